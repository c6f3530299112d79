"""cpu_head_forward: the C++ op against the composition of the ops it fuses (embedding, fc by cpu_linear, RoPE rows
gathered from the [P, D / 2] tables, cpu_decoder_layer with the embedding input, the final RMSNorm, cpu_linear) bit
for bit (logits, hidden and both caches) over commit passes (fc) and draft passes (slot_offset, tree mask), 16-bit
embedding tables, packed and quantized matrices, with and without the LM head; every backend against the reference
ops' composition; the fake kernel's shapes and opcheck; input errors naming the argument, raised before the cache
is written."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from eagle_kernels import _dispatch, ops, reference
from eagle_kernels._types import HeadForwardOutput
from eagle_kernels.reference.cpu_linear import quantize as quantize_blocks
from helpers import WEIGHT_DTYPES, clone_args, decoder_layer_inputs, random_tree

NUM_HEADS, HKV, D, H, INTER = 4, 2, 16, 64, 64  # H a multiple of 32: matrices can be packed / quantized
V_EMBED, V_DRAFT, F_FEATURES = 77, 96, 3 * H
CPP_LAYER, CPP_LINEAR = torch.ops.eagle_kernels.cpu_decoder_layer, torch.ops.eagle_kernels.cpu_linear


def head_implementation(backend="cpp"):
    """The backend's cpu_head_forward, or skip."""
    fn, reason = _dispatch.implementation("cpu_head_forward", backend, "cpu")
    if fn is None:
        pytest.skip(reason)
    return fn


def matrix(rows, cols, kind, g):
    """A [rows, cols] matrix as "fp32" / "bf16", "packed-<dtype>" (cpu_linear_pack) or "q8_0" (quantized, packed)."""
    w = torch.randn(rows, cols, generator=g) / cols ** 0.5
    if kind == "q8_0":
        return ops.cpu_linear_pack(quantize_blocks(w, "q8_0"))
    if kind.startswith("packed-"):
        return ops.cpu_linear_pack(w.to(WEIGHT_DTYPES[kind[7:]]))
    return w.to(WEIGHT_DTYPES[kind])


def head_case(B, N, prefix, commit=True, embed="fp32", weights="fp32", logits=True, seed=0):
    """(args, kwargs) of cpu_head_forward. A commit pass: features [B, N, 3H] through fc, causal positions
    prefix + i. A draft pass (commit False): features [B, N, H] as the layer's input, written after 3 earlier
    draft slots (slot_offset 3) under a tree mask over 3 + N slots, positions prefix - 1 + depth."""
    g = torch.Generator().manual_seed(seed)
    slot_offset = 0 if commit else 3
    mask = None if commit else random_tree(B, slot_offset + N, seed).mask
    prefixes = (prefix, max(prefix - 5, 1), prefix + 2)[:B]
    layer, _ = decoder_layer_inputs(B, N, H, NUM_HEADS, HKV, D, INTER, capacity=prefix + slot_offset + N + 3,
                                    generator=g, weight_dtype=WEIGHT_DTYPES[weights.removeprefix("packed-")]
                                    if weights != "q8_0" else torch.float32, tree_mask=mask, prefix=prefixes,
                                    embed=True)
    input_norm, qkv, o, post_norm, gate_up, down = layer[1:7]
    if weights.startswith("packed-") or weights == "q8_0":
        pack = (lambda w: ops.cpu_linear_pack(quantize_blocks(w, "q8_0"))) if weights == "q8_0" else ops.cpu_linear_pack
        qkv, o, gate_up, down = (pack(w) for w in (qkv, o, gate_up, down))
    k, v, seqlens = layer[9], layer[10], layer[11]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(int(seqlens.max()) + slot_offset + N + 3, dtype=torch.float64)[:, None] * inv_freq
    if commit:
        positions = seqlens.long()[:, None] + torch.arange(N)
    else:
        positions = seqlens.long()[:, None] - 1 + torch.randint(1, 4, (B, N), generator=g)
    features = torch.randn(B, N, F_FEATURES if commit else H, generator=g)
    fc = matrix(H, F_FEATURES, weights if weights != "bf16" else "fp32", g) if commit else None
    final_norm = 1 + 0.1 * torch.randn(H, generator=g) if logits else None
    lm_head = matrix(V_DRAFT, H, weights if weights != "bf16" else "packed-bf16", g) if logits else None
    table = torch.randn(V_EMBED, H, generator=g).to(WEIGHT_DTYPES[embed])
    args = (torch.randint(0, V_EMBED, (B, N), generator=g), table, features, fc, angles.cos().float(),
            angles.sin().float(), positions, input_norm, 1 + 0.1 * torch.randn(H, generator=g), qkv, o, post_norm,
            gate_up, down, final_norm, lm_head, k, v, seqlens, mask)
    return args, {"num_heads": NUM_HEADS, "eps": 1e-5, "slot_offset": slot_offset}


