"""Reference ``rmsnorm``: RMSNorm of rows, and the copy of the input that a decoder layer adds
its projections to in place (docs/ops.md §9)."""

from __future__ import annotations

import torch

from .. import _layer_checks


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.to(wide.dtype) * weight.to(wide.dtype)).to(x.dtype)


def rmsnorm(x, weight, eps, *, embed=None, embed_weight=None):
    """``(out, residual)``: ``out = norm(x) * weight`` row by row, with ``norm(x) = x /
    sqrt(mean(x^2) + eps)`` computed in fp32 (float64 for float64 input) and rounded to x's
    dtype before the scale; with ``embed``, ``out = [norm(embed) * embed_weight, norm(x) *
    weight]`` (EAGLE-3's attention input). ``residual`` is a copy of x.

    Shapes
    ------
    x [..., H]; weight [H]; embed [..., H]; embed_weight [H]; all one dtype (fp32, fp16, bf16
    or float64). Returns out [..., H] (``[..., 2H]`` with embed) and residual [..., H].
    """
    _layer_checks.check_rmsnorm(x, weight, eps, embed=embed, embed_weight=embed_weight)
    out = _norm(x, weight, eps)
    if embed is not None:
        out = torch.cat([_norm(embed, embed_weight, eps), out], dim=-1)
    return out, x.clone(memory_format=torch.contiguous_format)
