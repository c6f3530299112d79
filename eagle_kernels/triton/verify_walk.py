"""The kernel of Triton ``verify`` (the overview is in ``verify.py``): one program per request
descends its tree, computing each visited row's scalars with ``verify_rows.py`` when it gets
there, accepting or rejecting each drafted child and drawing the bonus token by inverse CDF,
with Philox4x32-10 coins in-kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .verify_rows import (
    NUM_STATS,
    _finite_argmax,
    _row_max,
    _sampling_stats,
    STAT_CUT,
    STAT_DENOM,
    STAT_KTH,
    STAT_MASS,
    STAT_MAX,
    STAT_NORM,
    _probs,
    _scaled,
    _weights,
)

PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
ACCEPT_DRAW = tl.constexpr(0)
BONUS_DRAW = tl.constexpr(1)


@triton.jit
def _uniform(seed, offset, nodes, DRAW: tl.constexpr):
    """U in [0, 1) (float64, 53 bits) of the stream at (seed, offset, node, DRAW) for every
    entry of the int32 tensor ``nodes``; seed and offset are int64 scalars."""
    c2 = nodes.to(tl.uint32)
    zero = c2 * 0
    k0 = zero + (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = zero + ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = zero + (offset & 0xFFFFFFFF).to(tl.uint32)
    c1 = zero + ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c3 = zero + DRAW
    for round_index in tl.static_range(10):
        if round_index > 0:
            k0 = tl.add(k0, PHILOX_W0, sanitize_overflow=False)
            k1 = tl.add(k1, PHILOX_W1, sanitize_overflow=False)
        hi0 = tl.umulhi(c0, PHILOX_M0)
        lo0 = tl.mul(c0, PHILOX_M0, sanitize_overflow=False)
        hi1 = tl.umulhi(c2, PHILOX_M1)
        lo1 = tl.mul(c2, PHILOX_M1, sanitize_overflow=False)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    bits53 = ((c0 >> 5).to(tl.uint64) << 26) | (c1 >> 6).to(tl.uint64)
    return bits53.to(tl.float64) * 1.1102230246251565e-16  # 2**-53


@triton.jit
def _zero_rejected(w, ids, tokens_row, node, N, rejected, offs_n):
    """w with the tokens of the node's rejected children (``rejected`` flags over nodes) at 0."""
    for c in range(node + 1, N):
        if tl.sum(tl.where(offs_n == c, rejected, 0), axis=0) != 0:
            w = tl.where(ids == tl.load(tokens_row + c), 0.0, w)
    return w


@triton.jit
def _residual_tile(row, start, V, row_max, t, kth, denom, cut, norm, tokens_row, node, N, rejected, offs_n,
                   ZERO_REJECTED: tl.constexpr, CT: tl.constexpr, BLOCK_V: tl.constexpr):
    """Token ids and float64 weights w of one tile of a row; with ZERO_REJECTED, the tokens of
    the node's rejected children at 0."""
    offs = start + tl.arange(0, BLOCK_V)
    valid = offs < V
    s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
    w = tl.where(valid, _weights(_probs(s, kth, denom, CT), cut, norm, CT), 0.0).to(tl.float64)
    if ZERO_REJECTED:
        w = _zero_rejected(w, offs, tokens_row, node, N, rejected, offs_n)
    return offs, valid, w


