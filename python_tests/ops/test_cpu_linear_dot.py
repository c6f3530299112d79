"""cpu_linear over Q8_0 / Q4_1 blocks packed for 8-bit activations (cpu_linear_pack(blocks, activations="int8"),
GGML's arithmetic): the layout, the activations' quantizer, every C++ path and the reference against float64 with
a bound that cannot be flaky, identical bits across ISAs, batch invariance, non-finite rows, bad input."""


import pytest
import torch

import eagle_kernels
from eagle_kernels import _dispatch
from eagle_kernels.reference.cpu_linear import (
    _split_rows,
    cpu_linear_unpack,
    pack_int8_activations,
    quantize,
    quantize_activations,
)
from helpers import (
    ISA_ENV,
    LINEAR_ISAS,
    QUANT_FORMATS,
    activations,
    assert_every_isa_gives,
    assert_non_finite_row_stays_alone,
    assert_rows_batch_invariant,
    native_cpu_linear,
    quant_blocks,
    quant_grid,
    skip_unavailable_isa,
    weight,
)

pytestmark = pytest.mark.usefixtures("single_thread")
MS = [1, 2, 3, 5, 7, 13]  # AVX-512: 3, 2 and 1 groups side by side, tiles of 6 rows (7, 13: several); AVX2: 2 rows
NS = [32, 160]
KS = [32, 576]


def pack8(rows):
    return eagle_kernels.cpu_linear_pack(rows, activations="int8")


def assert_within_block_bound(got, x, rows):
    """|got - exact| <= (2 nb + 4) u sum_b (|d dx I_b| + |m dx s_b|) + tiny, where exact is the float64 product of
    the dequantized weight and the dequantized 8-bit activations, I_b a block's integer dot product and s_b the sum
    of x's quants: the kernel's integer sums are exact, and each block adds two or three fp32 roundings (the scales'
    product, dx s, the fused multiply-adds) to a chain of nb blocks."""
    qx, dx = quantize_activations(x)  # [M, nb, 32], [M, nb]
    d, m, qw = _split_rows(rows)  # [N, nb], [N, nb] or None, [N, nb, 32]
    isum = torch.einsum("mbk,nbk->mnb", qx.double(), qw.double())
    scaled = d.double()[None] * dx.double()[:, None]  # [M, N, nb]
    exact_terms = scaled * isum
    size = exact_terms.abs()
    if m is not None:
        offset = m.double()[None] * (dx.double() * qx.double().sum(-1))[:, None]
        exact_terms = exact_terms + offset
        size = size + offset.abs()
    exact = exact_terms.sum(-1)
    nb = qw.shape[1]
    bound = (2 * nb + 4) * 2.0**-24 * size.sum(-1) + 1e-30
    err = (got.double() - exact).abs()
    assert got.dtype == torch.float32 and got.shape == exact.shape
    worst = float((err / bound).max())
    assert worst <= 1.0, f"error {worst:.3g} x the bound"


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_layout(fmt):
    """The same bytes as the block rows: column j's parameters, then chunks of 64 bytes with byte 4 j + r of chunk
    t holding k = 4 t + r (Q4_1: low nibble k = 4 t + r, high nibble 16 + 4 t + r); unpack inverts."""
    rows = quant_blocks(64, 64, fmt)
    p = pack8(rows)
    lines = 17 if fmt == "q8_0" else 10
    assert p.shape == (2, 2, 2, lines, 32) and p.dtype == rows.dtype and p.is_contiguous()
    assert torch.equal(cpu_linear_unpack(p), rows)
    assert torch.equal(pack_int8_activations(rows), p)
    r, b = rows.view(torch.uint8).reshape(64, 2, -1), p.view(torch.uint8).reshape(2, 2, 2, -1)
    for g, h, blk, j in [(0, 0, 0, 0), (1, 1, 1, 15), (0, 1, 1, 7)]:
        n = 32 * g + 16 * h + j
        assert torch.equal(b[g, h, blk, 2 * j:2 * j + 2], r[n, blk, 0:2])  # the scale's bytes
        if fmt == "q8_0":
            q = r[n, blk, 2:]
            for t in range(8):
                assert torch.equal(b[g, h, blk, 32 + 64 * t + 4 * j:32 + 64 * t + 4 * j + 4], q[4 * t:4 * t + 4])
        else:
            assert torch.equal(b[g, h, blk, 32 + 2 * j:34 + 2 * j], r[n, blk, 2:4])  # the minimum's bytes
            q = torch.cat([r[n, blk, 4:] & 0xF, r[n, blk, 4:] >> 4])  # element order
            for t in range(4):
                byte = b[g, h, blk, 64 + 64 * t + 4 * j:64 + 64 * t + 4 * j + 4]
                assert torch.equal(byte & 0xF, q[4 * t:4 * t + 4])
                assert torch.equal(byte >> 4, q[16 + 4 * t:16 + 4 * t + 4])


