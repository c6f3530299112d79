"""Reference ``q8_0_linear``: a linear layer over Q8_0 weights in the GPU's layout (docs/ops.md §19),
and the conversion from GGML's block rows to that layout."""

from __future__ import annotations

import torch

from .. import _layer_checks
from .cpu_linear import QUANT_BLOCK, ROW_BLOCK_BYTES


def split_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGML Q8_0 block rows int8 [N, K / 32 * 34] (``reference.cpu_linear.quantize``'s form: each
    block an fp16 scale, then 32 int8 quants) as ``(quants, scales)``: int8 [N, K] and fp16
    [N, K / 32], both contiguous, the same values. The GPU kernel reads quants in 16-byte loads,
    which the 34-byte blocks' 2-byte alignment rules out; the CPU kernels keep the block rows.
    Raises ``ValueError`` naming ``blocks`` for anything else."""
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.int8 or blocks.dim() != 2 \
            or blocks.shape[1] % ROW_BLOCK_BYTES[torch.int8]:
        got = f"{tuple(blocks.shape)} {blocks.dtype}" if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise ValueError(f"blocks: expected Q8_0 block rows, int8 [N, K / 32 * 34], got {got}")
    N = blocks.shape[0]
    rows = blocks.contiguous().view(N, -1, ROW_BLOCK_BYTES[torch.int8])
    scales = rows[..., :2].contiguous().view(torch.float16).view(N, -1)
    quants = rows[..., 2:].reshape(N, -1).contiguous()
    return quants, scales.contiguous()


def dequantize_q8_0(quants: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w[n, k] = quants[n, k] * scales[n, k // 32]`` in ``dtype`` (fp32 and float64: exact, an 8-bit
    times an 11-bit significand; a 16-bit dtype rounds it)."""
    wide = torch.promote_types(dtype, torch.float32)
    w = quants.to(wide) * scales.to(wide).repeat_interleave(QUANT_BLOCK, dim=1)
    return w.to(dtype)


def q8_0_linear(x, quants, scales, *, residual=None):
    """``out = [residual +] x @ w.T`` with ``w`` the exact dequantization of the Q8_0 weights
    (:func:`dequantize_q8_0`, fp32), accumulated in fp32 (float64 for float64 input) and rounded
    once to x's dtype; with ``residual``, the sum is taken before that rounding (the epilogue of a
    layer's o / down projection into its residual stream). The weights are never rounded to x's
    dtype: a kernel multiplies x by the integer quants (exact in 16 bits) and scales each block's
    fp32 partial sum.

    Shapes
    ------
    x [..., K] (fp32, fp16, bf16 or float64); quants int8 [N, K]; scales fp16 [N, K / 32];
    residual [..., N] in x's dtype or None. Returns a new tensor [..., N] in x's dtype.
    """
    _layer_checks.check_q8_0_linear(x, quants, scales, residual=residual)
    wide = torch.promote_types(x.dtype, torch.float32)
    y = x.to(wide) @ dequantize_q8_0(quants, scales, wide).t()
    if residual is not None:
        y = residual.to(wide) + y
    return y.to(x.dtype)
