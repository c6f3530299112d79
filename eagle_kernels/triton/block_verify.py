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

One program per request (grid ``(B,)``), in passes over whole rows of ``BLOCK_V`` tiles:

- greedy requests walk the chain, one max pass (max, first argmax, bad flags) per row walked;
- sampling requests: a max pass over rows ``0 .. G`` (the bad-row check over the whole block,
  before anything else, as the reference orders it), one pass over each draft row ``0 .. G - 1``
  until the first invalid one (entries finite and >= 0, the float64 sum ``S`` within 1e-3 of 1,
  ``d2t`` in range, ``r(x) > 0`` at the draft), then per row ``i`` of the (possibly cut) block its
  filters: the top-k and top-p thresholds by the radix search of ``verify_rows.py`` over the order
  keys of the logits (``2^RADIX_BITS`` candidates per pass: 4 passes for bf16 rows, 5 for fp16,
  8 for fp32, 16 for fp64 on the GPU; the last pass of each search also sums that threshold's
  normaliser), the softmax normaliser when there is no top-k, the float64 mass of the weights, and
  for ``0 < i < G`` one pass over the target and draft rows for ``R_i``. The bonus draw is an inverse CDF in token
  order (a float64 running sum across tiles, ``tl.cumsum`` within one): one pass for the totals
  and one that stops at the tile holding the token.

Each row's scalars (max, thresholds, normalisers, mass, draft sum) stay in registers, one lane
per row of ``[BLOCK_N]`` vectors, so nothing is written but the outputs. Logits are read in their
own dtype and computed in float32 (float64 for fp64 logits), as in ``verify``.
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
DRAFT_SUM_TOLERANCE = tl.constexpr(1e-3)  # |S - 1| above this makes a draft row invalid (docs/ops.md §4)


