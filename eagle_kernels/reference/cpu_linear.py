"""Reference ``cpu_linear``: a linear layer without bias, fp32, bf16 or fp16 weights, fp32 output."""

from __future__ import annotations

import torch

from .. import _checks


def cpu_linear(x, weight):
    """``out[..., n] = sum_k x[..., k] * weight[n, k]`` (``F.linear`` without bias), computed in
    float64 and rounded once to float32. A bf16 or fp16 weight is read as the float32 it widens
    to exactly (the kernel's zero-extend and shift by 16, or its F16C conversion).

    Shapes
    ------
    x: float32 [..., K]; weight: float32, bfloat16 or float16 [N, K], dense last dim; returns float32
    [..., N].
    """
    _checks.check_cpu_linear(x, weight)
    return torch.nn.functional.linear(x.double(), weight.double()).to(torch.float32)
