"""Triton rope_write_kv (docs/ops.md §10): RoPE on the q and k heads of a fused q/k/v projection,
and the rotated k and v stored into the KV cache, in one pass.

For request ``b`` and new token ``i`` at position ``p = positions[b, i]`` (Su et al. 2021,
"RoFormer", §3.4.2, in the half-split layout Llama uses)::

    rot(x)[j]         = x[j] * cos[p, j] - x[j + D/2] * sin[p, j]        j < D/2
    rot(x)[j + D/2]   = x[j + D/2] * cos[p, j] + x[j] * sin[p, j]
    q_out[b, s + i]   = rot(q heads of qkv[b, i])                          s = slot_offset
    k_cache[b, t]     = rot(k heads of qkv[b, i]),  v_cache[b, t] = v heads of qkv[b, i]
                                                    t = cache_seqlens[b] + s + i

and ``q_out[b, :s] = 0`` (the earlier tree slots' queries: padding whose attention output is
dropped). One program per (request, output row) handles every head of its token.
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
class RopeWriteKvConfig:
    num_warps: int


GPU_CONFIG = RopeWriteKvConfig(num_warps=4)
INTERPRETER_CONFIG = RopeWriteKvConfig(num_warps=1)


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, heads, offs_h, offs_j, cos, sin, HALF):
    """Rotate ``heads`` heads of 2 * HALF entries at ``src_ptr`` (dense) into ``dst_ptr`` (dense)."""
    valid = (offs_h[:, None] < heads) & (offs_j[None, :] < HALF)
    first = src_ptr + offs_h[:, None] * 2 * HALF + offs_j[None, :]
    x1 = tl.load(first, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=valid, other=0.0).to(tl.float32)
    out = dst_ptr + offs_h[:, None] * 2 * HALF + offs_j[None, :]
    tl.store(out, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=valid)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr,  # [B, N, (Hq + 2 Hkv) * D], dense
    positions_ptr,  # [B, N] int32/int64, strides stride_pb, stride_pn
    cos_ptr,  # [P, D / 2] fp32, dense
    sin_ptr,  # [P, D / 2] fp32, dense
    k_cache_ptr,  # [B, S, Hkv, D], strides stride_k0, stride_k1, D, 1
    v_cache_ptr,  # [B, S, Hkv, D], strides stride_v0, stride_v1, D, 1
    seqlens_ptr,  # [B] int32
    q_out_ptr,  # [B, s + N, Hq, D], dense
    N, slot_offset, Hq, Hkv, HALF, P,
    stride_pb, stride_pn,
    stride_k0, stride_k1, stride_v0, stride_v1,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_J: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    pid = tl.program_id(0).to(tl.int64)
    rows = slot_offset + N
    b = pid // rows
    r = pid % rows
    D = 2 * HALF
    q_dst = q_out_ptr + pid * Hq * D
    offs_j = tl.arange(0, BLOCK_J)
    offs_hq = tl.arange(0, BLOCK_HQ)
    if r < slot_offset:
        zero = tl.zeros([BLOCK_HQ, BLOCK_J], dtype=q_out_ptr.dtype.element_ty)
        q_valid = (offs_hq[:, None] < Hq) & (offs_j[None, :] < HALF)
        dst = q_dst + offs_hq[:, None] * D + offs_j[None, :]
        tl.store(dst, zero, mask=q_valid)
        tl.store(dst + HALF, zero, mask=q_valid)
    else:
        i = r - slot_offset
        pos = tl.load(positions_ptr + b * stride_pb + i * stride_pn).to(tl.int64)
        # Values are unchecked on a GPU: a position outside the tables reads nothing (cos = sin = 0).
        in_table = offs_j < tl.where((pos >= 0) & (pos < P), HALF, 0)
        cos = tl.load(cos_ptr + pos * HALF + offs_j, mask=in_table, other=0.0)[None, :]
        sin = tl.load(sin_ptr + pos * HALF + offs_j, mask=in_table, other=0.0)[None, :]
        src = qkv_ptr + (b * N + i) * (Hq + 2 * Hkv) * D
        _rotate_heads(src, q_dst, Hq, offs_hq, offs_j, cos, sin, HALF)
        t = tl.load(seqlens_ptr + b).to(tl.int64) + r
        offs_hkv = tl.arange(0, BLOCK_HKV)
        _rotate_heads(src + Hq * D, k_cache_ptr + b * stride_k0 + t * stride_k1, Hkv, offs_hkv, offs_j, cos, sin,
                      HALF)
        kv_valid = (offs_hkv[:, None] < Hkv) & (offs_j[None, :] < HALF)
        first = offs_hkv[:, None] * D + offs_j[None, :]
        v_src = src + (Hq + Hkv) * D
        v_dst = v_cache_ptr + b * stride_v0 + t * stride_v1
        v1 = tl.load(v_src + first, mask=kv_valid, other=0.0)
        v2 = tl.load(v_src + first + HALF, mask=kv_valid, other=0.0)
        tl.store(v_dst + first, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_valid)
        tl.store(v_dst + first + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_valid)


def rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, cache_seqlens, *, num_heads, slot_offset=0,
                  _config: RopeWriteKvConfig | None = None):
    """Triton rope_write_kv with the contract signature; see
    :func:`eagle_kernels.reference.rope_write_kv`.

    Shapes
    ------
    qkv [B, N, (Hq + 2 Hkv) D] fp32/fp16/bf16; positions int64/int32 [B, N] (any strides);
    cos, sin fp32 [P, D / 2]; k_cache, v_cache [B, S, Hkv, D] (rows dense); cache_seqlens int32
    [B]. Returns q [B, slot_offset + N, Hq, D] in the caches' dtype. ``_config`` overrides the
    launch configuration (tests).
    """
    _layer_checks.check_rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, cache_seqlens,
                                      num_heads=num_heads, slot_offset=slot_offset)
    B, N = qkv.shape[:2]
    S, Hkv, D = k_cache.shape[1:]
    q = torch.empty(B, slot_offset + N, num_heads, D, dtype=k_cache.dtype, device=qkv.device)
    if q.numel() == 0:
        return q
    qkv, cos, sin, seqlens = qkv.contiguous(), cos.contiguous(), sin.contiguous(), cache_seqlens.contiguous()
    config = _config or (INTERPRETER_CONFIG if interpreted(_rope_write_kv_kernel) else GPU_CONFIG)
    _rope_write_kv_kernel[(B * (slot_offset + N),)](
        qkv, positions, cos, sin, k_cache, v_cache, seqlens, q,
        N, slot_offset, num_heads, Hkv, D // 2, cos.shape[0],
        positions.stride(0), positions.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HKV=triton.next_power_of_2(Hkv),
        BLOCK_J=triton.next_power_of_2(D // 2),
        **launch_options(q.device), num_warps=config.num_warps,
    )
    return q