@dataclasses.dataclass(frozen=True)
class BlockVerifyConfig:
    """Tuning constants of the launch; the outputs do not depend on them.

    block_v: tile of the row passes (capped at next_pow2(V)).
    radix_bits: bits per digit of the threshold searches (2^radix_bits candidates per pass over
        [min(block_v, SEARCH_BLOCK), 2^radix_bits] tiles).
    num_warps: warps of the one program per request.
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
    return INTERPRETER_CONFIG if interpreted(_block_verify_kernel) else GPU_CONFIG


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
    """(kth, denom, cut, norm, mass) of a sampling row: its weights are
    ``w = [p >= cut] p / norm``, ``p = [s >= kth] exp(s) / denom`` (verify_rows.py's _probs and
    _weights), and ``mass`` their float64 sum."""
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
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < V
        s = _scaled(tl.load(row + offs, mask=valid, other=float("-inf")).to(CT), row_max, t)
        lane_mass += tl.where(valid, _weights(_probs(s, kth, denom, CT), cut, norm, CT), 0.0).to(tl.float64)
    return kth, denom, cut, norm, _sum1(lane_mass)


@triton.jit
def _draft_row_check(q_row, Vd, BLOCK_V: tl.constexpr):
    """(S, ok) of a draft row: its float64 sum, and whether every entry is finite and >= 0 with
    |S - 1| <= DRAFT_SUM_TOLERANCE."""
    lane_sum = tl.zeros([BLOCK_V], dtype=tl.float64)
    lane_bad = tl.zeros([BLOCK_V], dtype=tl.int32)
    for start in range(0, Vd, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        q = tl.load(q_row + offs, mask=offs < Vd, other=0.0)
        lane_bad = lane_bad | ((q != q) | (q == float("inf")) | (q < 0)).to(tl.int32)
        lane_sum += q.to(tl.float64)
    S = _sum1(lane_sum)
    return S, (_max1(lane_bad) == 0) & (tl.abs(S - 1.0) <= DRAFT_SUM_TOLERANCE)


@triton.jit
def _residual_mass(row, V, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S, draft_token,
                   CT: tl.constexpr, BLOCK_V: tl.constexpr, HAS_DRAFT: tl.constexpr, HAS_D2T: tl.constexpr):
    """R = sum_x max(p P(x) - r(x), 0) in float64, P = w / mass: one pass over the row."""
    lane = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(0, V, BLOCK_V):
        offs, valid, w, res = _tile(row, start, V, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S,
                                    draft_token, 1, CT, BLOCK_V, HAS_DRAFT, HAS_D2T)
        lane += res
    return _sum1(lane)


@triton.jit
def _draw(row, V, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S, draft_token, residual, coin,
          CT: tl.constexpr, BLOCK_V: tl.constexpr, HAS_DRAFT: tl.constexpr, HAS_D2T: tl.constexpr):
    """Inverse CDF (the reference's sample_inverse_cdf): the smallest x with cumsum64(v)[x] >
    coin * sum(v), else the largest x with v > 0, over v = the residual weights when ``residual``
    (the weights w instead should rounding leave the residual all zero), else v = w. Two passes:
    the totals, then the tiles up to the one the running sum crosses in."""
    total_w = tl.zeros([], tl.float64)
    total_res = tl.zeros([], tl.float64)
    for start in range(0, V, BLOCK_V):
        offs, valid, w, res = _tile(row, start, V, row_max, t, kth, denom, cut, norm, mass, p, q_row, inv_ptr, S,
                                    draft_token, residual, CT, BLOCK_V, HAS_DRAFT, HAS_D2T)
        total_w += _sum1(w)
        total_res += _sum1(res)
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


@triton.jit
def _greedy_chain(logits_b, tokens_row, G, V, stride_ln, CT: tl.constexpr, BLOCK_V: tl.constexpr):
    """§4's greedy walk along the chain: (accepted drafts, bonus token, bad row walked)."""
    i = tl.zeros([], tl.int32)
    accepted = tl.zeros([], tl.int32)
    bonus = tl.zeros([], tl.int32)
    bad = tl.zeros([], tl.int32)
    done = tl.zeros([], tl.int32)
    while done == 0:
        row_max, arg, flags = _range_max(logits_b + i * stride_ln, 0, V, CT, BLOCK_V)
        if ((flags & 1) != 0) | ((flags & 2) == 0):
            bad = 1
            done = 1
        else:
            draft = tl.load(tokens_row + tl.minimum(i + 1, G))
            if (i == G) | (draft != arg):
                accepted = i
                bonus = arg
                done = 1
            else:
                i += 1
    return accepted, bonus, bad


@triton.jit
def _block_verify_kernel(
    tokens_ptr,  # [B, N] int64: node 0 the root, node i >= 1 draft i
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V (strides stride_lb, stride_ln)
    draft_probs_ptr,  # [B, N, Vd] float32, dense (read only when HAS_DRAFT)
    inv_d2t_ptr,  # [V] int32: the draft id of each target id, -1 for none (read only when HAS_D2T)
    d2t_ok_ptr,  # [1] int32: 1 when every draft id maps into [0, V) (read only when HAS_D2T)
    num_drafts_ptr,  # [B] int32 in [0, N - 1] (read only when HAS_NUM_DRAFTS)
    temperature_ptr,  # [B] float32 (0 = greedy request)
    top_k_ptr,  # [B] int32 (0 = off)
    top_p_ptr,  # [B] float32 (1 = off)
    seed_ptr,  # [B] int64
    offset_ptr,  # [B] int64
    accept_len_ptr,  # [B] int32
    accept_nodes_ptr,  # [B, N] int32
    out_tokens_ptr,  # [B, N] int64
    status_ptr,  # [B] int32
    N, V, Vd, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    SIG_BITS: tl.constexpr,  # leading order-key bits that vary (16 bf16, 19 fp16, 32 fp32, 64 fp64)
    BLOCK_V: tl.constexpr,  # tile of the row passes
    BLOCK_S: tl.constexpr,  # rows of the search tiles, min(BLOCK_V, SEARCH_BLOCK)
    BLOCK_N: tl.constexpr,  # next power of two of N (at least 2): one lane per row
    RADIX_BITS: tl.constexpr,
    HAS_NUM_DRAFTS: tl.constexpr,
    HAS_DRAFT: tl.constexpr,  # draft_probs given; else every draft is a point mass
    HAS_D2T: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """Program b verifies request b's chain (module docstring): greedy walk, or block
    verification with Philox coins (node i, ACCEPT_DRAW) and the bonus coin (node t, BONUS_DRAW)."""
    wait_for_prior_grids(USE_PDL)
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    b = tl.program_id(0).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    tokens_row = tokens_ptr + b * N
    logits_b = logits_ptr + b * stride_lb
    G = tl.zeros([], tl.int32) + (N - 1)
    if HAS_NUM_DRAFTS:
        G = tl.minimum(tl.maximum(tl.load(num_drafts_ptr + b), 0), N - 1)
    temperature = tl.load(temperature_ptr + b)
    accepted = tl.zeros([], tl.int32)
    bonus = tl.zeros([], tl.int32)
    status = tl.zeros([], tl.int32)
    if temperature == 0.0:
        accepted, bonus, bad = _greedy_chain(logits_b, tokens_row, G, V, stride_ln, CT, BLOCK_V)
        status = bad
    else:
        t = temperature.to(CT)
        top_k = tl.load(top_k_ptr + b)
        top_p = tl.load(top_p_ptr + b)
        use_k = (top_k > 0) & (top_k < V)
        use_p = top_p < 1.0
        # Every row of the block is read (each h_i needs it): a bad one anywhere is status 1.
        maxes = tl.zeros([BLOCK_N], tl.float64)
        bad = tl.zeros([], tl.int32)
        for i in range(0, G + 1):
            row_max, arg, flags = _range_max(logits_b + i * stride_ln, 0, V, CT, BLOCK_V)
            bad = bad | (((flags & 1) != 0) | ((flags & 2) == 0)).to(tl.int32)
            maxes = tl.where(offs_n == i, row_max.to(tl.float64), maxes)
        if bad != 0:
            status = 1
        else:
            # Draft rows: the block ends before the first draft its row could not have drawn.
            sums = tl.full([BLOCK_N], 1.0, tl.float64)
            if HAS_DRAFT:
                j = tl.full([], 1, tl.int32)
                while j <= G:
                    q_row = draft_probs_ptr + (b * N + j - 1) * Vd
                    S, ok = _draft_row_check(q_row, Vd, BLOCK_V)
                    x = tl.load(tokens_row + j)
                    if HAS_D2T:
                        xd = tl.load(inv_d2t_ptr + x)
                        ok = ok & (tl.load(d2t_ok_ptr) != 0) & (xd >= 0)
                        qx = tl.load(q_row + xd, mask=xd >= 0, other=0.0)
                    else:
                        qx = tl.load(q_row + x)
                    sums = tl.where(offs_n == j - 1, S, sums)
                    if ok & (qx > 0):  # r(x) = q(x) / S > 0
                        j += 1
                    else:
                        G = j - 1
                        status = 2
            seed = tl.load(seed_ptr + b)
            offset = tl.load(offset_ptr + b)
            coins = _uniform(seed, offset, offs_n, ACCEPT_DRAW)
            # Per row: its filters' scalars, p_i, and the coin against h_i.
            kths = tl.zeros([BLOCK_N], tl.float64)
            denoms = tl.zeros([BLOCK_N], tl.float64)
            cuts = tl.zeros([BLOCK_N], tl.float64)
            norms = tl.zeros([BLOCK_N], tl.float64)
            masses = tl.zeros([BLOCK_N], tl.float64)
            ps = tl.full([BLOCK_N], 1.0, tl.float64)
            p = tl.full([], 1.0, tl.float64)
            for i in range(0, G + 1):
                row = logits_b + i * stride_ln
                row_max = _lane(maxes, i, offs_n).to(CT)
                kth, denom, cut, norm, mass = _row_filters(row, V, row_max, t, top_k, top_p, use_k, use_p, CT,
                                                           IS_FP64, SIG_BITS, BLOCK_V, BLOCK_S, RADIX_BITS)
                kths = tl.where(offs_n == i, kth.to(tl.float64), kths)
                denoms = tl.where(offs_n == i, denom.to(tl.float64), denoms)
                cuts = tl.where(offs_n == i, cut.to(tl.float64), cuts)
                norms = tl.where(offs_n == i, norm.to(tl.float64), norms)
                masses = tl.where(offs_n == i, mass, masses)
                if i > 0:
                    # p_i = min(1, p_(i-1) P_(i-1)(x_i) / r_(i-1)(x_i)), from row i - 1's scalars.
                    x = tl.load(tokens_row + i)
                    w = _weight_at(row - stride_ln, x, _lane(maxes, i - 1, offs_n).to(CT),
                                   t, _lane(kths, i - 1, offs_n).to(CT), _lane(denoms, i - 1, offs_n).to(CT),
                                   _lane(cuts, i - 1, offs_n).to(CT), _lane(norms, i - 1, offs_n).to(CT), CT)
                    r = 1.0
                    if HAS_DRAFT:
                        q_prev = draft_probs_ptr + (b * N + i - 1) * Vd
                        if HAS_D2T:
                            qx = tl.load(q_prev + tl.load(inv_d2t_ptr + x))
                        else:
                            qx = tl.load(q_prev + x)
                        r = qx.to(tl.float64) / _lane(sums, i - 1, offs_n)
                    p = tl.minimum(p * (w.to(tl.float64) / _lane(masses, i - 1, offs_n)) / r, 1.0)
                    ps = tl.where(offs_n == i, p, ps)
                    h = p
                    if i < G:
                        R = _residual_mass(row, V, row_max, t, kth, denom, cut, norm, mass, p,
                                           draft_probs_ptr + (b * N + i) * Vd, inv_d2t_ptr, _lane(sums, i, offs_n),
                                           tl.load(tokens_row + i + 1), CT, BLOCK_V, HAS_DRAFT, HAS_D2T)
                        denominator = R + 1.0 - p
                        h = tl.where(denominator > 0.0, R / tl.where(denominator > 0.0, denominator, 1.0), 1.0)
                    if _lane(coins, i, offs_n) < h:
                        accepted = i
            # The bonus token: from w_G when every draft is kept, else from max(p_t P_t - r_t, 0).
            at = accepted
            bonus = _draw(logits_b + at * stride_ln, V, _lane(maxes, at, offs_n).to(CT), t,
                          _lane(kths, at, offs_n).to(CT), _lane(denoms, at, offs_n).to(CT),
                          _lane(cuts, at, offs_n).to(CT), _lane(norms, at, offs_n).to(CT), _lane(masses, at, offs_n),
                          _lane(ps, at, offs_n), draft_probs_ptr + (b * N + at) * Vd, inv_d2t_ptr,
                          _lane(sums, at, offs_n), tl.load(tokens_row + tl.minimum(at + 1, N - 1)),
                          (at < G).to(tl.int32), _lane(_uniform(seed, offset, offs_n, BONUS_DRAW), at, offs_n), CT,
                          BLOCK_V, HAS_DRAFT, HAS_D2T)
    if status == 1:
        # Accept nothing; the bonus is the argmax over the finite root logits (0 if none).
        accepted = 0
        bonus = _finite_argmax(logits_b, V, CT, BLOCK_V)
    in_row = offs_n < N
    drafts = tl.load(tokens_row + offs_n + 1, mask=offs_n + 1 < N, other=-1)
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
    block_v = min(config.block_v, triton.next_power_of_2(V))
    _block_verify_kernel[(B,)](
        tokens.contiguous(), logits, probs, inverse, d2t_ok,
        num_drafts.contiguous() if num_drafts is not None else status,
        _given(temperature, "temperature", B, device), _given(top_k, "top_k", B, device),
        _given(top_p, "top_p", B, device), _given(seed, "seed", B, device), _given(offset, "offset", B, device),
        accept_len, accept_nodes, out_tokens, status,
        N, V, Vd, logits.stride(0), logits.stride(1),
        IS_FP64=target_logits.dtype == torch.float64, SIG_BITS=SIGNIFICANT_KEY_BITS[target_logits.dtype],
        BLOCK_V=block_v, BLOCK_S=min(block_v, SEARCH_BLOCK), BLOCK_N=max(2, triton.next_power_of_2(N)),
        RADIX_BITS=config.radix_bits, HAS_NUM_DRAFTS=num_drafts is not None, HAS_DRAFT=draft_probs is not None,
        HAS_D2T=d2t is not None, **launch_options(device), num_warps=config.num_warps,
    )
    return VerifyOutput(accept_len, accept_nodes, out_tokens, status)