def test_quantize_activations():
    """Per block of 32: |qx| <= 127 with 127 reached, x - qx dx within half a step (round half to even), a zero
    block all zeros, a block with inf or nan a nan scale."""
    x = activations(3, 96) * torch.tensor([1.0, 1e-20, 1e20]).repeat_interleave(32)
    x[1, 64:] = 0.0
    x[2, 32] = 0.5 * x[2, 33:64].abs().max()
    q, d = quantize_activations(x)
    assert q.dtype == torch.int8 and q.shape == (3, 3, 32) and d.dtype == torch.float32 and d.shape == (3, 3)
    nonzero = d != 0
    assert (q.abs().amax(-1)[nonzero] == 127).all()
    step = (x.reshape(3, 3, 32) - q.float() * d[..., None]).abs() / d[..., None]
    assert (step[nonzero] <= 0.5 + 1e-6).all()
    assert (d[1, 2] == 0) and (q[1, 2] == 0).all()
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 127.0] + [0.0] * 26) / 127
    assert q.new_tensor([0, 2, 2, 0, -2, 127]).equal(quantize_activations(halves)[0][0, :6])
    bad = x.clone()
    bad[0, 40] = float("inf")
    bad[1, 3] = float("nan")
    _, d_bad = quantize_activations(bad)
    assert d_bad[0, 1].isnan() and d_bad[1, 0].isnan() and not d_bad[0, 0].isnan()


@quant_grid(MS, NS, KS)
def test_matches_float64(linear, M, K, N, fmt):
    rows = quant_blocks(N, K, fmt)
    x = activations(M, K)
    assert_within_block_bound(linear(x, pack8(rows)), x, rows)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_bits_of_every_isa(fmt, monkeypatch):
    """Exact integer block sums and the same fp32 operations in the same order: the same bits at every ISA."""
    fn = native_cpu_linear()
    w = pack8(quant_blocks(160, 96, fmt))
    for M in (1, 3, 13):
        x = activations(M, 96) * 3
        monkeypatch.setenv(ISA_ENV, "scalar")
        assert_every_isa_gives(fn(x, w), fn, x, w, LINEAR_ISAS, monkeypatch)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_activation_quantizer_of_every_isa(fmt, monkeypatch):
    """The activations' quantizer has a scalar, an AVX2 and an AVX-512 form: the same bits on blocks where they
    could part ways: halves that round to even (amax 127 or 127 / 8: dx 1 or 1 / 8, exact), a zero block with
    -0.0, tiny and huge blocks."""
    fn = native_cpu_linear()
    ties = torch.tensor([127.0] + [k + 0.5 for k in range(-15, 15)] + [-0.0])
    zeros = torch.zeros(32)
    zeros[::3] = -0.0
    x = torch.stack([
        torch.cat([ties, -ties, ties / 8, zeros, ties.flip(0), -ties / 8]),
        activations(1, 192)[0] * 3,
        torch.cat([activations(1, 96)[0] * 1e-20, activations(1, 96)[0] * 1e20]),
    ])
    w = pack8(quant_blocks(64, 192, fmt))
    monkeypatch.setenv(ISA_ENV, "scalar")
    assert_every_isa_gives(fn(x, w), fn, x, w, LINEAR_ISAS, monkeypatch)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_rows_are_batch_invariant(fmt, isa, monkeypatch):
    """Each row is quantized alone: a verify pass of 13 rows gives each row what a one-row call gives."""
    fn = native_cpu_linear()
    skip_unavailable_isa(isa)
    monkeypatch.setenv(ISA_ENV, isa)
    assert_rows_batch_invariant(fn, activations(13, 576), pack8(quant_blocks(96, 576, fmt)))


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_non_finite_rows(linear, fmt):
    """A row holding inf or nan gives nan outputs (as the fp32 kernels give non-finite ones); the other rows are
    untouched."""
    assert_non_finite_row_stays_alone(linear, pack8(quant_blocks(64, 96, fmt)))


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_error_against_fp32_activations(fmt):
    """What the 8-bit activations cost: within a few of x's quantization steps of the fp32-activation result."""
    rows = quant_blocks(96, 576, fmt)
    x = activations(4, 576)
    exact = torch.nn.functional.linear(x.double(), eagle_kernels.reference.cpu_linear(
        torch.eye(576), eagle_kernels.cpu_linear_pack(rows)).double().T)
    got = eagle_kernels.cpu_linear(x, pack8(rows)).double()
    w_abs = eagle_kernels.reference.cpu_linear(torch.eye(576), eagle_kernels.cpu_linear_pack(rows)).double().abs()
    _, dx = quantize_activations(x)
    half_step = (dx.double().repeat_interleave(32, -1) / 2) @ w_abs  # sum_k |w_k| dx_k / 2
    assert ((got - exact).abs() <= half_step * 1.001 + 1e-6).all()
    assert (got - exact).abs().max() > 0  # the activations are rounded: not the fp32 kernel's result


