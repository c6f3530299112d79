"""rmsnorm: the decoder layer's RMSNorm (+ the residual copy) at SmolLM2-135M's and Llama-3-8B's
widths, bf16, for a decoding row (1), a verify tree (60) and a short prefill (512 rows); also
EAGLE-3's two-input form.

On CPU both providers run the reference (the op has no C++ kernel; its Triton kernel runs on
CUDA tensors, timed by bench/gpu_goals.py's kernels on a GPU). Throughput: bytes read and
written per second (x, weights, out, residual).

Run: ``PYTHONPATH=. python -m pytest bench/bench_rmsnorm.py --benchmark-only -q``.
"""

import functools

import pytest
import torch

DTYPE = torch.bfloat16


@functools.lru_cache(maxsize=4)
def make_case(rows, H, embed):
    gen = torch.Generator().manual_seed(rows + H)
    x = torch.randn(rows, H, generator=gen).to(DTYPE)
    weight = torch.randn(H, generator=gen).to(DTYPE)
    extra = {"embed": torch.randn(rows, H, generator=gen).to(DTYPE), "embed_weight": weight} if embed else {}
    return x, weight, extra


@pytest.mark.parametrize("embed", [False, True], ids=["plain", "eagle3"])
@pytest.mark.parametrize("H", [576, 4096], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("rows", [1, 60, 512], ids=lambda r: f"rows{r}")
def test_rmsnorm(measure, provider_op, rows, H, embed):
    fn, backend = provider_op("rmsnorm")
    x, weight, extra = make_case(rows, H, embed)
    moved = (rows * H * (4 if embed else 3) + H * (2 if embed else 1)) * x.element_size()
    measure(fn, x, weight, 1e-5, **extra, work=moved, unit="bytes", info={"backend": backend, "rows": rows, "H": H})
