"""Triton ``verify``: greedy and lossless sampling verification of a draft tree, from logits.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) on trees with deterministic
draft children (EAGLE-2, Li et al. 2024, §4); semantics and random stream as in
``eagle_kernels/reference/verify.py`` and docs/design.md ("Counter-based random stream",
"verify details").

Four kernels. ``_verify_max_kernel`` reads every logit row once, split into chunks across
programs (a few rows still fill the GPU): chunk max, first argmax and NaN/+inf/finite flags.
``_verify_levels_kernel`` reads the sampling rows once more in the same chunks: the softmax sum
and the entries (and their softmax mass) at or above 16 levels of ``s``, for the candidate lists
below. ``_verify_rows_kernel`` runs one program per logit row (B * N programs): it merges the
chunks into the row's max, first argmax and bad-row flag (all a greedy row needs) and, for
sampling requests, computes in ``BLOCK_V`` tiles the top-k threshold ``kth`` (the k-th
largest ``s = (logits - max) / T``), the softmax normaliser ``denom`` (float64 sum of
``exp(s)`` over ``s >= kth``), the top-p threshold ``cut``, the top-p normaliser ``norm`` and
the float64 mass of the final weights. Both thresholds come from a radix-16 search over the
order keys of the logits themselves, counting (top-k) or summing ``p`` over (top-p) the keys
at or above 15 candidates per pass: ``s`` and ``p`` are monotone in the logit, so ``kth`` is
``s`` of the k-th largest logit and ``cut`` is ``p`` of the logit found, and bf16/fp16 rows
need only the passes for their 16/19 significant key bits. ``s`` and ``p`` are recomputed
from the logits in every pass instead of being stored. Every weight is then a pure function
of its logit and the row's scalars::

    p(x) = [s(x) >= kth] * exp(s(x)) / denom,    w(x) = [p(x) >= cut] * p(x) / norm

and both filters are "keep x iff key >= threshold", which keeps ties together exactly as the
reference does. A row with top-k or top-p usually keeps few tokens, so before searching the
whole row the kernel tries a candidate list (``_candidate_stats``): from the levels kernel's
counts it picks the highest level that holds the top-k set or the nucleus in ``CANDIDATES``
slots, stores (id, s) of the entries at or above it in one more pass, and takes the
thresholds, normalisers and mass from that list sorted in registers: three reads of the row
in all instead of up to twenty. Rows the list cannot hold exactly (a flat distribution, a
nucleus reaching below the lowest level, temperature alone) take the search.

``_verify_walk_kernel`` runs one program per request: greedy steps read the stored argmax; a
sampling step evaluates ``w`` only at the drafted tokens and removes a rejected token's weight
from the float64 mass; the bonus draw (inverse CDF, a float64 running sum in token order) runs
over the row's candidate list, or else over the whole row in one pass that stores per-tile
sums, then scans the one tile where the running sum passes the coin. Philox4x32-10 runs
in-kernel on uint32 words.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _checks
from .._types import VerifyOutput

# Bits per radix digit of the threshold searches: 16 candidates per pass on the GPU (the
# [BLOCK_V, 16] comparison stays in registers); 256 under the interpreter, where the cost is
# per operation rather than per element, so half the passes run twice as fast.
RADIX_BITS = 8 if os.environ.get("TRITON_INTERPRET") == "1" else 4

# Leading bits of the order key (of the logit widened to the compute dtype) that can differ
# between logits of each input dtype: the threshold searches skip the rest.
SIGNIFICANT_KEY_BITS = {torch.bfloat16: 16, torch.float16: 19, torch.float32: 32, torch.float64: 64}
# Rows per tile of the threshold searches: their [SEARCH_BLOCK, 2^RADIX_BITS] accumulator
# (float64 for top-p) stays in registers at 4 warps.
SEARCH_BLOCK = 256
# Candidate lists (see _candidate_stats): capacity, and the levels of s = (logit - max) / T
# tried for the list's lower bound: -PIVOT_STEP * (1 .. NUM_PIVOTS).
CANDIDATES = 32 if os.environ.get("TRITON_INTERPRET") == "1" else 1024
NUM_PIVOTS = tl.constexpr(16)
# The max pass (_verify_max_kernel): tile, and at most this many chunks per row.
MAX_BLOCK = 64 if os.environ.get("TRITON_INTERPRET") == "1" else 2048
MAX_SPLITS = 64
PIVOT_STEP = tl.constexpr(1.5)

PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
ACCEPT_DRAW = tl.constexpr(0)
BONUS_DRAW = tl.constexpr(1)
# Slots of the per-row float64 statistics written by _verify_rows_kernel.
STAT_MAX = tl.constexpr(0)  # row max (NaN ignored)
STAT_KTH = tl.constexpr(1)  # top-k threshold on s (-inf when off)
STAT_DENOM = tl.constexpr(2)  # softmax normaliser, rounded to the compute dtype
STAT_CUT = tl.constexpr(3)  # top-p threshold on p (-inf when off)
STAT_NORM = tl.constexpr(4)  # top-p normaliser, rounded to the compute dtype (1 when off)
STAT_MASS = tl.constexpr(5)  # float64 sum of the weights w
NUM_STATS = tl.constexpr(6)


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
def _order_key(x, IS_FP64: tl.constexpr):
    """Unsigned key, monotone in the value; -0.0 and +0.0 share a key as they compare equal."""
    x = tl.where(x == 0, 0.0, x).to(x.dtype)
    if IS_FP64:
        u = x.to(tl.uint64, bitcast=True)
        sign = u >> 63
        return tl.where(sign == 1, ~u, u | 0x8000000000000000)
    else:
        u = x.to(tl.uint32, bitcast=True)
        sign = u >> 31
        return tl.where(sign == 1, ~u, u | 0x80000000)


@triton.jit
def _scaled(logits, row_max, t):
    """s = (logits - max) / T in the compute dtype. Shift before dividing: a tiny T sends the
    other logits to -inf, never the max to +inf."""
    return (logits - row_max) / t


@triton.jit
def _probs(s, kth, denom, CT: tl.constexpr):
    """Softmax of the top-k-filtered s. The scaled max is exactly 0 and survives top-k, so
    the softmax needs no second shift."""
    e = tl.where(s >= kth, tl.exp(s), 0.0).to(CT)
    return e / denom


@triton.jit
def _weights(p, cut, norm, CT: tl.constexpr):
    """Top-p filter and renormalisation; cut = -inf and norm = 1 leave p unchanged."""
    return tl.where(p >= cut, p / norm, 0.0).to(CT)


@triton.jit
def _threshold_key(row_ptr, V, row_max, t, kth, denom, target, IS_TOP_P: tl.constexpr, CT: tl.constexpr,
                   IS_FP64: tl.constexpr, SIG_BITS: tl.constexpr, BLOCK_S: tl.constexpr, RADIX_BITS: tl.constexpr):
    """Radix search, most significant digit first, over the order keys of the logits (as CT
    values): the largest key P with F(P) >= target, where F(P) counts the entries with
    key >= P (top-k, target k) or sums their p (top-p, target top_p). Returns the logit
    value whose key is P.

    s and p are monotone in the logit, so the k-th largest s is s of the k-th largest logit
    and the lowest kept level of p is p of the logit found here: the search needs no s or p
    for top-k, and only the leading SIG_BITS key bits vary for logits widened from 16 bits
    (bf16: 16, fp16: 19), so those take half the passes of fp32. Each digit of RADIX_BITS bits
    is one pass that evaluates the candidates P + j * 2^shift, j >= 1, into a [BLOCK_S, 2^R]
    accumulator reduced once per pass."""
    if IS_FP64:
        KT: tl.constexpr = tl.uint64
        KEY_BITS: tl.constexpr = 64
    else:
        KT: tl.constexpr = tl.uint32
        KEY_BITS: tl.constexpr = 32
    LEVELS: tl.constexpr = (SIG_BITS + RADIX_BITS - 1) // RADIX_BITS
    LOW_BITS: tl.constexpr = KEY_BITS - LEVELS * RADIX_BITS
    lanes = tl.arange(0, 1 << RADIX_BITS)
    prefix = tl.zeros([], dtype=KT)
    for level in tl.static_range(LEVELS):
        shift = KEY_BITS - RADIX_BITS * (level + 1)
        candidates = prefix + (lanes.to(KT) << shift)  # lane 0 is never counted
        if IS_TOP_P:
            acc = tl.zeros([BLOCK_S, 1 << RADIX_BITS], dtype=tl.float64)
        else:
            acc = tl.zeros([BLOCK_S, 1 << RADIX_BITS], dtype=tl.int32)
        for start in range(0, V, BLOCK_S):
            # [BLOCK_S, 1] tiles: loaded in the accumulator's 2-D layout, no per-tile shuffle
            offs = start + tl.arange(0, BLOCK_S)[:, None]
            valid = offs < V
            logits = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(CT)
            above = (_order_key(logits, IS_FP64) >= candidates[None, :]) & valid
            if IS_TOP_P:
                p = _probs(_scaled(logits, row_max, t), kth, denom, CT)
                acc += tl.where(above, p.to(tl.float64), 0.0)
            else:
                acc += above.to(tl.int32)
        if IS_TOP_P:
            totals = tl.sum(acc, axis=0)
        else:
            totals = tl.sum(acc, axis=0).to(tl.float64)
        digit = tl.sum(((totals >= target) & (lanes > 0)).to(tl.int32), axis=0)
        prefix = prefix + (digit.to(KT) << shift)
    if LOW_BITS > 0:
        # Below the searched bits a widened 16-bit logit's key is all zeros (x >= 0) or all
        # ones (x < 0, whose key is the complement): restore them to land on the entry itself.
        low = (tl.full([], 1, KT) << LOW_BITS) - 1
        prefix = tl.where((prefix >> (KEY_BITS - 1)) == 0, prefix | low, prefix)
    # Every entry has key >= key(-inf): F(key(-inf)) is everything. Only a top-p target above
    # the rounded total mass fails there, and then every token is kept.
    prefix = tl.maximum(prefix, _order_key(tl.full([], float("-inf"), CT), IS_FP64))
    # Back from key to value (the key order is the value order).
    if IS_FP64:
        bits = tl.where((prefix >> 63) == 1, prefix & 0x7FFFFFFFFFFFFFFF, ~prefix)
        return bits.to(tl.float64, bitcast=True)
    else:
        bits = tl.where((prefix >> 31) == 1, prefix & 0x7FFFFFFF, ~prefix)
        return bits.to(tl.float32, bitcast=True)


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
    children's tokens at 0); the largest x with w[x] > 0 if none. One pass stores every
    tile's float64 sum (the tiles of rejected tokens are summed again with them at 0); the
    running tile sums then name the one tile to scan."""
    n_tiles = tl.cdiv(V, BLOCK_V)
    for tile in range(0, n_tiles):
        offs, valid, w = _residual_tile(row, tile * BLOCK_V, V, row_max, t, kth, denom, cut, norm, tokens_row,
                                        node, N, rejected, offs_n, False, CT, BLOCK_V)
        tl.store(sums_row + tile, tl.sum(w, axis=0))
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
def _full_row_stats(row, V, row_max, t, top_k, top_p, use_k, use_p, total, CT: tl.constexpr, IS_FP64: tl.constexpr,
                    SIG_BITS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, RADIX_BITS: tl.constexpr):
    """kth, denom, cut, norm, mass of a sampling row from passes over the whole row; ``total``
    (the softmax sum over the row) is the normaliser when top-k is off."""
    kth = tl.full([], float("-inf"), CT)
    one = tl.full([], 1.0, CT)
    denom = total.to(CT)
    if use_k:
        kth_logit = _threshold_key(row, V, row_max, t, kth, one, top_k.to(tl.float64), False,
                                   CT, IS_FP64, SIG_BITS, BLOCK_S, RADIX_BITS)
        kth = _scaled(kth_logit.to(CT), row_max, t)
        lane_total = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < V
            s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
            lane_total += tl.where(valid & (s >= kth), tl.exp(s), 0.0).to(CT).to(tl.float64)
        denom = tl.sum(lane_total, axis=0).to(CT)
    cut = tl.full([], float("-inf"), CT)
    norm = one
    if use_p:
        cut_logit = _threshold_key(row, V, row_max, t, kth, denom, top_p.to(tl.float64), True,
                                   CT, IS_FP64, SIG_BITS, BLOCK_S, RADIX_BITS)
        cut = _probs(_scaled(cut_logit.to(CT), row_max, t), kth, denom, CT)
        lane_kept = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < V
            s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
            p = _probs(s, kth, denom, CT)
            lane_kept += tl.where(valid & (p >= cut), p.to(tl.float64), 0.0)
        norm = tl.sum(lane_kept, axis=0).to(CT)
    lane_mass = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < V
        s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
        w = _weights(_probs(s, kth, denom, CT), cut, norm, CT)
        lane_mass += tl.where(valid, w, 0.0).to(tl.float64)
    return kth, denom, cut, norm, tl.sum(lane_mass, axis=0)


