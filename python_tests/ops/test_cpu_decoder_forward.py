"""cpu_decoder_forward: the C++ op against the composition of the ops it fuses (embedding, RoPE rows gathered from
the [P, D / 2] tables, cpu_decoder_layers, the final RMSNorm, cpu_linear) bit for bit (logits, hidden, layer states
and both caches) over causal and tree passes, 16-bit embedding tables, packed and quantized LM heads, logit_rows and
row_counts; every backend against the reference ops' composition; the fake kernel's shapes; a model without
layers; input errors naming the argument, raised before the cache is written."""

import pytest
import torch
import torch.nn.functional as F

from eagle_kernels import _dispatch, ops, reference
from eagle_kernels._types import DecoderForwardOutput
from eagle_kernels.reference.cpu_linear import quantize as quantize_blocks
from helpers import WEIGHT_DTYPES, clone_args, decoder_stack_inputs, random_tree

SHAPE = (4, 2, 16, 64, 48)  # num_heads, Hkv, D, H, inter: H a multiple of 32, so lm_head can be packed / quantized
V_EMBED, V_HEAD = 77, 96
CPP_STACK, CPP_LINEAR = torch.ops.eagle_kernels.cpu_decoder_layers, torch.ops.eagle_kernels.cpu_linear


def forward_implementation(backend="cpp"):
    """The backend's cpu_decoder_forward, or skip."""
    fn, reason = _dispatch.implementation("cpu_decoder_forward", backend, "cpu")
    if fn is None:
        pytest.skip(reason)
    return fn


def make_head(kind, g):
    """lm_head [V_HEAD, H]: "fp32", "bf16", "packed-<dtype>" (cpu_linear_pack) or "q8_0" (quantized, packed)."""
    w = torch.randn(V_HEAD, SHAPE[3], generator=g) / SHAPE[3] ** 0.5
    if kind == "q8_0":
        return ops.cpu_linear_pack(quantize_blocks(w, "q8_0"))
    if kind.startswith("packed-"):
        return ops.cpu_linear_pack(w.to(WEIGHT_DTYPES[kind[7:]]))
    return w.to(WEIGHT_DTYPES[kind])


def forward_case(B, N, prefix, tree=False, embed="fp32", head="fp32", weights="fp32", layers=3, state_layers=(0, 2, 0),
                 seed=0):
    """(args, kwargs) of cpu_decoder_forward: decoder_stack_inputs' weights, caches, lengths and tree mask, a random
    embedding table, tokens, RoPE tables with 3 rows to spare, and positions (None causal, lengths + depths tree)."""
    num_heads, Hkv, D, H, inter = SHAPE
    g = torch.Generator().manual_seed(seed)
    t = random_tree(B, N, seed) if tree else None
    stack, kwargs = decoder_stack_inputs(max(layers, 1), B, N, H, num_heads, Hkv, D, inter, capacity=prefix + N + 3,
                                         generator=g, weight_dtype=WEIGHT_DTYPES[weights],
                                         tree_mask=None if t is None else t.mask,
                                         prefix=(prefix, max(prefix - 5, 0), prefix + 2)[:B], state_layers=state_layers)
    lists = [weights[:layers] for weights in stack[1:7]]
    k, v, seqlens, mask = stack[9][:layers], stack[10][:layers], stack[11], stack[12]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(int(seqlens.max()) + N + 3, dtype=torch.float64)[:, None] * inv_freq
    positions = None if t is None else seqlens.long()[:, None] + t.depths.long()
    args = (torch.randint(0, V_EMBED, (B, N), generator=g),
            torch.randn(V_EMBED, H, generator=g).to(WEIGHT_DTYPES[embed]), angles.cos().float(),
            angles.sin().float(), positions, *lists, 1 + 0.1 * torch.randn(H, generator=g), make_head(head, g), k, v,
            seqlens, mask)
    return args, kwargs


