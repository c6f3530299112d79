"""Triton ``verify`` of greedy calls (``temperature`` None): every row's argmax in parallel, then
the walk, in one launch (``_verify_greedy_kernel``, grid ``(C, N, B)``).

A greedy row needs one pass (its max, first argmax and bad flags), and a row's pass does not
depend on the walk's earlier rows. The one-launch walk of verify_walk.py reads only the rows the
walk visits, but one after another: each visited row is a phase that waits for the previous one
(a claim, the chunks, a merge, the next claim), so its time grows by a few microseconds a visited
row whatever the row's bytes. Here every row of the tree is read at once, so the launch costs one
read of all ``B * N`` rows (wider than the visited rows by N / (accepted + 1)) plus one merge:

1. Program ``(c, j, b)`` reads chunk ``c`` of row ``j`` of request ``b`` (``chunk`` entries,
   tiles of ``BLOCK_V``, ``VEC`` consecutive entries a thread: one 16-byte load of bf16; only a
   row's last tile is masked). Each thread reduces its VEC entries of a tile to their max (a
   NaN-propagating max: for 16-bit rows the compiler does it on packed pairs before widening)
   and keeps the largest such max so far (a strict ``>``: the first tile holding it stays), the
   tile that held it, and whether it saw a NaN. It stores the chunk's max (+inf when it saw a NaN
   or +inf: the row is bad either way) and the first index of that max: the threads holding
   the max read their entries of the tile where they reached it again.
2. It then takes a ticket of its request (``_launch_config.tickets``, acquire-release after a
   barrier, as draft_expand's chunks do). The program drawing ticket ``N * C - 1`` reads the
   request's ``N x C`` partials (``.cg``: written by other SMs), reduces them to each row's
   argmax (the first of equal maxima) and bad flag (NaN, +inf, or no entry above -inf, as
   ``reference.verify.row_is_bad``), walks the tree in registers (at each node the first child
   holding the row's argmax, up to ``max_depth``), writes the outputs and resets the ticket.

A bad row on the walk gives status 1 and the root's argmax over its finite entries
(``_finite_argmax``, a pass over the root row in the merging program: only then), as the
one-launch walk does. Outputs are the reference's for every input (python_tests/ops/
test_verify_greedy_rows.py); docs/gpu_kernels.md ("Greedy calls: every row at once") gives the
design's modeled cost beside the walk's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._pdl import wait_for_prior_grids
from .verify_rows import _finite_argmax, _max1, _min1

_BIG = tl.constexpr(2**31 - 1)  # above every entry index and node


@triton.jit
def _max_nan(a, b):
    """max(a, b), NaN if either is NaN (max.NaN: one instruction for float32)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan_fp64(a, b):
    """_max_nan for float64 (no NaN-propagating max instruction): NaN if either is NaN."""
    return tl.where((a != a) | (a > b), a, b)


@triton.jit
def _halve(x, IS_FP64: tl.constexpr):
    """[T, 2K] -> [T, K]: the NaN-propagating max of each thread's pairs of entries."""
    a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
    return _max_nan_fp64(a, b) if IS_FP64 else _max_nan(a, b)


@triton.jit
def _lane_max(x, IS_FP64: tl.constexpr):
    """[T, VEC] -> [T] (VEC a power of two, at most 16): the NaN-propagating max of each lane's VEC
    entries, halved down to one (VEC - 1 instructions): register moves, no shuffle (a tl.reduce
    with this combine compiles to the same code and interprets a hundred times slower)."""
    if x.shape[1] > 8:
        x = _halve(x, IS_FP64)
    if x.shape[1] > 4:
        x = _halve(x, IS_FP64)
    if x.shape[1] > 2:
        x = _halve(x, IS_FP64)
    if x.shape[1] > 1:
        x = _halve(x, IS_FP64)
    return tl.reshape(x, [x.shape[0]])


@triton.jit
def _tile_update(x, tile, best, best_tile, peak, IS_FP64: tl.constexpr):
    """One [threads, VEC] tile of each thread's running argmax: ``best`` (the largest tile max so
    far), the tile that held it first, and ``peak`` (NaN once a NaN was seen). A thread's VEC
    entries are reduced first (``_lane_max``), so the running state costs a few instructions a
    tile rather than a few an entry."""
    tile_max = _lane_max(x, IS_FP64)
    peak = _max_nan_fp64(peak, tile_max) if IS_FP64 else _max_nan(peak, tile_max)
    better = tile_max > best  # NaN never wins; an equal max keeps the earlier tile
    best = tl.where(better, tile_max, best)
    best_tile = tl.where(better, tile, best_tile)
    return best, best_tile, peak


