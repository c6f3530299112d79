"""cpu_linear over packed weights (cpu_linear_pack): the layout, every C++ path and the reference
against float64, identical bits across ISAs, batch invariance, bad input, and the model's use of
packed copies (PackedWeights, cpu_decoder_layer). NaN rows: test_cpu_linear.py, both layouts."""

import gc
import os
import weakref

import pytest
import torch

import eagle_kernels
from eagle_kernels import _dispatch, reference
from eagle_kernels.reference.cpu_linear import cpu_linear_unpack
from helpers import (
    ISA_ENV,
    WEIGHT_DTYPES,
    activations,
    assert_every_isa_gives,
    assert_within_fp32_bound,
    check_decoder_layer,
    clone_args,
    decoder_layer_case,
    native_decoder_layer,
    skip_unavailable_isa,
    tiny_hf_model,
    weight,
)

# Row tiles: AVX-512 1..12 rows with 4, 3, 2 or 1 groups side by side (13 = 6 + 7, 25 = 8 + 8 + 9);
# AVX2 pairs of rows.
MS = [1, 2, 3, 5, 7, 12, 13, 25]
KS = [576, 1536, 37]
NS = [32, 96, 576, 1056]  # 1, 3 (a 2-wide tile and a 1-wide tail), 18 and 33 groups
ISAS = ["avx512", "avx2", "scalar"]


def packed(N, K, wdtype):
    return eagle_kernels.cpu_linear_pack(weight(N, K, wdtype))


@pytest.mark.parametrize("wdtype", list(WEIGHT_DTYPES), ids=list(WEIGHT_DTYPES))
def test_layout(wdtype):
    """packed[g, h, k, j] = weight[32 g + 16 h + j, k] for every dtype (bf16: with K odd); unpack inverts."""
    w = weight(64, 5, wdtype)
    p = eagle_kernels.cpu_linear_pack(w)
    assert p.shape == (2, 2, 5, 16) and p.dtype == w.dtype and p.is_contiguous()
    for g in range(2):
        for h in range(2):
            for j in range(16):
                assert torch.equal(p[g, h, :, j], w[32 * g + 16 * h + j])
    assert torch.equal(cpu_linear_unpack(p), w)


def test_bf16_pair_layout():
    """bf16 with K even: packed[g, h, p, j, i] = weight[32 g + 16 h + j, 2 p + i]; unpack inverts."""
    w = weight(64, 6, "bf16")
    p = eagle_kernels.cpu_linear_pack(w)
    assert p.shape == (2, 2, 3, 16, 2) and p.dtype == torch.bfloat16 and p.is_contiguous()
    for g in range(2):
        for h in range(2):
            for j in range(16):
                for i in range(2):
                    assert torch.equal(p[g, h, :, j, i], w[32 * g + 16 * h + j, i::2])
    assert torch.equal(cpu_linear_unpack(p), w)