def composition(args, kwargs, row_counts=None, logit_rows=None, stack=CPP_STACK, linear=CPP_LINEAR):
    """The op as the ops it fuses: (logits, hidden, states), the caches written in place."""
    tokens, embed_table, rope_cos, rope_sin, positions = args[:5]
    lists, (final_norm, lm_head, k, v, seqlens, mask) = args[5:11], args[11:]
    B, N = tokens.shape
    if positions is None:
        positions = seqlens.long()[:, None] + torch.arange(N)
    cos = torch.cat([rope_cos[positions], rope_cos[positions]], -1)
    sin = torch.cat([rope_sin[positions], rope_sin[positions]], -1)
    out, states = stack(F.embedding(tokens, embed_table).float(), *lists, cos, sin, k, v, seqlens, mask, **kwargs,
                        row_counts=row_counts)
    hidden = F.rms_norm(out, (embed_table.shape[1],), final_norm, kwargs["eps"])
    if logit_rows is not None:
        return linear(torch.stack([hidden[b, logit_rows[b]] for b in range(B)]), lm_head), hidden, states
    logits = linear(hidden, lm_head)
    if row_counts is not None:
        logits = logits.masked_fill((torch.arange(N) >= row_counts[:, None])[..., None], 0.0)
    return logits, hidden, states


def assert_equals_composition(args, kwargs, row_counts=None, logit_rows=None):
    """The C++ op and the composition of the C++ ops it fuses agree bit for bit, caches included."""
    fn = forward_implementation()
    want_args = clone_args(args)
    got = fn(*args, **kwargs, row_counts=row_counts, logit_rows=logit_rows)
    want = composition(want_args, kwargs, row_counts, logit_rows)
    for name, a, b in zip(("logits", "hidden", "states"), got, want, strict=True):
        assert a.shape == b.shape and torch.equal(a, b), name
    assert torch.equal(args[13], want_args[13]) and torch.equal(args[14], want_args[14])
    return got


@pytest.mark.parametrize("embed,head,weights", [("fp32", "fp32", "fp32"), ("bf16", "packed-bf16", "bf16"),
                                                ("fp16", "q8_0", "fp32"), ("bf16", "bf16", "fp32")])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("B,N,prefix", [(1, 1, 37), (2, 8, 20), (3, 5, 0)])
def test_equals_composition(B, N, prefix, tree, embed, head, weights):
    """Embedding (any table dtype), RoPE rows at the default (causal) or given (tree) positions, the stack with
    layer states [0, L - 1, 0], the norm and the head (dense, packed, Q8_0): the composition's results, bit for
    bit, and the caches it writes."""
    args, kwargs = forward_case(B, N, prefix, tree, embed, head, weights)
    logits, hidden, states = assert_equals_composition(args, kwargs)
    assert logits.shape == (B, N, V_HEAD) and hidden.shape == (B, N, SHAPE[3]) and states.shape == (3, B, N, SHAPE[3])


@pytest.mark.parametrize("rows", ["last", "two"])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_logit_rows_equal_composition(tree, rows):
    """logit_rows [B, R]: the head over those rows of hidden only (a prefill's last row; two rows each, repeats and
    out of order)."""
    args, kwargs = forward_case(3, 6, 9, tree, "bf16", "packed-fp32")
    picks = torch.tensor([[5], [5], [5]]) if rows == "last" else torch.tensor([[0, 5], [3, 3], [4, 1]])
    logits = assert_equals_composition(args, kwargs, logit_rows=picks)[0]
    assert logits.shape == (3, picks.shape[1], V_HEAD)


