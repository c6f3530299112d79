"""Triton ``draft_expand``: one depth of EAGLE-2 dynamic tree expansion (Li et al. 2024, §4.1)
in one launch, with no sort: ``_draft_expand_kernel``, grid ``(NC, M, B)``.

1. Every program, chunk ``j`` of row ``(b, m)`` (``BLOCK_V`` entries: a [groups, threads, VEC]
   view, each thread holding runs of ``VEC`` consecutive entries, 16 bytes, one vector load
   each; bf16 read as int32 words and widened by bit ops), gives its max, its sum of
   ``exp(x - max)``, a bad
   flag (NaN or +inf seen) and its top ``TOP_K`` (ties: smaller id), stored best first, in a
   constant number of block-wide steps:
   a. threshold: the chunk's threads form ``SUPER = 2 * next_pow2(TOP_K)`` super-groups; the
      ``TOP_K``-th largest super-group max ``t`` is reached by ``TOP_K`` distinct entries, so
      every top-``TOP_K`` entry (ties included) is ``>= t``;
   b. compaction: each thread builds a bit mask of its entries ``>= t`` (one compare, select and
      add per entry), a scan over the threads' counts gives each one its slots, and it stores
      the ids of its first ``PER_THREAD`` survivors (lowest set bits) to a scratch row;
   c. rank: the ``n <= CAP`` survivors are read back and ranked by one compare per pair; the
      ``TOP_K`` best are stored at their rank.
   More than ``CAP`` survivors, or more than ``PER_THREAD`` in one thread (long ties at ``t``,
   mostly -inf chunks), and ``TOP_K > 32``, take ``TOP_K`` rounds of block-wide argmax
   instead (as does a threshold of -inf): exact, slower; with ``TOP_K <= 32`` the rounds of
   deterministic rows read the chunk again rather than hold it through the compaction. About
   1.3 * TOP_K entries survive a chunk of random logits (docs/gpu_kernels.md). Only a row's last
   chunk takes the masked loads.
2. The program then takes a ticket of its request (an int32 counter, ``atomic_add`` with
   acquire-release semantics after a barrier, so every thread's partials are published). The
   one drawing ticket ``M * NC - 1`` is the last of its request: it reads the request's partials
   (``.cg`` loads) and merges them into ``lse = max + log(sum)`` and each row's top ``TOP_K``,
   writes tokens and scores (``frontier_score + (x - max) - log(sum)``), selects the frontier
   among the ``M * TOP_K`` scores (NaN as -inf, ties by smaller index), and sets the counter
   back to zero: no launch zeroes the counters (``_launch_config.tickets``: one buffer per
   device, zero between launches, so CUDA-graph replays find it zero). A row's top ``TOP_K`` from its
   chunks' lists, all rows at once: the threshold is the ``TOP_K``-th largest chunk max (each
   of ``TOP_K`` chunks holds an entry ``>= it``), the list entries ``>= it`` are compacted by a
   scan and ranked by one compare per pair (step c again); rows with more than ``CAP`` of them,
   and tiles too large for registers (``merge_filters``), take ``TOP_K`` argmax rounds over the
   candidates instead (with few chunks the threshold ranks each list's first ``LEAD`` entries,
   ``merge_lead``, not only its first). The frontier is one pairwise rank over the ``M * TOP_K`` scores where
   that fits in registers, else ``TOP_K`` argmax rounds. Blocks are issued chunk axis first:
   requests finish in order and only the last request's merge runs after every chunk.

An argmax round is one int64 max over packed (value, id) keys (``_pack_key``) for
fp32/fp16/bf16 input; fp64 input keeps a max over values and a min over ids. Instruction counts
of both paths (``python bench/bench_draft_expand.py --sass``): docs/gpu_kernels.md.

Rows ranking logits by value is the log-prob order (one ``lse`` per row). A row with NaN or
+inf, or no entry above -inf, has all log-probs NaN (as torch.log_softmax gives): its
candidates are ids ``0..TOP_K-1`` with NaN scores, like the reference.

Sampled children (docs/ops.md §2): a launch given ``temperature`` compiles the ``SAMPLED``
specialisation (calls without it keep the kernel above unchanged). In it, a row of a request
with ``temperature > 0`` runs the same three steps on Gumbel keys instead of logits: each entry's
``(x - chunk max) / T - log(-log U)`` in float64, U from the shared Philox stream
(``philox.py``) at ``(seed, offset, node = id, draw = 2 + depth * 65536 + m)``; the chunk's sum
is of ``exp((x - chunk max) / T)``. The merge re-keys each chunk's candidates exactly as the
contract writes the key (``logp = (x - max) / T - log(sum)`` in the compute dtype, then
``logp - log(-log U)`` in float64) and takes the ``TOP_K`` largest, ties toward the smaller id:
rank ``r`` is the ``r``-th draw. Rows of requests at temperature 0 keep the deterministic rule
inside the same launch. Sampled launches use ``sampled_block_v``-entry chunks (2048 on the GPU:
the float64 keys and their Philox words do not fit 32 entries per thread). Every row also returns
its draft log-probs (``logprobs``).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import _checks
from .._types import DraftCandidates
from ._launch_config import gpu_sms, interpreted, tickets
from ._pdl import launch_options, wait_for_prior_grids
from .philox import _uniform


@dataclasses.dataclass(frozen=True)
class DraftExpandConfig:
    """Tuning constants of the draft_expand launch; the outputs do not depend on them.

    block_v: entries of a row per chunk program (capped at next_pow2(V); on a GPU a launch of few
        rows takes smaller chunks, ``_block_v``); it also sets the warps and the [groups, threads,
        VEC] view of a chunk (``chunk_shape``, ``chunk_vector``).
    merge_lanes: candidate keys of the frontier rows one round of the merge's plain rounds reduces
        together (the merge runs in a chunk program's warps).
    sampled_block_v: entries per chunk program in launches with a temperature (sampled
        children): a float64 key and its Philox draw per entry need more registers per entry.
    """

    block_v: int
    merge_lanes: int = 1024
    sampled_block_v: int = 2048


# Large chunks on the GPU: 64 entries per thread of 8 warps amortise the chunk's fixed steps
# (reductions, scan, rank, ticket): about 15.6 instructions per logit at 120-128 registers (two
# blocks per SM; docs/gpu_kernels.md), and fewer partials to merge. Small ones in
# the interpreter so that V = 1031 in the tests already takes the multi-chunk merge
# (test_triton_many_chunks in python_tests/ops/test_draft_expand_backends.py drives smaller
# chunks through _launch).
GPU_CONFIG = DraftExpandConfig(block_v=16384)
# On a GPU, deterministic launches of few rows take chunks down to this size (``_block_v``): the
# sampled launches' chunk, 4 warps a program.
MIN_GPU_BLOCK_V = 2048
INTERPRETER_CONFIG = DraftExpandConfig(block_v=1024, sampled_block_v=1024)
_MAX_CANDIDATES = 1 << 16  # NC * top_k candidates per row held by one merge program
_BIG_ID = tl.constexpr(2**31 - 1)  # above every id; jit code reads only constexpr globals
PER_THREAD = tl.constexpr(4)  # survivors one thread compacts
_LOG2E = tl.constexpr(1.4426950408889634)
_MAX_FILTER_K = 32  # largest top_k of the chunk threshold
_KEY_MIN = tl.constexpr(-(2**63) + 1)  # below every packed key: taken or masked entries


@triton.jit
def _pack_key(value, index):
    """int64 key whose max is the best (value desc, index asc) pair, so one reduction per
    argmax round instead of two. value: float32 without NaN; index: int32 in [0, 2**31)."""
    bits = (value + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 ties with +0.0, as floats do
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: flip the magnitude
    return (bits.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _unpack_key(key):
    bits = (key >> 32).to(tl.int32)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return bits.to(tl.float32, bitcast=True), 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _draft_expand_kernel(
    logits_ptr,  # [B * M, V] fp32 / fp16 / bf16 / fp64, row-contiguous
    part_max_ptr,  # [B * M, NC] compute dtype
    part_sum_ptr,  # [B * M, NC] compute dtype
    part_bad_ptr,  # [B * M, NC] int32
    part_val_ptr,  # [B * M, NC, TOP_K] compute dtype
    part_id_ptr,  # [B * M, NC, TOP_K] int32
    surv_ptr,  # [B * M, NC, CAP] int32 scratch: ids of the chunk's survivors
    tickets_ptr,  # [>= B] int32, zero between launches: chunk programs of each request done
    merge_val_ptr,  # [B * M, CAP] compute dtype scratch: a row's merge survivors
    merge_id_ptr,  # [B * M, CAP] int32 scratch
    frontier_scores_ptr,  # [B, M] float32
    d2t_ptr,  # [V] int64 (unused unless HAS_D2T)
    temperature_ptr,  # [B] float32 (read only when SAMPLED)
    seed_ptr,  # [B] int64
    offset_ptr,  # [B] int64
    tokens_ptr,  # [B, M * TOP_K] int64
    scores_ptr,  # [B, M * TOP_K] float32
    logprobs_ptr,  # [B, M * TOP_K] float32
    frontier_ptr,  # [B, TOP_K] int32
    draw_base,  # DRAFT_DRAW + depth * DEPTH_STRIDE (< 2**32)
    M,
    V,
    NC,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two of TOP_K
    BLOCK_V: tl.constexpr,
    SUPER: tl.constexpr,  # super-groups of the threshold; 0: no threshold, TOP_K plain rounds
    CAP: tl.constexpr,  # survivor slots ranked in registers (chunk and merge)
    THREADS: tl.constexpr,  # 32 * num_warps
    VEC: tl.constexpr,  # consecutive entries a thread loads at once (16 bytes)
    BF16_WORDS: tl.constexpr,  # bf16 logits read as int32 words of two entries
    BLOCK_M: tl.constexpr,  # frontier rows the merge's plain rounds take together
    BLOCK_MA: tl.constexpr,  # next power of two of M: the rows the merge's threshold step takes at once
    BLOCK_C: tl.constexpr,  # next power of two of NC
    BLOCK_CK: tl.constexpr,  # next power of two of NC * TOP_K
    BLOCK_MK: tl.constexpr,  # next power of two of M * TOP_K
    FILTER_MERGE: tl.constexpr,  # the merge's threshold, compaction and rank fit in registers
    LEAD: tl.constexpr,  # leading entries of each chunk's list the merge's threshold ranks (merge_lead)
    PAIRWISE_FRONTIER: tl.constexpr,  # the frontier by one rank step instead of TOP_K rounds
    HAS_D2T: tl.constexpr,
    IS_FP64: tl.constexpr,
    SAMPLED: tl.constexpr,  # temperature given: rows of requests with temperature > 0 rank Gumbel keys
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    """Program ``(chunk, m, b)``: the chunk's partials (``_chunk``); the last program of a
    request to finish (ticket ``M * NC - 1``) then merges the request's rows, picks its frontier
    (``_merge_request``) and resets the request's ticket for the next launch. Blocks are issued
    chunk-axis first, so requests finish in order and all but the last one's merge overlap chunk
    work."""
    wait_for_prior_grids(USE_PDL)
    chunk = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    row = b * M + tl.program_id(1)
    t = 0.0
    seed = 0
    offset = 0
    draw = draw_base
    if SAMPLED:
        t = tl.load(temperature_ptr + b)
        seed = tl.load(seed_ptr + b)
        offset = tl.load(offset_ptr + b)
        draw = draw_base + tl.program_id(1)
    row_ptr = logits_ptr + row * V
    out = row * NC + chunk
    if SAMPLED:
        if t > 0:
            _chunk(row_ptr, part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, surv_ptr, out, chunk,
                   V, t, seed, offset, draw, TOP_K, BLOCK_K, BLOCK_V, SUPER, CAP, THREADS, VEC, BF16_WORDS, IS_FP64,
                   True)
        else:
            _chunk(row_ptr, part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, surv_ptr, out, chunk,
                   V, t, seed, offset, draw, TOP_K, BLOCK_K, BLOCK_V, SUPER, CAP, THREADS, VEC, BF16_WORDS, IS_FP64,
                   False)
    else:
        _chunk(row_ptr, part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, surv_ptr, out, chunk,
               V, t, seed, offset, draw, TOP_K, BLOCK_K, BLOCK_V, SUPER, CAP, THREADS, VEC, BF16_WORDS, IS_FP64, False)
    # Publish: every thread's partials are stored (barrier) before one thread takes the ticket
    # with release semantics; the program drawing the last ticket acquires them all.
    tl.debug_barrier()
    done = tl.atomic_add(tickets_ptr + b, 1, sem="acq_rel")
    if done == M * NC - 1:
        _merge_request(part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, merge_val_ptr,
                       merge_id_ptr, frontier_scores_ptr, d2t_ptr, logits_ptr, tokens_ptr, scores_ptr, logprobs_ptr,
                       frontier_ptr, b, t, seed, offset, draw_base, M, V, NC, TOP_K, BLOCK_K, CAP, BLOCK_M, BLOCK_MA,
                       BLOCK_C, BLOCK_CK, BLOCK_MK, FILTER_MERGE, LEAD, PAIRWISE_FRONTIER, HAS_D2T, IS_FP64,
                       SAMPLED)
        tl.atomic_xchg(tickets_ptr + b, 0, sem="relaxed")  # stream order makes it visible to the next launch


@triton.jit
def _chunk(row_ptr, part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, surv_ptr, out, chunk, V, t,
           seed, offset, draw, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
           BLOCK_V: tl.constexpr, SUPER: tl.constexpr, CAP: tl.constexpr, THREADS: tl.constexpr,
           VEC: tl.constexpr, BF16_WORDS: tl.constexpr, IS_FP64: tl.constexpr, SAMPLED_ROW: tl.constexpr):
    """_chunk_partials, with the masked loads in a row's last chunk only."""
    if (chunk + 1) * BLOCK_V <= V:
        _chunk_partials(row_ptr, part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, surv_ptr, out,
                        chunk * BLOCK_V, V, t, seed, offset, draw, TOP_K, BLOCK_K, BLOCK_V, SUPER, CAP, THREADS,
                        VEC, BF16_WORDS, IS_FP64, False, SAMPLED_ROW)
    else:
        _chunk_partials(row_ptr, part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, surv_ptr, out,
                        chunk * BLOCK_V, V, t, seed, offset, draw, TOP_K, BLOCK_K, BLOCK_V, SUPER, CAP, THREADS,
                        VEC, BF16_WORDS, IS_FP64, True, SAMPLED_ROW)


@triton.jit
def _popcount(bits):
    """Set bits of each uint32 (SWAR; the compiler emits one POPC), as int32."""
    c = bits - ((bits >> 1) & 0x55555555)
    c = (c & 0x33333333) + ((c >> 2) & 0x33333333)
    c = (c + (c >> 4)) & 0x0F0F0F0F
    c = c + (c >> 8)
    return ((c + (c >> 16)) & 0x3F).to(tl.int32)


@triton.jit
def _gumbel_keys(x, ids, shift, t, seed, offset, draw):
    """Exponential-race keys ``(x - shift) / t - log(-log U)`` in float64 (docs/ops.md §2), U the
    stream's uniform at (seed, offset, node = id, draw); ``x`` in the compute dtype. With the
    row's max as ``shift`` the first term is the reference's scaled logit, bit for bit; the
    merge subtracts the row's log-normaliser (a float32 rounding of its own) for the final
    ranking."""
    s = (x - shift) / t
    u = _uniform(seed, offset, ids, draw.to(tl.uint32))
    return s.to(tl.float64) - tl.log(-tl.log(u))


@triton.jit
def _register_offset(reg, THREADS: tl.constexpr, VEC: tl.constexpr):
    """The id of a chunk thread's entry in register ``reg`` (``g * VEC + e``: run ``g``, entry
    ``e``) less the id of the thread's first entry: runs of the same thread lie ``THREADS * VEC``
    ids apart."""
    return reg + (reg // VEC) * (THREADS * VEC - VEC)


@triton.jit
def _load_chunk(row_ptr, base, V, g3, t3, e3, GROUPS: tl.constexpr, THREADS: tl.constexpr, VEC: tl.constexpr,
                BF16_WORDS: tl.constexpr, IS_FP64: tl.constexpr, MASKED: tl.constexpr):
    """The chunk as [GROUPS, THREADS, VEC] float32 (float64 for fp64 logits), -inf past V. Loaded
    as [GROUPS * THREADS, VEC] (row g * THREADS + t): the only order of that view puts the 16-byte
    runs in registers and the rows on the threads, in triton 3.6 and 3.9 alike (a 3-D load lets
    the compiler spread threads over the groups)."""
    r2 = tl.arange(0, GROUPS * THREADS)[:, None]
    if BF16_WORDS:
        # bf16 read as int32 words of two entries (V even, the row 4-byte aligned): the float32
        # of the low entry is the word shifted up, of the high one the word's high half.
        HALF: tl.constexpr = VEC // 2
        words = base // 2 + r2 * HALF + tl.arange(0, HALF)[None, :]
        words = tl.max_contiguous(tl.multiple_of(words, [1, HALF]), [1, HALF])
        word_ptr = row_ptr.to(tl.pointer_type(tl.int32)) + words
        if MASKED:
            w = tl.load(word_ptr, mask=2 * words < V, other=-8323200)  # 0xFF80FF80: two bf16 -inf
        else:
            w = tl.load(word_ptr)
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)  # & 0xFFFF0000
        x = tl.reshape(tl.join(lo, hi), [GROUPS, THREADS, VEC])
    else:
        offs = base + r2 * VEC + tl.arange(0, VEC)[None, :]
        offs = tl.max_contiguous(tl.multiple_of(offs, [1, VEC]), [1, VEC])
        if MASKED:
            x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
        else:
            x = tl.load(row_ptr + offs)
        x = tl.reshape(x, [GROUPS, THREADS, VEC])
        x = x.to(tl.float64) if IS_FP64 else x.to(tl.float32)
    return x


@triton.jit
def _chunk_partials(row_ptr, part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, surv_ptr, out,
                    base, V, temp, seed, offset, draw, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_V: tl.constexpr, SUPER: tl.constexpr, CAP: tl.constexpr, THREADS: tl.constexpr,
                    VEC: tl.constexpr, BF16_WORDS: tl.constexpr, IS_FP64: tl.constexpr, MASKED: tl.constexpr,
                    SAMPLED: tl.constexpr):
    # [GROUPS, THREADS, VEC] view: thread t holds the runs of VEC consecutive entries at
    # base + (g * THREADS + t) * VEC, one vector load each (16 bytes; the JIT specialises the
    # row pointer and V when they are multiples of 16). Every step below keeps this layout: the
    # per-thread maxima and survivor masks reduce axes 0 and 2 in registers. Flattened in
    # row-major order the view is the chunk in id order, so tl.sum over it (axis=None) adds the
    # entries in the same order as over the 1-D chunk when interpreted.
    GROUPS: tl.constexpr = BLOCK_V // (THREADS * VEC)
    g3 = tl.arange(0, GROUPS)[:, None, None]
    t3 = tl.arange(0, THREADS)[None, :, None]
    e3 = tl.arange(0, VEC)[None, None, :]
    if SAMPLED:
        # Only here: the compiler would otherwise keep every entry's id in registers for the
        # fallback rounds (which compute their own).
        offs = base + (g3 * THREADS + t3) * VEC + e3
        if MASKED:
            in_row = offs < V
    x = _load_chunk(row_ptr, base, V, g3, t3, e3, GROUPS, THREADS, VEC, BF16_WORDS, IS_FP64, MASKED)
    if SAMPLED:
        # The max and sum of exp((x - max) / T) as below; then x holds the Gumbel keys, which
        # the threshold, compaction and rank steps take in place of the logits.
        cmax = tl.max(x)
        shift = tl.where(cmax == float("-inf"), 0.0, cmax)
        csum = tl.sum(tl.exp((x - shift) / temp))
        tl.store(part_max_ptr + out, cmax)
        tl.store(part_sum_ptr + out, csum)
        tl.store(part_bad_ptr + out, ((csum != csum) | (cmax == float("inf"))).to(tl.int32))
        x = _gumbel_keys(x, offs, shift, temp, seed, offset, draw)
        if MASKED:
            x = tl.where(in_row, x, float("-inf"))
    # Maxima ignore NaN (max.f32 on the GPU, fmax in the interpreter); NaN only occurs in bad
    # rows, whose ranking is not used.
    if SUPER > 0:
        # The per-thread maxima take no shuffles.
        tmax = tl.max(tl.max(x, axis=2), axis=0)  # [THREADS]
        smax = tl.max(tl.reshape(tmax, [SUPER, THREADS // SUPER]), axis=1)  # [SUPER]
        cmax = tl.max(smax, axis=0)
    elif not SAMPLED:
        cmax = tl.max(x)
    if not SAMPLED:
        # exp(-inf) = 0; shifting by 0 when the chunk is all -inf avoids -inf - (-inf). A NaN entry
        # makes the sum NaN: with +inf as the max, that is the bad flag, with no extra reduction.
        shift = tl.where(cmax == float("-inf"), 0.0, cmax)
        csum = tl.sum(tl.exp2(x * _LOG2E - shift * _LOG2E))  # one FFMA per entry
        tl.store(part_max_ptr + out, cmax)
        tl.store(part_sum_ptr + out, csum)
        tl.store(part_bad_ptr + out, ((csum != csum) | (cmax == float("inf"))).to(tl.int32))
    n = BLOCK_V + 1  # survivors; above CAP: the plain rounds
    if SUPER > 0:
        # Threshold: the TOP_K-th largest super-group max. TOP_K super-groups hold an entry >= t
        # (or t = -inf), so the chunk's top TOP_K, ties included, are all >= t.
        above = tl.sum((smax[None, :] >= smax[:, None]).to(tl.int32), axis=1)  # [SUPER]
        t = tl.max(tl.where(above >= TOP_K, smax, float("-inf")), axis=0)
        # With t = -inf (fewer than TOP_K super-groups hold an entry above -inf) the chunk takes
        # the plain rounds, so entries past V (-inf) never survive.
        surv = x >= t
        # Compaction, per thread: a bit mask of its survivors (bit g * VEC + e; one select and
        # add per entry), then its first PER_THREAD survivors by lowest set bit, at slot =
        # survivors of the threads before + j. A thread with more sends the chunk to the plain
        # rounds (n > CAP). No step wraps around (the interpreter checks overflow).
        REGS: tl.constexpr = BLOCK_V // THREADS
        reg = (g3 * VEC + e3).to(tl.uint32)
        one = tl.full([1, 1, 1], 1, tl.uint32)
        if REGS > 32:  # two 32-bit masks (registers 0-31 and 32-63), joined for the extraction
            lo = tl.sum(tl.sum(tl.where(surv & (reg < 32), one << (reg & 31), 0), axis=2), axis=0)
            hi = tl.sum(tl.sum(tl.where(surv & (reg >= 32), one << (reg & 31), 0), axis=2), axis=0)
            cnt = _popcount(lo) + _popcount(hi)
            bits = lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)
        else:
            bits = tl.sum(tl.sum(tl.where(surv, one << reg, 0), axis=2), axis=0)
            cnt = _popcount(bits)
        counted = tl.sum(tl.where(cnt > PER_THREAD, CAP + 1, cnt), axis=0)
        n = tl.where(t == float("-inf"), CAP + 1, counted)
        slot = tl.cumsum(cnt, axis=0) - cnt
        first_id = base + tl.arange(0, THREADS) * VEC  # the id of each thread's first entry
        for j in tl.static_range(PER_THREAD if PER_THREAD < REGS else REGS):
            rest = bits & ((bits | (bits == 0).to(bits.dtype)) - 1)  # without the lowest set bit
            # The lowest set bit's index, from the exponent of its float value.
            at = ((bits ^ rest).to(tl.float32).to(tl.uint32, bitcast=True) >> 23) - 127  # g * VEC + e
            sid = first_id + _register_offset(at, THREADS, VEC).to(tl.int32)
            tl.store(surv_ptr + out * CAP + slot + j, sid, mask=(j < cnt) & (slot < CAP - j))
            bits = rest
        tl.debug_barrier()  # the ids just stored by other threads are read back below
    # Without a threshold (SUPER 0, CAP 0) the rank step cannot run, and must not be compiled either
    # (tl.arange(0, 0)): ``n`` above is a tensor once assigned, so the condition is made a constexpr here.
    if (n <= CAP) if SUPER > 0 else False:
        # Rank each survivor among the others (value desc, id asc): one compare per pair.
        cand = tl.arange(0, CAP)
        ids = tl.load(surv_ptr + out * CAP + cand, mask=cand < n, other=0)
        vals = tl.load(row_ptr + ids, mask=cand < n, other=float("-inf"))
        vals = vals.to(tl.float64) if IS_FP64 else vals.to(tl.float32)
        if SAMPLED:
            vals = tl.where(cand < n, _gumbel_keys(vals, ids, shift, temp, seed, offset, draw), float("-inf"))
        slot_i, id_i, v_i = cand[None, :], ids[None, :], vals[None, :]  # ranked: columns
        slot_j, id_j, v_j = cand[:, None], ids[:, None], vals[:, None]
        beats = (slot_j < n) & ((v_j > v_i) | ((v_j == v_i) & (id_j < id_i)))
        rank = tl.sum(beats.to(tl.int32), axis=0, keep_dims=True)  # [1, CAP]
        won = (slot_i < n) & (rank < TOP_K)
        tl.store(part_val_ptr + out * TOP_K + rank, v_i, mask=won)
        tl.store(part_id_ptr + out * TOP_K + rank, id_i, mask=won)
        # A chunk with fewer than TOP_K entries stores -inf with ids above every real one, so
        # the merge ranks them last.
        r = tl.arange(0, BLOCK_K)
        empty = (r >= n) & (r < TOP_K)
        tl.store(part_val_ptr + out * TOP_K + r, tl.full([BLOCK_K], float("-inf"), v_i.dtype), mask=empty)
        tl.store(part_id_ptr + out * TOP_K + r, r + (_BIG_ID - TOP_K), mask=empty)
    else:
        # TOP_K rounds of argmax (ties: smaller id) over the whole chunk: for more than CAP
        # survivors (long ties at the threshold, many -inf) and for large TOP_K (no threshold).
        # An exhausted round stores the filler described above. Taken entries and those past V
        # become NaN, which maxima ignore and no best equals; the smallest id among a thread's
        # entries equal to the best is its smallest register index (``loc``, a constant per
        # register: no per-entry ids in registers), then the smallest over threads.
        loc = g3 * VEC + e3
        first_id = base + tl.arange(0, THREADS) * VEC  # the id of each thread's first entry
        if not SAMPLED and SUPER > 0:
            # The chunk again (L1 / L2): holding it through the compaction for these rounds cost
            # spills while the survivor masks were built (all 64 entries a thread of 16-bit and
            # fp32 chunks live). The offset is 0 (a sum of counts), but the compiler cannot see
            # it: it recomputes the addresses here instead of keeping those of the first load
            # live (triton 3.6's masked loads: one 64-bit address per word, spilled otherwise).
            zero = tl.minimum(counted, 0)
            x = _load_chunk(row_ptr, base + zero, V, g3, t3, e3, GROUPS, THREADS, VEC, BF16_WORDS, IS_FP64, MASKED)
        if MASKED:
            x = tl.where(_register_offset(loc, THREADS, VEC) < (V - first_id)[None, :, None], x, float("nan"))
        for i in range(TOP_K):
            best = tl.max(x)
            best = tl.where(best != best, float("-inf"), best)  # nothing left: -inf, as the filler
            tloc = tl.min(tl.min(tl.where(x == best, loc, _BIG_ID), axis=2), axis=0)  # [THREADS]
            tid = tl.where(tloc == _BIG_ID, _BIG_ID, first_id + _register_offset(tloc, THREADS, VEC))
            pick = tl.min(tid, axis=0)
            tl.store(part_val_ptr + out * TOP_K + i, best)
            tl.store(part_id_ptr + out * TOP_K + i, tl.where(pick == _BIG_ID, _BIG_ID - TOP_K + i, pick))
            taken = (tid == pick)[None, :, None] & (loc == tloc[None, :, None])
            x = tl.where(taken, float("nan"), x)


@triton.jit
def _merge_request(part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, merge_val_ptr, merge_id_ptr,
                   frontier_scores_ptr, d2t_ptr, logits_ptr, tokens_ptr, scores_ptr, logprobs_ptr, frontier_ptr, b, t,
                   seed, offset, draw_base, M, V, NC, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, CAP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_MA: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_CK: tl.constexpr,
                   BLOCK_MK: tl.constexpr, FILTER_MERGE: tl.constexpr, LEAD: tl.constexpr,
                   PAIRWISE_FRONTIER: tl.constexpr,
                   HAS_D2T: tl.constexpr, IS_FP64: tl.constexpr, SAMPLED: tl.constexpr):
    """Request ``b``: every row's top TOP_K from its chunks' partials, then the frontier over
    the stored scores."""
    if SAMPLED:
        if t > 0:
            _merge_sampled_rows(part_max_ptr, part_sum_ptr, part_bad_ptr, part_id_ptr, frontier_scores_ptr, d2t_ptr,
                                logits_ptr, tokens_ptr, scores_ptr, logprobs_ptr, b, t, seed, offset, draw_base, M, V,
                                NC, TOP_K, BLOCK_M, BLOCK_C, BLOCK_CK, HAS_D2T, IS_FP64)
        else:
            _merge_value_rows(part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, merge_val_ptr,
                              merge_id_ptr, frontier_scores_ptr, d2t_ptr, tokens_ptr, scores_ptr, logprobs_ptr, b, M,
                              NC, TOP_K, BLOCK_K, CAP, BLOCK_M, BLOCK_MA, BLOCK_C, BLOCK_CK, FILTER_MERGE, LEAD,
                              HAS_D2T, IS_FP64)
    else:
        _merge_value_rows(part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, merge_val_ptr,
                          merge_id_ptr, frontier_scores_ptr, d2t_ptr, tokens_ptr, scores_ptr, logprobs_ptr, b, M, NC,
                          TOP_K, BLOCK_K, CAP, BLOCK_M, BLOCK_MA, BLOCK_C, BLOCK_CK, FILTER_MERGE, LEAD, HAS_D2T,
                          IS_FP64)
    # The scores just stored by other threads of this program are read back below.
    tl.debug_barrier()
    MK = M * TOP_K
    offs_mk = tl.arange(0, BLOCK_MK)
    acc = tl.load(scores_ptr + b * MK + offs_mk, mask=offs_mk < MK, other=float("-inf"))
    acc = tl.where(acc != acc, float("-inf"), acc)  # NaN ranks as -inf
    if PAIRWISE_FRONTIER:
        # Rank of each candidate (score desc, index asc) by one compare per pair; the padding
        # (-inf, indices above every candidate) is beaten by all candidates. The rows j in
        # blocks of at most 32 (fewer registers at a time).
        RB: tl.constexpr = 32 if BLOCK_MK > 32 else BLOCK_MK
        rank = tl.zeros([BLOCK_MK], tl.int32)
        s_i, i = acc[None, :], offs_mk[None, :]
        for j0 in tl.static_range(0, BLOCK_MK, RB):
            j = j0 + tl.arange(0, RB)
            s_j = tl.load(scores_ptr + b * MK + j, mask=j < MK, other=float("-inf"))
            s_j = tl.where(s_j != s_j, float("-inf"), s_j)[:, None]
            rank += tl.sum(((s_j > s_i) | ((s_j == s_i) & (j[:, None] < i))).to(tl.int32), axis=0)
        tl.store(frontier_ptr + b * TOP_K + rank, offs_mk, mask=(rank < TOP_K) & (offs_mk < MK))
    else:
        # TOP_K rounds of argmax, ties by index.
        keys_mk = tl.where(offs_mk < MK, _pack_key(acc, offs_mk), _KEY_MIN)
        for r in range(TOP_K):
            kmax = tl.max(keys_mk, axis=0)
            _, pick = _unpack_key(kmax)
            tl.store(frontier_ptr + b * TOP_K + r, pick)
            keys_mk = tl.where(keys_mk == kmax, _KEY_MIN, keys_mk)


@triton.jit
def _merge_value_rows(part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, merge_val_ptr, merge_id_ptr,
                      frontier_scores_ptr, d2t_ptr, tokens_ptr, scores_ptr, logprobs_ptr, b, M, NC,
                      TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, CAP: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_MA: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_CK: tl.constexpr, FILTER_MERGE: tl.constexpr,
                      LEAD: tl.constexpr,
                      HAS_D2T: tl.constexpr, IS_FP64: tl.constexpr):
    """The most likely TOP_K of every row of request ``b`` from its chunks' lists (sorted by
    value, best first). With FILTER_MERGE (all rows at once, BLOCK_MA): threshold, compaction and
    rank as in a chunk; rows with more than CAP survivors send the request to the rounds."""
    if FILTER_MERGE:
        m = tl.arange(0, BLOCK_MA)
        row_ok = m < M
        row = b * M + m  # [BLOCK_MA]
        offs_c = tl.arange(0, BLOCK_C)
        gmax, log_sum, bad, pm = _row_block_stats(part_max_ptr, part_sum_ptr, part_bad_ptr, row, row_ok, offs_c, NC,
                                                  1.0, False)
        # Threshold: the TOP_K-th largest of the first LEAD entries of every chunk's list (LEAD = 1:
        # the chunk maxima; -inf with fewer entries). TOP_K distinct entries are >= it, so a row's
        # top TOP_K, ties included, are all >= it (and in their chunk's list).
        if LEAD == 1:
            lead = pm
        else:
            offs_l = tl.arange(0, BLOCK_C * LEAD)
            lc, lr = offs_l // LEAD, offs_l % LEAD
            lead_ok = row_ok[:, None] & ((lc < NC) & (lr < TOP_K))[None, :]
            lead = tl.load(part_val_ptr + (row[:, None] * NC + lc[None, :]) * TOP_K + lr[None, :], mask=lead_ok,
                           other=float("-inf"), cache_modifier=".cg")
        above = tl.sum((lead[:, None, :] >= lead[:, :, None]).to(tl.int32), axis=2)  # [BLOCK_MA, C * LEAD]
        thr = tl.max(tl.where(above >= TOP_K, lead, float("-inf")), axis=1)
        n_cand = NC * TOP_K
        offs_ck = tl.arange(0, BLOCK_CK)
        cand = row_ok[:, None] & (offs_ck < n_cand)[None, :]
        at = row[:, None] * n_cand + offs_ck[None, :]
        vals = tl.load(part_val_ptr + at, mask=cand, other=float("-inf"), cache_modifier=".cg")
        ids = tl.load(part_id_ptr + at, mask=cand, other=_BIG_ID, cache_modifier=".cg")
        # Compaction: the survivors of a row in candidate order (bad rows keep none).
        surv = (cand & (vals >= thr[:, None]) & ~bad[:, None]).to(tl.int32)
        n = tl.sum(surv, axis=1)  # [BLOCK_MA]
        slot = tl.cumsum(surv, axis=1) - surv
        keep = (surv != 0) & (slot < CAP)
        tl.store(merge_val_ptr + row[:, None] * CAP + slot, vals, mask=keep)
        tl.store(merge_id_ptr + row[:, None] * CAP + slot, ids, mask=keep)
        tl.debug_barrier()  # the survivors just stored by other threads are read back below
        if tl.max(n, axis=0) <= CAP:
            fs = tl.load(frontier_scores_ptr + row, mask=row_ok, other=0.0)
            fs = fs.to(tl.float64) if IS_FP64 else fs
            cap = tl.arange(0, CAP)
            ok = cap[None, :] < n[:, None]  # [BLOCK_MA, CAP]
            at_s = row[:, None] * CAP + cap[None, :]
            sv = tl.load(merge_val_ptr + at_s, mask=ok, other=float("-inf"))
            si = tl.load(merge_id_ptr + at_s, mask=ok, other=_BIG_ID)
            # Rank (value desc, id asc) among the row's survivors: one compare per pair.
            v_j, v_i = sv[:, :, None], sv[:, None, :]
            id_j, id_i = si[:, :, None], si[:, None, :]
            beats = ok[:, :, None] & ((v_j > v_i) | ((v_j == v_i) & (id_j < id_i)))
            rank = tl.sum(beats.to(tl.int32), axis=1)  # [BLOCK_MA, CAP]
            won = ok & (rank < TOP_K)
            logp = (sv - gmax[:, None]) - log_sum[:, None]
            token = si.to(tl.int64)
            if HAS_D2T:
                token = token + tl.load(d2t_ptr + token, mask=won, other=0)
            c = m[:, None] * TOP_K + rank
            MK = M * TOP_K
            tl.store(tokens_ptr + b * MK + c, token, mask=won)
            tl.store(scores_ptr + b * MK + c, (fs[:, None] + logp).to(tl.float32), mask=won)
            tl.store(logprobs_ptr + b * MK + c, logp.to(tl.float32), mask=won)
            # Bad rows: candidates 0..TOP_K-1 with NaN scores, like the reference.
            r = tl.arange(0, BLOCK_K)
            nan_row = (row_ok & bad)[:, None] & (r < TOP_K)[None, :]
            token = tl.zeros([BLOCK_MA, BLOCK_K], tl.int64) + r[None, :]
            if HAS_D2T:
                token = token + tl.load(d2t_ptr + token, mask=nan_row, other=0)
            c = m[:, None] * TOP_K + r[None, :]
            tl.store(tokens_ptr + b * MK + c, token, mask=nan_row)
            nan = tl.full([BLOCK_MA, BLOCK_K], float("nan"), tl.float32)
            tl.store(scores_ptr + b * MK + c, nan, mask=nan_row)
            tl.store(logprobs_ptr + b * MK + c, nan, mask=nan_row)
        else:
            _merge_rows(part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, frontier_scores_ptr,
                        d2t_ptr, tokens_ptr, scores_ptr, logprobs_ptr, b, M, NC, TOP_K, BLOCK_M, BLOCK_C, BLOCK_CK,
                        HAS_D2T, IS_FP64)
    else:
        _merge_rows(part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, frontier_scores_ptr, d2t_ptr,
                    tokens_ptr, scores_ptr, logprobs_ptr, b, M, NC, TOP_K, BLOCK_M, BLOCK_C, BLOCK_CK, HAS_D2T,
                    IS_FP64)


@triton.jit
def _row_block_stats(part_max_ptr, part_sum_ptr, part_bad_ptr, row, row_ok, offs_c, NC, t, SAMPLED_ROW: tl.constexpr):
    """Max, log of the softmax sum and bad flag of a block of rows from their chunk partials
    (sums of ``exp((x - chunk max) / t)`` for sampled rows, t = 1 otherwise)."""
    part = row_ok[:, None] & (offs_c < NC)[None, :]
    at = row[:, None] * NC + offs_c[None, :]
    # .cg: partials of other programs, published by their tickets (not through this SM's L1).
    pm = tl.load(part_max_ptr + at, mask=part, other=float("-inf"), cache_modifier=".cg")
    ps = tl.load(part_sum_ptr + at, mask=part, other=0.0, cache_modifier=".cg")
    pb = tl.load(part_bad_ptr + at, mask=part, other=0, cache_modifier=".cg")
    gmax = tl.max(pm, axis=1)
    shift = tl.where(gmax == float("-inf"), 0.0, gmax)
    if SAMPLED_ROW:
        total = tl.sum(tl.where(pm == float("-inf"), 0.0, ps * tl.exp((pm - shift[:, None]) / t)), axis=1)
    else:
        total = tl.sum(tl.where(pm == float("-inf"), 0.0, ps * tl.exp(pm - shift[:, None])), axis=1)
    bad = (tl.max(pb, axis=1) != 0) | (gmax == float("-inf")) | (gmax == float("inf"))
    return gmax, tl.log(tl.where(bad, 1.0, total)), bad, pm


@triton.jit
def _store_candidate(tokens_ptr, scores_ptr, logprobs_ptr, d2t_ptr, b, m, r, row_ok, bad, pick, fs, logp, MK,
                     TOP_K: tl.constexpr, HAS_D2T: tl.constexpr):
    """Rank ``r`` of rows ``m``: token (``r`` for bad rows), score and draft log-prob."""
    token = tl.where(bad, r, pick).to(tl.int64)
    score = tl.where(bad, float("nan"), fs + logp).to(tl.float32)
    if HAS_D2T:
        token = token + tl.load(d2t_ptr + token, mask=row_ok, other=0)
    c = m * TOP_K + r
    tl.store(tokens_ptr + b * MK + c, token, mask=row_ok)
    tl.store(scores_ptr + b * MK + c, score, mask=row_ok)
    tl.store(logprobs_ptr + b * MK + c, tl.where(bad, float("nan"), logp).to(tl.float32), mask=row_ok)


@triton.jit
def _merge_rows(part_max_ptr, part_sum_ptr, part_bad_ptr, part_val_ptr, part_id_ptr, frontier_scores_ptr, d2t_ptr,
                tokens_ptr, scores_ptr, logprobs_ptr, b, M, NC, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_C: tl.constexpr, BLOCK_CK: tl.constexpr, HAS_D2T: tl.constexpr, IS_FP64: tl.constexpr):
    """The most likely TOP_K of every row of request ``b``, by value from the chunks' top TOP_K."""
    offs_c = tl.arange(0, BLOCK_C)
    offs_ck = tl.arange(0, BLOCK_CK)
    MK = M * TOP_K
    n_cand = NC * TOP_K
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        row_ok = m < M
        row = b * M + m  # [BLOCK_M]
        gmax, log_sum, bad, _ = _row_block_stats(part_max_ptr, part_sum_ptr, part_bad_ptr, row, row_ok, offs_c, NC, 1.0,
                                              False)
        fs = tl.load(frontier_scores_ptr + row, mask=row_ok, other=0.0)
        fs = fs.to(tl.float64) if IS_FP64 else fs
        cand = row_ok[:, None] & (offs_ck < n_cand)[None, :]
        at = row[:, None] * n_cand + offs_ck[None, :]
        vals = tl.load(part_val_ptr + at, mask=cand, other=float("-inf"), cache_modifier=".cg")
        ids = tl.load(part_id_ptr + at, mask=cand, other=_BIG_ID, cache_modifier=".cg")
        if IS_FP64:
            alive = cand
        else:
            keys = tl.where(cand, _pack_key(vals, ids), _KEY_MIN)
        for r in range(TOP_K):
            if IS_FP64:
                best = tl.max(tl.where(alive, vals, float("-inf")), axis=1)
                pick = tl.min(tl.where(alive & (vals == best[:, None]), ids, _BIG_ID), axis=1)
                alive = alive & (ids != pick[:, None])
            else:
                kmax = tl.max(keys, axis=1)
                best, pick = _unpack_key(kmax)
                keys = tl.where(keys == kmax[:, None], _KEY_MIN, keys)
            logp = (best - gmax) - log_sum
            _store_candidate(tokens_ptr, scores_ptr, logprobs_ptr, d2t_ptr, b, m, r, row_ok, bad, pick, fs, logp, MK,
                             TOP_K, HAS_D2T)


@triton.jit
def _merge_sampled_rows(part_max_ptr, part_sum_ptr, part_bad_ptr, part_id_ptr, frontier_scores_ptr, d2t_ptr,
                        logits_ptr, tokens_ptr, scores_ptr, logprobs_ptr, b, t, seed, offset, draw_base, M, V, NC,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_CK: tl.constexpr,
                        HAS_D2T: tl.constexpr, IS_FP64: tl.constexpr):
    """The TOP_K draws of every row of a sampled request: its chunks' candidates re-keyed
    exactly as the contract writes it (``logp = (x - max) / T - log(sum)`` in the compute
    dtype, then ``logp - log(-log U)`` in float64) and ranked by key, ties toward the smaller id."""
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    offs_c = tl.arange(0, BLOCK_C)
    offs_ck = tl.arange(0, BLOCK_CK)
    MK = M * TOP_K
    n_cand = NC * TOP_K
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        row_ok = m < M
        row = b * M + m  # [BLOCK_M]
        gmax, log_sum, bad, _ = _row_block_stats(part_max_ptr, part_sum_ptr, part_bad_ptr, row, row_ok, offs_c, NC, t,
                                              True)
        fs = tl.load(frontier_scores_ptr + row, mask=row_ok, other=0.0)
        fs = fs.to(tl.float64) if IS_FP64 else fs
        cand = row_ok[:, None] & (offs_ck < n_cand)[None, :]
        ids = tl.load(part_id_ptr + row[:, None] * n_cand + offs_ck[None, :], mask=cand, other=_BIG_ID,
                      cache_modifier=".cg")
        real = cand & (ids < V)  # chunks shorter than TOP_K fill with ids above V
        x = tl.load(logits_ptr + row[:, None] * V + ids, mask=real, other=float("-inf")).to(CT)
        logp = ((x - gmax[:, None]) / t).to(CT) - log_sum[:, None].to(CT)
        u = _uniform(seed, offset, ids, (draw_base + m[:, None]).to(tl.uint32))
        keys = tl.where(real, logp.to(tl.float64) - tl.log(-tl.log(u)), float("-inf"))
        alive = cand
        for r in range(TOP_K):
            best = tl.max(tl.where(alive, keys, float("-inf")), axis=1)
            pick = tl.min(tl.where(alive & (keys == best[:, None]), ids, _BIG_ID), axis=1)
            taken = alive & (ids == pick[:, None])
            picked_logp = tl.max(tl.where(taken, logp, float("-inf")), axis=1)
            alive = alive & (ids != pick[:, None])
            _store_candidate(tokens_ptr, scores_ptr, logprobs_ptr, d2t_ptr, b, m, r, row_ok, bad, pick, fs,
                             picked_logp, MK, TOP_K, HAS_D2T)


@dataclasses.dataclass(frozen=True)
class ChunkShape:
    """How a chunk program of ``block_v`` entries runs: ``warps`` warps; the chunk seen as
    [block_v // threads, threads] (registers x threads, at most 64 registers: two uint32
    survivor masks); ``n_super`` super-groups of whole threads for the threshold and ``cap``
    survivor slots, or 0 and 0 for the plain rounds (top_k above ``_MAX_FILTER_K``)."""

    warps: int
    threads: int
    n_super: int
    cap: int


def chunk_shape(block_v: int, top_k: int) -> ChunkShape:
    """Twice next_pow2(top_k) super-groups keep about 1.3 * top_k survivors of an 8192- or
    16384-entry chunk of random logits (16384: mean 10.8, at most 23 for top_k 8 over 2048 bf16
    chunks of N(0, 1));
    the slots are a power of two >= 32 and >= 3 * top_k. Above top_k 32 the [cap, cap] rank
    would not fit in registers: plain rounds."""
    warps = 4 if block_v <= 2048 else 8
    threads = min(block_v, max(32 * warps, block_v // 64))
    block_k = triton.next_power_of_2(top_k)
    if block_k > _MAX_FILTER_K:
        return ChunkShape(warps, threads, 0, 0)
    return ChunkShape(warps, threads, min(2 * block_k, threads), max(32, triton.next_power_of_2(3 * top_k)))


def chunk_vector(block_v: int, shape: ChunkShape, element_size: int) -> int:
    """Consecutive entries a chunk thread holds and loads at once: 16 bytes (8 bf16 / fp16, 4
    fp32, 2 fp64), at most its share of the chunk."""
    return min(16 // element_size, block_v // shape.threads)


def _register_cap(shape: ChunkShape) -> dict:
    """At most 128 registers per thread for 8-warp chunks, so two blocks share an SM (triton 3.6
    otherwise allocates 135 for bf16 and one block runs per SM); no launch option when
    interpreted."""
    return {} if shape.warps < 8 or interpreted(_draft_expand_kernel) else {"maxnreg": 128}


def merge_lead(NC: int, top_k: int) -> int:
    """Leading entries of each chunk's list whose TOP_K-th largest is the merge's threshold: about
    2 * top_k values in all (a power of two, at most next_pow2(top_k)), so that few chunks (NC <
    2 * top_k, 16384-entry chunks of a 128k vocabulary) still give a threshold about as tight as
    the maxima of many: 1 (the chunk maxima) from NC >= 2 * top_k on."""
    return min(triton.next_power_of_2(top_k), triton.next_power_of_2(-(-2 * top_k // NC)))


def merge_filters(shape: ChunkShape, M: int, NC: int, top_k: int, sampled: bool = False) -> bool:
    """Whether the merge takes the threshold, compaction and rank (else the plain rounds): they
    hold [M, NC lead, NC lead] (lead = merge_lead), [M, NC * top_k] and [M, cap, cap] tiles
    (powers of two), at most 64 elements a thread each (32 in a sampled launch), and need the
    chunk's slots (top_k <= 32). In a sampled launch only its temperature-0 rows take this merge,
    in programs of 4 warps whose Philox draws and float64 keys already hold 120-140 registers: with
    64 elements a thread (V 32000, M 8: the [8, 32, 32] rank tile) the kernel took 168-189 registers
    and spilled at 168 (docs/gpu_kernels.md, "Spills")."""
    lanes = (32 if sampled else 64) * shape.threads
    block_m = triton.next_power_of_2(M)
    block_c = triton.next_power_of_2(NC) * merge_lead(NC, top_k)
    return (shape.cap > 0 and block_m * block_c * block_c <= lanes
            and block_m * triton.next_power_of_2(NC * top_k) <= lanes and block_m * shape.cap * shape.cap <= lanes)


def launch_config() -> DraftExpandConfig:
    """The configuration a launch uses unless given one: the GPU's, or the interpreter's when
    the kernels run interpreted (TRITON_INTERPRET=1 when Triton defined them)."""
    return INTERPRETER_CONFIG if interpreted(_draft_expand_kernel) else GPU_CONFIG


DRAFT_DRAW = 2  # first draw index of the Gumbel draws (docs/design.md)
DEPTH_STRIDE = 65536  # draw = DRAFT_DRAW + depth * DEPTH_STRIDE + frontier row


def _block_v(rows: int, V: int, top_k: int, config: DraftExpandConfig, sampled: bool, sms: int | None) -> int:
    """Entries per chunk program: the configured size (capped at next_pow2(V)) or, for a
    deterministic launch on a GPU of ``sms`` SMs whose ``rows`` would leave SMs idle, the largest
    power of two down to MIN_GPU_BLOCK_V that gives every SM a chunk. A decoding step at batch 1
    expands 8 frontier rows: in a 32,000-entry draft vocabulary 16 programs of 16384 entries, 128
    of 2048 (modeled device time 6.9 -> 3.6 us; docs/gpu_kernels.md, draft_expand "Few rows").
    Never below the size whose chunks' candidates the merge can hold (so no call valid with the
    configured size is refused)."""
    block_v = min(config.sampled_block_v if sampled else config.block_v, triton.next_power_of_2(V))
    if sms is None or sampled:
        return block_v
    while (block_v > MIN_GPU_BLOCK_V and rows * triton.cdiv(V, block_v) < sms
           and triton.cdiv(V, block_v // 2) * top_k <= _MAX_CANDIDATES):
        block_v //= 2
    return block_v


def _launch(logits, frontier_scores, top_k, d2t, config: DraftExpandConfig, survivors=None, temperature=None,
            seed=None, offset=None, depth=0, merge_survivors=None) -> DraftCandidates:
    """``survivors``: the chunk step's scratch (int32 [B * M, NC, cap]), ``merge_survivors`` the
    merge's (int32 [B * M, cap]: ids), given by tests that read back which ids each chunk and
    each row's merge compacted. With ``temperature`` the kernels take the sampled
    specialisation (rows of requests at 0 keep the deterministic rule inside it); without it the
    deterministic kernels, unchanged."""
    B, M, V = logits.shape
    device = logits.device
    x = logits if logits.is_contiguous() else logits.contiguous()
    fs = frontier_scores.contiguous()
    is_fp64 = logits.dtype == torch.float64
    compute = torch.float64 if is_fp64 else torch.float32
    sampled = temperature is not None
    sms = gpu_sms(device)
    block_v = _block_v(B * M, V, top_k, config, sampled, sms)
    NC = triton.cdiv(V, block_v)
    if NC * top_k > _MAX_CANDIDATES:
        raise ValueError(f"top_k: expected ceil(V / {block_v}) * top_k <= {_MAX_CANDIDATES} on the "
                         f"triton path, got top_k = {top_k} with V = {V}")
    tokens = torch.empty(B, M * top_k, dtype=torch.int64, device=device)
    scores = torch.empty(B, M * top_k, dtype=torch.float32, device=device)
    logprobs = torch.empty(B, M * top_k, dtype=torch.float32, device=device)
    frontier = torch.empty(B, top_k, dtype=torch.int32, device=device)
    if B == 0:
        return DraftCandidates(tokens, scores, frontier, logprobs)
    if sampled:
        temperature = temperature.contiguous()
        seed = torch.zeros(B, dtype=torch.int64, device=device) if seed is None else seed.contiguous()
        offset = torch.zeros(B, dtype=torch.int64, device=device) if offset is None else offset.contiguous()
    else:
        temperature = seed = offset = fs  # placeholder pointers, never read
    draw_base = DRAFT_DRAW + depth * DEPTH_STRIDE
    R = B * M
    part_max = torch.empty(R, NC, dtype=compute, device=device)
    part_sum = torch.empty(R, NC, dtype=compute, device=device)
    part_bad = torch.empty(R, NC, dtype=torch.int32, device=device)
    part_val = torch.empty(R, NC, top_k, dtype=compute, device=device)
    part_id = torch.empty(R, NC, top_k, dtype=torch.int32, device=device)
    shape = chunk_shape(block_v, top_k)
    if survivors is None:
        survivors = torch.empty(R, NC, max(shape.cap, 1), dtype=torch.int32, device=device)
    merge_val = torch.empty(R, max(shape.cap, 1), dtype=compute, device=device)
    merge_id = merge_survivors
    if merge_id is None:
        merge_id = torch.empty(R, max(shape.cap, 1), dtype=torch.int32, device=device)
    d2t_arg = d2t.contiguous() if d2t is not None else tokens  # placeholder pointer, never read
    block_m = triton.next_power_of_2(M)
    block_c = triton.next_power_of_2(NC)
    block_ck = triton.next_power_of_2(NC * top_k)
    block_mk = triton.next_power_of_2(M * top_k)
    # Rows the merge's plain rounds take together: their candidate keys stay in registers.
    rounds_m = max(1, min(block_m, config.merge_lanes // block_ck))
    filter_merge = merge_filters(shape, M, NC, top_k, sampled)
    lanes = 64 * shape.threads
    vec = chunk_vector(block_v, shape, x.element_size())
    # bf16 in 4-byte words where every row starts on a word: V even, the tensor 4-byte aligned.
    words = x.dtype == torch.bfloat16 and vec >= 2 and V % 2 == 0 and x.data_ptr() % 4 == 0
    _draft_expand_kernel[(NC, M, B)](
        x, part_max, part_sum, part_bad, part_val, part_id, survivors, tickets(device, B), merge_val, merge_id, fs,
        d2t_arg, temperature, seed, offset, tokens, scores, logprobs, frontier, draw_base, M, V, NC,
        TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_V=block_v, SUPER=shape.n_super, CAP=shape.cap,
        THREADS=shape.threads, VEC=vec, BF16_WORDS=words, BLOCK_M=rounds_m, BLOCK_MA=block_m, BLOCK_C=block_c,
        BLOCK_CK=block_ck,
        BLOCK_MK=block_mk, FILTER_MERGE=filter_merge, LEAD=merge_lead(NC, top_k),
        PAIRWISE_FRONTIER=block_mk * block_mk <= lanes,
        HAS_D2T=d2t is not None, IS_FP64=is_fp64, SAMPLED=sampled, **launch_options(device), num_warps=shape.warps,
        **_register_cap(shape),
    )
    return DraftCandidates(tokens, scores, frontier, logprobs)


def draft_expand(logits, frontier_scores, top_k, *, d2t=None, temperature=None, seed=None, offset=None, depth=0,
                 _config: DraftExpandConfig | None = None) -> DraftCandidates:
    """Triton path of :func:`eagle_kernels.draft_expand` (contract §2); see
    :func:`eagle_kernels.reference.draft_expand` for semantics. ``_config`` overrides
    :func:`launch_config` (tests run the GPU configuration interpreted).

    Shapes
    ------
    logits [B, M, Vd] (fp32, fp16, bf16; fp64 computes in fp64); frontier_scores float32
    [B, M]; d2t int64 [Vd]; temperature float32 [B] (> 0: that request's children are sampled);
    seed, offset int64 [B]; depth: int -> DraftCandidates(tokens int64 [B, M * top_k], scores
    float32 [B, M * top_k], frontier int32 [B, top_k], logprobs float32 [B, M * top_k]).
    """
    _checks.check_draft_expand(logits, frontier_scores, top_k, d2t=d2t, temperature=temperature, seed=seed,
                               offset=offset, depth=depth)
    return _launch(logits, frontier_scores, top_k, d2t, _config or launch_config(), temperature=temperature,
                   seed=seed, offset=offset, depth=depth)
