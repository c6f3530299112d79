"""Operator registration, fakes, opcheck and backend selection."""

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import eagle_kernels
from eagle_kernels import _checks, _dispatch
from eagle_kernels._schemas import OPS, SCHEMAS
from helpers import decoder_layer_inputs, decoder_stack_inputs


def small_inputs(op):
    """A valid call of each op on small CPU tensors: (args, kwargs)."""
    g = torch.Generator().manual_seed(0)
    if op == "tree_attention":
        B, N, Hq, Hkv, D, S = 2, 5, 4, 2, 16, 16
        q = torch.randn(B, N, Hq, D, generator=g)
        k = torch.randn(B, S, Hkv, D, generator=g)
        v = torch.randn(B, S, Hkv, D, generator=g)
        seqlens = torch.tensor([3, 7], dtype=torch.int32)
        parents = torch.tensor([-1, 0, 0, 1, 2])
        mask = torch.zeros(B, N, 1, dtype=torch.int64)
        for i in range(N):
            node = i
            while node >= 0:
                mask[:, i, 0] |= 1 << node
                node = int(parents[node])
        return (q, k, v, seqlens, mask), {"sm_scale": 0.3}
    if op == "draft_expand":
        # One deterministic and one sampled request (docs/ops.md §2).
        return (torch.randn(2, 3, 11, generator=g), torch.randn(2, 3, generator=g), 4), {
            "d2t": torch.arange(11, dtype=torch.int64) * 2, "temperature": torch.tensor([0.0, 0.8]),
            "seed": torch.tensor([3, 4]), "offset": torch.tensor([0, 9]), "depth": 2}
    if op == "build_tree":
        root = torch.tensor([1, 2])
        tokens = torch.arange(12).reshape(2, 6)
        scores = torch.tensor([[-0.1, -0.5, -0.3, -0.2, -0.9, -0.6]] * 2)
        parents = torch.tensor([[-1, -1, 0, 0, 1, 1]] * 2, dtype=torch.int32)
        return (root, tokens, scores, parents, 5), {}
    if op == "verify":
        tokens = torch.tensor([[9, 1, 2, 3], [9, 3, 2, 1]])
        parents = torch.tensor([[-1, 0, 0, 1]] * 2, dtype=torch.int32)
        logits = torch.randn(2, 4, 6, generator=g)
        return (tokens, parents, logits), {
            "max_depth": 2, "temperature": torch.tensor([0.0, 0.8]),
            "top_k": torch.tensor([0, 3], dtype=torch.int32), "top_p": torch.tensor([1.0, 0.9]),
            "seed": torch.tensor([1, 2]), "offset": torch.tensor([0, 5]),
            # Draft rows over a draft vocabulary of 4 (ids 0-3 -> target 1-4); node 3 deterministic.
            "draft_probs": torch.softmax(torch.randn(2, 4, 4, generator=g), -1),
            "draft_sampled": torch.tensor([[False, True, True, False]] * 2),
            "d2t": torch.ones(4, dtype=torch.int64)}
    if op == "block_verify":  # chains of 3 drafts (the second request's cut to 1), a greedy and a sampling request
        tokens = torch.tensor([[9, 2, 3, 4], [9, 4, 0, 0]])
        logits = torch.randn(2, 4, 6, generator=g)
        return (tokens, logits, torch.softmax(torch.randn(2, 4, 4, generator=g), -1)), {
            "num_drafts": torch.tensor([3, 1], dtype=torch.int32), "temperature": torch.tensor([0.0, 0.8]),
            "top_k": torch.tensor([0, 3], dtype=torch.int32), "top_p": torch.tensor([1.0, 0.9]),
            "seed": torch.tensor([1, 2]), "offset": torch.tensor([0, 5]), "d2t": torch.ones(4, dtype=torch.int64)}
    if op == "coupled_noise":  # a draft vocabulary of 19 ids mapped by d2t, positions past 2^32
        return (torch.tensor([5, -2]), torch.tensor([[3, 4, 5], [1 << 33, 7, 0]]), 19), {
            "d2t": torch.arange(19, dtype=torch.int64) * 3}
    if op == "coupled_draft_logits":  # one greedy request; a draft vocabulary of 19 ids mapped by d2t
        return (torch.randn(2, 3, 19, generator=g), torch.tensor([0.0, 0.7]), torch.tensor([5, -2]),
                torch.tensor([1 << 33, 7])), {"d2t": torch.arange(19, dtype=torch.int64) * 3}
    if op == "compact_kv":
        k = torch.randn(3, 2, 12, 2, 8, generator=g)
        v = torch.randn(3, 2, 12, 2, 8, generator=g)
        seqlens = torch.tensor([2, 4], dtype=torch.int32)
        nodes = torch.tensor([[0, 2, 3], [0, 1, -1]], dtype=torch.int32)
        lens = torch.tensor([2, 1], dtype=torch.int32)
        return (k, v, seqlens, nodes, lens), {}
    if op == "write_kv":
        k = torch.randn(7, 4, 2, 8, generator=g)  # paged: 7 pages of 4 positions
        v = torch.randn(7, 4, 2, 8, generator=g)
        k_new = torch.randn(2, 3, 2, 8, generator=g)
        v_new = torch.randn(2, 3, 2, 8, generator=g)
        seqlens = torch.tensor([2, 5], dtype=torch.int32)
        table = torch.tensor([[3, 0], [6, 1]], dtype=torch.int32)
        return (k, v, k_new, v_new, seqlens), {"block_table": table}
    if op == "cpu_linear":
        return (torch.randn(2, 3, 20, generator=g), torch.randn(7, 20, generator=g).bfloat16()), {}
    if op == "cpu_decoder_layer":
        return decoder_layer_inputs(B=2, N=3, H=12, num_heads=4, Hkv=2, D=4, inter=10, capacity=9, generator=g)
    if op == "cpu_decoder_layers":
        return decoder_stack_inputs(L=3, B=2, N=3, H=12, num_heads=4, Hkv=2, D=4, inter=10, capacity=9, generator=g,
                                    state_layers=(0, 2))
    if op == "cpu_decoder_forward":
        (x, *lists, cos, sin, k, v, seqlens, mask), kwargs = decoder_stack_inputs(
            L=3, B=2, N=3, H=12, num_heads=4, Hkv=2, D=4, inter=10, capacity=9, generator=g, state_layers=(0, 2))
        angles = torch.arange(9, dtype=torch.float64)[:, None] * (1e-2 ** torch.arange(2, dtype=torch.float64))
        tokens = torch.randint(0, 11, (2, 3), generator=g)
        args = (tokens, torch.randn(11, 12, generator=g).bfloat16(), angles.cos().float(), angles.sin().float(), None,
                *lists, 1 + 0.1 * torch.randn(12, generator=g), torch.randn(32, 12, generator=g), k, v, seqlens, mask)
        return args, {**kwargs, "logit_rows": torch.tensor([[2], [0]])}
    if op == "cpu_head_forward":  # a draft pass over 3H features (fc): slot_offset 1, a tree mask over 1 + N slots
        mask = torch.tensor([[[1], [3], [5], [11]]] * 2, dtype=torch.int64)
        (_, input_norm, qkv, o, post_norm, gate_up, down, _, _, k, v, seqlens, _), kwargs = decoder_layer_inputs(
            B=2, N=3, H=12, num_heads=4, Hkv=2, D=4, inter=10, capacity=9, generator=g, tree_mask=mask, embed=True,
            slot_offset=1)
        angles = torch.arange(9, dtype=torch.float64)[:, None] * (1e-2 ** torch.arange(2, dtype=torch.float64))
        embed_norm = kwargs.pop("embed_norm")
        kwargs.pop("embed")
        args = (torch.randint(0, 11, (2, 3), generator=g), torch.randn(11, 12, generator=g).bfloat16(),
                torch.randn(2, 3, 36, generator=g), torch.randn(12, 36, generator=g), angles.cos().float(),
                angles.sin().float(), seqlens.long()[:, None] + torch.tensor([0, 1, 1]), input_norm, embed_norm, qkv,
                o, post_norm, gate_up, down, 1 + 0.1 * torch.randn(12, generator=g), torch.randn(32, 12, generator=g),
                k, v, seqlens, mask)
        return args, kwargs
    raise AssertionError(op)


