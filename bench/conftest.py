"""pytest-benchmark setup shared by ``bench/bench_<op>.py``.

- Collects ``bench_*.py`` so that ``python -m pytest bench/ --benchmark-only`` works without
  ``-o python_files=...``.
- Parametrises every benchmark that takes a ``provider`` argument over ``PROVIDERS``:
  ``reference`` (eagle_kernels.reference.<op>) and ``eagle`` (eagle_kernels.<op>, whichever
  backend ``backend_of`` picks; recorded in ``extra_info["backend"]``).
- ``measure(fn, *args, work=..., unit=...)`` times one call per round with a round count sized to
  a time budget, records throughput in ``extra_info`` and keeps the mean for the ratio table that
  ``pytest_terminal_summary`` prints (eagle / reference, per shape).

Environment: ``EAGLE_BENCH_TIME_S`` (default 0.25) is the time budget per benchmark;
``EAGLE_BENCH_SLOW_S`` (default 1.0): a reference call slower than this is skipped;
``EAGLE_BENCH_THREADS``: torch intra-op threads (default: torch's choice).
"""

from __future__ import annotations

import fnmatch
import math
import os
import time

import pytest
import torch

import eagle_kernels
from eagle_kernels import reference

PROVIDERS = ("reference", "eagle")
BUDGET_S = float(os.environ.get("EAGLE_BENCH_TIME_S", "0.25"))
SLOW_S = float(os.environ.get("EAGLE_BENCH_SLOW_S", "1.0"))
MAX_ROUNDS = 2000
if os.environ.get("EAGLE_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["EAGLE_BENCH_THREADS"]))
_RESULTS = pytest.StashKey[dict]()


def pytest_collect_file(file_path, parent):
    if file_path.suffix != ".py" or not file_path.name.startswith("bench_"):
        return None
    # pytest's own collector already takes files named on the command line and files matching
    # python_files (e.g. -o python_files=bench_*.py): do not collect them twice.
    if parent.session.isinitpath(file_path) or any(
            fnmatch.fnmatch(file_path.name, pattern) for pattern in parent.config.getini("python_files")):
        return None
    return pytest.Module.from_parent(parent, path=file_path)


def pytest_configure(config):
    config.stash[_RESULTS] = {}


def pytest_generate_tests(metafunc):
    if "provider" in metafunc.fixturenames and not any(
            "provider" in m.args[0] for m in metafunc.definition.iter_markers("parametrize")):
        metafunc.parametrize("provider", PROVIDERS, ids=list(PROVIDERS))


def op_for(provider: str, op: str):
    """The callable ``provider`` benchmarks for ``op``, and the backend name it reports."""
    if provider == "reference":
        return getattr(reference, op), "reference"
    if provider == "eagle":
        return getattr(eagle_kernels, op), eagle_kernels.backend_of(op, "cpu")
    raise ValueError(f"provider: expected one of {PROVIDERS}, got {provider!r}")


@pytest.fixture
def provider_op(provider):
    """``provider_op("build_tree")`` -> (callable, backend name) for the current provider.
    A fixture rather than an import: ``conftest`` is not a unique module name."""
    return lambda op: op_for(provider, op)


@pytest.fixture
def measure(benchmark, request):
    """``measure(fn, *args, work=..., unit=..., info=None, **kwargs)``: benchmark
    ``fn(*args, **kwargs)``.

    ``work`` is the amount of work of one call in ``unit`` (e.g. bytes moved, candidates);
    ``extra_info[unit + "_per_s"]`` records it per second of mean time. ``info`` (e.g. the
    backend) is copied into ``extra_info``.
    """
    callspec = request.node.callspec
    provider = callspec.params["provider"]
    shape = "-".join(part for part in callspec.id.split("-") if part not in PROVIDERS)
    key = (request.node.module.__name__, request.node.originalname, shape)

    def run(fn, *args, work: float, unit: str, info: dict | None = None, **kwargs):
        benchmark.group = f"{request.node.module.__name__.removeprefix('bench_')}[{shape}]"
        fn(*args, **kwargs)  # warm-up (lazy init, first-touch allocation)
        start = time.perf_counter()
        fn(*args, **kwargs)
        once = time.perf_counter() - start
        if provider == "reference" and once > SLOW_S:
            pytest.skip(f"reference takes {once:.2f} s per call (> EAGLE_BENCH_SLOW_S = {SLOW_S})")
        min_rounds = request.config.getoption("benchmark_min_rounds", 5)
        rounds = max(min_rounds, min(MAX_ROUNDS, math.ceil(BUDGET_S / max(once, 1e-7))))
        benchmark.pedantic(fn, args=args, kwargs=kwargs, rounds=rounds, warmup_rounds=1)
        if benchmark.stats is None:  # --benchmark-disable
            return
        mean = benchmark.stats.stats.mean
        benchmark.extra_info["provider"] = provider
        benchmark.extra_info["threads"] = torch.get_num_threads()
        benchmark.extra_info.update(info or {})
        benchmark.extra_info[unit] = work
        benchmark.extra_info[f"{unit}_per_s"] = work / mean
        results = request.config.stash[_RESULTS].setdefault(key, {})
        results[provider] = (mean, dict(benchmark.extra_info))
        if len(results) == 2:
            ratio = results["eagle"][0] / results["reference"][0]
            benchmark.extra_info["ratio_eagle_over_reference"] = ratio

    return run


def _fmt_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:8.2f} {unit}"
    return f"{seconds * 1e9:8.1f} ns"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    results = config.stash.get(_RESULTS, {})
    if not results:
        return
    tr = terminalreporter
    tr.write_sep("=", "eagle vs reference (mean time per call; ratio = eagle / reference)")
    tr.write_line(f"{'benchmark':<46} {'backend':>9} {'eagle':>11} {'reference':>11} {'ratio':>8} {'speedup':>8}")
    for (module, name, shape), by_provider in sorted(results.items()):
        label = f"{module.removeprefix('bench_')}[{shape}]"
        eagle = by_provider.get("eagle")
        ref = by_provider.get("reference")
        backend = eagle[1].get("backend", "?") if eagle else "-"
        e_txt = _fmt_time(eagle[0]) if eagle else f"{'-':>11}"
        r_txt = _fmt_time(ref[0]) if ref else f"{'-':>11}"
        if eagle and ref:
            ratio = eagle[0] / ref[0]
            tail = f"{ratio:8.3g} {1 / ratio:7.3g}x"
        else:
            tail = f"{'-':>8} {'-':>8}"
        tr.write_line(f"{label:<46} {backend:>9} {e_txt:>11} {r_txt:>11} {tail}")
