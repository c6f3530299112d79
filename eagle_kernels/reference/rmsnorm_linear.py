"""Reference ``rmsnorm_linear``: a decoder layer's RMSNorm and the projection after it, with
SwiGLU for a fused gate/up matrix, and the copy of the input (docs/ops.md §17)."""

from __future__ import annotations

import torch

from .. import _layer_checks
from .rmsnorm import _norm


def rmsnorm_linear(x, weight, norm_weight, eps, *, gated=False, add=None):
    """``(out, residual)``: ``h = norm(x) * norm_weight`` exactly as :func:`rmsnorm`'s ``out``
    (``h = x`` when ``norm_weight`` is None), ``y = h @ weight.T`` in fp32 (float64 for float64
    input); ``out = y`` rounded to x's dtype, or with ``gated`` (``weight`` = ``[gate; up]``,
    2I rows) ``out = silu(y_gate) * y_up`` computed from the unrounded halves and rounded once;
    with ``add`` (not with ``gated``) ``out = add + y`` rounded once: a layer's o or down
    projection added into its residual stream. ``residual`` is a copy of x.

    Shapes
    ------
    x [..., K]; weight [N, K] ([2I, K] with ``gated``); norm_weight [K] or None; add [..., N] or
    None; one dtype (fp32, fp16, bf16 or float64). Returns out [..., N] ([..., I] with ``gated``)
    and residual [..., K].
    """
    _layer_checks.check_rmsnorm_linear(x, weight, norm_weight, eps, gated=gated, add=add)
    h = x if norm_weight is None else _norm(x, norm_weight, eps)
    wide = torch.promote_types(x.dtype, torch.float32)
    y = h.to(wide) @ weight.to(wide).t()
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = gate / (1 + torch.exp(-gate)) * up
    if add is not None:
        y = add.to(wide) + y
    return y.to(x.dtype), x.clone(memory_format=torch.contiguous_format)
