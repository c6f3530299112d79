"""Triton ``verify``: greedy and lossless sampling verification of a draft tree, from logits.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) on trees with deterministic
draft children (EAGLE-2, Li et al. 2024, §4); semantics and random stream as in
``eagle_kernels/reference/verify.py`` and docs/design.md ("Counter-based random stream",
"verify details"). Measurements and the design's numbers: docs/gpu_kernels.md ("verify").

Walk first, in one launch (``_verify_kernel``, verify_walk.py): only the rows the walk visits
are read (at most max_depth + 1 per request, of the B * N given). Programs (b, j), j < SPLITS,
serve request b together: the walk is a sequence of phases, each one pass over the current
row split into SPLITS chunks; a program claims chunks of the open phase (an atomic counter),
and the program that completes a phase's last chunk merges the chunks' results, walks on and
opens the next phase. A program that finds every chunk taken waits for the next phase, which
depends only on programs already running, so the launch needs no co-residency; under the
interpreter (programs run one after another) the first program of a request runs every phase.

Greedy calls (no ``temperature``, no draft rows, no ``positions``) whose rows hold at most
``VerifyConfig.greedy_max_bytes`` of logits take ``_verify_greedy_kernel`` instead
(verify_greedy.py): every row's argmax at once, then the walk in the request's last program;
one read of all ``B * N`` rows rather than a phase per visited row. Calls with a temperature and
no draft rows or ``positions`` take ``_verify_temperature_kernel`` (verify_temperature.py)
likewise, up to ``VerifyConfig.temperature_max_bytes``: every row's max and softmax sum at once
(the argmax for requests at temperature 0), then the walk and the bonus draw in the request's last
program. With ``top_k`` / ``top_p`` tensors it also serves the sampling requests whose top-k is at
most ``VerifyConfig.list_topk`` (top-p or not) from candidate lists each chunk writes
(verify_topk.py), with ``list_topp`` top-p requests without top-k too when their nucleus ends inside
such a list, and leaves the other filtering requests, and any whose lists overflowed, to this
walk, launched after it (``SKIP_ROWS``: its ``pending`` flags) into the same outputs.

Per visited row:

- max phase: max, first argmax, NaN / +inf / finite flags. A greedy row needs nothing else:
  greedy mode is one pass over each visited row.
- sampling rows, levels phase: the softmax sum and the entries (and their exp(s)) at or above
  16 levels of ``s = (logits - max) / T``.
- then, with top-k or top-p, the list phase: the entries at or above the highest level that
  holds the top-k set or the nucleus in ``candidates`` slots are stored (ascending ids, each
  chunk at the offset its level counts give), and the merge takes the thresholds, normalisers
  and mass from that list sorted in registers. For top-p alone the list reaches one level
  lower than the nucleus needs, so the cut always clears the listed level by the margin the
  exactness check needs (rows whose nucleus ended just above a level used to fall back to a
  whole-row search). Temperature alone: the mass phase (float64 sum of the weights and
  per-tile sums for the bonus draw).
- rows no list can hold exactly (a flat distribution with top-k in the thousands or a nucleus
  of thousands of tokens) search their thresholds in more phases: radix-16 digits over the
  order keys of the logits (16/19 key bits for bf16/fp16 rows: 4/5 digits per threshold), each
  one pass over the chunks; the last digit also sums each candidate's normaliser, the first
  digits come from the level band holding the threshold when it is certain, and top-k + top-p
  lists the top-k set after the top-k search when it fits.

One launch per call: the scratch of a launch shape is kept (``_workspace``), and the kernel's
last program of each request leaves the request's control words zero for the next call.

Every weight is a pure function of its logit and the row's scalars::

    p(x) = [s(x) >= kth] * exp(s(x)) / denom,    w(x) = [p(x) >= cut] * p(x) / norm

and both filters are "keep x iff key >= threshold", which keeps ties together exactly as the
reference does. The merge of a row's last phase evaluates ``w`` only at the drafted tokens
(acceptance, removing a rejected token's weight from the float64 mass) and draws the bonus
(inverse CDF, a float64 running sum in token order) over the candidate list, or from the
per-tile sums and one scanned tile. Philox4x32-10 runs in-kernel on uint32 words. Logits are
read in their own dtype (fp16 / bf16 / fp32 / fp64; no copy) and computed in float32 (float64
for fp64 logits).

Sampled drafts (``draft_probs`` given: the ``HAS_DRAFT`` specialisation; calls without it compile
the kernel as before): at a node of a sampling row with sampled children the draft-aware rule
runs as more phases over the chunks, so the request's programs share its passes as they share
the row's own: a draft phase (the draft row's validity and float64 sum, over chunks of the draft
row), then the children in node order against the residual in the merge, a residual phase (the
new float64 mass) after each rejected sampled child, and the bonus from the final residual by
inverse CDF: from the last residual phase's chunk sums when nothing changed since, else after a
phase of its own, the merge scanning the one chunk that holds the draw. The residual weight of
any token is its first weight with the node's recorded rejections applied in order, as the
reference computes it. With ``d2t`` the launcher builds the inverse map (target id -> draft id)
and the range flag on the device.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import torch
import triton

from .. import _checks
from .._types import VerifyOutput
from ._launch_config import gpu_sms, interpreted, tickets
from ._pdl import launch_options
from .verify_greedy import _verify_greedy_kernel
from .verify_rows import (  # noqa: F401  (STAT_* name the stats slots for tests)
    NUM_PIVOTS,
    NUM_STATS,
    SEARCH_BLOCK,
    SIGNIFICANT_KEY_BITS,
    STAT_CUT,
    STAT_DENOM,
    STAT_KTH,
    STAT_MASS,
    STAT_MAX,
    STAT_NORM,
)
from .verify_temperature import _verify_temperature_kernel
from .verify_walk import CTL_WORDS, EVENT_WORDS, ROW_WORDS, _verify_kernel

# Chunks per row at most (programs per request).
MAX_SPLITS = 64
# Candidate lists of at most this many entries are sorted in a block of this size.
SHORT_LIST = 128


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """Tuning constants of the verify launch; the outputs do not depend on them.

    radix_bits: bits per digit of the threshold searches (2^radix_bits candidates per pass).
    candidates: candidate list capacity (a power of two), or 0 to search every sampling row
        in full.
    max_block: tile of the max pass (capped at next_pow2(V)); on a GPU a launch with few chunks
        per row takes a smaller one (``_chunking``).
    block_v: tile of the list, mass and bonus passes (capped at next_pow2(V)).
    num_warps: warps of the one program per request.
    greedy_block: tile of the all-rows pass of greedy calls (verify_greedy.py; capped at
        next_pow2(V)).
    greedy_max_bytes: greedy calls (``temperature`` None) whose ``B * N`` rows hold at most this
        many bytes of logits read every row at once (verify_greedy.py) instead of walking them
        one visited row after another; 0 never does.
    temperature_block: tile of the all-rows pass of calls with a temperature
        (verify_temperature.py), in entries of 16-bit logits (the same bytes for wider ones;
        capped at next_pow2(V)).
    temperature_max_bytes: greedy_max_bytes for calls with a temperature and no draft rows or
        ``positions``.
    list_topk: in those calls, sampling requests with top_k in (0, list_topk] (top-p or not) are
        listed by the all-rows kernel (verify_topk.py) rather than left to the walk; 0 never are.
        At most ``min(128, candidates // 2)``, the slots of a visited row's entries at or above kth.
    list_topp: top-p requests without top-k are listed too, by their ``list_topk`` largest entries
        (with each chunk's softmax sum): served when every visited row's nucleus ends inside its
        list, else left to the walk after a wasted pass. Off on the GPU by default: modeled, it
        saves a sixth where nuclei are tiny and nearly doubles the time where they are large
        (docs/gpu_kernels.md, "Top-p alone"); for engines whose traffic is mostly confident.
    list_min_batch: only in calls of at least this many requests.
    list_sub, list_cap, list_batch: a top-k chunk's sub-blocks (entries, at most; fewer where a
        chunk would have fewer than 2 list_topk of them, or the row's last chunk fewer than
        list_topk), list slots, and sub-blocks a step of its list pass.
    """

    radix_bits: int
    candidates: int
    max_block: int
    block_v: int = 1024
    num_warps: int = 4
    greedy_block: int = 2048
    greedy_max_bytes: int = 0
    temperature_block: int = 8192
    temperature_max_bytes: int = 0
    list_topk: int = 0
    list_topp: bool = False
    list_min_batch: int = 1
    list_sub: int = 128
    list_cap: int = 128
    list_batch: int = 8


# On the GPU: 16 candidates per search pass (the [BLOCK_S, 16] comparison stays in
# registers), lists of 1024 entries, 4096-entry tiles for the max pass (16 bf16 loads in
# flight per thread at 8 warps).
GPU_CONFIG = VerifyConfig(radix_bits=4, candidates=1024, max_block=4096, block_v=1024, num_warps=8,
                          greedy_block=2048, greedy_max_bytes=256 << 20,
                          temperature_max_bytes=512 << 20, list_topk=64, list_min_batch=4)
# The interpreter's cost is per operation rather than per element: 256 candidates per pass
# halve the passes; short lists and tiles let the tests' small V reach the candidate lists
# and the multi-tile bonus draw.
INTERPRETER_CONFIG = VerifyConfig(radix_bits=8, candidates=32, max_block=64, block_v=64, num_warps=4,
                                  greedy_block=64, greedy_max_bytes=1 << 40, temperature_block=64,
                                  temperature_max_bytes=1 << 40, list_topk=4, list_topp=True, list_sub=8, list_cap=16,
                                  list_batch=4)


def launch_config() -> VerifyConfig:
    """The configuration a launch uses unless given one: the GPU's, or the interpreter's when
    the kernels run interpreted (TRITON_INTERPRET=1 when Triton defined them)."""
    return INTERPRETER_CONFIG if interpreted(_verify_kernel) else GPU_CONFIG


def _splits(B: int, V: int, unit: int, sms: int | None) -> tuple[int, int]:
    """(chunks per row, entries per chunk): on a GPU of ``sms`` SMs enough programs for about
    two per SM whatever the batch, in whole tiles of ``unit`` entries; without one (``sms`` None:
    the interpreter), up to 4 chunks so that the merges are exercised."""
    tiles = triton.cdiv(V, unit)
    want = 4 if sms is None else triton.cdiv(2 * sms, B)
    splits = max(1, min(tiles, want, MAX_SPLITS))
    chunk = triton.cdiv(tiles, splits) * unit
    return triton.cdiv(V, chunk), chunk


def _chunking(B: int, V: int, config: VerifyConfig, sms: int | None) -> tuple[int, int, int]:
    """(tile of the max pass, chunks per row, entries per chunk). On a GPU the max pass takes
    ``config.max_block`` entries a tile unless tiles of ``block_v`` cut a row into more than 1.5
    times as many chunks: every phase of the walk waits for its slowest chunk, and at batch 1
    4096-entry tiles cut SmolLM2's 49,152-entry rows into 12 chunks (12 busy SMs) where
    1024-entry tiles give 48 (docs/gpu_model.md, "verify: a request's programs in parallel").
    From a batch of 8 at 128,256 entries the 4096-entry tile already gives the chunks wanted.
    (2048-entry tiles at 63 chunks spill in loops in the sm_90 compile under Triton 3.9, 1024-entry
    ones do not; under 3.6 both B 1 launches of the compile audit spill 28-32 B in loops, as 3.6
    does elsewhere: docs/gpu_kernels.md, "Small tiles at batch 1".) Without a GPU,
    ``config.max_block`` (capped at next_pow2(V))."""
    block_v = min(config.block_v, triton.next_power_of_2(V))
    block = min(config.max_block, triton.next_power_of_2(V))
    wide = (block, *_splits(B, V, max(block_v, block), sms))
    if sms is None or block <= block_v:
        return wide
    narrow = (block_v, *_splits(B, V, block_v, sms))
    return narrow if 2 * narrow[1] > 3 * wide[1] else wide


class Launch(NamedTuple):
    output: VerifyOutput
    cand_count: torch.Tensor  # [B, N] int32: -2 row not visited / greedy, -1 no list, else list length (record)
    stats: torch.Tensor  # [B, N, NUM_STATS] float64 (visited sampling rows only; NaN elsewhere) (record)


def verify(tokens, parents, target_logits, *, max_depth, temperature=None, top_k=None, top_p=None,
           seed=None, offset=None, draft_probs=None, draft_sampled=None, d2t=None, positions=None,
           _config: VerifyConfig | None = None) -> VerifyOutput:
    """Triton launcher with the contract signature (shapes as ``eagle_kernels.reference.verify``).
    ``_config`` overrides :func:`launch_config` (tests run the GPU configuration interpreted).

    Shapes
    ------
    tokens int64 [B, N], parents int32 [B, N], target_logits [B, N, V] float32 / float16 /
    bfloat16 / float64 (16-bit logits are read as they are, no copy); optional float32 /
    int32 / float32 / int64 / int64 [B] temperature, top_k, top_p, seed, offset; for sampled
    drafts draft_probs float32 [B, N, Vd], draft_sampled bool [B, N], d2t int64 [Vd].
    Returns VerifyOutput(accept_len [B], accept_nodes [B, max_depth + 1],
    out_tokens [B, max_depth + 1], status [B]). ``positions`` int64 [B] (coupled sampling): the
    sampling requests' tokens are the exponential race's, in the same launch.
    """
    _checks.check_verify(tokens, parents, target_logits, max_depth=max_depth, temperature=temperature,
                         top_k=top_k, top_p=top_p, seed=seed, offset=offset, draft_probs=draft_probs,
                         draft_sampled=draft_sampled, d2t=d2t, positions=positions)
    config = _config or launch_config()
    if draft_probs is None and positions is None and _reads_every_row(target_logits, config, temperature is not None):
        pending = _pending(target_logits, temperature, top_k, top_p)
        rows = _launch_rows(tokens, parents, target_logits, max_depth, config, temperature, seed, offset, top_k, top_p,
                            pending=pending)
        if pending is None:
            return rows
        # Filter tensors: their values are on the device, so the walk runs after the all-rows kernel for
        # the requests it left pending (the others' programs exit at once), into the same outputs.
        return _launch(tokens, parents, target_logits, max_depth, temperature, top_k, top_p, seed, offset, config,
                       record=False, outputs=rows, pending=pending).output
    return _launch(tokens, parents, target_logits, max_depth, temperature, top_k, top_p, seed, offset, config,
                   draft_probs=draft_probs, draft_sampled=draft_sampled, d2t=d2t, positions=positions,
                   record=False).output


# The all-rows greedy pass: at most this many rows a request (its merge holds [N, C] partials in
# registers) and chunks a row.
MAX_GREEDY_ROWS = 256
MAX_GREEDY_CHUNKS = 16


def _pending(target_logits, temperature, top_k, top_p) -> torch.Tensor | None:
    """The all-rows kernel's int32 [B] flags of the requests it leaves to the walk's launch after it
    (written for every request), where one follows: calls with a temperature and filter tensors."""
    if temperature is None or (top_k is None and top_p is None):
        return None
    return torch.empty(target_logits.shape[0], dtype=torch.int32, device=target_logits.device)


def _reads_every_row(target_logits, config: VerifyConfig, sampling: bool = False) -> bool:
    """Whether a call without draft rows or ``positions`` takes an all-rows pass (verify_greedy.py,
    or verify_temperature.py with ``sampling``: a temperature given) rather than the walk alone."""
    B, N, V = target_logits.shape
    limit = config.temperature_max_bytes if sampling else config.greedy_max_bytes
    return (config.greedy_block > 0 and N <= MAX_GREEDY_ROWS and B > 0
            and B * N * V * target_logits.element_size() <= limit)


def _greedy_chunking(B: int, N: int, V: int, block: int, sms: int | None) -> tuple[int, int]:
    """(chunks per row, entries per chunk, a whole number of tiles) of the all-rows greedy pass:
    on a GPU about four programs an SM over the launch's ``B * N`` rows, never fewer than one
    chunk a row; in the interpreter up to 3 chunks a row, so that the merge joins chunks."""
    tiles = triton.cdiv(V, block)
    want = 3 if sms is None else triton.cdiv(4 * sms, B * N)
    chunks = max(1, min(tiles, want, MAX_GREEDY_CHUNKS))
    chunk = triton.cdiv(tiles, chunks) * block
    return triton.cdiv(V, chunk), chunk


# The all-rows temperature pass: at most this many chunks a row.
MAX_TEMPERATURE_CHUNKS = 32


def _temperature_chunking(B: int, N: int, V: int, block: int, sms: int | None, per_sm: int = 3) -> tuple[int, int]:
    """(chunks per row, entries per chunk, a whole number of tiles) of the all-rows temperature
    pass: on a GPU one tile a program while the launch's ``B * N`` rows fit one wave of ``per_sm``
    programs an SM (registers allow three; two with the top-k lists compiled in), else two: a
    program's fixed work (its reductions, its ticket) is about a tile's, and the pass is bound by
    instruction issue. At most
    MAX_TEMPERATURE_CHUNKS chunks a row; in the interpreter one tile a chunk. Short chunks keep the
    bonus draw's scan short (it scans one chunk of the residual row); a tile of 8192 bf16 entries
    keeps four 16-byte loads a thread in flight (a program waits for each tile in turn: the
    compiler does not unroll that loop)."""
    tiles = triton.cdiv(V, block)
    per_chunk = 1 if sms is None or B * N * tiles <= per_sm * sms else 2
    chunks = min(triton.cdiv(tiles, per_chunk), MAX_TEMPERATURE_CHUNKS)
    chunk = triton.cdiv(tiles, chunks) * block
    return triton.cdiv(V, chunk), chunk


def _temperature_vec(block: int, element_size: int) -> int:
    """Consecutive entries of a lane of an all-rows temperature tile: 16 bytes, one load. The
    compiler keeps a 16-byte vector in one thread, so a lane's entries reduce without shuffles;
    a thread holds several lanes of a tile (four at 8192 bf16 entries and 8 warps)."""
    return min(block, max(1, 16 // element_size))


def _greedy_vec(block: int, num_warps: int) -> int:
    """Consecutive entries a thread takes of an all-rows greedy tile: the tile over the block's
    threads (8 bf16 entries, one 16-byte load, at 2048 entries and 8 warps), 4 to 16."""
    return min(block, 16, max(4, block // (32 * num_warps)))


def _launch_rows(tokens, parents, target_logits, max_depth, config: VerifyConfig, temperature=None, seed=None,
                 offset=None, top_k=None, top_p=None, outputs: VerifyOutput | None = None,
                 pending: torch.Tensor | None = None) -> VerifyOutput:
    """Launch ``_verify_greedy_kernel`` (``temperature`` None: every request greedy) or
    ``_verify_temperature_kernel`` (inputs already checked; no draft rows or positions). With
    ``top_k`` or ``top_p`` (and ``pending``, from ``_pending``) the sampling requests that filter are
    served when their top-k is listed (``config.list_topk``), else left out (their outputs unwritten,
    their ``pending`` flag 1): the walk's launch serves them. ``outputs``: write into these (tests)
    instead of new tensors."""
    B, N, V = target_logits.shape
    device = target_logits.device
    logits = target_logits if target_logits.stride(2) == 1 else target_logits.contiguous()
    A = max_depth + 1
    block = min(config.greedy_block, triton.next_power_of_2(V))
    if temperature is None:
        chunks, chunk = _greedy_chunking(B, N, V, block, gpu_sms(device))
    else:
        # 16-bit logits take temperature_block entries a tile, wider ones the same bytes.
        tile = min(config.temperature_block * 2 // target_logits.element_size(), triton.next_power_of_2(V))
        # The top-k lists' merge takes the kernel to two blocks an SM (docs/gpu_kernels.md).
        chunks, chunk = _temperature_chunking(B, N, V, max(block, tile), gpu_sms(device),
                                              2 if _lists_topk(B, top_k, top_p, config) else 3)
    compute_dtype = torch.float64 if target_logits.dtype == torch.float64 else torch.float32
    part_max = torch.empty((B, N, chunks), dtype=compute_dtype, device=device)
    part_arg = torch.empty((B, N, chunks), dtype=torch.int32, device=device)
    if outputs is None:
        outputs = VerifyOutput(torch.empty(B, dtype=torch.int32, device=device),
                               torch.empty((B, A), dtype=torch.int32, device=device),
                               torch.empty((B, A), dtype=torch.int64, device=device),
                               torch.empty(B, dtype=torch.int32, device=device))
    accept_len, accept_nodes, out_tokens, status = outputs
    shapes = dict(C=chunks, IS_FP64=target_logits.dtype == torch.float64, BLOCK_V=block,
                  VEC=_greedy_vec(block, config.num_warps))
    blocks = dict(BLOCK_N=triton.next_power_of_2(N), BLOCK_C=triton.next_power_of_2(chunks),
                  BLOCK_A=triton.next_power_of_2(A), **launch_options(device), num_warps=config.num_warps)
    if temperature is None:
        _verify_greedy_kernel[(chunks, N, B)](
            tokens.contiguous(), parents.contiguous(), logits, part_max, part_arg, tickets(device, B), accept_len,
            accept_nodes, out_tokens, status, N, V, max_depth, chunk, logits.stride(0), logits.stride(1), **shapes,
            **blocks,
        )
        return outputs
    zeros = None if seed is not None and offset is not None else torch.zeros(B, dtype=torch.int64, device=device)
    part_sum = torch.empty((B, N, chunks), dtype=compute_dtype, device=device)
    filters = top_k is not None or top_p is not None
    if filters and pending is None:
        raise ValueError("pending: calls with top_k / top_p tensors need the flags of the walk's launch (_pending)")
    k_arg = torch.zeros(B, dtype=torch.int32, device=device) if filters and top_k is None else top_k
    p_arg = torch.ones(B, dtype=torch.float32, device=device) if filters and top_p is None else top_p
    lists = _topk_lists(B, N, V, chunks, chunk, tile, compute_dtype, device, config) \
        if _lists_topk(B, top_k, top_p, config) else {}
    scratch = [lists.get(name, status) for name in ("sub_max", "list_thr", "list_count", "list_ids", "list_x",
                                                     "merged_ids", "merged_s")]
    _verify_temperature_kernel[(chunks, N, B)](
        tokens.contiguous(), parents.contiguous(), logits, temperature.contiguous(),
        k_arg.contiguous() if filters else status, p_arg.contiguous() if filters else status,
        zeros if seed is None else seed.contiguous(), zeros if offset is None else offset.contiguous(), part_max,
        part_arg, part_sum, *scratch, pending if filters else status, tickets(device, B), accept_len, accept_nodes,
        out_tokens, status, N, V, max_depth, chunk, logits.stride(0), logits.stride(1), **shapes, BLOCK_T=tile,
        VEC_T=_temperature_vec(tile, logits.element_size()), BLOCK_S=min(config.block_v, block), HAS_FILTERS=filters,
        **lists.get("constexprs", {}), **blocks,
    )
    return outputs


def _lists_topk(B: int, top_k, top_p, config: VerifyConfig) -> bool:
    """Whether the all-rows kernel lists the top-k requests of a call (verify_topk.py): a ``top_k``
    tensor (or a ``top_p`` one with ``config.list_topp``), lists in the configuration, and at least
    ``config.list_min_batch`` requests (each
    request's walk over its lists runs in one program, after every row's pass: with few requests
    that serial tail costs more than the walk kernel's phases; docs/gpu_kernels.md)."""
    filters = top_k is not None or (config.list_topp and top_p is not None)
    return filters and config.list_topk > 0 and config.candidates > 0 and B >= config.list_min_batch


def _topk_lists(B, N, V, chunks, chunk, tile, compute_dtype, device, config: VerifyConfig) -> dict:
    """Scratch and constexprs of the all-rows kernel's top-k lists (verify_topk.py)."""
    # At least 2 list_topk sub-blocks a chunk, and list_topk in the row's last (shortest) chunk, where the
    # tile allows: the k-th largest of many sub-block maxima is close to the chunk's k-th entry, so its
    # list holds little more than k entries; a chunk of fewer than k sub-blocks lists all its entries.
    last = V - (chunks - 1) * chunk
    fit = min(chunk // (2 * config.list_topk), last // config.list_topk)
    sub = min(config.list_sub, tile, max(8, 1 << max(fit, 1).bit_length() - 1))
    block_subs = triton.next_power_of_2(chunk // sub)
    cap, cand = config.list_cap, config.candidates
    # The entries at or above a visited row's kth: k of them but for ties, sorted for top-p's cut.
    top_cand = max(1, min(SHORT_LIST, cand // 2))

    def empty(*shape, dtype):
        return torch.empty(shape, dtype=dtype, device=device)

    return dict(sub_max=empty(B, N, chunks, block_subs, dtype=compute_dtype),
                list_thr=empty(B, N, chunks, dtype=compute_dtype), list_count=empty(B, N, chunks, dtype=torch.int32),
                list_ids=empty(B, N, chunks, cap, dtype=torch.int32),
                list_x=empty(B, N, chunks, cap, dtype=compute_dtype),
                merged_ids=empty(B, cand, dtype=torch.int32), merged_s=empty(B, cand, dtype=compute_dtype),
                constexprs=dict(LIST_TOPK=min(config.list_topk, top_cand), SUB=sub, BLOCK_SUBS=block_subs, CAP=cap,
                                BATCH=config.list_batch, NUM_CAND=cand, TOP_CAND=top_cand,
                                LIST_TOPP=config.list_topp))


def _draft_inputs(draft_probs, draft_sampled, d2t, V, placeholder):
    """Kernel arguments of the draft-aware rule: the draft rows, the sampled flags as int8, and
    with ``d2t`` the inverse map (the draft id of each target id, -1 for none; d2t is injective)
    and whether every draft id maps into [0, V), both built on the device without a sync."""
    if draft_probs is None:
        return placeholder, placeholder, placeholder, placeholder, 1
    device = draft_probs.device
    Vd = draft_probs.shape[2]
    probs = draft_probs.contiguous()
    sampled = draft_sampled.contiguous().view(torch.int8) if draft_sampled is not None else placeholder
    if d2t is None:
        return probs, sampled, placeholder, placeholder, Vd
    ids = torch.arange(Vd, dtype=torch.int64, device=device)
    target = ids + d2t
    in_range = (target >= 0) & (target < V)
    inverse = torch.full((V,), -1, dtype=torch.int32, device=device)
    inverse.index_put_((torch.where(in_range, target, 0),), torch.where(in_range, ids, -1).to(torch.int32))
    # A clamped out-of-range id may have overwritten slot 0: the row is then invalid anyway (d2t_ok = 0).
    d2t_ok = in_range.all().to(torch.int32).reshape(1)
    return probs, sampled, inverse, d2t_ok, Vd


# Workspaces of recent launch shapes (the newest last): scratch the kernel leaves ready for the next
# call, so a call launches the kernel alone.
_WORKSPACES: collections.OrderedDict = collections.OrderedDict()
MAX_WORKSPACES = 8


# Defaults of the sampling arguments left out: greedy, no top-k, no top-p, seed and offset 0.
_DEFAULTS = {"temperature": (0.0, torch.float32), "top_k": (0, torch.int32), "top_p": (1.0, torch.float32),
             "seed": (0, torch.int64), "offset": (0, torch.int64)}


def _workspace(B, N, V, A, dtype, device, config: VerifyConfig, splits, phases, block_t, Vd):
    """The per-shape scratch of a launch, made (and its control words zeroed) on the first call and
    reused after: the kernel's last program of each request resets its control words, the other
    scratch is written before it is read (the sampling defaults, kept there too, are constants). Calls of one
    shape share it, so they must not overlap (calls on one stream never do); a CUDA graph replays
    the kernel on the buffers of the call it captured (a first call before capturing keeps the
    fill out of the graph)."""
    key = (device, B, N, V, A, dtype, config, splits, phases, block_t, Vd)
    ws = _WORKSPACES.get(key)
    if ws is not None:
        _WORKSPACES.move_to_end(key)
        return ws
    compute_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    candidates = max(config.candidates, 1)

    def empty(*shape, dtype):
        return torch.empty(shape, dtype=dtype, device=device)

    ws = dict(
        control=torch.zeros((B, CTL_WORDS.value + 2 * phases), dtype=torch.int32, device=device),
        row_scalars=empty(B, ROW_WORDS.value, dtype=torch.float64),
        part_max=empty(B, splits, dtype=compute_dtype),
        part_arg=empty(B, splits, dtype=torch.int32),
        part_flags=empty(B, splits, dtype=torch.int32),
        part_total=empty(B, splits, dtype=torch.float64),
        part_counts=empty(B, splits, NUM_PIVOTS.value, dtype=torch.int32),
        part_sums=empty(B, splits, NUM_PIVOTS.value, dtype=torch.float32),
        part_mass=empty(B, splits, dtype=torch.float64),
        part_search=empty(B, splits, 2, 1 << config.radix_bits, dtype=torch.float64),
        prefix=empty(B, dtype=torch.int64),
        cand_index=empty(B, candidates, dtype=torch.int32),
        cand_scaled=empty(B, candidates, dtype=compute_dtype),
        tile_sums=empty(B, block_t, dtype=torch.float64),
        # The rejections at the current node of the draft-aware rule (EVENT_WORDS float64 each).
        events=empty(B, EVENT_WORDS.value * triton.next_power_of_2(N), dtype=torch.float64) if Vd else None,
    )
    _WORKSPACES[key] = ws
    while len(_WORKSPACES) > MAX_WORKSPACES:
        _WORKSPACES.popitem(last=False)
    return ws


def _launch(tokens, parents, target_logits, max_depth, temperature, top_k, top_p, seed, offset,
            config: VerifyConfig, draft_probs=None, draft_sampled=None, d2t=None, positions=None,
            record: bool = True, outputs: VerifyOutput | None = None, pending: torch.Tensor | None = None) -> Launch:
    """Allocate and launch (inputs already checked) with ``config`` (tests compare candidate
    lists with ``candidates = 0``, the full-row search). Returns the VerifyOutput and, with
    ``record``, the visited rows' internals: candidate counts and the sampling rows' scalars
    (without it, two empty tensors: the launch is then the kernel alone). ``outputs``: those of the
    all-rows kernel launched before, with its ``pending`` flags: the requests it left (``SKIP_ROWS``)."""
    B, N, V = target_logits.shape
    device = target_logits.device
    # Rows are read in place when their entries are contiguous; otherwise one dense copy.
    logits = target_logits if target_logits.stride(2) == 1 else target_logits.contiguous()
    is_fp64 = target_logits.dtype == torch.float64
    candidates = config.candidates
    A = max_depth + 1
    if outputs is None:
        accept_len = torch.empty(B, dtype=torch.int32, device=device)
        accept_nodes = torch.empty((B, A), dtype=torch.int32, device=device)
        out_tokens = torch.empty((B, A), dtype=torch.int64, device=device)
        status = torch.empty(B, dtype=torch.int32, device=device)
    else:  # the all-rows kernel's outputs: this launch writes the filtered sampling requests' (SKIP_ROWS)
        accept_len, accept_nodes, out_tokens, status = outputs
        if pending is None:
            raise ValueError("pending: a launch into the all-rows kernel's outputs needs its pending flags")
    if record:
        stats = torch.full((B, N, NUM_STATS.value), float("nan"), dtype=torch.float64, device=device)
        cand_count = torch.full((B, N), -2, dtype=torch.int32, device=device)
    else:
        stats = torch.empty((0, N, NUM_STATS.value), dtype=torch.float64, device=device)
        cand_count = torch.empty((0, N), dtype=torch.int32, device=device)
    if B == 0:
        return Launch(VerifyOutput(accept_len, accept_nodes, out_tokens, status), cand_count, stats)
    block_v = min(config.block_v, triton.next_power_of_2(V))
    sms = gpu_sms(device)
    block_max, splits, chunk = _chunking(B, V, config, sms)
    block_s = min(block_v, SEARCH_BLOCK)
    block_t = triton.next_power_of_2(triton.cdiv(V, block_v))
    # Per visited row: max, levels, list, the search digits of top-k and top-p, their two
    # normalisers and the mass; with draft rows, the draft row's check and a bonus phase, and a
    # residual phase per rejected sampled child (each node is rejected at most once).
    digits = triton.cdiv(SIGNIFICANT_KEY_BITS[target_logits.dtype], config.radix_bits)
    Vd = 0 if draft_probs is None else draft_probs.shape[2]
    phases = A * (6 + 2 * digits) + (2 * A + N if Vd else 0)
    # The draft-aware rule's passes: tiles of the search block (their residual weights carry the
    # node's rejections; two search tiles spilled in the walk's loop), a whole number of them a chunk.
    block_r = min(block_s, chunk & -chunk)
    chunk_d = triton.cdiv(triton.cdiv(max(Vd, 1), splits), block_r) * block_r
    ws = _workspace(B, N, V, A, target_logits.dtype, device, config, splits, phases, block_t, Vd)

    def given(t, name):
        """The argument, or its default (made on first use and kept: never written)."""
        if t is not None:
            return t.contiguous()
        if name not in ws:
            ws[name] = torch.full((B,), _DEFAULTS[name][0], dtype=_DEFAULTS[name][1], device=device)
        return ws[name]

    probs, sampled, inverse, d2t_ok, Vd = _draft_inputs(draft_probs, draft_sampled, d2t, V, status)
    events = status if draft_probs is None else ws["events"]
    _verify_kernel[(B, splits)](
        tokens.contiguous(), parents.contiguous(), logits, given(temperature, "temperature"), given(top_k, "top_k"),
        given(top_p, "top_p"), given(seed, "seed"), given(offset, "offset"), stats if record else status,
        cand_count if record else status, ws["control"], ws["row_scalars"], ws["part_max"], ws["part_arg"],
        ws["part_flags"], ws["part_total"], ws["part_counts"], ws["part_sums"], ws["part_mass"], ws["part_search"],
        ws["prefix"], ws["cand_index"], ws["cand_scaled"], ws["tile_sums"], accept_len, accept_nodes, out_tokens,
        status, probs, sampled, inverse, d2t_ok, events, status if positions is None else positions,
        status if pending is None else pending, N, V, Vd, max_depth, chunk, chunk_d, logits.stride(0), logits.stride(1),
        0 if positions is None else positions.stride(0), IS_FP64=is_fp64,
        SIG_BITS=SIGNIFICANT_KEY_BITS[target_logits.dtype], SPLITS=splits, PHASES=phases,
        BLOCK_SPLITS=max(32, triton.next_power_of_2(splits)), BLOCK_V=block_v, BLOCK_S=block_s, BLOCK_R=block_r,
        BLOCK_MAX=block_max, BLOCK_N=triton.next_power_of_2(N), BLOCK_A=triton.next_power_of_2(A), BLOCK_T=block_t,
        RADIX_BITS=config.radix_bits, NUM_CAND=candidates, SHORT_CAND=max(1, min(SHORT_LIST, candidates)),
        HAS_DRAFT=draft_probs is not None, HAS_MASK=draft_sampled is not None, HAS_D2T=d2t is not None,
        HAS_POSITIONS=positions is not None, RECORD=record, SKIP_ROWS=outputs is not None,
        BLOCK_CTL=triton.next_power_of_2(CTL_WORDS.value + 2 * phases), **launch_options(logits.device),
        num_warps=config.num_warps,
    )
    return Launch(VerifyOutput(accept_len, accept_nodes, out_tokens, status), cand_count, stats)
