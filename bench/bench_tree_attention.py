"""tree_attention: eagle (C++ on CPU, Triton on GPU) vs what a user writes today with SDPA.

Providers:
- ``eagle``: ``eagle_kernels.tree_attention`` on the cache as it is (contiguous or paged).
- ``sdpa``: gather each request's cache to [B, Hkv, prefix + N, D], unpack the int64 tree mask
  into the equivalent boolean [B, 1, N, prefix + N] mask (prefix all visible), and call
  ``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` (GQA without
  materialising the expanded heads; the gather and mask build are timed, as a user pays them
  every step).

Shapes: CPU, SmolLM2-135M attention (Hq 9, Hkv 3, D 64) with N in {16, 60} tree nodes, prefix in
{512, 2048}, B in {1, 4}, plus B 1 with N in {1, 8} (a decoded token, the CPU default tree),
fp32, contiguous cache. GPU (only with a CUDA device), Llama-3-8B
(Hq 32, Hkv 8, D 128), N 64, prefix in {1k, 4k, 16k}, B in {1, 8, 32}, bf16, pages of 16.
Every request holds the same prefix (so SDPA needs no padding). Trees: random build_tree trees.

``extra_info``: ``kv_bytes`` = B * (prefix + N) * Hkv * D * 2 (K and V) * element size (the
K/V an attention pass must read) and ``kv_bytes_per_s`` over the mean time; the eagle entry
also gets ``ratio_eagle_over_sdpa`` once both providers ran for its shape.

Run: ``PYTHONPATH=. python -m pytest bench/bench_tree_attention.py --benchmark-only -q``
(``EAGLE_BENCH_THREADS=1`` pins the thread count), or ``python bench/bench_tree_attention.py``
for a compact side-by-side table at 1 and 2 threads.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import eagle_kernels
from eagle_kernels import reference

HAS_CUDA = torch.cuda.is_available()
CPU_SHAPES = [(B, N, prefix) for B in (1, 4) for N in (16, 60) for prefix in (512, 2048)]
# What CPU decoding runs: one token (plain decoding, the head's root) and the 8 rows of the
# CPU default tree's verify pass.
CPU_SHAPES += [(1, N, prefix) for N in (1, 8) for prefix in (512, 2048)]
CPU_HEADS = (9, 3, 64)
GPU_SHAPES = [(B, 64, prefix) for B in (1, 8, 32) for prefix in (1024, 4096, 16384)]
GPU_HEADS = (32, 8, 128)
_MEANS: dict = {}


def random_mask(B, N, seed):
    """A random EAGLE-2-like tree of N nodes per request (build_tree over a random history)."""
    gen = torch.Generator().manual_seed(seed)
    C = N + 16
    parents = torch.full((B, C), -1, dtype=torch.int32)
    scores = torch.zeros(B, C)
    scores[:, 0] = -torch.rand(B, generator=gen) - 1e-3
    for c in range(1, C):
        p = torch.randint(-1, c, (B,), generator=gen, dtype=torch.int32)
        parents[:, c] = p
        base = torch.where(p >= 0, scores.gather(1, p.clamp(min=0).long()[:, None])[:, 0], torch.zeros(B))
        scores[:, c] = base - torch.rand(B, generator=gen) - 1e-3
    tokens = torch.randint(0, 1000, (B, C), generator=gen)
    return reference.build_tree(torch.zeros(B, dtype=torch.int64), tokens, scores, parents, N).mask


@functools.lru_cache(maxsize=4)
def make_case(B, N, prefix, heads, dtype, page, device):
    Hq, Hkv, D = heads
    # Generated where they live (GPU caches reach gigabytes).
    gen = torch.Generator(device=device).manual_seed(B * 1000 + N + prefix)
    q = torch.randn(B, N, Hq, D, generator=gen, device=device).to(dtype)
    capacity = prefix + N
    if page is None:
        shape, table = (B, capacity, Hkv, D), None
    else:
        pages = math.ceil(capacity / page)
        shape = (B * pages, page, Hkv, D)
        table = torch.randperm(B * pages, generator=gen, device=device).view(B, pages).to(torch.int32)
    k = torch.randn(shape, generator=gen, device=device).to(dtype)
    v = torch.randn(shape, generator=gen, device=device).to(dtype)
    seqlens = torch.full((B,), prefix, dtype=torch.int32, device=device)
    mask = random_mask(B, N, prefix).to(device)
    return q, k, v, seqlens, mask, table


def sdpa_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table=None):
    """What a user writes today: gather, build the boolean mask, call SDPA with GQA."""
    B, N, Hq, D = q.shape
    prefix = int(cache_seqlens[0])  # equal lengths in this benchmark
    T = prefix + N
    if block_table is None:
        k, v = k_cache[:, :T], v_cache[:, :T]
    else:
        page = k_cache.shape[1]
        used = block_table[:, : math.ceil(T / page)].long()
        k = k_cache[used].flatten(1, 2)[:, :T]
        v = v_cache[used].flatten(1, 2)[:, :T]
    j = torch.arange(N, device=q.device)
    tree = ((tree_mask[:, :, j // 64] >> (j % 64)) & 1).bool()  # [B, N, N]
    visible = torch.cat([torch.ones(B, N, prefix, dtype=torch.bool, device=q.device), tree], dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=visible[:, None], enable_gqa=True)
    return out.transpose(1, 2)


def provider_fn(provider):
    if provider == "eagle":
        return eagle_kernels.tree_attention
    if provider == "sdpa":
        return sdpa_tree_attention
    raise ValueError(f"provider: expected eagle or sdpa, got {provider!r}")


def kv_bytes(B, N, prefix, heads, dtype):
    _, Hkv, D = heads
    return B * (prefix + N) * Hkv * D * 2 * torch.empty(0, dtype=dtype).element_size()


def _record(benchmark, key, provider, work):
    mean = benchmark.stats.stats.mean
    benchmark.extra_info.update(provider=provider, threads=torch.get_num_threads(), kv_bytes=work,
                                kv_bytes_per_s=work / mean)
    results = _MEANS.setdefault(key, {})
    results[provider] = mean
    if len(results) == 2:
        benchmark.extra_info["ratio_eagle_over_sdpa"] = results["eagle"] / results["sdpa"]


def _run(benchmark, provider, case, sync=None):
    fn = provider_fn(provider)
    q, k, v, seqlens, mask, table = case

    def call():
        fn(q, k, v, seqlens, mask, block_table=table)
        if sync is not None:
            sync()

    call()
    start = time.perf_counter()
    call()
    once = time.perf_counter() - start
    rounds = max(5, min(500, math.ceil(float(os.environ.get("EAGLE_BENCH_TIME_S", "0.25")) / max(once, 1e-7))))
    benchmark.pedantic(call, rounds=rounds, warmup_rounds=1)


@pytest.mark.parametrize("provider", ["sdpa", "eagle"])
@pytest.mark.parametrize("B,N,prefix", CPU_SHAPES, ids=[f"B{b}-N{n}-prefix{p}" for b, n, p in CPU_SHAPES])
def test_tree_attention_cpu(benchmark, provider, B, N, prefix):
    benchmark.group = f"tree_attention_cpu[B{B}-N{N}-prefix{prefix}]"
    case = make_case(B, N, prefix, CPU_HEADS, torch.float32, None, "cpu")
    _run(benchmark, provider, case)
    if benchmark.stats is not None:
        benchmark.extra_info["backend"] = (eagle_kernels.backend_of("tree_attention", "cpu") if provider == "eagle"
                                           else "sdpa")
        _record(benchmark, ("cpu", B, N, prefix), provider, kv_bytes(B, N, prefix, CPU_HEADS, torch.float32))


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("provider", ["sdpa", "eagle"])
@pytest.mark.parametrize("B,N,prefix", GPU_SHAPES, ids=[f"B{b}-N{n}-prefix{p}" for b, n, p in GPU_SHAPES])
def test_tree_attention_gpu(benchmark, provider, B, N, prefix):
    benchmark.group = f"tree_attention_gpu[B{B}-N{N}-prefix{prefix}]"
    case = make_case(B, N, prefix, GPU_HEADS, torch.bfloat16, 16, "cuda")
    _run(benchmark, provider, case, sync=torch.cuda.synchronize)
    if benchmark.stats is not None:
        benchmark.extra_info["backend"] = (eagle_kernels.backend_of("tree_attention", "cuda") if provider == "eagle"
                                           else "sdpa")
        _record(benchmark, ("gpu", B, N, prefix), provider, kv_bytes(B, N, prefix, GPU_HEADS, torch.bfloat16))


# SmolLM2-135M heads over a split prefix: a decoded token (the plain step) and a 61-node tree
# (the speculative verify pass), bf16, contiguous cache.
MERGE_SHAPES = [(1, N, prefix) for N in (1, 61) for prefix in (1024, 4096)]


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("B,N,prefix", MERGE_SHAPES, ids=[f"B{b}-N{n}-prefix{p}" for b, n, p in MERGE_SHAPES])
def test_tree_attention_merge_gpu(benchmark, B, N, prefix):
    """The flash-decoding splits merged by each block's last program (timed by the benchmark)
    or by a merge launch, both timed as replayed CUDA graphs, the way a decoding step runs them
    (``folds_merge`` picks one by the partials' bytes): the measurement that sets
    FOLD_MERGE_BYTES."""
    import triton.testing

    from eagle_kernels.triton.tree_attention import _launch

    benchmark.group = f"tree_attention_merge_gpu[B{B}-N{N}-prefix{prefix}]"
    q, k, v, seqlens, mask, table = make_case(B, N, prefix, CPU_HEADS, torch.bfloat16, None, "cuda")
    calls = {name: (lambda fold=fold: _launch(q, k, v, seqlens, mask, fold_merge=fold))
             for name, fold in (("fold", True), ("launch", False))}
    benchmark.pedantic(calls["fold"], rounds=20, warmup_rounds=2)
    graph = {name: triton.testing.do_bench_cudagraph(f, rep=20, return_mode="median") for name, f in calls.items()}
    benchmark.extra_info.update(provider="fold", graph_us_fold=graph["fold"] * 1e3,
                                graph_us_launch=graph["launch"] * 1e3,
                                ratio_fold_over_launch=graph["fold"] / graph["launch"])


# SmolLM2-135M's verify pass at B 1 over a short, a longer and a 4k cache (by the capacity rules
# 16-row blocks, then 32-row ones, at 4k folding 12 splits), against 128-row blocks (at 4k 16
# splits and a merge launch).
ROWS_SHAPES = [(1, 61, prefix) for prefix in (256, 1024, 4096)]


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("B,N,prefix", ROWS_SHAPES, ids=[f"B{b}-N{n}-prefix{p}" for b, n, p in ROWS_SHAPES])
def test_tree_attention_rows_gpu(benchmark, B, N, prefix):
    """The launcher's row blocks for few (request, KV head) pairs (``gpu_config`` with the
    capacity; timed by the benchmark) and the 128-row blocks it used before (``rows_for``'s), each
    with its own split count, as replayed CUDA graphs: the measurement behind FILL_SHARE and
    FOLD_KV_READ_BYTES."""
    import triton.testing

    from eagle_kernels.triton import tree_attention as ta

    benchmark.group = f"tree_attention_rows_gpu[B{B}-N{N}-prefix{prefix}]"
    q, k, v, seqlens, mask, table = make_case(B, N, prefix, CPU_HEADS, torch.bfloat16, None, "cuda")
    group = CPU_HEADS[0] // CPU_HEADS[1]
    configs = {"launcher": None,
               "rows128": ta.gpu_config(N, group, CPU_HEADS[2], torch.bfloat16, False, False, heads=B * CPU_HEADS[1])}
    calls = {name: (lambda c=c: ta._launch(q, k, v, seqlens, mask, config=c)) for name, c in configs.items()}
    benchmark.pedantic(calls["launcher"], rounds=20, warmup_rounds=2)
    graph = {name: triton.testing.do_bench_cudagraph(f, rep=20, return_mode="median") for name, f in calls.items()}
    benchmark.extra_info.update(provider="launcher", graph_us_launcher=graph["launcher"] * 1e3,
                                graph_us_rows128=graph["rows128"] * 1e3,
                                ratio_launcher_over_rows128=graph["launcher"] / graph["rows128"])


# ------------------------------------------------------------------ side-by-side table (main)
def _time(fn, case, sync=None, budget=0.5):
    q, k, v, seqlens, mask, table = case
    if sync is not None:  # CUDA: triton's do_bench (events, L2 flushed between runs), median
        import triton.testing

        return triton.testing.do_bench(lambda: fn(q, k, v, seqlens, mask, block_table=table),
                                       warmup=10, rep=50, return_mode="median") * 1e-3

    def call():
        fn(q, k, v, seqlens, mask, block_table=table)
        if sync is not None:
            sync()

    call()
    call()
    times = []
    deadline = time.perf_counter() + budget
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]  # median


def main(argv):
    device = "cuda" if "--gpu" in argv else "cpu"
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if device == "cpu":
        threads_list = [1, 2]
        shapes, heads, page_opts = CPU_SHAPES, CPU_HEADS, [None]
        dtype_names = [a for a in argv if a in dtypes] or ["fp32"]
        sync = None
    else:
        threads_list = [torch.get_num_threads()]
        shapes, heads, page_opts = GPU_SHAPES, GPU_HEADS, [16]
        dtype_names = ["bf16"]
        sync = torch.cuda.synchronize
    print(f"{'shape':<28} {'dtype':>5} {'thr':>3} {'eagle':>10} {'sdpa':>10} {'speedup':>8} {'eagle GB/s':>10}")
    for threads in threads_list:
        torch.set_num_threads(threads)
        for name in dtype_names:
            for page in page_opts:
                for B, N, prefix in shapes:
                    case = make_case(B, N, prefix, heads, dtypes[name], page, device)
                    te = _time(eagle_kernels.tree_attention, case, sync)
                    ts = _time(sdpa_tree_attention, case, sync)
                    gbs = kv_bytes(B, N, prefix, heads, dtypes[name]) / te / 1e9
                    print(f"B{B}-N{N}-prefix{prefix:<6} {name:>5} {threads:>3} {te * 1e3:8.3f}ms {ts * 1e3:8.3f}ms "
                          f"{ts / te:7.2f}x {gbs:10.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
