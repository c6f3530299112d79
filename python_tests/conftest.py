"""Shared fixtures: every test body runs once per backend against the reference."""

import os

# The Triton interpreter must be chosen before triton is first imported, so that the
# triton backend runs on CPU tensors in tests.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from eagle_kernels import _dispatch  # noqa: E402
from eagle_kernels.triton._interpreter import speed_up_interpreter  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"
if INTERPRETED:
    speed_up_interpreter(vectorise_reductions=True)


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
    if hasattr(config, "workerinput"):
        items[:] = _longest_files_first(items)


# Test files of 25 s or more in a full run on two cores, longest first (measured 2026-12-06: the
# sm_90 compile audit 373 s, one subprocess; 232, 174, 116, 82, 60, 60, 44, 28 and 26 s for the
# others; test_verify_greedy_rows.py, added later, about 45 s alone). Files of few but long tests
# would come last by their number of tests.
LONG_FILES = (
    "ops/test_triton_compile.py",
    "ops/test_layer_ops.py",
    "ops/test_triton_gpu_configs.py",
    "ops/test_verify_backends.py",
    "ops/test_verify_coupled.py",
    "ops/test_gpu_model.py",
    "ops/test_verify_sampled.py",
    "ops/test_verify_greedy_rows.py",
    "ops/test_verify_temperature_rows.py",
    "ops/test_verify_topk_rows.py",
    "decoding/test_bookkeeping.py",
    "decoding/test_launch_count.py",
    "models/test_shipped_heads.py",
)


def _longest_files_first(items):
    """The suite's items with whole files reordered for pytest-xdist's ``--dist loadfile``, which
    hands files to its workers in collection order (``scripts/test.sh`` passes
    ``--no-loadscope-reorder``): ``LONG_FILES`` first, then the other files by their number of
    tests, most first. A long file handed out last would run alone on one core while the other
    worker idles (the compile audit did: about five minutes of a 2-core run)."""
    by_file = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    order = sorted(by_file, key=lambda f: (rank.get(f.removeprefix("python_tests/"), len(rank)), -len(by_file[f])))
    return [item for f in order for item in by_file[f]]


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
