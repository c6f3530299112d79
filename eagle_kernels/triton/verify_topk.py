"""Top-k requests in verify_temperature.py's all-rows launch: every row's top-k candidates listed
in parallel, the walk over the lists in the request's last program.

A sampling request with a small top-k (``0 < top_k <= LIST_TOPK``, with or without top-p) needs,
at each visited row, its k largest entries: the threshold ``kth``, the softmax normaliser over
the entries at or above it, top-p's cut inside that set, and the inverse CDF over the set for the
bonus token. All of it comes from a list holding every entry at or above ``kth``. verify_walk.py
builds that list in three dependent phases a visited row (max, levels, list); here each chunk
program lists its own candidates once, and the merge joins the visited rows' chunk lists:

1. Program ``(c, j, b)`` reads its chunk in tiles of ``[SUBS, SUB]``: each ``SUB``-entry
   sub-block's max (a NaN counted as +inf: the row is bad either way) is stored, and the chunk's
   max with it. The chunk's threshold ``v_c`` is the k-th largest sub-block max (-inf when the
   chunk has fewer than k sub-blocks): at least k of its entries (those sub-blocks' maxima) are at
   or above it, so every entry of the chunk's own top-k is too. The sub-blocks whose max reaches
   ``v_c`` (k of them, more on ties) are read again, ``BATCH`` at a time, and their finite entries
   ``x >= v_c`` stored (id and logit) in ascending id order, up to ``CAP``; the count is stored
   whole (above CAP the chunk overflowed). A -inf entry has no weight at any threshold: only a row
   with fewer than k finite entries has ``kth = -inf``, and then every list holds all its finite
   entries.
2. The merge of a visited row takes ``lam = max_c v_c``: chunk ``argmax v_c`` lists at least k
   entries at or above ``lam``, and every chunk lists all of its entries at or above its ``v_c``,
   hence at or above ``lam``; so the entries ``x >= lam`` of all lists are every entry of the row
   at or above ``lam``, at least k of them, and ``kth >= lam``. They are compacted into the
   request's list (chunk by chunk: ascending ids, the order the walk's list keeps) as
   ``s = (x - max) / T``. A joined list of at most ``TOP_CAND`` entries is the row's candidate
   list as it stands; a longer one (a few hundred entries at the goal shape: every chunk lists
   about k) gives its k-th largest ``s`` (a sort of ``NUM_CAND`` slots), and the entries at or
   above it (the top set: k of them but for ties; those below kth weigh nothing under top-k) are
   joined again from the chunks' lists into the same slots, in the same order. The walk's own
   ``_list_stats`` / ``_accept`` / ``_bonus_from_list`` take it from there over ``TOP_CAND`` slots
   rather than ``NUM_CAND``. A chunk that overflowed, a union above ``NUM_CAND`` entries or a top
   set above ``TOP_CAND`` (ties at kth) leaves the request to the walk's launch (``pending``),
   which then serves it from the start.

Top-p without top-k (``LIST_TOPP``) is listed the same way with k = ``LIST_TOPK``, and its chunk
programs also keep the online softmax sum of verify_temperature.py's rows (a running sum a
sub-block), since top-p's probabilities are relative to the whole row. The merge takes the row's
sum from those partials and hands the list to ``_list_stats`` as the walk does a list of its own:
every unlisted entry has ``s`` below the list's floor (the join's level, or the selected kth), so
the list holds the nucleus when its cut ends clear above that floor (the walk's margin); where it
does not (a flat row: a nucleus of thousands of entries), the request is left to the walk's launch.
A one-token nucleus, the common case after a confident draft, is served here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .philox import _uniform
from .verify_greedy import _descend, _max_nan, _max_nan_fp64, _store_outputs, _walk_start
from .verify_rows import _exp_scale, _fold_sums, _list_stats, _max1, _node_sums, _online_sum_step, _scaled, _sum1
from .verify_walk import ACCEPT_DRAW, BONUS_DRAW, _accept, _bonus_from_list


@triton.jit
def _sub_maxima(row, tile, start, end, subs_row, tile_offs, CT: tl.constexpr, SUB: tl.constexpr,
                SUBS: tl.constexpr):
    """A [SUBS, SUB] tile of a listed chunk and its sub-blocks' maxima, stored at ``subs_row``."""
    offs = tile + tile_offs
    x = tl.load(row + offs, mask=offs < end, other=float("-inf")).to(CT)
    # NaN as +inf: the chunk's max then marks the row bad, as the other passes' flags do. The
    # reduction keeps NaN (max.NaN: no select per entry) and the [SUBS] maxima map it.
    sub_max = tl.reduce(x, 1, _max_nan_fp64 if CT == tl.float64 else _max_nan)
    sub_max = tl.where(sub_max != sub_max, float("inf"), sub_max)
    tl.store(subs_row + (tile - start) // SUB + tl.arange(0, SUBS), sub_max)
    return x, sub_max


@triton.jit
def _topk_chunk(row, start, end, top_k, t, with_sum, part_max_ptr, part_sum_ptr, sub_max_ptr, list_thr_ptr,
                list_count_ptr, list_ids_ptr, list_x_ptr, part, CT: tl.constexpr, BLOCK_T: tl.constexpr,
                SUB: tl.constexpr, BLOCK_SUBS: tl.constexpr, CAP: tl.constexpr, BATCH: tl.constexpr):
    """Entries [start, end) of a listed row: the chunk's max (+inf when it holds a NaN or +inf), its
    threshold v_c, its entries at or above v_c (up to CAP, ascending ids) and their count, stored
    at ``part`` (step 1 above); ``with_sum`` (top-p alone), the sum of exp((x - max) / T) over the
    chunk too, at ``part`` of ``part_sum_ptr``."""
    SUBS: tl.constexpr = BLOCK_T // SUB
    tile_offs = tl.arange(0, SUBS)[:, None] * SUB + tl.arange(0, SUB)[None, :]
    subs_row = sub_max_ptr + part.to(tl.int64) * BLOCK_SUBS
    run_max = tl.full([SUBS], float("-inf"), CT)
    if with_sum:
        # The online softmax of verify_temperature.py's rows, a sub-block a lane, in a loop of its
        # own: the top-k requests' loop stays without it.
        k = _exp_scale(t, CT)
        run_sum = tl.zeros([SUBS], CT)
        for tile in range(start, end, BLOCK_T):
            x, sub_max = _sub_maxima(row, tile, start, end, subs_row, tile_offs, CT, SUB, SUBS)
            # (NaN taken as +inf in sub_max: a bad row's sum is never used.)
            run_max, run_sum = _online_sum_step(x, sub_max, run_max, run_sum, k)
        chunk_max = _max1(run_max)
        tl.store(part_sum_ptr + part, _fold_sums(run_max, run_sum, chunk_max, k))
    else:
        for tile in range(start, end, BLOCK_T):
            _, sub_max = _sub_maxima(row, tile, start, end, subs_row, tile_offs, CT, SUB, SUBS)
            run_max = tl.maximum(run_max, sub_max)
        chunk_max = _max1(run_max)
    tl.store(part_max_ptr + part, chunk_max)
    # Every thread reads back sub-block maxima other threads stored.
    tl.debug_barrier()
    offs_s = tl.arange(0, BLOCK_SUBS)
    n_subs = tl.cdiv(end - start, SUB)
    subs = tl.load(subs_row + offs_s, mask=offs_s < n_subs, other=float("-inf"))
    ranked = tl.sort(subs, descending=True)
    thr = _max1(tl.where(offs_s == top_k - 1, ranked, float("-inf")))
    flagged = (offs_s < n_subs) & (subs >= thr)
    rank = tl.cumsum(flagged.to(tl.int32), axis=0) - 1
    n_flagged = _sum1(flagged.to(tl.int32))
    # The flagged sub-blocks' indices, ascending, over the maxima just read (exact in the compute dtype).
    tl.debug_barrier()
    tl.store(subs_row + rank, offs_s.to(CT), mask=flagged)
    tl.debug_barrier()
    ids_row = list_ids_ptr + part.to(tl.int64) * CAP
    x_row = list_x_ptr + part.to(tl.int64) * CAP
    stored = 0
    slot_in_batch = tl.arange(0, BATCH)
    for first in range(0, n_flagged, BATCH):
        live = first + slot_in_batch < n_flagged
        sub = tl.load(subs_row + first + slot_in_batch, mask=live, other=0).to(tl.int32)
        offs = start + sub[:, None] * SUB + tl.arange(0, SUB)[None, :]
        valid = live[:, None] & (offs < end)
        x = tl.load(row + offs, mask=valid, other=float("-inf")).to(CT)
        keep = valid & (x >= thr) & (x > float("-inf"))  # a -inf entry has no weight whatever kth is
        per_sub = tl.sum(keep.to(tl.int32), axis=1)
        slot = stored + (tl.cumsum(per_sub, axis=0) - per_sub)[:, None] + tl.cumsum(keep.to(tl.int32), axis=1) - 1
        tl.store(ids_row + slot, offs.to(tl.int32), mask=keep & (slot < CAP))
        tl.store(x_row + slot, x, mask=keep & (slot < CAP))
        stored += _sum1(per_sub)
    tl.store(list_thr_ptr + part, thr)
    tl.store(list_count_ptr + part, stored)


@triton.jit
def _join_lists(list_count_ptr, list_ids_ptr, list_x_ptr, merged_ids, merged_s, first_part, node_max, t, level,
                kth, C: tl.constexpr, CAP: tl.constexpr, SLOTS: tl.constexpr):
    """The entries of a visited row's chunk lists (chunk ``first_part`` on) with ``x >= level`` and
    ``s >= kth``, as (id, s) at ``merged_ids`` / ``merged_s`` in ascending id order, up to SLOTS;
    returns how many there are. Partials are read .cg (other programs wrote them)."""
    slots = tl.arange(0, CAP)
    listed = 0
    # A chunk at a time: [CAP] vectors keep the merge's registers few (the walk's loop holds it).
    for c in range(0, C):
        count = tl.load(list_count_ptr + first_part + c, cache_modifier=".cg")
        flat = (first_part + c).to(tl.int64) * CAP + slots
        have = slots < count
        x = tl.load(list_x_ptr + flat, mask=have, other=float("-inf"), cache_modifier=".cg")
        s = _scaled(x, node_max, t)
        keep = have & (x >= level) & (s >= kth)
        slot = listed + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        ids = tl.load(list_ids_ptr + flat, mask=keep, other=0, cache_modifier=".cg")
        tl.store(merged_ids + slot, ids, mask=keep & (slot < SLOTS))
        tl.store(merged_s + slot, s, mask=keep & (slot < SLOTS))
        listed += _sum1(keep.to(tl.int32))
    return listed


@triton.jit
def _kth_largest(scaled_ptr, listed, k, NUM_CAND: tl.constexpr):
    """The k-th largest of the ``listed`` entries at ``scaled_ptr``, -inf where fewer than k."""
    slots = tl.arange(0, NUM_CAND)
    s = tl.load(scaled_ptr + slots, mask=slots < listed, other=float("-inf"), volatile=True)
    return _max1(tl.where(slots == k - 1, tl.sort(s, descending=True), float("-inf")))


@triton.jit
def _topk_node(part_max_ptr, list_thr_ptr, list_count_ptr, list_ids_ptr, list_x_ptr, merged_ids, merged_s, b, N,
               node, t, top_k, C: tl.constexpr, CT: tl.constexpr, BLOCK_C: tl.constexpr, CAP: tl.constexpr,
               NUM_CAND: tl.constexpr, TOP_CAND: tl.constexpr):
    """A visited row's max and its top set (step 2 above): the entries of its chunks' lists at or
    above max_c v_c joined, their k-th largest ``s`` selected, and the entries at or above it as
    (id, s) at ``merged_ids`` / ``merged_s`` in ascending id order. Returns (max, entries in the top
    set, whether the lists hold them all: no chunk overflowed, at most NUM_CAND joined and
    TOP_CAND in the set, and the s every unlisted entry is below)."""
    offs_c = tl.arange(0, BLOCK_C)
    in_c = offs_c < C
    first_part = (b * N + node) * C
    node_max = _max1(tl.load(part_max_ptr + first_part + offs_c, mask=in_c, other=float("-inf"),
                             cache_modifier=".cg"))
    level = _max1(tl.load(list_thr_ptr + first_part + offs_c, mask=in_c, other=float("-inf"), cache_modifier=".cg"))
    counts = tl.load(list_count_ptr + first_part + offs_c, mask=in_c, other=0, cache_modifier=".cg")
    # The joined list; where it is longer than TOP_CAND, its k-th largest, then the top set joined
    # again from the chunks' lists (a compaction in place would scan NUM_CAND slots). One inlined
    # join for both passes.
    kth = tl.full([], float("-inf"), CT)
    joined = 0
    listed = 0
    for select in range(0, 2):
        if (select == 0) | ((joined > TOP_CAND) & (joined <= NUM_CAND)):
            listed = _join_lists(list_count_ptr, list_ids_ptr, list_x_ptr, merged_ids, merged_s, first_part, node_max,
                                 t, level, kth, C, CAP, NUM_CAND)
            tl.debug_barrier()  # the list's stores before the loads of other threads
            if select == 0:
                joined = listed
                if (joined > TOP_CAND) & (joined <= NUM_CAND):
                    kth = _kth_largest(merged_s, joined, top_k, NUM_CAND)
                    tl.debug_barrier()  # the selection's loads before the top set overwrites the list
    whole = (_max1(counts) <= CAP) & (joined <= NUM_CAND) & (listed <= TOP_CAND)
    # Every entry left out of the list has s below this (the join's level or the selected kth).
    floor = tl.maximum(_scaled(level, node_max, t), kth)
    return node_max, listed, whole, floor


@triton.jit
def _merge_and_sample_topk(tokens_ptr, parents_ptr, logits_ptr, part_max_ptr, part_sum_ptr, list_thr_ptr,
                           list_count_ptr, list_ids_ptr, list_x_ptr, merged_ids_ptr, merged_s_ptr, accept_len_ptr,
                           accept_nodes_ptr, out_tokens_ptr, status_ptr, pending_ptr, t, top_k, top_p, top_p_alone,
                           seed, offset, b, N, V, max_depth, stride_lb, stride_ln, C: tl.constexpr,
                           CT: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                           BLOCK_A: tl.constexpr, CAP: tl.constexpr, NUM_CAND: tl.constexpr,
                           TOP_CAND: tl.constexpr):
    """Listed request b: the walk over its visited rows' lists (step 2 above) with the walk kernel's
    acceptance rule, thresholds and bonus draw; its outputs and ``pending`` 0, or, when a visited
    row's list cannot hold its candidates (for top-p alone: its nucleus), no outputs and
    ``pending`` 1 (the walk's launch serves the request). ``top_k`` is the lists' k (LIST_TOPK for
    top-p alone)."""
    offs_n = tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    tokens_row = tokens_ptr + b * N
    parents_row = parents_ptr + b * N
    merged_ids = merged_ids_ptr + b * NUM_CAND
    merged_s = merged_s_ptr + b * NUM_CAND
    tokens = tl.load(tokens_row + offs_n, mask=in_n, other=-1)
    accept_coins = _uniform(seed, offset, offs_n, ACCEPT_DRAW)
    use_p = top_p < 1.0
    exp_scale = _exp_scale(t, CT)
    offs_a, path, emitted = _walk_start(BLOCK_A)
    node = 0
    depth = 0
    walking = 1
    bad = 0
    whole = 1
    for step in range(0, max_depth + 1):
        if walking != 0:
            node_max, listed, fits, floor = _topk_node(part_max_ptr, list_thr_ptr, list_count_ptr, list_ids_ptr,
                                                       list_x_ptr, merged_ids, merged_s, b, N, node, t, top_k, C, CT,
                                                       BLOCK_C, CAP, NUM_CAND, TOP_CAND)
            if (node_max == float("inf")) | (node_max == float("-inf")):  # NaN / +inf, or no finite entry
                bad = 1
                walking = 0
            elif fits == 0:
                whole = 0
                walking = 0
            else:
                # A top-k list's own entries make its softmax sum. Top-p alone takes the row's from
                # the chunks' sums, and the list holds the nucleus only when it ends clear above the
                # list's floor (_list_stats' count -1 otherwise).
                level = tl.full([], float("-inf"), CT)
                total = tl.full([], 1.0, tl.float64)
                if top_p_alone:
                    level = floor
                    _, total, _ = _node_sums(part_max_ptr, part_sum_ptr, b, N, node, exp_scale, C, BLOCK_C)
                count, kth, denom, cut, norm, mass = _list_stats(merged_s, listed, level, top_k, top_p,
                                                                 top_p_alone == 0, use_p, total, CT, TOP_CAND)
                if count < 0:
                    whole = 0
                    walking = 0
                else:
                    row = logits_ptr + b.to(tl.int64) * stride_lb + node.to(tl.int64) * stride_ln
                    child, rejected = _accept(row, V, node_max, t, kth, denom, cut, norm, mass, node,
                                              step < max_depth, parents_row, tokens_row, tokens, accept_coins,
                                              offs_n, N, CT, BLOCK_N)
                    if child >= 0:
                        depth, path, emitted, node = _descend(child, step, depth, path, emitted, tokens_row, offs_a)
                    else:
                        # The list of this node is still the request's: the bonus from it.
                        u = _sum1(tl.where(offs_n == node, _uniform(seed, offset, offs_n, BONUS_DRAW), 0.0))
                        bonus = _bonus_from_list(merged_ids, merged_s, listed, tokens_row, node, N, rejected, offs_n,
                                                 kth, denom, cut, norm, u, V, CT, TOP_CAND)
                        emitted = tl.where(offs_a == depth, bonus.to(tl.int64), emitted)
                        walking = 0
    if whole != 0:
        _store_outputs(path, emitted, depth, bad, logits_ptr, accept_len_ptr, accept_nodes_ptr, out_tokens_ptr,
                       status_ptr, b, V, max_depth, stride_lb, CT, BLOCK_V, BLOCK_A)
    tl.store(pending_ptr + b, 1 - whole)
