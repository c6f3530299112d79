"""cpu_decoder_layers: the C++ stack against cpu_decoder_layer run layer by layer (bit for bit: output, layer
states and every cache entry) and against the reference, packed and quantized weights, padding rows, and input
errors naming the tensor (with its layer)."""

import pytest
import torch

from eagle_kernels import _dispatch, ops, reference
from eagle_kernels.reference.cpu_linear import quantize as quantize_blocks
from helpers import (
    DECODER_LAYERS,
    WEIGHT_DTYPES,
    clone_args,
    decoder_stack_inputs,
    native_decoder_layer,
    random_tree,
)


def stack_implementation(backend="cpp"):
    """The backend's cpu_decoder_layers, or skip."""
    fn, reason = _dispatch.implementation("cpu_decoder_layers", backend, "cpu")
    if fn is None:
        pytest.skip(reason)
    return fn


def stack_case(shape, L, B, N, prefix, weight_dtype="fp32", tree=False, state_layers=(), seed=0):
    num_heads, Hkv, D, H, inter = DECODER_LAYERS[shape]
    g = torch.Generator().manual_seed(seed)
    mask = random_tree(B, N, seed).mask if tree else None
    return decoder_stack_inputs(L, B, N, H, num_heads, Hkv, D, inter, capacity=prefix + N + 3, generator=g,
                                weight_dtype=WEIGHT_DTYPES[weight_dtype], tree_mask=mask,
                                prefix=(prefix, max(prefix - 5, 0), prefix + 2)[:B], state_layers=state_layers)


def layer_by_layer(args, kwargs, row_counts=None):
    """cpu_decoder_layer L times over the stack's arguments: (out, {layer: output}), caches written in place."""
    layer_fn = native_decoder_layer()
    x, lists, (cos, sin, k, v, seqlens, mask) = args[0], args[1:7], args[7:]
    outputs = []
    for layer in range(k.shape[0]):
        x = layer_fn(x, *(weights[layer] for weights in lists), cos, sin, k[layer], v[layer], seqlens, mask,
                     num_heads=kwargs["num_heads"], eps=kwargs["eps"], row_counts=row_counts)
        outputs.append(x)
    return x, outputs


def pack(args, activations="fp32"):
    """The stack's arguments with every weight matrix cpu_linear_pack'ed (quantized ones in ``activations``' layout)."""
    args = list(args)
    for i in (2, 3, 5, 6):
        args[i] = [ops.cpu_linear_pack(w, activations) for w in args[i]]
    return tuple(args)


def quantize(args, fmt):
    args = list(args)
    for i in (2, 3, 5, 6):
        args[i] = [quantize_blocks(w, fmt) for w in args[i]]
    return tuple(args)


