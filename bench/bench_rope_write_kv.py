"""rope_write_kv: RoPE on q and k and the K/V cache write of one layer, bf16, at SmolLM2-135M's
heads (9 q / 3 kv, D 64) and Llama-3-8B's (32 q / 8 kv, D 128), for a decoding token (N 1), a
verify tree (N 60) and a drafting pass at a slot offset (N 8 after 40 earlier tree slots).

On CPU both providers run the reference (the op has no C++ kernel; its Triton kernel runs on
CUDA tensors). Throughput: bytes read and written per second (qkv, the cos/sin rows, q, the
cache rows).

Run: ``PYTHONPATH=. python -m pytest bench/bench_rope_write_kv.py --benchmark-only -q``.
"""

import functools

import pytest
import torch

DTYPE = torch.bfloat16
HEADS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}
S = 1024


@functools.lru_cache(maxsize=2)
def make_case(model, N, slot_offset):
    Hq, Hkv, D = HEADS[model]
    gen = torch.Generator().manual_seed(N)
    qkv = torch.randn(1, N, (Hq + 2 * Hkv) * D, generator=gen).to(DTYPE)
    positions = torch.arange(500, 500 + N)[None]
    angles = torch.arange(S, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    k_cache = torch.zeros(1, S, Hkv, D, dtype=DTYPE)
    v_cache = torch.zeros(1, S, Hkv, D, dtype=DTYPE)
    seqlens = torch.tensor([500], dtype=torch.int32)
    return (qkv, positions, angles.cos().float(), angles.sin().float(), k_cache, v_cache, seqlens), Hq


@pytest.mark.parametrize("N,slot_offset", [(1, 0), (60, 0), (8, 40)], ids=["N1", "N60", "N8-offset40"])
@pytest.mark.parametrize("model", list(HEADS), ids=list(HEADS))
def test_rope_write_kv(measure, provider_op, model, N, slot_offset):
    fn, backend = provider_op("rope_write_kv")
    args, Hq = make_case(model, N, slot_offset)
    Hkv, D = args[4].shape[2:]
    moved = (N * (Hq + 2 * Hkv) * D + (slot_offset + N) * Hq * D + N * 2 * Hkv * D) * 2 + N * D * 4
    measure(fn, *args, num_heads=Hq, slot_offset=slot_offset, work=moved, unit="bytes",
            info={"backend": backend, "N": N})
