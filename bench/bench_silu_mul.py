"""silu_mul: the SwiGLU activation of a fused gate/up projection, bf16, at SmolLM2-135M's
intermediate size (1536) and Llama-3-8B's (14336), for a decoding row, a verify tree (60 rows)
and a short prefill (512 rows).

On CPU both providers run the reference (the op has no C++ kernel; its Triton kernel runs on
CUDA tensors). Throughput: bytes read and written per second.

Run: ``PYTHONPATH=. python -m pytest bench/bench_silu_mul.py --benchmark-only -q``.
"""

import functools

import pytest
import torch

DTYPE = torch.bfloat16


@functools.lru_cache(maxsize=2)
def make_case(rows, I):
    return torch.randn(rows, 2 * I, generator=torch.Generator().manual_seed(rows)).to(DTYPE)


@pytest.mark.parametrize("I", [1536, 14336], ids=lambda i: f"I{i}")
@pytest.mark.parametrize("rows", [1, 60, 512], ids=lambda r: f"rows{r}")
def test_silu_mul(measure, provider_op, rows, I):
    fn, backend = provider_op("silu_mul")
    gate_up = make_case(rows, I)
    measure(fn, gate_up, work=rows * 3 * I * gate_up.element_size(), unit="bytes",
            info={"backend": backend, "rows": rows, "I": I})
