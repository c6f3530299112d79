"""cpu_decoder_layer: a SmolLM2-135M forward pass on CPU with each decoder layer as one call,
against the same pass run op by op.

Paths (all on the same model, random weights of SmolLM2-135M's shapes, a 128-token prefix in
the cache):
- ``layer``: each decoder layer is one ``cpu_decoder_layer`` call (the default);
- ``ops``: the layer op by op from Python (RMSNorm, fused q/k/v through ``cpu_linear``, RoPE,
  ``write_kv``, ``tree_attention``, ...; ``EAGLE_KERNELS_CPU_LAYER=ops``), the path before it;
- ``torch``: op by op with torch's ``F.linear`` for every linear layer
  (``EAGLE_KERNELS_CPU_LINEAR=torch``).

Rows: 1 (a decoding step) and 8 (a verify chain, with its ancestor mask). A forward pass does
not advance ``cache_seqlens``, so every pass writes the same slots after the same 128-token
context.

``extra_info``: ``ms_per_forward``; the layer entries also get ``ratio_<path>_over_layer`` once
the other path ran for the same shape.

Run: ``PYTHONPATH=. python -m pytest bench/bench_cpu_decoder_layer.py --benchmark-only -q``, or
``python bench/bench_cpu_decoder_layer.py [threads ...]`` for the side-by-side table (paths
interleaved pass by pass, median per path) at 1 and 2 threads.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from unittest import mock

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e import random_smollm2  # noqa: E402

from eagle_kernels.models import llama  # noqa: E402

PATHS = {"layer": {}, "ops": {llama.CPU_LAYER_ENV: "ops"}, "torch": {llama.CPU_LINEAR_ENV: "torch"}}
ROWS = (1, 8)
PREFIX = 128
_MEANS: dict = {}


@functools.lru_cache(maxsize=None)
def model():
    return random_smollm2(torch.device("cpu"))[0]


def chain_mask(rows):
    """int64 [1, rows, 1]: a chain, each node seeing itself and the nodes before it."""
    return torch.tensor([[[(1 << (i + 1)) - 1 if i < 63 else -1] for i in range(rows)]], dtype=torch.int64)


def forward_call(path, rows):
    """A no-argument callable: one forward pass of ``rows`` new tokens over the prefix, on ``path``."""
    target = model()
    cache = target.new_cache(1, PREFIX + 16)
    g = torch.Generator().manual_seed(rows)
    with torch.no_grad():
        target(torch.randint(0, 49152, (1, PREFIX), generator=g), cache, logit_rows=torch.tensor([[PREFIX - 1]]))
    cache.seqlens.fill_(PREFIX)
    tokens = torch.randint(0, 49152, (1, rows), generator=g)
    positions = PREFIX + torch.arange(rows)[None]
    mask = chain_mask(rows) if rows > 1 else None

    def call():
        with mock.patch.dict(os.environ, PATHS[path]), torch.no_grad():
            return target(tokens, cache, positions=positions, tree_mask=mask)

    return call


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("rows", ROWS, ids=[f"N{r}" for r in ROWS])
def test_cpu_decoder_layer(benchmark, path, rows):
    benchmark.group = f"cpu_decoder_layer[smollm2-N{rows}]"
    call = forward_call(path, rows)
    call()
    start = time.perf_counter()
    call()
    once = time.perf_counter() - start
    budget = float(os.environ.get("EAGLE_BENCH_TIME_S", "0.25"))
    benchmark.pedantic(call, rounds=max(3, min(100, math.ceil(budget / once))), warmup_rounds=1)
    if benchmark.stats is None:  # --benchmark-disable
        return
    mean = benchmark.stats.stats.mean
    benchmark.extra_info.update(path=path, threads=torch.get_num_threads(), ms_per_forward=mean * 1e3)
    results = _MEANS.setdefault((rows, torch.get_num_threads()), {})
    results[path] = mean
    if "layer" in results:
        for other, t in results.items():
            if other != "layer" and (other == path or path == "layer"):
                benchmark.extra_info[f"ratio_{other}_over_layer"] = t / results["layer"]


def main(argv, rounds=15):
    threads_list = [int(a) for a in argv if a.isdigit()] or [1, 2]
    print(f"SmolLM2-135M forward over a {PREFIX}-token prefix, ms, median of {rounds} interleaved passes")
    print(f"{'thr':>3} {'rows':>4} | " + " ".join(f"{p:>8}" for p in PATHS) + " | ops / layer | torch / layer")
    for threads in threads_list:
        torch.set_num_threads(threads)
        for rows in ROWS:
            calls = {p: forward_call(p, rows) for p in PATHS}
            times = {p: [] for p in PATHS}
            for _ in range(rounds):
                for p, call in calls.items():
                    start = time.perf_counter()
                    call()
                    times[p].append(time.perf_counter() - start)
            med = {p: sorted(t)[len(t) // 2] for p, t in times.items()}
            print(f"{threads:>3} {rows:>4} | " + " ".join(f"{med[p] * 1e3:8.1f}" for p in PATHS)
                  + f" | {med['ops'] / med['layer']:11.2f} | {med['torch'] / med['layer']:13.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
