"""verify: tree verification straight from the target logits, against the torch path.

Providers (side by side in one group per shape):
- ``eagle``: ``eagle_kernels.verify`` (the backend ``backend_of("verify", device)`` picks:
  ``cpp`` on CPU; on CUDA the C++/Triton path), recorded in ``extra_info["backend"]``.
- ``torch``: what a user would write without these kernels (``torch_path_verify`` below):
  the whole ``[B, N, V]`` logits tensor goes through the sampling pipeline in vectorised torch
  — temperature, top-k masking with ``torch.topk`` (the k-th value as threshold), softmax,
  top-p masking with ``sort`` + ``cumsum`` + ``scatter`` — and greedy rows through ``argmax``;
  then a host loop walks each tree with the residual rule (acceptance coins and the bonus
  from one ``torch.rand`` call and ``torch.multinomial``). It materialises the [B, N, V]
  probabilities; ``eagle`` reads only the rows its walk visits.

Trees: EAGLE-2 shaped, up to 6 levels below the root (``max_depth = 6``), the first nodes of
the levels forming a chain, each node's first child carrying its parent row's top token so
that walks go deep (greedy accepts the whole chain); logits ``3 * randn`` with that
token set to the row max + ``SPIKE`` (p about 0.97 at T = 0.8). Modes: ``greedy`` (T = 0),
``temp`` (T = 0.8, no filters: the cheapest torch sampling path), ``topkp`` (T = 0.8, top-k 50,
top-p 0.9), ``topp`` (T = 0.8, top-p 0.9 alone, the common serving default), ``draft`` (T = 0.8
with every draft node sampled from its parent's draft row, ``draft_probs = softmax(target row +
randn)``: the draft-aware rule of docs/ops.md §4) and ``draftd2t`` (the same over a draft
vocabulary of V / 4 ids mapped by ``d2t``), ``coupled`` (T = 0.8 with ``positions``: coupled sampling,
the exponential race over each visited row's whole vocabulary) and ``coupledtopp`` (the same with
top-p 0.9: the race over the nucleus's candidate list); ``greedyrows`` and ``temprows`` are
``greedy`` without a temperature and ``temp`` without the filter arguments (on a GPU the all-rows
kernels). These modes have no torch baseline here; their eagle entry records ``ratio_over_temp``,
its time over the ``temp`` mode's (``topp``'s for ``coupledtopp``, ``greedy``'s for ``greedyrows``).
``extra_info``:
``logits_bytes`` (B * N * V * element size, the input the op is given) and
``logits_bytes_per_s``; the eagle entry also gets ``speedup_over_torch``.

CPU: B in {1, 4}, N in {16, 60}, V = 49152, fp32 logits. CUDA (only with a device):
B in {1, 8, 32}, N = 64, V = 128256, bf16 logits. Thread count: ``EAGLE_BENCH_THREADS``.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

import eagle_kernels

BUDGET_S = float(os.environ.get("EAGLE_BENCH_TIME_S", "0.25"))
MAX_DEPTH = 6
MODES = {
    "greedy": dict(temperature=0.0, top_k=0, top_p=1.0),
    "temp": dict(temperature=0.8, top_k=0, top_p=1.0),
    "topkp": dict(temperature=0.8, top_k=50, top_p=0.9),
    "topp": dict(temperature=0.8, top_k=0, top_p=0.9),
    "draft": dict(temperature=0.8, top_k=0, top_p=1.0),
    "draftd2t": dict(temperature=0.8, top_k=0, top_p=1.0),
    "coupled": dict(temperature=0.8, top_k=0, top_p=1.0),
    "coupledtopp": dict(temperature=0.8, top_k=0, top_p=0.9),
    # Greedy without a temperature argument: on a GPU the all-rows kernel (verify_greedy.py).
    "greedyrows": dict(temperature=0.0, top_k=0, top_p=1.0),
    # A temperature and no filter arguments: on a GPU the all-rows kernel (verify_temperature.py).
    "temprows": dict(temperature=0.8, top_k=0, top_p=1.0),
}
# The mode each one without a torch baseline is timed against.
BASELINE_MODE = {"draft": "temp", "draftd2t": "temp", "coupled": "temp", "coupledtopp": "topp",
                 "greedyrows": "greedy", "temprows": "temp"}
SPIKE = 4.0  # the planted token's logit is the row max + SPIKE: p about 0.97 at T = 0.8
_MEANS: dict = {}


def make_inputs(B, N, V, mode, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    per_level = math.ceil((N - 1) / MAX_DEPTH) if N > 1 else 1
    parents = torch.full((B, N), -1, dtype=torch.int32)
    for i in range(1, N):
        level = (i - 1) // per_level + 1
        lo = 0 if level == 1 else 1 + (level - 2) * per_level
        hi = 1 if level == 1 else min(N, 1 + (level - 1) * per_level)
        if level >= 2 and i == 1 + (level - 1) * per_level:
            parents[:, i] = lo  # the first node of a level extends the first node of the last
        else:
            parents[:, i] = torch.randint(lo, hi, (B,), generator=gen, dtype=torch.int32)
    logits = torch.randn(B, N, V, generator=gen) * 3.0
    top = torch.randint(0, V, (B, N), generator=gen)
    logits.scatter_(2, top[..., None], logits.amax(-1, keepdim=True) + SPIKE)
    tokens = torch.randint(0, V, (B, N), generator=gen)
    for b in range(B):
        seen = set()
        for i in range(1, N):
            p = int(parents[b, i])
            if p not in seen:  # first child: the parent's top token
                tokens[b, i] = top[b, p]
                seen.add(p)
    p = MODES[mode]
    sampling = dict(temperature=torch.full((B,), p["temperature"]),
                    top_k=torch.full((B,), p["top_k"], dtype=torch.int32),
                    top_p=torch.full((B,), p["top_p"]), seed=torch.arange(B, dtype=torch.int64),
                    offset=torch.full((B,), 7, dtype=torch.int64))
    if mode == "greedyrows":
        sampling = {}
    if mode == "temprows":
        del sampling["top_k"], sampling["top_p"]
    if mode.startswith("coupled"):
        sampling["positions"] = torch.arange(B, dtype=torch.int64) * 1000 + 50
    if mode.startswith("draft"):
        # Draft rows near the target's; the tree's tokens stay the planted ones (distinct siblings,
        # each with r(x) > 0), so the walks go as deep as in the other modes.
        draft_logits = logits + torch.randn(B, N, V, generator=gen)
        if mode == "draftd2t":
            Vd = V // 4
            keep = torch.zeros(V, dtype=torch.bool)
            keep[tokens.flatten()] = True
            keep[top.flatten()] = True
            rest = torch.nonzero(~keep).flatten()
            extra = rest[torch.randperm(rest.numel(), generator=gen)[: max(0, Vd - int(keep.sum()))]]
            keep[extra] = True
            ids = torch.nonzero(keep).flatten()
            sampling.update(draft_probs=torch.softmax(draft_logits[..., ids], -1), d2t=ids - torch.arange(ids.numel()))
        else:
            sampling.update(draft_probs=torch.softmax(draft_logits, -1))
    to = dict(device=device)
    return (tokens.to(**to), parents.to(**to), logits.to(dtype=dtype, **to),
            {k: v.to(**to) for k, v in sampling.items()})


def torch_path_verify(tokens, parents, logits, *, max_depth, temperature, top_k, top_p, seed, offset):
    """The torch path (module docstring): vectorised filters over [B, N, V], host tree walk."""
    B, N, V = logits.shape
    x = logits.float()
    greedy = temperature == 0
    argmax = x.argmax(-1).tolist()
    probs = None
    if not bool(greedy.all()):
        t = torch.where(greedy, torch.ones_like(temperature), temperature)[:, None, None]
        scaled = (x - x.amax(-1, keepdim=True)) / t
        k_max = int(top_k.max())
        if k_max > 0:
            kth = torch.topk(scaled, k_max, dim=-1).values.gather(
                -1, (top_k.long() - 1).clamp(min=0)[:, None, None].expand(B, N, 1))
            scaled = scaled.masked_fill((top_k[:, None, None] > 0) & (scaled < kth), float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if bool((top_p < 1).any()):
            sorted_p, order = probs.sort(-1, descending=True)
            drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p[:, None, None]
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
            probs = probs / probs.sum(-1, keepdim=True)
    coins = torch.rand(B, N).tolist()
    tok, par = tokens.tolist(), parents.tolist()
    A = max_depth + 1
    accept_len = torch.zeros(B, dtype=torch.int32)
    accept_nodes = torch.full((B, A), -1, dtype=torch.int32)
    out_tokens = torch.full((B, A), -1, dtype=torch.int64)
    for b in range(B):
        children = [[] for _ in range(N)]
        for c in range(1, N):
            children[par[b][c]].append(c)
        path, emitted, node = [0], [], 0
        while True:
            kids = children[node] if len(path) <= max_depth else []
            child = None
            if bool(greedy[b]):
                child = next((c for c in kids if tok[b][c] == argmax[b][node]), None)
                if child is None:
                    emitted.append(argmax[b][node])
                    break
            else:
                w = probs[b, node]
                for c in kids:
                    wx = float(w[tok[b][c]])
                    if wx > 0 and coins[b][c] * float(w.sum()) < wx:
                        child = c
                        break
                    w = w.clone()
                    w[tok[b][c]] = 0
                if child is None:
                    emitted.append(int(torch.multinomial(w, 1)))
                    break
            path.append(child)
            emitted.append(tok[b][child])
            node = child
        accept_len[b] = len(path) - 1
        accept_nodes[b, :len(path)] = torch.tensor(path, dtype=torch.int32)
        out_tokens[b, :len(emitted)] = torch.tensor(emitted)
    return accept_len, accept_nodes, out_tokens


def _run(benchmark, request, provider, fn, args, kwargs, logits, device):
    shape = "-".join(p for p in request.node.callspec.id.split("-") if p not in ("torch", "eagle"))
    benchmark.group = f"verify[{shape}]"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call():
        fn(*args, **kwargs)
        sync()

    call()
    start = time.perf_counter()
    call()
    once = time.perf_counter() - start
    rounds = max(5, min(2000, math.ceil(BUDGET_S / max(once, 1e-7))))
    benchmark.pedantic(call, rounds=rounds, warmup_rounds=1)
    if benchmark.stats is None:
        return
    mean = benchmark.stats.stats.mean
    nbytes = logits.numel() * logits.element_size()
    backend = eagle_kernels.backend_of("verify", device) if provider == "eagle" else "torch"
    benchmark.extra_info.update(provider=provider, backend=backend, threads=torch.get_num_threads(),
                                logits_bytes=nbytes, logits_bytes_per_s=nbytes / mean)
    means = _MEANS.setdefault(shape, {})
    means[provider] = mean
    mode = next(p for p in request.node.callspec.id.split("-") if p in MODES)
    temp_shape = shape.replace(mode, BASELINE_MODE.get(mode, mode))
    if provider == "eagle" and temp_shape != shape and "eagle" in _MEANS.get(temp_shape, {}):
        ratio = mean / _MEANS[temp_shape]["eagle"]
        benchmark.extra_info["ratio_over_temp"] = ratio
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            temp_ms = _MEANS[temp_shape]["eagle"] * 1e3
            reporter.write_line(f"verify[{shape}] threads={torch.get_num_threads()} eagle ({backend}) "
                                f"{mean * 1e3:.3f} ms, {ratio:.2f}x the {BASELINE_MODE[mode]} mode's {temp_ms:.3f} ms")
    if provider == "eagle" and "torch" in means:
        benchmark.extra_info["speedup_over_torch"] = means["torch"] / mean
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"verify[{shape}] threads={torch.get_num_threads()} torch {means['torch'] * 1e3:.3f} ms, "
                f"eagle ({backend}) {mean * 1e3:.3f} ms, speedup {means['torch'] / mean:.1f}x")


@pytest.mark.parametrize("provider", ["torch", "eagle"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("N", [16, 60], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("B", [1, 4], ids=lambda b: f"B{b}")
def test_verify_cpu(benchmark, request, provider, B, N, mode):
    if provider == "torch" and mode in BASELINE_MODE:
        pytest.skip("no torch baseline of the draft-aware rule or coupled sampling")
    tokens, parents, logits, sampling = make_inputs(B, N, 49152, mode)
    fn = eagle_kernels.verify if provider == "eagle" else torch_path_verify
    _run(benchmark, request, provider, fn, (tokens, parents, logits), dict(max_depth=MAX_DEPTH, **sampling),
         logits, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("provider", ["torch", "eagle"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("B", [1, 8, 32], ids=lambda b: f"B{b}")
def test_verify_gpu(benchmark, request, provider, B, mode):
    if provider == "torch" and mode in BASELINE_MODE:
        pytest.skip("no torch baseline of the draft-aware rule or coupled sampling")
    tokens, parents, logits, sampling = make_inputs(B, 64, 128256, mode, torch.bfloat16, "cuda")
    fn = eagle_kernels.verify if provider == "eagle" else torch_path_verify
    _run(benchmark, request, provider, fn, (tokens, parents, logits), dict(max_depth=MAX_DEPTH, **sampling),
         logits, "cuda")
