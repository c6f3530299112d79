"""Triton coupled_draft_logits (docs/ops.md §16): one program per draft row. A sampling request's
row is read three times (max, sum of exponentials, then the log-probabilities with the race noise of
coupled_noise drawn in place: the stream's Philox at ``draw = COUPLED_DRAW``, float64 logs, one float32
rounding); a greedy request's row is copied as float32. One launch per drafting step replaces the
noise tensor and the torch ops of the composition."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import _checks
from ..reference.random import COUPLED_DRAW
from ._launch_config import interpreted
from ._pdl import launch_options, wait_for_prior_grids
from .coupled_noise import _gumbel_noise


@dataclasses.dataclass(frozen=True)
class CoupledDraftLogitsConfig:
    block: int
    num_warps: int


# A draft vocabulary of 8,192 (the shipped head) is eight 1,024-entry tiles a pass.
GPU_CONFIG = CoupledDraftLogitsConfig(block=1024, num_warps=4)
# Small tiles so that the tests' vocabularies take several tiles per pass.
INTERPRETER_CONFIG = CoupledDraftLogitsConfig(block=64, num_warps=1)


@triton.jit
def _coupled_draft_logits_kernel(
    logits_ptr,  # [B, M, n] float32 / bfloat16 / float16, unit stride over n
    temperature_ptr,  # [B] float32 (0: greedy, the row is copied)
    seed_ptr,  # [B] int64
    positions_ptr,  # [B] int64, stride stride_pos: the position the rows' children take
    d2t_ptr,  # [n] int64: target id x + d2t[x] of draft id x (read when HAS_D2T)
    out_ptr,  # [B, M, n] float32, dense
    M,
    n,
    stride_lb,
    stride_lm,
    stride_pos,
    HAS_D2T: tl.constexpr,
    DRAW: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    b = row // M
    src = logits_ptr + b * stride_lb + (row % M) * stride_lm
    dst = out_ptr + row * n
    temperature = tl.load(temperature_ptr + b)
    if temperature > 0.0:
        # The row's max subtracted before the division (a tiny temperature: -inf, never inf - inf).
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(src + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
            lane_max = tl.maximum(lane_max, x)
        row_max = tl.max(lane_max, axis=0)
        lane_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(src + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
            lane_sum += tl.where(offs < n, tl.exp((x - row_max) / temperature), 0.0)
        log_total = tl.log(tl.sum(lane_sum, axis=0))
        seed = tl.load(seed_ptr + b)
        position = tl.load(positions_ptr + b * stride_pos)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < n
            x = tl.load(src + offs, mask=valid, other=0.0).to(tl.float32)
            noise = _gumbel_noise(seed, position, offs, valid, d2t_ptr, HAS_D2T, DRAW)
            tl.store(dst + offs, ((x - row_max) / temperature - log_total) + noise, mask=valid)
    else:
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=valid, other=0.0).to(tl.float32), mask=valid)


def coupled_draft_logits(logits, temperature, seed, positions, *, d2t=None,
                         _config: CoupledDraftLogitsConfig | None = None):
    """Triton coupled_draft_logits with the contract signature; see
    :func:`eagle_kernels.reference.coupled_draft_logits`. ``_config`` overrides the launch
    configuration (tests run the GPU configuration interpreted). Rows and ``positions`` are read
    in place (any strides; a row's entries need unit stride, else one dense copy).

    Shapes
    ------
    logits [B, M, n] float32 / bfloat16 / float16, temperature float32 [B], seed int64 [B],
    positions int64 [B], d2t int64 [n] -> float32 [B, M, n].
    """
    _checks.check_coupled_draft_logits(logits, temperature, seed, positions, d2t=d2t)
    B, M, n = logits.shape
    out = torch.empty(B, M, n, dtype=torch.float32, device=logits.device)
    if out.numel() == 0:
        return out
    rows = logits if logits.stride(2) == 1 else logits.contiguous()
    config = _config or (INTERPRETER_CONFIG if interpreted(_coupled_draft_logits_kernel) else GPU_CONFIG)
    d2t_arg = d2t.contiguous() if d2t is not None else seed  # a placeholder pointer without d2t
    _coupled_draft_logits_kernel[(B * M,)](
        rows, temperature.contiguous(), seed.contiguous(), positions, d2t_arg, out, M, n, rows.stride(0),
        rows.stride(1), positions.stride(0), HAS_D2T=d2t is not None, DRAW=COUPLED_DRAW,
        BLOCK=min(config.block, triton.next_power_of_2(n)), **launch_options(out.device), num_warps=config.num_warps)
    return out
