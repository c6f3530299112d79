"""Reference ``cpu_linear``: a linear layer without bias, fp32, bf16 or fp16 weights, fp32 output;
and the packed weight layout (``cpu_linear_pack`` / ``cpu_linear_unpack``)."""

from __future__ import annotations

import torch

from .. import _checks

PACK_WIDTH = 32  # output columns per group of a packed weight


def cpu_linear_pack(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] (N a multiple of 32) in the packed layout of ``cpu_linear``: groups of 32
    output columns, each as two halves of 16 columns stored one after the other, K-major inside a
    half, ``packed[g, h, k, j] = weight[32 g + 16 h + j, k]``. Same dtype, same values; a new
    contiguous tensor [N / 32, 2, K, 16].

    With it ``cpu_linear`` runs one FMA chain per output along K, 16 output columns per vector,
    x broadcast from memory (a GEMM micro-kernel rather than dot products), and each group is two
    weight streams: at 8-12 rows of x a pass costs little more than at one row. Its results agree
    with the row-major layout's to fp32 rounding (another summation order), and are bit for bit
    the same on every ISA.
    """
    _checks.check_cpu_linear_pack(weight)
    N, K = weight.shape
    half = PACK_WIDTH // 2
    return weight.reshape(N // PACK_WIDTH, 2, half, K).transpose(2, 3).contiguous()


def cpu_linear_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] of a packed weight [N / 32, 2, K, 16] (the inverse of
    :func:`cpu_linear_pack`)."""
    groups, halves, K, half = packed.shape
    return packed.transpose(2, 3).reshape(groups * halves * half, K)


def cpu_linear(x, weight):
    """``out[..., n] = sum_k x[..., k] * weight[n, k]`` (``F.linear`` without bias), computed in
    float64 and rounded once to float32. A bf16 or fp16 weight is read as the float32 it widens
    to exactly (the kernel's zero-extend and shift by 16, or its F16C conversion).

    Shapes
    ------
    x: float32 [..., K]; weight: float32, bfloat16 or float16, [N, K] with a dense last dim or
    packed [N / 32, 2, K, 16] (:func:`cpu_linear_pack`); returns float32 [..., N].
    """
    _checks.check_cpu_linear(x, weight)
    if weight.dim() == 4:
        weight = cpu_linear_unpack(weight)
    return torch.nn.functional.linear(x.double(), weight.double()).to(torch.float32)
