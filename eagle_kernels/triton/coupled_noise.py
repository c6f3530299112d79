"""Triton coupled_noise (docs/ops.md §15): the Gumbel noise ``-log(-log U)`` of coupled sampling at
each (request, position, token id), with the stream's Philox (philox.py) at ``draw = COUPLED_DRAW``.
Programs tile (request * W + position row, BLOCK columns); float64 logs, one float32 rounding."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import _checks
from ..reference.random import COUPLED_DRAW
from ._launch_config import interpreted
from ._pdl import launch_options, wait_for_prior_grids
from .philox import _uniform


@dataclasses.dataclass(frozen=True)
class CoupledNoiseConfig:
    block: int
    num_warps: int


GPU_CONFIG = CoupledNoiseConfig(block=1024, num_warps=4)
INTERPRETER_CONFIG = CoupledNoiseConfig(block=4096, num_warps=1)


@triton.jit
def _gumbel_noise(seed, position, offs, valid, d2t_ptr, HAS_D2T: tl.constexpr, DRAW: tl.constexpr):
    """float32 ``-log(-log U)`` (float64 logs, one rounding) of the stream at (seed, position, id(x), DRAW)
    for the vocabulary entries ``offs``: ``id(x) = x + d2t[x]`` with HAS_D2T, else ``x``."""
    ids = offs.to(tl.int64)
    if HAS_D2T:
        ids = ids + tl.load(d2t_ptr + offs, mask=valid, other=0)
    return (-tl.log(-tl.log(_uniform(seed, position, ids, DRAW)))).to(tl.float32)


@triton.jit
def _coupled_noise_kernel(
    seed_ptr,  # [B] int64
    positions_ptr,  # [B * W] int64, dense
    d2t_ptr,  # [n] int64 (read when HAS_D2T)
    out_ptr,  # [B * W, n] float32, dense
    W,
    n,
    HAS_D2T: tl.constexpr,
    DRAW: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    seed = tl.load(seed_ptr + row // W)
    position = tl.load(positions_ptr + row)
    tl.store(out_ptr + row * n + offs, _gumbel_noise(seed, position, offs, valid, d2t_ptr, HAS_D2T, DRAW), mask=valid)


def coupled_noise(seed, positions, num_tokens, *, d2t=None, _config: CoupledNoiseConfig | None = None):
    """Triton coupled_noise with the contract signature; see
    :func:`eagle_kernels.reference.coupled_noise`. ``_config`` overrides the launch configuration
    (tests run the GPU configuration interpreted).

    Shapes
    ------
    seed int64 [B], positions int64 [B, W], d2t int64 [num_tokens] -> float32 [B, W, num_tokens].
    """
    _checks.check_coupled_noise(seed, positions, num_tokens, d2t=d2t)
    B, W = positions.shape
    out = torch.empty(B, W, num_tokens, dtype=torch.float32, device=seed.device)
    if out.numel() == 0:
        return out
    config = _config or (INTERPRETER_CONFIG if interpreted(_coupled_noise_kernel) else GPU_CONFIG)
    grid = (B * W, triton.cdiv(num_tokens, config.block))
    d2t_arg = d2t.contiguous() if d2t is not None else seed  # a placeholder pointer without d2t
    _coupled_noise_kernel[grid](seed.contiguous(), positions.contiguous(), d2t_arg, out, W, num_tokens,
                                HAS_D2T=d2t is not None, DRAW=COUPLED_DRAW, BLOCK=config.block,
                                **launch_options(out.device), num_warps=config.num_warps)
    return out
