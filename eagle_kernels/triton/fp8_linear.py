"""Triton fp8_linear (docs/ops.md §20): a GEMM over fp8 (e4m3) weights with one scale per output
channel, the activations rounded to fp8 per row and block of 128 k in the kernel, with the add
into a residual stream in its epilogue.

The Q8_0 kernel (q8_0_linear.py) converts every weight to bf16 before its MMA: about 150 warp
instructions per KB of weights in the sm_90 SASS, issue-bound unless an SM issues 2.4 a cycle.
Here the MMA takes the fp8 weights as they are loaded (the tensor cores multiply e4m3 by e4m3
into fp32); the work per K step is the activations' few rows: each block's maximum, one
reciprocal a row, a multiply and conversion per entry, and one multiply-add of the block's partial
sums by its scales.

Every column program needs the same rounded activations. Where there are several (all but the
smallest matrices), a first launch rounds them once (``_fp8_round_rows_kernel``: e4m3 bits and a
scale per row and block) and the GEMM loads them: its loop is then the weights' loads, the MMA and
the scales' multiply-add. Rounding them in every program cost most of the loop's instructions
(326 warp instructions per 16 KB of weights at 64 columns, 481 per 8 KB at 32 in the sm_90 SASS).
The two paths compute the same values by the same operations, so they give the same bits.

Programs tile (BLOCK_N output columns, BLOCK_M rows), columns on the first grid axis, narrowed
by ``q8_0_linear.column_block`` until the programs fill the SMs. The MMA is taken transposed,
``w [BLOCK_N, 128] @ x8.T [128, BLOCK_M]``, so that the weights, the large operand, are its
first (a Hopper warpgroup MMA reads it from shared memory). Under the interpreter (no fp8 MMA,
and its fp32 -> e4m3 conversion does not round to nearest) the activations are rounded by
``_round_e4m3`` and the product is taken in fp32: the same values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _layer_checks
from ..reference.fp8_linear import ACT_BLOCK, FP8_MAX  # the contract's block of k and largest e4m3
from ._launch_config import interpreted
from ._pdl import launch_options, prefetch_l2, wait_for_prior_grids
from .q8_0_linear import FewRowGemmConfig, _store_rows, few_row_launch, k_block

# block_k: a multiple of ACT_BLOCK.
GPU_CONFIG = FewRowGemmConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4)
INTERPRETER_CONFIG = FewRowGemmConfig(block_m=64, block_n=64, block_k=128, num_warps=1, num_stages=1)


@triton.jit
def _round_e4m3(v):
    """``v`` (|v| <= 448, fp32) rounded to the nearest float8_e4m3fn value, ties to even, as fp32:
    the exponent's step (2^-9 at the subnormals), the quotient rounded to an even integer."""
    a = tl.abs(v)
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0)
    step = tl.exp2(e - 3.0)
    r = a / step
    f = tl.floor(r)
    d = r - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    f = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
    return tl.where(v < 0, -f * step, f * step)


@triton.jit
def _block_scale_and_scaled(xk, FP8_MAX: tl.constexpr):
    """Blocks of activations ``xk`` [R, ACT_BLOCK] (fp32) -> (their scales [R], ``amax / FP8_MAX``,
    0 for an all-zero block; the blocks times ``1 / scale``, one division a block, not yet rounded).
    Both paths of the op call this, so that they round the same values."""
    scale = tl.max(tl.abs(xk), axis=1) / FP8_MAX
    return scale, xk * (1.0 / tl.where(scale > 0, scale, 1.0))[:, None]


