"""Triton write_kv: store the K/V of N new tokens at logical positions cache_seqlens[b] + i.

One program per (request, token) copies its [Hkv, D] rows of K and V into the cache row that
the position maps to (contiguous, or through the block table when paged).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import _checks
from ._pdl import launch_options, wait_for_prior_grids


@triton.jit
def _write_kv_kernel(
    k_cache_ptr,  # [B, S, Hkv, D] or paged [P, page_size, Hkv, D], last dim dense
    v_cache_ptr,  # like k_cache_ptr
    k_new_ptr,  # [B, N, Hkv, D] contiguous
    v_new_ptr,  # [B, N, Hkv, D] contiguous
    seqlens_ptr,  # [B] int32
    block_table_ptr,  # [B, max_pages] int32, contiguous (unused unless IS_PAGED)
    N, Hkv, D, page_size, max_pages,
    stride_k0, stride_k1, stride_k2,
    stride_v0, stride_v1, stride_v2,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_PAGED: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    pid = tl.program_id(0).to(tl.int64)
    b = pid // N
    i = pid % N
    t = tl.load(seqlens_ptr + b) + i
    if IS_PAGED:
        outer = tl.load(block_table_ptr + b * max_pages + t // page_size).to(tl.int64)
        pos = t % page_size
    else:
        outer = b
        pos = t
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    valid = (offs_h[:, None] < Hkv) & (offs_d[None, :] < D)
    src = (pid * Hkv + offs_h[:, None]) * D + offs_d[None, :]
    k = tl.load(k_new_ptr + src, mask=valid, other=0.0)
    v = tl.load(v_new_ptr + src, mask=valid, other=0.0)
    k_dst = outer * stride_k0 + pos * stride_k1 + offs_h[:, None] * stride_k2 + offs_d[None, :]
    v_dst = outer * stride_v0 + pos * stride_v1 + offs_h[:, None] * stride_v2 + offs_d[None, :]
    tl.store(k_cache_ptr + k_dst, k, mask=valid)
    tl.store(v_cache_ptr + v_dst, v, mask=valid)


def write_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, *, block_table=None) -> None:
    """Triton write_kv with the contract signature; see :func:`eagle_kernels.reference.write_kv`.

    Shapes
    ------
    k_cache, v_cache [B, S, Hkv, D] or paged [P, page_size, Hkv, D] (dense last dim) with
    block_table int32 [B, max_pages]; k_new, v_new [B, N, Hkv, D]; cache_seqlens int32 [B].
    """
    _checks.check_write_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table=block_table)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:
            raise ValueError(f"{name}: expected a dense last (head) dim, got strides {tuple(cache.stride())}")
    B, N, Hkv, D = k_new.shape
    if k_new.numel() == 0:
        return
    k_src, v_src = k_new.contiguous(), v_new.contiguous()  # read-only inputs, [B, N, Hkv, D]
    seqlens = cache_seqlens.contiguous()
    paged = block_table is not None
    table = block_table.contiguous() if paged else seqlens  # placeholder pointer when unused
    _write_kv_kernel[(B * N,)](
        k_cache, v_cache, k_src, v_src, seqlens, table,
        N, Hkv, D, k_cache.shape[1] if paged else 1, table.shape[1] if paged else 1,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_H=triton.next_power_of_2(Hkv), BLOCK_D=triton.next_power_of_2(D), IS_PAGED=paged,
        **launch_options(k_cache.device), num_warps=4,
    )
