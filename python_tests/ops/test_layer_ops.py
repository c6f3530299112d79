"""The ops of the GPU decoder layer (rmsnorm, rope_write_kv, silu_mul, rmsnorm_linear, rmsnorm_qkv_rope, o_proj_mlp, the
8-bit GEMMs): the
Triton launchers
against the reference under TRITON_INTERPRET=1, with their interpreter and GPU launch
configurations; registration, fakes and opcheck; bad input. Tests running Triton carry
"triton" in their names (slow lane)."""

import dataclasses

import pytest
import torch

import eagle_kernels
from eagle_kernels import _dispatch, reference
from eagle_kernels._schemas import LAYER_OPS, LAYER_SCHEMAS

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def triton_module(op):
    fn, reason = _dispatch.implementation(op, "triton", "cpu")
    if fn is None:
        pytest.skip(reason)
    import importlib

    return importlib.import_module(f"eagle_kernels.triton.{op}")


def configs(module):
    return [("interpreter", module.INTERPRETER_CONFIG), ("gpu", module.GPU_CONFIG)]


def assert_close(got, want, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def rope_tables(P, D, theta=10000.0):
    angles = torch.arange(P, dtype=torch.float64)[:, None] / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    return angles.cos().float(), angles.sin().float()


def rope_inputs(dtype, B=2, N=3, Hq=4, Hkv=2, D=16, S=12, slot_offset=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    positions = torch.randint(0, 20, (B, N), generator=g)
    cos, sin = rope_tables(24, D)
    k_cache = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    seqlens = torch.tensor([2, 5][:B], dtype=torch.int32)
    return (qkv, positions, cos, sin, k_cache, v_cache, seqlens), {"num_heads": Hq, "slot_offset": slot_offset}


def small_inputs(op, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    if op == "rmsnorm":
        x = torch.randn(2, 3, 20, generator=g).to(dtype)
        embed, embed_weight = torch.randn(2, 3, 20, generator=g).to(dtype), torch.randn(20, generator=g).to(dtype)
        return (x, torch.randn(20, generator=g).to(dtype), 1e-5), {"embed": embed, "embed_weight": embed_weight}
    if op == "rope_write_kv":
        return rope_inputs(dtype, slot_offset=2)
    if op == "silu_mul":
        return (torch.randn(2, 3, 14, generator=g).to(dtype),), {}
    if op == "rmsnorm_linear":
        x, weight = torch.randn(2, 3, 20, generator=g).to(dtype), torch.randn(12, 20, generator=g).to(dtype)
        return (x, weight, torch.randn(20, generator=g).to(dtype), 1e-5), {"gated": True}
    if op == "rmsnorm_qkv_rope":
        return qkv_rope_inputs(dtype, slot_offset=2)
    if op == "o_proj_mlp":
        return o_proj_mlp_inputs(dtype, 6, 20, 12, 14, seed=1, batch=(2, 3)), {}
    if op == "q8_0_linear":
        x, quants, scales = q8_inputs(dtype, 6, 64, 12)
        return (x.view(2, 3, 64), quants, scales), {"residual": torch.randn(2, 3, 12, generator=g).to(dtype)}
    if op == "fp8_linear":
        x, weight, scale = fp8_inputs(dtype, 6, 128, 12)
        return (x.view(2, 3, 128), weight, scale), {"residual": torch.randn(2, 3, 12, generator=g).to(dtype)}
    raise AssertionError(op)


def fp8_inputs(dtype, rows, K, N, seed=0):
    """x [rows, K] and a random [N, K] matrix as fp8 with per-row scales."""
    from eagle_kernels.reference.fp8_linear import quantize_fp8

    g = torch.Generator().manual_seed(seed)
    weight, scale = quantize_fp8(torch.randn(N, K, generator=g) / K ** 0.5)
    return (torch.randn(rows, K, generator=g) * 3).to(dtype), weight, scale


def q8_inputs(dtype, rows, K, N, seed=0):
    """x [rows, K] and a random [N, K] matrix as Q8_0 (GGML's quantizer, split for the GPU kernel)."""
    from eagle_kernels.reference.cpu_linear import quantize
    from eagle_kernels.reference.q8_0_linear import split_q8_0

    g = torch.Generator().manual_seed(seed)
    blocks = quantize(torch.randn(N, K, generator=g) / K ** 0.5, "q8_0")
    return (torch.randn(rows, K, generator=g).to(dtype), *split_q8_0(blocks))


def qkv_rope_inputs(dtype, B=2, N=3, K=20, Hq=4, Hkv=2, D=16, S=12, slot_offset=0, norm=True, seed=0):
    (qkv, positions, cos, sin, k_cache, v_cache, seqlens), kwargs = rope_inputs(dtype, B, N, Hq, Hkv, D, S,
                                                                                 slot_offset, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(B, N, K, generator=g).to(dtype)
    weight = (torch.randn((Hq + 2 * Hkv) * D, K, generator=g) / K ** 0.5).to(dtype)
    norm_weight = (1 + 0.2 * torch.randn(K, generator=g)).to(dtype) if norm else None
    return (x, weight, norm_weight, 1e-5, positions, cos, sin, k_cache, v_cache, seqlens), kwargs


# ------------------------------------------------------------------ Triton against the reference
RMSNORM_CASES = [(torch.float32, 64, False), (torch.float32, 20, True), (torch.bfloat16, 20, False),
                 (torch.bfloat16, 64, True), (torch.float16, 20, True)]


@pytest.mark.parametrize("dtype,H,embed", RMSNORM_CASES, ids=["fp32-H64", "fp32-H20-embed", "bf16-H20",
                                                              "bf16-H64-embed", "fp16-H20-embed"])
def test_rmsnorm_triton_matches_reference(dtype, H, embed):
    module = triton_module("rmsnorm")
    g = torch.Generator().manual_seed(H)
    x = (torch.randn(3, 5, H, generator=g) * 3).to(dtype)
    weight = torch.randn(H, generator=g).to(dtype)
    extra = {"embed": torch.randn(3, 5, H, generator=g).to(dtype),
             "embed_weight": torch.randn(H, generator=g).to(dtype)}
    extra = extra if embed else {}
    want_out, want_residual = reference.rmsnorm(x, weight, 1e-5, **extra)
    assert want_out.shape == (3, 5, 2 * H if embed else H)
    for name, config in configs(module):
        out, residual = module.rmsnorm(x, weight, 1e-5, _config=config, **extra)
        assert out.dtype == dtype and out.shape == want_out.shape, name
        assert_close(out, want_out, dtype)
        assert torch.equal(residual, x) and residual.data_ptr() != x.data_ptr(), name


def test_rmsnorm_triton_strided_rows_and_float32_rule():
    """Strided rows are copied first; the fp32 result is F.rms_norm's (what TorchLayerPath runs)."""
    module = triton_module("rmsnorm")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 48, generator=g)[:, :24]
    weight = torch.randn(24, generator=g)
    out, residual = module.rmsnorm(x, weight, 1e-6)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (24,), weight, 1e-6), rtol=1e-6, atol=1e-6)
    assert torch.equal(residual, x)


ROPE_CASES = [(torch.float32, 0, (4, 2, 16)), (torch.float32, 3, (3, 3, 8)), (torch.float32, 3, (6, 1, 32)),
              (torch.bfloat16, 3, (4, 2, 16)), (torch.float16, 0, (4, 2, 16))]


@pytest.mark.parametrize("dtype,slot_offset,heads", ROPE_CASES,
                         ids=["fp32-gqa", "fp32-mha-offset3", "fp32-mqa-D32-offset3", "bf16-gqa-offset3", "fp16-gqa"])
def test_rope_write_kv_triton_matches_reference(dtype, slot_offset, heads):
    module = triton_module("rope_write_kv")
    Hq, Hkv, D = heads
    args, kwargs = rope_inputs(dtype, Hq=Hq, Hkv=Hkv, D=D, slot_offset=slot_offset)
    want_k, want_v = args[4].clone(), args[5].clone()
    want_q = reference.rope_write_kv(*args[:4], want_k, want_v, args[6], **kwargs)
    for name, config in configs(module):
        k, v = args[4].clone(), args[5].clone()
        q = module.rope_write_kv(*args[:4], k, v, args[6], _config=config, **kwargs)
        assert q.shape == want_q.shape == (2, slot_offset + 3, Hq, D) and q.dtype == dtype, name
        assert_close(q, want_q, dtype)
        assert torch.equal(q[:, :slot_offset], torch.zeros_like(q[:, :slot_offset])), name
        assert_close(k, want_k, dtype)
        assert torch.equal(v, want_v), name  # v is copied
        untouched = torch.ones(k.shape[:2], dtype=torch.bool)
        for b, start in enumerate(args[6].tolist()):
            untouched[b, start + slot_offset:start + slot_offset + 3] = False
        assert torch.equal(k[untouched], args[4][untouched]) and torch.equal(v[untouched], args[5][untouched]), name


def test_rope_write_kv_triton_broadcast_int32_positions_and_layer_views():
    """Positions as a drafting pass gives them (one per request, expanded: stride 0, int32) and
    caches that are one layer of a [L, B, S, Hkv, D] buffer."""
    module = triton_module("rope_write_kv")
    args, kwargs = rope_inputs(torch.float32)
    qkv, _, cos, sin, k_cache, v_cache, seqlens = args
    positions = torch.tensor([[4], [9]], dtype=torch.int32).expand(2, 3)
    k_all, v_all = torch.zeros(3, *k_cache.shape), torch.zeros(3, *v_cache.shape)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = reference.rope_write_kv(qkv, positions.long(), cos, sin, want_k, want_v, seqlens, **kwargs)
    k_all[1], v_all[1] = k_cache, v_cache
    got = module.rope_write_kv(qkv, positions, cos, sin, k_all[1], v_all[1], seqlens, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_all[1], want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v_all[1], want_v) and not k_all[0].any() and not k_all[2].any()


def test_rope_write_kv_triton_unchecked_position_outside_tables(monkeypatch):
    """Values unchecked (as on a GPU): a position past the tables gives zero q and k rows, and
    nothing is read outside the tables."""
    module = triton_module("rope_write_kv")
    monkeypatch.setenv("EAGLE_KERNELS_CHECK_VALUES", "0")
    args, kwargs = rope_inputs(torch.float32)
    qkv, positions, cos, sin, k_cache, v_cache, seqlens = args
    positions = positions.clone()
    positions[1, 2] = cos.shape[0] + 1000
    q = module.rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, seqlens, **kwargs)
    assert not q[1, 2].any() and not k_cache[1, int(seqlens[1]) + 2].any() and q[1, 1].any()