@pytest.mark.parametrize("op", OPS, ids=OPS)
def test_registered_with_schema(op):
    packet = getattr(torch.ops.eagle_kernels, op)
    assert str(packet.default._schema) == "eagle_kernels::" + SCHEMAS[op]


@pytest.mark.parametrize("op", OPS, ids=OPS)
def test_opcheck(op):
    args, kwargs = small_inputs(op)
    torch.library.opcheck(getattr(torch.ops.eagle_kernels, op).default, args, kwargs)


@pytest.mark.parametrize("op", OPS, ids=OPS)
def test_fake_shapes_match_real(op):
    """The fake kernel and the real op agree on every output's shape and dtype."""
    args, kwargs = small_inputs(op)
    real = getattr(torch.ops.eagle_kernels, op)(*args, **kwargs)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        def to_fake(a):
            if isinstance(a, list):
                return [to_fake(t) for t in a]
            return mode.from_tensor(a) if isinstance(a, torch.Tensor) else a

        fake_args = [to_fake(a) for a in args]
        fake_kwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        fake = getattr(torch.ops.eagle_kernels, op)(*fake_args, **fake_kwargs)
    real, fake = flat_tensors(real), flat_tensors(fake)
    assert [(tuple(t.shape), t.dtype) for t in real] == [(tuple(t.shape), t.dtype) for t in fake]


