"""o_proj_mlp: a decoder layer after its attention (the o projection into the residual, the norm,
gate/up with SwiGLU, the down projection into the residual) in one launch, bf16, at SmolLM2-135M's
widths (H 576, I 1536) for a decoding row and a verify tree (61 rows).

On CPU both providers run the reference (the op has no C++ kernel). On CUDA
(``test_o_proj_mlp_gpu``) the one launch runs beside the three ``rmsnorm_linear`` launches it
replaces (what the GPU layer path launches with ``O_PROJ_MLP_IN_ONE_LAUNCH`` off), both as replayed
CUDA graphs (``triton.testing.do_bench_cudagraph``), as a decoding step replays them;
``extra_info["ratio_eagle_over_unfused"]`` is the one launch's time over the three's. The two give
the same bits (python_tests/ops/test_layer_ops.py), so this is the price of the phases' hand-offs
inside one launch against two launch boundaries.

Run: ``PYTHONPATH=. python -m pytest bench/bench_o_proj_mlp.py --benchmark-only -q``.
"""

import functools

import pytest
import torch

import eagle_kernels

DTYPE = torch.bfloat16
HAS_CUDA = torch.cuda.is_available()
ROWS = [1, 61]


@functools.lru_cache(maxsize=4)
def make_case(rows, device="cpu"):
    g = torch.Generator().manual_seed(rows)
    tensors = (torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g),
               torch.randn(576, 576, generator=g) / 24, 1 + 0.1 * torch.randn(576, generator=g),
               torch.randn(3072, 576, generator=g) / 24, torch.randn(576, 1536, generator=g) / 1536 ** 0.5)
    return tuple(t.to(DTYPE).to(device) for t in tensors)


def three_launches(attention, residual, o_weight, norm_weight, gate_up, down, eps):
    """What the GPU layer path launches without o_proj_mlp: three rmsnorm_linear launches."""
    mid, _ = eagle_kernels.rmsnorm_linear(attention, o_weight, None, eps, add=residual)
    act, _ = eagle_kernels.rmsnorm_linear(mid, gate_up, norm_weight, eps, gated=True)
    return eagle_kernels.rmsnorm_linear(act, down, None, eps, add=mid)[0]


@pytest.mark.parametrize("rows", ROWS, ids=[f"rows{r}" for r in ROWS])
def test_o_proj_mlp(measure, provider_op, rows):
    fn, backend = provider_op("o_proj_mlp")
    args = make_case(rows)
    weights = sum(t.numel() for t in args[2:]) * 2
    measure(fn, *args, 1e-5, work=weights + 3 * args[0].numel() * 2, unit="bytes",
            info={"backend": backend, "rows": rows})


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("provider", ["unfused", "eagle"])
@pytest.mark.parametrize("rows", ROWS, ids=[f"rows{r}" for r in ROWS])
def test_o_proj_mlp_gpu(benchmark, provider, rows):
    import triton.testing

    benchmark.group = f"o_proj_mlp_gpu[{rows}]"
    args = (*make_case(rows, "cuda"), 1e-5)
    fn = eagle_kernels.o_proj_mlp if provider == "eagle" else three_launches
    benchmark(lambda: fn(*args))
    if benchmark.stats is None:
        return
    graph = {name: triton.testing.do_bench_cudagraph(lambda f=f: f(*args), rep=20, return_mode="median")
             for name, f in (("eagle", eagle_kernels.o_proj_mlp), ("unfused", three_launches))}
    benchmark.extra_info.update(backend=eagle_kernels.backend_of("o_proj_mlp", "cuda"),
                                graph_us_eagle=graph["eagle"] * 1e3, graph_us_unfused=graph["unfused"] * 1e3,
                                ratio_eagle_over_unfused=graph["eagle"] / graph["unfused"])
