"""Shared fixtures: every test body runs once per backend against the reference."""

import os

# The Triton interpreter must be chosen before triton is first imported, so that the
# triton backend runs on CPU tensors in tests.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from eagle_kernels import _dispatch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"


def pytest_collection_modifyitems(config, items):
    """Markers are declared in pyproject.toml. ``gpu`` tests skip without a CUDA device;
    ``manual`` tests (many minutes each) run only when the ``-m`` expression names them; every
    test of the Triton kernels under the interpreter (a ``triton`` backend parameter or a Triton
    test) is ``slow``: the interpreter runs a kernel at Python speed, so these take most of the
    suite's time and stay out of the fast lane (``-m "not slow"``)."""
    skip_gpu = pytest.mark.skip(reason="no CUDA device on this machine")
    skip_manual = pytest.mark.skip(reason="takes many minutes: run it with -m manual")
    run_manual = "manual" in (config.option.markexpr or "")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "manual" in item.keywords and not run_manual:
            item.add_marker(skip_manual)
        if INTERPRETED and "triton" in item.nodeid.lower():
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=_dispatch.BACKENDS)
def backend(request):
    """Name of the backend under test: reference, cpp or triton."""
    return request.param


@pytest.fixture
def op_impl(backend):
    """``op_impl("verify")`` is the current backend's implementation for CPU tensors
    (Triton under the interpreter); skips when that backend has no kernel for the op."""

    def get(op):
        fn, reason = _dispatch.implementation(op, backend, "cpu")
        if fn is None:
            pytest.skip(reason)
        return fn

    return get


@pytest.fixture
def gpu_op_impl():
    """Like ``op_impl`` but for CUDA tensors and the path ``eagle_kernels.<op>`` takes there."""
    if not HAS_CUDA:
        pytest.skip("no CUDA device on this machine")

    def get(op):
        backend = _dispatch.backend_of(op, "cuda")
        fn, reason = _dispatch.implementation(op, backend, "cuda")
        if fn is None:
            pytest.skip(reason)
        return fn

    return get


@pytest.fixture
def single_thread():
    """Model-level tests run many tiny ops: with the other core busy, OpenMP wake-ups cost
    milliseconds each, so they run on one thread (the kernel tests keep torch's default)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
