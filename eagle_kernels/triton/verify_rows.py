"""Row statistics of Triton ``verify`` (the overview is in ``verify.py``): the helpers with which
the kernel of ``verify_walk.py`` computes a visited row's scalars when its walk gets there -- the
row's max, first argmax and bad flag and, for sampling rows, the level counts, the top-k / top-p
threshold searches, the candidate lists and the normalisers, kept in the ``STAT_*`` slots. Every
helper here is a pure function of a row's logits and scalars, so the walk recomputes weights
from the same code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Leading bits of the order key (of the logit widened to the compute dtype) that can differ
# between logits of each input dtype: the threshold searches skip the rest.
SIGNIFICANT_KEY_BITS = {torch.bfloat16: 16, torch.float16: 19, torch.float32: 32, torch.float64: 64}
# Rows per tile of the threshold searches: their [SEARCH_BLOCK, 2^RADIX_BITS] accumulator
# (float64 for top-p) stays in registers at 4 warps.
SEARCH_BLOCK = 256
# Candidate lists (see _list_stats): the levels of s = (logit - max) / T tried for the
# list's lower bound, -PIVOT_STEP * (1 .. NUM_PIVOTS).
NUM_PIVOTS = tl.constexpr(16)
PIVOT_STEP = tl.constexpr(1.5)
# Slots of the per-row float64 statistics of a visited row.
STAT_MAX = tl.constexpr(0)  # row max (NaN ignored)
STAT_KTH = tl.constexpr(1)  # top-k threshold on s (-inf when off)
STAT_DENOM = tl.constexpr(2)  # softmax normaliser, rounded to the compute dtype
STAT_CUT = tl.constexpr(3)  # top-p threshold on p (-inf when off)
STAT_NORM = tl.constexpr(4)  # top-p normaliser, rounded to the compute dtype (1 when off)
STAT_MASS = tl.constexpr(5)  # float64 sum of the weights w
NUM_STATS = tl.constexpr(6)
_LOG2E = tl.constexpr(1.4426950408889634)
_FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


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


# Reductions to a scalar in two steps over a [S / 32, 32] view (docs/gpu_kernels.md, "Triton 3.6:
# one register per reduction"). Triton 3.6's inter-warp step loads the warps' partials from shared
# memory with a predicate (the threads that hold one) and leaves the destination undefined in the
# others; ptxas then keeps that register live from the kernel's entry: one register per reduction
# in the whole kernel (255 registers and spills in the walk's loop with plain reductions). Reducing
# the view over the axis that spans the warps first (S >= 256: 32 partials per warp, every thread
# loads one) or over the lanes first (S of 64 or 128) leaves no such load; 32 entries or fewer sit
# in one warp. Max, min and integer sums are the same in any order; a float sum is added in another
# order than tl.sum's. Inside hot loops tl.sum stays (under 3.9 the view costs a shuffle per tile).
@triton.jit
def _fold(x, axis: tl.constexpr, OP: tl.constexpr):
    """tl.max (OP 0), tl.min (OP 1) or tl.sum (OP 2) of x over ``axis``."""
    if OP == 0:
        return tl.max(x, axis=axis)
    elif OP == 1:
        return tl.min(x, axis=axis)
    else:
        return tl.sum(x, axis=axis)


@triton.jit
def _fold1(x, OP: tl.constexpr):
    """_fold(x, 0, OP) of a 1-D x in two steps over its [S / 32, 32] view (the note above)."""
    S: tl.constexpr = x.shape[0]
    if S >= 256:
        return _fold(_fold(tl.reshape(x, [S // 32, 32]), 0, OP), 0, OP)
    elif S > 32:
        return _fold(_fold(tl.reshape(x, [S // 32, 32]), 1, OP), 0, OP)
    else:
        return _fold(x, 0, OP)


@triton.jit
def _max1(x):
    """tl.max(x, axis=0) of a 1-D x (the note above _fold)."""
    return _fold1(x, 0)


@triton.jit
def _min1(x):
    """tl.min(x, axis=0) of a 1-D x (the note above _fold)."""
    return _fold1(x, 1)


@triton.jit
def _sum1(x):
    """tl.sum(x, axis=0) of a 1-D x (the note above _fold)."""
    return _fold1(x, 2)


@triton.jit
def _filters(top_k, top_p, V):
    """Whether a sampling request's top-k (a k in (0, V)) or top-p (a p below 1) can remove a token:
    the all-rows kernel leaves such requests to the walk, which serves only them after it."""
    return ((top_k > 0) & (top_k < V)) | (top_p < 1.0)


DRAFT_SUM_TOLERANCE = tl.constexpr(1e-3)  # |S - 1| above this makes a draft row invalid (docs/ops.md §4)


@triton.jit
def _draft_range(q_row, start, end, BLOCK_V: tl.constexpr):
    """(float64 sum, bad flag) of the draft row's entries in [start, end): bad when one of them
    is NaN, +inf or negative. A draft row is valid when no chunk is bad and its sum S has
    |S - 1| <= DRAFT_SUM_TOLERANCE."""
    lane_sum = tl.zeros([BLOCK_V], dtype=tl.float64)
    lane_bad = tl.zeros([BLOCK_V], dtype=tl.int32)
    for tile in range(start, end, BLOCK_V):
        offs = tile + tl.arange(0, BLOCK_V)
        q = tl.load(q_row + offs, mask=offs < end, other=0.0)
        lane_bad = lane_bad | ((q != q) | (q == float("inf")) | (q < 0)).to(tl.int32)
        lane_sum += q.to(tl.float64)
    return _sum1(lane_sum), _max1(lane_bad)


@triton.jit
def _merge_max(chunk_max, chunk_arg, chunk_flags, V):
    """(max, first argmax, bad) of a row from its chunks' max passes (_range_max; [BLOCK_SPLITS]
    each, masked chunks -inf / V / 0): bad when an entry is NaN or +inf or none is finite."""
    row_max = _max1(chunk_max)
    flags = _max1(chunk_flags & 1) | _max1(chunk_flags & 2)
    return row_max, _min1(tl.where(chunk_max == row_max, chunk_arg, V)), ((flags & 1) != 0) | ((flags & 2) == 0)


@triton.jit
def _draw_chunk(totals, target, splits, in_splits, chunk, V):
    """(first entry, running sum before it) of the chunk where the running sum of the chunks'
    totals (``totals``: [BLOCK_SPLITS] float64, chunk j = entries [j * chunk, (j + 1) * chunk))
    first passes ``target``: an inverse-CDF draw scans from there (V, and no scan, if rounding
    leaves no chunk past it)."""
    first = _min1(tl.where((tl.cumsum(totals, axis=0) > target) & in_splits, splits, V))
    carry = _sum1(tl.where(splits < first, totals, 0.0))
    return tl.minimum(first.to(tl.int64) * chunk, V), carry


@triton.jit
def _sum0(x):
    """tl.sum(x, axis=0) of a 2-D x [R, C] (the note above _fold): for C < 32, over the
    [R * C / 32, 32] view first (32 partials per warp), then over its 32 / C column groups."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    if (C < 32) & (R * C >= 256):
        return tl.sum(tl.reshape(tl.sum(tl.reshape(x, [R * C // 32, 32]), axis=0), [32 // C, C]), axis=0)
    else:
        return tl.sum(x, axis=0)


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
def _search_chunk(row, start, end, prefix, shift, row_max, t, kth, denom, IS_TOP_P: tl.constexpr, CT: tl.constexpr,
                  IS_FP64: tl.constexpr, BLOCK_S: tl.constexpr, RADIX_BITS: tl.constexpr):
    """One digit of the radix threshold search over [start, end) of a row: for the candidates
    P_j = prefix + j * 2^shift (j < 2^RADIX_BITS; j = 0 is never taken), F(P_j) counts the
    entries with order key >= P_j (top-k) or sums their p (top-p), as float64. One
    [BLOCK_S, 2^R] accumulator, reduced once."""
    if IS_FP64:
        KT: tl.constexpr = tl.uint64
    else:
        KT: tl.constexpr = tl.uint32
    lanes = tl.arange(0, 1 << RADIX_BITS)
    candidates = prefix + (lanes.to(KT) << shift.to(KT))
    if IS_TOP_P:
        acc = tl.zeros([BLOCK_S, 1 << RADIX_BITS], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_S, 1 << RADIX_BITS], dtype=tl.int32)
    for tile in range(start, end, BLOCK_S):
        # [BLOCK_S, 1] tiles: loaded in the accumulator's 2-D layout, no per-tile shuffle
        offs = tile + tl.arange(0, BLOCK_S)[:, None]
        valid = offs < end
        logits = tl.load(row + offs, mask=valid, other=float("-inf")).to(CT)
        above = (_order_key(logits, IS_FP64) >= candidates[None, :]) & valid
        if IS_TOP_P:
            p = _probs(_scaled(logits, row_max, t), kth, denom, CT)
            acc += tl.where(above, p.to(tl.float64), 0.0)
        else:
            acc += above.to(tl.int32)
    if IS_TOP_P:
        return _sum0(acc)
    else:
        return _sum0(acc).to(tl.float64)


@triton.jit
def _search_digit(prefix, shift, totals, target, IS_FP64: tl.constexpr, RADIX_BITS: tl.constexpr):
    """The prefix after one digit: the largest candidate P_j with F(P_j) >= target (F is
    non-increasing in P), j = 0 (the prefix itself) if none."""
    if IS_FP64:
        KT: tl.constexpr = tl.uint64
    else:
        KT: tl.constexpr = tl.uint32
    lanes = tl.arange(0, 1 << RADIX_BITS)
    digit = tl.sum(((totals >= target) & (lanes > 0)).to(tl.int32), axis=0)
    return prefix + (digit.to(KT) << shift.to(KT))


@triton.jit
def _search_value(prefix, CT: tl.constexpr, IS_FP64: tl.constexpr, SIG_BITS: tl.constexpr,
                  RADIX_BITS: tl.constexpr):
    """The logit value whose order key is the searched prefix (the largest key P with
    F(P) >= target once every digit is searched).

    s and p are monotone in the logit, so the k-th largest s is s of the k-th largest logit
    and the lowest kept level of p is p of the logit found: the search needs no s or p for
    top-k, and only the leading SIG_BITS key bits vary for logits widened from 16 bits (bf16:
    16, fp16: 19), so those take half the digits of fp32."""
    if IS_FP64:
        KT: tl.constexpr = tl.uint64
        KEY_BITS: tl.constexpr = 64
    else:
        KT: tl.constexpr = tl.uint32
        KEY_BITS: tl.constexpr = 32
    LEVELS: tl.constexpr = (SIG_BITS + RADIX_BITS - 1) // RADIX_BITS
    LOW_BITS: tl.constexpr = KEY_BITS - LEVELS * RADIX_BITS
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
def _search_chunk_last(row, start, end, prefix, shift, row_max, t, kth, denom, IS_TOP_P: tl.constexpr,
                       CT: tl.constexpr, IS_FP64: tl.constexpr, SIG_BITS: tl.constexpr, BLOCK_S: tl.constexpr,
                       RADIX_BITS: tl.constexpr):
    """The last digit of a threshold search over [start, end), fused with the normaliser: each
    candidate P_j is the key of one logit value v_j, and the threshold it would give is
    t_j = s(v_j) (top-k) or p(v_j) (top-p). Returns, per candidate, (F_j, N_j): top-k: the
    entries with s >= t_j and the float64 sum of their exp(s) (the softmax normaliser if t_j is
    the threshold); top-p: twice the float64 sum of the p >= t_j (the search's mass and the
    normaliser). Keys are compared through s or p, not the order key: a tie of a lower key with
    t_j counts with it, which changes F only inside a tie group of s or p and so picks the same
    threshold, and makes each N_j the kept set's own sum (``keep iff s >= kth`` / ``p >= cut``)."""
    if IS_FP64:
        KT: tl.constexpr = tl.uint64
    else:
        KT: tl.constexpr = tl.uint32
    lanes = tl.arange(0, 1 << RADIX_BITS)
    candidates = prefix + (lanes.to(KT) << shift.to(KT))
    level = _scaled(_search_value(candidates, CT, IS_FP64, SIG_BITS, RADIX_BITS).to(CT), row_max, t)
    if IS_TOP_P:
        # A candidate above the row max (s > 0) keeps nothing: p = +inf, without exp overflowing.
        level = tl.where(level > 0, float("inf"), _probs(tl.minimum(level, 0.0), kth, denom, CT)).to(CT)
    sums = tl.zeros([BLOCK_S, 1 << RADIX_BITS], dtype=tl.float64)
    counts = tl.zeros([BLOCK_S, 1 << RADIX_BITS], dtype=tl.int32)
    for tile in range(start, end, BLOCK_S):
        offs = tile + tl.arange(0, BLOCK_S)[:, None]
        valid = offs < end
        s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
        if IS_TOP_P:
            p = _probs(s, kth, denom, CT)
            sums += tl.where(valid & (p >= level[None, :]), p.to(tl.float64), 0.0)
        else:
            above = valid & (s >= level[None, :])
            counts += above.to(tl.int32)
            sums += tl.where(above, tl.exp(s).to(CT).to(tl.float64), 0.0)
    kept = _sum0(sums)
    if IS_TOP_P:
        return kept, kept
    else:
        return _sum0(counts).to(tl.float64), kept


@triton.jit
def _list_level(level_counts, level_sums, total, top_k, top_p, use_k, NUM_CAND: tl.constexpr):
    """The pivot index whose level bounds the candidate list (NUM_PIVOTS if none fits).

    ``level_counts`` / ``level_sums`` count the row's entries at or above each level of s and
    sum their exp(s) (``total``: over the row). A level fits when it holds the k largest
    (top-k) or, without top-k, clearly more than the top_p share of the softmax mass (the
    sorted list checks it exactly), in NUM_CAND slots; the highest fitting level is taken."""
    pivots = tl.arange(0, NUM_PIVOTS)
    need = tl.where(use_k, top_k, 1)
    fits = (level_counts >= need) & (level_counts <= NUM_CAND) \
        & (use_k | (level_sums.to(tl.float64) >= top_p.to(tl.float64) * total * 1.0001))
    first = tl.min(tl.where(fits, pivots, NUM_PIVOTS), axis=0)
    # Top-p alone: the nucleus lies at or above level ``first``, but an unlisted token (s below
    # the listed level) must not tie with the cut in p, which needs the cut at least 1 above the
    # listed level (checked in _list_stats). List one level lower (1.5 further down) when that
    # still fits: the cut then clears it by 1.5 whatever the row. Rows whose nucleus ended just
    # above a level used to fail the check and search the whole row.
    lower = tl.min(tl.where(pivots == first + 1, level_counts, NUM_CAND + 1), axis=0)
    return tl.where((use_k == 0) & (first + 1 < NUM_PIVOTS) & (lower <= NUM_CAND), first + 1, first)


# Seeded searches (_seed_prefix): the relative margin by which the levels' float32 sums must clear
# the top-p target, and the relative slack on the logit bounds of a level band.
SEED_MARGIN = tl.constexpr(1e-3)
SEED_SLACK = tl.constexpr(1e-3)


@triton.jit
def _seed_prefix(level_counts, level_sums, total, top_k, top_p, use_k, row_max, t, floor, CT: tl.constexpr,
                 IS_FP64: tl.constexpr, SIG_BITS: tl.constexpr, RADIX_BITS: tl.constexpr):
    """(prefix, first digit) of the first threshold search of a row no list holds, from its
    levels: the band [-PIVOT_STEP * (j + 1), -PIVOT_STEP * j) of s that holds the threshold
    (top-k: the first level with k entries at or above it, exact; top-p alone: the first level
    whose exp(s) sum clears top_p * total by SEED_MARGIN, the level above it falling short by as
    much, else no seed) bounds the threshold's logit, with slack, between two values; the digits
    their order keys share are the search's first digits. The search then starts below them: the
    threshold's key lies in that range, so it finds the same key (F is monotone). (0, 0) when no
    band is certain. For top-p after a top-k search, ``total`` is the top-k normaliser and the
    band must lie at or above ``floor`` (kth: the levels' sums there are the top-k set's)."""
    if IS_FP64:
        KT: tl.constexpr = tl.uint64
        KEY_BITS: tl.constexpr = 64
    else:
        KT: tl.constexpr = tl.uint32
        KEY_BITS: tl.constexpr = 32
    DIGITS: tl.constexpr = (SIG_BITS + RADIX_BITS - 1) // RADIX_BITS
    pivots = tl.arange(0, NUM_PIVOTS)
    target = top_p.to(tl.float64) * total
    sums = level_sums.to(tl.float64)
    reach = tl.where(use_k, level_counts >= top_k, sums >= target * (1.0 + SEED_MARGIN))
    j = tl.min(tl.where(reach, pivots, NUM_PIVOTS), axis=0)
    above = tl.sum(tl.where(pivots == j - 1, sums, 0.0), axis=0)
    low = (j + 1).to(CT) * (-PIVOT_STEP)
    certain = (j < NUM_PIVOTS) & (use_k | (((j == 0) | (above <= target * (1.0 - SEED_MARGIN))) & (low >= floor)))
    high = j.to(CT) * (-PIVOT_STEP)
    x_lo = (row_max + t * low - SEED_SLACK * (tl.abs(row_max) + t * tl.abs(low))).to(CT)
    x_hi = (row_max + t * high + SEED_SLACK * (tl.abs(row_max) + t * tl.abs(high))).to(CT)
    differ = _order_key(x_lo, IS_FP64) ^ _order_key(x_hi, IS_FP64)
    digit = tl.zeros([], tl.int32)
    for d in tl.static_range(DIGITS - 1):  # the last digit always runs (it sums the normaliser)
        digit += ((differ >> (KEY_BITS - RADIX_BITS * (d + 1))) == 0).to(tl.int32)
    digit = tl.where(certain, digit, 0)
    keep = KEY_BITS - RADIX_BITS * digit  # low bits cleared
    low_mask = tl.where(digit > 0, (tl.full([], 1, KT) << tl.minimum(keep, KEY_BITS - 1).to(KT)) - 1, 0)
    prefix = tl.where(digit > 0, _order_key(x_lo, IS_FP64) & ~low_mask.to(KT), 0).to(KT)
    return prefix, digit


@triton.jit
def _pivot_level(first, CT: tl.constexpr):
    """The level of s of pivot index ``first``: -PIVOT_STEP * (first + 1)."""
    level = (first + 1).to(CT) * PIVOT_STEP
    return -level


@triton.jit
def _store_list(row, start, end, row_max, t, level, slot0, index_ptr, scaled_ptr, CT: tl.constexpr,
                BLOCK_V: tl.constexpr, NUM_CAND: tl.constexpr):
    """Stores (id, s) of the entries of [start, end) with s >= level at slots slot0, slot0 + 1,
    ... in ascending id order; returns how many there were."""
    stored = 0
    for tile in range(start, end, BLOCK_V):
        offs = tile + tl.arange(0, BLOCK_V)
        valid = offs < end
        s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
        keep = valid & (s >= level)
        slot = slot0 + stored + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(index_ptr + slot, offs, mask=keep & (slot < NUM_CAND))
        tl.store(scaled_ptr + slot, s, mask=keep & (slot < NUM_CAND))
        stored += tl.sum(keep.to(tl.int32), axis=0)
    return stored


@triton.jit
def _list_stats(scaled_ptr, stored, level, top_k, top_p, use_k, use_p, total, CT: tl.constexpr,
                NUM_CAND: tl.constexpr):
    """kth, denom, cut, norm, mass of a row from its candidate list (the ``stored`` entries at
    or above ``level``), sorted in registers. Returns count = -1 where the list cannot give
    them exactly (the nucleus reaching below the level, or too close to it): the caller then
    searches the whole row."""
    kth = tl.full([], float("-inf"), CT)
    denom = total.to(CT)
    cut = tl.full([], float("-inf"), CT)
    norm = tl.full([], 1.0, CT)
    slots = tl.arange(0, NUM_CAND)
    listed = tl.load(scaled_ptr + slots, mask=slots < stored, other=float("-inf"), volatile=True)
    ranked = tl.sort(listed, descending=True)
    if use_k:
        kth = _max1(tl.where(slots == top_k - 1, ranked, float("-inf")))
        e = tl.where(ranked >= kth, tl.exp(ranked), 0.0).to(CT)
        denom = _sum1(e.to(tl.float64)).to(CT)
    p = _probs(ranked, kth, denom, CT)
    count = stored
    if use_p:
        # Most probable first: the first rank whose running mass reaches top_p sets the cut
        # (ties at the cut are kept by p >= cut).
        running = tl.cumsum(p.to(tl.float64), axis=0)
        first_rank = _min1(tl.where(running >= top_p.to(tl.float64), slots, NUM_CAND))
        if first_rank < NUM_CAND:
            cut = _max1(tl.where(slots == first_rank, p, float("-inf")))
        elif use_k == 0:
            count = -1  # the nucleus reaches below the listed level
        if use_k == 0:
            # Every unlisted token has s < level: clear of the cut by a margin of e in p, so
            # no unlisted token can tie with it.
            if cut < (tl.exp(level + 1.0) / denom).to(CT):
                count = -1
        norm = _sum1(tl.where(p >= cut, p.to(tl.float64), 0.0)).to(CT)
    mass = _sum1(_weights(p, cut, norm, CT).to(tl.float64))
    return count, kth, denom, cut, norm, mass


@triton.jit
def _range_max(row, start, end, CT: tl.constexpr, BLOCK: tl.constexpr):
    """Max pass over [start, end) of a row: its max (NaN ignored), first index holding it
    (``end`` if no entry is above -inf) and flags (bit 0: NaN or +inf seen, bit 1: a finite
    entry seen). A lane keeps its first maximum (NaN never compares greater), so the smallest
    index among the lanes holding the max is the first argmax. Per-lane partials, reduced once."""
    lane_max = tl.full([BLOCK], float("-inf"), CT)
    lane_arg = tl.full([BLOCK], end, tl.int32)
    lane_flags = tl.zeros([BLOCK], tl.int32)
    for tile in range(start, end, BLOCK):
        offs = tile + tl.arange(0, BLOCK)
        valid = offs < end
        x = tl.load(row + offs, mask=valid, other=float("-inf")).to(CT)
        lane_flags = lane_flags | (valid & ((x != x) | (x == float("inf")))).to(tl.int32) \
            | ((valid & (x > float("-inf")) & (x < float("inf"))).to(tl.int32) * 2)
        better = valid & (x > lane_max)
        lane_arg = tl.where(better, offs, lane_arg)
        lane_max = tl.where(better, x, lane_max)
    chunk_max = _max1(lane_max)
    arg = _min1(tl.where(lane_max == chunk_max, lane_arg, end))
    return chunk_max, arg, _max1(lane_flags & 1) | _max1(lane_flags & 2)


@triton.jit
def _finite_argmax(row, V, CT: tl.constexpr, BLOCK_V: tl.constexpr):
    """The bonus token of a request with a bad row: the first argmax over the finite entries
    of the root row, 0 if it has none."""
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
    best = _max1(tl.where(lane_arg < V, lane_best, float("-inf")))
    arg = _min1(tl.where((lane_arg < V) & (lane_best == best), lane_arg, V))
    return tl.where(arg < V, arg, 0)


@triton.jit
def _range_levels(row, start, end, row_max, t, CT: tl.constexpr, BLOCK_S: tl.constexpr):
    """Levels pass over [start, end) of a sampling row: the softmax sum (float64 of the
    compute-dtype exp(s)) and, at the NUM_PIVOTS levels -PIVOT_STEP * (1 .. NUM_PIVOTS) of
    s = (logit - max) / T, the entries at or above the level (int32) and their float32 sum of
    exp(s)."""
    levels = -PIVOT_STEP * (tl.arange(0, NUM_PIVOTS) + 1).to(CT)
    counts = tl.zeros([BLOCK_S, NUM_PIVOTS], dtype=tl.int32)
    sums = tl.zeros([BLOCK_S, NUM_PIVOTS], dtype=tl.float32)
    lane_total = tl.zeros([BLOCK_S, 1], dtype=tl.float64)
    for tile in range(start, end, BLOCK_S):
        # [BLOCK_S, 1] tiles: loaded in the accumulators' 2-D layout, no per-tile shuffle
        offs = tile + tl.arange(0, BLOCK_S)[:, None]
        valid = offs < end
        s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
        e = tl.where(valid, tl.exp(s), 0.0).to(CT)
        lane_total += e.to(tl.float64)
        at_or_above = valid & (s >= levels[None, :])
        counts += at_or_above.to(tl.int32)
        sums += tl.where(at_or_above, e.to(tl.float32), 0.0)
    return _sum1(tl.sum(lane_total, axis=1)), _sum0(counts), _sum0(sums)


@triton.jit
def _range_total(row, start, end, row_max, t, CT: tl.constexpr, BLOCK: tl.constexpr):
    """The softmax sum of _range_levels alone (float64 of the compute-dtype exp(s)), for rows
    with neither top-k nor top-p: no candidate list, so no level counts (the [BLOCK_S, 16] level
    accumulators cost about three times the rest of the levels pass)."""
    lane_total = tl.zeros([BLOCK], dtype=tl.float64)
    for tile in range(start, end, BLOCK):
        offs = tile + tl.arange(0, BLOCK)
        valid = offs < end
        s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
        lane_total += tl.where(valid, tl.exp(s), 0.0).to(CT).to(tl.float64)
    return _sum1(lane_total)


@triton.jit
def _range_mass(row, start, end, row_max, t, kth, denom, cut, norm, sums_row, CT: tl.constexpr,
                BLOCK_V: tl.constexpr):
    """Mass pass over [start, end) (BLOCK_V-aligned): the float64 sum of the weights w, and each
    tile's sum stored at ``sums_row`` (the bonus draw starts from them)."""
    lane_mass = tl.zeros([BLOCK_V], dtype=tl.float64)
    for tile in range(start, end, BLOCK_V):
        offs = tile + tl.arange(0, BLOCK_V)
        valid = offs < end
        s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
        w = tl.where(valid, _weights(_probs(s, kth, denom, CT), cut, norm, CT), 0.0).to(tl.float64)
        lane_mass += w
        tl.store(sums_row + tile // BLOCK_V, tl.sum(w, axis=0))
    return _sum1(lane_mass)


@triton.jit
def _exp_scale(t, CT: tl.constexpr):
    """log2(e) / T in the compute dtype, capped at the largest float32: exp((x - m) / T) is then
    exp2((x - m) * k), and a subnormal T still maps x = m to exp2(0) = 1 rather than 0 * inf."""
    return tl.minimum(_LOG2E / t.to(CT), _FLOAT32_MAX).to(CT)


@triton.jit
def _online_sum_step(x, tile_max, run_max, run_sum, k):
    """One tile of an online softmax, a lane a row of ``x`` ([lanes, entries]): the lanes' new
    running max (with ``tile_max``, the tile's own) and their running sums of exp2((x - max) * k),
    the old sums rescaled to the new max."""
    new_max = tl.maximum(run_max, tile_max)
    # A lane that has seen only -inf keeps a sum of 0 (exp2(-inf) = 0) rather than -inf - -inf.
    # (x - shift) * k, not x * k - shift * k: at a tiny T, k is huge and both products overflow.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    run_sum = run_sum * tl.exp2((run_max - shift) * k) + tl.sum(tl.exp2((x - shift[:, None]) * k), axis=1)
    return new_max, run_sum


@triton.jit
def _fold_sums(run_max, run_sum, chunk_max, k):
    """The lanes' running sums folded into one sum relative to ``chunk_max`` (their max)."""
    shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
    return _sum1(run_sum * tl.exp2((run_max - shift) * k))


@triton.jit
def _node_sums(part_max_ptr, part_sum_ptr, b, N, node, k, C: tl.constexpr, BLOCK_C: tl.constexpr):
    """A visited row's max, softmax sum (float64) and its chunks' sums relative to that max
    ([BLOCK_C] float64) from its chunks' partials (.cg: written by other programs, published by
    their tickets, not through this SM's L1)."""
    offs_c = tl.arange(0, BLOCK_C)
    at = (b * N + node) * C + offs_c
    pm = tl.load(part_max_ptr + at, mask=offs_c < C, other=float("-inf"), cache_modifier=".cg")
    ps = tl.load(part_sum_ptr + at, mask=offs_c < C, other=0.0, cache_modifier=".cg")
    node_max = _max1(pm)
    # Each chunk's sum relative to the row's max: the softmax sum is their total. (A bad row's
    # values are never used.)
    totals = ps.to(tl.float64) * tl.exp2((pm - node_max) * k).to(tl.float64)
    return node_max, _sum1(totals), totals


@triton.jit
def _node_partials(part_max_ptr, part_sum_ptr, b, N, node, k, C: tl.constexpr, BLOCK_C: tl.constexpr):
    """A visited row's max, softmax sum (float64) and chunk masses [BLOCK_C] (float64, summing to
    1), from its chunks' partials as ``_node_sums`` reads them."""
    node_max, denom, totals = _node_sums(part_max_ptr, part_sum_ptr, b, N, node, k, C, BLOCK_C)
    return node_max, denom, totals * (1.0 / denom)
