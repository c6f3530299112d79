"""Triton rmsnorm (docs/ops.md §9): RMSNorm of rows, and the copy of the input that a decoder
layer then adds its projections to in place (the residual stream), in one pass.

For each row ``x`` of H entries (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4)::

    out = round(round(x * rsqrt(mean(x^2) + eps)) * weight)      # fp32 arithmetic
    residual = x

where the inner ``round`` is to x's dtype (as a 16-bit model normalises in fp32 and then scales
in its own dtype). With ``embed`` (EAGLE-3's head) each output row is ``[norm(embed) *
embed_weight, norm(x) * weight]``, 2H wide. One program per row; a row is one tile
(``BLOCK_H`` >= H), so x is read once.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import _layer_checks
from ._launch_config import interpreted
from ._pdl import launch_options, wait_for_prior_grids


@dataclasses.dataclass(frozen=True)
class RmsnormConfig:
    num_warps: int


GPU_CONFIG = RmsnormConfig(num_warps=4)
INTERPRETER_CONFIG = RmsnormConfig(num_warps=1)


@triton.jit
def _normalise_row(src_ptr, weight_ptr, dst_ptr, offs, valid, H, eps):
    """Store ``round(round(x * rsqrt(mean(x^2) + eps)) * w)`` of the row at ``src_ptr`` to ``dst_ptr``;
    returns the row as loaded."""
    x = tl.load(src_ptr + offs, mask=valid, other=0.0)
    wide = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(wide * wide, axis=0) / H + eps)
    normed = (wide * inv).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (normed * w).to(dst_ptr.dtype.element_ty), mask=valid)
    return x


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [R, H] rows, dense
    weight_ptr,  # [H]
    embed_ptr,  # [R, H] rows, dense (unused unless HAS_EMBED)
    embed_weight_ptr,  # [H] (unused unless HAS_EMBED)
    out_ptr,  # [R, H] or [R, 2H] with HAS_EMBED
    residual_ptr,  # [R, H]
    H, eps,
    HAS_EMBED: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    valid = offs < H
    if HAS_EMBED:
        _normalise_row(embed_ptr + row * H, embed_weight_ptr, out_ptr + row * 2 * H, offs, valid, H, eps)
        x = _normalise_row(x_ptr + row * H, weight_ptr, out_ptr + row * 2 * H + H, offs, valid, H, eps)
    else:
        x = _normalise_row(x_ptr + row * H, weight_ptr, out_ptr + row * H, offs, valid, H, eps)
    tl.store(residual_ptr + row * H + offs, x, mask=valid)


def rmsnorm(x, weight, eps, *, embed=None, embed_weight=None, _config: RmsnormConfig | None = None):
    """Triton rmsnorm with the contract signature; see :func:`eagle_kernels.reference.rmsnorm`.

    Shapes
    ------
    x [..., H] fp32/fp16/bf16; weight [H] (x's dtype); embed [..., H] and embed_weight [H]
    (both or neither). Returns (out [..., H], or [..., 2H] with embed; residual [..., H]), both
    contiguous in x's dtype. ``_config`` overrides the launch configuration (tests).
    """
    _layer_checks.check_rmsnorm(x, weight, eps, embed=embed, embed_weight=embed_weight)
    H = x.shape[-1]
    width = 2 * H if embed is not None else H
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // H if H else 0
    if rows == 0:
        return out, residual
    x = x.contiguous()  # a copy only for strided rows
    weight = weight.contiguous()
    if embed is not None:
        embed, embed_weight = embed.contiguous(), embed_weight.contiguous()
    config = _config or (INTERPRETER_CONFIG if interpreted(_rmsnorm_kernel) else GPU_CONFIG)
    _rmsnorm_kernel[(rows,)](
        x, weight, x if embed is None else embed, weight if embed is None else embed_weight, out, residual,
        H, float(eps),
        HAS_EMBED=embed is not None, BLOCK_H=triton.next_power_of_2(H),
        **launch_options(out.device), num_warps=config.num_warps,
    )
    return out, residual