def flat_tensors(result):
    """An op's outputs as a flat list of tensors (a list of tensors among them is opened)."""
    if result is None:
        return []
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for part in result for t in flat_tensors(part)]


@pytest.mark.parametrize("op", OPS, ids=OPS)
def test_public_op_equals_reference(op):
    """``eagle_kernels.<op>`` (whatever backend it picks) equals the reference on CPU."""
    args, kwargs = small_inputs(op)
    if op in ("compact_kv", "write_kv"):
        clone = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        getattr(eagle_kernels, op)(*args, **kwargs)
        getattr(eagle_kernels.reference, op)(*clone, **kwargs)
        torch.testing.assert_close(args[0], clone[0], rtol=0, atol=0)
        torch.testing.assert_close(args[1], clone[1], rtol=0, atol=0)
        return
    if op in ("cpu_decoder_layer", "cpu_decoder_layers", "cpu_decoder_forward", "cpu_head_forward"):  # write K/V
        caches = {"cpu_decoder_forward": (13, 14), "cpu_head_forward": (16, 17)}.get(op, (9, 10))
        clone = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        got = getattr(eagle_kernels, op)(*args, **kwargs)
        want = getattr(eagle_kernels.reference, op)(*clone, **kwargs)
        assert type(got) is type(want)
        for pair in ((got, want), *((args[i], clone[i]) for i in caches)):
            torch.testing.assert_close(*pair, rtol=1e-5, atol=1e-5)
        return
    got = getattr(eagle_kernels, op)(*args, **kwargs)
    want = getattr(eagle_kernels.reference, op)(*args, **kwargs)
    assert type(got) is type(want)
    torch.testing.assert_close(got, want)


def native_scalar_arguments():
    """(op, schema argument) for every Python scalar (int, float, int[]) of the ops whose C++ CPU kernel skips the
    Python checks (_dispatch.NATIVE_VALIDATION): the operator schema sees these before the C++ checks run."""
    found = []
    for op in sorted(_dispatch.NATIVE_VALIDATION):
        for arg in getattr(torch.ops.eagle_kernels, op).default._schema.arguments:
            if _scalar_kind(arg) is not None:
                found.append((op, arg))
    return found


def _scalar_kind(arg):
    """"int", "float" or "int[]" for a scalar schema argument (optional or not), else None."""
    kind = str(arg.type)
    if kind.startswith("Optional["):
        kind = kind[len("Optional["):-1]
    return {"int": "int", "float": "float", "List[int]": "int[]"}.get(kind)


NATIVE_SCALARS = native_scalar_arguments() if _dispatch.HAS_CPP else []


