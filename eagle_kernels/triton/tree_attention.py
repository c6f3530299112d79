"""Triton tree attention (contract §1): flash attention over the committed prefix and the tree.

For request ``b``, node ``i`` and query head ``h`` (KV head ``h // G``)::

    out[b, i, h] = softmax_t(q . k_t * sm_scale) @ v     over t < cache_seqlens[b] (prefix,
                   no mask) and t = cache_seqlens[b] + j for tree slots j visible to i
                   (mask bit (i, j), or j <= i when tree_mask is None)

(SpecInfer, Miao et al. 2024, §4.2 tree-based parallel decoding; online softmax of
FlashAttention, Dao et al. 2022, Alg. 1, in base 2, the scale sm_scale * log2 e folded into the
exponent; FlashAttention-4's lazy rescaling, see ``_attend_tile``.)

Layout of one program: its rows are the (node, query head) pairs of ``NODES`` consecutive nodes
and the ``G`` query heads sharing one KV head (GQA packing). On a GPU a block holds up to 128
rows of a (request, KV head) (Llama-3-8B's 4 query heads per KV head at N 64: two node blocks,
neighbouring programs that read the same K/V tiles at the same time), or all 256 where there are
enough (request, KV head) pairs (B 8 and up at those heads: one K/V read). Prefix tiles need no mask beyond
the length bound; tree tiles read one int64 mask word per row (a tile's keys share it). Only
when the (request, KV head) programs are fewer than the SMs is the prefix split over
``NUM_SPLITS`` programs (flash-decoding, sized to fill the SMs once), and their partial results
(fp32; for bf16 inputs fp16 scaled per row, half the bytes) are combined by their log-sum-exp:
by the program of each block's last split (an atomic ticket), where the block's partials are few
(``folds_merge``: a decoded token, a short or lightly split tree; no launch of its own), else by
a small merge kernel. Configurations: :mod:`.tree_attention_config`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks
from ._launch_config import dot_mode, interpreted, tickets
from ._pdl import launch_options, wait_for_prior_grids
from .tree_attention_config import (  # noqa: F401  (the configurations' names, re-exported)
    GPU_CONFIG,
    GPU_CONFIG_D256,
    GPU_CONFIG_SMALL,
    GPU_CONFIG_WIDE,
    H200_SMS,
    INTERPRETER_CONFIG,
    SHARED_MEMORY_BUDGET,
    WIDE_BLOCKS_SUPPORTED,
    TreeAttentionConfig,
    blocks_per_sm,
    every_gpu_config,
    fold_chunk,
    folds_merge,
    gpu_config,
    partial_dtype,
    sm_count,
    split_layout,
    wide_blocks,
)

# Lazy rescaling: the running maxima move only when a row's grew by more than this (log2 units),
# so the probabilities of a tile stay below 2^8 (fp16 and bf16 hold them; the fp32 sums too).
RESCALE_SLACK = tl.constexpr(8.0)
# Work of a tree tile in prefix tiles (its mask; compiled loop: ~640 instructions a warp against
# ~415 for a prefix tile, plus the mask words' latency), for balancing flash-decoding splits.
TREE_TILE_COST = tl.constexpr(3)
# The lazy path's running maximum before a row's first key: raw scores are far above it.
NO_KEY = tl.constexpr(-1.0e30)
# Columns of the lazy path's row sums l_i [rows, LSUM_COLS] (all equal): the narrowest tl.dot.
LSUM_COLS = tl.constexpr(16)


@triton.jit
def _attend_tile(q, k, v, valid, m_i, l_i, acc, scale_log2,
                 MASKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, LAZY: tl.constexpr):
    """One online-softmax step over a key tile; with MASKED, ``valid`` [BLOCK_M, BLOCK_K] says
    which scores count (else all do).

    With LAZY, ``m_i`` is the running row maximum of the raw scores q . k (the scale is folded
    into the exponent: p = 2^(s * qk - s * m), one FFMA a score); without, of the scaled scores
    s * q . k (log2 units). Lazy rescaling (FlashAttention-4's
    conditional rescale), with LAZY: the block's maxima, ``l_i`` and ``acc`` move to the new row
    maxima only when some row's maximum grew by more than RESCALE_SLACK (in log2 units) or a row
    saw its first key; otherwise the stale maxima stay and p may reach 2^RESCALE_SLACK. acc and
    l_i then carry the same factor, which the final acc / l_i cancels: exact up to rounding.
    Without LAZY (fp32 inputs, whose FMA dots leave no registers for the block-wide test) every
    tile rescales. A row that has seen no valid key keeps m at its start (LAZY: the finite
    NO_KEY; else -inf, shifted by 0 instead, so no -inf - -inf NaN appears)."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if not LAZY:
        qk = qk * scale_log2  # this path keeps m in log2 units
    if MASKED:
        qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if LAZY:
        # m starts at NO_KEY, a finite floor (no -inf - -inf NaN to guard): a row's first key
        # grows it by ~1e30, its rescale factor is then 0 (l and acc are 0 anyway); the scale
        # multiplies the block's largest growth once, not each row's.
        if tl.max(m_new - m_i, 0) * scale_log2 > RESCALE_SLACK:  # block-uniform: rare after the first tile
            alpha = tl.exp2((m_i - m_new) * scale_log2)
            l_i = l_i * alpha[:, None]
            acc = acc * alpha[:, None]
            m_i = m_new
        p = tl.exp2(qk * scale_log2 - (m_i * scale_log2)[:, None]).to(v.dtype)
        # The row sums on the tensor cores: p @ ones accumulates every column of l_i to the
        # row's sum of the probabilities PV multiplies (the same 16-bit values), with no
        # per-tile adds and shuffles.
        l_i = tl.dot(p, tl.full([k.shape[0], LSUM_COLS], 1.0, v.dtype), l_i, input_precision=DOT_PRECISION)
        acc = acc + tl.dot(p, v, input_precision=DOT_PRECISION)
    else:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _kv_offsets(b, kvh, t, t_valid, block_table_ptr, page_size, max_pages,
                stride0, stride1, stride2, PAGE_SIZE: tl.constexpr, IS_PAGED: tl.constexpr,
                INT32_OFFSETS: tl.constexpr):
    """Element offsets [BLOCK_K] of logical positions ``t`` of request ``b`` (int32 when the
    launcher found every offset of both caches below 2^31, else int64). A page size
    PAGE_SIZE > 0 is a compile-time constant (a shift and a mask for powers of two); 0 takes the
    runtime ``page_size`` (an integer division: the fp32 launches, whose registers are full)."""
    if IS_PAGED:
        if PAGE_SIZE > 0:
            page_index = t // PAGE_SIZE
            slot = t % PAGE_SIZE
        else:
            page_index = t // page_size
            slot = t % page_size
        page = tl.load(block_table_ptr + b * max_pages + page_index, mask=t_valid, other=0)
        if INT32_OFFSETS:
            off = page * stride0 + slot * stride1 + kvh.to(tl.int32) * stride2
        else:
            off = page.to(tl.int64) * stride0 + slot.to(tl.int64) * stride1 + kvh * stride2
    else:
        if INT32_OFFSETS:
            off = b.to(tl.int32) * stride0 + t * stride1 + kvh.to(tl.int32) * stride2
        else:
            off = b * stride0 + t.to(tl.int64) * stride1 + kvh * stride2
    return off


