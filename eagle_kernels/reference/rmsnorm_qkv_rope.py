"""Reference ``rmsnorm_qkv_rope``: a decoder layer's input norm, its q/k/v projection, RoPE and the
KV cache write, with the copy of the input (docs/ops.md §18)."""

from __future__ import annotations

import torch

from .. import _layer_checks
from .rmsnorm import _norm
from .rope_write_kv import rope_write_kv


def rmsnorm_qkv_rope(x, weight, norm_weight, eps, positions, cos, sin, k_cache, v_cache, cache_seqlens, *,
                     num_heads, slot_offset=0):
    """``(q, residual)``: ``h`` as in :func:`rmsnorm_linear` (§9's norm, or x when ``norm_weight``
    is None), ``qkv = h @ weight.T`` in fp32 (float64 for float64 input) and not rounded, then
    :func:`rope_write_kv` of that qkv: q and k rotated at ``positions``, k and v written to the
    caches at ``cache_seqlens[b] + slot_offset + i``, q returned in the caches' dtype with zero
    rows before ``slot_offset``. ``residual`` is a copy of x.

    Shapes
    ------
    x [B, N, K]; weight [(num_heads + 2 Hkv) D, K]; norm_weight [K] or None (x's dtype);
    positions, cos, sin, k_cache, v_cache, cache_seqlens as for :func:`rope_write_kv`. Returns
    q [B, slot_offset + N, num_heads, D] and residual [B, N, K].
    """
    _layer_checks.check_rmsnorm_qkv_rope(x, weight, norm_weight, eps, positions, cos, sin, k_cache, v_cache,
                                         cache_seqlens, num_heads=num_heads, slot_offset=slot_offset)
    h = x if norm_weight is None else _norm(x, norm_weight, eps)
    wide = torch.promote_types(x.dtype, torch.float32)
    qkv = h.to(wide) @ weight.to(wide).t()
    q = rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, cache_seqlens, num_heads=num_heads,
                      slot_offset=slot_offset)
    return q, x.clone(memory_format=torch.contiguous_format)
