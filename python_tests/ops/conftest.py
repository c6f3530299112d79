"""Fixtures of the op tests."""

import pytest

from eagle_kernels import _dispatch, reference
from helpers import ISA_ENV, skip_unavailable_isa


@pytest.fixture(params=["reference", "avx512", "avx512-ymm", "avx2", "scalar"])
def linear(request, monkeypatch):
    """The implementation under test: the reference, or the C++ op with its ISA forced."""
    if request.param == "reference":
        return reference.cpu_linear
    fn, reason = _dispatch.implementation("cpu_linear", "cpp", "cpu")
    if fn is None:
        pytest.skip(reason)
    skip_unavailable_isa(request.param)
    monkeypatch.setenv(ISA_ENV, request.param)
    return fn