@triton.jit
def _greedy_chunk(row, start, end, part_max_ptr, part_arg_ptr, part, CT: tl.constexpr, IS_FP64: tl.constexpr,
                  BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    """Entries [start, end) of a row (``start`` a multiple of BLOCK_V): their max (+inf when one is
    NaN or +inf) and its first index, stored at ``part`` of the partials (step 1 above)."""
    THREADS: tl.constexpr = BLOCK_V // VEC
    threads = tl.arange(0, THREADS)
    cols = tl.arange(0, VEC)
    lanes = threads[:, None] * VEC + cols[None, :]  # [THREADS, VEC]: a thread's VEC consecutive entries
    whole_end = start + (end - start) // BLOCK_V * BLOCK_V
    best = tl.full([THREADS], float("-inf"), CT)
    best_tile = tl.full([THREADS], 0, tl.int32) + start
    peak = tl.full([THREADS], float("-inf"), CT)
    for tile in range(start, whole_end, BLOCK_V):
        x = tl.load(row + tile + lanes).to(CT)
        best, best_tile, peak = _tile_update(x, tile, best, best_tile, peak, IS_FP64)
    if whole_end < end:  # the row's last, partial tile
        offs = whole_end + lanes
        x = tl.load(row + offs, mask=offs < end, other=float("-inf")).to(CT)
        best, best_tile, peak = _tile_update(x, whole_end, best, best_tile, peak, IS_FP64)
    # A NaN makes the chunk's max +inf: either marks the row bad, and the merge needs no other flag.
    best = tl.where(peak != peak, float("inf"), best)
    chunk_max = _max1(best)
    # The chunk's first entry equal to its max: the threads holding the max read their VEC entries
    # of the tile where they reached it again (one load each, of a tile read moments ago).
    holder = best == chunk_max
    offs = best_tile[:, None] + lanes
    x = tl.load(row + offs, mask=holder[:, None] & (offs < end), other=float("-inf")).to(CT)
    first = tl.min(tl.where(x == best[:, None], cols[None, :], VEC), axis=1)
    chunk_arg = _min1(tl.where(holder, best_tile + threads * VEC + first, _BIG))
    tl.store(part_max_ptr + part, chunk_max)
    tl.store(part_arg_ptr + part, chunk_arg)


@triton.jit
def _verify_greedy_kernel(
    tokens_ptr,  # [B, N] int64
    parents_ptr,  # [B, N] int32
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V
    part_max_ptr,  # [B, N, C] compute dtype: a chunk's max (+inf if it holds a NaN or +inf, -inf if no larger entry)
    part_arg_ptr,  # [B, N, C] int32: the first index of that max
    tickets_ptr,  # [>= B] int32, zero between launches: chunk programs of each request done
    accept_len_ptr,  # [B] int32
    accept_nodes_ptr,  # [B, A] int32, A = max_depth + 1
    out_tokens_ptr,  # [B, A] int64
    status_ptr,  # [B] int32
    N, V, max_depth, chunk,  # chunk: entries of a row per program, a multiple of BLOCK_V
    stride_lb, stride_ln,
    C: tl.constexpr,  # chunks per row
    IS_FP64: tl.constexpr,
    BLOCK_V: tl.constexpr,  # entries of a tile: [BLOCK_V // VEC, VEC], VEC consecutive entries a thread
    VEC: tl.constexpr,
    BLOCK_N: tl.constexpr,  # next power of two of N
    BLOCK_C: tl.constexpr,  # next power of two of C
    BLOCK_A: tl.constexpr,  # next power of two of max_depth + 1
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """Program (c, j, b): chunk c of row j of request b, then, for the request's last program,
    the merge and the walk (module docstring)."""
    wait_for_prior_grids(USE_PDL)
    CT: tl.constexpr = tl.float64 if IS_FP64 else tl.float32
    c = tl.program_id(0)
    j = tl.program_id(1)
    b = tl.program_id(2)
    row = logits_ptr + b.to(tl.int64) * stride_lb + j.to(tl.int64) * stride_ln
    _greedy_chunk(row, c * chunk, tl.minimum(c * chunk + chunk, V), part_max_ptr, part_arg_ptr, (b * N + j) * C + c,
                  CT, IS_FP64, BLOCK_V, VEC)
    # Publish: every thread's partials are stored (barrier) before one thread takes the ticket
    # with release semantics; the program drawing the last ticket acquires them all.
    tl.debug_barrier()
    done = tl.atomic_add(tickets_ptr + b, 1, sem="acq_rel")
    if done == N * C - 1:
        _merge_and_walk(tokens_ptr, parents_ptr, logits_ptr, part_max_ptr, part_arg_ptr, accept_len_ptr,
                        accept_nodes_ptr, out_tokens_ptr, status_ptr, b, N, V, max_depth, stride_lb, C, CT, BLOCK_V,
                        BLOCK_N, BLOCK_C, BLOCK_A)
        tl.atomic_xchg(tickets_ptr + b, 0, sem="relaxed")  # stream order makes it visible to the next launch


@triton.jit
def _merge_and_walk(tokens_ptr, parents_ptr, logits_ptr, part_max_ptr, part_arg_ptr, accept_len_ptr,
                    accept_nodes_ptr, out_tokens_ptr, status_ptr, b, N, V, max_depth, stride_lb,
                    C: tl.constexpr, CT: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_A: tl.constexpr):
    """Request b's rows from their chunks' partials, then the greedy walk over its tree."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    in_n = offs_n < N
    at = (b * N + offs_n[:, None]) * C + offs_c[None, :]
    part = in_n[:, None] & (offs_c < C)[None, :]
    # .cg: partials of other programs, published by their tickets (not through this SM's L1).
    pm = tl.load(part_max_ptr + at, mask=part, other=float("-inf"), cache_modifier=".cg")
    pa = tl.load(part_arg_ptr + at, mask=part, other=_BIG, cache_modifier=".cg")
    row_max = tl.max(pm, axis=1)
    row_arg = tl.min(tl.where(pm == row_max[:, None], pa, _BIG), axis=1)
    # NaN or +inf seen (a chunk max of +inf), or no entry above -inf (reference.verify.row_is_bad).
    row_bad = (row_max == float("inf")) | (row_max == float("-inf"))
    tokens = tl.load(tokens_ptr + b * N + offs_n, mask=in_n, other=-1)
    parents = tl.load(parents_ptr + b * N + offs_n, mask=in_n, other=-2)
    offs_a, path, emitted = _walk_start(BLOCK_A)
    node = 0
    depth = 0
    walking = 1
    bad = 0
    for step in range(0, max_depth + 1):
        if walking != 0:
            here = offs_n == node
            if _max1(tl.where(here, row_bad, False).to(tl.int32)) != 0:
                bad = 1
                walking = 0
            else:
                target = _max1(tl.where(here, row_arg, -1))
                emitted = tl.where(offs_a == step, target.to(tl.int64), emitted)
                # The first child of the node holding the row's argmax (none past max_depth).
                hit = (parents == node) & (offs_n > node) & (tokens == target) & (step < max_depth)
                child = _min1(tl.where(hit, offs_n, _BIG))
                if child == _BIG:
                    walking = 0
                else:
                    depth += 1
                    path = tl.where(offs_a == depth, child, path)
                    node = child
    _store_outputs(path, emitted, depth, bad, logits_ptr, accept_len_ptr, accept_nodes_ptr, out_tokens_ptr,
                   status_ptr, b, V, max_depth, stride_lb, CT, BLOCK_V, BLOCK_A)


@triton.jit
def _walk_start(BLOCK_A: tl.constexpr):
    """A request's walk at its root: offsets over depths, the accepted path (the root at depth 0) and
    the tokens emitted (none yet)."""
    offs_a = tl.arange(0, BLOCK_A)
    return offs_a, tl.where(offs_a == 0, 0, -1), tl.full([BLOCK_A], -1, tl.int64)


@triton.jit
def _descend(child, step, depth, path, emitted, tokens_row, offs_a):
    """The walk accepts ``child`` at ``step``: its token emitted, the path one node deeper.
    Returns (depth, path, emitted, node)."""
    emitted = tl.where(offs_a == step, tl.load(tokens_row + child), emitted)
    path = tl.where(offs_a == depth + 1, child, path)
    return depth + 1, path, emitted, child


@triton.jit
def _store_outputs(path, emitted, depth, bad, logits_ptr, accept_len_ptr, accept_nodes_ptr, out_tokens_ptr,
                   status_ptr, b, V, max_depth, stride_lb, CT: tl.constexpr, BLOCK_V: tl.constexpr,
                   BLOCK_A: tl.constexpr):
    """Request b's outputs from its walk (``path``, ``emitted`` [BLOCK_A], ``depth`` accepted); a
    bad row on the walk (``bad``) accepts nothing, and its bonus is the argmax over the finite root
    logits (0 if none)."""
    offs_a = tl.arange(0, BLOCK_A)
    A = max_depth + 1
    if bad != 0:
        fallback = _finite_argmax(logits_ptr + b.to(tl.int64) * stride_lb, V, CT, BLOCK_V)
        path = tl.where(offs_a == 0, 0, -1)
        emitted = tl.where(offs_a == 0, fallback.to(tl.int64), -1)
        depth = 0
    tl.store(accept_nodes_ptr + b * A + offs_a, path, mask=offs_a < A)
    tl.store(out_tokens_ptr + b * A + offs_a, emitted, mask=offs_a < A)
    tl.store(accept_len_ptr + b, depth)
    tl.store(status_ptr + b, bad)
