"""cpu_linear: the AVX-512, AVX2 and portable C++ paths (and the reference) against F.linear
in float64, with an error bound that holds for any fp32 summation order."""


import pytest
import torch

import eagle_kernels
from eagle_kernels import _dispatch
from helpers import ISA_ENV, WEIGHT_DTYPES, activations, assert_within_fp32_bound, skip_unavailable_isa, weight

CHUNK_ENV = "EAGLE_KERNELS_CPU_LINEAR_CHUNK"
MS = [1, 3, 5, 7, 8, 17, 64]  # x tiles: AVX2 3 + 2 at 5; AVX-512VL 4 + 3 at 7, 6 + 6 + 5 at 17;
# AVX-512 paired tiles 7 at 7, 9 + 8 at 17
KS = [576, 1536, 100]  # SmolLM2 hidden and intermediate sizes; 100 leaves a K tail of 4
NS = [1, 7, 576, 1000]  # 7 and 1000 leave a partial panel of weight rows


@pytest.mark.parametrize("wdtype", list(WEIGHT_DTYPES), ids=list(WEIGHT_DTYPES))
@pytest.mark.parametrize("N", NS, ids=[f"N{n}" for n in NS])
@pytest.mark.parametrize("K", KS, ids=[f"K{k}" for k in KS])
@pytest.mark.parametrize("M", MS, ids=[f"M{m}" for m in MS])
def test_matches_float64(linear, M, K, N, wdtype):
    x, w = activations(M, K), weight(N, K, wdtype)
    assert_within_fp32_bound(linear(x, w), x, w)