@triton.jit
def _load_kv_tile(k_ptr, v_ptr, b, kvh, t, t_valid, kd_mask, offs_d, block_table_ptr, page_size, max_pages,
                  stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2, PAGE_SIZE: tl.constexpr,
                  IS_PAGED: tl.constexpr, INT32_OFFSETS: tl.constexpr, SHARED_KV_OFFSETS: tl.constexpr):
    """K and V [BLOCK_K, BLOCK_D] of a masked tile (a prefix's partial last tile, the tree's
    slots), offsets computed per key; the whole prefix tiles take hoisted offsets instead."""
    k_off = _kv_offsets(b, kvh, t, t_valid, block_table_ptr, page_size, max_pages,
                        stride_k0, stride_k1, stride_k2, PAGE_SIZE, IS_PAGED, INT32_OFFSETS)
    if SHARED_KV_OFFSETS:
        v_off = k_off
    else:
        v_off = _kv_offsets(b, kvh, t, t_valid, block_table_ptr, page_size, max_pages,
                            stride_v0, stride_v1, stride_v2, PAGE_SIZE, IS_PAGED, INT32_OFFSETS)
    k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kd_mask, other=0.0)
    v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kd_mask, other=0.0)
    return k, v


@triton.jit
def _tree_attention_kernel(
    q_ptr,  # [B, N, Hq, D] q.dtype (strided)
    k_ptr,  # [B, S, Hkv, D] or paged [P, page_size, Hkv, D], last dim dense
    v_ptr,  # like k_ptr
    seqlens_ptr,  # [B] int32
    mask_ptr,  # [B, N, W] int64, contiguous (unused when IS_CAUSAL)
    block_table_ptr,  # [B, max_pages] int32, contiguous (unused unless IS_PAGED)
    out_ptr,  # [B, N, Hq, D] q.dtype, contiguous (written when NUM_SPLITS == 1)
    part_o_ptr,  # [NUM_SPLITS, B * N * Hq, D] float32, or float16 with SCALED_PARTIALS (when NUM_SPLITS > 1)
    part_lse_ptr,  # [NUM_SPLITS, B * N * Hq] float32, base-2 log-sum-exp; SCALED_PARTIALS: then as many scales
    tickets_ptr,  # [>= B * Hkv * NODE_BLOCKS] int32, zero between launches (used when FOLD_MERGE)
    N, Hq, Hkv, D, W, page_size, max_pages, scale_log2,
    stride_qb, stride_qn, stride_qh,
    stride_k0, stride_k1, stride_k2,
    stride_v0, stride_v1, stride_v2,
    GROUP: tl.constexpr, NODES: tl.constexpr, NODE_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr, IS_PAGED: tl.constexpr, IS_CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr,  # D == BLOCK_D: whole-tile loads need no mask at all
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,  # 16-bit inputs: the conditional rescale of _attend_tile
    INT32_OFFSETS: tl.constexpr,  # every element offset of q, both caches, out and the partials is below 2^31
    SHARED_KV_OFFSETS: tl.constexpr,  # k_cache and v_cache have the same strides
    TILE_MODE: tl.constexpr,  # whole prefix tiles: 0 general, 1 contiguous, 2 pages in a tile, 3 a tile in a page
    SCALED_PARTIALS: tl.constexpr,  # bf16 inputs: split partials in fp16 scaled per row
    FOLD_MERGE: tl.constexpr,  # NUM_SPLITS > 1: the program of a block's last split merges its splits
    BLOCK_S: tl.constexpr, SPLIT_CHUNK: tl.constexpr,  # next_pow2(NUM_SPLITS); splits a merge round reads
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    # NODE_BLOCKS = cdiv(N, NODES) a compile-time constant (a tree's node count is fixed): its
    # division and remainder are shifts and masks at powers of two; one division by Hkv remains.
    nblk = pid % NODE_BLOCKS
    head_pid = pid // NODE_BLOCKS  # b * Hkv + kvh
    b32 = head_pid // Hkv
    kvh = (head_pid - b32 * Hkv).to(tl.int64)
    b = b32.to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    node_local = offs_m // GROUP
    node = nblk * NODES + node_local
    # Offsets in int32 when the launcher found every offset of q, the caches, the output and the
    # partial results below 2^31, else int64.
    if INT32_OFFSETS:
        b_o = b.to(tl.int32)
        kvh_o = kvh.to(tl.int32)
    else:
        b_o = b
        kvh_o = kvh
    head = kvh_o * GROUP + offs_m % GROUP
    row_valid = (node_local < NODES) & (node < N)
    offs_d = tl.arange(0, BLOCK_D)
    if EVEN_D:
        d_valid = offs_d < BLOCK_D  # constant true: row masks only
    else:
        d_valid = offs_d < D

    q_off = b_o * stride_qb + node[:, None].to(b_o.dtype) * stride_qn + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    if LAZY_RESCALE:
        m_i = tl.full([BLOCK_M], NO_KEY, tl.float32)
        l_i = tl.zeros([BLOCK_M, LSUM_COLS], tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    prefix = tl.load(seqlens_ptr + b)
    if NUM_SPLITS == 1:
        start = 0
        stop = prefix
    else:
        # Whole key tiles per split, balanced with the tree: the last split also attends to the
        # block's tree tiles (each about TREE_TILE_COST prefix tiles of work: the mask), so it
        # takes that many fewer prefix tiles and the other splits share the rest.
        tiles = tl.cdiv(prefix, BLOCK_K)
        tree = tl.cdiv(tl.minimum(N, (nblk + 1) * NODES), BLOCK_K) * TREE_TILE_COST
        last_tiles = tl.minimum(tl.maximum(tl.cdiv(tiles + tree, NUM_SPLITS) - tree, 0), tiles)
        first = (tiles - last_tiles) * BLOCK_K  # keys of the splits before the last
        chunk = tl.cdiv(tiles - last_tiles, NUM_SPLITS - 1) * BLOCK_K
        is_last = split == NUM_SPLITS - 1
        start = tl.where(is_last, first, split * chunk)
        stop = tl.where(is_last, prefix, tl.minimum(tl.minimum(prefix, first), start + chunk))

    offs_k = tl.arange(0, BLOCK_K)
    # Committed prefix: every node sees every position. Whole tiles first, with no key mask
    # and no score masking (as the off-diagonal blocks of causal flash attention); then the
    # one partial tile, where only the length bound masks.
    full_stop = start + tl.maximum(stop - start, 0) // BLOCK_K * BLOCK_K
    all_keys = offs_k < BLOCK_K
    kd_full = all_keys[:, None] & d_valid[None, :]
    # Whole tiles start at multiples of BLOCK_K, so what does not change from tile to tile is
    # computed once: the request's and KV head's part and the keys' offsets within the tile
    # (TILE_MODE 1), within their pages (2: BLOCK_K a multiple of the page size, a tile's pages
    # at fixed places) or within the one page the tile lies in (3). Per tile only the
    # block-table entries (one per page, or one scalar) and one multiply-add remain.
    table_row = block_table_ptr + b * max_pages
    if TILE_MODE == 1:
        k_row = b_o * stride_k0 + kvh_o * stride_k2 + offs_k.to(b_o.dtype) * stride_k1
        v_row = b_o * stride_v0 + kvh_o * stride_v2 + offs_k.to(b_o.dtype) * stride_v1
    elif TILE_MODE == 2:
        tile_page = offs_k // PAGE_SIZE
        k_row = kvh_o * stride_k2 + (offs_k % PAGE_SIZE).to(b_o.dtype) * stride_k1
        v_row = kvh_o * stride_v2 + (offs_k % PAGE_SIZE).to(b_o.dtype) * stride_v1
    else:
        k_row = kvh_o * stride_k2 + offs_k.to(b_o.dtype) * stride_k1
        v_row = kvh_o * stride_v2 + offs_k.to(b_o.dtype) * stride_v1
    for t0 in range(start, full_stop, BLOCK_K):
        if TILE_MODE == 0:
            t = t0 + offs_k
            k_off = _kv_offsets(b, kvh, t, all_keys, block_table_ptr, page_size, max_pages,
                                stride_k0, stride_k1, stride_k2, PAGE_SIZE, IS_PAGED, INT32_OFFSETS)
            v_off = _kv_offsets(b, kvh, t, all_keys, block_table_ptr, page_size, max_pages,
                                stride_v0, stride_v1, stride_v2, PAGE_SIZE, IS_PAGED, INT32_OFFSETS)
        elif TILE_MODE == 1:
            k_off = tl.cast(t0, b_o.dtype) * stride_k1 + k_row
            v_off = tl.cast(t0, b_o.dtype) * stride_v1 + v_row
        elif TILE_MODE == 2:
            page = tl.load(table_row + t0 // PAGE_SIZE + tile_page).to(b_o.dtype)
            k_off = page * stride_k0 + k_row
            v_off = page * stride_v0 + v_row
        else:
            page = tl.load(table_row + t0 // PAGE_SIZE).to(b_o.dtype)
            slot = tl.cast(t0 % PAGE_SIZE, b_o.dtype)
            k_off = (page * stride_k0 + slot * stride_k1) + k_row
            v_off = (page * stride_v0 + slot * stride_v1) + v_row
        if SHARED_KV_OFFSETS:
            v_off = k_off
        if EVEN_D:
            k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :])
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :])
        else:
            k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kd_full, other=0.0)
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kd_full, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, all_keys[None, :], m_i, l_i, acc, scale_log2,
                                     False, UPCAST, DOT_PRECISION, LAZY_RESCALE)
    if full_stop < stop:
        t = full_stop + offs_k
        t_valid = t < stop
        kd_mask = t_valid[:, None] & d_valid[None, :]
        k, v = _load_kv_tile(k_ptr, v_ptr, b, kvh, t, t_valid, kd_mask, offs_d, block_table_ptr, page_size,
                             max_pages, stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2,
                             PAGE_SIZE, IS_PAGED, INT32_OFFSETS, SHARED_KV_OFFSETS)
        m_i, l_i, acc = _attend_tile(q, k, v, t_valid[None, :], m_i, l_i, acc, scale_log2,
                                     True, UPCAST, DOT_PRECISION, LAZY_RESCALE)

    # Tree slots (last split only). Ancestors precede descendants, so no row of this block
    # sees a slot past its last node.
    if split == NUM_SPLITS - 1:
        last = tl.minimum(N, (nblk + 1) * NODES) - 1
        key_bit = tl.full([BLOCK_K], 1, tl.int64) << offs_k.to(tl.int64)  # BLOCK_K <= 64
        for j0 in range(0, last + 1, BLOCK_K):
            j = j0 + offs_k
            j_valid = j <= last
            kd_mask = j_valid[:, None] & d_valid[None, :]
            t = prefix + j
            k, v = _load_kv_tile(k_ptr, v_ptr, b, kvh, t, j_valid, kd_mask, offs_d, block_table_ptr, page_size,
                                 max_pages, stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2,
                                 PAGE_SIZE, IS_PAGED, INT32_OFFSETS, SHARED_KV_OFFSETS)
            if IS_CAUSAL:
                visible = row_valid[:, None] & j_valid[None, :] & (j[None, :] <= node[:, None])
            else:
                # BLOCK_K divides 64: the tile's keys share one mask word per row, loaded as a
                # [BLOCK_M] vector (not a [BLOCK_M, BLOCK_K] tile of repeated words), shifted
                # per row to the tile's first key; a key's bit is then a fixed mask, cleared past
                # the block's last node (rows past it load 0).
                words = tl.load(mask_ptr + (b * N + node.to(tl.int64)) * W + j0 // 64, mask=row_valid, other=0)
                words = words >> (j0 % 64)
                visible = (words[:, None] & tl.where(j_valid, key_bit, 0)[None, :]) != 0
            m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, scale_log2,
                                         True, UPCAST, DOT_PRECISION, LAZY_RESCALE)

    if LAZY_RESCALE:
        l_i = tl.max(l_i, 1)  # its columns are equal
    # A row with no visible key (a mask without the node's own bit and an empty prefix)
    # outputs zeros.
    has = l_i > 0.0
    inv_l = 1.0 / tl.where(has, l_i, 1.0)  # one division a row, not a value
    row = (b_o * N + node.to(b_o.dtype)) * Hq + head  # flat (b, node, head) index
    o_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + row[:, None] * D + offs_d[None, :], (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty),
                 mask=o_mask)
    else:
        rows_total = tl.num_programs(0) // NODE_BLOCKS * N * GROUP  # B * N * Hq
        base = split.to(b_o.dtype) * rows_total + row
        if SCALED_PARTIALS:
            # fp16 partials scaled by the row's largest |value| (o = acc / l, stored acc / max|acc|
            # in [-1, 1], its scale max|acc| / l beside the log-sum-exps): an absolute error of
            # at most 2^-12 of the row's largest |o|, below the bf16 output's rounding.
            amax = tl.max(tl.abs(acc), 1)
            amax = tl.where(amax > 0.0, amax, 1.0)
            tl.store(part_o_ptr + base[:, None] * D + offs_d[None, :], (acc * (1.0 / amax)[:, None]).to(tl.float16),
                     mask=o_mask)
            tl.store(part_lse_ptr + NUM_SPLITS * rows_total + base, amax * inv_l, mask=row_valid)
        else:
            tl.store(part_o_ptr + base[:, None] * D + offs_d[None, :], acc * inv_l[:, None], mask=o_mask)
        if LAZY_RESCALE:
            m_log2 = m_i * scale_log2  # m of raw scores on the lazy path
        else:
            m_log2 = m_i
        lse = tl.where(has, m_log2 + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + base, lse, mask=row_valid)
        if FOLD_MERGE:
            # Publish: every thread's partials are stored (barrier) before one thread takes the
            # block's ticket with release semantics; the program drawing the last ticket acquires
            # every split's partials and merges the block's rows, then resets the ticket (stream
            # order makes the reset visible to the next launch).
            tl.debug_barrier()
            done = tl.atomic_add(tickets_ptr + pid, 1, sem="acq_rel")
            if done == NUM_SPLITS - 1:
                merged = _merge_splits(part_o_ptr, part_lse_ptr, row.to(tl.int64), row_valid, offs_d, d_valid,
                                       rows_total, D, NUM_SPLITS, BLOCK_S, SPLIT_CHUNK, SCALED_PARTIALS)
                tl.store(out_ptr + row[:, None] * D + offs_d[None, :], merged.to(out_ptr.dtype.element_ty),
                         mask=o_mask)
                tl.atomic_xchg(tickets_ptr + pid, 0, sem="relaxed")