@pytest.mark.parametrize("logit_rows", [None, torch.tensor([[5], [1], [0]])], ids=["all-rows", "logit-rows"])
@pytest.mark.parametrize("head", ["fp32", "q8_0"])
def test_row_counts_equal_composition(head, logit_rows):
    """row_counts (a full request, a short one, a finished one): the padding rows' logits are exactly 0, the
    others the composition's run with the same row_counts; with logit_rows the asked rows are computed."""
    args, kwargs = forward_case(3, 6, 12, True, "fp16", head)
    counts = torch.tensor([6, 2, 0])
    logits = assert_equals_composition(args, kwargs, row_counts=counts, logit_rows=logit_rows)[0]
    if logit_rows is None:
        assert not logits[1, 2:].any() and not logits[2].any() and logits[0].all() and logits[1, :2].all()


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_strided_inputs_and_tight_tables(tree):
    """Transposed-view tokens, positions and logit_rows, an embedding table with a row stride, RoPE tables with no
    row to spare (P = the largest position + 1): the composition's results."""
    args, kwargs = forward_case(2, 4, 6, tree, "bf16")
    args = list(args)
    args[0] = args[0].t().contiguous().t()
    wide = torch.zeros(V_EMBED, SHAPE[3] + 8, dtype=args[1].dtype)
    wide[:, 4:-4] = args[1]
    args[1] = wide[:, 4:-4]
    P = int(args[15].max()) + args[0].shape[1] if args[4] is None else int(args[4].max()) + 1
    args[2], args[3] = args[2][:P], args[3][:P]
    if tree:
        args[4] = args[4].t().contiguous().t()
    assert_equals_composition(tuple(args), kwargs, logit_rows=torch.tensor([[3, 0], [1, 2]]).t().contiguous().t())


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_matches_reference_composition(tree, backend):
    """Every backend against the reference ops composed here (float64-composed layers, the reference linear), to
    fp32 rounding: logits, hidden, states and cache."""
    fn = forward_implementation(backend)
    args, kwargs = forward_case(2, 5, 30, tree, "bf16", "packed-bf16")
    picks = torch.tensor([[4, 0], [2, 2]]) if tree else None
    want_args = clone_args(args)
    got = fn(*args, **kwargs, logit_rows=picks)
    want = composition(want_args, kwargs, logit_rows=picks, stack=reference.cpu_decoder_layers,
                       linear=reference.cpu_linear)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(args[13], want_args[13], rtol=1e-4, atol=1e-4)