@pytest.mark.parametrize("wdtype", list(WEIGHT_DTYPES), ids=list(WEIGHT_DTYPES))
def test_leading_dims_and_strided_inputs(linear, wdtype):
    """x [B, T, K] as a non-contiguous view; weight rows with a stride (a slice of a wider
    matrix, last dim still dense)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 2 * 96, generator=g)[..., ::2]
    wide = torch.randn(13, 128, generator=g).to(WEIGHT_DTYPES[wdtype])
    w = wide[:, :96]
    assert not x.is_contiguous() and not w.is_contiguous() and w.stride(1) == 1
    got = linear(x, w)
    assert got.shape == (2, 5, 13)
    assert_within_fp32_bound(got, x, w)


@pytest.mark.parametrize("shape", [(0, 64), (3, 0), (4, 64)], ids=["M0", "K0", "N0"])
def test_empty(linear, shape):
    M, K = shape
    N = 0 if shape == (4, 64) else 5
    got = linear(torch.randn(M, K), torch.randn(N, K))
    assert got.shape == (M, N)
    assert bool((got == 0).all())


@pytest.mark.parametrize("isa", ["avx512", "avx512-ymm", "avx2", "scalar"])
def test_rows_are_batch_invariant(isa, monkeypatch):
    """Row m of the output is bit-identical whatever the other rows are (each output is one
    dot product in a fixed order): a verify pass scores a token exactly as decoding would,
    whichever x tile (of 1 to 6 rows) the row falls in."""
    fn, reason = _dispatch.implementation("cpu_linear", "cpp", "cpu")
    if fn is None:
        pytest.skip(reason)
    skip_unavailable_isa(isa)
    monkeypatch.setenv(ISA_ENV, isa)
    x, w = activations(17, 100), weight(1000, 100, "bf16")
    full = fn(x, w)
    for m in (0, 5, 16):
        for rows in (1, 2, 7, 8):
            part = x[m:m + rows]
            assert torch.equal(fn(part, w), full[m:m + part.shape[0]])


@pytest.mark.parametrize("wdtype", list(WEIGHT_DTYPES), ids=list(WEIGHT_DTYPES))
def test_avx512_and_avx2_paths_give_identical_bits(wdtype, monkeypatch):
    """The AVX-512VL build of the vector path runs the AVX2 arithmetic in the same order, with
    x tiles of up to 6 rows instead of 3 (avx512-ymm), and the paired tiles (the default at 2+
    rows) run the same per-lane arithmetic two weight rows to a 16-lane register, x tiles of up
    to 12 rows: identical outputs at every row count, so a model's results do not depend on
    which path a CPU has (K = 100: the K tail too; 1003 rows: a partial quad of weight rows)."""
    fn, reason = _dispatch.implementation("cpu_linear", "cpp", "cpu")
    if fn is None:
        pytest.skip(reason)
    skip_unavailable_isa("avx512")
    for M in (1, 2, 3, 4, 5, 7, 8, 12, 13, 24, 25):
        for K in (576, 100):
            x, w = activations(M, K), weight(1003, K, wdtype)
            monkeypatch.setenv(ISA_ENV, "avx2")
            avx2 = fn(x, w)
            for isa in ("avx512-ymm", "avx512"):
                monkeypatch.setenv(ISA_ENV, isa)
                assert torch.equal(fn(x, w), avx2), (isa, M, K)


@pytest.mark.parametrize("wdtype", list(WEIGHT_DTYPES), ids=list(WEIGHT_DTYPES))
def test_threads_do_not_change_the_result(linear, wdtype):
    """Split over threads (125 panels of 8 rows, one chunk per thread here), every output is still
    one dot product in a fixed order: bit-identical to the one-thread result."""
    x, w = activations(64, 1536), weight(1000, 1536, wdtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, w)
        torch.set_num_threads(2)
        two = linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("chunk", ["1", "8388608"], ids=["every-panel", "coarse"])
def test_parallel_chunk_setting_does_not_change_the_result(chunk, monkeypatch):
    """EAGLE_KERNELS_CPU_LINEAR_CHUNK only moves the split between threads (one panel per task,
    or the whole LM-head-sized call in one task at two threads): bit-identical outputs."""
    fn, reason = _dispatch.implementation("cpu_linear", "cpp", "cpu")
    if fn is None:
        pytest.skip(reason)
    x, w = activations(8, 576), weight(1000, 576, "bf16")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        default = fn(x, w)
        monkeypatch.setenv(CHUNK_ENV, chunk)
        assert torch.equal(fn(x, w), default)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("value", ["0", "-5", "abc", "12x"])
def test_bad_parallel_chunk_setting_is_named(value, monkeypatch):
    fn, reason = _dispatch.implementation("cpu_linear", "cpp", "cpu")
    if fn is None:
        pytest.skip(reason)
    monkeypatch.setenv(CHUNK_ENV, value)
    with pytest.raises(ValueError, match=CHUNK_ENV):
        fn(activations(2, 16), weight(7, 16, "fp32"))


@pytest.mark.parametrize("wdtype", ["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 2, 4, 8, 13])
def test_16bit_weight_equals_its_fp32_widening(linear, M, wdtype):
    """bf16 and fp16 are read exactly: the result equals the fp32 weight they widen to, bit for
    bit (K = 100 also runs the K tail's partial loads)."""
    for K in (576, 100):
        x, w = activations(M, K), weight(576, K, wdtype)
        assert torch.equal(linear(x, w), linear(x, w.float()))


def test_fp16_extremes_widen_exactly(linear):
    """Subnormal, largest finite and signed-zero fp16 weights (what F16C must convert without
    flushing) give the same result as their fp32 widening."""
    w = torch.tensor([[6e-8, -6e-8, 65504.0, -65504.0, 0.0, -0.0, 1e-5, 3.0, 2.0**-14] * 3] * 9,
                     dtype=torch.float16)
    x = activations(3, w.shape[1])
    assert torch.equal(linear(x, w), linear(x, w.float()))


BAD = {
    "x_dtype": ("x", lambda x, w: (x.double(), w)),
    "x_half": ("x", lambda x, w: (x.half(), w)),
    "x_rank0": ("x", lambda x, w: (x[0, 0], w)),
    "weight_dtype": ("weight", lambda x, w: (x, w.double())),
    "weight_int": ("weight", lambda x, w: (x, w.int())),
    "weight_rank1": ("weight", lambda x, w: (x, w[0])),
    "weight_rank3": ("weight", lambda x, w: (x, w[None])),
    "k_mismatch": ("weight", lambda x, w: (x, w[:, :-1])),
    "weight_transposed": ("weight", lambda x, w: (x, torch.randn(w.shape[1], w.shape[0]).t())),
    "weight_not_cpu": ("weight", lambda x, w: (x, w.to("meta"))),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input(linear, case):
    name, make = BAD[case]
    x, w = make(activations(3, 16), weight(7, 16, "fp32"))
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        linear(x, w)


@pytest.mark.parametrize("layout", ["rows", "packed"])
@pytest.mark.parametrize("M", [1, 3, 12, 13])
def test_nan_rows_stay_in_their_row(linear, M, layout):
    """A NaN in one row of x gives NaN across that output row only: the other rows equal their
    result without it (a NaN in one tile row must not reach the accumulators of the others).
    ``packed``: the weight in cpu_linear_pack's layout."""
    x = activations(M, 100)
    w = weight(13, 100, "bf16") if layout == "rows" else eagle_kernels.cpu_linear_pack(weight(96, 100, "bf16"))
    clean = linear(x, w)
    poisoned = x.clone()
    poisoned[M // 2, 37] = float("nan")
    got = linear(poisoned, w)
    assert bool(got[M // 2].isnan().all())
    others = [m for m in range(M) if m != M // 2]
    assert torch.equal(got[others], clean[others])
