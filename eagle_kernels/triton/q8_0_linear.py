"""Triton q8_0_linear (docs/ops.md §19): a GEMM over Q8_0 weights (int8 quants, one fp16 scale per
32 consecutive k of a row), with the add into a residual stream in its epilogue.

A draft head's decoding passes multiply a few rows (the accepted path, the frontier) by matrices
that no cache holds: each pass streams its weights from HBM once. For a Llama-3-8B-sized EAGLE-3
head that is about 0.75 GB of bf16 per pass and six passes per step, about a third of the
target's own weight read (docs/gpu_model.md, "A decoding step on the H200, modeled"). Q8_0 takes
1.0625 bytes per weight. The head only drafts: its precision changes which drafts are proposed,
never which tokens verification accepts.

Programs tile (BLOCK_N output columns, BLOCK_M rows); column blocks are the first grid axis, and
``column_block`` narrows them until the programs fill the SMs (a Llama head's 4,096-column
projections: 128 programs of 32 columns for 132 SMs). Each K step covers BLOCK_K / 32 blocks, unrolled: per block, x's
[BLOCK_M, 32] tile and the [BLOCK_N, 32] quants (two 16-byte loads a row), the quants converted to
x's dtype (exact: 8-bit integers), one MMA into fp32 partial sums, and one multiply-add of those by
the block's scales into the accumulator: a few instructions per row and column per block instead
of a multiply per weight. The epilogue adds the residual rows before the single rounding to x's
dtype.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _layer_checks
from ._launch_config import dot_mode, interpreted
from ._pdl import launch_options, prefetch_l2, wait_for_prior_grids
from .rmsnorm_linear import gemm_inputs, tile
from .tree_attention_config import sm_count

GROUP = 32  # k per Q8_0 scale


@dataclasses.dataclass(frozen=True)
class FewRowGemmConfig:
    """Tuning of the few-row GEMMs (q8_0_linear, fp8_linear)."""

    block_m: int  # the largest row block; fewer rows take the next power of two >= 16
    block_n: int
    block_k: int  # a multiple of the op's block of k (32 / 128)
    num_warps: int
    num_stages: int


# 64 columns x 256 k: 16 KB of quants a stage. In the sm_90 SASS (bench/compile_audit.py) the loop
# issues about 150 warp instructions per KB of quants (189 at 32 columns): at 4.3 TB/s an SM must
# take in about 16.5 B a cycle, so 2.4 (3.1) instructions a cycle of its 4. column_block halves the
# columns where the programs would not fill the SMs.
GPU_CONFIG = FewRowGemmConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4)
# fp32 x multiplies on the FMA units ("ieee" dots): 32 x 64 keeps them in registers (64 x 256 spills).
GPU_CONFIG_FP32 = FewRowGemmConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=3)
MIN_BLOCK_N = 32
INTERPRETER_CONFIG = FewRowGemmConfig(block_m=64, block_n=64, block_k=128, num_warps=1, num_stages=1)


@triton.jit
def _store_rows(acc, rows, cols, M, N, residual_ptr, out_ptr, HAS_RESIDUAL: tl.constexpr):
    """The epilogue of the few-row GEMMs: ``acc`` [BLOCK_M, BLOCK_N] (fp32) plus the residual rows
    where given, rounded once and stored for the rows and columns in range."""
    out_offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    out_mask = (rows < M)[:, None] & (cols < N)[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + out_offs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _q8_0_linear_kernel(
    x_ptr,  # [M, K] rows, row stride stride_xm, unit column stride
    q_ptr,  # [N, K] int8 quants, dense
    s_ptr,  # [N, K // GROUP] fp16 scales, dense
    residual_ptr,  # [M, N] dense (read only with HAS_RESIDUAL)
    out_ptr,  # [M, N] dense
    M, N, K, stride_xm,
    HAS_RESIDUAL: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
    PREFETCH: tl.constexpr = False,  # the program's quant rows into L2 before the wait
):
    # BLOCK_K divides K (the launcher's choice) and rows / columns past M / N read the last one
    # (their results are not stored): the loop's loads need no masks, hence no per-element
    # predicates (the instructions that would otherwise outnumber the MMAs).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    weight_rows = tl.minimum(cols, N - 1).to(tl.int64)
    if PREFETCH:
        prefetch_l2(q_ptr + weight_rows * K, K)
    wait_for_prior_grids(USE_PDL)
    offs_k = tl.arange(0, GROUP)
    x_ptrs = x_ptr + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    q_ptrs = q_ptr + weight_rows[:, None] * K + offs_k[None, :]
    s_ptrs = s_ptr + weight_rows * (K // GROUP)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        for g in tl.static_range(BLOCK_K // GROUP):
            # One block of 32 k: the MMA of x by the integer quants (exact in x's dtype), fp32
            # partial sums, then one multiply-add by the block's scales into the accumulator.
            xk = tl.load(x_ptrs + g * GROUP)
            qk = tl.load(q_ptrs + g * GROUP)
            sk = tl.load(s_ptrs + g).to(tl.float32)
            if UPCAST:  # the interpreter: no 16-bit dot, and no int8 -> bf16 conversion either
                xk = xk.to(tl.float32)
                wk = qk.to(tl.float32)
            else:
                wk = qk.to(xk.dtype)
            acc += tl.dot(xk, tl.trans(wk), input_precision=DOT_PRECISION) * sk[None, :]
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K
        s_ptrs += BLOCK_K // GROUP
    _store_rows(acc, rows, cols, M, N, residual_ptr, out_ptr, HAS_RESIDUAL)


def column_block(largest: int, N: int, row_blocks: int, sms: int) -> int:
    """Output columns a program: ``largest`` (at most), halved down to MIN_BLOCK_N while the
    programs (column blocks x ``row_blocks``) would leave half the SMs idle. A few-row GEMV is bound
    by how many SMs stream the weights: a Llama-3-8B head's 4,096-column projections take 128
    programs of 32 columns rather than 64 of 64. Narrower blocks cost more than they fill: at 16
    columns the loop issues 602 warp instructions per KB of quants against 189 at 32."""
    block = tile(largest, N)
    while block > MIN_BLOCK_N and triton.cdiv(N, block) * row_blocks * 2 <= sms:
        block //= 2
    return block


def k_block(largest: int, K: int) -> int:
    """The K step: the largest power of two that divides K, at most ``largest`` (K is a multiple
    of GROUP, so at least GROUP)."""
    block = GROUP
    while block * 2 <= largest and K % (block * 2) == 0:
        block *= 2
    return block


class FewRowLaunch(NamedTuple):
    """What the few-row GEMM launchers (q8_0_linear, fp8_linear) share: the output, x's rows [M, K],
    the residual rows (the output standing in for an absent one) and the row and column blocks."""

    out: torch.Tensor
    rows: torch.Tensor
    residual_rows: torch.Tensor
    M: int
    block_m: int
    block_n: int


def few_row_launch(x, N: int, residual, block_m: int, block_n: int) -> FewRowLaunch:
    """The output [..., N] in x's dtype, x's rows and the launch's row and column blocks
    (``column_block`` with the device's SM count); ``M`` 0 where there is nothing to launch (no rows
    or no columns: the caller returns the empty output)."""
    K = x.shape[-1]
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    M = x.numel() // K if K else 0
    if M == 0 or N == 0:
        return FewRowLaunch(out, x, out, 0, 0, 0)
    rows, _ = gemm_inputs(x, M, None)
    residual_rows = residual.reshape(M, N).contiguous() if residual is not None else out
    block_m = tile(block_m, M)
    block_n = column_block(block_n, N, triton.cdiv(M, block_m), sm_count(x.device))
    return FewRowLaunch(out, rows, residual_rows, M, block_m, block_n)


def q8_0_linear(x, quants, scales, *, residual=None, _config: FewRowGemmConfig | None = None):
    """Triton q8_0_linear with the contract signature; see
    :func:`eagle_kernels.reference.q8_0_linear`.

    Shapes
    ------
    x [..., K] fp32/fp16/bf16 (rows may be strided; the last dim dense); quants int8 [N, K];
    scales fp16 [N, K / 32]; residual [..., N] in x's dtype or None. Returns [..., N] in x's
    dtype, contiguous. ``_config`` overrides the launch configuration (tests).
    """
    _layer_checks.check_q8_0_linear(x, quants, scales, residual=residual)
    K, N = x.shape[-1], quants.shape[0]
    config = _config or (INTERPRETER_CONFIG if interpreted(_q8_0_linear_kernel)
                         else GPU_CONFIG_FP32 if x.dtype == torch.float32 else GPU_CONFIG)
    launch = few_row_launch(x, N, residual, config.block_m, config.block_n)
    if launch.M == 0:
        return launch.out
    upcast, precision = dot_mode(_q8_0_linear_kernel, x.dtype)
    quants = quants.contiguous()
    _q8_0_linear_kernel[(triton.cdiv(N, launch.block_n), triton.cdiv(launch.M, launch.block_m))](
        launch.rows, quants, scales.contiguous(), launch.residual_rows, launch.out,
        launch.M, N, K, launch.rows.stride(0),
        HAS_RESIDUAL=residual is not None, GROUP=GROUP,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=k_block(config.block_k, K), UPCAST=upcast,
        DOT_PRECISION=precision, **launch_options(launch.out.device, quants), num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return launch.out
