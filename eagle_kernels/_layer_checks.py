"""Input validation and output shapes of the GPU decoder-layer ops (rmsnorm, rope_write_kv,
silu_mul, rmsnorm_linear, rmsnorm_qkv_rope, o_proj_mlp, q8_0_linear, fp8_linear), in the style of
:mod:`._checks`: every failure is a ``ValueError`` whose message starts with the name of the
offending argument; ``values`` runs the checks that read tensor data (CPU tensors by default, see
``_checks.values_checked``)."""

from __future__ import annotations

import torch

from ._checks import _fail, check_eps, check_tensor, is_int, values_checked

HALF_AND_SINGLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_rmsnorm(x, weight, eps, *, embed=None, embed_weight=None, values=True):
    check_tensor("x", x, dtype=HALF_AND_SINGLE)
    if x.dim() < 1:
        _fail("x", "at least 1 dimension [..., H]", f"shape {tuple(x.shape)}")
    H = x.shape[-1]
    check_tensor("weight", weight, dtype=x.dtype, shape=(H,), device=x.device)
    check_eps(eps)
    if (embed is None) != (embed_weight is None):
        _fail("embed" if embed is None else "embed_weight", "embed and embed_weight together", "only one of them")
    if embed is not None:
        check_tensor("embed", embed, dtype=x.dtype, shape=tuple(x.shape), device=x.device)
        check_tensor("embed_weight", embed_weight, dtype=x.dtype, shape=(H,), device=x.device)


def rmsnorm_shapes(x, weight, eps, *, embed=None, embed_weight=None):
    H = x.shape[-1]
    return (*x.shape[:-1], 2 * H if embed is not None else H), tuple(x.shape)


def check_rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, cache_seqlens, *, num_heads, slot_offset=0,
                        values=True):
    check_tensor("qkv", qkv, dtype=HALF_AND_SINGLE, ndim=3)
    device = qkv.device
    B, N, width = qkv.shape
    check_tensor("k_cache", k_cache, dtype=HALF_AND_SINGLE, ndim=4, device=device)
    S, Hkv, D = k_cache.shape[1:]
    if k_cache.shape[0] != B:
        _fail("k_cache", f"batch dim {B} (qkv's) in [B, S, Hkv, D]", f"shape {tuple(k_cache.shape)}")
    check_tensor("v_cache", v_cache, dtype=k_cache.dtype, shape=tuple(k_cache.shape), device=device)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(3) != 1 or cache.stride(2) != D:
            _fail(name, "each position's [Hkv, D] rows dense (strides (*, *, D, 1))", f"strides {cache.stride()}")
    if D % 2:
        _fail("k_cache", "an even head dim D (half-split RoPE)", f"shape {tuple(k_cache.shape)}")
    if not is_int(num_heads) or num_heads < 1 or num_heads % Hkv:
        _fail("num_heads", f"a positive multiple of the caches' {Hkv} KV heads", num_heads)
    if width != (num_heads + 2 * Hkv) * D:
        _fail("qkv", f"last dim (num_heads + 2 Hkv) * D = {(num_heads + 2 * Hkv) * D}", f"shape {tuple(qkv.shape)}")
    check_tensor("positions", positions, dtype=(torch.int64, torch.int32), shape=(B, N), device=device)
    check_tensor("cos", cos, dtype=(torch.float32, torch.float64), ndim=2, device=device)
    if cos.shape[1] != D // 2:
        _fail("cos", f"shape [P, {D // 2}] (D / 2 columns)", f"shape {tuple(cos.shape)}")
    check_tensor("sin", sin, dtype=cos.dtype, shape=tuple(cos.shape), device=device)
    check_tensor("cache_seqlens", cache_seqlens, dtype=torch.int32, shape=(B,), device=device)
    if not is_int(slot_offset) or slot_offset < 0:
        _fail("slot_offset", "an int >= 0", slot_offset)
    if values and values_checked(device) and B and N:
        if bool((positions < 0).any()) or bool((positions >= cos.shape[0]).any()):
            _fail("positions", f"values in [0, {cos.shape[0]}) (the rows of cos and sin)",
                  f"range [{int(positions.min())}, {int(positions.max())}]")
        if bool((cache_seqlens < 0).any()):
            _fail("cache_seqlens", "values >= 0", f"minimum {int(cache_seqlens.min())}")
        needed = int(cache_seqlens.max()) + slot_offset + N
        if needed > S:
            _fail("cache_seqlens", f"cache_seqlens + slot_offset + N <= capacity {S}", f"{needed}")


def rope_write_kv_shape(qkv, positions, cos, sin, k_cache, v_cache, cache_seqlens, *, num_heads, slot_offset=0):
    B, N = qkv.shape[:2]
    return (B, slot_offset + N, num_heads, k_cache.shape[-1])


def check_silu_mul(gate_up, values=True):
    check_tensor("gate_up", gate_up, dtype=HALF_AND_SINGLE)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        _fail("gate_up", "an even last dim [..., 2I]", f"shape {tuple(gate_up.shape)}")


