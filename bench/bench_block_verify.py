"""block_verify: a sampled chain verified as one block (docs/ops.md §21).

Two comparisons, each side by side in one pytest-benchmark group per shape:

- ``test_block_verify_cpu``: ``eagle_kernels.block_verify`` (the backend ``backend_of`` picks)
  against the reference (``bench/conftest.py``'s ``measure``: the eagle / reference ratio table);
- ``test_chain_rules_cpu`` / ``_gpu``: on the same chain, ``block_verify`` against ``verify``'s
  draft-by-draft rule (docs/ops.md §4, the draft rows given). The block reads every row of its
  chain; verify stops at its first rejection, so with these random logits (most first drafts
  rejected) it reads about one row: the ratio is the block's extra cost where verify is cheapest.

Chains: ``G`` drafts drawn from softmax draft rows over a draft vocabulary of ``Vd`` ids mapped
by ``d2t`` (SmolLM2's 8,192 of 49,152 on the CPU, fp32 logits; a Llama-3-8B-shaped head's 32,000
of 128,256 on CUDA, bf16), T 1. ``extra_info``: ``logits_bytes`` (the chain's rows) per second.
What the block gains in tau: ``bench/block_gain.py``.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

import eagle_kernels

BUDGET_S = float(os.environ.get("EAGLE_BENCH_TIME_S", "0.25"))


def chain_inputs(B, G, V, Vd, dtype=torch.float32, device="cpu"):
    """(tokens, logits, draft_probs, d2t, sampling) of ``B`` chains of ``G`` sampled drafts."""
    g = torch.Generator().manual_seed(5)
    N = G + 1
    logits = (torch.randn(B, N, V, generator=g) * 3).to(dtype)
    q = torch.softmax(torch.randn(B, N, Vd, generator=g) * 3, -1)
    d2t = torch.randperm(V, generator=g)[:Vd].sort().values - torch.arange(Vd)
    draws = torch.multinomial(q.reshape(-1, Vd), 1, generator=g).reshape(B, N)
    tokens = torch.zeros(B, N, dtype=torch.int64)
    tokens[:, 1:] = (draws + d2t[draws])[:, :-1]
    sampling = dict(temperature=torch.ones(B), seed=torch.arange(B), offset=torch.zeros(B, dtype=torch.int64))
    move = lambda t: t.to(device)  # noqa: E731
    return move(tokens), move(logits), move(q), move(d2t), {k: move(v) for k, v in sampling.items()}


@pytest.mark.parametrize("G", [3, 5], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("B", [1, 4], ids=lambda b: f"B{b}")
def test_block_verify_cpu(measure, provider_op, B, G):
    tokens, logits, q, d2t, sampling = chain_inputs(B, G, 49152, 8192)
    fn, backend = provider_op("block_verify")
    measure(fn, tokens, logits, q, work=logits.numel() * logits.element_size(), unit="logits_bytes",
            info={"backend": backend}, d2t=d2t, **sampling)


def _rule_call(rule, tokens, logits, q, d2t, sampling):
    if rule == "block_verify":
        return lambda: eagle_kernels.block_verify(tokens, logits, q, d2t=d2t, **sampling)
    B, N = tokens.shape
    parents = torch.arange(-1, N - 1, dtype=torch.int32, device=tokens.device).expand(B, N).contiguous()
    return lambda: eagle_kernels.verify(tokens, parents, logits, max_depth=N - 1, draft_probs=q, d2t=d2t, **sampling)


def _time_rule(benchmark, rule, inputs, device):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn = _rule_call(rule, *inputs)

    def call():
        fn()
        sync()

    call()
    start = time.perf_counter()
    call()
    rounds = max(5, min(2000, math.ceil(BUDGET_S / max(time.perf_counter() - start, 1e-7))))
    benchmark.pedantic(call, rounds=rounds, warmup_rounds=1)
    logits = inputs[1]
    if benchmark.stats is not None:
        nbytes = logits.numel() * logits.element_size()
        benchmark.extra_info.update(rule=rule, backend=eagle_kernels.backend_of(rule, device),
                                    threads=torch.get_num_threads(), logits_bytes=nbytes,
                                    logits_bytes_per_s=nbytes / benchmark.stats.stats.mean)


@pytest.mark.parametrize("rule", ["verify", "block_verify"])
@pytest.mark.parametrize("G", [3, 5], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("B", [1, 4], ids=lambda b: f"B{b}")
def test_chain_rules_cpu(benchmark, rule, B, G):
    benchmark.group = f"chain_rules_cpu[B{B}-G{G}]"
    _time_rule(benchmark, rule, chain_inputs(B, G, 49152, 8192), "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("rule", ["verify", "block_verify"])
@pytest.mark.parametrize("B", [1, 8], ids=lambda b: f"B{b}")
def test_chain_rules_gpu(benchmark, rule, B):
    benchmark.group = f"chain_rules_gpu[B{B}-G5]"
    _time_rule(benchmark, rule, chain_inputs(B, 5, 128256, 32000, torch.bfloat16, "cuda"), "cuda")