def _wrong_types(kind, value):
    """Values of types the contract rejects (docs/ops.md: a ValueError naming the argument) that the operator schema
    either rejects with a RuntimeError (a float for an int, a str for a float) or converts (numpy scalars, 0-d
    tensors)."""
    if kind == "int[]":
        first = value[0] if value else 0
        return {"float-list": [float(first)], "numpy-list": [np.int64(first)], "tensor-list": [torch.tensor(first)]}
    if kind == "int":
        return {"float": float(value) if value else 1.5, "numpy": np.int64(value), "tensor": torch.tensor(value)}
    return {"str": "x", "numpy": np.float32(value), "tensor": torch.tensor(value)}


def _spoiled_calls():
    for op, arg in NATIVE_SCALARS:
        kind = _scalar_kind(arg)
        args, kwargs = small_inputs(op)
        position = [a.name for a in getattr(torch.ops.eagle_kernels, op).default._schema.arguments].index(arg.name)
        value = kwargs.get(arg.name, arg.default_value) if arg.kwarg_only else args[position]
        for label, bad in _wrong_types(kind, value).items():
            yield pytest.param(op, arg.name, None if arg.kwarg_only else position, bad, id=f"{op}-{arg.name}-{label}")


def test_every_native_scalar_is_type_checked():
    """Each op of NATIVE_VALIDATION with a Python scalar argument has its types tested before the native call."""
    if not _dispatch.HAS_CPP:
        pytest.skip(f"extension not built: {_dispatch.CPP_IMPORT_ERROR}")
    ops_with_scalars = {op for op, _ in NATIVE_SCALARS}
    assert ops_with_scalars == set(_checks.NATIVE_SCALAR_TYPES)
    assert {"verify", "draft_expand", "build_tree", "tree_attention", "cpu_decoder_forward"} <= ops_with_scalars


@pytest.mark.parametrize("op,name,position,bad", list(_spoiled_calls()))
@pytest.mark.parametrize("backend", _dispatch.BACKENDS)
def test_wrong_scalar_type_raises_the_reference_value_error(op, name, position, bad, backend, monkeypatch):
    """A scalar of the wrong Python type (2.0 for max_depth, "x" for eps, np.int64 for top_k, a tensor for sm_scale,
    [0.0] for state_layers) is the reference's ValueError, word for word, on every backend and through the public
    op, and nothing is written."""
    fn, reason = _dispatch.implementation(op, backend, "cpu")
    if fn is None:
        pytest.skip(reason)
    args, kwargs = small_inputs(op)
    args = list(args)
    if position is None:
        kwargs[name] = bad
    else:
        args[position] = bad
    with pytest.raises(ValueError, match=rf"^{name}: expected") as want:
        getattr(eagle_kernels.reference, op)(*args, **kwargs)
    snapshot = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(ValueError) as got:
        fn(*args, **kwargs)
    assert str(got.value) == str(want.value)
    monkeypatch.setenv(_dispatch.BACKEND_ENV, backend)
    with pytest.raises(ValueError) as public:
        getattr(eagle_kernels, op)(*args, **kwargs)
    assert str(public.value) == str(want.value)
    for before, after in zip(snapshot, args):
        if isinstance(before, torch.Tensor):
            assert torch.equal(before, after)


def _tensor_arguments():
    """(op, name, position or None) of every Tensor argument (optional or not) small_inputs gives a tensor."""
    for op in OPS:
        args, kwargs = small_inputs(op)
        for position, arg in enumerate(getattr(torch.ops.eagle_kernels, op).default._schema.arguments):
            if str(arg.type) not in ("Tensor", "Optional[Tensor]"):
                continue
            value = kwargs.get(arg.name) if arg.kwarg_only else args[position]
            if isinstance(value, torch.Tensor):
                yield pytest.param(op, arg.name, None if arg.kwarg_only else position, id=f"{op}-{arg.name}")


@pytest.mark.parametrize("op,name,position", list(_tensor_arguments()))
def test_number_for_a_tensor_raises_the_reference_value_error(op, name, position):
    """A Python number where a tensor goes (``temperature=0.7``) is the reference's ValueError through the public op,
    word for word: the native kernels' schema used to refuse it with a RuntimeError."""
    args, kwargs = small_inputs(op)
    args = list(args)
    if position is None:
        kwargs[name] = 0.7
    else:
        args[position] = 0.7
    with pytest.raises(ValueError) as want:
        getattr(eagle_kernels.reference, op)(*args, **kwargs)
    with pytest.raises(ValueError) as got:
        getattr(eagle_kernels, op)(*args, **kwargs)
    assert str(got.value) == str(want.value)
    assert name in str(want.value)