@triton.jit
def _candidate_stats(row, V, row_max, t, top_k, top_p, use_k, use_p, total, level_counts, level_sums,
                     index_ptr, scaled_ptr, CT: tl.constexpr, BLOCK_V: tl.constexpr, NUM_CAND: tl.constexpr):
    """The same scalars from a short candidate list, when one holds every token the filters
    keep. _verify_levels_kernel has counted the entries and summed their exp(s) at or above
    NUM_PIVOTS levels of s (``level_counts``, ``level_sums``; ``total`` = the sum over the
    row); one pass stores the entries at or above the highest level that can hold the top-k
    set and the nucleus in at most NUM_CAND slots (ascending token ids); thresholds,
    normalisers and mass then come from the sorted list. Returns count = -1 where no level
    fits (or the sorted list shows the nucleus reaching below the level): the caller then
    searches the whole row."""
    levels = -PIVOT_STEP * (tl.arange(0, NUM_PIVOTS) + 1).to(CT)  # [NUM_PIVOTS] levels of s
    # A level fits when it holds the k largest (top-k) or, without top-k, clearly more than the
    # top_p share of the softmax mass (the sorted list checks it exactly below), in NUM_CAND slots.
    need = tl.where(use_k, top_k, 1)
    fits = (level_counts >= need) & (level_counts <= NUM_CAND) \
        & (use_k | (level_sums.to(tl.float64) >= top_p.to(tl.float64) * total * 1.0001))
    first = tl.min(tl.where(fits, tl.arange(0, NUM_PIVOTS), NUM_PIVOTS), axis=0)
    kth = tl.full([], float("-inf"), CT)
    one = tl.full([], 1.0, CT)
    denom = total.to(CT)
    cut = tl.full([], float("-inf"), CT)
    norm = one
    mass = tl.zeros([], dtype=tl.float64)
    count = -1
    if first < NUM_PIVOTS:
        level = tl.sum(tl.where(tl.arange(0, NUM_PIVOTS) == first, levels, 0.0), axis=0).to(CT)
        stored = 0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < V
            s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
            keep = valid & (s >= level)
            slot = stored + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(index_ptr + slot, offs, mask=keep & (slot < NUM_CAND))
            tl.store(scaled_ptr + slot, s, mask=keep & (slot < NUM_CAND))
            stored += tl.sum(keep.to(tl.int32), axis=0)
        tl.debug_barrier()  # the list is read back by other threads of this program
        slots = tl.arange(0, NUM_CAND)
        listed = tl.load(scaled_ptr + slots, mask=slots < stored, other=float("-inf"))
        ranked = tl.sort(listed, descending=True)
        if use_k:
            kth = tl.max(tl.where(slots == top_k - 1, ranked, float("-inf")), axis=0)
            e = tl.where(ranked >= kth, tl.exp(ranked), 0.0).to(CT)
            denom = tl.sum(e.to(tl.float64), axis=0).to(CT)
        p = _probs(ranked, kth, denom, CT)
        count = stored
        if use_p:
            # Most probable first: the first rank whose running mass reaches top_p sets the cut
            # (ties at the cut are kept by p >= cut).
            running = tl.cumsum(p.to(tl.float64), axis=0)
            first_rank = tl.min(tl.where(running >= top_p.to(tl.float64), slots, NUM_CAND), axis=0)
            if first_rank < NUM_CAND:
                cut = tl.max(tl.where(slots == first_rank, p, float("-inf")), axis=0)
            elif use_k == 0:
                count = -1  # the nucleus reaches below the listed level
            if use_k == 0:
                # Every unlisted token has s < level: clear of the cut by a margin of e in
                # p, so no unlisted token can tie with it.
                if cut < (tl.exp(level + 1.0) / denom).to(CT):
                    count = -1
            norm = tl.sum(tl.where(p >= cut, p.to(tl.float64), 0.0), axis=0).to(CT)
        mass = tl.sum(_weights(p, cut, norm, CT).to(tl.float64), axis=0)
    return count, kth, denom, cut, norm, mass


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
def _any_flags(flags):
    """OR of the chunks' flag words (bit 0: NaN or +inf seen, bit 1: a finite entry seen)."""
    return tl.max(flags & 1, axis=0) | tl.max(flags & 2, axis=0)


