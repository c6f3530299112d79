"""Triton rmsnorm_linear (docs/ops.md §17): a decoder layer's RMSNorm, the projection after it
and, for a fused gate/up matrix, SwiGLU, in one launch.

Where a layer's matrices are small (SmolLM2-135M: 0.5-3.5 MB), a decoding step on a GPU is
bound by launches, not bytes: a replayed graph node cost about 3.4 us on an H200, more than
reading these matrices. Folding the norm into the GEMM that consumes it (and SwiGLU into the
gate/up GEMM's epilogue) takes two or three launches off each layer.

Programs tile (BLOCK_M rows, BLOCK_N output columns). With a norm, each program first sums the
squares of its rows over K (the rows are a few KB: every program re-reads them from L2), then
runs the K loop: ``h = round(round(x * rstd) * norm_weight)`` as §9 rounds it, one MMA per K
step against the weight tile (two with GATED: the gate rows n and the up rows I + n), fp32
accumulation; GATED's epilogue is ``silu(gate) * up`` before the single rounding. The programs of
the first column block also store the rows they read: the copy of x the layer adds to in place.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import _layer_checks
from ._launch_config import dot_mode, interpreted
from ._pdl import launch_options, prefetch_l2, wait_for_prior_grids


@dataclasses.dataclass(frozen=True)
class RmsnormLinearConfig:
    block_m: int  # the largest row block; fewer rows take the next power of two >= 16
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


GPU_CONFIG = RmsnormLinearConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
INTERPRETER_CONFIG = RmsnormLinearConfig(block_m=64, block_n=128, block_k=128, num_warps=1, num_stages=1)


@triton.jit
def _inverse_rms(x_rows, row_ok, K, eps, HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` of each row at ``x_rows`` [BLOCK_M] (K entries), fp32, over
    K in BLOCK_K steps: the rows are a few KB, read again from L2 by every program. Without
    HAS_NORM nothing is read (the result, unused, is 1 / sqrt(eps))."""
    offs_k = tl.arange(0, BLOCK_K)
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            xk = tl.load(x_rows + k0 + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            xk = xk.to(tl.float32)
            squares += tl.sum(xk * xk, axis=1)
    return 1.0 / tl.sqrt(squares / K + eps)


@triton.jit
def _input_tile(x_rows, norm_ptr, residual_rows, row_ok, copied, k0, K, rstd, HAS_NORM: tl.constexpr,
                BLOCK_K: tl.constexpr, COPY: tl.constexpr = True):
    """The GEMM input's K step at ``k0``: x's [BLOCK_M, BLOCK_K] tile, stored to the copy at
    ``residual_rows`` for the ``copied`` rows (with COPY), and with HAS_NORM normed as §9 rounds it
    (normalised in fp32 by ``rstd``, rounded, scaled, rounded). Returns (tile, k_ok)."""
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = (k0 + offs_k) < K
    x_mask = row_ok[:, None] & k_ok[None, :]
    xk = tl.load(x_rows + k0 + offs_k[None, :], mask=x_mask, other=0.0)
    if COPY:
        tl.store(residual_rows + k0 + offs_k[None, :], xk, mask=x_mask & copied[:, None])
    if HAS_NORM:
        nk = tl.load(norm_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        normed = (xk.to(tl.float32) * rstd[:, None]).to(xk.dtype)
        xk = (normed.to(tl.float32) * nk[None, :]).to(xk.dtype)
    return xk, k_ok


@triton.jit
def _rmsnorm_linear_kernel(
    x_ptr,  # [M, K] rows, row stride stride_xm, unit column stride
    norm_ptr,  # [K] (unused unless HAS_NORM)
    w_ptr,  # [N, K] dense, or [2N, K] with GATED (gate rows, then up rows)
    out_ptr,  # [M, N] dense
    residual_ptr,  # [M, K] dense: the copy of x
    add_ptr,  # [M, N] dense, added before the rounding (unused unless HAS_ADD)
    M, N, K, stride_xm, eps,
    HAS_NORM: tl.constexpr, GATED: tl.constexpr, HAS_ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
    PREFETCH: tl.constexpr = False,  # the program's weight rows into L2 before the wait
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if PREFETCH:
        _prefetch_rows(w_ptr, pid_n, N, K, GATED, BLOCK_N)
    wait_for_prior_grids(USE_PDL)
    _linear_tile(x_ptr, norm_ptr, w_ptr, out_ptr, residual_ptr, add_ptr, M, N, K, stride_xm, eps, pid_m, pid_n,
                 HAS_NORM, GATED, HAS_ADD, True, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION)


@triton.jit
def _prefetch_rows(w_ptr, pid_n, N, K, GATED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight rows of output column block ``pid_n`` (both halves' with GATED) into L2."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_bytes = K * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    w_rows = w_ptr + tl.minimum(cols, N - 1).to(tl.int64) * K
    prefetch_l2(w_rows, row_bytes)
    if GATED:
        prefetch_l2(w_rows + N * K, row_bytes)


@triton.jit
def _linear_tile(x_ptr, norm_ptr, w_ptr, out_ptr, residual_ptr, add_ptr, M, N, K, stride_xm, eps, pid_m, pid_n,
                 HAS_NORM: tl.constexpr, GATED: tl.constexpr, HAS_ADD: tl.constexpr, COPY: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One (row block ``pid_m``, column block ``pid_n``) tile of §17: the rows' inverse RMS (with
    HAS_NORM), the K loop's MMAs, SwiGLU (GATED) or the add (HAS_ADD), one rounding, the store;
    with COPY the first column block also stores the copy of x. Pointers as the kernel's."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    rstd = _inverse_rms(x_rows, row_ok, K, eps, HAS_NORM, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    copied = rows < tl.where(pid_n == 0, M, 0)  # the first column block's rows
    residual_rows = residual_ptr + rows.to(tl.int64)[:, None] * K
    w_cols = w_ptr + cols.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        h, k_ok = _input_tile(x_rows, norm_ptr, residual_rows, row_ok, copied, k0, K, rstd, HAS_NORM, BLOCK_K, COPY)
        w_mask = col_ok[:, None] & k_ok[None, :]
        wk = tl.load(w_cols + k0 + offs_k[None, :], mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
        if UPCAST:
            h = h.to(tl.float32)
            wk = wk.to(tl.float32)
        acc = tl.dot(h, tl.trans(wk), acc, input_precision=DOT_PRECISION)
        if GATED:
            wu = tl.load(w_cols + N * K + k0 + offs_k[None, :], mask=w_mask, other=0.0)
            if UPCAST:
                wu = wu.to(tl.float32)
            acc_up = tl.dot(h, tl.trans(wu), acc_up, input_precision=DOT_PRECISION)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if HAS_ADD:
        acc += tl.load(add_ptr + out_offs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def gemm_inputs(x: torch.Tensor, M: int, norm_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x's M rows [M, K] (a view where they are evenly strided with a dense last dim, else a copy)
    and the norm weight, or an empty tensor standing in for an absent one (the kernel then reads
    none; no bytes for the launch count's model to charge)."""
    rows = x.reshape(M, x.shape[-1])
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows, (norm_weight.contiguous() if norm_weight is not None else x.new_empty(0))


def tile(largest: int, size: int) -> int:
    """A block dimension over ``size`` entries: the next power of two, at least 16 (tl.dot's
    smallest), at most ``largest``."""
    return min(largest, max(16, triton.next_power_of_2(size)))


def column_block(block_n: int, gated: bool, dtype: torch.dtype) -> int:
    """The largest column block of a tile (before ``tile``): ``block_n``, half of it for a gated
    fp32 tile, whose FMA dots with two accumulators spill at 64 x 64 on sm_90."""
    return block_n // 2 if (gated and dtype == torch.float32) else block_n


def rmsnorm_linear(x, weight, norm_weight, eps, *, gated=False, add=None, _config: RmsnormLinearConfig | None = None):
    """Triton rmsnorm_linear with the contract signature; see
    :func:`eagle_kernels.reference.rmsnorm_linear`.

    Shapes
    ------
    x [..., K] fp32/fp16/bf16 (rows may be strided; the last dim dense); weight [N, K] ([2I, K]
    with ``gated``); norm_weight [K] or None; add [..., N] or None. Returns (out [..., N] or
    [..., I], residual [..., K]), both contiguous in x's dtype. ``_config`` overrides the launch
    configuration (tests).
    """
    _layer_checks.check_rmsnorm_linear(x, weight, norm_weight, eps, gated=gated, add=add)
    K = x.shape[-1]
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    M = x.numel() // K if K else 0
    if M == 0 or N == 0:
        if M and K:
            residual.copy_(x)
        if add is not None and out.numel():
            out.copy_(add)
        return out, residual
    rows, norm = gemm_inputs(x, M, norm_weight)
    weight = weight.contiguous()
    config = _config or (INTERPRETER_CONFIG if interpreted(_rmsnorm_linear_kernel) else GPU_CONFIG)
    block_m, block_n = tile(config.block_m, M), tile(column_block(config.block_n, gated, x.dtype), N)
    block_k = tile(config.block_k, K)
    upcast, precision = dot_mode(_rmsnorm_linear_kernel, x.dtype)
    _rmsnorm_linear_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        rows, norm, weight, out, residual, out.new_empty(0) if add is None else add.reshape(M, N).contiguous(),
        M, N, K, rows.stride(0), float(eps),
        HAS_NORM=norm_weight is not None, GATED=gated, HAS_ADD=add is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, DOT_PRECISION=precision,
        **launch_options(out.device, weight), num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out, residual
