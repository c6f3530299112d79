"""Triton ``verify``: greedy and lossless sampling verification of a draft tree, from logits.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) on trees with deterministic
draft children (EAGLE-2, Li et al. 2024, §4); semantics and random stream as in
``eagle_kernels/reference/verify.py`` and docs/design.md ("Counter-based random stream",
"verify details").

Four kernels. ``_verify_max_kernel`` reads every logit row once, split into chunks across
programs (a few rows still fill the GPU): chunk max, first argmax and NaN/+inf/finite flags.
``_verify_levels_kernel`` reads the sampling rows once more in the same chunks: the softmax sum
and the entries (and their softmax mass) at or above 16 levels of ``s``, for the candidate lists
below. ``_verify_rows_kernel`` runs one program per logit row (B * N programs): it merges the
chunks into the row's max, first argmax and bad-row flag (all a greedy row needs) and, for
sampling requests, computes in ``BLOCK_V`` tiles the top-k threshold ``kth`` (the k-th
largest ``s = (logits - max) / T``), the softmax normaliser ``denom`` (float64 sum of
``exp(s)`` over ``s >= kth``), the top-p threshold ``cut``, the top-p normaliser ``norm`` and
the float64 mass of the final weights. Both thresholds come from a radix-16 search over the
order keys of the logits themselves, counting (top-k) or summing ``p`` over (top-p) the keys
at or above 15 candidates per pass: ``s`` and ``p`` are monotone in the logit, so ``kth`` is
``s`` of the k-th largest logit and ``cut`` is ``p`` of the logit found, and bf16/fp16 rows
need only the passes for their 16/19 significant key bits. ``s`` and ``p`` are recomputed
from the logits in every pass instead of being stored. Every weight is then a pure function
of its logit and the row's scalars::

    p(x) = [s(x) >= kth] * exp(s(x)) / denom,    w(x) = [p(x) >= cut] * p(x) / norm

and both filters are "keep x iff key >= threshold", which keeps ties together exactly as the
reference does. A row with top-k or top-p usually keeps few tokens, so before searching the
whole row the kernel tries a candidate list (``_candidate_stats``): from the levels kernel's
counts it picks the highest level that holds the top-k set or the nucleus in ``candidates``
slots, stores (id, s) of the entries at or above it in one more pass, and takes the
thresholds, normalisers and mass from that list sorted in registers: three reads of the row
in all instead of up to twenty. Rows the list cannot hold exactly (a flat distribution, a
nucleus reaching below the lowest level, temperature alone) take the search.

``_verify_walk_kernel`` runs one program per request: greedy steps read the stored argmax; a
sampling step evaluates ``w`` only at the drafted tokens and removes a rejected token's weight
from the float64 mass; the bonus draw (inverse CDF, a float64 running sum in token order) runs
over the row's candidate list, or else over the whole row in one pass that stores per-tile
sums, then scans the one tile where the running sum passes the coin. Philox4x32-10 runs
in-kernel on uint32 words.

Modules: ``verify_rows.py`` (the max, levels and rows kernels: thresholds and candidate lists),
``verify_walk.py`` (Philox and the walk kernel), and here the launch configurations and the
launcher.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton

from .. import _checks
from .._types import VerifyOutput
from ._launch_config import interpreted
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
from .verify_walk import CTL_WORDS, ROW_WORDS, _verify_kernel

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
    max_block: tile of the max pass (capped at next_pow2(V)).
    block_v: tile of the list, mass and bonus passes (capped at next_pow2(V)).
    num_warps: warps of the one program per request.
    """

    radix_bits: int
    candidates: int
    max_block: int
    block_v: int = 1024
    num_warps: int = 4


# On the GPU: 16 candidates per search pass (the [BLOCK_S, 16] comparison stays in
# registers), lists of 1024 entries, 4096-entry tiles for the max pass (16 bf16 loads in
# flight per thread at 8 warps).
GPU_CONFIG = VerifyConfig(radix_bits=4, candidates=1024, max_block=4096, block_v=1024, num_warps=8)
# The interpreter's cost is per operation rather than per element: 256 candidates per pass
# halve the passes; short lists and tiles let the tests' small V reach the candidate lists
# and the multi-tile bonus draw.
INTERPRETER_CONFIG = VerifyConfig(radix_bits=8, candidates=32, max_block=64, block_v=64, num_warps=4)


def launch_config() -> VerifyConfig:
    """The configuration a launch uses unless given one: the GPU's, or the interpreter's when
    the kernels run interpreted (TRITON_INTERPRET=1 when Triton defined them)."""
    return INTERPRETER_CONFIG if interpreted(_verify_kernel) else GPU_CONFIG


def _splits(B: int, V: int, unit: int, device: torch.device) -> tuple[int, int]:
    """(chunks per row, entries per chunk): on a GPU enough programs for about two per SM
    whatever the batch, in whole tiles of ``unit`` entries; without one (the interpreter), up to
    4 chunks so that the merges are exercised."""
    tiles = triton.cdiv(V, unit)
    if device.type == "cuda":
        want = triton.cdiv(2 * torch.cuda.get_device_properties(device).multi_processor_count, B)
    else:
        want = 4
    splits = max(1, min(tiles, want, MAX_SPLITS))
    chunk = triton.cdiv(tiles, splits) * unit
    return triton.cdiv(V, chunk), chunk


class Launch(NamedTuple):
    output: VerifyOutput
    cand_count: torch.Tensor  # [B, N] int32: -2 row not visited / greedy, -1 no list, else list length
    stats: torch.Tensor  # [B, N, NUM_STATS] float64 (visited sampling rows only; NaN elsewhere)


