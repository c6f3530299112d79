"""Reference ``rope_write_kv``: RoPE on the q and k heads of a fused q/k/v projection, and the
rotated k and v stored into the KV cache (docs/ops.md §10)."""

from __future__ import annotations

import torch

from .. import _layer_checks


def rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, cache_seqlens, *, num_heads, slot_offset=0):
    """Rotate, store and return q.

    ``qkv[b, i]`` holds ``num_heads`` q heads, then Hkv k heads, then Hkv v heads, D entries
    each. Token i of request b sits at position ``p = positions[b, i]``; its q and k heads are
    rotated in the half-split layout, ``rot(x) = x * c + [-x2, x1] * s`` with ``c = [cos[p],
    cos[p]]``, ``s = [sin[p], sin[p]]`` (``x1``, ``x2`` the halves of x), in fp32 (float64 for
    float64 input). Rotated k and the v heads go to slot ``t = cache_seqlens[b] + slot_offset +
    i`` of ``k_cache[b]`` / ``v_cache[b]`` (in the caches' dtype); ``cache_seqlens`` is not
    changed. Returns q [B, slot_offset + N, num_heads, D] in the caches' dtype: row
    ``slot_offset + i`` is token i's rotated q, rows before ``slot_offset`` are zero (the
    queries of tree slots written by earlier calls, as ``tree_attention`` takes them).

    Shapes
    ------
    qkv [B, N, (num_heads + 2 Hkv) D]; positions int64/int32 [B, N], values in [0, P);
    cos, sin fp32 (or float64) [P, D / 2]; k_cache, v_cache [B, S, Hkv, D]; cache_seqlens int32 [B].
    Requires cache_seqlens[b] + slot_offset + N <= S.
    """
    _layer_checks.check_rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, cache_seqlens,
                                      num_heads=num_heads, slot_offset=slot_offset)
    B, N = qkv.shape[:2]
    Hkv, D = k_cache.shape[2:]
    wide = torch.promote_types(qkv.dtype, torch.float32)
    heads = qkv.view(B, N, num_heads + 2 * Hkv, D).to(wide)
    c = cos.to(wide)[positions.long()][:, :, None, :].repeat(1, 1, 1, 2)  # [B, N, 1, D]
    s = sin.to(wide)[positions.long()][:, :, None, :].repeat(1, 1, 1, 2)
    first, second = heads[..., : D // 2], heads[..., D // 2:]
    rotated = heads * c + torch.cat([-second, first], dim=-1) * s
    q = torch.zeros(B, slot_offset + N, num_heads, D, dtype=k_cache.dtype, device=qkv.device)
    q[:, slot_offset:] = rotated[:, :, :num_heads].to(k_cache.dtype)
    for b in range(B):
        for i in range(N):
            t = int(cache_seqlens[b]) + slot_offset + i
            k_cache[b, t] = rotated[b, i, num_heads:num_heads + Hkv].to(k_cache.dtype)
            v_cache[b, t] = heads[b, i, num_heads + Hkv:].to(v_cache.dtype)
    return q
