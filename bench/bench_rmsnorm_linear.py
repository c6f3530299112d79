"""rmsnorm_linear: a norm, the GEMM after it and (gated) SwiGLU in one launch, bf16, at SmolLM2-135M's
widths (K 576; q/k/v 960, gate/up 2 x 1536) for a decoding row and a verify tree (61 rows); and
rmsnorm_qkv_rope (the q/k/v GEMM with RoPE and the KV write in its epilogue) at the same rows, on
CUDA only, beside ``rmsnorm``, cuBLAS and ``rope_write_kv``.

On CPU both providers run the reference (the op has no C++ kernel). On CUDA
(``test_rmsnorm_linear_gpu``) the Triton kernel runs beside what the GPU layer path launches
without it: the ``rmsnorm`` op, a cuBLAS GEMM and (gated) ``silu_mul``. Both are timed as
replayed CUDA graphs (``triton.testing.do_bench_cudagraph``), as a decoding step replays them;
``extra_info["ratio_eagle_over_unfused"]`` is the fused time over the unfused sequence's.

Run: ``PYTHONPATH=. python -m pytest bench/bench_rmsnorm_linear.py --benchmark-only -q``.
"""

import functools

import pytest
import torch

import eagle_kernels

DTYPE = torch.bfloat16
HAS_CUDA = torch.cuda.is_available()
CASES = [(1, 960, False), (61, 960, False), (1, 1536, True), (61, 1536, True)]
IDS = [f"rows{r}-{'gateup' if g else 'qkv'}" for r, _, g in CASES]


@functools.lru_cache(maxsize=4)
def make_case(rows, N, gated, device="cpu"):
    g = torch.Generator().manual_seed(rows + N)
    x = torch.randn(rows, 576, generator=g).to(DTYPE)
    weight = (torch.randn(2 * N if gated else N, 576, generator=g) / 24).to(DTYPE)
    norm_weight = (1 + 0.1 * torch.randn(576, generator=g)).to(DTYPE)
    return x.to(device), weight.to(device), norm_weight.to(device)


def unfused(x, weight, norm_weight, eps, *, gated=False):
    """What the GPU layer path launches without rmsnorm_linear: norm (with the copy), GEMM, SwiGLU."""
    h, residual = eagle_kernels.rmsnorm(x, norm_weight, eps)
    y = torch.mm(h, weight.t())
    return (eagle_kernels.silu_mul(y) if gated else y), residual


@pytest.mark.parametrize("rows,N,gated", CASES, ids=IDS)
def test_rmsnorm_linear(measure, provider_op, rows, N, gated):
    fn, backend = provider_op("rmsnorm_linear")
    x, weight, norm_weight = make_case(rows, N, gated)
    measure(fn, x, weight, norm_weight, 1e-5, gated=gated, work=(weight.numel() + 2 * x.numel()) * 2, unit="bytes",
            info={"backend": backend, "rows": rows, "N": N, "gated": gated})


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("provider", ["unfused", "eagle"])
@pytest.mark.parametrize("rows,N,gated", CASES, ids=IDS)
def test_rmsnorm_linear_gpu(benchmark, provider, rows, N, gated):
    import triton.testing

    benchmark.group = f"rmsnorm_linear_gpu[{rows}-{N}-{gated}]"
    x, weight, norm_weight = make_case(rows, N, gated, "cuda")
    fn = eagle_kernels.rmsnorm_linear if provider == "eagle" else unfused
    benchmark(lambda: fn(x, weight, norm_weight, 1e-5, gated=gated))
    if benchmark.stats is None:
        return
    graph = {name: triton.testing.do_bench_cudagraph(lambda f=f: f(x, weight, norm_weight, 1e-5, gated=gated),
                                                     rep=20, return_mode="median")
             for name, f in (("eagle", eagle_kernels.rmsnorm_linear), ("unfused", unfused))}
    benchmark.extra_info.update(backend=eagle_kernels.backend_of("rmsnorm_linear", "cuda"),
                                graph_us_eagle=graph["eagle"] * 1e3, graph_us_unfused=graph["unfused"] * 1e3,
                                ratio_eagle_over_unfused=graph["eagle"] / graph["unfused"])


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("provider", ["unfused", "eagle"])
@pytest.mark.parametrize("rows", [1, 61], ids=["rows1", "rows61"])
def test_rmsnorm_qkv_rope_gpu(benchmark, provider, rows):
    import triton.testing

    benchmark.group = f"rmsnorm_qkv_rope_gpu[{rows}]"
    x, weight, norm_weight = make_case(rows, 960, False, "cuda")
    x = x.view(1, rows, 576)
    angles = torch.arange(256, dtype=torch.float64)[:, None] / 1e5 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    cos, sin = angles.cos().float().cuda(), angles.sin().float().cuda()
    positions = torch.arange(100, 100 + rows, device="cuda")[None]
    k_cache, v_cache = (torch.zeros(1, 256, 3, 64, dtype=DTYPE, device="cuda") for _ in range(2))
    seqlens = torch.full((1,), 100, dtype=torch.int32, device="cuda")

    def fused():
        return eagle_kernels.rmsnorm_qkv_rope(x, weight, norm_weight, 1e-5, positions, cos, sin, k_cache, v_cache,
                                              seqlens, num_heads=9)

    def apart():
        h, residual = eagle_kernels.rmsnorm(x, norm_weight, 1e-5)
        qkv = torch.mm(h.view(rows, 576), weight.t()).view(1, rows, -1)
        return eagle_kernels.rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, seqlens, num_heads=9), residual

    benchmark(fused if provider == "eagle" else apart)
    if benchmark.stats is None:
        return
    graph = {name: triton.testing.do_bench_cudagraph(f, rep=20, return_mode="median")
             for name, f in (("eagle", fused), ("unfused", apart))}
    benchmark.extra_info.update(backend=eagle_kernels.backend_of("rmsnorm_qkv_rope", "cuda"),
                                graph_us_eagle=graph["eagle"] * 1e3, graph_us_unfused=graph["unfused"] * 1e3,
                                ratio_eagle_over_unfused=graph["eagle"] / graph["unfused"])