def k_major(w):
    """The [N / 32, 2, K, 16] layout for any dtype (cpu_linear_pack gives bf16 with K even in pairs)."""
    N, K = w.shape
    return w.reshape(N // 32, 2, 16, K).transpose(2, 3).contiguous()


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_pairs_give_the_bits_of_the_k_major_layout(isa, monkeypatch):
    """The pair layout runs the same FMA chain per output as the K-major one: equal bits on every tile shape."""
    skip_unavailable_isa(isa)
    monkeypatch.setenv(ISA_ENV, isa)
    fn = torch.ops.eagle_kernels.cpu_linear
    for N, K in ((1056, 100), (96, 576), (32, 2)):
        w = weight(N, K, "bf16")
        pairs, kmajor = eagle_kernels.cpu_linear_pack(w), k_major(w)
        assert pairs.dim() == 5 and kmajor.dim() == 4
        for M in MS:
            x = activations(M, K)
            assert torch.equal(fn(x, pairs), fn(x, kmajor)), (N, K, M)


@pytest.mark.parametrize("wdtype", list(WEIGHT_DTYPES), ids=list(WEIGHT_DTYPES))
@pytest.mark.parametrize("N", NS, ids=[f"N{n}" for n in NS])
@pytest.mark.parametrize("K", KS, ids=[f"K{k}" for k in KS])
@pytest.mark.parametrize("M", MS, ids=[f"M{m}" for m in MS])
def test_matches_float64(linear, M, K, N, wdtype):
    x = activations(M, K)
    assert_within_fp32_bound(linear(x, packed(N, K, wdtype)), x, weight(N, K, wdtype))


@pytest.mark.parametrize("wdtype", list(WEIGHT_DTYPES), ids=list(WEIGHT_DTYPES))
def test_every_isa_gives_identical_bits(wdtype, monkeypatch):
    """One FMA chain per output along K in every path: AVX-512 (any tile), AVX2 and the scalar
    std::fma loop give the same bits."""
    fn = torch.ops.eagle_kernels.cpu_linear
    w = packed(1056, 100, wdtype)
    for M in (1, 3, 8, 13, 25):
        x = activations(M, 100)
        monkeypatch.setenv(ISA_ENV, "scalar")
        assert_every_isa_gives(fn(x, w), fn, x, w, ISAS, monkeypatch)


@pytest.mark.parametrize("isa", ISAS)
def test_rows_are_batch_invariant(isa, monkeypatch):
    """A row of the output is bit for bit the same alone and among 1..25 rows (a verify pass gives
    a token's row what decoding it alone gives)."""
    skip_unavailable_isa(isa)
    monkeypatch.setenv(ISA_ENV, isa)
    fn = torch.ops.eagle_kernels.cpu_linear
    w = packed(576, 576, "bf16")
    x = activations(25, 576)
    alone = torch.cat([fn(x[m:m + 1], w) for m in range(25)])
    for M in (2, 5, 12, 13, 25):
        assert torch.equal(fn(x[:M], w), alone[:M]), M


@pytest.mark.parametrize("wdtype", list(WEIGHT_DTYPES), ids=list(WEIGHT_DTYPES))
def test_threads_and_chunks_do_not_change_the_result(wdtype, monkeypatch):
    fn = torch.ops.eagle_kernels.cpu_linear
    w, x = packed(1056, 576, wdtype), activations(12, 576)
    want = fn(x, w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fn(x, w), want)
    finally:
        torch.set_num_threads(threads)
    for chunk in ("1", "8388608"):
        monkeypatch.setenv("EAGLE_KERNELS_CPU_LINEAR_CHUNK", chunk)
        assert torch.equal(fn(x, w), want)


@pytest.mark.parametrize("wdtype", ["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 4, 13])
def test_16bit_weight_equals_its_fp32_widening(linear, M, wdtype):
    """A bf16 / fp16 packed weight gives bit for bit the result of its fp32 widening, packed."""
    w = weight(96, 100, wdtype)
    x = activations(M, 100)
    got = linear(x, eagle_kernels.cpu_linear_pack(w))
    assert torch.equal(got, linear(x, eagle_kernels.cpu_linear_pack(w.float())))


def test_agrees_with_the_row_major_layout():
    """The two layouts sum in different orders: equal to fp32 rounding, on the same inputs."""
    fn = torch.ops.eagle_kernels.cpu_linear
    w, x = weight(576, 1536, "fp32"), activations(12, 1536)
    torch.testing.assert_close(fn(x, eagle_kernels.cpu_linear_pack(w)), fn(x, w), rtol=1e-5, atol=1e-4)


def test_leading_dims_and_empty_rows(linear):
    w = packed(64, 16, "fp32")
    x = activations(6, 16).view(2, 3, 16)
    assert torch.equal(linear(x, w), linear(x.reshape(6, 16), w).view(2, 3, 64))
    assert linear(x[:0], w).shape == (0, 3, 64)


BAD = {
    "k_mismatch": lambda w: w[:, :, :-1].contiguous(),
    "half_not_16": lambda w: w[..., :8].contiguous(),
    "one_half": lambda w: w[:, :1].contiguous(),
    "not_contiguous": lambda w: w.transpose(0, 1).contiguous().transpose(0, 1),
    "rank3": lambda w: w[:, 0],
    "rank5": lambda w: w[None],
    "dtype": lambda w: w.double(),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_packed_weight(linear, case):
    w = BAD[case](packed(64, 16, "fp32"))
    with pytest.raises(ValueError, match=r"\bweight\b"):
        linear(activations(3, 16), w)


BAD_PAIRS = {  # on a bf16 pair-packed [2, 2, 8, 16, 2] (K 16)
    "k_odd": (lambda w: w, 15),
    "pairs_short": (lambda w: w[:, :, :-1].contiguous(), 16),
    "last_not_2": (lambda w: torch.cat([w, w[..., :1]], -1), 16),
    "half_not_16": (lambda w: w[:, :, :, :8].contiguous(), 16),
    "one_half": (lambda w: w[:, :1].contiguous(), 16),
    "not_contiguous": (lambda w: w.transpose(0, 1).contiguous().transpose(0, 1), 16),
    "fp32_pairs": (lambda w: w.float(), 16),
    "fp16_pairs": (lambda w: w.half(), 16),
}


@pytest.mark.parametrize("case", list(BAD_PAIRS), ids=list(BAD_PAIRS))
def test_bad_pair_packed_weight(linear, case):
    make, K = BAD_PAIRS[case]
    w = make(packed(64, 16, "bf16"))
    with pytest.raises(ValueError, match=r"\bweight\b"):
        linear(activations(3, K), w)


@pytest.mark.parametrize("shape", [(48, 16), (7, 16), (64,), (2, 64, 16)], ids=["N48", "N7", "rank1", "rank3"])
def test_bad_pack_input(shape):
    with pytest.raises(ValueError, match=r"\bweight\b"):
        eagle_kernels.cpu_linear_pack(torch.zeros(shape))


# ------------------------------------------------------------------------------ model side
@pytest.fixture
def packing(monkeypatch):
    """The CPU policy packs: on a CPU without AVX-512 (where the policy keeps row-major weights
    because the packed kernel's AVX2 path is the slower one) it is told the CPU has it, so the
    model-side bookkeeping and the packed AVX2 path run everywhere."""
    from eagle_kernels.models import cpu_weights

    if ("cpu_linear", "cpu") not in _dispatch.NATIVE_KERNELS:
        pytest.skip("the C++ extension is not built")
    if _dispatch.cpu_isa() not in ("avx512-ymm", "avx512", "avx512-bf16"):
        levels = _dispatch.CPU_ISA_LEVELS

        def avx512_cpu_isa():  # min(avx512, the cap), as the kernels resolve it on such a CPU
            cap = {"": "avx512", "native": "avx512", "portable": "scalar"}.get(
                os.environ.get(ISA_ENV, ""))
            cap = cap or os.environ[ISA_ENV]
            return levels[min(levels.index(cap), levels.index("avx512"))]

        monkeypatch.setattr(_dispatch, "cpu_isa", avx512_cpu_isa)
    cpu_weights._parse_policy.cache_clear()
    assert cpu_weights.cpu_policy().packed
    yield
    monkeypatch.undo()
    cpu_weights._parse_policy.cache_clear()


@pytest.mark.usefixtures("packing")
def test_packed_weights_follow_their_matrix(monkeypatch):
    """PackedWeights: one copy per matrix, repacked after an in-place update, dropped with the
    matrix; left alone where packing does not apply."""
    from eagle_kernels.models.cpu_weights import PackedWeights

    packs = PackedWeights()
    w = torch.randn(64, 16)
    first = packs(w)
    assert first.shape == (2, 2, 16, 16) and packs(w) is first and w in packs
    w.mul_(2.0)  # bumps the version counter
    assert w not in packs
    second = packs(w)
    assert second is not first and torch.equal(cpu_linear_unpack(second), w)
    odd = torch.randn(48, 16)
    assert packs(odd) is odd
    monkeypatch.setenv("EAGLE_KERNELS_CPU_LINEAR", "rows")
    assert packs(torch.randn(64, 16)).dim() == 2
    monkeypatch.delenv("EAGLE_KERNELS_CPU_LINEAR")
    monkeypatch.setenv(ISA_ENV, "avx2")  # the packed kernel's AVX2 tiles are slower: rows kept
    assert packs(torch.randn(64, 16)).dim() == 2
    monkeypatch.delenv(ISA_ENV)
    assert len(packs) == 1
    del w, first, second
    gc.collect()
    assert len(packs) == 0


@pytest.mark.usefixtures("packing")
def test_packed_copies_belong_to_their_model():
    """Each model packs its own matrices at load: tied embedding and LM head once, and the
    copies go with the model even while the caller still holds the row-major matrices."""
    from eagle_kernels.models import LlamaConfig, LlamaModel

    hf = tiny_hf_model(torch.float32, tie=True)
    hf.resize_token_embeddings(128)  # a multiple of 32, so the (tied) LM head packs too
    weights = {n: t.detach().clone() for n, t in hf.state_dict().items() if not n.endswith("inv_freq")}
    one, two = (LlamaModel(LlamaConfig.from_hf(hf.config), weights) for _ in range(2))
    o_proj = weights["model.layers.0.self_attn.o_proj.weight"]
    assert o_proj in one.packed and o_proj in two.packed and one.packed(o_proj) is not two.packed(o_proj)
    assert len(one.packed) == 1 + 4 * one.config.num_layers  # LM head (= embedding) + 4 per layer
    copy = weakref.ref(one.packed(o_proj))
    del one
    gc.collect()
    assert copy() is None and o_proj in two.packed


@pytest.mark.usefixtures("packing")
def test_load_time_copies_live_on_huge_pages(monkeypatch):
    """pack_all moves a model's load-time copies into one 2 MiB-aligned arena (the same values, the same
    logits), leaves them where they are with EAGLE_KERNELS_CPU_HUGE_PAGES=off, and names the variable for
    any other value."""
    from eagle_kernels.models import LlamaConfig, LlamaModel
    from eagle_kernels.models.cpu_weights import CPU_HUGE_PAGES_ENV, HUGE_PAGE_BYTES, huge_page_arena

    arena = huge_page_arena(5000)
    if arena is None:
        pytest.skip("no MADV_HUGEPAGE on this platform")
    assert arena.numel() == 5000 and arena.data_ptr() % HUGE_PAGE_BYTES == 0
    hf = tiny_hf_model(torch.float32, tie=True)
    hf.resize_token_embeddings(128)  # the tied LM head packs too
    weights = {n: t.detach().clone() for n, t in hf.state_dict().items() if not n.endswith("inv_freq")}
    models = {}
    for mode in ("auto", "off"):
        monkeypatch.setenv(CPU_HUGE_PAGES_ENV, mode)
        models[mode] = LlamaModel(LlamaConfig.from_hf(hf.config), weights)
    copies = {mode: [entry[2] for entry in model.packed._copies.values()] for mode, model in models.items()}
    assert len(copies["auto"]) == len(copies["off"]) == 1 + 4 * hf.config.num_hidden_layers
    for moved, kept in zip(copies["auto"], copies["off"]):
        assert torch.equal(moved, kept) and moved.data_ptr() % 4096 == 0
    assert len({t.untyped_storage().data_ptr() for t in copies["auto"]}) == 1  # one mapping
    assert len({t.untyped_storage().data_ptr() for t in copies["off"]}) == len(copies["off"])
    assert min(t.data_ptr() for t in copies["auto"]) % HUGE_PAGE_BYTES == 0
    tokens = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    logits = [model(tokens, model.new_cache(1, 8)).logits for model in models.values()]
    assert torch.equal(*logits)
    monkeypatch.setenv(CPU_HUGE_PAGES_ENV, "yes")
    with pytest.raises(ValueError, match=CPU_HUGE_PAGES_ENV):
        LlamaModel(LlamaConfig.from_hf(hf.config), weights)


def test_decoder_layer_takes_packed_weights():
    """cpu_decoder_layer with the four matrices packed: the reference (which unpacks) agrees to
    fp32 rounding, and so does the call with the row-major matrices."""

    fn = native_decoder_layer()
    args, kwargs = decoder_layer_case("smollm2", 2, 8, 37, "bf16", tree=True)
    packed_args = list(args)
    for i in (2, 3, 5, 6):  # qkv, o, gate_up, down
        packed_args[i] = eagle_kernels.cpu_linear_pack(args[i])
    check_decoder_layer((tuple(packed_args), kwargs), 8)
    torch.testing.assert_close(fn(*clone_args(tuple(packed_args)), **kwargs), fn(*clone_args(args), **kwargs),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("wdtype", ["fp32", "bf16"])  # bf16: the pair layout
def test_decoder_layer_rejects_a_bad_packed_weight(wdtype):

    fn = native_decoder_layer()
    args, kwargs = decoder_layer_case("smollm2", 1, 2, 5, wdtype, tree=False)
    bad = list(args)
    bad[3] = eagle_kernels.cpu_linear_pack(args[3])[:, :, :-1].contiguous()  # o_weight with K short (by one / a pair)
    for impl in (fn, reference.cpu_decoder_layer):
        with pytest.raises(ValueError, match=r"\bo_weight\b"):
            impl(*bad, **kwargs)


@pytest.mark.usefixtures("packing")
def test_model_reads_packed_copies(monkeypatch):
    """LlamaModel on CPU reads packed copies of its matrices (those with N a multiple of 32), and
    its logits agree with the row-major kernel's to fp32 rounding."""
    from eagle_kernels.models import llama

    model = llama.LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    tokens = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    results = {}
    for mode in ("auto", "rows"):
        monkeypatch.setenv("EAGLE_KERNELS_CPU_LINEAR", mode)
        cache = model.new_cache(1, 16)
        with torch.profiler.profile() as prof:
            results[mode] = model(tokens, cache).logits
        assert any(e.name == "eagle_kernels::cpu_decoder_forward" for e in prof.events())
    torch.testing.assert_close(results["auto"], results["rows"], rtol=1e-5, atol=1e-5)
    assert model.weights["model.layers.0.self_attn.o_proj.weight"] in model.packed
    # vocab 97 is not a multiple of 32: the LM head stays row-major (and still runs the kernel)
    assert model.weights["lm_head.weight"] not in model.packed
