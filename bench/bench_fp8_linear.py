"""fp8_linear: a draft head's GEMM over fp8 (e4m3) weights with per-channel scales, the bf16 rows rounded to
fp8 once by a launch of their own (or in every program of the GEMM: the ``graph_us_eagle_rounded_in_programs``
record), at a Llama-3-8B-sized EAGLE-3 head's matrices and a draft pass's 8 rows; beside the bf16 cuBLAS GEMM of
the same matrix, as bench_q8_0_linear.py does for q8_0_linear (the same cases and records).

Run: ``PYTHONPATH=. python -m pytest bench/bench_fp8_linear.py --benchmark-only -q``.
"""

import functools

import pytest
from bench_q8_0_linear import GPU_CASES, GPU_IDS, HAS_CUDA, bench_beside_cublas, dense_case

import eagle_kernels


@functools.lru_cache(maxsize=4)
def fp8_case(K, N, residual, device="cpu"):
    from eagle_kernels.reference.fp8_linear import quantize_fp8

    x, weight, add = dense_case(K, N, residual)
    weight8, scale = quantize_fp8(weight)
    return x.to(device), weight8.to(device), scale.to(device), None if add is None else add.to(device)


def test_fp8_linear(measure, provider_op):
    fn, backend = provider_op("fp8_linear")
    x, weight, scale, _ = fp8_case(256, 96, False)
    measure(fn, x, weight, scale, work=weight.numel(), unit="bytes", info={"backend": backend})


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("provider", ["cublas", "eagle"])
@pytest.mark.parametrize("K,N,residual", GPU_CASES, ids=GPU_IDS)
def test_fp8_linear_gpu(benchmark, provider, K, N, residual):
    x, weight8, scale, add = fp8_case(K, N, residual, "cuda")

    def eagle():
        return eagle_kernels.fp8_linear(x, weight8, scale, residual=add)

    bench_beside_cublas(benchmark, "fp8_linear", provider, eagle, weight8.numel() + N * 4, K, N, residual)
    if benchmark.stats is not None and provider == "eagle":
        import triton.testing

        from eagle_kernels.triton import fp8_linear as triton_fp8_linear

        def rounded_in_programs():
            return triton_fp8_linear.fp8_linear(x, weight8, scale, residual=add, _round_first=False)

        us = triton.testing.do_bench_cudagraph(rounded_in_programs, rep=20, return_mode="median") * 1e3
        benchmark.extra_info.update(graph_us_eagle_rounded_in_programs=us,
                                    ratio_rounded_in_programs_over_eagle=us / benchmark.extra_info["graph_us_eagle"])