@triton.jit
def _is_bad(flags):
    """A row is bad with NaN or +inf anywhere, or no finite entry (-inf alone is a mask)."""
    return ((flags & 1) != 0) | ((flags & 2) == 0)


@triton.jit
def _verify_max_kernel(
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V
    part_max_ptr,  # [B, N, SPLITS] compute dtype: chunk max (NaN ignored; -inf if none above)
    part_arg_ptr,  # [B, N, SPLITS] int32: the chunk's first index holding its max (V if none)
    part_flags_ptr,  # [B, N, SPLITS] int32: bit 0 NaN or +inf seen, bit 1 a finite entry seen
    N, V, chunk, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """First pass over the logits, split into SPLITS chunks of ``chunk`` entries per row so
    that a few rows still spread over the whole GPU (program (row, split)). A lane keeps its
    first maximum (NaN never compares greater), so the smallest index among the lanes holding
    the chunk max is the chunk's first argmax."""
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row = logits_ptr + (pid // N) * stride_lb + (pid % N) * stride_ln
    lane_max = tl.full([BLOCK_V], float("-inf"), CT)
    lane_arg = tl.full([BLOCK_V], V, tl.int32)
    lane_flags = tl.zeros([BLOCK_V], tl.int32)
    end = tl.minimum(split * chunk + chunk, V)
    for start in range(split * chunk, end, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < end
        x = tl.load(row + offs, mask=valid, other=float("-inf")).to(CT)
        lane_flags = lane_flags | (valid & ((x != x) | (x == float("inf")))).to(tl.int32) \
            | ((valid & (x > float("-inf")) & (x < float("inf"))).to(tl.int32) * 2)
        better = valid & (x > lane_max)
        lane_arg = tl.where(better, offs, lane_arg)
        lane_max = tl.where(better, x, lane_max)
    chunk_max = tl.max(lane_max, axis=0)
    out = pid * SPLITS + split
    tl.store(part_max_ptr + out, chunk_max)
    tl.store(part_arg_ptr + out, tl.min(tl.where(lane_max == chunk_max, lane_arg, V), axis=0))
    tl.store(part_flags_ptr + out, _any_flags(lane_flags))


@triton.jit
def _verify_levels_kernel(
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V
    temperature_ptr,  # [B] float32 (0 = greedy row: nothing to do)
    part_max_ptr,  # [B, N, SPLITS] compute dtype, from _verify_max_kernel
    part_flags_ptr,  # [B, N, SPLITS] int32, from _verify_max_kernel
    part_total_ptr,  # [B, N, SPLITS] float64: the chunk's sum of exp(s)
    part_counts_ptr,  # [B, N, SPLITS, NUM_PIVOTS] int32: entries with s at or above each level
    part_sums_ptr,  # [B, N, SPLITS, NUM_PIVOTS] float32: their sum of exp(s)
    N, V, chunk, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Second pass over a sampling row, in the max pass's chunks (program (row, split)): the
    softmax sum and, at the NUM_PIVOTS levels -PIVOT_STEP * (1 .. NUM_PIVOTS) of
    s = (logit - max) / T, the entries at or above the level and their exp(s)."""
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temperature = tl.load(temperature_ptr + pid // N)
    chunks = tl.arange(0, BLOCK_SPLITS)
    flags = tl.load(part_flags_ptr + pid * SPLITS + chunks, mask=chunks < SPLITS, other=0)
    bad = _is_bad(_any_flags(flags))
    if (temperature != 0.0) & (bad == 0):  # a bad row is never sampled from
        row = logits_ptr + (pid // N) * stride_lb + (pid % N) * stride_ln
        row_max = tl.max(tl.load(part_max_ptr + pid * SPLITS + chunks, mask=chunks < SPLITS,
                                 other=float("-inf")), axis=0)
        t = temperature.to(CT)
        levels = -PIVOT_STEP * (tl.arange(0, NUM_PIVOTS) + 1).to(CT)
        counts = tl.zeros([BLOCK_S, NUM_PIVOTS], dtype=tl.int32)
        sums = tl.zeros([BLOCK_S, NUM_PIVOTS], dtype=tl.float32)
        lane_total = tl.zeros([BLOCK_S, 1], dtype=tl.float64)
        end = tl.minimum(split * chunk + chunk, V)
        for start in range(split * chunk, end, BLOCK_S):
            # [BLOCK_S, 1] tiles: loaded in the accumulators' 2-D layout, no per-tile shuffle
            offs = start + tl.arange(0, BLOCK_S)[:, None]
            valid = offs < end
            s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
            e = tl.where(valid, tl.exp(s), 0.0).to(CT)
            lane_total += e.to(tl.float64)
            at_or_above = valid & (s >= levels[None, :])
            counts += at_or_above.to(tl.int32)
            sums += tl.where(at_or_above, e.to(tl.float32), 0.0)
        out = pid * SPLITS + split
        tl.store(part_total_ptr + out, tl.sum(tl.sum(lane_total, axis=1), axis=0))
        tl.store(part_counts_ptr + out * NUM_PIVOTS + tl.arange(0, NUM_PIVOTS), tl.sum(counts, axis=0))
        tl.store(part_sums_ptr + out * NUM_PIVOTS + tl.arange(0, NUM_PIVOTS), tl.sum(sums, axis=0))


@triton.jit
def _verify_rows_kernel(
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V
    temperature_ptr,  # [B] float32 (0 = greedy row)
    top_k_ptr,  # [B] int32 (0 = off)
    top_p_ptr,  # [B] float32 (1 = off)
    stats_ptr,  # [B, N, NUM_STATS] float64, slots STAT_*; written for sampling rows
    argmax_ptr,  # [B, N] int32: first argmax; node 0 of a bad root row: its fallback token
    bad_ptr,  # [B, N] int32: 1 where the row holds NaN / +inf or no finite entry
    part_max_ptr,  # [B, N, SPLITS] compute dtype, from _verify_max_kernel
    part_arg_ptr,  # [B, N, SPLITS] int32
    part_flags_ptr,  # [B, N, SPLITS] int32
    part_total_ptr,  # [B, N, SPLITS] float64, from _verify_levels_kernel (sampling rows)
    part_counts_ptr,  # [B, N, SPLITS, NUM_PIVOTS] int32
    part_sums_ptr,  # [B, N, SPLITS, NUM_PIVOTS] float32
    cand_count_ptr,  # [B, N] int32: entries in the row's candidate list, -1 where it has none
    cand_index_ptr,  # [B, N, NUM_CAND] int32: candidate token ids, ascending
    cand_scaled_ptr,  # [B, N, NUM_CAND] compute dtype: their s
    N, V, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    SIG_BITS: tl.constexpr,  # leading order-key bits that vary (16 bf16, 19 fp16, 32 fp32, 64 fp64)
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    NUM_CAND: tl.constexpr,  # candidate list capacity; 0 turns the candidate path off
    SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    """Per-row scalars of the walk (module docstring), one program per row (b, node).

    Every pass keeps per-lane partials ([BLOCK_V] or [BLOCK_S, 2^R]) and reduces them once at
    its end: a reduction across warps inside the loop would put a barrier in every tile."""
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    pid = tl.program_id(0).to(tl.int64)
    b = pid // N
    node = pid % N
    row = logits_ptr + b * stride_lb + node * stride_ln
    temperature = tl.load(temperature_ptr + b)
    top_k = tl.load(top_k_ptr + b)
    top_p = tl.load(top_p_ptr + b)

    # Max, first argmax and the bad-row flags, merged from _verify_max_kernel's chunks: the
    # smallest index among the chunks holding the row max is the row's first argmax.
    chunks = tl.arange(0, BLOCK_SPLITS)
    in_row = chunks < SPLITS
    chunk_max = tl.load(part_max_ptr + pid * SPLITS + chunks, mask=in_row, other=float("-inf"))
    chunk_arg = tl.load(part_arg_ptr + pid * SPLITS + chunks, mask=in_row, other=V)
    chunk_flags = tl.load(part_flags_ptr + pid * SPLITS + chunks, mask=in_row, other=0)
    row_max = tl.max(chunk_max, axis=0)
    arg = tl.min(tl.where(chunk_max == row_max, chunk_arg, V), axis=0)
    arg = tl.where(arg < V, arg, 0)  # no entry above -inf: token 0
    bad = _is_bad(_any_flags(chunk_flags)).to(tl.int32)
    if (bad != 0) & (node == 0):
        # A bad row anywhere on the walk falls back to the argmax over the finite root logits
        # (0 if none). On a good root row that is the plain argmax already.
        lane_best = tl.full([BLOCK_V], float("-inf"), CT)
        lane_arg = tl.full([BLOCK_V], V, tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < V
            x = tl.load(row + offs, mask=valid, other=float("-inf")).to(CT)
            finite = valid & (x > float("-inf")) & (x < float("inf"))
            better = finite & ((lane_arg == V) | (x > lane_best))
            lane_arg = tl.where(better, offs, lane_arg)
            lane_best = tl.where(better, x, lane_best)
        best = tl.max(tl.where(lane_arg < V, lane_best, float("-inf")), axis=0)
        arg = tl.min(tl.where((lane_arg < V) & (lane_best == best), lane_arg, V), axis=0)
        arg = tl.where(arg < V, arg, 0)
    tl.store(argmax_ptr + pid, arg)
    tl.store(bad_ptr + pid, bad)

    count = -1
    if (temperature != 0.0) & (bad == 0):
        t = temperature.to(CT)
        kth = tl.full([], float("-inf"), CT)
        one = tl.full([], 1.0, CT)
        denom = one
        cut = tl.full([], float("-inf"), CT)
        norm = one
        mass = tl.zeros([], dtype=tl.float64)
        use_k = (top_k > 0) & (top_k < V)
        use_p = top_p < 1.0
        total = tl.sum(tl.load(part_total_ptr + pid * SPLITS + chunks, mask=in_row, other=0.0), axis=0)
        if NUM_CAND > 0:
            if use_k | use_p:
                at = (pid * SPLITS + chunks)[:, None] * NUM_PIVOTS + tl.arange(0, NUM_PIVOTS)[None, :]
                level_counts = tl.sum(tl.load(part_counts_ptr + at, mask=in_row[:, None], other=0), axis=0)
                level_sums = tl.sum(tl.load(part_sums_ptr + at, mask=in_row[:, None], other=0.0), axis=0)
                count, kth, denom, cut, norm, mass = _candidate_stats(
                    row, V, row_max, t, top_k, top_p, use_k, use_p, total, level_counts, level_sums,
                    cand_index_ptr + pid * NUM_CAND, cand_scaled_ptr + pid * NUM_CAND, CT, BLOCK_V, NUM_CAND)
        if count < 0:
            kth, denom, cut, norm, mass = _full_row_stats(row, V, row_max, t, top_k, top_p, use_k, use_p, total,
                                                          CT, IS_FP64, SIG_BITS, BLOCK_V, BLOCK_S, RADIX_BITS)
        st = stats_ptr + pid * NUM_STATS
        tl.store(st + STAT_MAX, row_max.to(tl.float64))
        tl.store(st + STAT_KTH, kth.to(tl.float64))
        tl.store(st + STAT_DENOM, denom.to(tl.float64))
        tl.store(st + STAT_CUT, cut.to(tl.float64))
        tl.store(st + STAT_NORM, norm.to(tl.float64))
        tl.store(st + STAT_MASS, mass)
    tl.store(cand_count_ptr + pid, count)


@triton.jit
def _verify_walk_kernel(
    tokens_ptr,  # [B, N] int64
    parents_ptr,  # [B, N] int32
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V
    temperature_ptr,  # [B] float32 (0 = greedy row)
    seed_ptr,  # [B] int64
    offset_ptr,  # [B] int64
    stats_ptr,  # [B, N, NUM_STATS] float64 from _verify_rows_kernel
    argmax_ptr,  # [B, N] int32 from _verify_rows_kernel
    bad_ptr,  # [B, N] int32 from _verify_rows_kernel
    cand_count_ptr,  # [B, N] int32 from _verify_rows_kernel (-1: no candidate list)
    cand_index_ptr,  # [B, N, NUM_CAND] int32 from _verify_rows_kernel
    cand_scaled_ptr,  # [B, N, NUM_CAND] compute dtype from _verify_rows_kernel
    tile_sums_ptr,  # [B, BLOCK_T] float64 scratch: per-tile sums of the bonus row's residual weights
    accept_len_ptr,  # [B] int32
    accept_nodes_ptr,  # [B, A] int32, A = max_depth + 1
    out_tokens_ptr,  # [B, A] int64
    status_ptr,  # [B] int32
    N, V, max_depth, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_T: tl.constexpr,  # next power of two of the tiles per row
    NUM_CAND: tl.constexpr,
):
    """One program per request walks its tree from the per-row scalars."""
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    b = tl.program_id(0).to(tl.int64)
    A = max_depth + 1
    temperature = tl.load(temperature_ptr + b)
    seed = tl.load(seed_ptr + b)
    offset = tl.load(offset_ptr + b)
    greedy = temperature == 0.0
    t = temperature.to(CT)
    logits_b = logits_ptr + b * stride_lb

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
        if tl.load(bad_ptr + b * N + node) != 0:
            bad = 1
            done = 1
        else:
            may_descend = depth < max_depth  # a node at max_depth is a leaf
            child = -1
            if greedy:
                arg = tl.load(argmax_ptr + b * N + node)
                hit = (parents == node) & (tokens == arg) & (offs_n > node) & may_descend
                first = tl.min(tl.where(hit, offs_n, BLOCK_N), axis=0)
                child = tl.where(first < BLOCK_N, first, -1)
                if child < 0:
                    tl.store(out_tokens_ptr + b * A + depth, arg.to(tl.int64))
                    done = 1
            else:
                row = logits_b + node * stride_ln
                st = stats_ptr + (b * N + node) * NUM_STATS
                row_max = tl.load(st + STAT_MAX).to(CT)
                kth = tl.load(st + STAT_KTH).to(CT)
                denom = tl.load(st + STAT_DENOM).to(CT)
                cut = tl.load(st + STAT_CUT).to(CT)
                norm = tl.load(st + STAT_NORM).to(CT)
                # Children of this node whose token was rejected: their weight is now 0.
                rejected = tl.zeros([BLOCK_N], tl.int32)
                if may_descend:
                    mass = tl.load(st + STAT_MASS)
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
                    listed = tl.full([], -1, tl.int32)
                    if NUM_CAND > 0:
                        listed = tl.load(cand_count_ptr + b * N + node)
                    if listed >= 0:
                        bonus = _bonus_from_list(cand_index_ptr + (b * N + node) * NUM_CAND,
                                                 cand_scaled_ptr + (b * N + node) * NUM_CAND, listed,
                                                 tokens_ptr + b * N, node, N, rejected, offs_n,
                                                 kth, denom, cut, norm, u, V, CT, NUM_CAND)
                    else:
                        bonus = _inverse_cdf(row, V, row_max, t, kth, denom, cut, norm, u, tokens_ptr + b * N, node,
                                             N, rejected, offs_n, tile_sums_ptr + b * BLOCK_T, CT, BLOCK_V, BLOCK_T)
                    tl.store(out_tokens_ptr + b * A + depth, bonus.to(tl.int64))
                    done = 1
            if done == 0:
                depth += 1
                tl.store(accept_nodes_ptr + b * A + depth, child)
                tl.store(out_tokens_ptr + b * A + depth - 1, tl.load(tokens_ptr + b * N + child))
                node = child
    tl.debug_barrier()
    if bad != 0:
        # Accept nothing; the bonus is the root's fallback token from the row kernel.
        fallback = tl.load(argmax_ptr + b * N)
        tl.store(accept_nodes_ptr + b * A + offs_a, tl.where(offs_a == 0, 0, -1), mask=offs_a < A)
        tl.store(out_tokens_ptr + b * A + offs_a,
                 tl.where(offs_a == 0, fallback.to(tl.int64), -1), mask=offs_a < A)
        depth = 0
    tl.store(accept_len_ptr + b, depth)
    tl.store(status_ptr + b, bad)


def _max_splits(rows: int, V: int, block: int, device: torch.device) -> tuple[int, int]:
    """(chunks per row, entries per chunk) of the max pass: enough programs for about four
    per SM (a batch of a few rows would otherwise read each row with one SM), whole tiles per
    chunk. Without a GPU (the interpreter), up to 4 chunks so that the merge is exercised."""
    tiles = triton.cdiv(V, block)
    if device.type == "cuda":
        want = triton.cdiv(4 * torch.cuda.get_device_properties(device).multi_processor_count, rows)
    else:
        want = 4
    splits = max(1, min(tiles, want, MAX_SPLITS))
    chunk = triton.cdiv(tiles, splits) * block
    return triton.cdiv(V, chunk), chunk


class Launch(NamedTuple):
    output: VerifyOutput
    cand_count: torch.Tensor  # [B, N] int32
    stats: torch.Tensor  # [B, N, NUM_STATS] float64 (sampling rows only)


def verify(tokens, parents, target_logits, *, max_depth, temperature=None, top_k=None, top_p=None,
           seed=None, offset=None) -> VerifyOutput:
    """Triton launcher with the contract signature (shapes as ``eagle_kernels.reference.verify``).

    Shapes
    ------
    tokens int64 [B, N], parents int32 [B, N], target_logits [B, N, V]; optional float32 /
    int32 / float32 / int64 / int64 [B] temperature, top_k, top_p, seed, offset.
    Returns VerifyOutput(accept_len [B], accept_nodes [B, max_depth + 1],
    out_tokens [B, max_depth + 1], status [B]).
    """
    _checks.check_verify(tokens, parents, target_logits, max_depth=max_depth, temperature=temperature,
                         top_k=top_k, top_p=top_p, seed=seed, offset=offset)
    return _launch(tokens, parents, target_logits, max_depth, temperature, top_k, top_p, seed, offset, CANDIDATES).output


def _launch(tokens, parents, target_logits, max_depth, temperature, top_k, top_p, seed, offset, candidates):
    """Allocate and launch (inputs already checked). ``candidates``: the candidate list
    capacity, a power of two, or 0 to search every sampling row in full (tests compare both).
    Returns the VerifyOutput with the per-row internals: candidate counts ([B, N] int32, -1
    where a row had no list) and the sampling rows' scalars ([B, N, NUM_STATS] float64)."""
    B, N, V = target_logits.shape
    device = target_logits.device
    # Rows are read in place when their entries are contiguous; otherwise one dense copy.
    logits = target_logits if target_logits.stride(2) == 1 else target_logits.contiguous()

    def given(t, fill, dtype):
        return torch.full((B,), fill, dtype=dtype, device=device) if t is None else t.contiguous()

    temperature = given(temperature, 0.0, torch.float32)
    top_k = given(top_k, 0, torch.int32)
    top_p = given(top_p, 1.0, torch.float32)
    seed = given(seed, 0, torch.int64)
    offset = given(offset, 0, torch.int64)
    is_fp64 = target_logits.dtype == torch.float64
    # Per-row scalars (the row kernel writes argmax and bad for every row, stats for sampling
    # rows), candidate lists, and per-tile sums of one residual row per request for the bonus.
    stats = torch.empty((B, N, NUM_STATS.value), dtype=torch.float64, device=device)
    argmax = torch.empty((B, N), dtype=torch.int32, device=device)
    bad = torch.empty((B, N), dtype=torch.int32, device=device)
    compute_dtype = torch.float64 if is_fp64 else torch.float32
    cand_count = torch.empty((B, N), dtype=torch.int32, device=device)
    cand_index = torch.empty((B, N, max(candidates, 1)), dtype=torch.int32, device=device)
    cand_scaled = torch.empty((B, N, max(candidates, 1)), dtype=compute_dtype, device=device)

    A = max_depth + 1
    accept_len = torch.empty(B, dtype=torch.int32, device=device)
    accept_nodes = torch.empty((B, A), dtype=torch.int32, device=device)
    out_tokens = torch.empty((B, A), dtype=torch.int64, device=device)
    status = torch.empty(B, dtype=torch.int32, device=device)
    if B == 0:
        return Launch(VerifyOutput(accept_len, accept_nodes, out_tokens, status), cand_count, stats)
    block_v = min(1024, triton.next_power_of_2(V))
    block_t = triton.next_power_of_2(triton.cdiv(V, block_v))
    tile_sums = torch.empty((B, block_t), dtype=torch.float64, device=device)
    max_block = min(MAX_BLOCK, triton.next_power_of_2(V))
    splits, chunk = _max_splits(B * N, V, max_block, device)
    part_max = torch.empty((B, N, splits), dtype=compute_dtype, device=device)
    part_arg = torch.empty((B, N, splits), dtype=torch.int32, device=device)
    part_flags = torch.empty((B, N, splits), dtype=torch.int32, device=device)
    _verify_max_kernel[(B * N, splits)](
        logits, part_max, part_arg, part_flags, N, V, chunk, logits.stride(0), logits.stride(1),
        IS_FP64=is_fp64, SPLITS=splits, BLOCK_V=max_block, num_warps=4,
    )
    part_total = torch.empty((B, N, splits), dtype=torch.float64, device=device)
    part_counts = torch.empty((B, N, splits, NUM_PIVOTS.value), dtype=torch.int32, device=device)
    part_sums = torch.empty((B, N, splits, NUM_PIVOTS.value), dtype=torch.float32, device=device)
    _verify_levels_kernel[(B * N, splits)](
        logits, temperature, part_max, part_flags, part_total, part_counts, part_sums, N, V, chunk,
        logits.stride(0), logits.stride(1), IS_FP64=is_fp64, SPLITS=splits,
        BLOCK_SPLITS=triton.next_power_of_2(splits), BLOCK_S=min(max_block, SEARCH_BLOCK), num_warps=4,
    )
    _verify_rows_kernel[(B * N,)](
        logits, temperature, top_k, top_p, stats, argmax, bad, part_max, part_arg, part_flags,
        part_total, part_counts, part_sums, cand_count, cand_index, cand_scaled, N, V,
        logits.stride(0), logits.stride(1),
        IS_FP64=is_fp64, SIG_BITS=SIGNIFICANT_KEY_BITS[target_logits.dtype], BLOCK_V=block_v,
        BLOCK_S=min(block_v, SEARCH_BLOCK), RADIX_BITS=RADIX_BITS, NUM_CAND=candidates,
        SPLITS=splits, BLOCK_SPLITS=triton.next_power_of_2(splits), num_warps=4,
    )
    _verify_walk_kernel[(B,)](
        tokens.contiguous(), parents.contiguous(), logits, temperature, seed, offset, stats, argmax, bad,
        cand_count, cand_index, cand_scaled, tile_sums, accept_len, accept_nodes, out_tokens, status,
        N, V, max_depth, logits.stride(0), logits.stride(1),
        IS_FP64=is_fp64, BLOCK_V=block_v, BLOCK_N=triton.next_power_of_2(N),
        BLOCK_A=triton.next_power_of_2(A), BLOCK_T=block_t, NUM_CAND=candidates, num_warps=4,
    )
    return Launch(VerifyOutput(accept_len, accept_nodes, out_tokens, status), cand_count, stats)
