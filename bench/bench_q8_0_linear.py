"""q8_0_linear: a draft head's GEMM over Q8_0 weights (int8 quants, fp16 block scales), bf16 rows, at a
Llama-3-8B-sized EAGLE-3 head's matrices and a draft pass's 8 rows.

On CPU both providers run the reference at a small shape (the op has no C++ kernel). On CUDA
(``test_q8_0_linear_gpu``) the Triton kernel runs beside the bf16 cuBLAS GEMM of the same matrix
(``torch.mm``; ``addmm_`` into the residual where the layer adds one), both timed as replayed CUDA
graphs (``triton.testing.do_bench_cudagraph``): ``extra_info["ratio_eagle_over_cublas"]`` is the 8-bit
kernel's time over cuBLAS's, ``eagle_gb_per_s`` the bytes it must read (weights, scales, rows) per
second. The decoding-step model charges these launches their bytes; the kernel model says they are
issue-bound at its fitted issue rate (docs/gpu_model.md, "An 8-bit head"): this measures which.

Run: ``PYTHONPATH=. python -m pytest bench/bench_q8_0_linear.py --benchmark-only -q``.
"""

import functools

import pytest
import torch

import eagle_kernels

HAS_CUDA = torch.cuda.is_available()
ROWS = 8
# (K, N, residual): gate/up (64-column blocks) and down into the residual (32-column blocks).
GPU_CASES = [(4096, 28672, False), (14336, 4096, True)]
GPU_IDS = ["gateup", "down-residual"]


@functools.lru_cache(maxsize=4)
def dense_case(K, N, residual, device="cpu"):
    """bf16 rows [8, K], a bf16 matrix [N, K] (N(0, 1 / K)), the residual [8, N] or None."""
    g = torch.Generator().manual_seed(K + N)
    x = torch.randn(ROWS, K, generator=g).to(torch.bfloat16)
    weight = (torch.randn(N, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    add = torch.randn(ROWS, N, generator=g).to(torch.bfloat16) if residual else None
    return x.to(device), weight.to(device), None if add is None else add.to(device)


@functools.lru_cache(maxsize=4)
def q8_case(K, N, residual, device="cpu"):
    from eagle_kernels.reference.cpu_linear import quantize
    from eagle_kernels.reference.q8_0_linear import split_q8_0

    x, weight, add = dense_case(K, N, residual)
    quants, scales = split_q8_0(quantize(weight.float(), "q8_0"))
    return x.to(device), quants.to(device), scales.to(device), None if add is None else add.to(device)


def bench_beside_cublas(benchmark, op_name, provider, run_8bit, weight_bytes, K, N, residual):
    """Benchmark ``run_8bit`` (provider "eagle") or the bf16 cuBLAS GEMM of the same matrix, then record both
    as replayed graphs with their ratio and the 8-bit kernel's bytes per second."""
    import triton.testing

    benchmark.group = f"{op_name}_gpu[{K}-{N}]"
    x, weight, add = dense_case(K, N, residual, "cuda")
    accumulator = None if add is None else add.clone()  # what the layer path adds into in place

    def cublas():
        return torch.mm(x, weight.t()) if accumulator is None else accumulator.addmm_(x, weight.t())

    benchmark(run_8bit if provider == "eagle" else cublas)
    if benchmark.stats is None:
        return
    ms = {name: triton.testing.do_bench_cudagraph(f, rep=20, return_mode="median")
          for name, f in (("eagle", run_8bit), ("cublas", cublas))}
    moved = weight_bytes + x.numel() * 2 + ROWS * N * 2 * (2 if residual else 1)
    benchmark.extra_info.update(backend=eagle_kernels.backend_of(op_name, "cuda"), graph_us_eagle=ms["eagle"] * 1e3,
                                graph_us_cublas=ms["cublas"] * 1e3, ratio_eagle_over_cublas=ms["eagle"] / ms["cublas"],
                                eagle_gb_per_s=moved / (ms["eagle"] * 1e-3) / 1e9, K=K, N=N)


def test_q8_0_linear(measure, provider_op):
    fn, backend = provider_op("q8_0_linear")
    x, quants, scales, _ = q8_case(256, 96, False)
    measure(fn, x, quants, scales, work=quants.numel() * 17 // 16, unit="bytes", info={"backend": backend})


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("provider", ["cublas", "eagle"])
@pytest.mark.parametrize("K,N,residual", GPU_CASES, ids=GPU_IDS)
def test_q8_0_linear_gpu(benchmark, provider, K, N, residual):
    x, quants, scales, add = q8_case(K, N, residual, "cuda")

    def eagle():
        return eagle_kernels.q8_0_linear(x, quants, scales, residual=add)

    bench_beside_cublas(benchmark, "q8_0_linear", provider, eagle, quants.numel() * 17 // 16, K, N, residual)