@triton.jit
def _fp8_round_rows_kernel(
    x_ptr,  # [M, K] rows, row stride stride_xm, unit column stride
    x8_ptr,  # [M, K] float8_e4m3fn bits (int8 view), dense: each block times 1 / its scale, rounded
    xs_ptr,  # [M, K / ACT_BLOCK] fp32 block scales, dense
    K, stride_xm,
    ACT_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, BLOCKS: tl.constexpr, EMULATE: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    # One row and BLOCKS blocks of ACT_BLOCK k a program.
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    wait_for_prior_grids(USE_PDL)
    num_blocks = K // ACT_BLOCK
    in_range = blocks < num_blocks
    offs = blocks[:, None] * ACT_BLOCK + tl.arange(0, ACT_BLOCK)[None, :]  # [BLOCKS, ACT_BLOCK]
    xk = tl.load(x_ptr + row * stride_xm + offs, mask=in_range[:, None], other=0.0).to(tl.float32)
    scale, v = _block_scale_and_scaled(xk, FP8_MAX)
    if EMULATE:  # exact e4m3 values, which the interpreter's conversion keeps (but not NaN: 0x7f as sm_90's)
        bits = tl.where(v == v, _round_e4m3(v).to(tl.float8e4nv).to(tl.int8, bitcast=True), 0x7F)
    else:
        bits = v.to(tl.float8e4nv).to(tl.int8, bitcast=True)
    tl.store(x8_ptr + row * K + offs, bits, mask=in_range[:, None])
    tl.store(xs_ptr + row * num_blocks + blocks, scale, mask=in_range)


@triton.jit
def _fp8_linear_kernel(
    x_ptr,  # [M, K] rows, row stride stride_xm, unit column stride; ROUNDED: float8_e4m3fn bits (int8 view)
    xs_ptr,  # ROUNDED: [M, K / ACT_BLOCK] fp32 block scales of x, dense (else not read)
    w_ptr,  # [N, K] float8_e4m3fn bits (int8 view), dense
    ws_ptr,  # [N] fp32 weight scales
    residual_ptr,  # [M, N] dense (read only with HAS_RESIDUAL)
    out_ptr,  # [M, N] dense
    M, N, K, stride_xm,
    HAS_RESIDUAL: tl.constexpr, ACT_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr,
    ROUNDED: tl.constexpr = False,  # x rounded by _fp8_round_rows_kernel (else rounded here)
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
    PREFETCH: tl.constexpr = False,  # the program's weight rows into L2 before the wait
):
    # BLOCK_K divides K and rows / columns past M / N read the last one (not stored): no masks.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    weight_rows = tl.minimum(cols, N - 1).to(tl.int64)
    if PREFETCH:
        prefetch_l2(w_ptr + weight_rows * K, K)
    wait_for_prior_grids(USE_PDL)
    offs_k = tl.arange(0, ACT_BLOCK)
    x_rows = tl.minimum(rows, M - 1).to(tl.int64)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]
    xs_ptrs = xs_ptr + x_rows * (K // ACT_BLOCK)
    w_ptrs = w_ptr + weight_rows[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # transposed: out.T
    for _ in range(0, K, BLOCK_K):
        for b in tl.static_range(BLOCK_K // ACT_BLOCK):
            wk = tl.load(w_ptrs + b * ACT_BLOCK).to(tl.float8e4nv, bitcast=True)  # [BLOCK_N, ACT_BLOCK]
            if ROUNDED:
                x8 = tl.load(x_ptrs + b * ACT_BLOCK)  # [BLOCK_M, ACT_BLOCK] e4m3 bits
                scale = tl.load(xs_ptrs + b)  # [BLOCK_M]
                if EMULATE:  # the interpreter reads e4m3fn's NaN (0x7f / 0xff) as a number
                    xf = tl.where((x8 & 0x7F) == 0x7F, float("nan"), x8.to(tl.float8e4nv, bitcast=True).to(tl.float32))
                    partial = tl.dot(wk.to(tl.float32), tl.trans(xf), input_precision="ieee")
                else:
                    partial = tl.dot(wk, tl.trans(x8.to(tl.float8e4nv, bitcast=True)))
            else:
                xk = tl.load(x_ptrs + b * ACT_BLOCK).to(tl.float32)  # [BLOCK_M, ACT_BLOCK]
                scale, v = _block_scale_and_scaled(xk, FP8_MAX)  # [BLOCK_M], [BLOCK_M, ACT_BLOCK]
                if EMULATE:
                    partial = tl.dot(wk.to(tl.float32), tl.trans(_round_e4m3(v)), input_precision="ieee")
                else:
                    partial = tl.dot(wk, tl.trans(v.to(tl.float8e4nv)))
            acc += partial * scale[None, :]
        x_ptrs += BLOCK_K
        xs_ptrs += BLOCK_K // ACT_BLOCK
        w_ptrs += BLOCK_K
    acc = tl.trans(acc * tl.load(ws_ptr + weight_rows)[:, None])  # [BLOCK_M, BLOCK_N]
    _store_rows(acc, rows, cols, M, N, residual_ptr, out_ptr, HAS_RESIDUAL)


def fp8_linear(x, weight, weight_scale, *, residual=None, _config: FewRowGemmConfig | None = None,
               _round_first: bool | None = None):
    """Triton fp8_linear with the contract signature; see :func:`eagle_kernels.reference.fp8_linear`.

    Shapes
    ------
    x [..., K] fp32/fp16/bf16 (rows may be strided; the last dim dense), K a multiple of 128;
    weight float8_e4m3fn [N, K]; weight_scale fp32 [N]; residual [..., N] in x's dtype or None.
    Returns [..., N] in x's dtype, contiguous. ``_config`` overrides the launch configuration and
    ``_round_first`` whether the activations are rounded by a launch of their own (default: where
    the GEMM has more than one column program) (tests).
    """
    _layer_checks.check_fp8_linear(x, weight, weight_scale, residual=residual)
    K, N = x.shape[-1], weight.shape[0]
    interpret = interpreted(_fp8_linear_kernel)
    config = _config or (INTERPRETER_CONFIG if interpret else GPU_CONFIG)
    launch = few_row_launch(x, N, residual, config.block_m, config.block_n)
    if launch.M == 0:
        return launch.out
    column_programs = triton.cdiv(N, launch.block_n)
    rows, row_scales = launch.rows, launch.rows  # the scales' argument is not read unless rounded first
    round_first = column_programs > 1 if _round_first is None else _round_first
    if round_first:
        rows, row_scales = round_rows(launch.rows, interpret)
    weight = weight.contiguous().view(torch.int8)
    _fp8_linear_kernel[(column_programs, triton.cdiv(launch.M, launch.block_m))](
        rows, row_scales, weight, weight_scale.contiguous(), launch.residual_rows,
        launch.out, launch.M, N, K, rows.stride(0),
        HAS_RESIDUAL=residual is not None, ACT_BLOCK=ACT_BLOCK, FP8_MAX=FP8_MAX,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=max(ACT_BLOCK, k_block(config.block_k, K)),
        EMULATE=interpret, ROUNDED=round_first, **launch_options(launch.out.device, weight),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return launch.out


# Blocks of 128 k a program of the rounding launch: a Llama-3-8B head's 4,096-wide rows take 8 programs a row.
ROUND_BLOCKS = 4


def round_rows(rows: torch.Tensor, interpret: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows [M, K] (row-strided, the last dim dense) rounded as the GEMM multiplies them: the
    float8_e4m3fn bits [M, K] (int8 view) and the block scales fp32 [M, K / 128] (one launch)."""
    M, K = rows.shape
    rounded = torch.empty(M, K, dtype=torch.int8, device=rows.device)
    scales = torch.empty(M, K // ACT_BLOCK, dtype=torch.float32, device=rows.device)
    _fp8_round_rows_kernel[(M, triton.cdiv(K // ACT_BLOCK, ROUND_BLOCKS))](
        rows, rounded, scales, K, rows.stride(0),
        ACT_BLOCK=ACT_BLOCK, FP8_MAX=FP8_MAX, BLOCKS=ROUND_BLOCKS, EMULATE=interpret,
        **launch_options(rows.device), num_warps=4,
    )
    return rounded, scales
