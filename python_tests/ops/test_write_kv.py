"""write_kv: every backend against the reference, and against positions computed by hand."""

import math

import pytest
import torch

from eagle_kernels import reference

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PAGE = 16


def make_case(B, N, Hkv, D, dtype, paged, seed, prefix=(5, 37, 0)):
    gen = torch.Generator().manual_seed(seed)
    seqlens = torch.tensor([prefix[b % len(prefix)] for b in range(B)], dtype=torch.int32)
    capacity = int(seqlens.max()) + N + 3
    if paged:
        pages = math.ceil(capacity / PAGE)
        pool = B * pages + 2
        shape = (pool, PAGE, Hkv, D)
        table = torch.randperm(pool, generator=gen)[: B * pages].view(B, pages).to(torch.int32)
    else:
        shape = (B, capacity, Hkv, D)
        table = None
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_new = torch.randn(B, N, Hkv, D, generator=gen).to(dtype)
    v_new = torch.randn(B, N, Hkv, D, generator=gen).to(dtype)
    return k_cache, v_cache, k_new, v_new, seqlens, table


def expected(k_cache, v_cache, k_new, v_new, seqlens, table):
    """Caches after the write, computed position by position (not with the reference)."""
    k_want, v_want = k_cache.clone(), v_cache.clone()
    B, N = k_new.shape[:2]
    for b in range(B):
        for i in range(N):
            t = int(seqlens[b]) + i
            idx = (b, t) if table is None else (int(table[b, t // PAGE]), t % PAGE)
            k_want[idx] = k_new[b, i]
            v_want[idx] = v_new[b, i]
    return k_want, v_want


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("B,N,Hkv,D", [(1, 1, 1, 64), (3, 7, 3, 64), (2, 65, 2, 128), (2, 20, 8, 40)],
                         ids=["B1-N1", "B3-N7-Hkv3", "B2-N65-D128", "B2-N20-Hkv8-D40"])
def test_write_matches_positions(backend, op_impl, B, N, Hkv, D, dtype, paged):
    fn = op_impl("write_kv")
    k_cache, v_cache, k_new, v_new, seqlens, table = make_case(B, N, Hkv, D, dtype, paged, seed=N + D)
    k_want, v_want = expected(k_cache, v_cache, k_new, v_new, seqlens, table)
    assert fn(k_cache, v_cache, k_new, v_new, seqlens, block_table=table) is None
    torch.testing.assert_close(k_cache, k_want, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_want, rtol=0, atol=0)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_matches_reference_with_strided_new(backend, op_impl, paged):
    """k_new/v_new as non-contiguous views (a transposed projection output)."""
    fn = op_impl("write_kv")
    k_cache, v_cache, k_new, v_new, seqlens, table = make_case(2, 9, 3, 64, torch.float32, paged, seed=4)
    k_view = k_new.transpose(1, 2).contiguous().transpose(1, 2)
    v_view = v_new.transpose(1, 2).contiguous().transpose(1, 2)
    assert not k_view.is_contiguous()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k_ref, v_ref, k_new, v_new, seqlens, block_table=table)
    fn(k_cache, v_cache, k_view, v_view, seqlens, block_table=table)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0)


def test_write_then_tree_attention_reads_the_new_tokens(backend, op_impl):
    """A verify step's K/V, written by write_kv, is what tree_attention attends to."""
    write, attend = op_impl("write_kv"), op_impl("tree_attention")
    B, N, Hq, Hkv, D = 2, 7, 6, 3, 64
    k_cache, v_cache, k_new, v_new, seqlens, table = make_case(B, N, Hkv, D, torch.float32, True, seed=11)
    q = torch.randn(B, N, Hq, D, generator=torch.Generator().manual_seed(1))
    write(k_cache, v_cache, k_new, v_new, seqlens, block_table=table)
    got = attend(q, k_cache, v_cache, seqlens, None, block_table=table)
    want = reference.tree_attention(q, k_cache, v_cache, seqlens, None, block_table=table)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The last node sees its own new key: changing it changes that node's output only.
    k_new[:, -1] += 1.0
    write(k_cache, v_cache, k_new, v_new, seqlens, block_table=table)
    moved = attend(q, k_cache, v_cache, seqlens, None, block_table=table)
    torch.testing.assert_close(moved[:, :-1], got[:, :-1], atol=1e-5, rtol=1e-5)
    assert float((moved[:, -1] - got[:, -1]).abs().max()) > 1e-3


@pytest.mark.parametrize("case,name", [
    ("new_rank", "k_new"),
    ("v_new_shape", "v_new"),
    ("v_new_dtype", "v_new"),
    ("cache_dtype", "k_cache"),
    ("cache_heads", "k_cache"),
    ("cache_head_dim", "k_cache"),
    ("v_cache_shape", "v_cache"),
    ("cache_batch", "k_cache"),
    ("seqlens_dtype", "cache_seqlens"),
    ("seqlens_shape", "cache_seqlens"),
    ("seqlens_beyond_cache", "cache_seqlens"),
    ("seqlens_negative", "cache_seqlens"),
    ("seqlens_beyond_pages", "cache_seqlens"),
    ("block_table_dtype", "block_table"),
    ("block_table_page_id", "block_table"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_input(backend, op_impl, case, name):
    fn = op_impl("write_kv")
    paged = case in ("seqlens_beyond_pages", "block_table_dtype", "block_table_page_id")
    k_cache, v_cache, k_new, v_new, seqlens, table = make_case(2, 5, 3, 16, torch.float32, paged, seed=0)
    if case == "new_rank":
        k_new = k_new[0]
    elif case == "v_new_shape":
        v_new = v_new[:, :-1]
    elif case == "v_new_dtype":
        v_new = v_new.half()
    elif case == "cache_dtype":
        k_cache, v_cache = k_cache.half(), v_cache.half()
    elif case == "cache_heads":
        k_cache, v_cache = k_cache[:, :, :2].contiguous(), v_cache[:, :, :2].contiguous()
    elif case == "cache_head_dim":
        k_cache, v_cache = k_cache[..., :8].contiguous(), v_cache[..., :8].contiguous()
    elif case == "v_cache_shape":
        v_cache = v_cache[:, :-1].contiguous()
    elif case == "cache_batch":
        k_cache, v_cache = k_cache[:1].contiguous(), v_cache[:1].contiguous()
    elif case == "seqlens_dtype":
        seqlens = seqlens.long()
    elif case == "seqlens_shape":
        seqlens = seqlens[:1]
    elif case in ("seqlens_beyond_cache", "seqlens_beyond_pages"):
        seqlens = seqlens.clone()
        capacity = k_cache.shape[1] if not paged else table.shape[1] * PAGE
        seqlens[1] = capacity - k_new.shape[1] + 1
    elif case == "seqlens_negative":
        seqlens = seqlens.clone()
        seqlens[0] = -1
    elif case == "block_table_dtype":
        table = table.long()
    elif case == "block_table_page_id":
        table = table.clone()
        table[1, 0] = k_cache.shape[0]
    before = k_cache.clone()
    with pytest.raises(ValueError, match=name):
        fn(k_cache, v_cache, k_new, v_new, seqlens, block_table=table)
    if k_cache.shape == before.shape:
        torch.testing.assert_close(k_cache, before, rtol=0, atol=0)


def test_pages_of_no_positions(backend, op_impl):
    """A paged cache whose pages hold no positions (shape [P, 0, Hkv, D]) has capacity 0: writing no tokens is a
    no-op on every backend (the reference and Triton divided by the page size), one token a ValueError."""
    fn = op_impl("write_kv")
    k_cache, v_cache = torch.zeros(2, 0, 3, 16), torch.zeros(2, 0, 3, 16)
    table, seqlens = torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    fn(k_cache, v_cache, torch.zeros(1, 0, 3, 16), torch.zeros(1, 0, 3, 16), seqlens, block_table=table)
    with pytest.raises(ValueError, match="cache_seqlens"):
        fn(k_cache, v_cache, torch.zeros(1, 1, 3, 16), torch.zeros(1, 1, 3, 16), seqlens, block_table=table)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_against_reference(gpu_op_impl, paged):
    fn = gpu_op_impl("write_kv")
    k_cache, v_cache, k_new, v_new, seqlens, table = make_case(4, 60, 8, 128, torch.bfloat16, paged, seed=3)
    k_want, v_want = expected(k_cache, v_cache, k_new, v_new, seqlens, table)
    to = lambda t: None if t is None else t.cuda()  # noqa: E731
    k_gpu, v_gpu = to(k_cache), to(v_cache)
    fn(k_gpu, v_gpu, to(k_new), to(v_new), to(seqlens), block_table=to(table))
    torch.testing.assert_close(k_gpu.cpu(), k_want, rtol=0, atol=0)
    torch.testing.assert_close(v_gpu.cpu(), v_want, rtol=0, atol=0)
