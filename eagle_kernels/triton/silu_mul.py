"""Triton silu_mul (docs/ops.md §11): the SwiGLU activation of a fused gate/up projection.

For each row ``[gate, up]`` of 2I entries (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6)::

    out = round(silu(gate) * up) = round(gate / (1 + exp(-gate)) * up)     fp32 arithmetic

Programs tile (row, BLOCK_I columns).
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
class SiluMulConfig:
    block_i: int
    num_warps: int


GPU_CONFIG = SiluMulConfig(block_i=1024, num_warps=4)
INTERPRETER_CONFIG = SiluMulConfig(block_i=4096, num_warps=1)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [R, 2I], dense
    out_ptr,  # [R, I], dense
    I,
    BLOCK_I: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    valid = offs < I
    gate = tl.load(gate_up_ptr + row * 2 * I + offs, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * I + I + offs, mask=valid, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * I + offs, out.to(out_ptr.dtype.element_ty), mask=valid)


def silu_mul(gate_up, *, _config: SiluMulConfig | None = None):
    """Triton silu_mul with the contract signature; see :func:`eagle_kernels.reference.silu_mul`.

    Shapes
    ------
    gate_up [..., 2I] fp32/fp16/bf16; returns [..., I] (contiguous, same dtype). ``_config``
    overrides the launch configuration (tests).
    """
    _layer_checks.check_silu_mul(gate_up)
    I = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], I, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    gate_up = gate_up.contiguous()
    config = _config or (INTERPRETER_CONFIG if interpreted(_silu_mul_kernel) else GPU_CONFIG)
    block = min(config.block_i, triton.next_power_of_2(I))
    _silu_mul_kernel[(out.numel() // I, triton.cdiv(I, block))](
        gate_up, out, I,
        BLOCK_I=block, **launch_options(out.device), num_warps=config.num_warps,
    )
    return out