def test_rope_write_kv_reference_is_rotate():
    """The reference's rotation is the model's ``rotate`` with tables from its RoPE frequencies."""
    from eagle_kernels.models.layers import rotate

    args, kwargs = rope_inputs(torch.float64)
    qkv, positions, cos, sin, k_cache, v_cache, seqlens = args
    q = reference.rope_write_kv(qkv, positions, cos.double(), sin.double(), k_cache, v_cache, seqlens, **kwargs)
    c = cos.double()[positions].repeat(1, 1, 2)[:, :, None]
    s = sin.double()[positions].repeat(1, 1, 2)[:, :, None]
    torch.testing.assert_close(q, rotate(qkv.view(2, 3, 8, 16)[:, :, :4], c, s), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("I", [7, 1500], ids=["I7", "I1500"])
def test_silu_mul_triton_matches_reference(dtype, I):
    module = triton_module("silu_mul")
    g = torch.Generator().manual_seed(I)
    gate_up = (torch.randn(2, 3, 2 * I, generator=g) * 4).to(dtype)
    want = reference.silu_mul(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(want.float(), (torch.nn.functional.silu(gate) * up).to(dtype).float(),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    for name, config in configs(module):
        got = module.silu_mul(gate_up, _config=config)
        assert got.shape == (2, 3, I) and got.dtype == dtype, name
        assert_close(got, want, dtype)


# (rows, K, N, gated, norm, strided rows): SmolLM2-135M's widths (q/k/v 960, gate/up 2 x 1536 over K 576) for a
# decoding row and a verify tree, and odd sizes that leave every block partial.
RMSNORM_LINEAR_CASES = [(1, 576, 960, False, True, False), (61, 576, 1536, True, True, False),
                        (5, 100, 40, False, False, True), (70, 96, 66, True, True, True),
                        (17, 33, 7, True, False, False)]


def rmsnorm_linear_inputs(dtype, rows, K, N, gated, norm, strided, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * K if strided else K, generator=g).to(dtype)[:, :K]  # strided: every other half row
    weight = (torch.randn(2 * N if gated else N, K, generator=g) / K ** 0.5).to(dtype)
    norm_weight = (1 + 0.2 * torch.randn(K, generator=g)).to(dtype) if norm else None
    return x, weight, norm_weight


def test_rmsnorm_linear_reference_is_the_unfused_layer():
    """§17 in float64 is §9 then the GEMM then §11 (one rounding at float64 precision); in bf16 the reference
    keeps SwiGLU's inputs unrounded: within one rounding of the unfused sequence in fp32."""
    x, weight, norm_weight = rmsnorm_linear_inputs(torch.float64, 7, 24, 10, True, True, False)
    out, residual = reference.rmsnorm_linear(x, weight, norm_weight, 1e-5, gated=True)
    h, _ = reference.rmsnorm(x, norm_weight, 1e-5)
    torch.testing.assert_close(out, reference.silu_mul(h @ weight.t()), rtol=1e-12, atol=1e-12)
    assert torch.equal(residual, x) and residual.data_ptr() != x.data_ptr()
    x16, w16, n16 = (t.to(torch.bfloat16) for t in (x, weight, norm_weight))
    out16, _ = reference.rmsnorm_linear(x16, w16, n16, 1e-5, gated=True)
    h16, _ = reference.rmsnorm(x16, n16, 1e-5)
    want = torch.nn.functional.silu((h16.float() @ w16.float().t())[:, :10]) * (h16.float() @ w16.float().t())[:, 10:]
    torch.testing.assert_close(out16.float(), want, rtol=4e-3, atol=4e-3)  # one bf16 rounding
    plain, _ = reference.rmsnorm_linear(x, weight, None, 1e-5)
    torch.testing.assert_close(plain, x @ weight.t(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,K,N,gated,norm,strided", RMSNORM_LINEAR_CASES,
                         ids=["rows1-qkv", "rows61-gateup", "K100-plain-strided", "rows70-gated-strided",
                              "K33-gated-nonorm"])
def test_rmsnorm_linear_triton_matches_reference(dtype, rows, K, N, gated, norm, strided):
    """The interpreter's and the GPU's configurations against the reference. The interpreter rounds fp32 to bf16
    toward zero, not to nearest as a GPU does, at each of §9's two roundings and the output's: up to about three
    bf16 steps off; so bf16 within 5e-2, fp16 and fp32 at the usual tolerance."""
    module = triton_module("rmsnorm_linear")
    x, weight, norm_weight = rmsnorm_linear_inputs(dtype, rows, K, N, gated, norm, strided, seed=rows)
    want, want_residual = reference.rmsnorm_linear(x, weight, norm_weight, 1e-5, gated=gated)
    for name, config in configs(module):
        got, residual = module.rmsnorm_linear(x, weight, norm_weight, 1e-5, gated=gated, _config=config)
        assert got.shape == (rows, N) and got.dtype == dtype and got.is_contiguous(), name
        tol = 5e-2 if dtype == torch.bfloat16 else TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        assert torch.equal(residual, want_residual) and residual.is_contiguous(), name


# (rows, K, N, norm): SmolLM2-135M's o (576 -> 576) and down (1536 -> 576) projections for a decoding row and a
# verify tree, and odd sizes.
RMSNORM_LINEAR_ADD_CASES = [(1, 576, 576, False), (61, 1536, 576, False), (17, 33, 7, True), (70, 96, 66, False)]


def test_rmsnorm_linear_reference_adds_before_its_rounding():
    """With ``add``: in float64 add + the product; in bf16 one rounding of the fp32 sum (not the bf16 sum of a
    rounded product), so it can differ from addmm of rounded parts but never by more than one rounding."""
    x, weight, _ = rmsnorm_linear_inputs(torch.float64, 7, 24, 10, False, False, False)
    add = torch.randn(7, 10, dtype=torch.float64)
    out, residual = reference.rmsnorm_linear(x, weight, None, 1e-5, add=add)
    torch.testing.assert_close(out, add + x @ weight.t(), rtol=1e-12, atol=1e-12)
    assert torch.equal(residual, x)
    x16, w16, a16 = (t.to(torch.bfloat16) for t in (x, weight, add))
    out16, _ = reference.rmsnorm_linear(x16, w16, None, 1e-5, add=a16)
    assert torch.equal(out16, (a16.float() + x16.float() @ w16.float().t()).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,K,N,norm", RMSNORM_LINEAR_ADD_CASES,
                         ids=["rows1-o", "rows61-down", "K33-norm", "rows70"])
def test_rmsnorm_linear_triton_add_matches_reference(dtype, rows, K, N, norm):
    """The o / down form (no norm, the residual added in the epilogue) in every launch configuration."""
    module = triton_module("rmsnorm_linear")
    x, weight, norm_weight = rmsnorm_linear_inputs(dtype, rows, K, N, False, norm, False, seed=rows)
    add = torch.randn(rows, N, generator=torch.Generator().manual_seed(rows + 1)).to(dtype)
    want, _ = reference.rmsnorm_linear(x, weight, norm_weight, 1e-5, add=add)
    for name, config in configs(module):
        got, residual = module.rmsnorm_linear(x, weight, norm_weight, 1e-5, add=add, _config=config)
        tol = 5e-2 if dtype == torch.bfloat16 else TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=name)
        assert torch.equal(residual, x), name
    batched, _ = module.rmsnorm_linear(x.view(1, rows, K), weight, norm_weight, 1e-5, add=add.view(1, rows, N))
    assert batched.shape == (1, rows, N)
    empty, _ = module.rmsnorm_linear(x, weight[:0], norm_weight, 1e-5, add=add[:, :0])
    assert empty.shape == (rows, 0)


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_rmsnorm_linear_nan_row_stays_in_its_row(backend_name):
    """A NaN in one input row (no error: values are not checked) makes that row's outputs NaN and leaves every
    other row as without it; the copy keeps the NaN."""
    fn, reason = _dispatch.implementation("rmsnorm_linear", backend_name, "cpu")
    if fn is None:
        pytest.skip(reason)
    x, weight, norm_weight = rmsnorm_linear_inputs(torch.float32, 6, 20, 12, True, True, False)
    clean, _ = fn(x, weight, norm_weight, 1e-5, gated=True)
    x[2, 5] = float("nan")
    got, residual = fn(x, weight, norm_weight, 1e-5, gated=True)
    assert got[2].isnan().all() and residual[2, 5].isnan()
    others = [0, 1, 3, 4, 5]
    assert torch.equal(got[others], clean[others])


def test_rmsnorm_linear_triton_batched_rows_and_empty():
    """[B, N, K] rows keep their leading dims; zero rows or zero outputs launch nothing and still copy x."""
    module = triton_module("rmsnorm_linear")
    x, weight, norm_weight = rmsnorm_linear_inputs(torch.float32, 6, 20, 12, True, True, False)
    got, residual = module.rmsnorm_linear(x.view(2, 3, 20), weight, norm_weight, 1e-5, gated=True)
    want, _ = reference.rmsnorm_linear(x, weight, norm_weight, 1e-5, gated=True)
    assert got.shape == (2, 3, 12) and residual.shape == (2, 3, 20)
    assert_close(got.view(6, 12), want, torch.float32)
    empty, copy = module.rmsnorm_linear(x, weight[:0], norm_weight, 1e-5)
    assert empty.shape == (6, 0) and torch.equal(copy, x)
    none, _ = module.rmsnorm_linear(x[:0], weight, norm_weight, 1e-5)
    assert none.shape == (0, 24)


def test_rmsnorm_qkv_rope_reference_is_rmsnorm_linear_then_rope_write_kv():
    """§18 in float64: §17's projection, then §10 (float64 leaves nothing to round between them)."""
    args, kwargs = qkv_rope_inputs(torch.float64, slot_offset=2)
    x, weight, norm_weight, eps, positions, cos, sin, k_cache, v_cache, seqlens = args
    k_want, v_want = k_cache.clone(), v_cache.clone()
    qkv, _ = reference.rmsnorm_linear(x, weight, norm_weight, eps)
    q_want = reference.rope_write_kv(qkv, positions, cos, sin, k_want, v_want, seqlens, **kwargs)
    q, residual = reference.rmsnorm_qkv_rope(*args, **kwargs)
    torch.testing.assert_close(q, q_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k_cache, k_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v_cache, v_want, rtol=1e-12, atol=1e-12)
    assert torch.equal(residual, x) and not q[:, :2].any()


# (B, N, K, Hq, Hkv, D, S, slot offset, norm): a SmolLM2-135M decoding row and verify tree (K 576, 9 / 3 heads of
# 64), a draft pass at a slot offset without a norm (EAGLE-1's head), and an odd head dim.
QKV_ROPE_CASES = [(1, 1, 576, 9, 3, 64, 8, 0, True), (1, 61, 576, 9, 3, 64, 70, 0, True),
                  (2, 3, 20, 4, 2, 16, 12, 2, False), (2, 5, 33, 2, 1, 6, 12, 1, True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B,N,K,Hq,Hkv,D,S,slot_offset,norm", QKV_ROPE_CASES,
                         ids=["smollm2-row", "smollm2-tree61", "slot-offset-nonorm", "D6"])
def test_rmsnorm_qkv_rope_triton_matches_reference(dtype, B, N, K, Hq, Hkv, D, S, slot_offset, norm):
    """q, the cache rows written (and no other row), the copy; bf16 within 5e-2 as for rmsnorm_linear (the
    interpreter rounds toward zero)."""
    module = triton_module("rmsnorm_qkv_rope")
    args, kwargs = qkv_rope_inputs(dtype, B, N, K, Hq, Hkv, D, S, slot_offset, norm, seed=N)
    x, weight, norm_weight, eps, positions, cos, sin, k_cache, v_cache, seqlens = args
    k_want, v_want = k_cache.clone(), v_cache.clone()
    want, want_residual = reference.rmsnorm_qkv_rope(x, weight, norm_weight, eps, positions, cos, sin, k_want,
                                                     v_want, seqlens, **kwargs)
    tol = 5e-2 if dtype == torch.bfloat16 else TOLERANCE[dtype]
    for name, config in configs(module):
        k_got, v_got = k_cache.clone(), v_cache.clone()
        got, residual = module.rmsnorm_qkv_rope(x, weight, norm_weight, eps, positions, cos, sin, k_got, v_got,
                                                seqlens, _config=config, **kwargs)
        assert got.shape == want.shape and got.dtype == k_cache.dtype, name
        for what, g, w in (("q", got, want), ("k", k_got, k_want), ("v", v_got, v_want)):
            torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol, msg=lambda m: f"{name} {what}: {m}")
        written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
        for b in range(B):
            written[b, int(seqlens[b]) + slot_offset:int(seqlens[b]) + slot_offset + N] = True
        assert torch.equal(k_got[~written], k_cache[~written]) and torch.equal(v_got[~written], v_cache[~written])
        assert not got[:, :slot_offset].any() and torch.equal(residual, want_residual), name


# ------------------------------------------------------------------ o_proj_mlp
def o_proj_mlp_inputs(dtype, rows, Ka, H, inner, seed=0, batch=None):
    """(attention, residual, o_weight, norm_weight, gate_up_weight, down_weight, eps), rows shaped ``batch``."""
    g = torch.Generator().manual_seed(seed)
    shape = batch or (rows,)
    attention = torch.randn(*shape, Ka, generator=g).to(dtype)
    residual = torch.randn(*shape, H, generator=g).to(dtype)
    o_weight = (torch.randn(H, Ka, generator=g) / Ka ** 0.5).to(dtype)
    norm_weight = (1 + 0.2 * torch.randn(H, generator=g)).to(dtype)
    gate_up = (torch.randn(2 * inner, H, generator=g) / H ** 0.5).to(dtype)
    down = (torch.randn(H, inner, generator=g) / inner ** 0.5).to(dtype)
    return attention, residual, o_weight, norm_weight, gate_up, down, 1e-5


def test_o_proj_mlp_reference_is_the_layer_after_attention():
    """In float64: the o projection added into the residual, then the residual plus the SwiGLU MLP of its norm."""
    attention, residual, o_weight, norm_weight, gate_up, down, eps = o_proj_mlp_inputs(torch.float64, 7, 24, 16, 10)
    out = reference.o_proj_mlp(attention, residual, o_weight, norm_weight, gate_up, down, eps)
    mid = residual + attention @ o_weight.t()
    h = mid / torch.sqrt(mid.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
    gate, up = (h @ gate_up.t()).chunk(2, dim=-1)
    torch.testing.assert_close(out, mid + (torch.nn.functional.silu(gate) * up) @ down.t(), rtol=1e-12, atol=1e-12)


# (dtype, rows, Ka, H, I): SmolLM2-135M's widths at a decoding row and a verify tree's 61 rows (bf16); two row blocks
# of odd widths in every dtype (fp32's gate/up tiles are half as wide; the gate/up phase of a row block waits for that
# block's o tiles only).
O_PROJ_MLP_CASES = [(torch.bfloat16, 1, 576, 576, 1536), (torch.bfloat16, 61, 576, 576, 1536)] + \
    [(dtype, 70, 40, 48, 72) for dtype in DTYPES]


@pytest.mark.parametrize("dtype,rows,Ka,H,inner", O_PROJ_MLP_CASES,
                         ids=["bf16-rows1-smollm2", "bf16-rows61-smollm2", "fp32-rows70-odd", "bf16-rows70-odd",
                              "fp16-rows70-odd"])
def test_o_proj_mlp_triton_is_three_rmsnorm_linear_launches(dtype, rows, Ka, H, inner):
    """Bit for bit the three rmsnorm_linear launches it replaces (each tile is theirs), in both launch configurations,
    and near the reference; the control words are zero again after the launch."""
    module = triton_module("o_proj_mlp")
    linear = triton_module("rmsnorm_linear")
    args = o_proj_mlp_inputs(dtype, rows, Ka, H, inner, seed=rows)
    attention, residual, o_weight, norm_weight, gate_up, down, eps = args
    want = reference.o_proj_mlp(*args)
    for name, config in configs(module):
        got = module.o_proj_mlp(*args, _config=config)
        assert got.shape == residual.shape and got.dtype == dtype and got.is_contiguous(), name
        tiles = linear.RmsnormLinearConfig(config.block_m, config.block_n, config.block_k, config.num_warps,
                                           config.num_stages)
        mid, _ = linear.rmsnorm_linear(attention, o_weight, None, eps, add=residual, _config=tiles)
        act, _ = linear.rmsnorm_linear(mid, gate_up, norm_weight, eps, gated=True, _config=tiles)
        three, _ = linear.rmsnorm_linear(act, down, None, eps, add=mid, _config=tiles)
        assert torch.equal(got, three), name
        tol = 5e-2 if dtype == torch.bfloat16 else TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=name)
        assert not module.tickets(got.device, 64).any(), name


def test_o_proj_mlp_triton_programs_take_items_in_any_number():
    """One program or more programs than items: the same result (the items are taken from one counter)."""
    module = triton_module("o_proj_mlp")
    args = o_proj_mlp_inputs(torch.float32, 70, 40, 48, 72, seed=5, batch=(2, 35))
    base = module.o_proj_mlp(*args)
    for programs in (1, 2, 1000):
        config = dataclasses.replace(module.INTERPRETER_CONFIG, programs=programs)
        assert torch.equal(module.o_proj_mlp(*args, _config=config), base), programs
    assert base.shape == (2, 35, 48)


def test_o_proj_mlp_triton_is_one_launch_and_empty_rows_launch_nothing():
    from eagle_kernels import launch_count

    module = triton_module("o_proj_mlp")
    args = o_proj_mlp_inputs(torch.float32, 3, 16, 8, 12)
    module.o_proj_mlp(*args)  # the device's control words made (a fill, once per process)
    with launch_count.counting() as counts:
        module.o_proj_mlp(*args)
    assert counts.total == 1
    attention, residual, *rest = args
    with launch_count.counting() as counts:
        empty = module.o_proj_mlp(attention[:0], residual[:0], *rest)
    assert counts.total == 0 and empty.shape == (0, 8)


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_o_proj_mlp_nan_row_stays_in_its_row(backend_name):
    """A NaN in one attention row makes that output row NaN and leaves the others as without it."""
    fn, reason = _dispatch.implementation("o_proj_mlp", backend_name, "cpu")
    if fn is None:
        pytest.skip(reason)
    args = list(o_proj_mlp_inputs(torch.float32, 6, 20, 12, 14))
    clean = fn(*args)
    args[0] = args[0].clone()
    args[0][2, 5] = float("nan")
    got = fn(*args)
    assert got[2].isnan().all()
    assert torch.equal(got[[0, 1, 3, 4, 5]], clean[[0, 1, 3, 4, 5]])


def test_split_q8_0_is_the_block_rows():
    """The split form holds the block rows' values: quants x scales is their exact dequantization."""
    from eagle_kernels.reference.cpu_linear import dequantize, quantize
    from eagle_kernels.reference.q8_0_linear import dequantize_q8_0, split_q8_0

    blocks = quantize(torch.randn(40, 96, generator=torch.Generator().manual_seed(3)), "q8_0")
    quants, scales = split_q8_0(blocks)
    assert quants.shape == (40, 96) and quants.dtype == torch.int8 and quants.is_contiguous()
    assert scales.shape == (40, 3) and scales.dtype == torch.float16 and scales.is_contiguous()
    assert torch.equal(dequantize_q8_0(quants, scales), dequantize(blocks))
    for bad in (blocks.view(torch.uint8), blocks[:, :-1], blocks[0]):
        with pytest.raises(ValueError, match="^blocks:"):
            split_q8_0(bad)


def test_q8_0_linear_reference_is_the_dequantized_product():
    """§19 in float64 is x times the exactly dequantized matrix, plus the residual; in bf16 one rounding of the
    fp32 product (the weights are never rounded to bf16)."""
    from eagle_kernels.reference.q8_0_linear import dequantize_q8_0

    x, quants, scales = q8_inputs(torch.float64, 5, 96, 24)
    residual = torch.randn(5, 24, dtype=torch.float64)
    w = dequantize_q8_0(quants, scales, torch.float64)
    torch.testing.assert_close(reference.q8_0_linear(x, quants, scales), x @ w.t(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reference.q8_0_linear(x, quants, scales, residual=residual), residual + x @ w.t(),
                               rtol=1e-12, atol=1e-12)
    x16, r16 = x.to(torch.bfloat16), residual.to(torch.bfloat16)
    want = (r16.double() + x16.double() @ w.t()).float()
    torch.testing.assert_close(reference.q8_0_linear(x16, quants, scales, residual=r16).float(), want,
                               rtol=4e-3, atol=4e-3)


# (rows, K, N): a decoding row at SmolLM2-135M's q/k/v (K 576: 64-k steps), a verify tree's rows over the gate's
# 1536 columns (enough programs that the GPU configuration keeps 64 columns a program; K 192, the same 64-k steps
# as the gate's 576, three of them rather than nine: the interpreter's time), a commit's few rows over a 2 x 96
# input (K 192), one group (K 32) and columns past a block's end.
Q8_CASES = [(1, 576, 960), (61, 192, 1536), (7, 192, 40), (3, 32, 7), (20, 256, 70)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,K,N", Q8_CASES, ids=["rows1-qkv", "rows61-N1536", "rows7-K192", "K32", "rows20-N70"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_q8_0_linear_triton_matches_reference(dtype, rows, K, N, residual):
    """Every launch configuration (the interpreter's, the GPU's 16-bit and fp32 ones) against the reference. The
    interpreter rounds fp32 to bf16 toward zero, not to nearest: bf16 within 5e-2."""
    module = triton_module("q8_0_linear")
    x, quants, scales = q8_inputs(dtype, rows, K, N, seed=rows)
    add = torch.randn(rows, N, generator=torch.Generator().manual_seed(9)).to(dtype) if residual else None
    want = reference.q8_0_linear(x, quants, scales, residual=add)
    for config in (module.INTERPRETER_CONFIG, module.GPU_CONFIG, module.GPU_CONFIG_FP32):
        got = module.q8_0_linear(x, quants, scales, residual=add, _config=config)
        assert got.shape == (rows, N) and got.dtype == dtype and got.is_contiguous(), config
        tol = 5e-2 if dtype == torch.bfloat16 else TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_q8_0_linear_triton_strided_batched_and_empty():
    """[B, N, K] rows with a strided row dim keep their leading dims; zero rows or columns launch nothing."""
    module = triton_module("q8_0_linear")
    x, quants, scales = q8_inputs(torch.float32, 6, 64, 12)
    wide = torch.cat([x, x], dim=1)[:, :64]  # row stride 128
    got = module.q8_0_linear(wide.view(2, 3, 64), quants, scales)
    assert got.shape == (2, 3, 12)
    assert_close(got.view(6, 12), reference.q8_0_linear(x, quants, scales), torch.float32)
    assert module.q8_0_linear(x[:0], quants, scales).shape == (0, 12)
    assert module.q8_0_linear(x, quants[:0], scales[:0]).shape == (6, 0)


def test_q8_0_linear_launch_rules():
    """The K step divides K (no masks in the loop); column blocks narrow to 32 until the programs fill half the
    SMs, never below."""
    module = triton_module("q8_0_linear")
    assert [module.k_block(256, K) for K in (32, 96, 576, 4096, 14336)] == [32, 32, 64, 256, 256]
    assert module.column_block(64, 4096, 1, 132) == 32  # 64 programs of 64 fill under half of 132 SMs
    assert module.column_block(64, 6144, 1, 132) == 64  # 96 programs
    assert module.column_block(64, 28672, 1, 132) == 64
    assert module.column_block(64, 576, 1, 132) == 32
    assert module.column_block(64, 40, 1, 132) == 32 and module.column_block(64, 7, 1, 132) == 16


def test_fp8_linear_reference_rounds_as_the_contract():
    """§20 by hand: the weights' per-row scales and e4m3 rounding; the activations' per-(row, 128-k block)
    scales, zeros for an all-zero block; the float64 sum of the scaled block products."""
    from eagle_kernels.reference.fp8_linear import quantize_fp8, round_activations

    w = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    w[2] = 0
    weight, scale = quantize_fp8(w)
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale[2] == 1
    torch.testing.assert_close(scale[0], w[0].abs().max() / 448)
    assert (weight.float().abs().amax(dim=1)[[0, 1, 3, 4]] == 448).all()
    x = torch.randn(3, 256, dtype=torch.float64)
    x[1, :128] = 0
    q, sx = round_activations(x)
    assert sx[1, 0] == 0 and not q[1, 0].any()
    inv = 1.0 / sx[0, 1]
    assert torch.equal(q[0, 1], (x[0, 128:].float() * inv).to(torch.float8_e4m3fn).float())
    want = torch.einsum("rbk,nbk,rb->rn", q.double(), weight.double().view(5, 2, 128), sx.double()) * scale.double()
    torch.testing.assert_close(reference.fp8_linear(x.float(), weight, scale), want.float(), rtol=1e-6, atol=1e-6)
    for bad in (torch.ones(4), torch.full((2, 2), float("nan")), torch.ones(2, 2, dtype=torch.int32)):
        with pytest.raises(ValueError, match="^weight:"):
            quantize_fp8(bad)


# (rows, K, N): a decoding row at K 640 (128-k steps), a verify tree at K 1152 (two K steps of the GPU's 256 and
# one of 128), one block (K 128), rows and columns past a block's end.
FP8_CASES = [(1, 640, 960), (61, 1152, 576), (7, 128, 40), (20, 256, 70)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,K,N", FP8_CASES, ids=["rows1-K640", "rows61-K1152", "rows7-K128", "rows20-N70"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_fp8_linear_triton_matches_reference(dtype, rows, K, N, residual):
    """Both launch configurations against the reference: the interpreter rounds the activations by the kernel's
    own e4m3 emulation, so fp32 agrees to fp32 rounding (the same fp8 values as torch's cast); bf16 within the
    interpreter's toward-zero output rounding."""
    module = triton_module("fp8_linear")
    x, weight, scale = fp8_inputs(dtype, rows, K, N, seed=rows)
    add = torch.randn(rows, N, generator=torch.Generator().manual_seed(9)).to(dtype) if residual else None
    want = reference.fp8_linear(x, weight, scale, residual=add)
    for config in (module.INTERPRETER_CONFIG, module.GPU_CONFIG):
        got = module.fp8_linear(x, weight, scale, residual=add, _config=config)
        assert got.shape == (rows, N) and got.dtype == dtype and got.is_contiguous(), config
        tol = 5e-2 if dtype == torch.bfloat16 else TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,K,N", FP8_CASES, ids=["rows1-K640", "rows61-K1152", "rows7-K128", "rows20-N70"])
def test_fp8_linear_rounding_launch_gives_the_same_bits(dtype, rows, K, N):
    """The activations rounded by a launch of their own (where a GEMM has several column programs) and rounded in
    every program give the same bits, in both launch configurations, for strided rows, with a residual and with a
    NaN row (its outputs NaN, the other rows untouched); the rounding launch is one more Triton launch."""
    from eagle_kernels.launch_count import counting

    module = triton_module("fp8_linear")
    x, weight, scale = fp8_inputs(dtype, rows, K + 128, N, seed=rows)
    x, weight = x[:, 64:K + 64], weight[:, :K].contiguous()  # rows strided, K + 128 apart
    x[-1, 3] = float("nan")
    add = torch.randn(rows, N, generator=torch.Generator().manual_seed(9)).to(dtype)
    for config in (module.INTERPRETER_CONFIG, module.GPU_CONFIG):
        in_programs = module.fp8_linear(x, weight, scale, residual=add, _config=config, _round_first=False)
        with counting() as launches:
            rounded_first = module.fp8_linear(x, weight, scale, residual=add, _config=config, _round_first=True)
        assert [launch.name for launch in launches.launches if launch.kind == "triton"] == [
            "_fp8_round_rows_kernel", "_fp8_linear_kernel"]
        assert torch.equal(rounded_first[:-1], in_programs[:-1]), config
        assert rounded_first[-1].isnan().all() and in_programs[-1].isnan().all()


def test_fp8_linear_rounds_first_where_several_programs_share_the_rows():
    """The default: one launch where the matrix's columns are one program's, the rounding launch first where there
    are more."""
    from eagle_kernels.launch_count import counting

    module = triton_module("fp8_linear")
    x, weight, scale = fp8_inputs(torch.float32, 3, 256, 128)
    for N, want in ((32, ["_fp8_linear_kernel"]), (128, ["_fp8_round_rows_kernel", "_fp8_linear_kernel"])):
        with counting() as launches:
            module.fp8_linear(x, weight[:N], scale[:N])
        assert [launch.name for launch in launches.launches if launch.kind == "triton"] == want, N


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize("op", ["q8_0_linear", "fp8_linear"])
def test_8bit_linear_nan_row_stays_in_its_row(op, backend_name):
    """A NaN in one row of x (no error: values are not checked) makes that row's outputs NaN and leaves every other
    row as without it (the fp8 kernel's block scale of that row is NaN, no other row's)."""
    fn, reason = _dispatch.implementation(op, backend_name, "cpu")
    if fn is None:
        pytest.skip(reason)
    x, weight, scale = (q8_inputs if op == "q8_0_linear" else fp8_inputs)(torch.float32, 6, 256, 12)
    clean = fn(x, weight, scale)
    x[2, 5] = float("nan")
    got = fn(x, weight, scale)
    assert got[2].isnan().all()
    others = [0, 1, 3, 4, 5]
    assert torch.equal(got[others], clean[others])


def test_fp8_linear_e4m3_rounding_emulation():
    """The interpreter's rounding of the activations equals torch's float8_e4m3fn cast (to nearest even) at every
    e4m3 value, the midpoints between neighbours (ties), values just off them and the subnormals: one row per
    value set whose largest entry is 448 (scale 1) times the identity, in fp32, gives the rounded row itself."""
    module = triton_module("fp8_linear")
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), -mids,
                        torch.rand(200, generator=torch.Generator().manual_seed(5)) * 448])
    values = values[values.abs() <= 448]
    rows = -(-values.numel() // 127)
    x = torch.zeros(rows * 127)
    x[:values.numel()] = values
    x = torch.cat([torch.full((rows, 1), 448.0), x.view(rows, 127)], dim=1)  # [rows, 128], amax 448
    for round_first in (False, True):
        got = module.fp8_linear(x, torch.eye(128).to(torch.float8_e4m3fn), torch.ones(128), _round_first=round_first)
        assert torch.equal(got, x.to(torch.float8_e4m3fn).float()), round_first


# ------------------------------------------------------------------ registration
@pytest.mark.parametrize("op", LAYER_OPS, ids=LAYER_OPS)
def test_registered_with_schema(op):
    assert str(getattr(torch.ops.eagle_kernels, op).default._schema) == "eagle_kernels::" + LAYER_SCHEMAS[op]


@pytest.mark.parametrize("op", LAYER_OPS, ids=LAYER_OPS)
def test_opcheck(op):
    args, kwargs = small_inputs(op)
    # opcheck's schema check multiplies the inputs, which torch has no CPU kernel for at float8_e4m3fn.
    utils = ("test_faketensor", "test_autograd_registration") if op == "fp8_linear" else None
    torch.library.opcheck(getattr(torch.ops.eagle_kernels, op).default, args, kwargs,
                          **({"test_utils": utils} if utils else {}))


def test_opcheck_rmsnorm_linear_add():
    """The o / down form through the registered op: schema, fake and dispatch with ``add``."""
    g = torch.Generator().manual_seed(3)
    x, weight, add = torch.randn(2, 3, 20, generator=g), torch.randn(12, 20, generator=g), torch.randn(2, 3, 12)
    torch.library.opcheck(torch.ops.eagle_kernels.rmsnorm_linear.default, (x, weight, None, 1e-5), {"add": add})


@pytest.mark.parametrize("op", LAYER_OPS, ids=LAYER_OPS)
def test_fake_shapes_match_real(op):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kwargs = small_inputs(op, torch.bfloat16)
    real = getattr(torch.ops.eagle_kernels, op)(*args, **kwargs)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake_kwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        fake = getattr(torch.ops.eagle_kernels, op)(*fake_args, **fake_kwargs)
    real = real if isinstance(real, (tuple, list)) else [real]
    fake = fake if isinstance(fake, (tuple, list)) else [fake]
    assert [(tuple(t.shape), t.dtype) for t in real] == [(tuple(t.shape), t.dtype) for t in fake]


@pytest.mark.parametrize("op", LAYER_OPS, ids=LAYER_OPS)
def test_backends(op, monkeypatch):
    """No C++ kernel: the reference on CPU, Triton on CUDA; the public op equals the reference."""
    monkeypatch.delenv(_dispatch.BACKEND_ENV, raising=False)
    assert eagle_kernels.backend_of(op, "cpu") == "reference"
    if _dispatch.implementation(op, "triton", "cuda")[0] is not None:
        assert eagle_kernels.backend_of(op, "cuda") == "triton"
    args, kwargs = small_inputs(op)
    clone = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got = getattr(eagle_kernels, op)(*args, **kwargs)
    want = getattr(reference, op)(*clone, **kwargs)
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------ bad input
def bad_cases():
    x, w = torch.randn(2, 8), torch.randn(8)
    rope_args, rope_kwargs = rope_inputs(torch.float32)
    qkv, positions, cos, sin, k, v, seqlens = rope_args

    def rope(**changes):
        named = dict(zip(["qkv", "positions", "cos", "sin", "k_cache", "v_cache", "cache_seqlens"], rope_args))
        kwargs = dict(rope_kwargs)
        for name, value in changes.items():
            (kwargs if name in kwargs else named)[name] = value
        return "rope_write_kv", tuple(named.values()), kwargs

    q8 = q8_inputs(torch.float32, 2, 64, 4)
    f8 = fp8_inputs(torch.float32, 2, 128, 4)
    qkv_args, qkv_kwargs = qkv_rope_inputs(torch.float32)
    qkv_names = ["x", "weight", "norm_weight", "eps", "positions", "cos", "sin", "k_cache", "v_cache",
                 "cache_seqlens"]

    def qkv_rope(**changes):
        named, kwargs = dict(zip(qkv_names, qkv_args)), dict(qkv_kwargs)
        for name, value in changes.items():
            (kwargs if name in kwargs else named)[name] = value
        return "rmsnorm_qkv_rope", tuple(named.values()), kwargs

    mlp = o_proj_mlp_inputs(torch.float32, 4, 16, 8, 6)
    mlp_names = ["attention", "residual", "o_weight", "norm_weight", "gate_up_weight", "down_weight", "eps"]

    def o_mlp(**changes):
        named = dict(zip(mlp_names, mlp))
        named.update(changes)
        return "o_proj_mlp", tuple(named.values()), {}

    return {
        "rmsnorm-x-int": ("x", ("rmsnorm", (x.long(), w.long(), 1e-5), {})),
        "rmsnorm-weight-shape": ("weight", ("rmsnorm", (x, torch.randn(7), 1e-5), {})),
        "rmsnorm-weight-dtype": ("weight", ("rmsnorm", (x, w.double(), 1e-5), {})),
        "rmsnorm-eps": ("eps", ("rmsnorm", (x, w, -1.0), {})),
        "rmsnorm-embed-alone": ("embed_weight", ("rmsnorm", (x, w, 1e-5), {"embed": x})),
        "rmsnorm-embed-shape": ("embed", ("rmsnorm", (x, w, 1e-5), {"embed": x[:1], "embed_weight": w})),
        "rope-qkv-width": ("qkv", rope(qkv=qkv[..., :-16])),
        "rope-qkv-rank": ("qkv", rope(qkv=qkv[0])),
        "rope-num-heads": ("num_heads", rope(num_heads=3)),
        "rope-positions-dtype": ("positions", rope(positions=positions.float())),
        "rope-positions-shape": ("positions", rope(positions=positions[:, :2])),
        "rope-positions-range": ("positions", rope(positions=positions + 100)),
        "rope-cos-width": ("cos", rope(cos=cos[:, :4])),
        "rope-sin-dtype": ("sin", rope(sin=sin.double())),
        "rope-cos-half": ("cos", rope(cos=cos.half(), sin=sin.half())),
        "rope-v-dtype": ("v_cache", rope(v_cache=v.double())),
        "rope-k-strided": ("k_cache", rope(k_cache=k.transpose(1, 2).contiguous().transpose(1, 2))),
        "rope-k-batch": ("k_cache", rope(k_cache=k[:1], v_cache=v[:1])),
        "rope-seqlens-dtype": ("cache_seqlens", rope(cache_seqlens=seqlens.long())),
        "rope-capacity": ("cache_seqlens", rope(cache_seqlens=seqlens + 8)),
        "rope-slot-offset": ("slot_offset", rope(slot_offset=-1)),
        "silu-odd": ("gate_up", ("silu_mul", (torch.randn(2, 7),), {})),
        "silu-int": ("gate_up", ("silu_mul", (torch.ones(2, 8, dtype=torch.int32),), {})),
        "norm-linear-x-int": ("x", ("rmsnorm_linear", (x.long(), torch.randn(4, 8).long(), None, 1e-5), {})),
        "norm-linear-weight-k": ("weight", ("rmsnorm_linear", (x, torch.randn(4, 7), w, 1e-5), {})),
        "norm-linear-weight-1d": ("weight", ("rmsnorm_linear", (x, w, w, 1e-5), {})),
        "norm-linear-weight-dtype": ("weight", ("rmsnorm_linear", (x, torch.randn(4, 8).double(), w, 1e-5), {})),
        "norm-linear-gated-odd": ("weight", ("rmsnorm_linear", (x, torch.randn(5, 8), w, 1e-5), {"gated": True})),
        "norm-linear-gated-type": ("gated", ("rmsnorm_linear", (x, torch.randn(4, 8), w, 1e-5), {"gated": 1})),
        "norm-linear-norm-shape": ("norm_weight", ("rmsnorm_linear", (x, torch.randn(4, 8), w[:7], 1e-5), {})),
        "norm-linear-norm-dtype": ("norm_weight", ("rmsnorm_linear", (x, torch.randn(4, 8), w.half(), 1e-5), {})),
        "norm-linear-eps": ("eps", ("rmsnorm_linear", (x, torch.randn(4, 8), w, float("nan")), {})),
        "norm-linear-add-shape": ("add", ("rmsnorm_linear", (x, torch.randn(4, 8), None, 1e-5),
                                          {"add": torch.zeros(2, 5)})),
        "norm-linear-add-dtype": ("add", ("rmsnorm_linear", (x, torch.randn(4, 8), None, 1e-5),
                                          {"add": torch.zeros(2, 4).double()})),
        "norm-linear-add-gated": ("add", ("rmsnorm_linear", (x, torch.randn(4, 8), None, 1e-5),
                                          {"gated": True, "add": torch.zeros(2, 2)})),
        "qkv-rope-x-2d": ("x", qkv_rope(x=qkv_args[0][0])),
        "qkv-rope-weight-rows": ("weight", qkv_rope(weight=qkv_args[1][:-16])),
        "qkv-rope-norm-shape": ("norm_weight", qkv_rope(norm_weight=qkv_args[2][:-1])),
        "qkv-rope-positions-range": ("positions", qkv_rope(positions=qkv_args[4] + 100)),
        "qkv-rope-k-dtype": ("k_cache", qkv_rope(k_cache=qkv_args[7].long())),
        "qkv-rope-capacity": ("cache_seqlens", qkv_rope(cache_seqlens=qkv_args[9] + 8)),
        "qkv-rope-num-heads": ("num_heads", qkv_rope(num_heads=3)),
        "o-mlp-attention-int": ("attention", o_mlp(attention=mlp[0].long())),
        "o-mlp-o-weight-k": ("o_weight", o_mlp(o_weight=mlp[2][:, :-1])),
        "o-mlp-residual-shape": ("residual", o_mlp(residual=mlp[1][:, :-1])),
        "o-mlp-residual-dtype": ("residual", o_mlp(residual=mlp[1].double())),
        "o-mlp-norm-shape": ("norm_weight", o_mlp(norm_weight=mlp[3][:-1])),
        "o-mlp-gate-up-odd": ("gate_up_weight", o_mlp(gate_up_weight=mlp[4][:-1])),
        "o-mlp-gate-up-width": ("gate_up_weight", o_mlp(gate_up_weight=mlp[4][:, :-1])),
        "o-mlp-down-shape": ("down_weight", o_mlp(down_weight=mlp[5][:, :-2])),
        "o-mlp-down-dtype": ("down_weight", o_mlp(down_weight=mlp[5].half())),
        "o-mlp-eps": ("eps", o_mlp(eps=-1.0)),
        "q8-x-int": ("x", ("q8_0_linear", (x.long(), *q8[1:]), {})),
        "q8-quants-dtype": ("quants", ("q8_0_linear", (q8[0], q8[1].to(torch.uint8), q8[2]), {})),
        "q8-quants-k": ("quants", ("q8_0_linear", (q8[0], q8[1][:, :32], q8[2]), {})),
        "q8-k-not-blocks": ("quants", ("q8_0_linear", (q8[0][:, :48], q8[1][:, :48], q8[2]), {})),
        "q8-scales-dtype": ("scales", ("q8_0_linear", (q8[0], q8[1], q8[2].float()), {})),
        "q8-scales-shape": ("scales", ("q8_0_linear", (q8[0], q8[1], q8[2][:, :1]), {})),
        "q8-residual-shape": ("residual", ("q8_0_linear", q8, {"residual": torch.zeros(2, 5)})),
        "q8-residual-dtype": ("residual", ("q8_0_linear", q8, {"residual": torch.zeros(2, 4).double()})),
        "fp8-x-double": ("x", ("fp8_linear", (f8[0].double(), *f8[1:]), {})),
        "fp8-weight-dtype": ("weight", ("fp8_linear", (f8[0], f8[1].view(torch.int8), f8[2]), {})),
        "fp8-k-not-blocks": ("weight", ("fp8_linear", (f8[0][:, :64], f8[1][:, :64], f8[2]), {})),
        "fp8-weight-k": ("weight", ("fp8_linear", (f8[0], f8[1][:, :-1], f8[2]), {})),
        "fp8-scale-shape": ("weight_scale", ("fp8_linear", (f8[0], f8[1], f8[2][:1]), {})),
        "fp8-scale-dtype": ("weight_scale", ("fp8_linear", (f8[0], f8[1], f8[2].half()), {})),
        "fp8-residual-shape": ("residual", ("fp8_linear", f8, {"residual": torch.zeros(2, 5)})),
    }


BAD = bad_cases()


@pytest.mark.parametrize("backend_name", ["reference", "triton"], ids=["reference", "triton"])
@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_names_the_tensor(case, backend_name):
    name, (op, args, kwargs) = BAD[case]
    fn, reason = _dispatch.implementation(op, backend_name, "cpu")
    if fn is None:
        pytest.skip(reason)
    with pytest.raises(ValueError, match=f"^{name}:"):
        fn(*args, **kwargs)


def test_configs_are_frozen():
    for op in LAYER_OPS:
        module = triton_module(op)
        assert dataclasses.is_dataclass(module.GPU_CONFIG)
        with pytest.raises(dataclasses.FrozenInstanceError):
            module.GPU_CONFIG.num_warps = 1