@pytest.mark.parametrize("op", OPS, ids=OPS)
def test_meta_tensors_get_the_fake_shapes(op):
    """Meta tensors (shapes, no data) through the public op give the real outputs' shapes and dtypes (the fake
    kernel's) instead of reaching a backend that reads data."""
    args, kwargs = small_inputs(op)

    def to_meta(a):
        if isinstance(a, list):
            return [to_meta(t) for t in a]
        return a.to("meta") if isinstance(a, torch.Tensor) else a

    real = getattr(eagle_kernels, op)(*args, **kwargs)
    meta = getattr(eagle_kernels, op)(*[to_meta(a) for a in args], **{k: to_meta(v) for k, v in kwargs.items()})
    assert type(meta) is type(real)
    real, meta = flat_tensors(real), flat_tensors(meta)
    assert [(tuple(t.shape), t.dtype) for t in real] == [(tuple(t.shape), t.dtype) for t in meta]
    assert all(t.device.type == "meta" for t in meta)


@pytest.mark.parametrize("op", OPS, ids=OPS)
def test_first_argument_not_a_tensor_names_it(op):
    """A list where the op's first tensor goes is a ValueError naming that argument, not an AttributeError."""
    args, kwargs = small_inputs(op)
    first = getattr(torch.ops.eagle_kernels, op).default._schema.arguments[0].name
    with pytest.raises(ValueError, match=rf"^{first}: expected a torch.Tensor"):
        getattr(eagle_kernels, op)(args[0].tolist(), *args[1:], **kwargs)


def test_result_types_are_named_tuples():
    assert eagle_kernels.Tree._fields == ("tokens", "parents", "depths", "mask")
    assert eagle_kernels.DraftCandidates._fields == ("tokens", "scores", "frontier", "logprobs")
    assert eagle_kernels.VerifyOutput._fields == ("accept_len", "accept_nodes", "out_tokens", "status")
    assert eagle_kernels.DecoderLayersOutput._fields == ("out", "states")
    assert eagle_kernels.DecoderForwardOutput._fields == ("logits", "hidden", "states")
    assert eagle_kernels.HeadForwardOutput._fields == ("logits", "hidden")


@pytest.mark.parametrize("op", OPS, ids=OPS)
def test_backend_of_auto(op, monkeypatch):
    monkeypatch.delenv(_dispatch.BACKEND_ENV, raising=False)
    expected = "cpp" if (op, "cpu") in _dispatch.NATIVE_KERNELS else "reference"
    assert eagle_kernels.backend_of(op, "cpu") == expected
    assert eagle_kernels.backend_of(op, torch.device("cpu")) == expected


