"""cpu_decoder_layer: the C++ kernel against the reference (output and the K/V it writes) over a
shape grid, the model's fused-layer path against its op-by-op path, batch invariance and input
errors."""

import pytest
import torch

from eagle_kernels import _dispatch
from helpers import (
    DECODER_LAYERS,
    WEIGHT_DTYPES,
    check_decoder_layer,
    clone_args,
    decoder_layer_case,
    native_decoder_layer,
    random_tree,
    tiny_hf_model,
)


@pytest.mark.parametrize("weight_dtype", list(WEIGHT_DTYPES))
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("B,N,prefix", [(1, 1, 0), (1, 1, 37), (2, 8, 37), (3, 13, 100), (1, 64, 5)])
@pytest.mark.parametrize("layer", list(DECODER_LAYERS))
def test_matches_reference(layer, B, N, prefix, tree, weight_dtype):
    """Output and the K/V written agree with the float64-composed reference to fp32 rounding;
    the cache outside the new slots is untouched."""
    check_decoder_layer(decoder_layer_case(layer, B, N, prefix, weight_dtype, tree), N)


@pytest.mark.parametrize("weight_dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("slot_offset", [0, 2, 6])
@pytest.mark.parametrize("B,N,prefix", [(1, 2, 0), (2, 2, 37), (3, 8, 20)])
def test_eagle3_draft_layer_matches_reference(B, N, prefix, slot_offset, tree, weight_dtype):
    """The EAGLE-3 form: embedding input (2H-wide q/k/v) and new tokens after ``slot_offset``
    tree slots of earlier calls."""
    args, kwargs = decoder_layer_case("smollm2", B, N, prefix, weight_dtype, tree, embed=True, slot_offset=slot_offset)
    check_decoder_layer((args, kwargs), N, slot_offset)


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("eagle3", [False, True], ids=["target", "eagle3"])
@pytest.mark.parametrize("counts", [(8, 3, 0), (5, 1, 8), (8, 8, 8)])
def test_padding_rows_are_skipped(counts, eagle3, tree):
    """row_counts: the computed rows are bit for bit those of the unpadded call (rows are
    independent, and their tree-mask ancestors come before them), padding rows keep x, their
    K/V slots hold zeros, and the reference agrees."""
    fn = native_decoder_layer()
    N, slot_offset = 8, (2 if eagle3 else 0)
    args, kwargs = decoder_layer_case("smollm2", 3, N, 20, "fp32", tree, embed=eagle3, slot_offset=slot_offset)
    row_counts = torch.tensor(counts)
    full_args = clone_args(args)
    full = fn(*full_args, **kwargs)
    check_decoder_layer((args, {**kwargs, "row_counts": row_counts}), N, slot_offset)
    padded_args = clone_args(args)
    got = fn(*padded_args, **kwargs, row_counts=row_counts)
    for b, count in enumerate(counts):
        assert torch.equal(got[b, :count], full[b, :count])
        assert torch.equal(got[b, count:], args[0][b, count:])
        start = int(args[11][b]) + slot_offset
        for cache, full_cache in ((padded_args[9], full_args[9]), (padded_args[10], full_args[10])):
            assert torch.equal(cache[b, start:start + count], full_cache[b, start:start + count])
            assert not cache[b, start + count:start + N].any()


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512-ymm", "avx512", "avx512-bf16"])
@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16"])
def test_instruction_sets_match_reference(isa, weight_dtype, monkeypatch):
    """EAGLE_KERNELS_CPU_ISA caps the layer's kernels (linear layers, tree attention) as it caps
    the separate ops (a cap above what the CPU has runs its best): every level matches the
    reference."""
    monkeypatch.setenv("EAGLE_KERNELS_CPU_ISA", isa)
    check_decoder_layer(decoder_layer_case("smollm2", 2, 8, 37, weight_dtype, True), 8)


def test_rows_are_batch_invariant():
    """A request's rows are bit for bit the same alone and in a batch (each step is per row)."""
    fn = native_decoder_layer()
    args, kwargs = decoder_layer_case("smollm2", 3, 5, 20, "fp32", tree=True)
    together = fn(*clone_args(args), **kwargs)
    for b in range(3):
        alone = list(clone_args(args))
        for i in (0, 7, 8, 9, 10, 11, 12):  # per-request tensors: x, cos, sin, caches, lengths, mask
            alone[i] = alone[i][b:b + 1].contiguous()
        assert torch.equal(fn(*alone, **kwargs), together[b:b + 1])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("eagle3", [False, True], ids=["target", "eagle3"])
@pytest.mark.parametrize("B,N,prefix", [(1, 1, 37), (2, 8, 100), (3, 13, 70)])
def test_16bit_cache_matches_reference(B, N, prefix, eagle3, cache_dtype):
    """A bf16 / fp16 cache: k and v stored rounded to it, attention in it, as the reference (to the cache dtype's
    rounding: an fp32 k a rounding away from the reference's can round to the neighbouring 16-bit value)."""
    args, kwargs = decoder_layer_case("smollm2", B, N, prefix, "fp32", tree=True, embed=eagle3,
                                      slot_offset=2 if eagle3 else 0)
    args = args[:9] + (args[9].to(cache_dtype), args[10].to(cache_dtype)) + args[11:]
    before = clone_args(args)
    check_decoder_layer((args, kwargs), N, 2 if eagle3 else 0, tol=2e-2 if cache_dtype == torch.bfloat16 else 2e-3)
    for cache, old in ((args[9], before[9]), (args[10], before[10])):
        assert cache.dtype == cache_dtype and not torch.equal(cache, old)  # the new slots were written, in 16 bits


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_model_16bit_cache_layer_kernel_matches_op_by_op_path(monkeypatch, cache_dtype):
    """LlamaModel with a 16-bit cache (kv_cache_dtype): the fused layer (one call per layer) gives the op-by-op
    path's logits and cache entries (both round k, v and q to the cache dtype and attend in it)."""
    from eagle_kernels.models import llama

    model = llama.LlamaModel(*_tiny_config_and_weights(), kv_cache_dtype=cache_dtype)
    assert model.kv_cache_dtype == cache_dtype and model.new_cache(1, 4).k.dtype == cache_dtype
    tol = 2e-2 if cache_dtype == torch.bfloat16 else 2e-3
    fused, op_by_op = fused_and_op_by_op(model, monkeypatch)
    for got, want in zip(fused, op_by_op):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_kv_cache_dtype_must_be_16_or_32_bit_float():
    from eagle_kernels.models import llama

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        llama.LlamaModel(*_tiny_config_and_weights(), kv_cache_dtype=torch.int8)


def _tiny_config_and_weights():
    from eagle_kernels.models import llama

    model = llama.LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    return model.config, model.weights


def test_model_layer_kernel_matches_op_by_op_path(monkeypatch):
    """LlamaModel: decoding and a tree pass through cpu_decoder_layer agree with the op-by-op path
    to fp32 rounding (logits and every cache entry), and run one kernel call per layer."""
    from eagle_kernels.models import llama

    fused, op_by_op = fused_and_op_by_op(llama.LlamaModel.from_transformers(tiny_hf_model(torch.float32)), monkeypatch)
    for got, want in zip(fused, op_by_op):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def fused_and_op_by_op(model, monkeypatch):
    """(step logits, tree-pass logits, k cache, v cache) of a 70-token prefill (op by op either way: 140 rows),
    one decoded token and a 6-node tree pass, through cpu_decoder_forward (the default), through
    cpu_decoder_layers (EAGLE_KERNELS_CPU_LAYER=stack), through cpu_decoder_layer (layer) and through the op-by-op
    path. Checks that the default makes one forward call, the stack mode one stack call, the layer mode one layer
    call per layer, the op-by-op path none of them, and that the default and the stack mode give the layer mode's
    results bit for bit; returns (the default's, the op-by-op path's)."""
    from eagle_kernels.models import llama

    native_decoder_layer()
    prompt = torch.randint(0, 97, (2, 70))
    tree = random_tree(2, 6, seed=3)
    results = {}
    expected_calls = {"auto": (0, 0, 1), "stack": (0, 1, 0), "layer": (model.config.num_layers, 0, 0),
                      "ops": (0, 0, 0)}
    for mode, calls in expected_calls.items():
        monkeypatch.setenv(llama.CPU_LAYER_ENV, mode)
        cache = model.new_cache(2, 96)
        model(prompt, cache)
        cache.seqlens += 70
        with torch.profiler.profile() as prof:
            step = model(prompt[:, :1], cache)
        names = [e.name for e in prof.events()]
        assert tuple(names.count(f"eagle_kernels::{op}") for op in
                     ("cpu_decoder_layer", "cpu_decoder_layers", "cpu_decoder_forward")) == calls
        cache.seqlens += 1
        positions = cache.seqlens[:, None].long() + tree.depths.long()
        verify = model(tree.tokens % 97, cache, positions=positions, tree_mask=tree.mask)
        results[mode] = (step.logits, verify.logits, cache.k, cache.v)
    for mode in ("auto", "stack"):
        for got, want in zip(results[mode], results["layer"]):
            assert torch.equal(got, want)
    return results["auto"], results["ops"]


def test_model_forward_call_follows_weight_updates(monkeypatch):
    """The default path keeps the per-layer weight lists of its cpu_decoder_forward call between passes: a matrix
    updated in place, a weight replaced under its name and a packed copy repacked are all used by the next pass
    (its logits equal a fresh op-by-op pass over the updated weights)."""
    from eagle_kernels.models import llama

    native_decoder_layer()
    model = llama.LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    prompt = torch.randint(0, 97, (1, 9))

    def step(mode):
        monkeypatch.setenv(llama.CPU_LAYER_ENV, mode)
        cache = model.new_cache(1, 16)
        return model(prompt, cache).logits

    before = step("auto")
    with torch.no_grad():
        model.layer_weights(1).gate_up.mul_(1.5)  # in place: a new version of the fused matrix
    after_update = step("auto")
    assert not torch.equal(after_update, before)
    torch.testing.assert_close(after_update, step("ops"), rtol=1e-5, atol=1e-5)
    name = "model.layers.0.self_attn.o_proj.weight"
    model.weights[name] = model.weights[name] * 0.5  # replaced under its name
    after_replace = step("auto")
    assert not torch.equal(after_replace, after_update)
    torch.testing.assert_close(after_replace, step("ops"), rtol=1e-5, atol=1e-5)


def test_model_row_counts_skip_padding_rows(monkeypatch):
    """LlamaModel.forward(row_counts=): on the cpu_decoder_layer path the computed rows' logits,
    hidden and layer states are bit for bit those of the unpadded pass, padding rows get zero
    logits, and the op-by-op path (which computes every row) agrees on the computed rows."""
    from eagle_kernels.models import llama

    native_decoder_layer()
    model = llama.LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    prompt = torch.randint(0, 97, (3, 40))
    tree = random_tree(3, 7, seed=5)
    counts = torch.tensor([7, 2, 0])

    def tree_pass(row_counts):
        cache = model.new_cache(3, 64)
        model(prompt, cache)
        cache.seqlens += 40
        positions = cache.seqlens[:, None].long() + tree.depths.long()
        return model(tree.tokens % 97, cache, positions=positions, tree_mask=tree.mask, feature_layers=(0, 1),
                     row_counts=row_counts)

    full, padded = tree_pass(None), tree_pass(counts)
    for b, count in enumerate(counts.tolist()):
        assert torch.equal(padded.logits[b, :count], full.logits[b, :count])
        assert torch.equal(padded.hidden[b, :count], full.hidden[b, :count])
        for layer in (0, 1):
            assert torch.equal(padded.layer_states[layer][b, :count], full.layer_states[layer][b, :count])
        assert not padded.logits[b, count:].any()
    for mode in ("stack", "layer"):  # the torch ops around one stack call, a call per layer: the same bits
        monkeypatch.setenv(llama.CPU_LAYER_ENV, mode)
        other = tree_pass(counts)
        for got, want in ((other.logits, padded.logits), (other.hidden, padded.hidden),
                          *((other.layer_states[layer], padded.layer_states[layer]) for layer in (0, 1))):
            assert torch.equal(got, want)
    monkeypatch.setenv(llama.CPU_LAYER_ENV, "ops")
    ops_path = tree_pass(counts)
    for b, count in enumerate(counts.tolist()):
        torch.testing.assert_close(ops_path.logits[b, :count], full.logits[b, :count], rtol=1e-5, atol=1e-5)


def test_eagle3_head_layer_kernel_matches_op_by_op_path(monkeypatch):
    """EagleHead (EAGLE-3): a pass over committed pairs and a drafting pass after earlier tree
    slots (slot_offset, tree mask, positions broadcast per request as the decoder passes them)
    run as one cpu_head_forward call each (auto), one cpu_decoder_layer call each (layer), and
    agree with the op-by-op path to fp32 rounding, hidden states and head cache alike; auto and
    layer bit for bit."""
    from eagle_kernels.models import llama
    from eagle_kernels.models.eagle_head import EagleHead

    native_decoder_layer()
    target = llama.LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    head = EagleHead.random(target, "eagle3", draft_vocab_size=50, std=0.2)
    H = target.config.hidden_size
    g = torch.Generator().manual_seed(5)
    tokens, features = torch.randint(0, 97, (2, 9), generator=g), torch.randn(2, 9, H, generator=g)
    draft_tokens, draft_features = torch.randint(0, 97, (2, 3), generator=g), torch.randn(2, 3, H, generator=g)
    tree = random_tree(2, 5, seed=1)
    results = {}
    for mode in ("auto", "layer", "ops"):
        monkeypatch.setenv(llama.CPU_LAYER_ENV, mode)
        cache = head.new_cache(2, 24)
        with torch.profiler.profile() as prof:
            committed = head(tokens, features, cache)
            cache.seqlens += 9
            positions = cache.seqlens[:, None].long() + 1  # [B, 1]: one position per depth, broadcast
            drafted = head(draft_tokens, draft_features, cache, positions=positions, tree_mask=tree.mask,
                           slot_offset=2)
        calls = {op: sum(e.name == f"eagle_kernels::{op}" for e in prof.events())
                 for op in ("cpu_head_forward", "cpu_decoder_layer")}
        assert calls == {"auto": {"cpu_head_forward": 2, "cpu_decoder_layer": 0},
                         "layer": {"cpu_head_forward": 0, "cpu_decoder_layer": 2},
                         "ops": {"cpu_head_forward": 0, "cpu_decoder_layer": 0}}[mode]
        results[mode] = (committed, drafted, cache.k, cache.v)
    for got, want, exact in zip(results["auto"], results["ops"], results["layer"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got, exact)


def test_eagle3_head_run_fuses_fc_and_logits(monkeypatch):
    """EagleHead.run(fc=True) and run(logits=True), the decoder's commit and draft passes: one
    cpu_head_forward call each whose hidden states, draft logits and cache equal the layer path's
    (target_features, the layer call, logits) bit for bit; an in-place update of the head's LM head
    and of its layer's o matrix is used by the next fused call."""
    from eagle_kernels.models import llama
    from eagle_kernels.models.eagle_head import EagleHead

    native_decoder_layer()
    target = llama.LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    head = EagleHead.random(target, "eagle3", draft_vocab_size=50, std=0.2)
    H = target.config.hidden_size
    g = torch.Generator().manual_seed(7)
    tokens, rows = torch.randint(0, 97, (2, 4), generator=g), torch.randn(2, 4, 3 * H, generator=g)
    draft_tokens, draft_features = torch.randint(0, 97, (2, 3), generator=g), torch.randn(2, 3, H, generator=g)
    tree = random_tree(2, 5, seed=2)

    def passes(mode):
        monkeypatch.setenv(llama.CPU_LAYER_ENV, mode)
        cache = head.new_cache(2, 24)
        cache.seqlens += 5
        with torch.profiler.profile() as prof:
            committed, none = head.run(tokens, rows, cache, fc=True)
            cache.seqlens += 4
            drafted, logits = head.run(draft_tokens, draft_features, cache, positions=cache.seqlens[:, None].long(),
                                       tree_mask=tree.mask, slot_offset=2, logits=True)
        assert none is None and logits.shape == (2, 3, 50)
        fused = sum(e.name == "eagle_kernels::cpu_head_forward" for e in prof.events())
        assert fused == (2 if mode == "auto" else 0)
        return committed, drafted, logits, cache.k, cache.v

    def assert_equal(got, want):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)

    before = passes("auto")
    assert_equal(before, passes("layer"))
    with torch.no_grad():
        head.weights["lm_head.weight"].mul_(1.5)
        head.layer_weights().o.mul_(0.5)
    after = passes("auto")
    assert not torch.equal(after[2], before[2]) and not torch.equal(after[1], before[1])
    assert_equal(after, passes("layer"))


def test_layer_env_rejects_unknown_mode(monkeypatch):
    from eagle_kernels.models import llama

    model = llama.LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    monkeypatch.setenv(llama.CPU_LAYER_ENV, "fused")
    with pytest.raises(ValueError, match=llama.CPU_LAYER_ENV):
        model(torch.zeros(1, 1, dtype=torch.int64), model.new_cache(1, 4))


BAD_INPUTS = {
    "x": lambda a: a.__setitem__(0, a[0].double()),
    "input_norm": lambda a: a.__setitem__(1, a[1][:-1]),
    "qkv_weight": lambda a: a.__setitem__(2, a[2][:-1]),
    "o_weight": lambda a: a.__setitem__(3, a[3].t().contiguous().t()),
    "post_norm": lambda a: a.__setitem__(4, a[4].half()),
    "gate_up_weight": lambda a: a.__setitem__(5, a[5][:-1]),
    "down_weight": lambda a: a.__setitem__(6, a[6][:, :-1]),
    "cos": lambda a: a.__setitem__(7, a[7][:, :, :-2]),
    "sin": lambda a: a.__setitem__(8, a[8].double()),
    "k_cache": lambda a: a.__setitem__(9, a[9].double()),
    "v_cache": lambda a: a.__setitem__(10, a[10][:, :-1]),
    "cache_seqlens": lambda a: a.__setitem__(11, torch.tensor([50, 0], dtype=torch.int32)),
    "tree_mask": lambda a: a.__setitem__(12, torch.zeros(2, 3, 2, dtype=torch.int64)),
}


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("row_counts", [torch.tensor([3, 4]), torch.tensor([-1, 2]),
                                        torch.tensor([3, 2], dtype=torch.int32), torch.tensor([3])],
                         ids=["over-N", "negative", "int32", "short"])
def test_bad_row_counts_are_named(row_counts, backend):
    fn, reason = _dispatch.implementation("cpu_decoder_layer", backend, "cpu")
    if fn is None:
        pytest.skip(reason)
    args, kwargs = decoder_layer_case("small", 2, 3, 4, "fp32", tree=True)
    with pytest.raises(ValueError, match="row_counts"):
        fn(*args, **kwargs, row_counts=row_counts)


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_names_the_tensor(name, backend):
    fn, reason = _dispatch.implementation("cpu_decoder_layer", backend, "cpu")
    if fn is None:
        pytest.skip(reason)
    args, kwargs = decoder_layer_case("small", 2, 3, 4, "fp32", tree=True)
    args = list(args)
    BAD_INPUTS[name](args)
    with pytest.raises(ValueError, match=name):
        fn(*args, **kwargs)


@pytest.mark.parametrize("eagle3", [False, True], ids=["target", "eagle3"])
@pytest.mark.parametrize("B,N", [(0, 3), (2, 0), (0, 0)], ids=["B0", "N0", "B0-N0"])
@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_empty_batch_or_no_tokens(backend, B, N, eagle3):
    """B = 0 or N = 0 (a 2-request, 3-token tree pass with padding rows sliced; EAGLE-3: with the embedding input,
    after 2 earlier slots): the C++ op's empty output, the caches untouched (the reference used to fail reshaping
    0 elements)."""
    fn, reason = _dispatch.implementation("cpu_decoder_layer", backend, "cpu")
    if fn is None:
        pytest.skip(reason)
    cpp = native_decoder_layer()
    slot_offset = 2 if eagle3 else 0
    args, kwargs = decoder_layer_case("small", 2, 3, 4, "fp32", tree=True, embed=eagle3, slot_offset=slot_offset)
    args = list(args)
    args[0], args[7], args[8] = (args[i][:B, :N] for i in (0, 7, 8))  # x, cos, sin
    args[9], args[10], args[11] = (args[i][:B] for i in (9, 10, 11))  # the caches, cache_seqlens
    args[12] = args[12][:B, :slot_offset + N, :(slot_offset + N + 63) // 64]
    if eagle3:
        kwargs["embed"] = kwargs["embed"][:B, :N]
    kwargs["row_counts"] = torch.full((B,), min(N, 1), dtype=torch.int64)
    want_args, got_args = clone_args(args), clone_args(args)
    want, got = cpp(*want_args, **kwargs), fn(*got_args, **kwargs)
    assert (got.shape, got.dtype) == (want.shape, want.dtype) == (args[0].shape, torch.float32)
    for i in (9, 10):
        assert torch.equal(got_args[i], args[i]) and torch.equal(want_args[i], args[i])


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("name,value", [("num_heads", 4.0), ("eps", "x"), ("eps", torch.tensor(1e-5)),
                                        ("slot_offset", 2.0)], ids=["num-heads-float", "eps-str", "eps-tensor",
                                                                    "slot-offset-float"])
def test_bad_scalar_type_names_the_argument(name, value, backend):
    """A scalar of the wrong Python type is a ValueError naming it on every backend (the C++ op's schema used to
    raise a RuntimeError, or to convert a tensor), the caches untouched."""
    fn, reason = _dispatch.implementation("cpu_decoder_layer", backend, "cpu")
    if fn is None:
        pytest.skip(reason)
    args, kwargs = decoder_layer_case("small", 2, 3, 4, "fp32", tree=True, embed=True, slot_offset=2)
    caches = args[9].clone(), args[10].clone()
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        fn(*args, **{**kwargs, name: value})
    assert torch.equal(args[9], caches[0]) and torch.equal(args[10], caches[1])


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("eps", [-1.0, float("nan")], ids=["negative", "nan"])
@pytest.mark.parametrize("op", ["cpu_decoder_layer", "cpu_decoder_layers"])
def test_eps_below_zero_names_it(op, eps, backend):
    """A negative or NaN eps is a ValueError naming it (it gave NaN rows), the caches untouched."""
    fn, reason = _dispatch.implementation(op, backend, "cpu")
    if fn is None:
        pytest.skip(reason)
    args, kwargs = decoder_layer_case("small", 2, 3, 4, "fp32", tree=True, embed=False)
    if op == "cpu_decoder_layers":
        args = (args[0], *([a] for a in args[1:7]), *args[7:9], args[9][None], args[10][None], *args[11:])
        kwargs = {k: v for k, v in kwargs.items() if k in ("num_heads", "eps")}
    caches = args[-4].clone(), args[-3].clone()
    with pytest.raises(ValueError, match=r"eps: expected a number >= 0"):
        fn(*args, **{**kwargs, "eps": eps})
    assert torch.equal(args[-4], caches[0]) and torch.equal(args[-3], caches[1])


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("name", ["embed", "embed_norm", "slot_offset", "tree_mask"])
def test_bad_eagle3_input_names_the_argument(name, backend):
    fn, reason = _dispatch.implementation("cpu_decoder_layer", backend, "cpu")
    if fn is None:
        pytest.skip(reason)
    args, kwargs = decoder_layer_case("small", 2, 3, 4, "fp32", tree=True, embed=True, slot_offset=2)
    args = list(args)
    if name == "embed":
        kwargs["embed"] = kwargs["embed"][:, :2]
    elif name == "embed_norm":
        del kwargs["embed_norm"]
    elif name == "slot_offset":
        kwargs["slot_offset"] = -1
    else:  # a mask for the 3 new rows only, not the 2 + 3 slots
        args[12] = random_tree(2, 3, 0).mask
    with pytest.raises(ValueError, match=name):
        fn(*args, **kwargs)


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_num_heads_must_be_a_multiple_of_kv_heads(backend):
    fn, reason = _dispatch.implementation("cpu_decoder_layer", backend, "cpu")
    if fn is None:
        pytest.skip(reason)
    args, kwargs = decoder_layer_case("small", 2, 3, 4, "fp32", tree=False)
    with pytest.raises(ValueError, match="num_heads"):
        fn(*args, **{**kwargs, "num_heads": 3})
