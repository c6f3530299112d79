"""The kernel of Triton ``verify`` (the overview is in ``verify.py``): one program per request
descends its tree, computing each visited row's scalars with ``verify_rows.py`` when it gets
there, accepting or rejecting each drafted child and drawing the bonus token by inverse CDF,
with Philox4x32-10 coins in-kernel. With ``positions`` (coupled sampling), a sampling request's
token at each visited row is the exponential race over the row's weights instead, run once the
thresholds are known: over the candidate list in the merge, or as one more pass over the chunks
(``KIND_RACE``, in place of the mass pass).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..reference.random import COUPLED_DRAW
from ._pdl import wait_for_prior_grids
from .philox import _uniform
from .verify_rows import (
    DRAFT_SUM_TOLERANCE,
    NUM_PIVOTS,
    NUM_STATS,
    STAT_CUT,
    STAT_DENOM,
    STAT_KTH,
    STAT_MASS,
    STAT_MAX,
    STAT_NORM,
    _draft_range,
    _draw_chunk,
    _finite_argmax,
    _list_level,
    _list_stats,
    _max1,
    _merge_max,
    _min1,
    _pivot_level,
    _probs,
    _range_levels,
    _range_mass,
    _range_max,
    _range_total,
    _scaled,
    _search_chunk,
    _search_chunk_last,
    _search_digit,
    _search_value,
    _seed_prefix,
    _store_list,
    _sum0,
    _sum1,
    _weights,
)

ACCEPT_DRAW = tl.constexpr(0)
BONUS_DRAW = tl.constexpr(1)
RACE_DRAW = tl.constexpr(COUPLED_DRAW)
# The passes a phase runs over one chunk of the current row.
KIND_MAX = tl.constexpr(0)  # max, first argmax, NaN / +inf / finite flags
KIND_LEVELS = tl.constexpr(1)  # softmax sum; with top-k or top-p, counts and exp(s) sums at the NUM_PIVOTS levels
KIND_LIST = tl.constexpr(2)  # the candidate list: entries at or above the chosen level
KIND_MASS = tl.constexpr(3)  # the weights' float64 sum and per-tile sums (no list)
KIND_SEARCH_K = tl.constexpr(4)  # one digit of the top-k threshold search (rows without a list); the last
# digit also sums each candidate's softmax normaliser
KIND_SEARCH_P = tl.constexpr(6)  # one digit of the top-p threshold search; the last also its normaliser
KIND_RACE = tl.constexpr(7)  # coupled requests, rows without a list: each chunk's best race ratio (no mass pass)
# The draft-aware rule at a node with sampled children (HAS_DRAFT):
KIND_DRAFT = tl.constexpr(8)  # the draft row's float64 sum and bad flags, over chunks of the draft row
KIND_RESIDUAL = tl.constexpr(9)  # the residual weights' float64 sum after the recorded rejections
# Per-request control words (int32, zero before a launch and left zero after it: the last program
# of a request to exit resets them, so a cached workspace needs no fill between calls): the phase
# now open (FINISHED once the request is done), the open phase's kind and row, the walk's depth,
# the pivot of the list level, the programs that have exited; then the claim and done counters
# of every phase.
CTL_PHASE = tl.constexpr(0)
CTL_KIND = tl.constexpr(1)
CTL_NODE = tl.constexpr(2)
CTL_DEPTH = tl.constexpr(3)
CTL_PIVOT = tl.constexpr(4)  # -1 - lane: a list of the top-k set, counted by the last top-k digit in that lane
CTL_DIGIT = tl.constexpr(5)  # the digit of the open search phase
CTL_EXITED = tl.constexpr(6)  # programs of the request that have left the walk
# The draft-aware rule's place at the current node: the sampled child whose rejection the open
# residual phase weighs, the rejections recorded, the draft row's validity, and whether the open
# residual phase is the bonus draw's.
CTL_CHILD = tl.constexpr(7)
CTL_EVENTS = tl.constexpr(8)
CTL_DRAFT_BAD = tl.constexpr(9)
CTL_BONUS = tl.constexpr(10)
CTL_WORDS = tl.constexpr(12)
FINISHED = tl.constexpr(1 << 30)
# Per-request float64 scalars of the current row, written by a phase's merge for the next.
ROW_MAX = tl.constexpr(0)
ROW_TOTAL = tl.constexpr(1)
ROW_KTH = tl.constexpr(2)
ROW_DENOM = tl.constexpr(3)
ROW_CUT = tl.constexpr(4)
ROW_NORM = tl.constexpr(5)
ROW_LEVEL = tl.constexpr(6)
# The draft-aware rule: the mass before the pending rejection, the draft row's sum S, the draft
# mass of the rejected sampled children, w(x) of the pending one.
ROW_MASS = tl.constexpr(7)
ROW_S = tl.constexpr(8)
ROW_REMOVED = tl.constexpr(9)
ROW_WX = tl.constexpr(10)
ROW_WORDS = tl.constexpr(12)


@triton.jit
def _children_of(node, parents_row, offs_n, N):
    """Flags over nodes (``offs_n``): the children of ``node``, the later nodes whose parent it is."""
    return (tl.load(parents_row + offs_n, mask=offs_n < N, other=-2) == node) & (offs_n > node)


@triton.jit
def _next_flagged(flags, after, offs_n, N):
    """The first node above ``after`` whose entry of ``flags`` (over nodes) is nonzero; N if none.
    The walk's loops over a node's children or its rejected ones step with this: one reduction
    a child instead of a step per later node (a tree of 61 nodes has up to 60 after the root)."""
    return _min1(tl.where((flags != 0) & (offs_n > after), offs_n, N))


@triton.jit
def _zero_rejected(w, ids, tokens_row, node, N, rejected, offs_n):
    """w with the tokens of the node's rejected children (``rejected`` flags over nodes) at 0."""
    c = _next_flagged(rejected, node, offs_n, N)
    while c < N:
        w = tl.where(ids == tl.load(tokens_row + c), 0.0, w)
        c = _next_flagged(rejected, c, offs_n, N)
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
    c = _next_flagged(rejected, node, offs_n, N)
    while c < N:
        hit = (tl.load(tokens_row + c) // BLOCK_V).to(tl.int32)
        offs, valid, w = _residual_tile(row, hit * BLOCK_V, V, row_max, t, kth, denom, cut, norm, tokens_row,
                                        node, N, rejected, offs_n, True, CT, BLOCK_V)
        tl.store(sums_row + hit, _sum1(w))
        c = _next_flagged(rejected, c, offs_n, N)
    tl.debug_barrier()
    tiles = tl.arange(0, BLOCK_T)
    sums = tl.load(sums_row + tiles, mask=tiles < n_tiles, other=0.0, volatile=True)
    target = u * _sum1(sums)
    running = tl.cumsum(sums, axis=0)
    tile = _min1(tl.where(running > target, tiles, n_tiles)).to(tl.int32)
    found = V
    # Rounding inside a tile can disagree with its sum by the last bit: then the next tile.
    while (found == V) & (tile < n_tiles):
        carry = _sum1(tl.where(tiles == tile, running - sums, 0.0))
        offs, valid, w = _residual_tile(row, tile * BLOCK_V, V, row_max, t, kth, denom, cut, norm, tokens_row,
                                        node, N, rejected, offs_n, True, CT, BLOCK_V)
        found = _min1(tl.where((tl.cumsum(w, axis=0) + carry > target) & valid, offs, V))
        tile += 1
    if found == V:
        last_tile = _max1(tl.where(sums > 0, tiles, -1))
        found = 0
        if last_tile >= 0:
            offs, valid, w = _residual_tile(row, last_tile * BLOCK_V, V, row_max, t, kth, denom, cut, norm,
                                            tokens_row, node, N, rejected, offs_n, True, CT, BLOCK_V)
            found = tl.maximum(_max1(tl.where(w > 0, offs, -1)), 0)
    return found


@triton.jit
def _bonus_from_list(index_ptr, scaled_ptr, listed, tokens_row, node, N, rejected, offs_n, kth, denom, cut, norm,
                     u, V, CT: tl.constexpr, NUM_CAND: tl.constexpr):
    """The inverse-CDF draw of _inverse_cdf over a row's candidate list: every token of
    positive weight is listed, in ascending id order, so the running sums are the same."""
    slots = tl.arange(0, NUM_CAND)
    index = tl.load(index_ptr + slots, mask=slots < listed, other=V, volatile=True)
    scaled = tl.load(scaled_ptr + slots, mask=slots < listed, other=float("-inf"), volatile=True)
    w = tl.where(slots < listed, _weights(_probs(scaled, kth, denom, CT), cut, norm, CT), 0.0).to(tl.float64)
    w = _zero_rejected(w, index, tokens_row, node, N, rejected, offs_n)
    target = u * _sum1(w)
    found = _min1(tl.where(tl.cumsum(w, axis=0) > target, index, V))
    last_positive = _max1(tl.where(w > 0, index, -1))
    return tl.where(found < V, found, tl.maximum(last_positive, 0))


@triton.jit
def _race_ratios(ids, w, seed, position):
    """The exponential race's ratios ``w / E``, ``E = -log U(seed, position, id, COUPLED_DRAW)``, in
    float64 (``w`` float64); -1 off the support, 0 where U = 0 (E = inf)."""
    # The draw index as a uint32 scalar: a global constant above 2^31 would pass as an int32.
    u = _uniform(seed, position, ids, tl.full([], RACE_DRAW, tl.uint32))
    return tl.where(w > 0.0, w / -tl.log(u), -1.0)


@triton.jit
def _range_race(row, start, end, row_max, t, kth, denom, cut, norm, seed, position, CT: tl.constexpr,
                BLOCK_V: tl.constexpr):
    """Race pass over [start, end) of a coupled row: the best ratio (float64) and the first id holding
    it. Each lane keeps its first maximum (ids ascend within a lane), so the smallest id among the
    lanes at the best is the first one: ties go to the smaller id, as in the reference."""
    lane_best = tl.full([BLOCK_V], -2.0, tl.float64)
    lane_id = tl.full([BLOCK_V], end, tl.int32)
    for tile in range(start, end, BLOCK_V):
        offs = tile + tl.arange(0, BLOCK_V)
        valid = offs < end
        s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
        w = tl.where(valid, _weights(_probs(s, kth, denom, CT), cut, norm, CT), 0.0).to(tl.float64)
        ratio = _race_ratios(offs, w, seed, position)
        better = valid & (ratio > lane_best)
        lane_id = tl.where(better, offs, lane_id)
        lane_best = tl.where(better, ratio, lane_best)
    best = _max1(lane_best)
    return best, _min1(tl.where(lane_best == best, lane_id, end))


@triton.jit
def _race_from_list(index_ptr, scaled_ptr, listed, kth, denom, cut, norm, seed, position, V, CT: tl.constexpr,
                    NUM_CAND: tl.constexpr):
    """The race's winner over a row's candidate list (it holds every token of positive weight)."""
    slots = tl.arange(0, NUM_CAND)
    index = tl.load(index_ptr + slots, mask=slots < listed, other=V, volatile=True)
    scaled = tl.load(scaled_ptr + slots, mask=slots < listed, other=float("-inf"), volatile=True)
    w = tl.where(slots < listed, _weights(_probs(scaled, kth, denom, CT), cut, norm, CT), 0.0).to(tl.float64)
    ratio = _race_ratios(index, w, seed, position)
    best = _max1(ratio)
    return _min1(tl.where(ratio == best, index, V))


@triton.jit
def _first_child_with(token, node, may_descend, parents_row, tokens_row, N, BLOCK_N: tl.constexpr):
    """The first child of ``node`` holding ``token`` (-1 if none, or when the node is a leaf)."""
    offs = tl.arange(0, BLOCK_N)
    hit = _children_of(node, parents_row, offs, N) & (tl.load(tokens_row + offs, mask=offs < N, other=-1) == token) \
        & may_descend
    first = _min1(tl.where(hit, offs, BLOCK_N))
    return tl.where(first < BLOCK_N, first, -1)


@triton.jit
def _load_prefix(ptr, IS_FP64: tl.constexpr):
    """The open search's key prefix (stored as the bits of an int64)."""
    bits = tl.load(ptr, volatile=True)
    if IS_FP64:
        return bits.to(tl.uint64, bitcast=True)
    else:
        return bits.to(tl.uint32)


@triton.jit
def _store_prefix(ptr, prefix, IS_FP64: tl.constexpr):
    if IS_FP64:
        tl.store(ptr, prefix.to(tl.uint64).to(tl.int64, bitcast=True))
    else:
        tl.store(ptr, prefix.to(tl.uint32).to(tl.int64))


@triton.jit
def _list_counts(ctl, part_counts_ptr, part_search_ptr, parts, splits, mask, RADIX: tl.constexpr,
                 NUM_PIVOTS: tl.constexpr):
    """Each chunk's entries at or above the list level: the levels' counts at pivot CTL_PIVOT, or
    for a list of the top-k set (CTL_PIVOT = -1 - lane) the last top-k digit's count in that lane."""
    pivot = tl.load(ctl + CTL_PIVOT, volatile=True)
    if pivot >= 0:
        counts = tl.load(part_counts_ptr + (parts + splits) * NUM_PIVOTS + pivot, mask=mask, other=0, volatile=True)
    else:
        counts = tl.load(part_search_ptr + (parts + splits) * 2 * RADIX + (-1 - pivot), mask=mask, other=0.0,
                         volatile=True).to(tl.int32)
    return counts


@triton.jit
def _accept(row, V, row_max, t, kth, denom, cut, norm, mass, node, may_descend, parents_row, tokens_row, tokens,
            accept_coins, offs_n, N, CT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tries the node's children in node order: child c with token x is accepted with
    probability w(x) / mass under the residual; a rejection zeroes w(x) (``rejected`` flags the
    child) and removes it from the mass. Returns (accepted child or -1, rejected flags)."""
    child = -1
    rejected = tl.zeros([BLOCK_N], tl.int32)
    if may_descend:
        children = _children_of(node, parents_row, offs_n, N)
        c = _next_flagged(children, node, offs_n, N)
        while c < N:
            x = tl.load(tokens_row + c)
            in_range = (x >= 0) & (x < V)
            logit = tl.load(row + x, mask=in_range, other=float("-inf")).to(CT)
            wx = _weights(_probs(_scaled(logit, row_max, t), kth, denom, CT), cut, norm, CT)
            seen = _max1(((rejected != 0) & (tokens == x)).to(tl.int32))
            wx = tl.where(seen != 0, 0.0, wx).to(CT)
            u = _sum1(tl.where(offs_n == c, accept_coins, 0.0))
            # w[x] > 0 first: a coin of 0 never accepts a zero-probability token.
            if (wx > 0) & (u < wx.to(tl.float64) / mass):
                child = c
            elif wx > 0:  # reject: zero p(x) and renormalise
                rejected = tl.where(offs_n == c, 1, rejected)
                mass = mass - wx.to(tl.float64)
            c = tl.where(child >= 0, N, _next_flagged(children, c, offs_n, N))
    return child, rejected


@triton.jit
def _accept_and_bonus(row, V, row_max, t, kth, denom, cut, norm, mass, node, may_descend, parents_row, tokens_row,
                      tokens, accept_coins, offs_n, N, seed, offset, listed, index_b, scaled_b, sums_b,
                      CT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr,
                      NUM_CAND: tl.constexpr):
    """Deterministic drafts: _accept, then the bonus over the candidate list or the row's tiles
    when every child fails. Returns (child or -1, bonus or -1, finish)."""
    child, rejected = _accept(row, V, row_max, t, kth, denom, cut, norm, mass, node, may_descend, parents_row,
                              tokens_row, tokens, accept_coins, offs_n, N, CT, BLOCK_N)
    bonus = tl.full([], -1, tl.int32)
    finish = 0
    if child < 0:
        u = _sum1(tl.where(offs_n == node, _uniform(seed, offset, offs_n, BONUS_DRAW), 0.0))
        if listed >= 0:
            if NUM_CAND > 0:
                bonus = _bonus_from_list(index_b, scaled_b, listed, tokens_row, node, N, rejected, offs_n, kth, denom,
                                         cut, norm, u, V, CT, NUM_CAND).to(tl.int32)
        else:
            bonus = _inverse_cdf(row, V, row_max, t, kth, denom, cut, norm, u, tokens_row, node, N, rejected, offs_n,
                                 sums_b, CT, BLOCK_V, BLOCK_T).to(tl.int32)
        finish = 1
    return child, bonus, finish


# Rejections at a node with sampled children (the draft-aware rule, docs/ops.md §4), recorded in
# order; the residual weight of any token is its first weight with these events applied.
EV_ZERO = tl.constexpr(1)  # a deterministic child, or a sampled one whose residual would be empty: w(x) = 0
EV_RESIDUAL = tl.constexpr(2)  # a sampled child: w = max(w / mass - r', 0)
EV_KEEP = tl.constexpr(3)  # a sampled child whose residual and zeroing would both be empty: w unchanged
# An event's float64 words in the per-request scratch: kind, token, the mass before it and, for a
# sampled child, the draft mass removed before it (-1 for a deterministic child).
EV_WORD_KIND = tl.constexpr(0)
EV_WORD_TOKEN = tl.constexpr(1)
EV_WORD_MASS = tl.constexpr(2)
EV_WORD_REMOVED = tl.constexpr(3)
EVENT_WORDS = tl.constexpr(4)


@triton.jit
def _draft_r(ids, valid, q_row, inv_ptr, S, HAS_D2T: tl.constexpr):
    """r(y) = q_u(draft id of y) / S in float64 for target ids ``ids`` (0 where no draft id maps
    to y)."""
    if HAS_D2T:
        draft = tl.load(inv_ptr + ids, mask=valid, other=-1)
        q = tl.load(q_row + draft, mask=valid & (draft >= 0), other=0.0)
    else:
        q = tl.load(q_row + ids, mask=valid, other=0.0)
    return q.to(tl.float64) / S


@triton.jit
def _apply_events(w, ids, r, events, n_events, CT: tl.constexpr):
    """The residual weights of tokens ``ids`` (first weights ``w``, draft probabilities ``r``)
    after the node's ``n_events`` recorded rejections (``events``: EVENT_WORDS float64 per
    rejection), computed as the reference does: ``w / mass`` in the compute dtype with mass
    rounded to it, ``r'`` rounded to it from float64."""
    zeroed = ids < 0  # the earlier sampled siblings' tokens: out of r'
    for j in range(0, n_events):
        kind = tl.load(events + j * EVENT_WORDS + EV_WORD_KIND, volatile=True).to(tl.int32)
        token = tl.load(events + j * EVENT_WORDS + EV_WORD_TOKEN, volatile=True).to(tl.int64)
        removed = tl.load(events + j * EVENT_WORDS + EV_WORD_REMOVED, volatile=True)
        if kind == EV_RESIDUAL:
            mass = tl.load(events + j * EVENT_WORDS + EV_WORD_MASS, volatile=True)
            r_now = tl.where(zeroed, 0.0, r / (1.0 - removed)).to(CT)
            w = tl.maximum(w / mass.to(CT) - r_now, 0.0).to(CT)
        elif kind == EV_ZERO:
            w = tl.where(ids == token, 0.0, w).to(CT)
        if removed >= 0:  # a sampled child (deterministic ones record -1): out of r' from now on
            zeroed = zeroed | (ids == token)
    return w


@triton.jit
def _record_event(events, n_events, kind, token, mass, removed):
    at = events + n_events * EVENT_WORDS
    tl.store(at + EV_WORD_KIND, kind.to(tl.float64))
    tl.store(at + EV_WORD_TOKEN, token.to(tl.float64))
    tl.store(at + EV_WORD_MASS, mass.to(tl.float64))
    tl.store(at + EV_WORD_REMOVED, removed.to(tl.float64))
    tl.debug_barrier()  # read back by every thread of the program


@triton.jit
def _residual_row_tile(row, start, V, row_max, t, kth, denom, cut, norm, q_row, inv_ptr, S, events, n_events,
                       CT: tl.constexpr, BLOCK_V: tl.constexpr, HAS_D2T: tl.constexpr):
    """Token ids, validity and float64 residual weights of one tile of the row."""
    offs = start + tl.arange(0, BLOCK_V)
    valid = offs < V
    s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
    w = tl.where(valid, _weights(_probs(s, kth, denom, CT), cut, norm, CT), 0.0).to(CT)
    r = _draft_r(offs, valid, q_row, inv_ptr, S, HAS_D2T)
    w = _apply_events(w, offs, r, events, n_events, CT)
    return offs, valid, tl.where(valid, w, 0.0).to(tl.float64)


@triton.jit
def _residual_range(row, start, end, row_max, t, kth, denom, cut, norm, q_row, inv_ptr, S, events, n_events,
                    CT: tl.constexpr, BLOCK_R: tl.constexpr, HAS_D2T: tl.constexpr):
    """float64 sum of the residual weights of the row's entries in [start, end), tile by tile
    (the order the bonus draw's scan adds them in)."""
    total = tl.zeros([], tl.float64)
    for tile in range(start, end, BLOCK_R):
        offs, valid, w = _residual_row_tile(row, tile, end, row_max, t, kth, denom, cut, norm, q_row, inv_ptr, S,
                                            events, n_events, CT, BLOCK_R, HAS_D2T)
        total += _sum1(w)
    return total


@triton.jit
def _residual_bonus(row, V, row_max, t, kth, denom, cut, norm, q_row, inv_ptr, S, events, n_events, u,
                    part_mass, splits, in_splits, chunk, CT: tl.constexpr, BLOCK_R: tl.constexpr,
                    HAS_D2T: tl.constexpr):
    """Inverse CDF over the residual row (as _inverse_cdf) from a residual phase's chunk sums
    (``part_mass``: [SPLITS] float64, chunk j = entries [j * chunk, (j + 1) * chunk)): the
    smallest x with cumsum64(w)[x] > u * sum(w), else the largest x with w[x] > 0. The merging
    program scans from the chunk where the running sum passes the target, normally within it."""
    sums = tl.load(part_mass + splits, mask=in_splits, other=0.0, volatile=True)
    target = u * _sum1(sums)
    tile, carry = _draw_chunk(sums, target, splits, in_splits, chunk, V)
    found = tl.zeros([], tl.int64) + V
    while tile < V:
        offs, valid, w = _residual_row_tile(row, tile, V, row_max, t, kth, denom, cut, norm, q_row, inv_ptr, S,
                                            events, n_events, CT, BLOCK_R, HAS_D2T)
        found = _min1(tl.where((tl.cumsum(w, axis=0) + carry > target) & valid, offs, V))
        carry += _sum1(w)
        tile = tl.where(found < V, V, tile + BLOCK_R)
    if found == V:  # only through rounding: the largest token with a positive residual weight
        last_positive = tl.full([], -1, tl.int64)
        for start in range(0, V, BLOCK_R):
            offs, valid, w = _residual_row_tile(row, start, V, row_max, t, kth, denom, cut, norm, q_row, inv_ptr, S,
                                                events, n_events, CT, BLOCK_R, HAS_D2T)
            last_positive = tl.maximum(last_positive, _max1(tl.where(w > 0, offs, -1)))
        found = tl.maximum(last_positive, 0)
    return found


@triton.jit
def _sampled_child_count(node, may_descend, parents_row, sampled_row, N, BLOCK_N: tl.constexpr,
                         HAS_MASK: tl.constexpr):
    """How many children of ``node`` were drawn from its draft row."""
    offs_n = tl.arange(0, BLOCK_N)
    child = _children_of(node, parents_row, offs_n, N) & may_descend
    if HAS_MASK:
        child = child & (tl.load(sampled_row + offs_n, mask=offs_n < N, other=0) != 0)
    return _sum1(child.to(tl.int32))


@triton.jit
def _draft_siblings_bad(node, parents_row, tokens_row, tokens, sampled_row, q_row, inv_ptr, S, V, offs_n, N,
                        HAS_MASK: tl.constexpr, HAS_D2T: tl.constexpr):
    """1 when a sampled child of ``node`` makes its draft row invalid: r(x) <= 0, an earlier
    sampled sibling with the same token, or the earlier siblings' r already summing to 1."""
    siblings = _children_of(node, parents_row, offs_n, N)
    if HAS_MASK:
        siblings = siblings & (tl.load(sampled_row + offs_n, mask=offs_n < N, other=0) != 0)
    bad = tl.zeros([], tl.int1)
    removed = tl.zeros([], tl.float64)
    c = _next_flagged(siblings, node, offs_n, N)
    while c < N:
        x = tl.load(tokens_row + c)
        xs = x + offs_n * 0
        rx = _sum1(_draft_r(xs, (offs_n == 0) & (xs >= 0) & (xs < V), q_row, inv_ptr, S, HAS_D2T))
        seen = _max1((siblings & (offs_n < c) & (tokens == x)).to(tl.int32)) != 0
        bad = bad | (rx <= 0) | seen | (removed >= 1.0)
        removed += rx
        c = _next_flagged(siblings, c, offs_n, N)
    return bad


@triton.jit
def _try_children(row, V, row_max, t, kth, denom, cut, norm, mass, removed, n_events, after, node, parents_row,
                  tokens_row, sampled_row, q_row, inv_ptr, S, events, accept_coins, offs_n, N, CT: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_D2T: tl.constexpr):
    """The draft-aware rule's children of ``node`` after ``after``, in node order, against the
    residual (docs/ops.md §4), until one is accepted or a sampled one is rejected: that
    rejection is recorded (event ``n_events``) and its new mass needs a residual phase. A
    rejected deterministic child zeroes w(x) and leaves the mass less w(x). Returns (accepted
    child or -1, rejected sampled child or -1, mass, events recorded, w(x) of that child)."""
    children = _children_of(node, parents_row, offs_n, N)
    child = -1
    pending = -1
    pending_w = tl.zeros([], tl.float64)
    c = _next_flagged(children, after, offs_n, N)
    while c < N:
        is_sampled = tl.full([], 1, tl.int32) != 0
        if HAS_MASK:
            is_sampled = tl.load(sampled_row + c) != 0
        x = tl.load(tokens_row + c)
        xs = x + offs_n * 0
        one = (offs_n == 0) & (xs >= 0) & (xs < V)
        logit = tl.load(row + xs, mask=one, other=float("-inf")).to(CT)
        w0 = tl.where(one, _weights(_probs(_scaled(logit, row_max, t), kth, denom, CT), cut, norm, CT), 0.0).to(CT)
        r = _draft_r(xs, one, q_row, inv_ptr, S, HAS_D2T)
        wx = _sum1(_apply_events(w0, xs, r, events, n_events, CT).to(tl.float64))
        d = tl.where(is_sampled, _sum1(r) / (1.0 - removed), 1.0)
        coin = _sum1(tl.where(offs_n == c, accept_coins, 0.0))
        if (wx > 0) & (coin < (wx / mass) / d):
            child = c
        elif is_sampled:
            _record_event(events, n_events, tl.full([], EV_RESIDUAL, tl.int32), x, mass, removed)
            pending = c
            pending_w = wx
        elif wx > 0:
            _record_event(events, n_events, tl.full([], EV_ZERO, tl.int32), x, mass, tl.full([], -1.0, tl.float64))
            n_events += 1
            mass = mass - wx
        c = tl.where((child >= 0) | (pending >= 0), N, _next_flagged(children, c, offs_n, N))
    return child, pending, mass, n_events, pending_w


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
    stats_ptr,  # [B, N, NUM_STATS] float64: the scalars of each visited sampling row (RECORD only)
    cand_count_ptr,  # [B, N] int32: list length of each visited sampling row, -1 without a list (RECORD only)
    ctl_ptr,  # [B, CTL_WORDS + 2 * PHASES] int32, zero: control words, claim and done counters (left zero)
    rowf_ptr,  # [B, ROW_WORDS] float64 scratch: the current row's scalars
    part_max_ptr,  # [B, SPLITS] compute dtype: chunk max
    part_arg_ptr,  # [B, SPLITS] int32: chunk first argmax
    part_flags_ptr,  # [B, SPLITS] int32: chunk NaN / +inf (bit 0) and finite (bit 1) flags; draft phase: bad entries
    part_total_ptr,  # [B, SPLITS] float64: chunk softmax sum
    part_counts_ptr,  # [B, SPLITS, NUM_PIVOTS] int32: chunk entries at or above each level
    part_sums_ptr,  # [B, SPLITS, NUM_PIVOTS] float32: their exp(s) sum
    part_mass_ptr,  # [B, SPLITS] float64: chunk sum of the weights (draft phase: of q; residual phase: of the residual)
    part_search_ptr,  # [B, SPLITS, 2, 2^RADIX_BITS] float64: chunk counts / p sums of a search digit; last digit:
    # each candidate's normaliser
    prefix_ptr,  # [B] int64 scratch: the order-key prefix of the open search (bits of a uint32 / uint64)
    cand_index_ptr,  # [B, NUM_CAND] int32 scratch: the current row's candidate ids, ascending
    cand_scaled_ptr,  # [B, NUM_CAND] compute dtype scratch: their s
    tile_sums_ptr,  # [B, BLOCK_T] float64 scratch: per-tile sums of the current row's weights
    accept_len_ptr,  # [B] int32
    accept_nodes_ptr,  # [B, A] int32, A = max_depth + 1
    out_tokens_ptr,  # [B, A] int64
    status_ptr,  # [B] int32
    draft_probs_ptr,  # [B, N, Vd] float32 (read only when HAS_DRAFT)
    draft_sampled_ptr,  # [B, N] int8 (read only when HAS_MASK)
    inv_d2t_ptr,  # [V] int32: the draft id of each target id, -1 for none (read only when HAS_D2T)
    d2t_ok_ptr,  # [1] int32: 1 when every draft id maps into [0, V)
    events_ptr,  # [B, EVENT_WORDS * BLOCK_N] float64 scratch: the rejections at the current node
    positions_ptr,  # [B] int64, stride stride_pos: the position the root's row predicts (read only when HAS_POSITIONS)
    pending_ptr,  # [B] int32 (SKIP_ROWS): 1 for the requests the all-rows kernel launched before left to this one
    N, V, Vd, max_depth, chunk, chunk_d,  # chunk_d: entries of the draft row a draft phase's chunk takes
    stride_lb, stride_ln, stride_pos,
    IS_FP64: tl.constexpr,
    SIG_BITS: tl.constexpr,  # leading order-key bits that vary (16 bf16, 19 fp16, 32 fp32, 64 fp64)
    SPLITS: tl.constexpr,  # chunks per row (programs per request)
    PHASES: tl.constexpr,  # claim / done counters per request: 6 + 2 * DIGITS per row the walk can visit
    BLOCK_SPLITS: tl.constexpr,  # next power of two of SPLITS, at least 32 (whole-view merge sums: _sum0)
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,  # tile of the draft-aware rule's passes (draft row, residual)
    BLOCK_MAX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_T: tl.constexpr,  # next power of two of the BLOCK_V tiles per row
    RADIX_BITS: tl.constexpr,
    NUM_CAND: tl.constexpr,  # candidate list capacity; 0 turns the candidate path off
    SHORT_CAND: tl.constexpr,  # min(128, NUM_CAND): the sort size of short lists
    HAS_DRAFT: tl.constexpr,  # draft_probs given: the draft-aware rule at nodes with sampled children
    HAS_MASK: tl.constexpr,  # draft_sampled given (else every non-root node is sampled)
    HAS_D2T: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,  # coupled sampling for the sampling requests
    RECORD: tl.constexpr,  # store each visited row's scalars and list length (tests)
    BLOCK_CTL: tl.constexpr,  # next power of two of CTL_WORDS + 2 * PHASES
    SKIP_ROWS: tl.constexpr = False,  # serve only the requests verify_temperature.py's launch left pending
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """Programs (b, j), j < SPLITS, walk request b's tree together (module docstring of
    verify.py): each phase is one pass over the chunks of the current row; a program claims
    chunks of the open phase, and the one that finishes a phase's last chunk merges the
    chunks, walks on (accepts a child, or draws the bonus token) and opens the next phase.
    A program with nothing left to claim waits only for chunks already claimed by running
    programs, so the launch never depends on how many programs are resident."""
    wait_for_prior_grids(USE_PDL)
    if SKIP_ROWS:
        # The all-rows kernel launched before this one served the other requests. (Checked first, on a load
        # of its own: after the request's other scalars the walk modeled 4% slower.)
        if tl.load(pending_ptr + tl.program_id(0)) == 0:
            return
    if IS_FP64:
        CT: tl.constexpr = tl.float64
        KT: tl.constexpr = tl.uint64
        KEY_BITS: tl.constexpr = 64
    else:
        CT: tl.constexpr = tl.float32
        KT: tl.constexpr = tl.uint32
        KEY_BITS: tl.constexpr = 32
    RADIX: tl.constexpr = 1 << RADIX_BITS
    DIGITS: tl.constexpr = (SIG_BITS + RADIX_BITS - 1) // RADIX_BITS
    b = tl.program_id(0).to(tl.int64)
    A = max_depth + 1
    temperature = tl.load(temperature_ptr + b)
    top_k = tl.load(top_k_ptr + b)
    top_p = tl.load(top_p_ptr + b)
    greedy = temperature == 0.0
    # Coupled sampling: each visited row's token is the race's winner (draft rows play no part); the
    # race replaces the mass pass on rows without a list. Without positions these are constants, so
    # that launch compiles to the kernel without the race.
    if HAS_POSITIONS:
        coupled = temperature != 0.0
        position0 = tl.load(positions_ptr + b * stride_pos)
        mass_kind = tl.where(coupled, KIND_RACE, KIND_MASS)
    else:
        coupled = tl.zeros([], tl.int1)  # a constant: the race code folds away
        position0 = tl.zeros([], tl.int64)
        mass_kind = KIND_MASS
    use_k = (top_k > 0) & (top_k < V)
    use_p = top_p < 1.0
    t = temperature.to(CT)
    logits_b = logits_ptr + b * stride_lb
    ctl = ctl_ptr + b * (CTL_WORDS + 2 * PHASES)
    claims = ctl + CTL_WORDS
    dones = claims + PHASES
    rowf = rowf_ptr + b * ROW_WORDS
    parts = b * SPLITS
    index_b = cand_index_ptr + b * NUM_CAND
    scaled_b = cand_scaled_ptr + b * NUM_CAND
    sums_b = tile_sums_ptr + b * BLOCK_T
    tokens_row = tokens_ptr + b * N
    parents_row = parents_ptr + b * N
    offs_a = tl.arange(0, BLOCK_A)
    splits = tl.arange(0, BLOCK_SPLITS)
    in_splits = splits < SPLITS

    phase = tl.zeros([], tl.int32)
    running = tl.full([], 1, tl.int32)
    while running != 0:
        # Wait for the phase to open (acquire: its kind, row and scalars are then visible).
        opened = tl.atomic_add(ctl + CTL_PHASE, 0)
        while opened < phase:
            opened = tl.atomic_add(ctl + CTL_PHASE, 0)
        if opened >= FINISHED:
            running = 0
        else:
            claim = tl.atomic_add(claims + phase, 1)
            if claim >= SPLITS:
                phase += 1  # every chunk of this phase is taken: wait for the next one
            else:
                kind = tl.load(ctl + CTL_KIND, volatile=True)
                node = tl.load(ctl + CTL_NODE, volatile=True)
                row = logits_b + node * stride_ln
                start = claim * chunk
                end = tl.minimum(start + chunk, V)
                if (phase == 0) & (claim == 0):
                    tl.store(accept_nodes_ptr + b * A + offs_a, tl.where(offs_a == 0, 0, -1), mask=offs_a < A)
                    tl.store(out_tokens_ptr + b * A + offs_a, tl.full([BLOCK_A], -1, tl.int64), mask=offs_a < A)
                # The row max (a later phase's: the max phase's merge writes it).
                row_max = tl.load(rowf + ROW_MAX, mask=kind != KIND_MAX, other=0.0, volatile=True).to(CT)
                if kind == KIND_MAX:
                    chunk_max, chunk_arg, chunk_flags = _range_max(row, start, end, CT, BLOCK_MAX)
                    tl.store(part_max_ptr + parts + claim, chunk_max)
                    tl.store(part_arg_ptr + parts + claim, chunk_arg)
                    tl.store(part_flags_ptr + parts + claim, chunk_flags)
                elif kind == KIND_LEVELS:
                    if use_k | use_p:
                        chunk_total, chunk_counts, chunk_sums = _range_levels(row, start, end, row_max, t, CT,
                                                                              BLOCK_S)
                        tl.store(part_counts_ptr + (parts + claim) * NUM_PIVOTS + tl.arange(0, NUM_PIVOTS),
                                 chunk_counts)
                        tl.store(part_sums_ptr + (parts + claim) * NUM_PIVOTS + tl.arange(0, NUM_PIVOTS), chunk_sums)
                    else:  # no candidate list: the level counts are never read
                        chunk_total = _range_total(row, start, end, row_max, t, CT, BLOCK_V)
                    tl.store(part_total_ptr + parts + claim, chunk_total)
                elif kind == KIND_DRAFT:
                    if HAS_DRAFT:
                        d_start = claim * chunk_d
                        d_sum, d_bad = _draft_range(draft_probs_ptr + (b * N + node) * Vd, d_start,
                                                    tl.minimum(d_start + chunk_d, Vd), BLOCK_R)
                        tl.store(part_mass_ptr + parts + claim, d_sum)
                        tl.store(part_flags_ptr + parts + claim, d_bad)
                elif kind == KIND_LIST:
                    if NUM_CAND > 0:
                        before = _list_counts(ctl, part_counts_ptr, part_search_ptr, parts, splits, splits < claim,
                                              RADIX, NUM_PIVOTS)
                        level = tl.load(rowf + ROW_LEVEL, volatile=True).to(CT)
                        _store_list(row, start, end, row_max, t, level, _sum1(before), index_b, scaled_b,
                                    CT, BLOCK_V, NUM_CAND)
                else:
                    kth = tl.load(rowf + ROW_KTH, volatile=True).to(CT)
                    denom = tl.load(rowf + ROW_DENOM, volatile=True).to(CT)
                    cut = tl.load(rowf + ROW_CUT, volatile=True).to(CT)
                    norm = tl.load(rowf + ROW_NORM, volatile=True).to(CT)
                    if kind == KIND_MASS:
                        tl.store(part_mass_ptr + parts + claim,
                                 _range_mass(row, start, end, row_max, t, kth, denom, cut, norm, sums_b, CT, BLOCK_V))
                    elif kind == KIND_RESIDUAL:
                        if HAS_DRAFT:
                            tl.store(part_mass_ptr + parts + claim, _residual_range(
                                row, start, end, row_max, t, kth, denom, cut, norm,
                                draft_probs_ptr + (b * N + node) * Vd, inv_d2t_ptr,
                                tl.load(rowf + ROW_S, volatile=True), events_ptr + b * EVENT_WORDS * BLOCK_N,
                                tl.load(ctl + CTL_EVENTS, volatile=True), CT, BLOCK_R, HAS_D2T))
                    elif kind == KIND_RACE:
                        if HAS_POSITIONS:
                            position = position0 + tl.load(ctl + CTL_DEPTH, volatile=True)
                            race_best, race_id = _range_race(row, start, end, row_max, t, kth, denom, cut, norm,
                                                             tl.load(seed_ptr + b), position, CT, BLOCK_V)
                            tl.store(part_total_ptr + parts + claim, race_best)
                            tl.store(part_arg_ptr + parts + claim, race_id)
                    else:
                        prefix = _load_prefix(prefix_ptr + b, IS_FP64)
                        digit = tl.load(ctl + CTL_DIGIT, volatile=True)
                        shift = KEY_BITS - RADIX_BITS * (digit + 1)
                        at = part_search_ptr + (parts + claim) * 2 * RADIX + tl.arange(0, RADIX)
                        if digit + 1 < DIGITS:
                            if kind == KIND_SEARCH_K:
                                totals = _search_chunk(row, start, end, prefix, shift, row_max, t, kth, denom, False,
                                                       CT, IS_FP64, BLOCK_S, RADIX_BITS)
                            else:
                                totals = _search_chunk(row, start, end, prefix, shift, row_max, t, kth, denom, True,
                                                       CT, IS_FP64, BLOCK_S, RADIX_BITS)
                        else:
                            if kind == KIND_SEARCH_K:
                                totals, kept = _search_chunk_last(row, start, end, prefix, shift, row_max, t, kth,
                                                                  denom, False, CT, IS_FP64, SIG_BITS, BLOCK_S,
                                                                  RADIX_BITS)
                            else:
                                totals, kept = _search_chunk_last(row, start, end, prefix, shift, row_max, t, kth,
                                                                  denom, True, CT, IS_FP64, SIG_BITS, BLOCK_S,
                                                                  RADIX_BITS)
                            tl.store(at + RADIX, kept)
                        tl.store(at, totals)
                # Release this chunk's results; the last chunk of the phase merges them.
                tl.debug_barrier()
                if tl.atomic_add(dones + phase, 1) == SPLITS - 1:
                    depth = tl.load(ctl + CTL_DEPTH, volatile=True)
                    may_descend = depth < max_depth  # a node at max_depth is a leaf
                    next_kind = KIND_MAX
                    next_node = node
                    finish = 0
                    bad = 0
                    draft_bad = 0
                    bonus = -1
                    child = -1
                    ready = 0  # 1: the row's weights are known, walk on
                    # The draft-aware rule at a node with sampled children: 1 to try its children
                    # after `after` next, or to draw its bonus from the last residual phase's sums.
                    try_children = 0
                    draw_bonus = 0
                    after = node
                    S = tl.full([], 1.0, tl.float64)
                    removed = tl.zeros([], tl.float64)
                    n_events = tl.zeros([], tl.int32)
                    reusable = 0  # 1: the chunk sums are the final residual's (the bonus needs no phase)
                    search = 0  # 1: start the whole-row threshold searches
                    listed = -1
                    seed_prefix = tl.zeros([], KT)  # the first search's prefix and digit (_seed_prefix)
                    seed_digit = tl.zeros([], tl.int32)
                    kth = tl.full([], float("-inf"), CT)
                    denom = tl.full([], 1.0, CT)
                    cut = tl.full([], float("-inf"), CT)
                    norm = tl.full([], 1.0, CT)
                    mass = tl.zeros([], tl.float64)
                    total = tl.load(rowf + ROW_TOTAL, volatile=True)
                    if kind == KIND_MAX:
                        cm = tl.load(part_max_ptr + parts + splits, mask=in_splits, other=float("-inf"), volatile=True)
                        ca = tl.load(part_arg_ptr + parts + splits, mask=in_splits, other=V, volatile=True)
                        cf = tl.load(part_flags_ptr + parts + splits, mask=in_splits, other=0, volatile=True)
                        row_max, arg, row_bad = _merge_max(cm, ca, cf, V)
                        if row_bad:
                            bad = 1
                            finish = 1
                        elif greedy:
                            child = _first_child_with(arg, node, may_descend, parents_row, tokens_row, N, BLOCK_N)
                            if child < 0:
                                bonus = arg
                                finish = 1
                        else:
                            tl.store(rowf + ROW_MAX, row_max.to(tl.float64))
                            next_kind = KIND_LEVELS
                    elif kind == KIND_LEVELS:
                        total = _sum1(tl.load(part_total_ptr + parts + splits, mask=in_splits, other=0.0,
                                              volatile=True))
                        tl.store(rowf + ROW_TOTAL, total)
                        pivot = tl.full([], NUM_PIVOTS, tl.int32)
                        if NUM_CAND > 0:
                            if use_k | use_p:
                                at = (parts + splits)[:, None] * NUM_PIVOTS + tl.arange(0, NUM_PIVOTS)[None, :]
                                level_counts = _sum0(tl.load(part_counts_ptr + at, mask=in_splits[:, None], other=0,
                                                             volatile=True))
                                level_sums = _sum0(tl.load(part_sums_ptr + at, mask=in_splits[:, None], other=0.0,
                                                           volatile=True))
                                pivot = _list_level(level_counts, level_sums, total, top_k, top_p, use_k, NUM_CAND)
                                # Where no list fits: the first search starts at the digits its level band fixes.
                                seed_prefix, seed_digit = _seed_prefix(level_counts, level_sums, total, top_k, top_p,
                                                                       use_k, row_max, t, float("-inf"), CT, IS_FP64,
                                                                       SIG_BITS, RADIX_BITS)
                        if pivot < NUM_PIVOTS:
                            tl.store(ctl + CTL_PIVOT, pivot)
                            tl.store(rowf + ROW_LEVEL, _pivot_level(pivot, CT).to(tl.float64))
                            next_kind = KIND_LIST
                        else:
                            # No list holds the kept tokens (or temperature alone): the searches,
                            # then the mass.
                            search = 1
                    elif kind == KIND_LIST:
                        if NUM_CAND > 0:
                            stored = _sum1(_list_counts(ctl, part_counts_ptr, part_search_ptr, parts, splits,
                                                        in_splits, RADIX, NUM_PIVOTS))
                            level = tl.load(rowf + ROW_LEVEL, volatile=True).to(CT)
                            tl.debug_barrier()
                            # Lists are mostly short: sort SHORT_CAND slots when they hold it.
                            if stored <= SHORT_CAND:
                                listed, kth, denom, cut, norm, mass = _list_stats(
                                    scaled_b, stored, level, top_k, top_p, use_k, use_p, total, CT, SHORT_CAND)
                            else:
                                listed, kth, denom, cut, norm, mass = _list_stats(
                                    scaled_b, stored, level, top_k, top_p, use_k, use_p, total, CT, NUM_CAND)
                        if listed >= 0:
                            ready = 1
                        else:
                            search = 1  # the list cannot give the thresholds exactly
                    elif (kind == KIND_SEARCH_K) | (kind == KIND_SEARCH_P):
                        digit = tl.load(ctl + CTL_DIGIT, volatile=True)
                        shift = KEY_BITS - RADIX_BITS * (digit + 1)
                        at = (parts + splits)[:, None] * 2 * RADIX + tl.arange(0, RADIX)[None, :]
                        totals = _sum0(tl.load(part_search_ptr + at, mask=in_splits[:, None], other=0.0,
                                               volatile=True))
                        target = tl.where(kind == KIND_SEARCH_K, top_k.to(tl.float64), top_p.to(tl.float64))
                        prefix = _search_digit(_load_prefix(prefix_ptr + b, IS_FP64), shift, totals, target, IS_FP64,
                                               RADIX_BITS)
                        next_kind = kind
                        if digit + 1 < DIGITS:
                            _store_prefix(prefix_ptr + b, prefix, IS_FP64)
                            tl.store(ctl + CTL_DIGIT, digit + 1)
                        else:
                            # The normaliser of the threshold found: its lane of the chunks' sums.
                            lane = ((prefix >> shift.to(prefix.dtype)) & (RADIX - 1)).to(tl.int32)
                            in_lane = in_splits[:, None] & (tl.arange(0, RADIX) == lane)[None, :]
                            kept = tl.sum(_sum0(tl.load(part_search_ptr + at + RADIX, mask=in_lane, other=0.0,
                                                        volatile=True)), axis=0).to(CT)
                            value = _search_value(prefix, CT, IS_FP64, SIG_BITS, RADIX_BITS).to(CT)
                            next_kind = mass_kind
                            if kind == KIND_SEARCH_K:
                                kth = _scaled(value, row_max, t)
                                tl.store(rowf + ROW_KTH, kth.to(tl.float64))
                                tl.store(rowf + ROW_DENOM, kept.to(tl.float64))
                                if use_p:
                                    # The entries with s >= kth (their count is the threshold's lane of the
                                    # totals) hold the nucleus: a list of them when it fits, else the search.
                                    at_kth = tl.sum(tl.where(tl.arange(0, RADIX) == lane, totals, 0.0), axis=0)
                                    if (NUM_CAND > 0) & (at_kth <= NUM_CAND):
                                        tl.store(ctl + CTL_PIVOT, -1 - lane)
                                        tl.store(rowf + ROW_LEVEL, kth.to(tl.float64))
                                        next_kind = KIND_LIST
                                    else:
                                        # The top-p search, seeded by the levels at or above kth.
                                        seed_prefix = tl.zeros([], KT)
                                        seed_digit = tl.zeros([], tl.int32)
                                        if NUM_CAND > 0:
                                            lv = (parts + splits)[:, None] * NUM_PIVOTS \
                                                + tl.arange(0, NUM_PIVOTS)[None, :]
                                            level_counts = _sum0(tl.load(part_counts_ptr + lv, mask=in_splits[:, None],
                                                                         other=0, volatile=True))
                                            level_sums = _sum0(tl.load(part_sums_ptr + lv, mask=in_splits[:, None],
                                                                       other=0.0, volatile=True))
                                            seed_prefix, seed_digit = _seed_prefix(
                                                level_counts, level_sums, kept.to(tl.float64), top_k, top_p,
                                                use_k == 0, row_max, t, kth, CT, IS_FP64, SIG_BITS, RADIX_BITS)
                                        _store_prefix(prefix_ptr + b, seed_prefix, IS_FP64)
                                        tl.store(ctl + CTL_DIGIT, seed_digit)
                                        next_kind = KIND_SEARCH_P
                            else:
                                kth = tl.load(rowf + ROW_KTH, volatile=True).to(CT)
                                denom = tl.load(rowf + ROW_DENOM, volatile=True).to(CT)
                                cut = _probs(_scaled(value, row_max, t), kth, denom, CT)
                                tl.store(rowf + ROW_CUT, cut.to(tl.float64))
                                tl.store(rowf + ROW_NORM, kept.to(tl.float64))
                    elif kind == KIND_RACE:
                        if HAS_POSITIONS:
                            ratios = tl.load(part_total_ptr + parts + splits, mask=in_splits, other=-3.0, volatile=True)
                            ids = tl.load(part_arg_ptr + parts + splits, mask=in_splits, other=V, volatile=True)
                            winner = _min1(tl.where(ratios == _max1(ratios), ids, V))
                            child = _first_child_with(winner, node, may_descend, parents_row, tokens_row, N, BLOCK_N)
                            if child < 0:
                                bonus = winner
                                finish = 1
                    elif (kind == KIND_DRAFT) | (kind == KIND_RESIDUAL):
                        if HAS_DRAFT:
                            # The draft-aware rule at `node`, resumed after a phase over the chunks:
                            # the draft row's check, a rejected sampled child's new mass, or the
                            # bonus draw's residual totals.
                            kth = tl.load(rowf + ROW_KTH, volatile=True).to(CT)
                            denom = tl.load(rowf + ROW_DENOM, volatile=True).to(CT)
                            cut = tl.load(rowf + ROW_CUT, volatile=True).to(CT)
                            norm = tl.load(rowf + ROW_NORM, volatile=True).to(CT)
                            mass = tl.load(rowf + ROW_MASS, volatile=True)
                            chunk_sums = tl.load(part_mass_ptr + parts + splits, mask=in_splits, other=0.0,
                                                 volatile=True)
                            offs_n = tl.arange(0, BLOCK_N)
                            q_row = draft_probs_ptr + (b * N + node) * Vd
                            if kind == KIND_DRAFT:
                                S = _sum1(chunk_sums)
                                bad_entries = _max1(tl.load(part_flags_ptr + parts + splits, mask=in_splits, other=0,
                                                            volatile=True))
                                draft_bad = ((bad_entries != 0) | (tl.abs(S - 1.0) > DRAFT_SUM_TOLERANCE)).to(
                                    tl.int32)
                                if HAS_D2T:
                                    draft_bad = draft_bad | (tl.load(d2t_ok_ptr) == 0).to(tl.int32)
                                S = tl.where(draft_bad != 0, 1.0, S)
                                draft_bad = draft_bad | _draft_siblings_bad(
                                    node, parents_row, tokens_row, tl.load(tokens_row + offs_n, mask=offs_n < N,
                                                                           other=-1),
                                    draft_sampled_ptr + b * N, q_row, inv_d2t_ptr, S, V, offs_n, N, HAS_MASK,
                                    HAS_D2T).to(tl.int32)
                                tl.store(rowf + ROW_S, S)
                                tl.store(ctl + CTL_DRAFT_BAD, draft_bad)
                                if draft_bad != 0:  # no child is tried: the bonus from p_u
                                    tl.store(ctl + CTL_EVENTS, 0)
                                    tl.store(ctl + CTL_BONUS, 1)
                                    next_kind = KIND_RESIDUAL
                                else:
                                    try_children = 1
                            else:
                                S = tl.load(rowf + ROW_S, volatile=True)
                                draft_bad = tl.load(ctl + CTL_DRAFT_BAD, volatile=True)
                                n_events = tl.load(ctl + CTL_EVENTS, volatile=True)
                                if tl.load(ctl + CTL_BONUS, volatile=True) != 0:
                                    draw_bonus = 1
                                else:
                                    # The new mass after the sampled child `after` was rejected (event
                                    # n_events - 1); an empty residual only through rounding: zero w(x)
                                    # instead, or keep w.
                                    after = tl.load(ctl + CTL_CHILD, volatile=True)
                                    wx = tl.load(rowf + ROW_WX, volatile=True)
                                    removed = tl.load(rowf + ROW_REMOVED, volatile=True)
                                    new_mass = _sum1(chunk_sums)
                                    reusable = 1
                                    x = tl.load(tokens_row + after)
                                    if new_mass == 0.0:
                                        new_mass = mass - wx
                                        _record_event(events_ptr + b * EVENT_WORDS * BLOCK_N, n_events - 1,
                                                      tl.where(new_mass > 0, EV_ZERO, EV_KEEP).to(tl.int32), x, mass,
                                                      removed)
                                        new_mass = tl.where(new_mass > 0, new_mass, mass)
                                        reusable = 0
                                    xs = x + offs_n * 0
                                    removed += _sum1(_draft_r(xs, (offs_n == 0) & (xs >= 0) & (xs < V), q_row,
                                                              inv_d2t_ptr, S, HAS_D2T))
                                    mass = new_mass
                                    try_children = 1
                    else:
                        kth = tl.load(rowf + ROW_KTH, volatile=True).to(CT)
                        denom = tl.load(rowf + ROW_DENOM, volatile=True).to(CT)
                        cut = tl.load(rowf + ROW_CUT, volatile=True).to(CT)
                        norm = tl.load(rowf + ROW_NORM, volatile=True).to(CT)
                        mass = _sum1(tl.load(part_mass_ptr + parts + splits, mask=in_splits, other=0.0,
                                             volatile=True))
                        listed = -2  # the mass phase ran: the tile sums are in place
                        ready = 1
                    if search != 0:
                        # Whole-row thresholds, each digit and normaliser one phase over the chunks:
                        # top-k (then its softmax normaliser), top-p (then its normaliser), mass.
                        tl.store(rowf + ROW_KTH, float("-inf"))
                        tl.store(rowf + ROW_DENOM, total.to(CT).to(tl.float64))
                        tl.store(rowf + ROW_CUT, float("-inf"))
                        tl.store(rowf + ROW_NORM, 1.0)
                        _store_prefix(prefix_ptr + b, seed_prefix, IS_FP64)
                        tl.store(ctl + CTL_DIGIT, seed_digit)
                        next_kind = tl.where(use_k, KIND_SEARCH_K, tl.where(use_p, KIND_SEARCH_P, mass_kind))
                    if ready != 0:
                        if RECORD:
                            st = stats_ptr + (b * N + node) * NUM_STATS
                            tl.store(st + STAT_MAX, row_max.to(tl.float64))
                            tl.store(st + STAT_KTH, kth.to(tl.float64))
                            tl.store(st + STAT_DENOM, denom.to(tl.float64))
                            tl.store(st + STAT_CUT, cut.to(tl.float64))
                            tl.store(st + STAT_NORM, norm.to(tl.float64))
                            tl.store(st + STAT_MASS, mass)
                            tl.store(cand_count_ptr + b * N + node, tl.maximum(listed, -1))
                        if coupled:
                            # Only the list path gets here (rows without a list take the race pass).
                            if NUM_CAND > 0:
                                winner = _race_from_list(index_b, scaled_b, listed, kth, denom, cut, norm,
                                                         tl.load(seed_ptr + b), position0 + depth, V, CT, NUM_CAND)
                                child = _first_child_with(winner, node, may_descend, parents_row, tokens_row, N,
                                                          BLOCK_N)
                                if child < 0:
                                    bonus = winner
                                    finish = 1
                        else:
                            offs_n = tl.arange(0, BLOCK_N)
                            tokens = tl.load(tokens_row + offs_n, mask=offs_n < N, other=-1)
                            seed = tl.load(seed_ptr + b)
                            offset = tl.load(offset_ptr + b)
                            accept_coins = _uniform(seed, offset, offs_n, ACCEPT_DRAW)
                            drafted = 0
                            if HAS_DRAFT:
                                drafted = _sampled_child_count(node, may_descend, parents_row,
                                                               draft_sampled_ptr + b * N, N, BLOCK_N, HAS_MASK)
                            if drafted > 0:
                                # The draft-aware rule runs in phases over the chunks, from the
                                # row's scalars kept here: the draft row's check first.
                                tl.store(rowf + ROW_KTH, kth.to(tl.float64))
                                tl.store(rowf + ROW_DENOM, denom.to(tl.float64))
                                tl.store(rowf + ROW_CUT, cut.to(tl.float64))
                                tl.store(rowf + ROW_NORM, norm.to(tl.float64))
                                tl.store(rowf + ROW_MASS, mass)
                                next_kind = KIND_DRAFT
                            else:
                                child, bonus, finish = _accept_and_bonus(
                                    row, V, row_max, t, kth, denom, cut, norm, mass, node, may_descend, parents_row,
                                    tokens_row, tokens, accept_coins, offs_n, N, seed, offset, listed, index_b,
                                    scaled_b, sums_b, CT, BLOCK_N, BLOCK_V, BLOCK_T, NUM_CAND)
                    if HAS_DRAFT:
                        offs_n = tl.arange(0, BLOCK_N)
                        q_row = draft_probs_ptr + (b * N + node) * Vd
                        events_b = events_ptr + b * EVENT_WORDS * BLOCK_N
                        if try_children != 0:
                            recorded = n_events
                            child, pending, mass, n_events, pending_w = _try_children(
                                row, V, row_max, t, kth, denom, cut, norm, mass, removed, n_events, after, node,
                                parents_row, tokens_row, draft_sampled_ptr + b * N, q_row, inv_d2t_ptr, S, events_b,
                                _uniform(tl.load(seed_ptr + b), tl.load(offset_ptr + b), offs_n, ACCEPT_DRAW),
                                offs_n, N, CT, HAS_MASK, HAS_D2T)
                            if pending >= 0:
                                tl.store(ctl + CTL_CHILD, pending)
                                tl.store(ctl + CTL_EVENTS, n_events + 1)
                                tl.store(ctl + CTL_BONUS, 0)
                                tl.store(rowf + ROW_MASS, mass)
                                tl.store(rowf + ROW_WX, pending_w)
                                tl.store(rowf + ROW_REMOVED, removed)
                                next_kind = KIND_RESIDUAL
                            elif child < 0:
                                if (reusable != 0) & (n_events == recorded):
                                    draw_bonus = 1
                                else:
                                    tl.store(ctl + CTL_EVENTS, n_events)
                                    tl.store(ctl + CTL_BONUS, 1)
                                    next_kind = KIND_RESIDUAL
                        if draw_bonus != 0:
                            u = _sum1(tl.where(offs_n == node, _uniform(tl.load(seed_ptr + b), tl.load(offset_ptr + b),
                                                                        offs_n, BONUS_DRAW), 0.0))
                            bonus = _residual_bonus(row, V, row_max, t, kth, denom, cut, norm, q_row, inv_d2t_ptr, S,
                                                    events_b, n_events, u, part_mass_ptr + parts, splits, in_splits,
                                                    chunk, CT, BLOCK_R, HAS_D2T).to(tl.int32)
                            finish = 1
                    # Walk on: record an accepted child or the bonus, then open the next phase.
                    if child >= 0:
                        depth += 1
                        tl.store(accept_nodes_ptr + b * A + depth, child)
                        tl.store(out_tokens_ptr + b * A + depth - 1, tl.load(tokens_row + child))
                        next_kind = KIND_MAX
                        next_node = child
                    if bad != 0:
                        # Accept nothing; the bonus is the argmax over the finite root logits (0 if none).
                        fallback = _finite_argmax(logits_b, V, CT, BLOCK_MAX)
                        tl.store(accept_nodes_ptr + b * A + offs_a, tl.where(offs_a == 0, 0, -1), mask=offs_a < A)
                        tl.store(out_tokens_ptr + b * A + offs_a, tl.where(offs_a == 0, fallback.to(tl.int64), -1),
                                 mask=offs_a < A)
                        depth = 0
                    elif finish != 0:
                        tl.store(out_tokens_ptr + b * A + depth, bonus.to(tl.int64))
                    if finish != 0:
                        tl.store(accept_len_ptr + b, depth)
                        tl.store(status_ptr + b, tl.where(bad != 0, 1, 2 * draft_bad))
                    else:
                        tl.store(ctl + CTL_KIND, next_kind)
                        tl.store(ctl + CTL_NODE, next_node)
                        tl.store(ctl + CTL_DEPTH, depth)
                    tl.debug_barrier()
                    tl.atomic_xchg(ctl + CTL_PHASE, tl.where(finish != 0, FINISHED, phase + 1))
    # Every program of the request passes here once, after its last read of the control words:
    # the last one resets them for the next launch on the same workspace.
    tl.debug_barrier()
    if tl.atomic_add(ctl + CTL_EXITED, 1) == SPLITS - 1:
        words = tl.arange(0, BLOCK_CTL)
        tl.store(ctl + words, tl.zeros([BLOCK_CTL], tl.int32), mask=words < CTL_WORDS + 2 * PHASES)
