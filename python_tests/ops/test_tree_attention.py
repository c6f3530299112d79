"""tree_attention (contract §1): every backend against an independent dense float64 computation.

The dense computation builds the full [N, prefix + N] visibility from each node's ancestor set
(walking ``parents``, not reading the mask), gathers the cache position by position (through
the block table when paged) and takes a float64 softmax per query head.
"""

import math

import numpy as np
import pytest
import torch

from eagle_kernels import reference
from helpers import random_tree

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Inputs are quantised identically for both sides; the tolerance covers float32 accumulation
# (online softmax, any block order) and the final rounding to q.dtype.
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
HEADS = [(9, 3), (8, 8), (4, 1)]
HEAD_IDS = [f"Hq{hq}-Hkv{hkv}" for hq, hkv in HEADS]
PAGE = 16
D = 64


# ------------------------------------------------------------------------------------ helpers


def ancestors(parents_row):
    """List of ancestor sets (each node included in its own)."""
    sets = []
    for i, p in enumerate(parents_row.tolist()):
        sets.append({i} | (sets[p] if p >= 0 else set()))
    return sets


def mask_from_parents(parents):
    """int64 [B, N, W] tree mask built bit by bit with Python ints."""
    B, N = parents.shape
    W = (N + 63) // 64
    mask = torch.zeros(B, N, W, dtype=torch.int64)
    for b in range(B):
        for i, anc in enumerate(ancestors(parents[b])):
            words = [0] * W
            for j in anc:
                words[j // 64] |= 1 << (j % 64)
            mask[b, i] = torch.tensor([w - (1 << 64) if w >= 1 << 63 else w for w in words])
    return mask


def chain_parents(B, N):
    return torch.arange(-1, N - 1, dtype=torch.int32).expand(B, N).contiguous()


def physical_index(block_table, b, length):
    """Index arrays (into the cache's first two dims) of logical positions 0..length-1."""
    t = np.arange(length)
    if block_table is None:
        return np.full(length, b), t
    table = block_table.numpy()
    return np.array([table[b, p // PAGE] for p in t], dtype=np.int64), t % PAGE


def dense_attention(q, k_cache, v_cache, cache_seqlens, parents, block_table=None, sm_scale=None):
    """float64 [B, N, Hq, D] (numpy, as a torch tensor); ``parents`` None means causal."""
    B, N, Hq, Dh = q.shape
    Hkv = k_cache.shape[-2]
    group = Hq // Hkv
    scale = Dh ** -0.5 if sm_scale is None else sm_scale
    qs = q.double().numpy()
    ks, vs = k_cache.double().numpy(), v_cache.double().numpy()
    out = np.zeros((B, N, Hq, Dh))
    for b in range(B):
        prefix = int(cache_seqlens[b])
        rows = physical_index(block_table, b, prefix + N)
        keys, vals = ks[rows], vs[rows]  # [T, Hkv, D]
        visible = np.zeros((N, prefix + N), dtype=bool)
        visible[:, :prefix] = True
        sets = [range(i + 1) for i in range(N)] if parents is None else ancestors(parents[b])
        for i, anc in enumerate(sets):
            visible[i, [prefix + j for j in anc]] = True
        for h in range(Hq):
            kv = h // group
            logits = np.where(visible, qs[b, :, h] @ keys[:, kv].T * scale, -np.inf)
            weights = np.exp(logits - logits.max(axis=1, keepdims=True))
            out[b, :, h] = (weights / weights.sum(axis=1, keepdims=True)) @ vals[:, kv]
    return torch.from_numpy(out)


def make_inputs(N, prefix, heads, dtype, paged, seed, B=2, garbage=None):
    """q, caches, cache_seqlens (requests of different lengths) and block_table (shuffled pages,
    more pages in the pool than in use)."""
    Hq, Hkv = heads
    gen = torch.Generator().manual_seed(seed)
    seqlens = torch.tensor([prefix, max(prefix - 5, 0)][:B] + [prefix] * max(B - 2, 0), dtype=torch.int32)
    capacity = prefix + N + 3
    q = torch.randn(B, N, Hq, D, generator=gen).to(dtype)
    if not paged:
        shape = (B, capacity, Hkv, D)
        block_table = None
    else:
        pages = math.ceil(capacity / PAGE)
        pool = B * pages + 3
        shape = (pool, PAGE, Hkv, D)
        block_table = torch.randperm(pool, generator=gen)[: B * pages].view(B, pages).to(torch.int32)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    if garbage is not None:
        # Poison every position no request may read (beyond cache_seqlens + N, unused pages).
        for cache in (k_cache, v_cache):
            keep = np.zeros(shape[:2], dtype=bool)
            for b in range(B):
                keep[physical_index(block_table, b, int(seqlens[b]) + N)] = True
            cache[~torch.from_numpy(keep)] = garbage
    return q, k_cache, v_cache, seqlens, block_table


def run_and_compare(fn, N, prefix, heads, dtype, paged, seed, *, causal=False, sm_scale=None,
                    garbage=None):
    q, k, v, seqlens, table = make_inputs(N, prefix, heads, dtype, paged, seed, garbage=garbage)
    tree = None if causal else random_tree(q.shape[0], N, seed)
    mask = None if causal else tree.mask
    out = fn(q, k, v, seqlens, mask, block_table=table, sm_scale=sm_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = dense_attention(q, k, v, seqlens, None if causal else tree.parents, table, sm_scale)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
    return out


LAYOUTS = [False, True]
LAYOUT_IDS = ["contiguous", "paged"]


def interpreted_subset(backend, representative: bool) -> None:
    """The Triton interpreter takes seconds per case: it runs a representative subset of each
    grid here; the C++ path runs all of it, and the GPU tests run Triton compiled."""
    if backend == "triton" and not representative:
        pytest.skip("Triton interpreter: representative subset only")


def interpreted_heads(backend, heads, triton_heads):
    """The interpreter's cost grows with the number of programs, one per (request, KV head,
    block of nodes): tests whose subject is not the head layout run Triton on fewer heads
    (test_random_tree_fp32 runs it on (9, 3) heads, test_tree_attention_backends on GQA groups
    of 1, 3 and 4 with several KV heads)."""
    return triton_heads if backend == "triton" else heads


# ---------------------------------------------------------------------------------- tier 1
@pytest.mark.parametrize("paged", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("prefix", [0, 1, 37], ids=lambda p: f"prefix{p}")
@pytest.mark.parametrize("N", [1, 7, 60, 65], ids=lambda n: f"N{n}")
def test_random_tree_fp32(backend, op_impl, N, prefix, heads, paged):
    interpreted_subset(backend, heads == (9, 3) and prefix == 37 and N in (7, 65))
    fn = op_impl("tree_attention")
    run_and_compare(fn, N, prefix, heads, torch.float32, paged, seed=1000 * N + 10 * prefix + heads[0])


@pytest.mark.parametrize("paged", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("N", [7, 65], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("sm_scale", [None, 0.3], ids=["default_scale", "scale0.3"])
def test_dtypes_and_scale(backend, op_impl, sm_scale, dtype, N, paged):
    # Triton: N = 65 paged, each dtype once, the two scales alternating.
    diagonal = (list(DTYPES.values()).index(dtype) + (sm_scale is not None)) % 2 == 0
    interpreted_subset(backend, N == 65 and paged and diagonal)
    fn = op_impl("tree_attention")
    run_and_compare(fn, N, 37, (9, 3), dtype, paged, seed=N + 7, sm_scale=sm_scale)


@pytest.mark.parametrize("paged", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("prefix", [0, 37], ids=lambda p: f"prefix{p}")
@pytest.mark.parametrize("N", [1, 7, 60, 65], ids=lambda n: f"N{n}")
def test_causal(backend, op_impl, N, prefix, paged):
    interpreted_subset(backend, prefix == 37 and N in (7, 65))
    fn = op_impl("tree_attention")
    run_and_compare(fn, N, prefix, (4, 1), torch.float32, paged, seed=N + prefix, causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_causal_low_precision(backend, op_impl, dtype):
    fn = op_impl("tree_attention")
    run_and_compare(fn, 60, 37, (8, 8), dtype, True, seed=5, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["tree", "causal"])
@pytest.mark.parametrize("paged", LAYOUTS, ids=LAYOUT_IDS)
def test_positions_past_the_tree_are_never_read(backend, op_impl, paged, causal):
    """Positions past cache_seqlens + N and pool pages no request owns hold NaN: the output
    must not see them (masked loads, not zero-weighted ones)."""
    fn = op_impl("tree_attention")
    heads = interpreted_heads(backend, (9, 3), (3, 1))
    out = run_and_compare(fn, 65, 37, heads, torch.float32, paged, seed=3, causal=causal,
                          garbage=float("nan"))
    assert bool(torch.isfinite(out).all())


# ------------------------------------------------------------------ tier 2: golden masks
@pytest.mark.parametrize("N", [7, 64, 65], ids=lambda n: f"N{n}")
def test_chain_tree_equals_causal(backend, op_impl, N):
    fn = op_impl("tree_attention")
    B = 2
    # A chain from build_tree: each candidate the only child of the previous one.
    cand_parents = torch.arange(-1, N - 2, dtype=torch.int32).expand(B, N - 1).contiguous()
    cand_scores = -torch.arange(1, N, dtype=torch.float32).expand(B, N - 1).contiguous()
    tree = reference.build_tree(torch.zeros(B, dtype=torch.int64), torch.ones(B, N - 1, dtype=torch.int64),
                                cand_scores, cand_parents, N)
    torch.testing.assert_close(tree.mask, mask_from_parents(chain_parents(B, N)), rtol=0, atol=0)
    q, k, v, seqlens, table = make_inputs(N, 37, interpreted_heads(backend, (9, 3), (3, 1)), torch.float32,
                                          True, seed=N)
    tree_out = fn(q, k, v, seqlens, tree.mask, block_table=table)
    causal_out = fn(q, k, v, seqlens, None, block_table=table)
    torch.testing.assert_close(tree_out, causal_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(tree_out.double(), dense_attention(q, k, v, seqlens, None, table), **TOL[torch.float32])


@pytest.mark.parametrize("paged", LAYOUTS, ids=LAYOUT_IDS)
def test_strided_queries_equal_contiguous(backend, op_impl, paged):
    """q as the query columns of a fused q/k/v projection ([B, N, Hq + 2 Hkv, D] narrowed to its first Hq
    heads, as cpu_decoder_layer passes it): the same output as its contiguous copy, bit for bit."""
    fn = op_impl("tree_attention")
    heads = interpreted_heads(backend, (9, 3), (3, 1))
    q, k, v, seqlens, table = make_inputs(7, 37, heads, torch.float32, paged, seed=5)
    fused = torch.randn(q.shape[0], q.shape[1], heads[0] + 2 * heads[1], D)
    fused[:, :, :heads[0]] = q
    q_view = fused[:, :, :heads[0]]
    assert not q_view.is_contiguous()
    mask = mask_from_parents(chain_parents(q.shape[0], q.shape[1]))
    torch.testing.assert_close(fn(q_view, k, v, seqlens, mask, block_table=table),
                               fn(q, k, v, seqlens, mask, block_table=table), rtol=0, atol=0)


def golden_parents_65():
    """Trees of 65 nodes whose masks use bit 63 of word 0 (the int64 sign bit) and word 1."""
    star = [-1] + [0] * 64
    chain = list(range(-1, 64))
    # Two long branches interleaved; node 64 hangs under node 63, which hangs under node 1.
    branches = [-1, 0, 0] + [i - 2 for i in range(3, 63)] + [1, 63]
    return torch.tensor([star, chain, branches], dtype=torch.int32)


def test_mask_second_word_n65(backend, op_impl):
    fn = op_impl("tree_attention")
    parents = golden_parents_65()
    mask = mask_from_parents(parents)
    sign = -(1 << 63)
    # Hand-written words of the rows that straddle the word boundary.
    assert mask[0, 63].tolist() == [sign | 1, 0]        # star: root and itself (bit 63)
    assert mask[0, 64].tolist() == [1, 1]              # star: root, and bit 0 of word 1
    assert mask[1, 64].tolist() == [-1, 1]             # chain: every bit of word 0
    assert mask[2, 64].tolist() == [sign | 0b11, 1]    # nodes 0, 1, 63 and 64
    B, N = parents.shape
    q, k, v, seqlens, table = make_inputs(N, 37, interpreted_heads(backend, (8, 8), (2, 2)), torch.float32,
                                          False, seed=65, B=B)
    out = fn(q, k, v, seqlens, mask, block_table=table)
    want = dense_attention(q, k, v, seqlens, parents, table)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    # Each boundary bit matters: clearing it moves the output far beyond the tolerance.
    for b, i, word, bit in [(0, 63, 0, 63), (0, 64, 1, 0), (2, 64, 0, 63)]:
        flipped = mask.clone()
        flipped[b, i, word] ^= (1 << bit) if bit < 63 else sign
        moved = fn(q, k, v, seqlens, flipped, block_table=table)
        assert float((moved[b, i] - out[b, i]).abs().max()) > 1e-2
        torch.testing.assert_close(moved[b, :i], out[b, :i], atol=0, rtol=0)


def test_build_tree_masks_match_ancestor_sets(backend, op_impl):
    """The random trees fed to the other tests carry the masks their parents imply."""
    op_impl("tree_attention")
    for N in (1, 7, 60, 65):
        tree = random_tree(3, N, seed=N)
        torch.testing.assert_close(tree.mask, mask_from_parents(tree.parents), rtol=0, atol=0)


# ------------------------------------------------------------------------ tier 5: bad input
@pytest.mark.parametrize("case,name", [
    ("heads_not_divisible", "k_cache"),
    ("head_dim_mismatch", "k_cache"),
    ("mask_width", "tree_mask"),
    ("mask_dtype", "tree_mask"),
    ("seqlens_beyond_cache", "cache_seqlens"),
    ("seqlens_beyond_pages", "cache_seqlens"),
    ("k_dtype_differs", "k_cache"),
    ("v_dtype_differs", "v_cache"),
    ("v_shape_differs", "v_cache"),
    ("q_rank", "q"),
    ("seqlens_dtype", "cache_seqlens"),
    ("block_table_dtype", "block_table"),
    ("scale_nan", "sm_scale"),
    ("scale_inf", "sm_scale"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_input(backend, op_impl, case, name):
    fn = op_impl("tree_attention")
    N = 65
    paged = case in ("seqlens_beyond_pages", "block_table_dtype")
    q, k, v, seqlens, table = make_inputs(N, 5, (9, 3), torch.float32, paged, seed=0)
    mask = mask_from_parents(chain_parents(2, N))
    if case == "heads_not_divisible":
        k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()
    elif case == "head_dim_mismatch":
        k, v = k[..., :32].contiguous(), v[..., :32].contiguous()
    elif case == "mask_width":
        mask = mask[..., :1].contiguous()
    elif case == "mask_dtype":
        mask = mask.to(torch.int32)
    elif case in ("seqlens_beyond_cache", "seqlens_beyond_pages"):
        seqlens = seqlens.clone()
        # One position more than the cache (or the request's pages) can address.
        seqlens[1] = (k.shape[1] if not paged else table.shape[1] * PAGE) - N + 1
    elif case == "k_dtype_differs":
        k, v = k.half(), v.half()
    elif case == "v_dtype_differs":
        v = v.half()
    elif case == "v_shape_differs":
        v = v[:, :-1].contiguous()
    elif case == "q_rank":
        q = q[0]
    elif case == "seqlens_dtype":
        seqlens = seqlens.long()
    elif case == "block_table_dtype":
        table = table.long()
    # A non-finite scale would give NaN rows (or, in the CPU kernel, zeros): rejected instead.
    scale = {"scale_nan": float("nan"), "scale_inf": float("inf")}.get(case)
    with pytest.raises(ValueError, match=name):
        fn(q, k, v, seqlens, mask, block_table=table, sm_scale=scale)
