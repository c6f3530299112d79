"""compact_kv: commit a 6-token accepted path in a SmolLM2-135M-like KV cache, all layers.

Cache: L = 30 layers, S = 2048 positions, Hkv = 3, D = 64, bf16; contiguous [L, B, S, Hkv, D]
or paged [L, P, 16, Hkv, D] with a shuffled block table. Each request sits at a different
committed length and accepts 6 draft nodes of a 60-node tree.

Throughput: bytes actually moved per second, L * sum(accept_len) * 2 (K and V) * 2 (read and
write) * Hkv * D * 2 bytes, over the mean time.
"""

import functools

import pytest
import torch

L, S, HKV, D, PAGE = 30, 2048, 3, 64, 16
DTYPE = torch.bfloat16
ACCEPT_LEN = 6
TREE_NODES = 60


@functools.lru_cache(maxsize=2)
def make_case(B, paged):
    gen = torch.Generator().manual_seed(B)
    if paged:
        pages = S // PAGE
        shape = (L, B * pages, PAGE, HKV, D)
        block_table = torch.randperm(B * pages, generator=gen).view(B, pages).to(torch.int32)
    else:
        shape = (L, B, S, HKV, D)
        block_table = None
    k_cache = torch.empty(shape, dtype=DTYPE).uniform_(-1, 1, generator=gen)
    v_cache = torch.empty(shape, dtype=DTYPE).uniform_(-1, 1, generator=gen)
    cache_seqlens = torch.tensor([1000 + 137 * b for b in range(B)], dtype=torch.int32)
    nodes = [sorted(torch.randperm(TREE_NODES - 1, generator=gen)[:ACCEPT_LEN].add(1).tolist()) for _ in range(B)]
    accept_nodes = torch.tensor([[0] + n for n in nodes], dtype=torch.int32)
    accept_len = torch.full((B,), ACCEPT_LEN, dtype=torch.int32)
    return k_cache, v_cache, cache_seqlens, accept_nodes, accept_len, block_table


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("B", [1, 4], ids=lambda b: f"B{b}")
def test_compact_kv(measure, provider_op, B, paged):
    fn, backend = provider_op("compact_kv")
    k_cache, v_cache, seqlens, accept_nodes, accept_len, block_table = make_case(B, paged)
    moved = L * int(accept_len.sum()) * 2 * 2 * HKV * D * k_cache.element_size()
    # Repeating the same compaction moves the same bytes each round: the op is idempotent in cost.
    measure(fn, k_cache, v_cache, seqlens, accept_nodes, accept_len, block_table=block_table,
            work=moved, unit="bytes", info={"backend": backend, "B": B, "layout": "paged" if paged else "contiguous"})