def test_public_op_returns_named_tuple():
    """ops.cpu_decoder_forward (whichever backend it picks) returns a DecoderForwardOutput of the op's results."""
    args, kwargs = forward_case(2, 3, 4)
    want_args = clone_args(args)
    got = ops.cpu_decoder_forward(*args, **kwargs)
    assert type(got) is DecoderForwardOutput
    torch.testing.assert_close(tuple(got), composition(want_args, kwargs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("logit_rows", [None, torch.tensor([[2, 0, 1, 1], [0, 0, 0, 0]])], ids=["all", "rows"])
@pytest.mark.parametrize("head", ["fp32", "q8_0"])
def test_fake_shapes(head, logit_rows):
    """Under FakeTensorMode the op gives logits [B, R, V], hidden [B, N, H], states [len(state_layers), B, N, H]."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kwargs = forward_case(2, 3, 4, True, "bf16", head)
    with FakeTensorMode() as mode:
        def fake(a):
            if isinstance(a, list):
                return [fake(t) for t in a]
            return mode.from_tensor(a) if isinstance(a, torch.Tensor) else a

        out = torch.ops.eagle_kernels.cpu_decoder_forward(*map(fake, args), **kwargs, logit_rows=fake(logit_rows))
    R = 3 if logit_rows is None else 4
    assert [(tuple(t.shape), t.dtype) for t in out] == [((2, R, V_HEAD), torch.float32),
                                                        ((2, 3, SHAPE[3]), torch.float32),
                                                        ((3, 2, 3, SHAPE[3]), torch.float32)]


def test_opcheck():
    """torch.library.opcheck over a tree pass with a quantized head, row_counts and logit_rows: the schema's
    mutation annotations, the fake kernel and the real op agree."""
    args, kwargs = forward_case(2, 3, 4, True, "bf16", "q8_0")
    kwargs.update(row_counts=torch.tensor([3, 1]), logit_rows=torch.tensor([[2], [0]]))
    torch.library.opcheck(torch.ops.eagle_kernels.cpu_decoder_forward.default, args, kwargs)


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_no_layers(backend):
    """L = 0 (empty lists, [0, B, S, Hkv, D] caches): hidden is the embedding RMS-normed, logits its head rows."""
    fn = forward_implementation(backend)
    args, kwargs = forward_case(2, 3, 4, embed="bf16", head="packed-fp32", layers=0, state_layers=())
    logits, hidden, states = fn(*args, **kwargs)
    want_hidden = F.rms_norm(F.embedding(args[0], args[1]).float(), (SHAPE[3],), args[11], kwargs["eps"])
    exact = dict(rtol=0, atol=0) if backend == "cpp" else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, want_hidden, **exact)
    torch.testing.assert_close(logits, CPP_LINEAR(want_hidden, args[12]), **exact)
    assert states.shape == (0, 2, 3, SHAPE[3])


@pytest.mark.parametrize("rows", [None, "row_counts", "logit_rows"])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("B,N", [(0, 3), (2, 0), (0, 0)], ids=["B0", "N0", "B0-N0"])
@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_empty_batch_or_no_tokens(backend, B, N, tree, rows):
    """B = 0 or N = 0 (the inputs of a 3-request, 3-token case sliced): what the C++ op returns (empty logits,
    hidden and states of the right shapes and dtypes) and both caches untouched (the reference's layers used to
    fail reshaping 0 elements)."""
    fn, cpp = forward_implementation(backend), forward_implementation("cpp")
    args, kwargs = forward_case(3, 3, 4, tree, layers=2, state_layers=(1, 0))
    args = list(args)
    args[0] = args[0][:B, :N]
    if args[4] is not None:
        args[4] = args[4][:B, :N]
    args[13], args[14], args[15] = args[13][:, :B], args[14][:, :B], args[15][:B]
    if args[16] is not None:
        args[16] = args[16][:B, :N, :(N + 63) // 64]
    if rows == "row_counts":
        kwargs["row_counts"] = torch.zeros(B, dtype=torch.int64)
    elif rows == "logit_rows":
        kwargs["logit_rows"] = torch.zeros(B, min(N, 2), dtype=torch.int64)
    want_args, got_args = clone_args(args), clone_args(args)
    want, got = cpp(*want_args, **kwargs), fn(*got_args, **kwargs)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
    assert got.states.shape == (2, B, N, SHAPE[3]) and got.hidden.shape == (B, N, SHAPE[3])
    for i in (13, 14):
        assert torch.equal(got_args[i], args[i]) and torch.equal(want_args[i], args[i])


def _short_tables(a):
    """positions None and tables one row short of the last default position (cache_seqlens + N - 1)."""
    P = int(a[15].max()) + a[0].shape[1] - 1
    a[2], a[3], a[4] = a[2][:P], a[3][:P], None


def _set(i, f):
    return lambda a, kw: a.__setitem__(i, f(a[i]))


BAD_INPUTS = {  # id -> (the name the error must carry, how the arguments are spoiled)
    "tokens-int32": ("tokens", _set(0, lambda t: t.int())),
    "tokens-past-vocab": ("tokens", _set(0, lambda t: t.index_fill(1, torch.tensor([2]), V_EMBED))),
    "tokens-negative": ("tokens", _set(0, lambda t: t.index_fill(1, torch.tensor([0]), -1))),
    "embed-int": ("embed_table", _set(1, lambda e: e.long())),
    "embed-1d": ("embed_table", _set(1, lambda e: e[0])),
    "cos-width": ("rope_cos", _set(2, lambda c: c[:, :-1].contiguous())),
    "cos-strided": ("rope_cos", _set(2, lambda c: c.t().contiguous().t())),
    "sin-rows": ("rope_sin", _set(3, lambda s: s[:-1])),
    "positions-shape": ("positions", _set(4, lambda p: p[:, :-1])),
    "positions-past-P": ("positions", lambda a, kw: a[4].__setitem__((1, 2), a[2].shape[0])),
    "P-short-of-default": ("rope_cos", lambda a, kw: _short_tables(a)),
    "final-norm-shape": ("final_norm", _set(11, lambda w: w[:-1])),
    "lm-head-K": ("lm_head", _set(12, lambda w: w[:, :-1].contiguous())),
    "lm-head-1d": ("lm_head", _set(12, lambda w: w[0])),
    "logit-rows-B": ("logit_rows", lambda a, kw: kw.__setitem__("logit_rows", torch.zeros(3, 1, dtype=torch.int64))),
    "logit-rows-past-N": ("logit_rows", lambda a, kw: kw.__setitem__("logit_rows", torch.tensor([[0], [3]]))),
    "layer-count": ("qkv_weight", _set(6, lambda ws: ws[:-1])),
    # Scalars of the wrong Python type: the C++ op's schema used to raise a RuntimeError (or to convert a tensor).
    "eps-str": ("eps", lambda a, kw: kw.__setitem__("eps", "x")),
    # A negative or NaN eps gave NaN rows without an error.
    "eps-negative": ("eps", lambda a, kw: kw.__setitem__("eps", -1.0)),
    "eps-nan": ("eps", lambda a, kw: kw.__setitem__("eps", float("nan"))),
    "eps-tensor": ("eps", lambda a, kw: kw.__setitem__("eps", torch.tensor(1e-5))),
    "state-layers-float": ("state_layers", lambda a, kw: kw.__setitem__("state_layers", [0.0])),
    "num-heads-float": ("num_heads", lambda a, kw: kw.__setitem__("num_heads", float(kw["num_heads"]))),
}


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_the_argument(case, backend):
    """A ValueError naming the argument; the caches are left as they were (every check precedes the stack)."""
    fn = forward_implementation(backend)
    args, kwargs = forward_case(2, 3, 4, True, layers=2, state_layers=(1,))
    args, kwargs = list(args), {**kwargs, "logit_rows": None}
    name, spoil = BAD_INPUTS[case]
    spoil(args, kwargs)
    caches = args[13].clone(), args[14].clone()
    with pytest.raises(ValueError, match=name):
        fn(*args, **kwargs)
    assert torch.equal(args[13], caches[0]) and torch.equal(args[14], caches[1])


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_nan_row_stays_in_its_request(backend):
    """A NaN embedding row read by one request reaches that request's logits (never silently finite) and leaves
    the other request's logits, hidden rows, layer states and cache entries as a clean call gives them, bit for bit."""
    fn = forward_implementation(backend)
    args, kwargs = forward_case(2, 4, 10, tree=True)
    tokens = args[0].clone()
    tokens[1, 2] = V_EMBED - 1
    tokens[0] = torch.where(tokens[0] == V_EMBED - 1, 0, tokens[0])  # request 0 never reads the NaN row
    table = args[1].clone()
    table[V_EMBED - 1, 5] = float("nan")
    clean_args, nan_args = clone_args((tokens, *args[1:])), list(clone_args((tokens, *args[1:])))
    nan_args[1] = table
    clean, got = fn(*clean_args, **kwargs), fn(*nan_args, **kwargs)
    for part, clean_part in zip(got[:2], clean[:2]):
        assert torch.equal(part[0], clean_part[0])
    assert torch.equal(got.states[:, 0], clean.states[:, 0])
    for cache, clean_cache in ((nan_args[13], clean_args[13]), (nan_args[14], clean_args[14])):
        assert torch.equal(cache[:, 0], clean_cache[:, 0])
    assert not torch.isfinite(got.logits[1]).all()