def test_bad_pack_input():
    rows = quant_blocks(64, 64, "q4_1")
    with pytest.raises(ValueError, match=r"\bactivations\b"):
        eagle_kernels.cpu_linear_pack(rows, activations="int4")
    with pytest.raises(ValueError, match=r"\bweight\b.*quantized"):
        eagle_kernels.cpu_linear_pack(weight(64, 64, "fp32"), activations="int8")  # no silent fp32 fallback
    with pytest.raises(ValueError, match=r"\bweight\b"):
        pack8(rows[:40])
    with pytest.raises(ValueError, match=r"\bx\b.*multiple of 32"):
        quantize_activations(torch.randn(2, 40))


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_bad_packed_weight(linear, fmt):
    p = pack8(quant_blocks(64, 64, fmt))
    lines = p.shape[3]
    cases = [p.reshape(2, 2, 2, -1, 16), torch.zeros(2, 2, 2, lines + 1, 32, dtype=p.dtype), p.transpose(0, 1),
             pack8(quant_blocks(64, 96, fmt)), p.reshape(2, 2, 2, lines, 32, 1)]
    for case in cases:
        with pytest.raises(ValueError, match=r"\bweight\b"):
            linear(activations(2, 64), case)


def test_decoder_layer_takes_int8_activation_weights():
    """cpu_decoder_layer reads weights packed for 8-bit activations like cpu_linear, and agrees with the reference
    layer on them (8-bit activations there too) to fp32 rounding; checks name the weight."""
    fn, reason = _dispatch.implementation("cpu_decoder_layer", "cpp", "cpu")
    if fn is None:
        pytest.skip(reason)
    ref, _ = _dispatch.implementation("cpu_decoder_layer", "reference", "cpu")
    from helpers import decoder_layer_case

    args, kwargs = decoder_layer_case("smollm2", 1, 3, 4, "fp32", tree=False)
    (x, input_norm, qkv, o, post_norm, gate_up, down, *rest) = args
    q = [pack8(quantize(m if m.dim() == 2 else cpu_linear_unpack(m), "q4_1")) for m in (qkv, o, gate_up, down)]
    cache = [t.clone() if isinstance(t, torch.Tensor) else t for t in rest]
    got = fn(x, input_norm, *q[:2], post_norm, *q[2:], *rest, **kwargs)
    want = ref(x, input_norm, *q[:2], post_norm, *q[2:], *cache, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"\bo_weight\b"):
        fn(x, input_norm, q[0], q[2], post_norm, *q[2:], *rest, **kwargs)