def composition(args, kwargs, layer=CPP_LAYER, linear=CPP_LINEAR):
    """The op as the ops it fuses: (logits, hidden), the caches written in place."""
    (tokens, table, features, fc, rope_cos, rope_sin, positions, input_norm, embed_norm, qkv, o, post_norm, gate_up,
     down, final_norm, lm_head, k, v, seqlens, mask) = args
    x = features if fc is None else linear(features, fc)
    cos = torch.cat([rope_cos[positions], rope_cos[positions]], -1)
    sin = torch.cat([rope_sin[positions], rope_sin[positions]], -1)
    hidden = layer(x, input_norm, qkv, o, post_norm, gate_up, down, cos, sin, k, v, seqlens, mask, **kwargs,
                   embed=F.embedding(tokens, table).float(), embed_norm=embed_norm)
    if lm_head is None:
        return hidden.new_zeros(*hidden.shape[:2], 0), hidden
    return linear(F.rms_norm(hidden, (H,), final_norm, kwargs["eps"]), lm_head), hidden


@pytest.mark.parametrize("embed,weights", [("fp32", "fp32"), ("bf16", "packed-bf16"), ("fp16", "q8_0"),
                                           ("bf16", "bf16")])
@pytest.mark.parametrize("commit", [True, False], ids=["commit", "draft"])
@pytest.mark.parametrize("logits", [True, False], ids=["logits", "hidden-only"])
@pytest.mark.parametrize("B,N,prefix", [(1, 1, 37), (2, 4, 20), (3, 3, 9)])
def test_equals_composition(B, N, prefix, logits, commit, embed, weights):
    """A commit pass (fc over 3H features) or a draft pass (features as the input, slot_offset, tree mask), any
    table dtype, dense / packed / Q8_0 matrices, with or without the LM head: the composition's results, bit for
    bit, and the caches it writes."""
    fn = head_implementation()
    args, kwargs = head_case(B, N, prefix, commit, embed, weights, logits)
    want_args = clone_args(args)
    got = fn(*args, **kwargs)
    want = composition(want_args, kwargs)
    for name, a, b in zip(("logits", "hidden"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(args[16], want_args[16]) and torch.equal(args[17], want_args[17])
    assert got[0].shape == (B, N, V_DRAFT if logits else 0) and got[1].shape == (B, N, H)


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("commit", [True, False], ids=["commit", "draft"])
def test_matches_reference_composition(commit, backend):
    """Every backend against the reference ops composed here, to fp32 rounding: logits, hidden and cache."""
    fn = head_implementation(backend)
    args, kwargs = head_case(2, 3, 12, commit, "bf16", "packed-bf16")
    want_args = clone_args(args)
    got = fn(*args, **kwargs)
    want = composition(want_args, kwargs, layer=reference.cpu_decoder_layer, linear=reference.cpu_linear)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(args[16], want_args[16], rtol=1e-4, atol=1e-4)


def test_public_op_returns_named_tuple():
    """ops.cpu_head_forward (whichever backend it picks) returns a HeadForwardOutput of the op's results."""
    args, kwargs = head_case(2, 3, 4)
    want_args = clone_args(args)
    got = ops.cpu_head_forward(*args, **kwargs)
    assert type(got) is HeadForwardOutput
    torch.testing.assert_close(tuple(got), composition(want_args, kwargs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("logits", [True, False], ids=["logits", "hidden-only"])
def test_fake_shapes_and_opcheck(logits):
    """Under FakeTensorMode: logits [B, N, Vd] ([B, N, 0] without the head), hidden [B, N, H]; opcheck agrees
    (mutation annotations, fake kernel, real op)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kwargs = head_case(2, 3, 4, commit=False, weights="q8_0", logits=logits)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = torch.ops.eagle_kernels.cpu_head_forward(*fake, **kwargs)
    assert [(tuple(t.shape), t.dtype) for t in out] == [((2, 3, V_DRAFT if logits else 0), torch.float32),
                                                        ((2, 3, H), torch.float32)]
    torch.library.opcheck(torch.ops.eagle_kernels.cpu_head_forward.default, args, kwargs)


def _set(i, f):
    return lambda a, kw: a.__setitem__(i, f(a[i]))


BAD_INPUTS = {  # id -> (the name the error must carry, how the arguments are spoiled)
    "tokens-int32": ("tokens", _set(0, lambda t: t.int())),
    "tokens-past-vocab": ("tokens", _set(0, lambda t: t.index_fill(1, torch.tensor([1]), V_EMBED))),
    "embed-int": ("embed_table", _set(1, lambda e: e.long())),
    "features-B": ("features", _set(2, lambda f: f[:1])),
    "features-fp16": ("features", _set(2, lambda f: f.half())),
    "fc-width": ("fc_weight", _set(3, lambda w: w[:, :-1].contiguous())),
    "no-fc-3H": ("features", _set(3, lambda w: None)),
    "cos-width": ("rope_cos", _set(4, lambda c: c[:, :-1].contiguous())),
    "sin-rows": ("rope_sin", _set(5, lambda s: s[:-1])),
    "positions-shape": ("positions", _set(6, lambda p: p[:, :-1])),
    "positions-past-P": ("positions", lambda a, kw: a[6].__setitem__((1, 2), a[4].shape[0])),
    "embed-norm-shape": ("embed_norm", _set(8, lambda w: w[:-1])),
    "qkv-H-wide": ("qkv_weight", _set(9, lambda w: w[:, :H].contiguous())),
    "lm-head-alone": ("lm_head", _set(14, lambda w: None)),
    "lm-head-K": ("lm_head", _set(15, lambda w: w[:, :-1].contiguous())),
    "cache-5d": ("k_cache", _set(16, lambda k: k[None])),
    "cache-full": ("cache", lambda a, kw: a[18].fill_(a[16].shape[1] - 1)),
    "mask-slots": ("tree_mask", lambda a, kw: kw.__setitem__("slot_offset", 0)),
    # Scalars of the wrong Python type: the C++ op's schema used to raise a RuntimeError (or to convert them).
    "eps-str": ("eps", lambda a, kw: kw.__setitem__("eps", "x")),
    # A negative or NaN eps gave NaN rows without an error.
    "eps-negative": ("eps", lambda a, kw: kw.__setitem__("eps", -1.0)),
    "eps-nan": ("eps", lambda a, kw: kw.__setitem__("eps", float("nan"))),
    "eps-float32": ("eps", lambda a, kw: kw.__setitem__("eps", np.float32(1e-5))),
    "slot-offset-float": ("slot_offset", lambda a, kw: kw.__setitem__("slot_offset", 0.0)),
    "slot-offset-bool": ("slot_offset", lambda a, kw: kw.__setitem__("slot_offset", True)),
    "num-heads-numpy": ("num_heads", lambda a, kw: kw.__setitem__("num_heads", np.int64(kw["num_heads"]))),
}


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_the_argument(case, backend):
    """A ValueError naming the argument; the caches are left as they were (every check precedes the layer)."""
    fn = head_implementation(backend)
    commit = case != "mask-slots"
    args, kwargs = head_case(2, 3, 4, commit=commit)
    args, kwargs = list(args), dict(kwargs)
    name, spoil = BAD_INPUTS[case]
    spoil(args, kwargs)
    caches = args[16].clone(), args[17].clone()
    with pytest.raises(ValueError, match=name):
        fn(*args, **kwargs)
    assert torch.equal(args[16], caches[0]) and torch.equal(args[17], caches[1])


@pytest.mark.parametrize("logits", [True, False], ids=["logits", "no-head"])
@pytest.mark.parametrize("commit", [True, False], ids=["commit", "draft"])
@pytest.mark.parametrize("B,N", [(0, 3), (2, 0), (0, 0)], ids=["B0", "N0", "B0-N0"])
@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_empty_batch_or_no_tokens(backend, B, N, commit, logits):
    """B = 0 or N = 0 (the inputs of a 3-request, 3-token pass sliced; a draft pass keeps its 3 earlier slots):
    what the C++ op returns (empty logits and hidden of the right shapes and dtypes) and both caches untouched (the
    reference's layer used to fail reshaping 0 elements)."""
    fn, cpp = head_implementation(backend), head_implementation("cpp")
    args, kwargs = head_case(3, 3, 4, commit, logits=logits)
    args = list(args)
    for i in (0, 2, 6):  # tokens, features, positions
        args[i] = args[i][:B, :N]
    for i in (16, 17, 18):  # the caches, cache_seqlens
        args[i] = args[i][:B]
    if args[19] is not None:
        slots = kwargs["slot_offset"] + N
        args[19] = args[19][:B, :slots, :(slots + 63) // 64]
    want_args, got_args = clone_args(args), clone_args(args)
    want, got = cpp(*want_args, **kwargs), fn(*got_args, **kwargs)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
    assert got.logits.shape == (B, N, V_DRAFT if logits else 0) and got.hidden.shape == (B, N, H)
    for i in (16, 17):
        assert torch.equal(got_args[i], args[i]) and torch.equal(want_args[i], args[i])


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("commit", [True, False], ids=["commit", "draft"])
def test_nan_row_stays_in_its_request(commit, backend):
    """A NaN feature row of one request reaches that request's logits (never silently finite) and leaves the other
    request's logits, hidden rows and cache entries as a clean call gives them, bit for bit."""
    fn = head_implementation(backend)
    args, kwargs = head_case(2, 3, 10, commit)
    features = args[2].clone()
    features[1, 1, 5] = float("nan")
    clean_args, nan_args = clone_args(args), list(clone_args(args))
    nan_args[2] = features
    clean, got = fn(*clean_args, **kwargs), fn(*nan_args, **kwargs)
    for part, clean_part in zip(got, clean):
        assert torch.equal(part[0], clean_part[0])
    for cache, clean_cache in ((nan_args[16], clean_args[16]), (nan_args[17], clean_args[17])):
        assert torch.equal(cache[0], clean_cache[0])
    assert not torch.isfinite(got.logits[1]).all()