def silu_mul_shape(gate_up):
    return (*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def _gemm_rows(x, dtype, name: str = "x") -> int:
    """Check a GEMM's rows ``x`` [..., K] (argument ``name``) of one of ``dtype``; returns K."""
    check_tensor(name, x, dtype=dtype)
    if x.dim() < 1:
        _fail(name, "at least 1 dimension [..., K]", f"shape {tuple(x.shape)}")
    return x.shape[-1]


def _gemm_residual(residual, x, N: int, name: str = "residual") -> None:
    """Check the residual rows [..., N] (argument ``name``) a GEMM adds its product to (None: none)."""
    if residual is not None:
        check_tensor(name, residual, dtype=x.dtype, shape=(*x.shape[:-1], N), device=x.device)


def check_rmsnorm_linear(x, weight, norm_weight, eps, *, gated=False, add=None, values=True):
    K = _gemm_rows(x, HALF_AND_SINGLE)
    check_tensor("weight", weight, dtype=x.dtype, ndim=2, device=x.device)
    if weight.shape[1] != K:
        _fail("weight", f"shape [N, {K}] (x's last dim K)", f"shape {tuple(weight.shape)}")
    if not isinstance(gated, bool):
        _fail("gated", "a bool", gated)
    if gated and weight.shape[0] % 2:
        _fail("weight", "an even row count [2I, K] (gated: gate rows, then up rows)", f"shape {tuple(weight.shape)}")
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, dtype=x.dtype, shape=(K,), device=x.device)
    check_eps(eps)
    if add is not None and gated:
        _fail("add", "None with gated (SwiGLU's output is not added to)", "a tensor")
    _gemm_residual(add, x, weight.shape[0], "add")


def rmsnorm_linear_shapes(x, weight, norm_weight, eps, *, gated=False):
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    return (*x.shape[:-1], N), tuple(x.shape)


def check_o_proj_mlp(attention, residual, o_weight, norm_weight, gate_up_weight, down_weight, eps, *, values=True):
    Ka = _gemm_rows(attention, HALF_AND_SINGLE, "attention")
    dtype, device = attention.dtype, attention.device
    check_tensor("o_weight", o_weight, dtype=dtype, ndim=2, device=device)
    if o_weight.shape[1] != Ka:
        _fail("o_weight", f"shape [H, {Ka}] (attention's last dim)", f"shape {tuple(o_weight.shape)}")
    H = o_weight.shape[0]
    check_tensor("residual", residual, dtype=dtype, shape=(*attention.shape[:-1], H), device=device)
    check_tensor("norm_weight", norm_weight, dtype=dtype, shape=(H,), device=device)
    check_tensor("gate_up_weight", gate_up_weight, dtype=dtype, ndim=2, device=device)
    if gate_up_weight.shape[0] % 2 or gate_up_weight.shape[1] != H:
        _fail("gate_up_weight", f"shape [2I, {H}] (gate rows, then up rows)", f"shape {tuple(gate_up_weight.shape)}")
    inner = gate_up_weight.shape[0] // 2
    check_tensor("down_weight", down_weight, dtype=dtype, shape=(H, inner), device=device)
    check_eps(eps)


def check_rmsnorm_qkv_rope(x, weight, norm_weight, eps, positions, cos, sin, k_cache, v_cache, cache_seqlens, *,
                           num_heads, slot_offset=0, values=True):
    check_rmsnorm_linear(x, weight, norm_weight, eps)
    if x.dim() != 3:
        _fail("x", "3 dimensions [B, N, K]", f"shape {tuple(x.shape)}")
    check_tensor("k_cache", k_cache, dtype=HALF_AND_SINGLE, ndim=4, device=x.device)
    Hkv, D = k_cache.shape[2:]
    if not is_int(num_heads) or num_heads < 1 or (Hkv and num_heads % Hkv):
        _fail("num_heads", f"a positive multiple of the caches' {Hkv} KV heads", num_heads)
    if weight.shape[0] != (num_heads + 2 * Hkv) * D:
        _fail("weight", f"(num_heads + 2 Hkv) * D = {(num_heads + 2 * Hkv) * D} rows (q, k, v heads)",
              f"shape {tuple(weight.shape)}")
    # The projection's shape, with no storage: rope_write_kv's checks read only its shape, dtype and device.
    qkv = x.new_empty(()).expand(x.shape[0], x.shape[1], weight.shape[0])
    check_rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, cache_seqlens, num_heads=num_heads,
                        slot_offset=slot_offset, values=values)


def rmsnorm_qkv_rope_shapes(x, k_cache, *, num_heads, slot_offset=0):
    B, N = x.shape[:2]
    return (B, slot_offset + N, num_heads, k_cache.shape[-1]), tuple(x.shape)


def check_q8_0_linear(x, quants, scales, *, residual=None, values=True):
    K = _gemm_rows(x, HALF_AND_SINGLE)
    check_tensor("quants", quants, dtype=torch.int8, ndim=2, device=x.device)
    if quants.shape[1] != K or K % 32:
        _fail("quants", f"shape [N, {K}] (x's last dim K, a multiple of 32)", f"shape {tuple(quants.shape)}")
    N = quants.shape[0]
    check_tensor("scales", scales, dtype=torch.float16, shape=(N, K // 32), device=x.device)
    _gemm_residual(residual, x, N)


def q8_0_linear_shape(x, quants, scales, *, residual=None):
    return (*x.shape[:-1], quants.shape[0])


def check_fp8_linear(x, weight, weight_scale, *, residual=None, values=True):
    K = _gemm_rows(x, (torch.float32, torch.float16, torch.bfloat16))
    check_tensor("weight", weight, dtype=torch.float8_e4m3fn, ndim=2, device=x.device)
    if weight.shape[1] != K or K % 128:
        _fail("weight", f"shape [N, {K}] (x's last dim K, a multiple of 128)", f"shape {tuple(weight.shape)}")
    N = weight.shape[0]
    check_tensor("weight_scale", weight_scale, dtype=torch.float32, shape=(N,), device=x.device)
    _gemm_residual(residual, x, N)


def fp8_linear_shape(x, weight, weight_scale, *, residual=None):
    return (*x.shape[:-1], weight.shape[0])
