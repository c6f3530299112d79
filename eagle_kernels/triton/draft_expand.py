"""Triton ``draft_expand``: one depth of EAGLE-2 dynamic tree expansion (Li et al. 2024, §4.1)
in two launches, with no sort.

1. ``_draft_chunk_kernel``, grid ``(B * M, NC)``: chunk ``j`` of row ``(b, m)`` (``BLOCK_V``
   entries, read as contiguous groups of ``GROUP`` ids) gives its max, its sum of
   ``exp(x - max)``, a bad flag (NaN or +inf seen) and its local top ``TOP_K``: ``TOP_K``
   rounds of argmax over the group maxima choose the ``TOP_K`` best groups, which hold the
   chunk's top ``TOP_K`` (see the kernel), then ``TOP_K`` rounds of masked argmax over those
   groups' entries (ties: smaller id).
2. ``_draft_merge_kernel``, grid ``(B,)``: merges the ``NC`` partials of several rows at once
   into ``lse = max + log(sum)`` and each row's top ``TOP_K`` (the best ``TOP_K`` of its
   ``NC * TOP_K`` chunk candidates; one argmax round serves all rows of a block), writes
   tokens and scores (``frontier_score + (x - max) - log(sum)``), then selects the frontier
   among the ``M * TOP_K`` scores (NaN as -inf, ties by smaller index).

Each argmax round is one int64 max over packed (value, id) keys (``_pack_key``) for
fp32/fp16/bf16 input; fp64 input keeps a max over values and a min over ids and no pre-filter.
Before the group pre-filter, the rounds over whole 4096-entry chunks bounded kernel 1 and the
merge ran ``M * TOP_K`` rounds in sequence: on an H200, B = 32, M = 8, V = 128256 bf16 logits
took about 330-380 us per call and B = 1 about 150 us (top_k 8-10, bench/bench_draft_expand.py),
far below the memory bandwidth. Now a GPU chunk's rounds run over its 256 group maxima and then
over ``16 * TOP_K`` entries instead of 4096, and the merge runs ``2 * TOP_K`` rounds in sequence
(one block of rows while ``M * next_pow2(NC * TOP_K) <= 4096``: M = 8 at V = 128256, top_k 10).

Rows ranking logits by value is the log-prob order (one ``lse`` per row). A row with NaN or
+inf, or no entry above -inf, has all log-probs NaN (as torch.log_softmax gives): its
candidates are ids ``0..TOP_K-1`` with NaN scores, like the reference.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import _checks
from .._types import DraftCandidates
from ._launch_config import interpreted


@dataclasses.dataclass(frozen=True)
class DraftExpandConfig:
    """Tuning constants of the draft_expand launch; the outputs do not depend on them.

    block_v: entries of a row per chunk program (capped at next_pow2(V)); it also sets the
        group size of the chunk pre-filter (``_group_size``).
    merge_lanes: candidate keys of the frontier rows one merge round reduces together.
    """

    block_v: int
    merge_lanes: int = 4096


# Large chunks on the GPU (fewer partials to merge); small ones in the interpreter so that
# V = 1031 in the tests already takes the multi-chunk merge (test_triton_many_chunks in
# python_tests/ops/test_draft_expand_backends.py drives smaller chunks through _launch).
GPU_CONFIG = DraftExpandConfig(block_v=4096)
INTERPRETER_CONFIG = DraftExpandConfig(block_v=1024)
_MAX_CANDIDATES = 1 << 16  # NC * top_k candidates per row held by one merge program
_BIG_ID = tl.constexpr(2**31 - 1)  # above every id; jit code reads only constexpr globals
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
def _draft_chunk_kernel(
    logits_ptr,  # [B * M, V] fp32 / fp16 / bf16 / fp64, row-contiguous
    part_max_ptr,  # [B * M, NC] compute dtype
    part_sum_ptr,  # [B * M, NC] compute dtype
    part_bad_ptr,  # [B * M, NC] int32
    part_val_ptr,  # [B * M, NC, TOP_K] compute dtype
    part_id_ptr,  # [B * M, NC, TOP_K] int32
    V,
    NC,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two of TOP_K
    BLOCK_V: tl.constexpr,
    GROUP: tl.constexpr,  # entries per group of the pre-filter; 0: no pre-filter
    IS_FP64: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    base = chunk * BLOCK_V
    out = row * NC + chunk
    if GROUP > 0:
        # The chunk as [GROUPS, GROUP] contiguous groups of ids, one load of the logits.
        GROUPS: tl.constexpr = BLOCK_V // GROUP
        group_ids = tl.arange(0, GROUPS)
        offs = base + group_ids[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    else:
        offs = base + tl.arange(0, BLOCK_V)
    in_row = offs < V
    x = tl.load(logits_ptr + row * V + offs, mask=in_row, other=float("-inf"))
    x = x.to(tl.float64) if IS_FP64 else x.to(tl.float32)
    is_nan = x != x
    # Ranking value: NaN only occurs in bad rows, whose ranking is not used.
    xr = tl.where(is_nan, float("-inf"), x)
    if GROUP > 0:
        bad = tl.max(tl.max(is_nan.to(tl.int32), axis=1), axis=0)
        group_max = tl.max(xr, axis=1)  # [GROUPS]
        cmax = tl.max(group_max, axis=0)
    else:
        bad = tl.max(is_nan.to(tl.int32), axis=0)
        cmax = tl.max(xr, axis=0)
    bad = bad | (cmax == float("inf")).to(tl.int32)
    # -inf entries count 0; shifting by 0 when the chunk is all -inf avoids -inf - (-inf).
    shift = tl.where(cmax == float("-inf"), 0.0, cmax)
    e = tl.where(xr == float("-inf"), 0.0, tl.exp(xr - shift))
    if GROUP > 0:
        csum = tl.sum(tl.sum(e, axis=1), axis=0)
    else:
        csum = tl.sum(e, axis=0)
    tl.store(part_max_ptr + out, cmax)
    tl.store(part_sum_ptr + out, csum)
    tl.store(part_bad_ptr + out, bad)
    # Local top-k: TOP_K rounds of argmax over the entries not taken yet (ties: smaller id).
    # -inf entries are real candidates (ranked by id); the masked tail never is.
    # A chunk with fewer than TOP_K entries stores -inf with ids above every real one, so the
    # merge ranks them last.
    if IS_FP64:
        alive = in_row
        for r in range(TOP_K):
            best = tl.max(tl.where(alive, xr, float("-inf")), axis=0)
            pick = tl.min(tl.where(alive & (xr == best), offs, _BIG_ID), axis=0)
            tl.store(part_val_ptr + out * TOP_K + r, best)
            tl.store(part_id_ptr + out * TOP_K + r, tl.where(pick == _BIG_ID, _BIG_ID - TOP_K + r, pick))
            alive = alive & (offs != pick)
    else:
        if GROUP > 0:
            # Pre-filter: the chunk's top TOP_K lie in the TOP_K best groups by (group max desc,
            # group index asc). An entry of any other group is beaten by the best entry of each
            # chosen group: a larger value, or an equal one at a smaller id (groups are
            # ascending id ranges). So the rounds run over TOP_K * GROUP entries, re-read from
            # the cache, instead of BLOCK_V.
            group_keys = tl.where(base + group_ids * GROUP < V, _pack_key(group_max, group_ids), _KEY_MIN)
            lanes = tl.arange(0, BLOCK_K)
            chosen = tl.full([BLOCK_K], -1, tl.int32)  # group of each lane; -1: none left
            for r in range(TOP_K):
                gmax = tl.max(group_keys, axis=0)
                _, group = _unpack_key(gmax)
                chosen = tl.where((lanes == r) & (gmax != _KEY_MIN), group, chosen)
                group_keys = tl.where(group_keys == gmax, _KEY_MIN, group_keys)
            offs = base + chosen[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_K, GROUP]
            in_row = (chosen[:, None] >= 0) & (offs < V)
            xr = tl.load(logits_ptr + row * V + offs, mask=in_row, other=float("-inf")).to(tl.float32)
            xr = tl.where(xr != xr, float("-inf"), xr)
        keys = tl.where(in_row, _pack_key(xr, offs), _KEY_MIN)
        for r in range(TOP_K):
            if GROUP > 0:
                kmax = tl.max(tl.max(keys, axis=1), axis=0)
            else:
                kmax = tl.max(keys, axis=0)
            best, pick = _unpack_key(kmax)
            exhausted = kmax == _KEY_MIN
            tl.store(part_val_ptr + out * TOP_K + r, tl.where(exhausted, float("-inf"), best))
            tl.store(part_id_ptr + out * TOP_K + r, tl.where(exhausted, _BIG_ID - TOP_K + r, pick))
            keys = tl.where(keys == kmax, _KEY_MIN, keys)


@triton.jit
def _draft_merge_kernel(
    part_max_ptr,  # [B * M, NC] compute dtype
    part_sum_ptr,  # [B * M, NC] compute dtype
    part_bad_ptr,  # [B * M, NC] int32
    part_val_ptr,  # [B * M, NC, TOP_K] compute dtype
    part_id_ptr,  # [B * M, NC, TOP_K] int32
    frontier_scores_ptr,  # [B, M] float32
    d2t_ptr,  # [V] int64 (unused unless HAS_D2T)
    tokens_ptr,  # [B, M * TOP_K] int64
    scores_ptr,  # [B, M * TOP_K] float32
    frontier_ptr,  # [B, TOP_K] int32
    M,
    NC,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,  # frontier rows merged together
    BLOCK_C: tl.constexpr,
    BLOCK_CK: tl.constexpr,
    BLOCK_MK: tl.constexpr,
    HAS_D2T: tl.constexpr,
    IS_FP64: tl.constexpr,
):
    """Per request: BLOCK_M rows at a time, each round takes every row's next best candidate
    (TOP_K rounds per block of rows, not per row), then the frontier over the stored scores."""
    b = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    offs_ck = tl.arange(0, BLOCK_CK)
    MK = M * TOP_K
    n_cand = NC * TOP_K
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        row_ok = m < M
        row = b * M + m  # [BLOCK_M]
        part = row_ok[:, None] & (offs_c < NC)[None, :]
        at = row[:, None] * NC + offs_c[None, :]
        pm = tl.load(part_max_ptr + at, mask=part, other=float("-inf"))
        ps = tl.load(part_sum_ptr + at, mask=part, other=0.0)
        pb = tl.load(part_bad_ptr + at, mask=part, other=0)
        gmax = tl.max(pm, axis=1)
        shift = tl.where(gmax == float("-inf"), 0.0, gmax)
        total = tl.sum(tl.where(pm == float("-inf"), 0.0, ps * tl.exp(pm - shift[:, None])), axis=1)
        bad = (tl.max(pb, axis=1) != 0) | (gmax == float("-inf")) | (gmax == float("inf"))
        log_sum = tl.log(tl.where(bad, 1.0, total))
        fs = tl.load(frontier_scores_ptr + row, mask=row_ok, other=0.0)
        fs = fs.to(tl.float64) if IS_FP64 else fs
        cand = row_ok[:, None] & (offs_ck < n_cand)[None, :]
        at = row[:, None] * n_cand + offs_ck[None, :]
        vals = tl.load(part_val_ptr + at, mask=cand, other=float("-inf"))
        ids = tl.load(part_id_ptr + at, mask=cand, other=_BIG_ID)
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
            token = tl.where(bad, r, pick).to(tl.int64)
            logp = (best - gmax) - log_sum
            score = tl.where(bad, float("nan"), fs + logp).to(tl.float32)
            if HAS_D2T:
                token = token + tl.load(d2t_ptr + token, mask=row_ok, other=0)
            c = m * TOP_K + r
            tl.store(tokens_ptr + b * MK + c, token, mask=row_ok)
            tl.store(scores_ptr + b * MK + c, score, mask=row_ok)
    # The scores just stored by other threads of this program are read back below.
    tl.debug_barrier()
    # Frontier: TOP_K rounds of argmax over the candidates, NaN ranked as -inf, ties by index.
    offs_mk = tl.arange(0, BLOCK_MK)
    acc = tl.load(scores_ptr + b * MK + offs_mk, mask=offs_mk < MK, other=float("-inf"))
    keys_mk = tl.where(offs_mk < MK, _pack_key(tl.where(acc != acc, float("-inf"), acc), offs_mk), _KEY_MIN)
    for r in range(TOP_K):
        kmax = tl.max(keys_mk, axis=0)
        _, pick = _unpack_key(kmax)
        tl.store(frontier_ptr + b * TOP_K + r, pick)
        keys_mk = tl.where(keys_mk == kmax, _KEY_MIN, keys_mk)


def _group_size(block_v: int, top_k: int, is_fp64: bool) -> int:
    """Entries per group of the chunk pre-filter, 0 for none. A round costs about
    (groups + top_k * group) lanes, least near group = sqrt(block_v / top_k): 16 for the GPU's
    4096-entry chunks; smaller so that a chunk has at least twice top_k groups. Chunks with
    fewer groups than that, and fp64 logits, take the plain rounds."""
    group = min(16, block_v // (2 * triton.next_power_of_2(top_k)))  # a power of two, or 0
    return 0 if is_fp64 or group < 1 else group


def launch_config() -> DraftExpandConfig:
    """The configuration a launch uses unless given one: the GPU's, or the interpreter's when
    the kernels run interpreted (TRITON_INTERPRET=1 when Triton defined them)."""
    return INTERPRETER_CONFIG if interpreted(_draft_chunk_kernel) else GPU_CONFIG


def _launch(logits, frontier_scores, top_k, d2t, config: DraftExpandConfig) -> DraftCandidates:
    B, M, V = logits.shape
    device = logits.device
    x = logits if logits.is_contiguous() else logits.contiguous()
    fs = frontier_scores.contiguous()
    is_fp64 = logits.dtype == torch.float64
    compute = torch.float64 if is_fp64 else torch.float32
    block_v = min(config.block_v, triton.next_power_of_2(V))
    NC = triton.cdiv(V, block_v)
    if NC * top_k > _MAX_CANDIDATES:
        raise ValueError(f"top_k: expected ceil(V / {block_v}) * top_k <= {_MAX_CANDIDATES} on the "
                         f"triton path, got top_k = {top_k} with V = {V}")
    tokens = torch.empty(B, M * top_k, dtype=torch.int64, device=device)
    scores = torch.empty(B, M * top_k, dtype=torch.float32, device=device)
    frontier = torch.empty(B, top_k, dtype=torch.int32, device=device)
    if B == 0:
        return DraftCandidates(tokens, scores, frontier)
    R = B * M
    part_max = torch.empty(R, NC, dtype=compute, device=device)
    part_sum = torch.empty(R, NC, dtype=compute, device=device)
    part_bad = torch.empty(R, NC, dtype=torch.int32, device=device)
    part_val = torch.empty(R, NC, top_k, dtype=compute, device=device)
    part_id = torch.empty(R, NC, top_k, dtype=torch.int32, device=device)
    _draft_chunk_kernel[(R, NC)](
        x, part_max, part_sum, part_bad, part_val, part_id, V, NC,
        TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_V=block_v,
        GROUP=_group_size(block_v, top_k, is_fp64), IS_FP64=is_fp64,
        num_warps=4 if block_v <= 2048 else 8,
    )
    d2t_arg = d2t.contiguous() if d2t is not None else tokens  # placeholder pointer, never read
    block_ck = triton.next_power_of_2(NC * top_k)
    _draft_merge_kernel[(B,)](
        part_max, part_sum, part_bad, part_val, part_id, fs, d2t_arg, tokens, scores, frontier,
        M, NC, TOP_K=top_k,
        # Rows merged together: their candidate keys (BLOCK_M * BLOCK_CK int64) stay in registers.
        BLOCK_M=max(1, min(triton.next_power_of_2(M), config.merge_lanes // block_ck)),
        BLOCK_C=triton.next_power_of_2(NC), BLOCK_CK=block_ck,
        BLOCK_MK=triton.next_power_of_2(M * top_k), HAS_D2T=d2t is not None, IS_FP64=is_fp64,
        num_warps=4 if block_ck * triton.next_power_of_2(M) <= 2048 else 8,
    )
    return DraftCandidates(tokens, scores, frontier)


def draft_expand(logits, frontier_scores, top_k, *, d2t=None,
                 _config: DraftExpandConfig | None = None) -> DraftCandidates:
    """Triton path of :func:`eagle_kernels.draft_expand` (contract §2); see
    :func:`eagle_kernels.reference.draft_expand` for semantics. ``_config`` overrides
    :func:`launch_config` (tests run the GPU configuration interpreted).

    Shapes
    ------
    logits [B, M, Vd] (fp32, fp16, bf16; fp64 computes in fp64); frontier_scores float32
    [B, M]; d2t int64 [Vd] -> DraftCandidates(tokens int64 [B, M * top_k], scores float32
    [B, M * top_k], frontier int32 [B, top_k]).
    """
    _checks.check_draft_expand(logits, frontier_scores, top_k, d2t=d2t)
    return _launch(logits, frontier_scores, top_k, d2t, _config or launch_config())