@triton.jit
def _merge_splits(part_o_ptr, part_lse_ptr, rows, row_ok, offs_d, d_ok, R, D,
                  NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, SCALED: tl.constexpr):
    """sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) for ``rows`` [rows] (flat (b, node, head)
    indices, int64) of the [NUM_SPLITS, R, D] partials: the log-sum-exps of every split first
    (the maximum M and the denominator), then the outputs ``CHUNK`` splits a round, in split
    order (the same sums whichever program merges). ``.cg`` loads: other programs' partials,
    published by a ticket or a launch boundary, never through this SM's L1. Rows with no key in
    any split give zeros."""
    offs_s = tl.arange(0, BLOCK_S)
    valid = (offs_s < NUM_SPLITS)[:, None] & row_ok[None, :]
    flat = offs_s.to(tl.int64)[:, None] * R + rows[None, :]  # [splits, rows]
    lse = tl.load(part_lse_ptr + flat, mask=valid, other=float("-inf"), cache_modifier=".cg")
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top[None, :])
    total = tl.sum(weight, 0)
    if CHUNK >= BLOCK_S:
        # One round: every load issued at once (the merge launch's programs).
        o_mask = valid[:, :, None] & d_ok[None, None, :]
        o = tl.load(part_o_ptr + flat[:, :, None] * D + offs_d[None, None, :], mask=o_mask, other=0.0,
                    cache_modifier=".cg")
        if SCALED:
            weight = weight * tl.load(part_lse_ptr + NUM_SPLITS * R + flat, mask=valid, other=0.0,
                                      cache_modifier=".cg")
        merged = tl.sum(o.to(tl.float32) * weight[:, :, None], 0)
    else:
        offs_c = tl.arange(0, CHUNK)
        merged = tl.zeros([rows.shape[0], offs_d.shape[0]], tl.float32)
        for s0 in range(0, NUM_SPLITS, CHUNK):
            split = s0 + offs_c
            c_valid = (split < NUM_SPLITS)[:, None] & row_ok[None, :]
            c_flat = split.to(tl.int64)[:, None] * R + rows[None, :]  # [CHUNK, rows]
            c_lse = tl.load(part_lse_ptr + c_flat, mask=c_valid, other=float("-inf"), cache_modifier=".cg")
            c_weight = tl.exp2(c_lse - top[None, :])
            if SCALED:
                c_weight = c_weight * tl.load(part_lse_ptr + NUM_SPLITS * R + c_flat, mask=c_valid, other=0.0,
                                              cache_modifier=".cg")
            o = tl.load(part_o_ptr + c_flat[:, :, None] * D + offs_d[None, None, :],
                        mask=c_valid[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
            merged += tl.sum(o.to(tl.float32) * c_weight[:, :, None], 0)
    return merged * (1.0 / tl.where(total > 0.0, total, 1.0))[:, None]


@triton.jit
def _tree_attention_merge_kernel(
    part_o_ptr,  # [NUM_SPLITS, R, D] float32 (or float16, SCALED), R = B * N * Hq
    part_lse_ptr,  # [NUM_SPLITS, R] float32 (SCALED: then the partials' [NUM_SPLITS, R] scales)
    out_ptr,  # [R, D] q.dtype
    R, D,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    SCALED: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M): the splits' softmaxes recombined,
    BLOCK_R rows a program, every load issued at once. The partials are a [splits, rows, D]
    block with the splits outermost: the layout then keeps a value's splits in one thread (the
    sum over them is a thread's own adds; warps lie along the rows), where a [rows, splits, D]
    block put its warps along the splits (a cross-warp reduction: ~15 instructions a value)."""
    wait_for_prior_grids(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    merged = _merge_splits(part_o_ptr, part_lse_ptr, rows, rows < R, offs_d, offs_d < D, R, D,
                           NUM_SPLITS, BLOCK_S, BLOCK_S, SCALED)
    out_mask = (rows < R)[:, None] & (offs_d < D)[None, :]
    tl.store(out_ptr + rows[:, None] * D + offs_d[None, :], merged.to(out_ptr.dtype.element_ty), mask=out_mask)


# Partial values a merge program holds: next_pow2(splits) x rows x head dim = 16,384 (128 fp32 a
# thread at 4 warps: 8 splits x 16 rows at D 128, 32 splits x 4 rows; more spills at D 256).
MERGE_VALUES = 16_384


def merge_rows(block_s: int, block_d: int) -> int:
    """Rows a merge program recombines for a [``block_s`` splits, rows, ``block_d``] block of
    partials (at least 2)."""
    return max(2, MERGE_VALUES // (block_s * block_d))


def _fits_int32(tensor: torch.Tensor) -> bool:
    """Whether every element offset of ``tensor`` (and every partial sum of one, the strides
    being non-negative) is below 2^31: the kernel may then compute its offsets in int32."""
    if any(s < 0 for s in tensor.stride()):
        return False
    return sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1 < 2**31


def _launch(q, k_cache, v_cache, cache_seqlens, tree_mask=None, *, block_table=None, sm_scale=None,
            num_splits=None, fold_merge=None, config: TreeAttentionConfig | None = None):
    """Launcher: validate → reject unsupported layouts → allocate → grid → launch.
    ``num_splits`` overrides the flash-decoding split count (tests), ``fold_merge`` the choice
    between merging the splits in their last programs and a merge launch (``folds_merge``);
    ``config`` overrides the
    configuration: :func:`gpu_config`, or INTERPRETER_CONFIG when the kernel runs interpreted
    (tests run GPU configurations interpreted; bench/gpu_goals.py sweeps them)."""
    _checks.check_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask,
                                 block_table=block_table, sm_scale=sm_scale)
    if q.dtype == torch.float64:
        raise ValueError("q: expected dtype float32, float16 or bfloat16 for the triton path, got torch.float64")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:
            raise ValueError(f"{name}: expected a dense last (head) dim, got strides {tuple(cache.stride())}")
    B, N, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    out = torch.empty(B, N, Hq, D, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()  # a copy of q only; the caches are never copied
    # Index tensors are small: made contiguous so that the kernel indexes them flat.
    seqlens = cache_seqlens.contiguous()
    paged = block_table is not None
    table = block_table.contiguous() if paged else seqlens  # placeholder pointer when unused
    causal = tree_mask is None
    mask = seqlens if causal else tree_mask.contiguous()
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    if scale < 0:
        # The kernel keeps running maxima of the raw scores q . k and folds a positive scale into
        # the exponent: s (q . k) = |s| ((-q) . k), negation exact in every dtype.
        q, scale = -q, -scale

    interpret = interpreted(_tree_attention_kernel)
    on_gpu = q.device.type == "cuda"
    capacity = _checks.kv_capacity(k_cache, block_table)
    sms = sm_count(q.device)
    if config is None:
        # B x Hkv (request, KV head) pairs: enough of them take one 256-row block each (wide_blocks),
        # few over a short cache smaller blocks (gpu_config with the capacity).
        config = INTERPRETER_CONFIG if interpret else gpu_config(
            N, group, D, q.dtype, causal, paged, heads=B * Hkv, sms=sms, capacity=capacity if on_gpu else None)
    block_d = max(16, triton.next_power_of_2(D))
    block_k = config.block_k
    if 64 % block_k:
        raise ValueError(f"config: block_k must divide 64 (one mask word per row and tile), got {block_k}")
    layout = split_layout(N, group, B * Hkv, capacity, config, sms)
    block_m, programs = layout.block_m, layout.blocks
    nodes = block_m // group
    if num_splits is not None:
        splits = int(num_splits)
    else:
        splits = layout.splits if on_gpu else 1
    # bf16 inputs: fp16 partials scaled per row (partial_dtype); fp16 and fp32 keep fp32 partials.
    scaled = partial_dtype(q.dtype) == torch.float16
    if splits > 1:
        part_o = torch.empty(splits, B * N * Hq, D, dtype=partial_dtype(q.dtype), device=q.device)
        part_lse = torch.empty(2 if scaled else 1, splits, B * N * Hq, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    if fold_merge is None:
        fold_merge = folds_merge(splits, layout.rows, D, part_o.element_size())
    fold_merge = bool(fold_merge) and splits > 1
    block_s = max(2, triton.next_power_of_2(splits))
    upcast, precision = dot_mode(_tree_attention_kernel, q.dtype)
    options = {} if config.max_registers is None else {"maxnreg": config.max_registers}
    page_size = k_cache.shape[1] if paged else 1
    # 16-bit inputs: lazy rescaling and a compile-time page size; fp32 (FMA dots, registers
    # full) keeps the eager rescale and the runtime page size, which spill nothing in its loops.
    sixteen_bit = q.dtype != torch.float32
    max_pages = table.shape[1] if paged else 1
    compile_page = page_size if sixteen_bit else 0
    if not paged:
        tile_mode = 1
    elif compile_page and block_k % compile_page == 0:
        tile_mode = 2
    elif compile_page and compile_page % block_k == 0:
        tile_mode = 3
    else:
        tile_mode = 0
    _tree_attention_kernel[(programs, splits)](
        q, k_cache, v_cache, seqlens, mask, table, out, part_o, part_lse,
        tickets(q.device, programs) if fold_merge else seqlens,
        N, Hq, Hkv, D, mask.shape[-1] if not causal else 1, page_size, max_pages,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group, NODES=nodes, NODE_BLOCKS=triton.cdiv(N, nodes), BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_D=block_d,
        NUM_SPLITS=splits, PAGE_SIZE=compile_page, IS_PAGED=paged, IS_CAUSAL=causal,
        EVEN_D=block_d == D, UPCAST=upcast, DOT_PRECISION=precision, LAZY_RESCALE=sixteen_bit,
        INT32_OFFSETS=all(map(_fits_int32, (q, k_cache, v_cache))) and splits * out.numel() < 2**31,
        SHARED_KV_OFFSETS=k_cache.stride() == v_cache.stride(), TILE_MODE=tile_mode, SCALED_PARTIALS=scaled,
        FOLD_MERGE=fold_merge, BLOCK_S=block_s,
        SPLIT_CHUNK=fold_chunk(splits, block_m, block_d, config.num_warps),
        **launch_options(q.device), num_warps=config.num_warps, num_stages=config.num_stages, **options,
    )
    if splits > 1 and not fold_merge:
        block_r = merge_rows(block_s, block_d)
        _tree_attention_merge_kernel[(triton.cdiv(B * N * Hq, block_r),)](
            part_o, part_lse, out, B * N * Hq, D,
            NUM_SPLITS=splits, BLOCK_S=block_s, BLOCK_R=block_r, BLOCK_D=block_d, SCALED=scaled,
            **launch_options(out.device), num_warps=4,
        )
    return out


def tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask=None, *, block_table=None, sm_scale=None,
                   _config: TreeAttentionConfig | None = None):
    """Triton tree attention with the contract signature; see
    :func:`eagle_kernels.reference.tree_attention` for shapes and semantics.

    Shapes
    ------
    q [B, N, Hq, D] (fp32/fp16/bf16, any strides); k_cache, v_cache [B, S, Hkv, D] or paged
    [P, page_size, Hkv, D] (dense last dim) with block_table int32 [B, max_pages];
    cache_seqlens int32 [B]; tree_mask int64 [B, N, ceil(N / 64)] or None (causal).
    Returns [B, N, Hq, D] in q.dtype. ``_config`` overrides the launch configuration (tests).
    """
    return _launch(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table=block_table, sm_scale=sm_scale,
                   config=_config)
