"""Triton ``verify`` of calls with a temperature (no draft rows or ``positions``): every row's
softmax statistics in parallel, then the walk, in one launch (``_verify_temperature_kernel``, grid
``(C, N, B)``), as verify_greedy.py does for greedy calls. With filter tensors (``HAS_FILTERS``)
requests with a small top-k (top-p or not) are listed here too (verify_topk.py); the other
filtering requests, and listed ones whose lists overflowed, are left to verify_walk.py's kernel,
launched after this one (``pending``).

Without top-k or top-p a sampling row needs only its max and its softmax sum; the one-launch walk
of verify_walk.py computes them in phases (max, sum, the float64 mass with per-tile sums) one
visited row after another, about three waits a visited row. Here every row is read once:

1. Program ``(c, j, b)`` reads chunk ``c`` of row ``j`` of request ``b``. A greedy request
   (temperature 0) takes verify_greedy.py's pass (max and first argmax, its tiles). A sampling
   request's lanes (16 bytes of consecutive entries each, several a thread, in wider tiles) keep a
   running max ``m`` and a running sum of ``exp((x - m) / T)``, rescaled when ``m`` grows (the
   online softmax); the chunk stores its max (+inf when it saw a NaN or +inf) and its sum relative
   to that max.
2. A ticket per request as in verify_greedy.py; the request's last program walks the tree,
   merging each visited row's ``C`` partials when it gets there into the row's max ``M``, softmax
   sum ``Z`` and per-chunk masses ``P_c = S_c exp((m_c - M) / T) / Z`` (float64). At each node the
   children are tried in node order, child ``c`` with token ``x`` accepted when
   ``U < w(x) / mass``, ``w(x) = exp((l(x) - M) / T) / Z`` evaluated from its one logit
   (``verify_walk._accept``, the walk's own code); a rejected token is zeroed and leaves the mass.
   When every child fails, the bonus token is the inverse CDF of the residual row: the chunk
   masses (less the rejected tokens') name the chunk the draw falls in, and that chunk is scanned
   in token order with a float64 running sum (``_chunk_bonus``).

The mass and the chunk masses come from the online sums rather than a float64 sum of each weight
rounded to float32 (the walk's mass pass): they differ from the reference's in the last bits, so a
decision can differ only when its uniform falls within a few ulps of the threshold (the contract's
allowance, docs/design.md "Counter-based random stream"); the random numbers are the same
Philox4x32-10 stream. Bad rows give status 1 and the root's finite argmax, as everywhere.
python_tests/ops/test_verify_temperature_rows.py checks the outputs against the reference and
the walk; docs/gpu_kernels.md ("Temperature calls: every row at once") gives the modeled cost.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._pdl import wait_for_prior_grids
from .philox import _uniform
from .verify_greedy import (
    _descend,
    _greedy_chunk,
    _lane_max,
    _max_nan,
    _max_nan_fp64,
    _merge_and_walk,
    _store_outputs,
    _walk_start,
)
from .verify_rows import (
    _draw_chunk,
    _exp_scale,
    _filters,
    _fold_sums,
    _max1,
    _min1,
    _node_partials,
    _online_sum_step,
    _probs,
    _scaled,
    _sum1,
    _weights,
)
from .verify_topk import _merge_and_sample_topk, _topk_chunk
from .verify_walk import ACCEPT_DRAW, BONUS_DRAW, _accept, _next_flagged, _residual_tile


@triton.jit
def _softmax_tile(x, run_max, run_sum, peak, k, IS_FP64: tl.constexpr):
    """One [threads, VEC] tile of each thread's online softmax: its running max, the running sum of
    exp2((x - max) * k) over its entries (rescaled when the max grows) and ``peak`` (NaN once a NaN
    was seen: the row is bad, and the sums no longer matter)."""
    tile_max = _lane_max(x, IS_FP64)
    peak = _max_nan_fp64(peak, tile_max) if IS_FP64 else _max_nan(peak, tile_max)
    run_max, run_sum = _online_sum_step(x, tile_max, run_max, run_sum, k)
    return run_max, run_sum, peak


@triton.jit
def _softmax_chunk(row, start, end, t, part_max_ptr, part_sum_ptr, part, CT: tl.constexpr, IS_FP64: tl.constexpr,
                   BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    """Entries [start, end) of a sampling row: their max (+inf when one is NaN or +inf) and the sum
    of exp((x - max) / T) over them, stored at ``part`` of the partials (step 1 above)."""
    LANES: tl.constexpr = BLOCK_V // VEC  # a thread holds BLOCK_V // VEC // (32 * num_warps) of them
    lanes = tl.arange(0, LANES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    k = _exp_scale(t, CT)
    whole_end = start + (end - start) // BLOCK_V * BLOCK_V
    run_max = tl.full([LANES], float("-inf"), CT)
    run_sum = tl.zeros([LANES], CT)
    peak = tl.full([LANES], float("-inf"), CT)
    for tile in range(start, whole_end, BLOCK_V):
        x = tl.load(row + tile + lanes).to(CT)
        run_max, run_sum, peak = _softmax_tile(x, run_max, run_sum, peak, k, IS_FP64)
    if whole_end < end:  # the row's last, partial tile
        offs = whole_end + lanes
        x = tl.load(row + offs, mask=offs < end, other=float("-inf")).to(CT)
        run_max, run_sum, peak = _softmax_tile(x, run_max, run_sum, peak, k, IS_FP64)
    chunk_max = _max1(tl.where(peak != peak, float("inf"), run_max))
    tl.store(part_max_ptr + part, chunk_max)
    tl.store(part_sum_ptr + part, _fold_sums(run_max, run_sum, chunk_max, k))


@triton.jit
def _verify_temperature_kernel(
    tokens_ptr,  # [B, N] int64
    parents_ptr,  # [B, N] int32
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V
    temperature_ptr,  # [B] float32: 0 makes the request greedy
    top_k_ptr,  # [B] int32 (HAS_FILTERS): a sampling request with top_k in (0, V) filters; up to LIST_TOPK listed
    top_p_ptr,  # [B] float32 (HAS_FILTERS): so does one with top_p < 1 (left to the walk unless listed)
    seed_ptr,  # [B] int64
    offset_ptr,  # [B] int64
    part_max_ptr,  # [B, N, C] compute dtype: a chunk's max (+inf if it holds a NaN or +inf, -inf if no larger entry)
    part_arg_ptr,  # [B, N, C] int32: greedy requests, the first index of that max
    part_sum_ptr,  # [B, N, C] compute dtype: sampling requests but listed top-k ones, a chunk's sum of exp((x - m) / T)
    sub_max_ptr,  # [B, N, C, BLOCK_SUBS] compute dtype scratch (LIST_TOPK): a top-k chunk's sub-block maxima
    list_thr_ptr,  # [B, N, C] compute dtype (LIST_TOPK): a top-k chunk's threshold v_c
    list_count_ptr,  # [B, N, C] int32 (LIST_TOPK): its entries at or above v_c (CAP stored)
    list_ids_ptr,  # [B, N, C, CAP] int32 (LIST_TOPK): their ids, ascending
    list_x_ptr,  # [B, N, C, CAP] compute dtype (LIST_TOPK): their logits
    merged_ids_ptr,  # [B, NUM_CAND] int32 scratch (LIST_TOPK): the visited row's list, ascending ids
    merged_s_ptr,  # [B, NUM_CAND] compute dtype scratch (LIST_TOPK): its s
    pending_ptr,  # [B] int32 (HAS_FILTERS): 1 where the walk's launch must serve the request, else 0
    tickets_ptr,  # [>= B] int32, zero between launches: chunk programs of each request done
    accept_len_ptr,  # [B] int32
    accept_nodes_ptr,  # [B, A] int32, A = max_depth + 1
    out_tokens_ptr,  # [B, A] int64
    status_ptr,  # [B] int32
    N, V, max_depth, chunk,  # chunk: entries of a row per program, a multiple of BLOCK_V and of BLOCK_T
    stride_lb, stride_ln,
    C: tl.constexpr,  # chunks per row
    IS_FP64: tl.constexpr,
    BLOCK_V: tl.constexpr,  # entries of a greedy row's tile: [BLOCK_V // VEC, VEC], VEC consecutive entries a thread
    VEC: tl.constexpr,
    BLOCK_T: tl.constexpr,  # entries of a sampling row's tile: [BLOCK_T // VEC_T, VEC_T]
    VEC_T: tl.constexpr,
    BLOCK_S: tl.constexpr,  # entries a step of the bonus draw's scan
    BLOCK_N: tl.constexpr,  # next power of two of N
    BLOCK_C: tl.constexpr,  # next power of two of C
    BLOCK_A: tl.constexpr,  # next power of two of max_depth + 1
    HAS_FILTERS: tl.constexpr = False,  # top_k / top_p given: the walk's launch follows for the filtered requests
    LIST_TOPK: tl.constexpr = 0,  # HAS_FILTERS: requests with top_k in (0, LIST_TOPK] listed here (verify_topk.py)
    SUB: tl.constexpr = 1,  # entries of a top-k chunk's sub-block
    BLOCK_SUBS: tl.constexpr = 1,  # next power of two of a chunk's sub-blocks
    CAP: tl.constexpr = 1,  # list slots of a top-k chunk
    BATCH: tl.constexpr = 1,  # sub-blocks a step of a top-k chunk's list pass
    NUM_CAND: tl.constexpr = 1,  # slots of a visited row's list
    TOP_CAND: tl.constexpr = 1,  # slots of a visited row's entries at or above its kth (top-k lists)
    LIST_TOPP: tl.constexpr = False,  # LIST_TOPK: top-p requests without top-k listed too (their nucleus, if it fits)
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """Program (c, j, b): chunk c of row j of request b, then, for the request's last program,
    the merge and the walk (module docstring)."""
    wait_for_prior_grids(USE_PDL)
    CT: tl.constexpr = tl.float64 if IS_FP64 else tl.float32
    c = tl.program_id(0)
    j = tl.program_id(1)
    b = tl.program_id(2)
    t = tl.load(temperature_ptr + b)
    LISTS: tl.constexpr = HAS_FILTERS and LIST_TOPK > 0
    if HAS_FILTERS:
        top_k = tl.load(top_k_ptr + b)
        filtering = (t != 0) & _filters(top_k, tl.load(top_p_ptr + b), V)
        # A top-k request listed here (verify_topk.py), and with LIST_TOPP a top-p one without top-k
        # (its LIST_TOPK largest entries listed); the other filtering ones go to the walk's launch.
        if LIST_TOPP:
            top_p_alone = filtering & ((top_k <= 0) | (top_k >= V))
        else:  # a constant: without LIST_TOPP the sums' loop and top-p's merge are not compiled
            top_p_alone = False
        listed = (filtering & (top_k > 0) & (top_k <= LIST_TOPK) & (top_k < V)) | top_p_alone
        list_k = tl.where(top_p_alone, LIST_TOPK, top_k)
        if filtering & (listed == 0):
            if (c == 0) & (j == 0):
                tl.store(pending_ptr + b, 1)
            return
    row = logits_ptr + b.to(tl.int64) * stride_lb + j.to(tl.int64) * stride_ln
    start = c * chunk
    end = tl.minimum(start + chunk, V)
    part = (b * N + j) * C + c
    if t == 0:
        _greedy_chunk(row, start, end, part_max_ptr, part_arg_ptr, part, CT, IS_FP64, BLOCK_V, VEC)
    else:
        if LISTS:  # (a constexpr: without it the top-k code is not compiled)
            if listed:
                _topk_chunk(row, start, end, list_k, t, top_p_alone, part_max_ptr, part_sum_ptr, sub_max_ptr,
                            list_thr_ptr, list_count_ptr, list_ids_ptr, list_x_ptr, part, CT, BLOCK_T, SUB, BLOCK_SUBS,
                            CAP, BATCH)
            else:
                _softmax_chunk(row, start, end, t, part_max_ptr, part_sum_ptr, part, CT, IS_FP64, BLOCK_T, VEC_T)
        else:
            _softmax_chunk(row, start, end, t, part_max_ptr, part_sum_ptr, part, CT, IS_FP64, BLOCK_T, VEC_T)
    # Publish as verify_greedy.py does: a barrier, then an acquire-release ticket.
    tl.debug_barrier()
    done = tl.atomic_add(tickets_ptr + b, 1, sem="acq_rel")
    if done == N * C - 1:
        if t == 0:
            _merge_and_walk(tokens_ptr, parents_ptr, logits_ptr, part_max_ptr, part_arg_ptr, accept_len_ptr,
                            accept_nodes_ptr, out_tokens_ptr, status_ptr, b, N, V, max_depth, stride_lb, C, CT,
                            BLOCK_V, BLOCK_N, BLOCK_C, BLOCK_A)
        else:
            if LISTS:
                if listed:
                    _merge_and_sample_topk(tokens_ptr, parents_ptr, logits_ptr, part_max_ptr, part_sum_ptr,
                                           list_thr_ptr, list_count_ptr, list_ids_ptr, list_x_ptr, merged_ids_ptr,
                                           merged_s_ptr, accept_len_ptr, accept_nodes_ptr, out_tokens_ptr, status_ptr,
                                           pending_ptr, t, list_k, tl.load(top_p_ptr + b), top_p_alone,
                                           tl.load(seed_ptr + b), tl.load(offset_ptr + b), b, N, V, max_depth,
                                           stride_lb, stride_ln, C, CT, BLOCK_V, BLOCK_N, BLOCK_C, BLOCK_A, CAP,
                                           NUM_CAND, TOP_CAND)
                else:
                    _merge_and_sample(tokens_ptr, parents_ptr, logits_ptr, part_max_ptr, part_sum_ptr,
                                      accept_len_ptr, accept_nodes_ptr, out_tokens_ptr, status_ptr, t,
                                      tl.load(seed_ptr + b), tl.load(offset_ptr + b), b, N, V, max_depth, chunk,
                                      stride_lb, stride_ln, C, CT, BLOCK_V, BLOCK_S, BLOCK_N, BLOCK_C, BLOCK_A)
            else:
                _merge_and_sample(tokens_ptr, parents_ptr, logits_ptr, part_max_ptr, part_sum_ptr, accept_len_ptr,
                                  accept_nodes_ptr, out_tokens_ptr, status_ptr, t, tl.load(seed_ptr + b),
                                  tl.load(offset_ptr + b), b, N, V, max_depth, chunk, stride_lb, stride_ln, C, CT,
                                  BLOCK_V, BLOCK_S, BLOCK_N, BLOCK_C, BLOCK_A)
        if HAS_FILTERS:
            if listed == 0:  # served here (a listed request's merge says whether it was)
                tl.store(pending_ptr + b, 0)
        tl.atomic_xchg(tickets_ptr + b, 0, sem="relaxed")  # stream order makes it visible to the next launch


@triton.jit
def _chunk_bonus(row, V, row_max, t, denom, totals, u, chunk, tokens_row, node, N, rejected, offs_n,
                 C: tl.constexpr, CT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """The bonus token at a node whose children all failed: the smallest x with cumsum64(w)[x] >
    u * sum(w) over the residual row (the rejected children's tokens at 0), the largest x with
    w[x] > 0 if rounding leaves none. ``totals`` [BLOCK_C] float64 are the row's chunk masses:
    less the rejected tokens' weights they name the chunk to scan, from which the scan runs in
    steps of BLOCK_S entries (past the chunk's end too, should its sum have been rounded up)."""
    offs_c = tl.arange(0, BLOCK_C)
    r = _next_flagged(rejected, node, offs_n, N)
    while r < N:
        x = tl.load(tokens_row + r)
        wx = _weights(_probs(_scaled(tl.load(row + x).to(CT), row_max, t), float("-inf"), denom, CT),
                      float("-inf"), 1.0, CT)
        totals = tl.where(offs_c == (x // chunk).to(tl.int32), totals - wx.to(tl.float64), totals)
        r = _next_flagged(rejected, r, offs_n, N)
    totals = tl.maximum(totals, 0.0)
    target = u * _sum1(totals)
    start, carry = _draw_chunk(totals, target, offs_c, offs_c < C, chunk, V)
    found = tl.zeros([], tl.int64) + V  # int64, as the entry offsets the scan compares
    while (found == V) & (start < V):
        offs, valid, w = _residual_tile(row, start, V, row_max, t, float("-inf"), denom, float("-inf"), 1.0,
                                        tokens_row, node, N, rejected, offs_n, True, CT, BLOCK_S)
        # A step's sum first (a reduction); the running sum in token order only in the step it passes.
        step = tl.sum(w, axis=0)
        if carry + step > target:
            found = _min1(tl.where((tl.cumsum(w, axis=0) + carry > target) & valid, offs, V))
        carry += step
        start += BLOCK_S
    if found == V:  # rounding left no entry past the target: the last one of positive weight
        last = tl.zeros([], tl.int64) - 1
        for tile in range(0, V, BLOCK_S):
            offs, valid, w = _residual_tile(row, tile, V, row_max, t, float("-inf"), denom, float("-inf"), 1.0,
                                            tokens_row, node, N, rejected, offs_n, True, CT, BLOCK_S)
            last = tl.maximum(last, _max1(tl.where(w > 0, offs, -1)))
        found = tl.maximum(last, 0)
    return found


@triton.jit
def _merge_and_sample(tokens_ptr, parents_ptr, logits_ptr, part_max_ptr, part_sum_ptr, accept_len_ptr,
                      accept_nodes_ptr, out_tokens_ptr, status_ptr, t, seed, offset, b, N, V, max_depth, chunk,
                      stride_lb, stride_ln, C: tl.constexpr, CT: tl.constexpr, BLOCK_V: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_A: tl.constexpr):
    """Sampling request b: its rows' max, softmax sum and chunk masses from the partials, then the
    walk with the acceptance rule and the bonus draw (module docstring, step 2)."""
    offs_n = tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    k = _exp_scale(t, CT)
    tokens_row = tokens_ptr + b * N
    parents_row = parents_ptr + b * N
    tokens = tl.load(tokens_row + offs_n, mask=in_n, other=-1)
    accept_coins = _uniform(seed, offset, offs_n, ACCEPT_DRAW)
    offs_a, path, emitted = _walk_start(BLOCK_A)
    node = 0
    depth = 0
    walking = 1
    bad = 0
    draw = 0  # the walk stopped at a node whose children all failed: the bonus is drawn there
    rejected = tl.zeros([BLOCK_N], tl.int32)
    for step in range(0, max_depth + 1):
        if walking != 0:
            node_max, denom, totals = _node_partials(part_max_ptr, part_sum_ptr, b, N, node, k, C, BLOCK_C)
            if (node_max == float("inf")) | (node_max == float("-inf")):  # NaN / +inf, or no finite entry
                bad = 1
                walking = 0
            else:
                row = logits_ptr + b.to(tl.int64) * stride_lb + node.to(tl.int64) * stride_ln
                # Weights divide by the sum rounded to the compute dtype, as the walk's do.
                child, rejected = _accept(row, V, node_max, t, float("-inf"), denom.to(CT), float("-inf"), 1.0,
                                          _sum1(totals), node, step < max_depth, parents_row, tokens_row, tokens,
                                          accept_coins, offs_n, N, CT, BLOCK_N)
                if child >= 0:
                    depth, path, emitted, node = _descend(child, step, depth, path, emitted, tokens_row, offs_a)
                else:
                    draw = 1
                    walking = 0
    if draw != 0:  # outside the walk's loop: its registers stay few
        node_max, denom, totals = _node_partials(part_max_ptr, part_sum_ptr, b, N, node, k, C, BLOCK_C)
        row = logits_ptr + b.to(tl.int64) * stride_lb + node.to(tl.int64) * stride_ln
        u = _sum1(tl.where(offs_n == node, _uniform(seed, offset, offs_n, BONUS_DRAW), 0.0))
        bonus = _chunk_bonus(row, V, node_max, t, denom.to(CT), totals, u, chunk, tokens_row, node, N, rejected,
                             offs_n, C, CT, BLOCK_S, BLOCK_C)
        emitted = tl.where(offs_a == depth, bonus.to(tl.int64), emitted)
    _store_outputs(path, emitted, depth, bad, logits_ptr, accept_len_ptr, accept_nodes_ptr, out_tokens_ptr,
                   status_ptr, b, V, max_depth, stride_lb, CT, BLOCK_V, BLOCK_A)