def verify(tokens, parents, target_logits, *, max_depth, temperature=None, top_k=None, top_p=None,
           seed=None, offset=None, _config: VerifyConfig | None = None) -> VerifyOutput:
    """Triton launcher with the contract signature (shapes as ``eagle_kernels.reference.verify``).
    ``_config`` overrides :func:`launch_config` (tests run the GPU configuration interpreted).

    Shapes
    ------
    tokens int64 [B, N], parents int32 [B, N], target_logits [B, N, V] float32 / float16 /
    bfloat16 / float64 (16-bit logits are read as they are, no copy); optional float32 /
    int32 / float32 / int64 / int64 [B] temperature, top_k, top_p, seed, offset.
    Returns VerifyOutput(accept_len [B], accept_nodes [B, max_depth + 1],
    out_tokens [B, max_depth + 1], status [B]).
    """
    _checks.check_verify(tokens, parents, target_logits, max_depth=max_depth, temperature=temperature,
                         top_k=top_k, top_p=top_p, seed=seed, offset=offset)
    return _launch(tokens, parents, target_logits, max_depth, temperature, top_k, top_p, seed, offset,
                   _config or launch_config()).output


def _launch(tokens, parents, target_logits, max_depth, temperature, top_k, top_p, seed, offset,
            config: VerifyConfig) -> Launch:
    """Allocate and launch (inputs already checked) with ``config`` (tests compare candidate
    lists with ``candidates = 0``, the full-row search). Returns the VerifyOutput with the
    visited rows' internals: candidate counts and the sampling rows' scalars."""
    B, N, V = target_logits.shape
    device = target_logits.device
    # Rows are read in place when their entries are contiguous; otherwise one dense copy.
    logits = target_logits if target_logits.stride(2) == 1 else target_logits.contiguous()

    def given(t, fill, dtype):
        return torch.full((B,), fill, dtype=dtype, device=device) if t is None else t.contiguous()

    temperature = given(temperature, 0.0, torch.float32)
    top_k = given(top_k, 0, torch.int32)
    top_p = given(top_p, 1.0, torch.float32)
    seed = given(seed, 0, torch.int64)
    offset = given(offset, 0, torch.int64)
    is_fp64 = target_logits.dtype == torch.float64
    compute_dtype = torch.float64 if is_fp64 else torch.float32
    candidates = config.candidates
    stats = torch.full((B, N, NUM_STATS.value), float("nan"), dtype=torch.float64, device=device)
    cand_count = torch.full((B, N), -2, dtype=torch.int32, device=device)
    cand_index = torch.empty((B, max(candidates, 1)), dtype=torch.int32, device=device)
    cand_scaled = torch.empty((B, max(candidates, 1)), dtype=compute_dtype, device=device)
    A = max_depth + 1
    accept_len = torch.empty(B, dtype=torch.int32, device=device)
    accept_nodes = torch.empty((B, A), dtype=torch.int32, device=device)
    out_tokens = torch.empty((B, A), dtype=torch.int64, device=device)
    status = torch.empty(B, dtype=torch.int32, device=device)
    if B == 0:
        return Launch(VerifyOutput(accept_len, accept_nodes, out_tokens, status), cand_count, stats)
    block_v = min(config.block_v, triton.next_power_of_2(V))
    block_max = min(config.max_block, triton.next_power_of_2(V))
    block_s = min(block_v, SEARCH_BLOCK)
    block_t = triton.next_power_of_2(triton.cdiv(V, block_v))
    splits, chunk = _splits(B, V, max(block_v, block_max), device)
    phases = 3 * A  # a max, a levels and a list or mass phase per visited row
    control = torch.zeros((B, CTL_WORDS.value + 2 * phases), dtype=torch.int32, device=device)
    row_scalars = torch.empty((B, ROW_WORDS.value), dtype=torch.float64, device=device)
    part_max = torch.empty((B, splits), dtype=compute_dtype, device=device)
    part_arg = torch.empty((B, splits), dtype=torch.int32, device=device)
    part_flags = torch.empty((B, splits), dtype=torch.int32, device=device)
    part_total = torch.empty((B, splits), dtype=torch.float64, device=device)
    part_counts = torch.empty((B, splits, NUM_PIVOTS.value), dtype=torch.int32, device=device)
    part_sums = torch.empty((B, splits, NUM_PIVOTS.value), dtype=torch.float32, device=device)
    part_mass = torch.empty((B, splits), dtype=torch.float64, device=device)
    tile_sums = torch.empty((B, block_t), dtype=torch.float64, device=device)
    _verify_kernel[(B, splits)](
        tokens.contiguous(), parents.contiguous(), logits, temperature, top_k, top_p, seed, offset, stats, cand_count,
        control, row_scalars, part_max, part_arg, part_flags, part_total, part_counts, part_sums, part_mass,
        cand_index, cand_scaled, tile_sums, accept_len, accept_nodes, out_tokens, status,
        N, V, max_depth, chunk, logits.stride(0), logits.stride(1),
        IS_FP64=is_fp64, SIG_BITS=SIGNIFICANT_KEY_BITS[target_logits.dtype], SPLITS=splits, PHASES=phases,
        BLOCK_SPLITS=triton.next_power_of_2(splits), BLOCK_V=block_v, BLOCK_S=block_s, BLOCK_MAX=block_max,
        BLOCK_N=triton.next_power_of_2(N), BLOCK_A=triton.next_power_of_2(A), BLOCK_T=block_t,
        RADIX_BITS=config.radix_bits, NUM_CAND=candidates, SHORT_CAND=max(1, min(SHORT_LIST, candidates)), num_warps=config.num_warps,
    )
    return Launch(VerifyOutput(accept_len, accept_nodes, out_tokens, status), cand_count, stats)