@pytest.mark.parametrize("forced", _dispatch.BACKENDS, ids=_dispatch.BACKENDS)
@pytest.mark.parametrize("op", OPS, ids=OPS)
def test_backend_env_forces_path(op, forced, monkeypatch):
    monkeypatch.setenv(_dispatch.BACKEND_ENV, forced)
    fn, _ = _dispatch.implementation(op, forced, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = eagle_kernels.backend_of(op, "cpu")
    assert chosen == (forced if fn is not None else "reference")
    args, kwargs = small_inputs(op)
    if op not in ("compact_kv", "write_kv"):  # the forced path still gives the reference's answer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = getattr(eagle_kernels, op)(*args, **kwargs)
        torch.testing.assert_close(got, getattr(eagle_kernels.reference, op)(*args, **kwargs))


def test_backend_env_rejects_unknown(monkeypatch):
    monkeypatch.setenv(_dispatch.BACKEND_ENV, "fortran")
    with pytest.raises(ValueError, match="EAGLE_KERNELS_BACKEND"):
        eagle_kernels.backend_of("verify", "cpu")


def test_unknown_op_and_backend_rejected():
    with pytest.raises(ValueError, match="op"):
        _dispatch.implementation("sort", "reference", "cpu")
    with pytest.raises(ValueError, match="backend"):
        _dispatch.implementation("verify", "fortran", "cpu")


def test_forced_missing_backend_warns_once(monkeypatch):
    missing = [op for op in OPS if _dispatch.implementation(op, "cpp", "cpu")[0] is None]
    if not missing:
        pytest.skip("every op has a C++ kernel")
    monkeypatch.setenv(_dispatch.BACKEND_ENV, "cpp")
    _dispatch._warn_forced_fallback.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eagle_kernels.backend_of(missing[0], "cpu")
        eagle_kernels.backend_of(missing[0], "cpu")
    assert len([w for w in caught if "runs the reference" in str(w.message)]) == 1


def test_cpu_wheel_reports_native_build():
    """Where a C++ compiler built the extension, the bookkeeping ops run natively on CPU."""
    if not _dispatch.HAS_CPP:
        pytest.skip(f"extension not built: {_dispatch.CPP_IMPORT_ERROR}")
    assert ("build_tree", "cpu") in _dispatch.NATIVE_KERNELS
    assert ("compact_kv", "cpu") in _dispatch.NATIVE_KERNELS
    assert ("tree_attention", "cpu") in _dispatch.NATIVE_KERNELS
    assert ("write_kv", "cpu") in _dispatch.NATIVE_KERNELS
    assert ("cpu_linear", "cpu") in _dispatch.NATIVE_KERNELS


def test_import_without_extension_warns_and_works(tmp_path):
    """A package without eagle_kernels._C imports, warns once, and runs every op."""
    code = (
        "import sys, warnings, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'eagle_kernels._C':\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import eagle_kernels, torch\n"
        "msgs = [str(w.message) for w in caught if 'reference path' in str(w.message)]\n"
        "assert len(msgs) == 1, msgs\n"
        "assert eagle_kernels.backend_of('build_tree', 'cpu') == 'reference'\n"
        "t = eagle_kernels.build_tree(torch.tensor([1]), torch.tensor([[2, 3]]), torch.tensor([[-1.0, -2.0]]),\n"
        "                             torch.tensor([[-1, 0]], dtype=torch.int32), 3)\n"
        "assert t.parents.tolist() == [[-1, 0, 1]], t\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("mode,cpu,cuda", [("auto", True, False), ("1", True, True), ("0", False, False)],
                         ids=["auto", "always", "never"])
def test_value_checks_switch(mode, cpu, cuda, monkeypatch):
    from eagle_kernels import _checks

    monkeypatch.setenv("EAGLE_KERNELS_CHECK_VALUES", mode)
    assert _checks.values_checked(torch.device("cpu")) is cpu
    assert _checks.values_checked(torch.device("cuda")) is cuda
    bad_parents = torch.tensor([[-1, 1]], dtype=torch.int32)  # parents[1] >= 1
    call = lambda: _checks.check_verify(torch.tensor([[0, 1]]), bad_parents, torch.zeros(1, 2, 4),  # noqa: E731
                                        max_depth=1)
    if cpu:
        with pytest.raises(ValueError, match="parents"):
            call()
    else:
        call()


@pytest.mark.parametrize("backend", ["reference", "cpp", "triton"])
@pytest.mark.parametrize("op", ["tree_attention", "write_kv", "compact_kv"])
def test_caches_with_a_strided_head_dim_are_refused_on_every_backend(op, backend):
    """A K/V cache whose head dim is not dense (stride 2 here): the kernels read and write it as dense, so every
    backend refuses it with a ValueError naming k_cache (the reference computed with it, docs/ops.md §0)."""
    fn, reason = _dispatch.implementation(op, backend, "cpu")
    if fn is None:
        pytest.skip(reason)
    B, N, H, D = 1, 2, 2, 8
    k, v = (torch.zeros(B, 16, H, 2 * D)[..., ::2] for _ in range(2))
    seqlens = torch.tensor([3], dtype=torch.int32)
    args = {"tree_attention": (torch.randn(B, N, H, D), k, v, seqlens),
            "write_kv": (k, v, torch.randn(B, N, H, D), torch.randn(B, N, H, D), seqlens),
            "compact_kv": (k, v, seqlens, torch.tensor([[0, 1]], dtype=torch.int32),
                           torch.tensor([1], dtype=torch.int32))}[op]
    with pytest.raises(ValueError, match=r"k_cache: expected a dense last \(head\) dim"):
        fn(*args)
    assert not k.any()  # nothing written
