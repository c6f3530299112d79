"""Triton ``block_verify``: a chain of drafts verified as one block (docs/ops.md §21).

Block verification (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro and Suresh 2024, "Block
verification accelerates speculative decoding"): with ``P_i`` the target's filtered
distribution after node ``i``, ``r_i`` the draft row draft ``i + 1`` was drawn from and ``x_i``
draft ``i``, in float64

    p_0 = 1,   p_i = min(1, p_(i-1) P_(i-1)(x_i) / r_(i-1)(x_i)),
    R_i = sum_x max(p_i P_i(x) - r_i(x), 0),   h_i = R_i / (R_i + 1 - p_i)  (i < G),   h_G = p_G,

the block keeps the largest ``i`` with ``U_i < h_i`` and draws the bonus token from
``max(p_t P_t - r_t, 0)`` (``w_G`` when all ``G`` drafts are kept). Semantics, random stream and
arithmetic are those of ``eagle_kernels/reference/block_verify.py``; the row filters (temperature,
top-k, softmax, top-p with ties kept) are ``verify``'s, computed with the helpers of
``verify_rows.py``.

Five launches, every row of a chain cut into ``SPLITS`` chunks of whole tiles (``chunking``: about
two programs per SM over the ``B * N`` rows on a GPU), no value read on the host (``G`` a request's
drafts, ``N`` its nodes; chunk partials in a float64 scratch ``[B, N, SPLITS, PARTS]``, row
scalars in ``[B, N, SLOTS]``):

1. grid ``(B, N, SPLITS)``, program ``(b, i, j)`` for row ``i <= G`` (idle past it): chunk ``j``'s
   max, first argmax and NaN / +inf / finite flags; for a sampling request with draft rows and
   ``i < G`` also chunk ``j`` of draft row ``i``: its float64 sum and whether an entry is NaN,
   +inf or negative.
2. the same grid, for a sampling request's good row (the row's max and flags merged from launch
   1's partials by each program): with top-k or top-p, program ``j = 0`` finds the thresholds
   and normalisers by the radix search of ``verify_rows.py`` over the order keys of the logits
   (``2^RADIX_BITS`` candidates per pass: 4 passes for bf16 rows, 5 for fp16, 8 for fp32, 16 for
   fp64 on the GPU; the last pass of each search also sums that threshold's normaliser, and the
   softmax sum comes first when there is no top-k): one program walks the row; otherwise each
   chunk's softmax sum.
3. the same grid: each chunk's float64 mass of the weights, lane by lane and tile by tile (the
   bonus draw's order); program ``j = 0`` stores the row's scalars (max, argmax, bad flag for
   every request; the filters, ``w_i(x_(i+1))``, and draft row ``i``'s sum ``S``,
   ``r_i(x_(i+1))`` and validity: entries finite and >= 0, ``|S - 1| <= 1e-3``, ``d2t`` in
   range, ``r_i(x_(i+1)) > 0``).
4. the same grid, for ``i < G'`` of a sampling request without a bad row, ``G'`` the block cut
   before the first invalid draft row (the bad-row check over rows ``0 .. G`` comes first, as the
   reference orders it): ``p_i`` from the rows before it (their masses merged from launch 3's
   partials) and chunk ``j``'s sums of the residual weights for ``R_i`` and the bonus draw.
5. grid ``(B,)``: greedy requests' walk from the rows' argmaxes and flags; sampling requests'
   status, ``h_i`` from the merged ``R_i`` and the accepted length from the coins, and the bonus
   draw, an inverse CDF in token order over row ``t``: the chunk where the running sum of the
   chunks' totals passes the target, then a scan of that chunk's tiles (``tl.cumsum`` within a
   tile). Then the outputs.

Logits are read in their own dtype and computed in float32 (float64 for fp64 logits), as in
``verify``; a row's scalars round-trip through the float64 scratch exactly.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
import triton
import triton.language as tl

from .. import _checks
from .._types import VerifyOutput
from ..reference import random as _random
from ._launch_config import gpu_sms, interpreted
from ._pdl import launch_options, wait_for_prior_grids
from .philox import _uniform
from .verify import _draft_inputs
from .verify_rows import (
    DRAFT_SUM_TOLERANCE,
    SEARCH_BLOCK,
    SIGNIFICANT_KEY_BITS,
    _draft_range,
    _draw_chunk,
    _finite_argmax,
    _max1,
    _merge_max,
    _min1,
    _probs,
    _range_max,
    _range_total,
    _scaled,
    _search_chunk,
    _search_chunk_last,
    _search_digit,
    _search_value,
    _sum1,
    _weights,
)

ACCEPT_DRAW = tl.constexpr(_random.ACCEPT_DRAW)
BONUS_DRAW = tl.constexpr(_random.BONUS_DRAW)


@dataclasses.dataclass(frozen=True)
class BlockVerifyConfig:
    """Tuning constants of the launch; the outputs do not depend on them.

    block_v: tile of the row passes (capped at next_pow2(V)); a row's chunks are whole tiles
        (``chunking``).
    radix_bits: bits per digit of the threshold searches (2^radix_bits candidates per pass over
        [min(block_v, SEARCH_BLOCK), 2^radix_bits] tiles).
    num_warps: warps of each program (every launch).
    """

    block_v: int
    radix_bits: int
    num_warps: int


# On the GPU: 2048-entry tiles at 8 warps (8 loads in flight per thread), 16 candidates per search
# pass (verify's: the [256, 16] float64 accumulator of a top-p digit stays in registers).
GPU_CONFIG = BlockVerifyConfig(block_v=2048, radix_bits=4, num_warps=8)
# The interpreter's cost is per operation: 256 candidates per pass halve the passes, and small
# tiles let the tests' small V reach the multi-tile paths.
INTERPRETER_CONFIG = BlockVerifyConfig(block_v=64, radix_bits=8, num_warps=4)


def launch_config() -> BlockVerifyConfig:
    """The GPU's configuration, or the interpreter's when the kernel runs interpreted."""
    return INTERPRETER_CONFIG if interpreted(_block_verify_max_kernel) else GPU_CONFIG


# Chunks per row at most.
MAX_SPLITS = 64


def chunking(B: int, N: int, V: int, block_v: int, sms: int | None) -> tuple[int, int]:
    """(chunks per row, entries per chunk): on a GPU of ``sms`` SMs about two programs per SM over
    the B * N rows, in whole tiles of ``block_v`` entries; without one (the interpreter), up to 4
    chunks so that the merges run."""
    tiles = triton.cdiv(V, block_v)
    want = 4 if sms is None else triton.cdiv(2 * sms, B * N)
    splits = max(1, min(tiles, want, MAX_SPLITS))
    chunk = triton.cdiv(tiles, splits) * block_v
    return triton.cdiv(V, chunk), chunk


@triton.jit
def _lane(vec, i, offs_n):
    """Entry ``i`` of a per-row vector (float64: an -inf entry comes back as -inf)."""
    return _sum1(tl.where(offs_n == i, vec, 0.0))


@triton.jit
def _draft_r(ids, valid, q_row, inv_ptr, S, draft_token, HAS_DRAFT: tl.constexpr, HAS_D2T: tl.constexpr):
    """r(y) in float64 at target ids ``ids``: the draft row q / S (with d2t through the inverse map,
    0 where no draft id maps to y), or without draft rows the point mass at ``draft_token``."""
    if HAS_DRAFT:
        if HAS_D2T:
            draft = tl.load(inv_ptr + ids, mask=valid, other=-1)
            q = tl.load(q_row + draft, mask=valid & (draft >= 0), other=0.0)
        else:
            q = tl.load(q_row + ids, mask=valid, other=0.0)
        r = q.to(tl.float64) / S
    else:
        r = tl.where(valid & (ids == draft_token), 1.0, 0.0).to(tl.float64)
    return r


@triton.jit
def _weight_at(row, x, row_max, t, kth, denom, cut, norm, CT: tl.constexpr):
    """w(x) of one token, in the compute dtype."""
    s = _scaled(tl.load(row + x).to(CT), row_max, t)
    return _weights(_probs(s, kth, denom, CT), cut, norm, CT)


@triton.jit
def _tile(row, start, V, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S, draft_token, residual,
          CT: tl.constexpr, BLOCK_V: tl.constexpr, HAS_DRAFT: tl.constexpr, HAS_D2T: tl.constexpr):
    """Ids, validity, float64 weights w and (where ``residual``) residual weights
    max(p * (w / mass) - r, 0) of one tile of a row (0 past V)."""
    offs = start + tl.arange(0, BLOCK_V)
    valid = offs < V
    s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
    w = tl.where(valid, _weights(_probs(s, kth, denom, CT), cut, norm, CT), 0.0).to(tl.float64)
    res = w
    if residual != 0:
        r = _draft_r(offs, valid, q_row, inv_ptr, S, draft_token, HAS_DRAFT, HAS_D2T)
        res = tl.maximum(p * (w / mass) - r, 0.0)
    return offs, valid, w, res


@triton.jit
def _threshold(row, V, row_max, t, kth, denom, target, IS_TOP_P: tl.constexpr, CT: tl.constexpr,
               IS_FP64: tl.constexpr, SIG_BITS: tl.constexpr, BLOCK_S: tl.constexpr, RADIX_BITS: tl.constexpr):
    """(logit value, normaliser) of a row's top-k (``target`` = k) or top-p (``target`` = top_p)
    threshold: the radix search of verify_rows.py over the order keys of the logits, one pass per
    digit, whose last pass also sums the normaliser of each candidate (top-k: the float64 sum of
    exp(s) over s >= kth; top-p: of p over p >= cut). The k-th largest s is s of the k-th largest
    logit (s is monotone in the logit), and likewise for the cut in p, so the thresholds are
    ``s(value)`` and ``p(s(value))``."""
    if IS_FP64:
        KT: tl.constexpr = tl.uint64
        KEY_BITS: tl.constexpr = 64
    else:
        KT: tl.constexpr = tl.uint32
        KEY_BITS: tl.constexpr = 32
    RADIX: tl.constexpr = 1 << RADIX_BITS
    DIGITS: tl.constexpr = (SIG_BITS + RADIX_BITS - 1) // RADIX_BITS
    prefix = tl.zeros([], KT)
    for d in range(0, DIGITS - 1):
        shift = KEY_BITS - RADIX_BITS * (d + 1)
        totals = _search_chunk(row, 0, V, prefix, shift, row_max, t, kth, denom, IS_TOP_P, CT, IS_FP64, BLOCK_S,
                               RADIX_BITS)
        prefix = _search_digit(prefix, shift, totals, target, IS_FP64, RADIX_BITS)
    shift = tl.full([], KEY_BITS - RADIX_BITS * DIGITS, tl.int32)
    totals, kept = _search_chunk_last(row, 0, V, prefix, shift, row_max, t, kth, denom, IS_TOP_P, CT, IS_FP64,
                                      SIG_BITS, BLOCK_S, RADIX_BITS)
    prefix = _search_digit(prefix, shift, totals, target, IS_FP64, RADIX_BITS)
    lane = ((prefix >> shift.to(KT)) & (RADIX - 1)).to(tl.int32)
    normaliser = tl.sum(tl.where(tl.arange(0, RADIX) == lane, kept, 0.0), axis=0)
    return _search_value(prefix, CT, IS_FP64, SIG_BITS, RADIX_BITS).to(CT), normaliser


@triton.jit
def _row_thresholds(row, V, row_max, t, top_k, top_p, use_k, CT: tl.constexpr, IS_FP64: tl.constexpr,
                    SIG_BITS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
                    RADIX_BITS: tl.constexpr):
    """(kth, denom, cut, norm) of a sampling row with top-k or top-p: its weights are
    ``w = [p >= cut] p / norm``, ``p = [s >= kth] exp(s) / denom`` (verify_rows.py's _probs and
    _weights). One program walks the whole row: the searches' digits, and the softmax sum when
    there is no top-k."""
    kth = tl.full([], float("-inf"), CT)
    cut = tl.full([], float("-inf"), CT)
    norm = tl.full([], 1.0, CT)
    if use_k:
        value, kept = _threshold(row, V, row_max, t, kth, norm, top_k.to(tl.float64), False, CT, IS_FP64, SIG_BITS,
                                 BLOCK_S, RADIX_BITS)
        kth = _scaled(value, row_max, t)
        denom = kept.to(CT)
    else:
        denom = _range_total(row, 0, V, row_max, t, CT, BLOCK_V).to(CT)
    if top_p < 1.0:
        value, kept = _threshold(row, V, row_max, t, kth, denom, top_p.to(tl.float64), True, CT, IS_FP64, SIG_BITS,
                                 BLOCK_S, RADIX_BITS)
        cut = _probs(_scaled(value, row_max, t), kth, denom, CT)
        norm = kept.to(CT)
    return kth, denom, cut, norm


@triton.jit
def _chunk_sums(row, start, end, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S, draft_token,
                residual, CT: tl.constexpr, BLOCK_V: tl.constexpr, HAS_DRAFT: tl.constexpr, HAS_D2T: tl.constexpr):
    """Two float64 sums over the row's entries in [start, end) of the weights w, or (``residual``)
    of the residual weights max(p * (w / mass) - r, 0): lane by lane (a mass, an R) and tile by
    tile (the order the bonus draw's scan adds them in)."""
    lane = tl.zeros([BLOCK_V], dtype=tl.float64)
    total = tl.zeros([], tl.float64)
    for tile in range(start, end, BLOCK_V):
        offs, valid, w, res = _tile(row, tile, end, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S,
                                    draft_token, residual, CT, BLOCK_V, HAS_DRAFT, HAS_D2T)
        lane += res
        total += _sum1(res)
    return _sum1(lane), total


@triton.jit
def _draw(row, V, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S, draft_token, residual, coin,
          totals_w, totals_res, splits, in_splits, chunk, CT: tl.constexpr, BLOCK_V: tl.constexpr,
          HAS_DRAFT: tl.constexpr, HAS_D2T: tl.constexpr):
    """Inverse CDF (the reference's sample_inverse_cdf): the smallest x with cumsum64(v)[x] >
    coin * sum(v), else the largest x with v > 0, over v = the residual weights when ``residual``
    (the weights w instead should rounding leave the residual all zero), else v = w. The chunks'
    totals (tile by tile: ``totals_w`` of w, ``totals_res`` of the residual weights; [BLOCK_SPLITS])
    give the chunk where the running sum passes the target; the scan starts there and normally
    ends in it."""
    totals = tl.where(residual != 0, totals_res, totals_w)
    residual = tl.where(_sum1(totals) == 0.0, 0, residual)  # rounding only: draw from w
    totals = tl.where(residual != 0, totals_res, totals_w)
    target = coin * _sum1(totals)
    start, carry = _draw_chunk(totals, target, splits, in_splits, chunk, V)
    found = tl.zeros([], tl.int64) + V
    while start < V:
        offs, valid, w, res = _tile(row, start, V, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S,
                                    draft_token, residual, CT, BLOCK_V, HAS_DRAFT, HAS_D2T)
        found = _min1(tl.where((tl.cumsum(res, axis=0) + carry > target) & valid, offs, V))
        carry += _sum1(res)
        start = tl.where(found < V, V, start + BLOCK_V)
    if found == V:  # only through rounding: the largest token with a positive weight
        last_positive = tl.full([], -1, tl.int64)
        for tile in range(0, V, BLOCK_V):
            offs, valid, w, res = _tile(row, tile, V, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S,
                                        draft_token, residual, CT, BLOCK_V, HAS_DRAFT, HAS_D2T)
            last_positive = tl.maximum(last_positive, _max1(tl.where(res > 0, offs, -1)))
        found = tl.maximum(last_positive, 0)
    return found


# Slots of the per-row scratch [B, N, SLOTS] float64 (integers and flags as exact float64 values).
# Launch 3's first chunk program of row i <= G writes MAX, BAD, ARG, and for a sampling request's
# good row KTH, DENOM, CUT, NORM (launch 2 wrote them first for rows with top-k or top-p) and for
# i < G W_NEXT (w_i(x_(i+1)), in the compute dtype), SUM (the draft row's float64 sum, 1 for point
# masses), R_NEXT (r_i(x_(i+1))) and DRAFT_OK.
MAX = tl.constexpr(0)
BAD = tl.constexpr(1)
ARG = tl.constexpr(2)
KTH = tl.constexpr(3)
DENOM = tl.constexpr(4)
CUT = tl.constexpr(5)
NORM = tl.constexpr(6)
W_NEXT = tl.constexpr(7)
SUM = tl.constexpr(8)
R_NEXT = tl.constexpr(9)
DRAFT_OK = tl.constexpr(10)
SLOTS = tl.constexpr(11)
# Slots of the per-chunk partials [B, N, SPLITS, PARTS] float64, chunk j of row i: launch 1's
# max, first argmax and flags (bit 0 NaN / +inf, bit 1 finite) and, over chunk j of draft row i,
# the float64 sum and whether an entry is NaN, +inf or negative; launch 2's softmax sum (rows
# without top-k or top-p); launch 3's mass (lane by lane) and its tile-by-tile sum; launch 4's R
# and its tile-by-tile sum.
PART_MAX = tl.constexpr(0)
PART_ARG = tl.constexpr(1)
PART_FLAGS = tl.constexpr(2)
PART_DSUM = tl.constexpr(3)
PART_DBAD = tl.constexpr(4)
PART_TOTAL = tl.constexpr(5)
PART_MASS = tl.constexpr(6)
PART_TOTAL_W = tl.constexpr(7)
PART_RES = tl.constexpr(8)
PART_TOTAL_RES = tl.constexpr(9)
PARTS = tl.constexpr(10)


@triton.jit
def _num_drafts(num_drafts_ptr, b, N, HAS_NUM_DRAFTS: tl.constexpr):
    """G of request b: num_drafts[b] clamped to [0, N - 1], N - 1 without num_drafts."""
    G = tl.zeros([], tl.int32) + (N - 1)
    if HAS_NUM_DRAFTS:
        G = tl.minimum(tl.maximum(tl.load(num_drafts_ptr + b), 0), N - 1)
    return G


@triton.jit
def _chunk_program(num_drafts_ptr, N, HAS_NUM_DRAFTS: tl.constexpr):
    """(b, i, j, G) of a program of the chunk launches: request b, row i, chunk j, and G."""
    b = tl.program_id(0).to(tl.int64)
    return b, tl.program_id(1), tl.program_id(2), _num_drafts(num_drafts_ptr, b, N, HAS_NUM_DRAFTS)


@triton.jit
def _row_max(parts_row, splits, in_splits, V):
    """(max, first argmax, bad) of a row from launch 1's chunk partials (``parts_row``: chunk 0's
    partials of the row; ``splits``: chunk ids)."""
    at = parts_row + splits * PARTS
    chunk_max = tl.load(at + PART_MAX, mask=in_splits, other=float("-inf"))
    chunk_arg = tl.load(at + PART_ARG, mask=in_splits, other=V).to(tl.int32)
    chunk_flags = tl.load(at + PART_FLAGS, mask=in_splits, other=0.0).to(tl.int32)
    return _merge_max(chunk_max, chunk_arg, chunk_flags, V)


@triton.jit
def _chunk_slot(parts_b, SPLITS, offs_n, splits, in_rows, in_splits, slot):
    """[BLOCK_N, BLOCK_SPLITS] partials ``slot`` of every chunk of rows ``offs_n`` (``parts_b``: request b's)."""
    at = parts_b + (offs_n[:, None] * SPLITS + splits[None, :]) * PARTS + slot
    return tl.load(at, mask=in_rows[:, None] & in_splits[None, :], other=0.0)


@triton.jit
def _block_of(rows, offs_n, G):
    """(bad, G') of a sampling request from launch 3's flags (``rows``: the scratch of its rows
    0 .. BLOCK_N - 1): whether a row 0 .. G is bad, and the block cut before the first draft
    whose row is invalid (G' = the first invalid draft row i < G, else G)."""
    bads = tl.load(rows + BAD, mask=offs_n <= G, other=0.0)
    oks = tl.load(rows + DRAFT_OK, mask=offs_n < G, other=1.0)
    return _max1((bads != 0.0).to(tl.int32)), _min1(tl.where((offs_n < G) & (oks == 0.0), offs_n, G))


@triton.jit
def _capped_products(a, r, offs_n, Gc, BLOCK_N: tl.constexpr):
    """[BLOCK_N] p_i = min(1, p_(i-1) a_(i-1) / r_(i-1)), p_0 = 1, for i <= Gc (1 past), with
    a_i = P_i(x_(i+1)) and r_i = r_i(x_(i+1)) over the rows."""
    ps = tl.full([BLOCK_N], 1.0, tl.float64)
    p = tl.full([], 1.0, tl.float64)
    for i in range(1, Gc + 1):
        p = tl.minimum(p * _lane(a, i - 1, offs_n) / _lane(r, i - 1, offs_n), 1.0)
        ps = tl.where(offs_n == i, p, ps)
    return ps


@triton.jit
def _chain_ratios(rows, parts_b, SPLITS, offs_n, splits, in_splits, Gc):
    """(masses, a, r) over the rows of a sampling request's block (rows < Gc; 1 elsewhere): each
    row's mass from launch 3's chunk sums, a_i = w_i(x_(i+1)) / mass_i and r_i(x_(i+1))."""
    in_block = offs_n < Gc
    masses = tl.sum(_chunk_slot(parts_b, SPLITS, offs_n, splits, offs_n <= Gc, in_splits, PART_MASS), axis=1)
    w_next = tl.load(rows + W_NEXT, mask=in_block, other=0.0)
    r = tl.load(rows + R_NEXT, mask=in_block, other=1.0)
    a = tl.where(in_block, w_next / tl.where(in_block, masses, 1.0), 0.0)
    return masses, a, r


@triton.jit
def _block_verify_max_kernel(
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V (strides stride_lb, stride_ln)
    draft_probs_ptr,  # [B, N, Vd] float32, dense (read only when HAS_DRAFT)
    num_drafts_ptr,  # [B] int32 in [0, N - 1] (read only when HAS_NUM_DRAFTS)
    temperature_ptr,  # [B] float32 (0 = greedy request)
    parts_ptr,  # [B, N, SPLITS, PARTS] float64: written PART_MAX, PART_ARG, PART_FLAGS, PART_DSUM, PART_DBAD
    N, V, Vd, chunk, chunk_d, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    SPLITS: tl.constexpr,  # chunks a row
    BLOCK_V: tl.constexpr,  # tile of the row passes
    HAS_NUM_DRAFTS: tl.constexpr,
    HAS_DRAFT: tl.constexpr,  # draft_probs given; else every draft is a point mass
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """Program (b, i, j): chunk j of row i of request b (idle past its G): max, first argmax and
    flags; for a sampling request with draft rows and i < G, chunk j of draft row i (chunk_d
    entries a chunk): its float64 sum and bad-entry flag."""
    wait_for_prior_grids(USE_PDL)
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    b, i, j, G = _chunk_program(num_drafts_ptr, N, HAS_NUM_DRAFTS)
    if i <= G:
        part = parts_ptr + ((b * N + i) * SPLITS + j) * PARTS
        start = j * chunk
        chunk_max, chunk_arg, chunk_flags = _range_max(logits_ptr + b * stride_lb + i * stride_ln, start,
                                                       tl.minimum(start + chunk, V), CT, BLOCK_V)
        tl.store(part + PART_MAX, chunk_max.to(tl.float64))
        tl.store(part + PART_ARG, chunk_arg.to(tl.float64))
        tl.store(part + PART_FLAGS, chunk_flags.to(tl.float64))
        if HAS_DRAFT:
            if (i < G) & (tl.load(temperature_ptr + b) != 0.0):
                d_start = j * chunk_d
                d_sum, d_bad = _draft_range(draft_probs_ptr + (b * N + i) * Vd, d_start,
                                            tl.minimum(d_start + chunk_d, Vd), BLOCK_V)
                tl.store(part + PART_DSUM, d_sum)
                tl.store(part + PART_DBAD, d_bad.to(tl.float64))


@triton.jit
def _block_verify_filters_kernel(
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V (strides stride_lb, stride_ln)
    num_drafts_ptr,  # [B] int32 in [0, N - 1] (read only when HAS_NUM_DRAFTS)
    temperature_ptr,  # [B] float32 (0 = greedy request)
    top_k_ptr,  # [B] int32 (0 = off)
    top_p_ptr,  # [B] float32 (1 = off)
    scratch_ptr,  # [B, N, SLOTS] float64: KTH, DENOM, CUT, NORM written for rows with top-k or top-p
    parts_ptr,  # [B, N, SPLITS, PARTS] float64: launch 1's; PART_TOTAL written for the other rows
    N, V, chunk, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    SIG_BITS: tl.constexpr,  # leading order-key bits that vary (16 bf16, 19 fp16, 32 fp32, 64 fp64)
    SPLITS: tl.constexpr,  # chunks a row
    BLOCK_SPLITS: tl.constexpr,  # next power of two of SPLITS (at least 2)
    BLOCK_V: tl.constexpr,  # tile of the row passes
    BLOCK_S: tl.constexpr,  # rows of the search tiles, min(BLOCK_V, SEARCH_BLOCK)
    RADIX_BITS: tl.constexpr,
    HAS_NUM_DRAFTS: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """Program (b, i, j), for a sampling request's good row i <= G: with top-k or top-p, program
    j = 0 finds the row's thresholds and normalisers (the radix searches walk the whole row);
    otherwise chunk j's softmax sum."""
    wait_for_prior_grids(USE_PDL)
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    b, i, j, G = _chunk_program(num_drafts_ptr, N, HAS_NUM_DRAFTS)
    temperature = tl.load(temperature_ptr + b)
    if (temperature != 0.0) & (i <= G):
        splits = tl.arange(0, BLOCK_SPLITS)
        in_splits = splits < SPLITS
        parts_row = parts_ptr + (b * N + i) * SPLITS * PARTS
        row_max, arg, bad = _row_max(parts_row, splits, in_splits, V)
        if bad == 0:
            row = logits_ptr + b * stride_lb + i * stride_ln
            m = row_max.to(CT)
            t = temperature.to(CT)
            top_k = tl.load(top_k_ptr + b)
            top_p = tl.load(top_p_ptr + b)
            use_k = (top_k > 0) & (top_k < V)
            if use_k | (top_p < 1.0):
                if j == 0:
                    kth, denom, cut, norm = _row_thresholds(row, V, m, t, top_k, top_p, use_k, CT, IS_FP64,
                                                            SIG_BITS, BLOCK_V, BLOCK_S, RADIX_BITS)
                    out = scratch_ptr + (b * N + i) * SLOTS
                    tl.store(out + KTH, kth.to(tl.float64))
                    tl.store(out + DENOM, denom.to(tl.float64))
                    tl.store(out + CUT, cut.to(tl.float64))
                    tl.store(out + NORM, norm.to(tl.float64))
            else:
                start = j * chunk
                tl.store(parts_row + j * PARTS + PART_TOTAL,
                         _range_total(row, start, tl.minimum(start + chunk, V), m, t, CT, BLOCK_V))


@triton.jit
def _block_verify_mass_kernel(
    tokens_ptr,  # [B, N] int64: node 0 the root, node i >= 1 draft i
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V (strides stride_lb, stride_ln)
    draft_probs_ptr,  # [B, N, Vd] float32, dense (read only when HAS_DRAFT)
    inv_d2t_ptr,  # [V] int32: the draft id of each target id, -1 for none (read only when HAS_D2T)
    d2t_ok_ptr,  # [1] int32: 1 when every draft id maps into [0, V) (read only when HAS_D2T)
    num_drafts_ptr,  # [B] int32 in [0, N - 1] (read only when HAS_NUM_DRAFTS)
    temperature_ptr,  # [B] float32 (0 = greedy request)
    top_k_ptr,  # [B] int32 (0 = off)
    top_p_ptr,  # [B] float32 (1 = off)
    scratch_ptr,  # [B, N, SLOTS] float64: row scalars (written by each row's chunk 0, as above)
    parts_ptr,  # [B, N, SPLITS, PARTS] float64: launches 1-2's; PART_MASS, PART_TOTAL_W written
    N, V, Vd, chunk, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    SPLITS: tl.constexpr,  # chunks a row
    BLOCK_SPLITS: tl.constexpr,  # next power of two of SPLITS (at least 2)
    BLOCK_V: tl.constexpr,  # tile of the row passes
    HAS_NUM_DRAFTS: tl.constexpr,
    HAS_DRAFT: tl.constexpr,  # draft_probs given; else every draft is a point mass
    HAS_D2T: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """Program (b, i, j), for row i <= G: chunk 0 stores the row's max, first argmax and bad flag
    (every request); for a sampling request's good row each chunk its float64 mass (lane by lane
    and tile by tile), and chunk 0 the row's filter scalars and, for i < G, w_i(x_(i+1)) and draft
    row i's sum S, r_i(x_(i+1)) and validity (entries finite and >= 0, |S - 1| <= 1e-3, d2t in
    range, r_i(x_(i+1)) > 0)."""
    wait_for_prior_grids(USE_PDL)
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    b, i, j, G = _chunk_program(num_drafts_ptr, N, HAS_NUM_DRAFTS)
    if i <= G:
        splits = tl.arange(0, BLOCK_SPLITS)
        in_splits = splits < SPLITS
        parts_row = parts_ptr + (b * N + i) * SPLITS * PARTS
        out = scratch_ptr + (b * N + i) * SLOTS
        row_max, arg, bad = _row_max(parts_row, splits, in_splits, V)
        if j == 0:
            tl.store(out + MAX, row_max)
            tl.store(out + BAD, bad.to(tl.float64))
            tl.store(out + ARG, arg.to(tl.float64))
        temperature = tl.load(temperature_ptr + b)
        if (temperature != 0.0) & (bad == 0):
            row = logits_ptr + b * stride_lb + i * stride_ln
            m = row_max.to(CT)
            t = temperature.to(CT)
            top_k = tl.load(top_k_ptr + b)
            filtered = ((top_k > 0) & (top_k < V)) | (tl.load(top_p_ptr + b) < 1.0)
            if filtered:  # launch 2's program 0 stored them
                kth = tl.load(out + KTH).to(CT)
                denom = tl.load(out + DENOM).to(CT)
                cut = tl.load(out + CUT).to(CT)
                norm = tl.load(out + NORM).to(CT)
            else:
                kth = tl.full([], float("-inf"), CT)
                denom = _sum1(tl.load(parts_row + splits * PARTS + PART_TOTAL, mask=in_splits, other=0.0)).to(CT)
                cut = tl.full([], float("-inf"), CT)
                norm = tl.full([], 1.0, CT)
            start = j * chunk
            mass, total_w = _chunk_sums(row, start, tl.minimum(start + chunk, V), m, t, kth, denom, cut, norm,
                                        1.0, 1.0, draft_probs_ptr, inv_d2t_ptr, 1.0, 0, 0, CT, BLOCK_V, HAS_DRAFT,
                                        HAS_D2T)
            tl.store(parts_row + j * PARTS + PART_MASS, mass)
            tl.store(parts_row + j * PARTS + PART_TOTAL_W, total_w)
            if j == 0:
                if filtered == 0:
                    tl.store(out + KTH, kth.to(tl.float64))
                    tl.store(out + DENOM, denom.to(tl.float64))
                    tl.store(out + CUT, cut.to(tl.float64))
                    tl.store(out + NORM, norm.to(tl.float64))
                if i < G:
                    x = tl.load(tokens_ptr + b * N + i + 1)
                    tl.store(out + W_NEXT, _weight_at(row, x, m, t, kth, denom, cut, norm, CT).to(tl.float64))
                    S = tl.full([], 1.0, tl.float64)
                    r = tl.full([], 1.0, tl.float64)
                    ok = tl.full([], 1, tl.int1)
                    if HAS_DRAFT:
                        # Draft i + 1 must be drawable from its row (§21: the block ends before it).
                        q_row = draft_probs_ptr + (b * N + i) * Vd
                        S = _sum1(tl.load(parts_row + splits * PARTS + PART_DSUM, mask=in_splits, other=0.0))
                        d_bad = _max1(tl.load(parts_row + splits * PARTS + PART_DBAD, mask=in_splits, other=0.0))
                        ok = (d_bad == 0.0) & (tl.abs(S - 1.0) <= DRAFT_SUM_TOLERANCE)
                        if HAS_D2T:
                            xd = tl.load(inv_d2t_ptr + x)
                            ok = ok & (tl.load(d2t_ok_ptr) != 0) & (xd >= 0)
                            qx = tl.load(q_row + xd, mask=xd >= 0, other=0.0)
                        else:
                            qx = tl.load(q_row + x)
                        ok = ok & (qx > 0)  # r(x) = q(x) / S > 0
                        r = qx.to(tl.float64) / S
                    tl.store(out + SUM, S)
                    tl.store(out + R_NEXT, r)
                    tl.store(out + DRAFT_OK, ok.to(tl.float64))


@triton.jit
def _block_verify_residual_kernel(
    tokens_ptr,  # [B, N] int64: node 0 the root, node i >= 1 draft i
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V (strides stride_lb, stride_ln)
    draft_probs_ptr,  # [B, N, Vd] float32, dense (read only when HAS_DRAFT)
    inv_d2t_ptr,  # [V] int32: the draft id of each target id, -1 for none (read only when HAS_D2T)
    num_drafts_ptr,  # [B] int32 in [0, N - 1] (read only when HAS_NUM_DRAFTS)
    temperature_ptr,  # [B] float32 (0 = greedy request)
    scratch_ptr,  # [B, N, SLOTS] float64: launch 3's row scalars
    parts_ptr,  # [B, N, SPLITS, PARTS] float64: launch 3's; PART_RES, PART_TOTAL_RES written for rows i < G'
    N, V, Vd, chunk, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    SPLITS: tl.constexpr,  # chunks a row
    BLOCK_SPLITS: tl.constexpr,  # next power of two of SPLITS (at least 2)
    BLOCK_V: tl.constexpr,  # tile of the row passes
    BLOCK_N: tl.constexpr,  # next power of two of N (at least 2): one lane per row
    HAS_NUM_DRAFTS: tl.constexpr,
    HAS_DRAFT: tl.constexpr,  # draft_probs given; else every draft is a point mass
    HAS_D2T: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """Program (b, i, j), for a sampling request without a bad row and i < G': p_i from the rows
    before it and one pass over chunk j of row i and draft row i: R_i's chunk sum of
    max(p_i P_i(x) - r_i(x), 0), lane by lane (for h_i) and tile by tile (for the bonus draw from
    row i)."""
    wait_for_prior_grids(USE_PDL)
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    b, i, j, G = _chunk_program(num_drafts_ptr, N, HAS_NUM_DRAFTS)
    temperature = tl.load(temperature_ptr + b)
    if (temperature != 0.0) & (i < G):
        offs_n = tl.arange(0, BLOCK_N)
        rows = scratch_ptr + (b * N + offs_n) * SLOTS
        bad, Gc = _block_of(rows, offs_n, G)
        if (bad == 0) & (i < Gc):
            splits = tl.arange(0, BLOCK_SPLITS)
            in_splits = splits < SPLITS
            parts_b = parts_ptr + b * N * SPLITS * PARTS
            masses, a, r = _chain_ratios(rows, parts_b, SPLITS, offs_n, splits, in_splits, Gc)
            p = _lane(_capped_products(a, r, offs_n, i, BLOCK_N), i, offs_n)
            out = scratch_ptr + (b * N + i) * SLOTS
            start = j * chunk
            R, total_res = _chunk_sums(logits_ptr + b * stride_lb + i * stride_ln, start,
                                       tl.minimum(start + chunk, V), tl.load(out + MAX).to(CT), temperature.to(CT),
                                       tl.load(out + KTH).to(CT), tl.load(out + DENOM).to(CT),
                                       tl.load(out + CUT).to(CT), tl.load(out + NORM).to(CT), _lane(masses, i, offs_n),
                                       p, draft_probs_ptr + (b * N + i) * Vd, inv_d2t_ptr, tl.load(out + SUM),
                                       tl.load(tokens_ptr + b * N + i + 1), 1, CT, BLOCK_V, HAS_DRAFT, HAS_D2T)
            part = parts_b + (i * SPLITS + j) * PARTS
            tl.store(part + PART_RES, R)
            tl.store(part + PART_TOTAL_RES, total_res)


@triton.jit
def _block_verify_finish_kernel(
    tokens_ptr,  # [B, N] int64: node 0 the root, node i >= 1 draft i
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V (strides stride_lb, stride_ln)
    draft_probs_ptr,  # [B, N, Vd] float32, dense (read only when HAS_DRAFT)
    inv_d2t_ptr,  # [V] int32: the draft id of each target id, -1 for none (read only when HAS_D2T)
    num_drafts_ptr,  # [B] int32 in [0, N - 1] (read only when HAS_NUM_DRAFTS)
    temperature_ptr,  # [B] float32 (0 = greedy request)
    seed_ptr,  # [B] int64
    offset_ptr,  # [B] int64
    scratch_ptr,  # [B, N, SLOTS] float64: launch 3's row scalars
    parts_ptr,  # [B, N, SPLITS, PARTS] float64: launches 3-4's chunk sums
    accept_len_ptr,  # [B] int32
    accept_nodes_ptr,  # [B, N] int32
    out_tokens_ptr,  # [B, N] int64
    status_ptr,  # [B] int32
    N, V, Vd, chunk, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    SPLITS: tl.constexpr,  # chunks a row
    BLOCK_SPLITS: tl.constexpr,  # next power of two of SPLITS (at least 2)
    BLOCK_V: tl.constexpr,  # tile of the row passes
    BLOCK_N: tl.constexpr,  # next power of two of N (at least 2): one lane per row
    HAS_NUM_DRAFTS: tl.constexpr,
    HAS_DRAFT: tl.constexpr,  # draft_probs given; else every draft is a point mass
    HAS_D2T: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """Program b: request b's outcome from the row scalars and chunk sums. Greedy: §4's walk (the
    first row that is bad, is the last or whose argmax is not the next draft ends it). Sampling:
    status 1 for a bad row 0 .. G, else the block cut before the first invalid draft row (status
    2), the largest i with U_i < h_i (Philox coins at node i, ACCEPT_DRAW; h_G' = p_G') and the
    bonus drawn from row t (node t, BONUS_DRAW). Then the outputs."""
    wait_for_prior_grids(USE_PDL)
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    b = tl.program_id(0).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    tokens_row = tokens_ptr + b * N
    logits_b = logits_ptr + b * stride_lb
    rows = scratch_ptr + (b * N + offs_n) * SLOTS
    G = _num_drafts(num_drafts_ptr, b, N, HAS_NUM_DRAFTS)
    temperature = tl.load(temperature_ptr + b)
    drafts = tl.load(tokens_row + offs_n + 1, mask=offs_n + 1 < N, other=-1)
    accepted = tl.zeros([], tl.int32)
    bonus = tl.zeros([], tl.int32)
    status = tl.zeros([], tl.int32)
    if temperature == 0.0:
        in_chain = offs_n <= G
        bads = tl.load(rows + BAD, mask=in_chain, other=0.0) != 0.0
        args = tl.load(rows + ARG, mask=in_chain, other=0.0).to(tl.int32)
        stop = _min1(tl.where(in_chain & (bads | (offs_n == G) | (drafts != args)), offs_n, G))
        accepted = stop
        bonus = _max1(tl.where(offs_n == stop, args, 0))
        status = _max1(tl.where((offs_n == stop) & bads, 1, 0))
    else:
        bad, Gc = _block_of(rows, offs_n, G)
        if bad != 0:
            status = 1
        else:
            status = tl.where(Gc < G, 2, 0)
            splits = tl.arange(0, BLOCK_SPLITS)
            in_splits = splits < SPLITS
            parts_b = parts_ptr + b * N * SPLITS * PARTS
            masses, a, r = _chain_ratios(rows, parts_b, SPLITS, offs_n, splits, in_splits, Gc)
            ps = _capped_products(a, r, offs_n, Gc, BLOCK_N)
            in_cut = (offs_n > 0) & (offs_n < Gc)
            Rs = tl.sum(_chunk_slot(parts_b, SPLITS, offs_n, splits, in_cut, in_splits, PART_RES), axis=1)
            denominators = tl.where(in_cut, Rs + 1.0 - ps, 0.0)
            hs = tl.where(denominators > 0.0, Rs / tl.where(denominators > 0.0, denominators, 1.0), 1.0)
            hs = tl.where(offs_n == Gc, ps, tl.where(in_cut, hs, 0.0))
            seed = tl.load(seed_ptr + b)
            offset = tl.load(offset_ptr + b)
            coins = _uniform(seed, offset, offs_n, ACCEPT_DRAW)
            accepted = _max1(tl.where((offs_n >= 1) & (offs_n <= Gc) & (coins < hs), offs_n, 0))
            # The bonus token: from w_G when every draft is kept, else from max(p_t P_t - r_t, 0).
            at = accepted
            row = scratch_ptr + (b * N + at) * SLOTS
            parts_at = parts_b + (at * SPLITS + splits) * PARTS
            bonus = _draw(logits_b + at * stride_ln, V, tl.load(row + MAX).to(CT), temperature.to(CT),
                          tl.load(row + KTH).to(CT), tl.load(row + DENOM).to(CT), tl.load(row + CUT).to(CT),
                          tl.load(row + NORM).to(CT), _lane(masses, at, offs_n), _lane(ps, at, offs_n),
                          draft_probs_ptr + (b * N + at) * Vd, inv_d2t_ptr, tl.load(row + SUM, mask=at < Gc, other=1.0),
                          tl.load(tokens_row + tl.minimum(at + 1, N - 1)), (at < Gc).to(tl.int32),
                          _lane(_uniform(seed, offset, offs_n, BONUS_DRAW), at, offs_n),
                          tl.load(parts_at + PART_TOTAL_W, mask=in_splits, other=0.0),
                          tl.load(parts_at + PART_TOTAL_RES, mask=in_splits & (splits * 0 + at < Gc), other=0.0),
                          splits, in_splits, chunk, CT, BLOCK_V, HAS_DRAFT, HAS_D2T).to(tl.int32)
    if status == 1:
        # Accept nothing; the bonus is the argmax over the finite root logits (0 if none).
        accepted = 0
        bonus = _finite_argmax(logits_b, V, CT, BLOCK_V)
    in_row = offs_n < N
    out = tl.where(offs_n < accepted, drafts, tl.where(offs_n == accepted, bonus.to(tl.int64), -1))
    tl.store(out_tokens_ptr + b * N + offs_n, out, mask=in_row)
    tl.store(accept_nodes_ptr + b * N + offs_n, tl.where(offs_n <= accepted, offs_n, -1), mask=in_row)
    tl.store(accept_len_ptr + b, accepted)
    tl.store(status_ptr + b, status)


# Defaults of the sampling arguments left out (greedy, no top-k, no top-p, seed and offset 0),
# made once per (device, B) and never written.
_DEFAULTS = {"temperature": (0.0, torch.float32), "top_k": (0, torch.int32), "top_p": (1.0, torch.float32),
             "seed": (0, torch.int64), "offset": (0, torch.int64)}
_DEFAULT_TENSORS: collections.OrderedDict = collections.OrderedDict()
MAX_DEFAULT_SETS = 8


def _given(t, name, B, device):
    if t is not None:
        return t.contiguous()
    key = (device, B, name)
    cached = _DEFAULT_TENSORS.get(key)
    if cached is None:
        value, dtype = _DEFAULTS[name]
        cached = _DEFAULT_TENSORS[key] = torch.full((B,), value, dtype=dtype, device=device)
        while len(_DEFAULT_TENSORS) > MAX_DEFAULT_SETS * len(_DEFAULTS):
            _DEFAULT_TENSORS.popitem(last=False)
    return cached


def block_verify(tokens, target_logits, draft_probs=None, *, num_drafts=None, temperature=None, top_k=None,
                 top_p=None, seed=None, offset=None, d2t=None,
                 _config: BlockVerifyConfig | None = None) -> VerifyOutput:
    """Triton launcher with the contract signature (docs/ops.md §21; shapes as
    ``eagle_kernels.reference.block_verify``). ``_config`` overrides :func:`launch_config`
    (tests run the GPU configuration interpreted).

    Shapes
    ------
    tokens int64 [B, N], target_logits [B, N, V] float32 / float16 / bfloat16 / float64 (read as
    they are when their last dim is dense); optional draft_probs float32 [B, N, Vd], num_drafts
    int32 [B], temperature float32 [B], top_k int32 [B], top_p float32 [B], seed int64 [B],
    offset int64 [B], d2t int64 [Vd]. Returns VerifyOutput(accept_len int32 [B], accept_nodes
    int32 [B, N], out_tokens int64 [B, N], status int32 [B]).
    """
    _checks.check_block_verify(tokens, target_logits, draft_probs, num_drafts=num_drafts, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed, offset=offset, d2t=d2t)
    config = _config or launch_config()
    B, N, V = target_logits.shape
    device = target_logits.device
    accept_len = torch.empty(B, dtype=torch.int32, device=device)
    accept_nodes = torch.empty((B, N), dtype=torch.int32, device=device)
    out_tokens = torch.empty((B, N), dtype=torch.int64, device=device)
    status = torch.empty(B, dtype=torch.int32, device=device)
    if B == 0:
        return VerifyOutput(accept_len, accept_nodes, out_tokens, status)
    logits = target_logits if target_logits.stride(2) == 1 else target_logits.contiguous()
    probs, _, inverse, d2t_ok, Vd = _draft_inputs(draft_probs, None, d2t, V, status)
    tokens = tokens.contiguous()
    has_num_drafts = num_drafts is not None
    num_drafts = num_drafts.contiguous() if has_num_drafts else status
    temperature = _given(temperature, "temperature", B, device)
    seed, offset = _given(seed, "seed", B, device), _given(offset, "offset", B, device)
    is_fp64 = target_logits.dtype == torch.float64
    block_v = min(config.block_v, triton.next_power_of_2(V))
    splits, chunk = chunking(B, N, V, block_v, gpu_sms(device))
    chunk_d = triton.cdiv(triton.cdiv(Vd, splits), block_v) * block_v
    scratch = torch.empty((B, N, SLOTS.value), dtype=torch.float64, device=device)
    parts = torch.empty((B, N, splits, PARTS.value), dtype=torch.float64, device=device)
    block_n = max(2, triton.next_power_of_2(N))
    options = dict(HAS_NUM_DRAFTS=has_num_drafts, **launch_options(device), num_warps=config.num_warps)
    drafts = dict(HAS_DRAFT=draft_probs is not None, HAS_D2T=d2t is not None)
    sizes = dict(SPLITS=splits, BLOCK_SPLITS=max(2, triton.next_power_of_2(splits)), BLOCK_V=block_v)
    strides = (logits.stride(0), logits.stride(1))
    grid = (B, N, splits)
    top_k, top_p = _given(top_k, "top_k", B, device), _given(top_p, "top_p", B, device)
    _block_verify_max_kernel[grid](
        logits, probs, num_drafts, temperature, parts, N, V, Vd, chunk, chunk_d, *strides,
        IS_FP64=is_fp64, SPLITS=splits, BLOCK_V=block_v, HAS_DRAFT=draft_probs is not None, **options,
    )
    _block_verify_filters_kernel[grid](
        logits, num_drafts, temperature, top_k, top_p, scratch, parts, N, V, chunk, *strides,
        IS_FP64=is_fp64, SIG_BITS=SIGNIFICANT_KEY_BITS[target_logits.dtype], BLOCK_S=min(block_v, SEARCH_BLOCK),
        RADIX_BITS=config.radix_bits, **sizes, **options,
    )
    _block_verify_mass_kernel[grid](
        tokens, logits, probs, inverse, d2t_ok, num_drafts, temperature, top_k, top_p, scratch, parts, N, V, Vd,
        chunk, *strides, IS_FP64=is_fp64, **sizes, **drafts, **options,
    )
    _block_verify_residual_kernel[grid](
        tokens, logits, probs, inverse, num_drafts, temperature, scratch, parts, N, V, Vd, chunk, *strides,
        IS_FP64=is_fp64, BLOCK_N=block_n, **sizes, **drafts, **options,
    )
    _block_verify_finish_kernel[(B,)](
        tokens, logits, probs, inverse, num_drafts, temperature, seed, offset, scratch, parts,
        accept_len, accept_nodes, out_tokens, status, N, V, Vd, chunk, *strides,
        IS_FP64=is_fp64, BLOCK_N=block_n, **sizes, **drafts, **options,
    )
    return VerifyOutput(accept_len, accept_nodes, out_tokens, status)
