"""Programmatic dependent launch (eagle_kernels/triton/_pdl.py): which launches use it, and that
a kernel's PDL branch computes what its plain launch computes. The order that makes PDL safe (the
wait before any global memory access) is checked in each kernel's SASS by the compile audit
(python_tests/ops/test_triton_compile.py)."""

from __future__ import annotations

import types

import pytest
import torch

from eagle_kernels.triton import _pdl


class _Device:
    def __init__(self, kind: str):
        self.type, self.index = kind, 0


@pytest.fixture
def capability(monkeypatch):
    """Set the compute capability major that torch reports for CUDA devices."""
    def set_major(major: int):
        props = types.SimpleNamespace(major=major, minor=0, multi_processor_count=132)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    return set_major


@pytest.mark.parametrize("major, env, expected", [
    (9, None, True), (10, None, True), (8, None, False), (9, "0", False), (9, "off", False), (9, "1", True),
])
def test_pdl_on_sm90_and_later_unless_turned_off(capability, monkeypatch, major, env, expected):
    capability(major)
    if env is None:
        monkeypatch.delenv(_pdl.ENV, raising=False)
    else:
        monkeypatch.setenv(_pdl.ENV, env)
    assert _pdl.programmatic_launch(_Device("cuda")) is expected
    assert _pdl.launch_options(_Device("cuda")) == {"USE_PDL": expected, "launch_pdl": expected}
    assert _pdl.programmatic_launch(_Device("cpu")) is False


def test_forced_overrides_the_environment(capability, monkeypatch):
    """forced(True) turns PDL on despite EAGLE_KERNELS_PDL=0, for CPU tensors (the interpreter) as well,
    never for a GPU older than sm_90; forced(False) turns it off."""
    capability(9)
    monkeypatch.setenv(_pdl.ENV, "0")
    with _pdl.forced(True):
        assert _pdl.programmatic_launch(_Device("cpu")) and _pdl.programmatic_launch(_Device("cuda"))
        capability(8)
        assert not _pdl.programmatic_launch(_Device("cuda"))
        capability(9)
        with _pdl.forced(False):
            assert not _pdl.programmatic_launch(_Device("cuda")) and not _pdl.programmatic_launch(_Device("cpu"))
        assert _pdl.enabled()
    assert not _pdl.enabled() and not _pdl.programmatic_launch(_Device("cuda"))


def test_weight_prefetch_rule(capability, monkeypatch):
    """A GEMM launch prefetches its weight rows with PDL on, for a matrix of at most PREFETCH_MAX_BYTES whose
    rows are 16-byte multiples starting 16-byte aligned; not when the switch is off."""
    capability(9)
    monkeypatch.delenv(_pdl.ENV, raising=False)
    cuda = _Device("cuda")
    with _pdl.forced(True):
        assert _pdl.launch_options(cuda, torch.empty(64, 576, dtype=torch.bfloat16))["PREFETCH"]
        assert not _pdl.launch_options(cuda, torch.empty(64, 33, dtype=torch.bfloat16))["PREFETCH"]  # 66-byte rows
        assert not _pdl.launch_options(cuda, torch.empty(64 * 576 + 4, dtype=torch.bfloat16)[4:].view(64, 576))[
            "PREFETCH"]  # rows 8 bytes off alignment
        monkeypatch.setattr(_pdl, "PREFETCH_MAX_BYTES", 64 * 576 * 2 - 1)  # a matrix one byte too large
        assert not _pdl.launch_options(cuda, torch.empty(64, 576, dtype=torch.bfloat16))["PREFETCH"]
        monkeypatch.setattr(_pdl, "PREFETCH_MAX_BYTES", 64 * 576 * 2)
        monkeypatch.setattr(_pdl, "PREFETCH_WEIGHTS", False)
        assert not _pdl.launch_options(cuda, torch.empty(64, 576, dtype=torch.bfloat16))["PREFETCH"]
    with _pdl.forced(False):
        assert _pdl.launch_options(cuda, torch.empty(64, 576)) == {"USE_PDL": False, "launch_pdl": False,
                                                                    "PREFETCH": False}


def test_bad_environment_value(monkeypatch):
    monkeypatch.setenv(_pdl.ENV, "sometimes")
    with pytest.raises(ValueError, match=_pdl.ENV):
        _pdl.enabled()


def test_pdl_branch_computes_the_same(monkeypatch):
    """Kernels launched with PDL (the interpreter runs their PDL branch, whose wait has nothing to
    wait for and whose prefetch does nothing) give the results of plain launches, bit for bit:
    rmsnorm_linear and tree_attention."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels interpreted (TRITON_INTERPRET=1)")
    from eagle_kernels.triton.rmsnorm_linear import rmsnorm_linear
    from eagle_kernels.triton.tree_attention import tree_attention

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=gen)
    w = torch.randn(2 * 24, 40, generator=gen)
    norm = torch.rand(40, generator=gen) + 0.5
    q = torch.randn(2, 3, 4, 16, generator=gen)
    k = torch.randn(2, 12, 2, 16, generator=gen)
    v = torch.randn(2, 12, 2, 16, generator=gen)
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    from triton.runtime.interpreter import InterpretedFunction

    launched = []
    run = InterpretedFunction.run

    def recording(self, *args, **kwargs):
        launched.append((self.fn.__name__, kwargs.get("USE_PDL"), kwargs.get("launch_pdl"), kwargs.get("PREFETCH")))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    results = []
    for on in (False, True):
        with _pdl.forced(on):
            out, residual = rmsnorm_linear(x, w, norm, 1e-5, gated=True)
            attention = tree_attention(q, k, v, seqlens)
        results.append((out, residual, attention))
    for plain, pdl in zip(*results):
        assert torch.equal(plain, pdl)
    # rmsnorm_linear's PDL branch prefetches its weight rows first (a no-op interpreted).
    assert launched == [("_rmsnorm_linear_kernel", False, False, False), ("_tree_attention_kernel", False, False, None),
                        ("_rmsnorm_linear_kernel", True, True, True), ("_tree_attention_kernel", True, True, None)]
