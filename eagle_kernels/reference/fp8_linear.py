"""Reference ``fp8_linear``: a linear layer over fp8 (e4m3) weights with one scale per output
channel, the activations rounded to fp8 per row and block of 128 k (docs/ops.md §20), and the
weights' quantization."""

from __future__ import annotations

import torch

from .. import _layer_checks

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
ACT_BLOCK = 128  # k per activation scale


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight_fp8, weight_scale)`` of a float matrix [N, K]: one fp32 scale per row,
    ``amax(|row|) / 448`` (1 for an all-zero row), and the row divided by it rounded to
    float8_e4m3fn (to nearest even). Raises ``ValueError`` naming ``weight`` for a non-float or
    non-finite matrix, or one that is not 2-D."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        got = f"{tuple(weight.shape)} {weight.dtype}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight: expected a float matrix [N, K], got {got}")
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weight: expected finite values")
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale


def round_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 128) as the kernel multiplies it: per row and block of 128 k a
    scale ``amax / 448`` (fp32; 0 for an all-zero block) and the block times ``1 / scale`` (fp32)
    rounded to e4m3 (to nearest even; a zero scale gives zeros). Returns (the rounded blocks as
    float32 [..., K / 128, 128], the scales float32 [..., K / 128])."""
    blocks = x.float().reshape(*x.shape[:-1], -1, ACT_BLOCK)
    scale = blocks.abs().amax(dim=-1) / FP8_MAX
    inverse = 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks * inverse[..., None]).to(torch.float8_e4m3fn).float()
    return torch.where(scale[..., None] > 0, q, torch.zeros_like(q)), scale


def fp8_linear(x, weight, weight_scale, *, residual=None):
    """``out = [residual +] sum_b sx_b * (x8_b @ w8_b.T) * weight_scale``: x rounded to fp8 per row
    and block of 128 k (:func:`round_activations`), multiplied by the fp8 weights (``weight``
    float8_e4m3fn [N, K]) block by block, each block's sum scaled by its activation scale, the
    total by each output channel's ``weight_scale``; computed here in float64 and rounded once to
    x's dtype (a kernel accumulates in fp32), with ``residual`` added before that rounding. The
    scheme of vLLM's dynamic FP8 (per-token activation scales) at 128-k blocks, as DeepSeek-V3's
    activations: a draft head's GEMMs at one byte a weight with no per-weight conversion.

    Shapes
    ------
    x [..., K] fp32, fp16 or bf16, K a multiple of 128; weight float8_e4m3fn [N, K]; weight_scale
    float32 [N]; residual [..., N] in x's dtype or None. Returns a new tensor [..., N] in x's dtype.
    """
    _layer_checks.check_fp8_linear(x, weight, weight_scale, residual=residual)
    q, scale = round_activations(x)
    w = weight.double().reshape(weight.shape[0], -1, ACT_BLOCK)  # [N, K / 128, 128]
    y = torch.einsum("...bk,nbk,...b->...n", q.double(), w, scale.double()) * weight_scale.double()
    if residual is not None:
        y = residual.double() + y
    return y.to(x.dtype)