@triton.jit
def _inverse_cdf(row, V, row_max, t, kth, denom, cut, norm, u, tokens_row, node, N, rejected, offs_n, sums_row,
                 CT: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """Smallest x with cumsum64(w)[x] > u * sum(w) over the residual row (the node's rejected
    children's tokens at 0); the largest x with w[x] > 0 if none. The row's mass pass stored
    every tile's float64 sum at ``sums_row``; the tiles of rejected tokens are summed again
    with them at 0, then the running tile sums name the one tile to scan."""
    n_tiles = tl.cdiv(V, BLOCK_V)
    tl.debug_barrier()
    for c in range(node + 1, N):
        if tl.sum(tl.where(offs_n == c, rejected, 0), axis=0) != 0:
            hit = (tl.load(tokens_row + c) // BLOCK_V).to(tl.int32)
            offs, valid, w = _residual_tile(row, hit * BLOCK_V, V, row_max, t, kth, denom, cut, norm, tokens_row,
                                            node, N, rejected, offs_n, True, CT, BLOCK_V)
            tl.store(sums_row + hit, tl.sum(w, axis=0))
    tl.debug_barrier()
    tiles = tl.arange(0, BLOCK_T)
    sums = tl.load(sums_row + tiles, mask=tiles < n_tiles, other=0.0)
    target = u * tl.sum(sums, axis=0)
    running = tl.cumsum(sums, axis=0)
    tile = tl.min(tl.where(running > target, tiles, n_tiles), axis=0).to(tl.int32)
    found = V
    # Rounding inside a tile can disagree with its sum by the last bit: then the next tile.
    while (found == V) & (tile < n_tiles):
        carry = tl.sum(tl.where(tiles == tile, running - sums, 0.0), axis=0)
        offs, valid, w = _residual_tile(row, tile * BLOCK_V, V, row_max, t, kth, denom, cut, norm, tokens_row,
                                        node, N, rejected, offs_n, True, CT, BLOCK_V)
        found = tl.min(tl.where((tl.cumsum(w, axis=0) + carry > target) & valid, offs, V), axis=0)
        tile += 1
    if found == V:
        last_tile = tl.max(tl.where(sums > 0, tiles, -1), axis=0)
        found = 0
        if last_tile >= 0:
            offs, valid, w = _residual_tile(row, last_tile * BLOCK_V, V, row_max, t, kth, denom, cut, norm,
                                            tokens_row, node, N, rejected, offs_n, True, CT, BLOCK_V)
            found = tl.maximum(tl.max(tl.where(w > 0, offs, -1), axis=0), 0)
    return found


@triton.jit
def _bonus_from_list(index_ptr, scaled_ptr, listed, tokens_row, node, N, rejected, offs_n, kth, denom, cut, norm,
                     u, V, CT: tl.constexpr, NUM_CAND: tl.constexpr):
    """The inverse-CDF draw of _inverse_cdf over a row's candidate list: every token of
    positive weight is listed, in ascending id order, so the running sums are the same."""
    slots = tl.arange(0, NUM_CAND)
    index = tl.load(index_ptr + slots, mask=slots < listed, other=V)
    scaled = tl.load(scaled_ptr + slots, mask=slots < listed, other=float("-inf"))
    w = tl.where(slots < listed, _weights(_probs(scaled, kth, denom, CT), cut, norm, CT), 0.0).to(tl.float64)
    w = _zero_rejected(w, index, tokens_row, node, N, rejected, offs_n)
    target = u * tl.sum(w, axis=0)
    found = tl.min(tl.where(tl.cumsum(w, axis=0) > target, index, V), axis=0)
    last_positive = tl.max(tl.where(w > 0, index, -1), axis=0)
    return tl.where(found < V, found, tl.maximum(last_positive, 0))


@triton.jit
def _verify_kernel(
    tokens_ptr,  # [B, N] int64
    parents_ptr,  # [B, N] int32
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V
    temperature_ptr,  # [B] float32 (0 = greedy row)
    top_k_ptr,  # [B] int32 (0 = off)
    top_p_ptr,  # [B] float32 (1 = off)
    seed_ptr,  # [B] int64
    offset_ptr,  # [B] int64
    stats_ptr,  # [B, N, NUM_STATS] float64: the scalars of each visited sampling row (for tests)
    cand_count_ptr,  # [B, N] int32: list length of each visited sampling row, -1 without a list
    cand_index_ptr,  # [B, NUM_CAND] int32 scratch: the current row's candidate ids, ascending
    cand_scaled_ptr,  # [B, NUM_CAND] compute dtype scratch: their s
    tile_sums_ptr,  # [B, BLOCK_T] float64 scratch: per-tile sums of the current row's weights
    accept_len_ptr,  # [B] int32
    accept_nodes_ptr,  # [B, A] int32, A = max_depth + 1
    out_tokens_ptr,  # [B, A] int64
    status_ptr,  # [B] int32
    N, V, max_depth, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    SIG_BITS: tl.constexpr,  # leading order-key bits that vary (16 bf16, 19 fp16, 32 fp32, 64 fp64)
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_MAX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_T: tl.constexpr,  # next power of two of the BLOCK_V tiles per row
    RADIX_BITS: tl.constexpr,
    NUM_CAND: tl.constexpr,  # candidate list capacity; 0 turns the candidate path off
):
    """One program per request walks its tree; each visited row is read when the walk reaches
    it: the max pass (all a greedy row needs), then for a sampling row the levels pass and the
    candidate list (or the whole-row searches), the acceptance of its children and, at the
    last row, the bonus draw."""
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    b = tl.program_id(0).to(tl.int64)
    A = max_depth + 1
    temperature = tl.load(temperature_ptr + b)
    top_k = tl.load(top_k_ptr + b)
    top_p = tl.load(top_p_ptr + b)
    seed = tl.load(seed_ptr + b)
    offset = tl.load(offset_ptr + b)
    greedy = temperature == 0.0
    t = temperature.to(CT)
    logits_b = logits_ptr + b * stride_lb
    index_b = cand_index_ptr + b * NUM_CAND
    scaled_b = cand_scaled_ptr + b * NUM_CAND
    sums_b = tile_sums_ptr + b * BLOCK_T

    offs_n = tl.arange(0, BLOCK_N)
    parents = tl.load(parents_ptr + b * N + offs_n, mask=offs_n < N, other=-2)
    tokens = tl.load(tokens_ptr + b * N + offs_n, mask=offs_n < N, other=-1)
    # Every coin the walk may need, in two vectorised Philox calls: accept coin of each node
    # (as a child) and bonus coin of each node (as the last accepted node).
    accept_coins = _uniform(seed, offset, offs_n, ACCEPT_DRAW)
    bonus_coins = _uniform(seed, offset, offs_n, BONUS_DRAW)
    offs_a = tl.arange(0, BLOCK_A)
    tl.store(accept_nodes_ptr + b * A + offs_a, tl.where(offs_a == 0, 0, -1), mask=offs_a < A)
    tl.store(out_tokens_ptr + b * A + offs_a, tl.full([BLOCK_A], -1, tl.int64), mask=offs_a < A)
    # The walk's scalar stores below may come from other threads than these vector stores: order
    # them (without the barrier a late -1 can overwrite an emitted token).
    tl.debug_barrier()

    node = tl.zeros([], tl.int32)
    depth = tl.zeros([], tl.int32)
    done = tl.zeros([], tl.int32)
    bad = tl.zeros([], tl.int32)
    while done == 0:
        row = logits_b + node * stride_ln
        row_max, arg, row_bad = _row_max(row, V, CT, BLOCK_MAX)
        if row_bad != 0:
            bad = 1
            done = 1
        else:
            may_descend = depth < max_depth  # a node at max_depth is a leaf
            child = -1
            if greedy:
                hit = (parents == node) & (tokens == arg) & (offs_n > node) & may_descend
                first = tl.min(tl.where(hit, offs_n, BLOCK_N), axis=0)
                child = tl.where(first < BLOCK_N, first, -1)
                if child < 0:
                    tl.store(out_tokens_ptr + b * A + depth, arg.to(tl.int64))
                    done = 1
            else:
                count, kth, denom, cut, norm, mass = _sampling_stats(
                    row, V, row_max, t, top_k, top_p, index_b, scaled_b, sums_b, CT, IS_FP64, SIG_BITS,
                    BLOCK_V, BLOCK_S, RADIX_BITS, NUM_CAND)
                st = stats_ptr + (b * N + node) * NUM_STATS
                tl.store(st + STAT_MAX, row_max.to(tl.float64))
                tl.store(st + STAT_KTH, kth.to(tl.float64))
                tl.store(st + STAT_DENOM, denom.to(tl.float64))
                tl.store(st + STAT_CUT, cut.to(tl.float64))
                tl.store(st + STAT_NORM, norm.to(tl.float64))
                tl.store(st + STAT_MASS, mass)
                tl.store(cand_count_ptr + b * N + node, count)
                # Children of this node whose token was rejected: their weight is now 0.
                rejected = tl.zeros([BLOCK_N], tl.int32)
                if may_descend:
                    for c in range(node + 1, N):
                        parent = tl.load(parents_ptr + b * N + c)
                        if (parent == node) & (child < 0):
                            x = tl.load(tokens_ptr + b * N + c)
                            in_range = (x >= 0) & (x < V)
                            logit = tl.load(row + x, mask=in_range, other=float("-inf")).to(CT)
                            wx = _weights(_probs(_scaled(logit, row_max, t), kth, denom, CT), cut, norm, CT)
                            seen = tl.max(((rejected != 0) & (tokens == x)).to(tl.int32), axis=0)
                            wx = tl.where(seen != 0, 0.0, wx).to(CT)
                            u = tl.sum(tl.where(offs_n == c, accept_coins, 0.0), axis=0)
                            # w[x] > 0 first: a coin of 0 never accepts a zero-probability token.
                            if (wx > 0) & (u < wx.to(tl.float64) / mass):
                                child = c
                            elif wx > 0:  # reject: zero p(x) and renormalise
                                rejected = tl.where(offs_n == c, 1, rejected)
                                mass = mass - wx.to(tl.float64)
                if child < 0:
                    u = tl.sum(tl.where(offs_n == node, bonus_coins, 0.0), axis=0)
                    bonus = tl.full([], -1, tl.int32)
                    if NUM_CAND > 0:
                        if count >= 0:
                            bonus = _bonus_from_list(index_b, scaled_b, count, tokens_ptr + b * N, node, N, rejected,
                                                     offs_n, kth, denom, cut, norm, u, V, CT, NUM_CAND).to(tl.int32)
                    if bonus < 0:
                        bonus = _inverse_cdf(row, V, row_max, t, kth, denom, cut, norm, u, tokens_ptr + b * N, node,
                                             N, rejected, offs_n, sums_b, CT, BLOCK_V, BLOCK_T).to(tl.int32)
                    tl.store(out_tokens_ptr + b * A + depth, bonus.to(tl.int64))
                    done = 1
            if done == 0:
                depth += 1
                tl.store(accept_nodes_ptr + b * A + depth, child)
                tl.store(out_tokens_ptr + b * A + depth - 1, tl.load(tokens_ptr + b * N + child))
                node = child
    tl.debug_barrier()
    if bad != 0:
        # Accept nothing; the bonus is the argmax over the finite root logits (0 if none).
        fallback = _finite_argmax(logits_b, V, CT, BLOCK_MAX)
        tl.store(accept_nodes_ptr + b * A + offs_a, tl.where(offs_a == 0, 0, -1), mask=offs_a < A)
        tl.store(out_tokens_ptr + b * A + offs_a,
                 tl.where(offs_a == 0, fallback.to(tl.int64), -1), mask=offs_a < A)
        depth = 0
    tl.store(accept_len_ptr + b, depth)
    tl.store(status_ptr + b, bad)
