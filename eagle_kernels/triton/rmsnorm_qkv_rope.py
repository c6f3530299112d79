"""Triton rmsnorm_qkv_rope (docs/ops.md §18): a decoder layer's input norm, its q/k/v GEMM, RoPE
and the KV cache write, in one launch.

It is ``rmsnorm_linear`` (§17) whose epilogue is ``rope_write_kv`` (§10): one program per (row
block, head). The K loop accumulates the head's two halves apart (``acc1`` for entries
``j < D / 2``, ``acc2`` for the rest), so the epilogue rotates a token's q or k head in
registers, ``[acc1 c - acc2 s, acc2 c + acc1 s]`` with ``c``, ``s`` the RoPE rows of its position,
and stores it where §10 puts it: q heads to the returned q at row ``slot_offset + i``, k and v
heads into the caches at ``cache_seqlens[b] + slot_offset + i``. The projection is rotated
unrounded (§10 after §17 would round it first). The q heads' programs of the first row block
also zero q's rows before ``slot_offset``; the first head's programs store the copy of x.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import _layer_checks
from ._launch_config import dot_mode, interpreted
from ._pdl import launch_options, prefetch_l2, wait_for_prior_grids
from .rmsnorm_linear import _input_tile, _inverse_rms, gemm_inputs, tile


@dataclasses.dataclass(frozen=True)
class RmsnormQkvRopeConfig:
    block_m: int  # the largest row block; fewer rows take the next power of two >= 16
    block_k: int
    num_warps: int
    num_stages: int


GPU_CONFIG = RmsnormQkvRopeConfig(block_m=64, block_k=64, num_warps=4, num_stages=3)
INTERPRETER_CONFIG = RmsnormQkvRopeConfig(block_m=64, block_k=128, num_warps=1, num_stages=1)


@triton.jit
def _rmsnorm_qkv_rope_kernel(
    x_ptr,  # [M, K] rows (M = B * N), row stride stride_xm, unit column stride
    norm_ptr,  # [K] (unused unless HAS_NORM)
    w_ptr,  # [(Hq + 2 Hkv) * D, K] dense: q heads, k heads, v heads
    residual_ptr,  # [M, K] dense: the copy of x
    positions_ptr,  # [B, N] int32/int64, strides stride_pb, stride_pn
    cos_ptr,  # [P, HALF] fp32, dense
    sin_ptr,  # [P, HALF] fp32, dense
    k_cache_ptr,  # [B, S, Hkv, D], strides stride_k0, stride_k1, D, 1
    v_cache_ptr,  # [B, S, Hkv, D], strides stride_v0, stride_v1, D, 1
    seqlens_ptr,  # [B] int32
    q_out_ptr,  # [B, slot_offset + N, Hq, D], dense
    M, N, K, B, stride_xm, eps, slot_offset, Hq, Hkv, HALF, P,
    stride_pb, stride_pn, stride_k0, stride_k1, stride_v0, stride_v1,
    HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
    PREFETCH: tl.constexpr = False,  # the head's weight rows into L2 before the wait
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    D = 2 * HALF
    if PREFETCH:
        head_rows = w_ptr + (head * D + tl.minimum(tl.arange(0, BLOCK_J), HALF - 1)).to(tl.int64) * K
        row_bytes = K * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
        prefetch_l2(head_rows, row_bytes)
        prefetch_l2(head_rows + HALF * K, row_bytes)
    wait_for_prior_grids(USE_PDL)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, BLOCK_J)
    row_ok = rows < M
    j_ok = offs_j < HALF
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    rstd = _inverse_rms(x_rows, row_ok, K, eps, HAS_NORM, BLOCK_M, BLOCK_K)
    acc1 = tl.zeros([BLOCK_M, BLOCK_J], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_J], dtype=tl.float32)
    copied = rows < tl.where(head == 0, M, 0)  # the first head's rows
    residual_rows = residual_ptr + rows.to(tl.int64)[:, None] * K
    w_first = w_ptr + (head * D + offs_j).to(tl.int64)[:, None] * K  # [BLOCK_J] rows of the head's first half
    for k0 in range(0, K, BLOCK_K):
        h, k_ok = _input_tile(x_rows, norm_ptr, residual_rows, row_ok, copied, k0, K, rstd, HAS_NORM, BLOCK_K)
        w_mask = j_ok[:, None] & k_ok[None, :]
        w1 = tl.load(w_first + k0 + offs_k[None, :], mask=w_mask, other=0.0)  # [BLOCK_J, BLOCK_K]
        w2 = tl.load(w_first + HALF * K + k0 + offs_k[None, :], mask=w_mask, other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w1 = w1.to(tl.float32)
            w2 = w2.to(tl.float32)
        acc1 = tl.dot(h, tl.trans(w1), acc1, input_precision=DOT_PRECISION)
        acc2 = tl.dot(h, tl.trans(w2), acc2, input_precision=DOT_PRECISION)
    b = (rows // N).to(tl.int64)
    i = rows % N
    out_mask = row_ok[:, None] & j_ok[None, :]
    dtype = q_out_ptr.dtype.element_ty
    if head < Hq + Hkv:  # q and k heads: RoPE at each row's position
        pos = tl.load(positions_ptr + b * stride_pb + i * stride_pn, mask=row_ok, other=0).to(tl.int64)
        # Values are unchecked on a GPU: a position outside the tables reads nothing (cos = sin = 0).
        in_table = out_mask & ((pos >= 0) & (pos < P))[:, None]
        cos = tl.load(cos_ptr + pos[:, None] * HALF + offs_j[None, :], mask=in_table, other=0.0)
        sin = tl.load(sin_ptr + pos[:, None] * HALF + offs_j[None, :], mask=in_table, other=0.0)
        first = acc1 * cos - acc2 * sin
        second = acc2 * cos + acc1 * sin
        if head < Hq:
            q_row = (b * (slot_offset + N) + slot_offset + i) * Hq + head
            dst = q_out_ptr + q_row[:, None] * D + offs_j[None, :]
        else:
            t = tl.load(seqlens_ptr + b, mask=row_ok, other=0).to(tl.int64) + slot_offset + i
            dst = k_cache_ptr + (b * stride_k0 + t * stride_k1 + (head - Hq) * D)[:, None] + offs_j[None, :]
        tl.store(dst, first.to(dtype), mask=out_mask)
        tl.store(dst + HALF, second.to(dtype), mask=out_mask)
    else:  # v heads: stored as they are
        t = tl.load(seqlens_ptr + b, mask=row_ok, other=0).to(tl.int64) + slot_offset + i
        dst = v_cache_ptr + (b * stride_v0 + t * stride_v1 + (head - Hq - Hkv) * D)[:, None] + offs_j[None, :]
        tl.store(dst, acc1.to(dtype), mask=out_mask)
        tl.store(dst + HALF, acc2.to(dtype), mask=out_mask)
    if (head < Hq) & (pid_m == 0):
        # q's rows before slot_offset (earlier tree slots' queries, padding for tree_attention): zero.
        zero = tl.zeros([BLOCK_M, BLOCK_J], dtype=dtype)
        for z0 in range(0, B * slot_offset, BLOCK_M):
            z = z0 + tl.arange(0, BLOCK_M)
            zb = (z // slot_offset).to(tl.int64)
            q_row = (zb * (slot_offset + N) + z % slot_offset) * Hq + head
            z_mask = (z < B * slot_offset)[:, None] & j_ok[None, :]
            tl.store(q_out_ptr + q_row[:, None] * D + offs_j[None, :], zero, mask=z_mask)
            tl.store(q_out_ptr + q_row[:, None] * D + HALF + offs_j[None, :], zero, mask=z_mask)


def rmsnorm_qkv_rope(x, weight, norm_weight, eps, positions, cos, sin, k_cache, v_cache, cache_seqlens, *,
                     num_heads, slot_offset=0, _config: RmsnormQkvRopeConfig | None = None):
    """Triton rmsnorm_qkv_rope with the contract signature; see
    :func:`eagle_kernels.reference.rmsnorm_qkv_rope`.

    Shapes
    ------
    x [B, N, K] fp32/fp16/bf16 (rows may be strided; the last dim dense); weight [(Hq + 2 Hkv) D,
    K]; norm_weight [K] or None; positions, cos, sin, k_cache, v_cache, cache_seqlens as for
    ``rope_write_kv``. Returns (q [B, slot_offset + N, Hq, D] in the caches' dtype, residual
    [B, N, K] contiguous). ``_config`` overrides the launch configuration (tests).
    """
    _layer_checks.check_rmsnorm_qkv_rope(x, weight, norm_weight, eps, positions, cos, sin, k_cache, v_cache,
                                         cache_seqlens, num_heads=num_heads, slot_offset=slot_offset)
    B, N, K = x.shape
    Hkv, D = k_cache.shape[2:]
    q = torch.empty(B, slot_offset + N, num_heads, D, dtype=k_cache.dtype, device=x.device)
    residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    M = B * N
    if M == 0:
        q.zero_()
        return q, residual
    rows, norm = gemm_inputs(x, M, norm_weight)
    weight, cos, sin, seqlens = weight.contiguous(), cos.contiguous(), sin.contiguous(), cache_seqlens.contiguous()
    config = _config or (INTERPRETER_CONFIG if interpreted(_rmsnorm_qkv_rope_kernel) else GPU_CONFIG)
    block_j = max(16, triton.next_power_of_2(D // 2))
    # fp32's FMA dots with two [BLOCK_M, 64] accumulators (head_dim 128) spill at 64 rows on sm_90: half the rows.
    widest_m = config.block_m // 2 if (x.dtype == torch.float32 and block_j > 32) else config.block_m
    block_m = tile(widest_m, M)
    upcast, precision = dot_mode(_rmsnorm_qkv_rope_kernel, x.dtype)
    _rmsnorm_qkv_rope_kernel[(triton.cdiv(M, block_m), num_heads + 2 * Hkv)](
        rows, norm, weight, residual, positions, cos, sin, k_cache, v_cache, seqlens, q,
        M, N, K, B, rows.stride(0), float(eps), slot_offset, num_heads, Hkv, D // 2, cos.shape[0],
        positions.stride(0), positions.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HAS_NORM=norm_weight is not None, BLOCK_M=block_m,
        BLOCK_K=tile(config.block_k, K), BLOCK_J=block_j, UPCAST=upcast, DOT_PRECISION=precision,
        **launch_options(q.device, weight), num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return q, residual
