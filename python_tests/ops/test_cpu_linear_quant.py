"""cpu_linear over weight-only quantized weights (GGML Q8_0 / Q4_1 blocks, packed by cpu_linear_pack) with fp32
activations: the block format against the gguf package, the packed layout, x's integer form, every C++ path and the
reference against float64 with a bound that cannot be flaky, identical bits across ISAs (also on extreme blocks),
batch invariance, non-finite rows, bad input."""


import pytest
import torch

import eagle_kernels
from eagle_kernels import _dispatch
from eagle_kernels.reference.cpu_linear import (
    _split_rows,
    cpu_linear_unpack,
    dequantize,
    fixed_point_activations,
    pack_int8_activations,
    quantize,
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

# Small torch ops (the quantizer, the reference) cost milliseconds each in OpenMP wake-ups when the other core is
# busy; the kernels' own parallel split is not what these tests check.
pytestmark = pytest.mark.usefixtures("single_thread")
MS = [1, 2, 3, 5, 13]  # AVX-512: 2 and 1 groups side by side, tiles of 2 rows; AVX2: tiles of 2 rows
NS = [32, 160]  # 1 and 5 groups (wide tiles of 3 or 2 groups and a tail)
KS = [32, 576]


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_blocks_are_ggml_quant_blocks(fmt):
    """quantize writes GGML's bytes (its reference quantizer's), dequantize reads them as GGML does."""
    gguf = pytest.importorskip("gguf")
    kind = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}[fmt]
    w = weight(64, 96, "fp32")
    rows = quantize(w, fmt)
    assert rows.shape == (64, 96 // 32 * (34 if fmt == "q8_0" else 20))
    ggml = gguf.quants.quantize(w.numpy(), kind)
    assert (rows.view(torch.uint8).numpy() == ggml).all()
    assert torch.equal(dequantize(rows), torch.from_numpy(gguf.quants.dequantize(ggml, kind)))
    step = (w.reshape(64, 3, 32).amax(-1) - w.reshape(64, 3, 32).amin(-1)).max()
    assert (dequantize(rows) - w).abs().max() <= step / (254 if fmt == "q8_0" else 15) * 1.01


def assert_within_fixed_point_bound(got, x, rows):
    """|got - exact| <= sum_b sum_k |w_k| s_b / 2 + (2 nb + 4) u sum_b (|d s_b I_b| + |m s_b X_b|) + tiny, where exact
    is the float64 product of the dequantized weight and x itself: x's integer form X (fixed_point_activations)
    moves each element by at most s_b / 2, the kernel's integer block sums I_b = sum_k q_k X_k are exact, and each
    block adds a few fp32 roundings (float(A_b), the scales' product, the fused multiply-adds) to a chain of nb
    blocks."""
    X, s = fixed_point_activations(x)  # [M, nb, 32], [M, nb]
    d, m, qw = _split_rows(rows)  # [N, nb], [N, nb] or None, [N, nb, 32]
    w = d.double()[..., None] * qw.double() + (0.0 if m is None else m.double()[..., None])
    exact = torch.nn.functional.linear(x.double(), w.reshape(w.shape[0], -1))
    moved = torch.einsum("mb,nbk->mnb", s.double() / 2, w.abs()).sum(-1)
    size = (d.double()[None] * s.double()[:, None] * torch.einsum("mbk,nbk->mnb", X.double(), qw.double())).abs()
    if m is not None:
        size = size + (m.double()[None] * (s.double() * X.double().sum(-1))[:, None]).abs()
    nb = qw.shape[1]
    bound = moved + (2 * nb + 4) * 2.0**-24 * size.sum(-1) + 1e-30
    err = (got.double() - exact).abs()
    assert got.dtype == torch.float32 and got.shape == exact.shape
    worst = float((err / bound).max())
    assert worst <= 1.0, f"error {worst:.3g} x the bound"


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_layout(fmt):
    """The packed blocks hold the same bytes: column j's parameters, then the quants in chunks of 64 bytes, byte
    4 j + r of chunk t holding k = 4 t + r (Q4_1: the low nibble k = 4 t + r, the high one k = 16 + 4 t + r); the
    bytes of the 8-bit-activation packing in another shape; unpack inverts."""
    rows = quant_blocks(64, 64, fmt)
    p = eagle_kernels.cpu_linear_pack(rows)
    per = 544 if fmt == "q8_0" else 320
    assert p.shape == (2, 2, 2, per) and p.dtype == rows.dtype and p.is_contiguous()
    assert torch.equal(cpu_linear_unpack(p), rows)
    assert torch.equal(pack_int8_activations(rows).reshape(p.shape), p)
    r, b = rows.view(torch.uint8).reshape(64, 2, -1), p.view(torch.uint8)
    for g, h, blk, j in [(0, 0, 0, 0), (1, 1, 1, 15), (0, 1, 1, 7)]:
        n = 32 * g + 16 * h + j
        assert torch.equal(b[g, h, blk, 2 * j:2 * j + 2], r[n, blk, 0:2])  # the scale's bytes
        if fmt == "q8_0":
            quants = b[g, h, blk, 32:].reshape(8, 16, 4)[:, j]  # [chunk t, r]
            assert torch.equal(quants.reshape(-1), r[n, blk, 2:])
        else:
            assert torch.equal(b[g, h, blk, 32 + 2 * j:34 + 2 * j], r[n, blk, 2:4])  # the minimum's bytes
            q = torch.cat([r[n, blk, 4:] & 0xF, r[n, blk, 4:] >> 4])  # element order
            nibbles = b[g, h, blk, 64:].reshape(4, 16, 4)[:, j].reshape(-1)
            assert torch.equal(nibbles & 0xF, q[:16]) and torch.equal(nibbles >> 4, q[16:])


def test_fixed_point_activations():
    """X = round-to-even(x / s), s = 2^(E - 22) with E the exponent of the block's largest |x| (frexp): |X| <= 2^22,
    |x - s X| <= s / 2; zero blocks, powers of two, subnormal and non-finite blocks."""
    x = torch.randn(5, 64) * torch.logspace(-30, 30, 64)
    x[1, :32] = 0.0
    x[2, 32:] = torch.tensor(2.0**-140)  # a subnormal block: s = 2^-162 flushes to 0 in fp32
    x[3, 5] = 2.0**10  # a power of two as the largest element: X = 2^21, exactly
    x[4, 40] = float("nan")
    X, s = fixed_point_activations(x)
    assert X.shape == (5, 2, 32) and s.shape == (5, 2) and s.dtype == torch.float32
    finite = torch.isfinite(s)
    assert finite.sum() == 9 and torch.isnan(s[4, 1])
    assert (X.abs() <= 2**22).all()
    xb = x.double().reshape(5, 2, 32)
    _, E = torch.frexp(xb.abs().amax(-1))
    scale = torch.ldexp(torch.ones_like(xb[..., 0]), (E - 22).double())
    assert torch.equal(s[finite].double(), scale.float().double()[finite])
    moved = (xb - X.double() * scale[..., None]).abs()
    assert (moved[finite] <= scale[finite][..., None] / 2).all()
    assert (X[1, 0] == 0).all() and X[3, 0, 5] == 2**21 and s[2, 1] == 0


@quant_grid(MS, NS, KS)
def test_matches_float64(linear, M, K, N, fmt):
    """Within the bound of the float64 product with the exactly dequantized weight (x's integer form and fp32
    roundings); the reference too."""
    rows = quant_blocks(N, K, fmt)
    x = activations(M, K) * torch.logspace(-3, 3, K)  # blocks of very different sizes
    assert_within_fixed_point_bound(linear(x, eagle_kernels.cpu_linear_pack(rows)), x, rows)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_bits_of_every_isa(fmt, monkeypatch):
    """Exact integer block sums (VPDPBUSD over three bytes, VPMADDWD over two int16 parts, int32) and the same fp32
    operations in the same order: the same bits at every ISA."""
    fn = native_cpu_linear()
    w = eagle_kernels.cpu_linear_pack(quant_blocks(160, 96, fmt))
    for M in (1, 3, 13):
        x = activations(M, 96) * 3
        monkeypatch.setenv(ISA_ENV, "scalar")
        assert_every_isa_gives(fn(x, w), fn, x, w, LINEAR_ISAS, monkeypatch)


def _extreme_rows():
    """x blocks at the edges of the integer form: an all-zero block; a power of two as the largest element; elements
    rounding up to X = 2^22 and -2^22; scales below fp32's normal range (2^-142: subnormal; 2^-162: 0); subnormal x;
    huge x; the largest and tiny magnitudes side by side."""
    x = torch.randn(8, 96)
    x[0, :32] = 0.0
    x[1, :32] = torch.linspace(-1, 1, 32)
    x[1, 7] = -1.0  # the largest |x| is 1 = 0.5 2^1: X = -2^21 exactly
    x[2, :32] = 1.0 - 2.0**-24  # x / 2^-22 = 2^22 - 1/4: X = 2^22
    x[2, 3] = -(1.0 - 2.0**-24)
    x[3, 32:64] = torch.randn(32) * 2.0**-120  # the scale leaves the normal range
    x[4, 32:64] = torch.randn(32) * 2.0**-140  # subnormal x
    x[5, 64:] = torch.randn(32) * 2.0**120
    x[6, 64:] = torch.randn(32) * 2.0**-100
    x[6, 64] = 2.0**20
    x[7] = torch.randn(96) * 1e-3
    return x


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_extreme_blocks(fmt, monkeypatch):
    """The extreme blocks: every ISA gives the scalar path's bits, within the bound; Q8_0 quants of -128 (a GGUF may
    hold them; GGML's quantizer writes -127 .. 127) too."""
    fn = native_cpu_linear()
    rows = quant_blocks(64, 96, fmt)
    if fmt == "q8_0":  # set some quants to -128
        r = rows.view(torch.uint8).reshape(64, 3, 34)
        r[::3, :, 2::5] = 0x80
    x = _extreme_rows()
    w = eagle_kernels.cpu_linear_pack(rows)
    monkeypatch.setenv(ISA_ENV, "scalar")
    want = fn(x, w)
    assert_within_fixed_point_bound(want, x, rows)
    assert_every_isa_gives(want, fn, x, w, LINEAR_ISAS, monkeypatch)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_rows_are_batch_invariant(fmt, isa, monkeypatch):
    """A row's output does not depend on the other rows: a verify pass of 13 rows gives each row what a
    one-row call gives."""
    fn = native_cpu_linear()
    skip_unavailable_isa(isa)
    monkeypatch.setenv(ISA_ENV, isa)
    assert_rows_batch_invariant(fn, activations(13, 576), eagle_kernels.cpu_linear_pack(quant_blocks(96, 576, fmt)))


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_non_finite_rows(linear, fmt):
    """A row holding inf or nan gives nan outputs (as the fp32 kernels give non-finite ones); the other rows are
    untouched."""
    assert_non_finite_row_stays_alone(linear, eagle_kernels.cpu_linear_pack(quant_blocks(64, 96, fmt)))


def _bad_cases(fmt):
    rows = quant_blocks(64, 64, fmt)
    p = eagle_kernels.cpu_linear_pack(rows)
    return {
        "block rows, not packed": rows,
        "K of another x": eagle_kernels.cpu_linear_pack(quant_blocks(64, 96, fmt)),
        "bytes per block": torch.zeros(2, 2, 2, 100, dtype=rows.dtype),
        "not contiguous": p.transpose(0, 1),
        "3-D": p.reshape(4, 2, -1),
    }


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("case", list(_bad_cases("q8_0")))
def test_bad_packed_weight(linear, fmt, case):
    with pytest.raises(ValueError, match=r"\bweight\b"):
        linear(activations(2, 64), _bad_cases(fmt)[case])


@pytest.mark.parametrize("linear", ["reference", "avx512"], indirect=True)
def test_bad_k_for_quant_blocks(linear):
    """x with K not a multiple of 32 against a quantized weight: an error naming the weight."""
    with pytest.raises(ValueError, match=r"\bweight\b"):
        linear(activations(1, 40), torch.zeros(1, 2, 1, 544, dtype=torch.int8))


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_bad_quantize_input(fmt):
    with pytest.raises(ValueError, match=r"\bweight\b.*multiple of 32"):
        quantize(torch.randn(32, 48), fmt)  # K does not fit the blocks: no silent fallback
    with pytest.raises(ValueError, match=r"\bweight\b"):
        quantize(torch.randn(32), fmt)
    with pytest.raises(ValueError, match=r"\bweight\b.*finite"):
        quantize(torch.full((32, 32), float("inf")), fmt)
    with pytest.raises(ValueError, match=r"\bweight\b.*fp16"):
        quantize(torch.full((32, 32), 1e38).index_fill_(1, torch.tensor([0]), -1e38), fmt)
    with pytest.raises(ValueError, match=r"\bfmt\b"):
        quantize(torch.randn(32, 32), "q4_0")


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_bad_pack_input(fmt):
    rows = quant_blocks(64, 64, fmt)
    with pytest.raises(ValueError, match=r"\bweight\b"):
        eagle_kernels.cpu_linear_pack(rows[:40])  # N not a multiple of 32
    with pytest.raises(ValueError, match=r"\bweight\b"):
        eagle_kernels.cpu_linear_pack(rows[:, :-1])  # not whole blocks
    with pytest.raises(ValueError, match=r"\bblocks\b"):
        dequantize(rows[:, :-1])


def test_decoder_layer_takes_quantized_weights():
    """cpu_decoder_layer reads packed quantized weights like cpu_linear (the dequantized layer's output to a few
    fp32 roundings; checks name the weight)."""
    fn, reason = _dispatch.implementation("cpu_decoder_layer", "cpp", "cpu")
    if fn is None:
        pytest.skip(reason)
    from helpers import decoder_layer_case

    args, kwargs = decoder_layer_case("smollm2", 1, 3, 4, "fp32", tree=False)
    (x, input_norm, qkv, o, post_norm, gate_up, down, *rest) = args
    q = [eagle_kernels.cpu_linear_pack(quantize(m if m.dim() == 2 else cpu_linear_unpack(m), "q4_1"))
         for m in (qkv, o, gate_up, down)]
    deq = [eagle_kernels.cpu_linear_pack(dequantize(cpu_linear_unpack(m))) for m in q]
    cache = [t.clone() if isinstance(t, torch.Tensor) else t for t in rest]
    got = fn(x, input_norm, *q[:2], post_norm, *q[2:], *rest, **kwargs)
    want = fn(x, input_norm, *deq[:2], post_norm, *deq[2:], *cache, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, want)  # x's integer form and one rounding per block: not the fp32 chain's bits
    with pytest.raises(ValueError, match=r"\bo_weight\b"):
        fn(x, input_norm, q[0], q[2], post_norm, *q[2:], *rest, **kwargs)


@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_zero_row_weights(fmt, activations):
    """A weight of no output rows quantizes, packs, unpacks and multiplies to empty outputs on every backend, as a
    float one does (a reshape of 0 elements raised a RuntimeError)."""
    blocks = quantize(torch.randn(0, 64), fmt)
    assert blocks.shape == (0, 2 * {"q8_0": 34, "q4_1": 20}[fmt]) and dequantize(blocks).shape == (0, 64)
    packed = eagle_kernels.cpu_linear_pack(blocks, activations)
    assert packed.shape[0] == 0 and torch.equal(cpu_linear_unpack(packed), blocks)
    x = torch.randn(3, 64)
    for backend in ("reference", "cpp"):
        fn, _ = _dispatch.implementation("cpu_linear", backend, "cpu")
        if fn is not None:
            assert fn(x, packed).shape == (3, 0)
