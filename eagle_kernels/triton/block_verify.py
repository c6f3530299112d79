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

Three launches, the rows of a chain in parallel (``G`` a request's drafts, ``N`` its nodes):

1. grid ``(B, N)``, program ``(b, i)`` for row ``i <= G`` (idle past it): one max pass (max, first
   argmax, bad flags); for a sampling request's good row its filters: the top-k and top-p
   thresholds by the radix search of ``verify_rows.py`` over the order keys of the logits
   (``2^RADIX_BITS`` candidates per pass: 4 passes for bf16 rows, 5 for fp16, 8 for fp32, 16 for
   fp64 on the GPU; the last pass of each search also sums that threshold's normaliser), the
   softmax normaliser when there is no top-k, the float64 mass of the weights and, for ``i < G``,
   ``P_i(x_(i+1))`` and one pass over draft row ``i`` (entries finite and >= 0, the float64 sum
   ``S`` within 1e-3 of 1, ``d2t`` in range, ``r_i(x_(i+1)) > 0``). These scalars go to a float64
   scratch ``[B, N, SLOTS]`` the launcher allocates.
2. grid ``(B, N)``, program ``(b, i)`` for ``i < G'`` of a sampling request without a bad row,
   ``G'`` the block cut before the first invalid draft row (the bad-row check over rows ``0 .. G``
   comes first, as the reference orders it): ``p_i`` from the rows before it and one pass over the
   target and draft rows for ``R_i``, writing ``h_i`` (``i > 0``) and the residual weights' total
   that the bonus draw from row ``i`` would need.
3. grid ``(B,)``: greedy requests' walk from the rows' argmaxes and flags; sampling requests'
   status, accepted length from the ``h_i`` and the coins, and the bonus draw, an inverse CDF in
   token order over row ``t`` (a float64 running sum across tiles, ``tl.cumsum`` within one; the
   totals summed tile by tile in launches 1 and 2): one pass that stops at the tile holding the
   token. Then the outputs.

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
from ._launch_config import interpreted
from ._pdl import launch_options, wait_for_prior_grids
from .philox import _uniform
from .verify import _draft_inputs
from .verify_rows import (
    SEARCH_BLOCK,
    SIGNIFICANT_KEY_BITS,
    _draft_row_check,
    _finite_argmax,
    _max1,
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

    block_v: tile of the row passes (capped at next_pow2(V)).
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
    return INTERPRETER_CONFIG if interpreted(_block_verify_rows_kernel) else GPU_CONFIG


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
def _row_filters(row, V, row_max, t, top_k, top_p, use_k, use_p, CT: tl.constexpr, IS_FP64: tl.constexpr,
                 SIG_BITS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, RADIX_BITS: tl.constexpr):
    """(kth, denom, cut, norm, mass, total) of a sampling row: its weights are
    ``w = [p >= cut] p / norm``, ``p = [s >= kth] exp(s) / denom`` (verify_rows.py's _probs and
    _weights), ``mass`` their float64 sum (lane by lane) and ``total`` the same summed tile by tile
    (the bonus draw's order)."""
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
    if use_p:
        value, kept = _threshold(row, V, row_max, t, kth, denom, top_p.to(tl.float64), True, CT, IS_FP64, SIG_BITS,
                                 BLOCK_S, RADIX_BITS)
        cut = _probs(_scaled(value, row_max, t), kth, denom, CT)
        norm = kept.to(CT)
    lane_mass = tl.zeros([BLOCK_V], dtype=tl.float64)
    total = tl.zeros([], tl.float64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < V
        s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
        w = tl.where(valid, _weights(_probs(s, kth, denom, CT), cut, norm, CT), 0.0).to(tl.float64)
        lane_mass += w
        total += _sum1(w)
    return kth, denom, cut, norm, _sum1(lane_mass), total


@triton.jit
def _residual_mass(row, V, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S, draft_token,
                   CT: tl.constexpr, BLOCK_V: tl.constexpr, HAS_DRAFT: tl.constexpr, HAS_D2T: tl.constexpr):
    """(R, total): R = sum_x max(p P(x) - r(x), 0) in float64, P = w / mass, summed lane by lane
    (h's), and summed tile by tile (the bonus draw's order). One pass over the row."""
    lane = tl.zeros([BLOCK_V], dtype=tl.float64)
    total = tl.zeros([], tl.float64)
    for start in range(0, V, BLOCK_V):
        offs, valid, w, res = _tile(row, start, V, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S,
                                    draft_token, 1, CT, BLOCK_V, HAS_DRAFT, HAS_D2T)
        lane += res
        total += _sum1(res)
    return _sum1(lane), total


@triton.jit
def _draw(row, V, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S, draft_token, residual, coin,
          total_w, total_res, CT: tl.constexpr, BLOCK_V: tl.constexpr, HAS_DRAFT: tl.constexpr,
          HAS_D2T: tl.constexpr):
    """Inverse CDF (the reference's sample_inverse_cdf): the smallest x with cumsum64(v)[x] >
    coin * sum(v), else the largest x with v > 0, over v = the residual weights when ``residual``
    (the weights w instead should rounding leave the residual all zero), else v = w. The totals
    (tile by tile: ``total_w`` of w, ``total_res`` of the residual weights, read only when
    ``residual``) come from launches 1 and 2; one pass over the tiles up to the one the running
    sum crosses in."""
    total_res = tl.where(residual != 0, total_res, total_w)
    residual = tl.where(total_res == 0.0, 0, residual)  # rounding only: draw from w
    target = coin * tl.where(residual != 0, total_res, total_w)
    carry = tl.zeros([], tl.float64)
    found = V
    last_positive = -1
    start = 0
    while (found == V) & (start < V):
        offs, valid, w, res = _tile(row, start, V, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S,
                                    draft_token, residual, CT, BLOCK_V, HAS_DRAFT, HAS_D2T)
        found = _min1(tl.where((tl.cumsum(res, axis=0) + carry > target) & valid, offs, V))
        last_positive = tl.maximum(last_positive, _max1(tl.where(res > 0, offs, -1)))
        carry += _sum1(res)
        start += BLOCK_V
    return tl.where(found < V, found, tl.maximum(last_positive, 0))


# Slots of the per-row scratch [B, N, SLOTS] float64 (integers and flags as exact float64 values).
# Launch 1 writes, for rows 0 .. G: MAX, BAD, ARG; for sampling requests' good rows also KTH, DENOM,
# CUT, NORM, MASS, TOTAL_W (the sum of w tile by tile, the bonus draw's order), and for rows i < G:
# P_NEXT (P_i(x_(i+1)) = w_i(x_(i+1)) / mass_i), SUM (the draft row's float64 sum, 1 for point
# masses), R_NEXT (r_i(x_(i+1))) and DRAFT_OK. Launch 2 writes, for rows i < G' (G' the cut
# block), TOTAL_RES (the residual weights' sum tile by tile, p = p_i) and for i > 0 H.
MAX = tl.constexpr(0)
BAD = tl.constexpr(1)
ARG = tl.constexpr(2)
KTH = tl.constexpr(3)
DENOM = tl.constexpr(4)
CUT = tl.constexpr(5)
NORM = tl.constexpr(6)
MASS = tl.constexpr(7)
P_NEXT = tl.constexpr(8)
SUM = tl.constexpr(9)
R_NEXT = tl.constexpr(10)
DRAFT_OK = tl.constexpr(11)
H = tl.constexpr(12)
TOTAL_W = tl.constexpr(13)
TOTAL_RES = tl.constexpr(14)
SLOTS = tl.constexpr(15)


@triton.jit
def _num_drafts(num_drafts_ptr, b, N, HAS_NUM_DRAFTS: tl.constexpr):
    """G of request b: num_drafts[b] clamped to [0, N - 1], N - 1 without num_drafts."""
    G = tl.zeros([], tl.int32) + (N - 1)
    if HAS_NUM_DRAFTS:
        G = tl.minimum(tl.maximum(tl.load(num_drafts_ptr + b), 0), N - 1)
    return G


@triton.jit
def _block_of(rows, offs_n, G):
    """(bad, G') of a sampling request from launch 1's flags (``rows``: the scratch of its rows
    0 .. BLOCK_N - 1): whether a row 0 .. G is bad, and the block cut before the first draft
    whose row is invalid (G' = the first invalid draft row i < G, else G)."""
    bads = tl.load(rows + BAD, mask=offs_n <= G, other=0.0)
    oks = tl.load(rows + DRAFT_OK, mask=offs_n < G, other=1.0)
    return _max1((bads != 0.0).to(tl.int32)), _min1(tl.where((offs_n < G) & (oks == 0.0), offs_n, G))


@triton.jit
def _capped_products(rows, offs_n, Gc, BLOCK_N: tl.constexpr):
    """[BLOCK_N] p_i = min(1, p_(i-1) P_(i-1)(x_i) / r_(i-1)(x_i)), p_0 = 1, for i <= Gc (1 past)."""
    a = tl.load(rows + P_NEXT, mask=offs_n < Gc, other=0.0)
    r = tl.load(rows + R_NEXT, mask=offs_n < Gc, other=1.0)
    ps = tl.full([BLOCK_N], 1.0, tl.float64)
    p = tl.full([], 1.0, tl.float64)
    for i in range(1, Gc + 1):
        p = tl.minimum(p * _lane(a, i - 1, offs_n) / _lane(r, i - 1, offs_n), 1.0)
        ps = tl.where(offs_n == i, p, ps)
    return ps


@triton.jit
def _block_verify_rows_kernel(
    tokens_ptr,  # [B, N] int64: node 0 the root, node i >= 1 draft i
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V (strides stride_lb, stride_ln)
    draft_probs_ptr,  # [B, N, Vd] float32, dense (read only when HAS_DRAFT)
    inv_d2t_ptr,  # [V] int32: the draft id of each target id, -1 for none (read only when HAS_D2T)
    d2t_ok_ptr,  # [1] int32: 1 when every draft id maps into [0, V) (read only when HAS_D2T)
    num_drafts_ptr,  # [B] int32 in [0, N - 1] (read only when HAS_NUM_DRAFTS)
    temperature_ptr,  # [B] float32 (0 = greedy request)
    top_k_ptr,  # [B] int32 (0 = off)
    top_p_ptr,  # [B] float32 (1 = off)
    scratch_ptr,  # [B, N, SLOTS] float64: row scalars (written: rows 0 .. G, slots as above)
    N, V, Vd, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    SIG_BITS: tl.constexpr,  # leading order-key bits that vary (16 bf16, 19 fp16, 32 fp32, 64 fp64)
    BLOCK_V: tl.constexpr,  # tile of the row passes
    BLOCK_S: tl.constexpr,  # rows of the search tiles, min(BLOCK_V, SEARCH_BLOCK)
    RADIX_BITS: tl.constexpr,
    HAS_NUM_DRAFTS: tl.constexpr,
    HAS_DRAFT: tl.constexpr,  # draft_probs given; else every draft is a point mass
    HAS_D2T: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """Program (b, i): row i of request b (idle past its G): max, first argmax and bad flag; for a
    sampling request's good row its filters, mass and P_i(x_(i+1)), and for i < G draft row i's
    sum, r_i(x_(i+1)) and validity."""
    wait_for_prior_grids(USE_PDL)
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    G = _num_drafts(num_drafts_ptr, b, N, HAS_NUM_DRAFTS)
    if i <= G:
        row = logits_ptr + b * stride_lb + i * stride_ln
        out = scratch_ptr + (b * N + i) * SLOTS
        row_max, arg, flags = _range_max(row, 0, V, CT, BLOCK_V)
        bad = ((flags & 1) != 0) | ((flags & 2) == 0)
        tl.store(out + MAX, row_max.to(tl.float64))
        tl.store(out + BAD, bad.to(tl.float64))
        tl.store(out + ARG, arg.to(tl.float64))
        temperature = tl.load(temperature_ptr + b)
        if (temperature != 0.0) & (bad == 0):
            t = temperature.to(CT)
            top_k = tl.load(top_k_ptr + b)
            top_p = tl.load(top_p_ptr + b)
            use_k = (top_k > 0) & (top_k < V)
            use_p = top_p < 1.0
            kth, denom, cut, norm, mass, total_w = _row_filters(row, V, row_max, t, top_k, top_p, use_k, use_p, CT,
                                                                IS_FP64, SIG_BITS, BLOCK_V, BLOCK_S, RADIX_BITS)
            tl.store(out + KTH, kth.to(tl.float64))
            tl.store(out + DENOM, denom.to(tl.float64))
            tl.store(out + CUT, cut.to(tl.float64))
            tl.store(out + NORM, norm.to(tl.float64))
            tl.store(out + MASS, mass)
            tl.store(out + TOTAL_W, total_w)
            if i < G:
                x = tl.load(tokens_ptr + b * N + i + 1)
                w = _weight_at(row, x, row_max, t, kth, denom, cut, norm, CT)
                tl.store(out + P_NEXT, w.to(tl.float64) / mass)
                S = tl.full([], 1.0, tl.float64)
                r = tl.full([], 1.0, tl.float64)
                ok = tl.full([], 1, tl.int1)
                if HAS_DRAFT:
                    # Draft i + 1 must be drawable from its row (§21: the block ends before it).
                    q_row = draft_probs_ptr + (b * N + i) * Vd
                    S, ok = _draft_row_check(q_row, Vd, BLOCK_V)
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
    scratch_ptr,  # [B, N, SLOTS] float64: launch 1's row scalars; H written for rows 0 < i < G'
    N, V, Vd, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    BLOCK_V: tl.constexpr,  # tile of the row passes
    BLOCK_N: tl.constexpr,  # next power of two of N (at least 2): one lane per row
    HAS_NUM_DRAFTS: tl.constexpr,
    HAS_DRAFT: tl.constexpr,  # draft_probs given; else every draft is a point mass
    HAS_D2T: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """Program (b, i), for a sampling request without a bad row and i < G': p_i from the rows
    before it and one pass over row i and draft row i for R_i = sum_x max(p_i P_i(x) - r_i(x), 0),
    summed lane by lane for h_i = R_i / (R_i + 1 - p_i) (1 where the denominator is not positive;
    row 0's is never read) and tile by tile for the bonus draw from row i."""
    wait_for_prior_grids(USE_PDL)
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    G = _num_drafts(num_drafts_ptr, b, N, HAS_NUM_DRAFTS)
    temperature = tl.load(temperature_ptr + b)
    if (temperature != 0.0) & (i < G):
        offs_n = tl.arange(0, BLOCK_N)
        rows = scratch_ptr + (b * N + offs_n) * SLOTS
        bad, Gc = _block_of(rows, offs_n, G)
        if (bad == 0) & (i < Gc):
            p = _lane(_capped_products(rows, offs_n, i, BLOCK_N), i, offs_n)
            out = scratch_ptr + (b * N + i) * SLOTS
            R, total_res = _residual_mass(logits_ptr + b * stride_lb + i * stride_ln, V, tl.load(out + MAX).to(CT),
                               temperature.to(CT), tl.load(out + KTH).to(CT), tl.load(out + DENOM).to(CT),
                               tl.load(out + CUT).to(CT), tl.load(out + NORM).to(CT), tl.load(out + MASS), p,
                               draft_probs_ptr + (b * N + i) * Vd, inv_d2t_ptr, tl.load(out + SUM),
                               tl.load(tokens_ptr + b * N + i + 1), CT, BLOCK_V, HAS_DRAFT, HAS_D2T)
            tl.store(out + TOTAL_RES, total_res)
            denominator = R + 1.0 - p
            tl.store(out + H, tl.where(denominator > 0.0, R / tl.where(denominator > 0.0, denominator, 1.0), 1.0))


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
    scratch_ptr,  # [B, N, SLOTS] float64: launches 1 and 2's row scalars
    accept_len_ptr,  # [B] int32
    accept_nodes_ptr,  # [B, N] int32
    out_tokens_ptr,  # [B, N] int64
    status_ptr,  # [B] int32
    N, V, Vd, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    BLOCK_V: tl.constexpr,  # tile of the row passes
    BLOCK_N: tl.constexpr,  # next power of two of N (at least 2): one lane per row
    HAS_NUM_DRAFTS: tl.constexpr,
    HAS_DRAFT: tl.constexpr,  # draft_probs given; else every draft is a point mass
    HAS_D2T: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """Program b: request b's outcome from the row scalars. Greedy: §4's walk (the first row that
    is bad, is the last or whose argmax is not the next draft ends it). Sampling: status 1 for a bad
    row 0 .. G, else the block cut before the first invalid draft row (status 2), the largest i with
    U_i < h_i (Philox coins at node i, ACCEPT_DRAW; h_G' = p_G') and the bonus drawn from row t
    (node t, BONUS_DRAW). Then the outputs."""
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
            ps = _capped_products(rows, offs_n, Gc, BLOCK_N)
            hs = tl.where(offs_n == Gc, ps, tl.load(rows + H, mask=(offs_n > 0) & (offs_n < Gc), other=0.0))
            seed = tl.load(seed_ptr + b)
            offset = tl.load(offset_ptr + b)
            coins = _uniform(seed, offset, offs_n, ACCEPT_DRAW)
            accepted = _max1(tl.where((offs_n >= 1) & (offs_n <= Gc) & (coins < hs), offs_n, 0))
            # The bonus token: from w_G when every draft is kept, else from max(p_t P_t - r_t, 0).
            at = accepted
            row = scratch_ptr + (b * N + at) * SLOTS
            bonus = _draw(logits_b + at * stride_ln, V, tl.load(row + MAX).to(CT), temperature.to(CT),
                          tl.load(row + KTH).to(CT), tl.load(row + DENOM).to(CT), tl.load(row + CUT).to(CT),
                          tl.load(row + NORM).to(CT), tl.load(row + MASS), _lane(ps, at, offs_n),
                          draft_probs_ptr + (b * N + at) * Vd, inv_d2t_ptr, tl.load(row + SUM, mask=at < Gc, other=1.0),
                          tl.load(tokens_row + tl.minimum(at + 1, N - 1)), (at < Gc).to(tl.int32),
                          _lane(_uniform(seed, offset, offs_n, BONUS_DRAW), at, offs_n), tl.load(row + TOTAL_W),
                          tl.load(row + TOTAL_RES, mask=at < Gc, other=0.0), CT, BLOCK_V, HAS_DRAFT, HAS_D2T)
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
    scratch = torch.empty((B, N, SLOTS.value), dtype=torch.float64, device=device)
    is_fp64 = target_logits.dtype == torch.float64
    block_v = min(config.block_v, triton.next_power_of_2(V))
    block_n = max(2, triton.next_power_of_2(N))
    flags = dict(HAS_NUM_DRAFTS=has_num_drafts, HAS_DRAFT=draft_probs is not None, HAS_D2T=d2t is not None,
                 **launch_options(device), num_warps=config.num_warps)
    shape = (N, V, Vd, logits.stride(0), logits.stride(1))
    _block_verify_rows_kernel[(B, N)](
        tokens, logits, probs, inverse, d2t_ok, num_drafts, temperature, _given(top_k, "top_k", B, device),
        _given(top_p, "top_p", B, device), scratch, *shape,
        IS_FP64=is_fp64, SIG_BITS=SIGNIFICANT_KEY_BITS[target_logits.dtype], BLOCK_V=block_v,
        BLOCK_S=min(block_v, SEARCH_BLOCK), RADIX_BITS=config.radix_bits, **flags,
    )
    _block_verify_residual_kernel[(B, N)](
        tokens, logits, probs, inverse, num_drafts, temperature, scratch, *shape,
        IS_FP64=is_fp64, BLOCK_V=block_v, BLOCK_N=block_n, **flags,
    )
    _block_verify_finish_kernel[(B,)](
        tokens, logits, probs, inverse, num_drafts, temperature, seed, offset, scratch,
        accept_len, accept_nodes, out_tokens, status, *shape,
        IS_FP64=is_fp64, BLOCK_V=block_v, BLOCK_N=block_n, **flags,
    )
    return VerifyOutput(accept_len, accept_nodes, out_tokens, status)
