"""RMSNorm in torch ops: the arithmetic of the models' torch layer paths (Hugging Face's
``LlamaRMSNorm``), shared by :mod:`eagle_kernels.models.layers` and the torch fallbacks of the
step bookkeeping (:mod:`eagle_kernels.bookkeeping`). The Triton kernels have their own op
(``eagle_kernels.rmsnorm``, docs/ops.md §9)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * norm(x)`` over the last dimension; half-precision rows normalise in fp32 and
    round before the scale."""
    if x.dtype == weight.dtype == torch.float32:
        # One op instead of seven; the same arithmetic in the same order (bit-identical).
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    wide = x.to(torch.promote_types(x.dtype, torch.float32))  # half inputs normalise in fp32
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)
