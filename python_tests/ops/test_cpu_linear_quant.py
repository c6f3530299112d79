"""cpu_linear over weight-only quantized weights (GGML Q8_0 / Q4_1 blocks, packed by cpu_linear_pack): the block
format against the gguf package, the packed layout, every C++ path and the reference against float64, bit equality
with the fp32 packed kernel on the dequantized matrix, identical bits across ISAs, batch invariance, bad input."""


import pytest
import torch

import eagle_kernels
from eagle_kernels import _dispatch
from eagle_kernels.reference.cpu_linear import cpu_linear_unpack, dequantize, quantize
from helpers import (
    ISA_ENV,
    LINEAR_ISAS,
    QUANT_FORMATS,
    activations,
    assert_every_isa_gives,
    assert_rows_batch_invariant,
    assert_within_fp32_bound,
    native_cpu_linear,
    quant_blocks,
    quant_grid,
    skip_unavailable_isa,
    weight,
)

# Small torch ops (the quantizer, the reference) cost milliseconds each in OpenMP wake-ups when the other core is
# busy; the kernels' own parallel split is not what these tests check.
pytestmark = pytest.mark.usefixtures("single_thread")
MS = [1, 2, 3, 5, 13]  # AVX-512: 3, 2 and 1 groups side by side, two row tiles; AVX2: tiles of 4 rows
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


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_layout(fmt):
    """The packed blocks hold the same bytes: column j's parameters, then k-major quants (Q4_1: k = 2p in the
    low nibble of pair p, 2p + 1 in the high one); unpack inverts."""
    rows = quant_blocks(64, 64, fmt)
    p = eagle_kernels.cpu_linear_pack(rows)
    per = 544 if fmt == "q8_0" else 320
    assert p.shape == (2, 2, 2, per) and p.dtype == rows.dtype and p.is_contiguous()
    assert torch.equal(cpu_linear_unpack(p), rows)
    r, b = rows.view(torch.uint8).reshape(64, 2, -1), p.view(torch.uint8)
    for g, h, blk, j in [(0, 0, 0, 0), (1, 1, 1, 15), (0, 1, 1, 7)]:
        n = 32 * g + 16 * h + j
        assert torch.equal(b[g, h, blk, 2 * j:2 * j + 2], r[n, blk, 0:2])  # the scale's bytes
        if fmt == "q8_0":
            assert torch.equal(b[g, h, blk, 32 + j::16], r[n, blk, 2:])
        else:
            assert torch.equal(b[g, h, blk, 32 + 2 * j:34 + 2 * j], r[n, blk, 2:4])  # the minimum's bytes
            q = torch.cat([r[n, blk, 4:] & 0xF, r[n, blk, 4:] >> 4])
            pairs = b[g, h, blk, 64 + j::16]
            assert torch.equal(pairs & 0xF, q[0::2]) and torch.equal(pairs >> 4, q[1::2])


@quant_grid(MS, NS, KS)
def test_matches_float64(linear, M, K, N, fmt):
    """Within the fp32 bound of the float64 product with the exactly dequantized weight."""
    rows = quant_blocks(N, K, fmt)
    x = activations(M, K)
    assert_within_fp32_bound(linear(x, eagle_kernels.cpu_linear_pack(rows)), x, dequantize(rows))


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_bits_of_every_isa_and_of_the_fp32_packed_kernel(fmt, monkeypatch):
    """Each output is the fp32 packed kernel's FMA chain on the dequantized matrix: the same bits at every ISA,
    and as cpu_linear on cpu_linear_pack(dequantize(blocks))."""
    fn = native_cpu_linear()
    rows = quant_blocks(160, 96, fmt)
    q, fp32 = eagle_kernels.cpu_linear_pack(rows), eagle_kernels.cpu_linear_pack(dequantize(rows))
    for M in (1, 3, 13):
        x = activations(M, 96)
        monkeypatch.setenv(ISA_ENV, "avx512")
        assert_every_isa_gives(fn(x, fp32), fn, x, q, LINEAR_ISAS, monkeypatch)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_rows_are_batch_invariant(fmt, isa, monkeypatch):
    """A row's output does not depend on the other rows: a verify pass of 13 rows gives each row what a
    one-row call gives."""
    fn = native_cpu_linear()
    skip_unavailable_isa(isa)
    monkeypatch.setenv(ISA_ENV, isa)
    assert_rows_batch_invariant(fn, activations(13, 576), eagle_kernels.cpu_linear_pack(quant_blocks(96, 576, fmt)))


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
    """cpu_decoder_layer reads packed quantized weights like cpu_linear (checks name the weight)."""
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
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"\bo_weight\b"):
        fn(x, input_norm, q[0], q[2], post_norm, *q[2:], *rest, **kwargs)