@pytest.mark.parametrize("weights", ["fp32", "bf16", "packed-fp32", "packed-bf16", "q8_0", "q4_1-int8"])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("B,N,prefix", [(1, 1, 37), (2, 8, 20), (3, 5, 0)])
def test_equals_one_call_per_layer(B, N, prefix, tree, weights):
    """The stack gives what cpu_decoder_layer gives called once per layer, bit for bit: the output, each layer
    state asked for (repeats and the last layer included), and every entry of the [L, ...] caches."""
    fn = stack_implementation()
    shape = "small" if weights in ("fp32", "bf16") else "smollm2"  # packing: N, K multiples of 32
    args, kwargs = stack_case(shape, 4, B, N, prefix, "bf16" if "bf16" in weights else "fp32", tree,
                              state_layers=(2, 0, 3, 2))
    if weights.startswith("packed"):
        args = pack(args)
    elif weights == "q8_0":
        args = pack(quantize(args, "q8_0"))
    elif weights == "q4_1-int8":
        args = pack(quantize(args, "q4_1"), "int8")
    want_args = clone_args(args)
    out, states = fn(*args, **kwargs)
    want_out, outputs = layer_by_layer(want_args, kwargs)
    assert torch.equal(out, want_out)
    assert states.shape == (4, *args[0].shape)
    for state, layer in zip(states, kwargs["state_layers"]):
        assert torch.equal(state, outputs[layer])
    assert torch.equal(args[9], want_args[9]) and torch.equal(args[10], want_args[10])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_padding_rows_and_16bit_cache_equal_one_call_per_layer(cache_dtype):
    """row_counts (a finished request, a short tree) and a 16-bit cache go through the stack as through each
    layer's call."""
    fn = stack_implementation()
    args, kwargs = stack_case("small", 3, 3, 6, 12, tree=True, state_layers=(1,))
    args = args[:9] + (args[9].to(cache_dtype), args[10].to(cache_dtype)) + args[11:]
    counts = torch.tensor([6, 2, 0])
    want_args = clone_args(args)
    out, states = fn(*args, **kwargs, row_counts=counts)
    want_out, outputs = layer_by_layer(want_args, kwargs, row_counts=counts)
    assert torch.equal(out, want_out) and torch.equal(states[0], outputs[1])
    assert torch.equal(args[9], want_args[9]) and torch.equal(args[10], want_args[10])


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_matches_reference(tree, backend):
    """Every backend against the reference stack (float64-composed layers) to fp32 rounding over 3 layers."""
    fn = stack_implementation(backend)
    args, kwargs = stack_case("smollm2", 3, 2, 4, 30, tree=tree, state_layers=(0, 1))
    want_args = clone_args(args)
    out, states = fn(*args, **kwargs)
    want_out, want_states = reference.cpu_decoder_layers(*want_args, **kwargs)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, want_states, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(args[9], want_args[9], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_no_layers_returns_a_copy_of_x(backend):
    fn = stack_implementation(backend)
    args, kwargs = stack_case("small", 1, 2, 3, 4)
    args = (args[0], [], [], [], [], [], [], args[7], args[8], args[9][:0], args[10][:0], *args[11:])
    out, states = fn(*args, **kwargs)
    assert torch.equal(out, args[0]) and out.data_ptr() != args[0].data_ptr() and states.shape == (0, 2, 3, 40)


def _short_list(a, i):
    a[i] = a[i][:-1]


BAD_INPUTS = {  # the name the error must carry -> how the arguments are spoiled
    "x": lambda a: a.__setitem__(0, a[0].double()),
    "k_cache": lambda a: a.__setitem__(9, a[9][0]),  # one layer's [B, S, Hkv, D]: not [L, B, S, Hkv, D]
    "v_cache": lambda a: a.__setitem__(10, a[10][:, :, :-1]),
    "cache_seqlens": lambda a: a.__setitem__(11, torch.tensor([50, 0], dtype=torch.int32)),
    "input_norm": lambda a: _short_list(a, 1),
    "down_weight": lambda a: _short_list(a, 6),
    r"qkv_weight\[1\]": lambda a: a[2].__setitem__(1, a[2][1][:-1]),
    r"post_norm\[2\]": lambda a: a[4].__setitem__(2, a[4][2].half()),
    r"gate_up_weight\[0\]": lambda a: a[5].__setitem__(0, a[5][0][:-1]),
    "cos": lambda a: a.__setitem__(7, a[7][:, :, :-2]),
    "tree_mask": lambda a: a.__setitem__(12, torch.zeros(2, 3, 2, dtype=torch.int64)),
}


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_names_the_tensor(name, backend):
    fn = stack_implementation(backend)
    args, kwargs = stack_case("small", 3, 2, 3, 4, tree=True)
    args = [list(a) if isinstance(a, list) else a for a in args]
    BAD_INPUTS[name](args)
    with pytest.raises(ValueError, match=name):
        fn(*args, **kwargs)


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("state_layers,row_counts", [([3], None), ([-1], None), ([0], torch.tensor([4, 1])),
                                                     ([0.0], None), ([torch.tensor(0)], None)],
                         ids=["past-L", "negative", "row-counts-over-N", "float", "tensor"])
def test_bad_state_layers_and_row_counts_are_named(state_layers, row_counts, backend):
    fn = stack_implementation(backend)
    args, kwargs = stack_case("small", 3, 2, 3, 4)
    with pytest.raises(ValueError, match="row_counts" if row_counts is not None else "state_layers"):
        fn(*args, **{**kwargs, "state_layers": state_layers}, row_counts=row_counts)


@pytest.mark.parametrize("B,N,weights", [(0, 3, "fp32"), (2, 0, "fp32"), (0, 0, "fp32"), (0, 3, "packed-bf16"),
                                          (2, 0, "packed-bf16"), (2, 0, "q8_0")],
                         ids=["B0", "N0", "B0-N0", "B0-packed-bf16", "N0-packed-bf16", "N0-q8_0"])
@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_empty_batch_or_no_tokens(backend, B, N, weights):
    """B = 0 or N = 0 (a 3-request, 3-token tree pass with padding rows and a bf16 cache, sliced): what the C++ op
    returns (empty output and states of the right shapes and dtypes), both caches untouched (the reference's layers
    used to fail reshaping 0 elements)."""
    fn, cpp = stack_implementation(backend), stack_implementation("cpp")
    shape = "small" if weights == "fp32" else "smollm2"  # packing: N, K multiples of 32
    args, kwargs = stack_case(shape, 2, 3, 3, 4, "bf16" if "bf16" in weights else "fp32", tree=True,
                              state_layers=(1, 0, 1))
    if weights.startswith("packed"):
        args = pack(args)
    elif weights == "q8_0":
        args = pack(quantize(args, "q8_0"))
    args = list(args)
    args[0], args[7], args[8] = (args[i][:B, :N] for i in (0, 7, 8))  # x, cos, sin
    args[9], args[10] = (args[i][:, :B].to(torch.bfloat16) for i in (9, 10))
    args[11], args[12] = args[11][:B], args[12][:B, :N, :(N + 63) // 64]
    kwargs["row_counts"] = torch.full((B,), min(N, 1), dtype=torch.int64)
    want_args, got_args = clone_args(args), clone_args(args)
    want, got = cpp(*want_args, **kwargs), fn(*got_args, **kwargs)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
    assert got.out.shape == (B, N, args[0].shape[2]) and got.states.shape == (3, B, N, args[0].shape[2])
    for i in (9, 10):
        assert torch.equal(got_args[i], args[i]) and torch.equal(want_args[i], args[i])


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_nan_row_stays_in_its_request(backend):
    """A NaN in one request's input reaches that request's output (never silently finite everywhere) and leaves
    the other request's output, layer states and cache entries as a clean call gives them, bit for bit."""
    fn = stack_implementation(backend)
    args, kwargs = stack_case("small", 3, 2, 4, 10, tree=True, state_layers=(1,))
    clean_args, nan_args = clone_args(args), list(clone_args(args))
    nan_args[0] = nan_args[0].clone()
    nan_args[0][1, 2, 5] = float("nan")
    clean_out, clean_states = fn(*clean_args, **kwargs)
    out, states = fn(*nan_args, **kwargs)
    assert torch.equal(out[0], clean_out[0]) and torch.equal(states[:, 0], clean_states[:, 0])
    for cache, clean_cache in ((nan_args[9], clean_args[9]), (nan_args[10], clean_args[10])):
        assert torch.equal(cache[:, 0], clean_cache[:, 0])
    assert not torch.isfinite(out[1]).all()
