"""EAGLE_KERNELS_CPU_ISA (docs/cpu_kernels.md): one vocabulary for every C++ CPU kernel, an
ordered cap that the CPU bounds, old spellings as aliases, and a ValueError for anything else."""

import pytest
import torch

import eagle_kernels
from eagle_kernels import _dispatch

ENV = _dispatch.CPU_ISA_ENV
LEVELS = _dispatch.CPU_ISA_LEVELS

pytestmark = pytest.mark.skipif(not _dispatch.HAS_CPP, reason="the C++ extension is not built")


def best(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    return _dispatch.cpu_isa()


def test_unset_empty_and_native_mean_no_cap(monkeypatch):
    top = best(monkeypatch)
    assert top in LEVELS and top != "avx512-ymm"  # a cap, never what a CPU has
    for value in ("", "native"):
        monkeypatch.setenv(ENV, value)
        assert _dispatch.cpu_isa() == top


@pytest.mark.parametrize("cap", LEVELS)
def test_a_level_caps_and_the_cpu_bounds(cap, monkeypatch):
    top = best(monkeypatch)
    monkeypatch.setenv(ENV, cap)
    assert _dispatch.cpu_isa() == min(cap, top, key=LEVELS.index)


def test_portable_is_scalar(monkeypatch):
    monkeypatch.setenv(ENV, "portable")
    assert _dispatch.cpu_isa() == "scalar"


def test_cpu_capability_agrees_with_torch(monkeypatch):
    """The detection agrees with ATen's own where the two speak of the same features."""
    top = best(monkeypatch)
    torch_level = torch.backends.cpu.get_cpu_capability()
    if torch_level == "AVX2":
        assert top == "avx2"
    elif torch_level in ("AVX512", "AVX512_BF16", "AMX"):
        assert top in ("avx512", "avx512-bf16")


def small_calls():
    """One small call of every CPU kernel that reads EAGLE_KERNELS_CPU_ISA."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 16, generator=g), torch.randn(4, 16, generator=g)
    logits = torch.randn(1, 2, 40, generator=g)
    q = torch.randn(1, 2, 2, 16, generator=g)
    cache = torch.randn(1, 8, 2, 16, generator=g)
    seqlens = torch.tensor([3], dtype=torch.int32)
    tokens = torch.tensor([[0, 5]])
    parents = torch.tensor([[-1, 0]], dtype=torch.int32)
    return {
        "cpu_linear": lambda: eagle_kernels.cpu_linear(x, w),
        "draft_expand": lambda: eagle_kernels.draft_expand(logits, torch.zeros(1, 2), 2),
        "tree_attention": lambda: eagle_kernels.tree_attention(q, cache, cache, seqlens),
        "verify": lambda: eagle_kernels.verify(tokens, parents, logits, max_depth=1),
    }


@pytest.mark.parametrize("op", ["cpu_linear", "draft_expand", "tree_attention", "verify"])
@pytest.mark.parametrize("value", ["avx-512", "AVX2", "sse4", "avx512 "])
def test_unknown_values_are_an_error_naming_the_variable(op, value, monkeypatch):
    call = small_calls()[op]
    monkeypatch.delenv(ENV, raising=False)
    call()  # the inputs are fine
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError,
                       match=f"{ENV}: expected scalar, avx2, avx512-ymm, avx512 or avx512-bf16.*got '{value}'"):
        call()
    with pytest.raises(ValueError, match=ENV):
        _dispatch.cpu_isa()
