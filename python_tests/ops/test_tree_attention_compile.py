"""tree_attention's shared-memory estimate against the compiled kernel (sm_90, Triton's own
compiler and ptxas, the JIT's specialisation of the launcher's arguments: bench/
tree_attention_audit.py, which also audits every configuration as a bench command).

The estimate decides the pipeline stages (and so whether a launch fits an H200 block at all);
a few configurations are compiled here, the goal layout first: Llama-3-8B heads (32 / 8),
head_dim 128, 16-bit inputs, a contiguous cache with a tree mask, which once needed 262,144 B
a block (over the 232,448 B an H200 block may use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
AUDIT = os.path.join(ROOT, "bench", "tree_attention_audit.py")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
BUDGET = 232_448
# Four compiles (~10-40 s): out of the fast lane.
pytestmark = pytest.mark.slow
# (D, dtype, causal, paged[, (request, KV head) pairs]): the goal layout, a D 64 causal one, the
# paged goal layout, and its 256-row block (B 8 and up).
CASES = [[128, "bfloat16", False, False], [64, "float16", True, False], [128, "bfloat16", False, True],
         [128, "bfloat16", False, True, 132]]


@pytest.fixture(scope="module")
def compiled():
    if not os.path.exists(CUOBJDUMP):
        pytest.skip("this Triton install has no CUDA backend tools (cuobjdump)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, AUDIT, "check", json.dumps(CASES)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return {json.dumps(r["case"]): r for r in map(json.loads, run.stdout.splitlines())}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"D{c[0]}-{c[1]}-{'causal' if c[2] else 'tree'}-"
                         f"{'paged' if c[3] else 'contiguous'}{'-wide' if len(c) > 4 else ''}")
def test_estimate_matches_compiled_shared_memory(compiled, case):
    r = compiled[json.dumps(case)]
    assert r["shared"] + r["static_shared"] <= BUDGET, r
    assert r["loop_spills"] == 0, r  # no spill instruction (LDL / STL) inside a loop
    # An upper bound, for 16-bit inputs within its 1 KiB bounds: the rescale's reduction scratch
    # (placed at the allocator's alignment) and the paged gather's block-table indices; fp32 (FMA
    # dots) is checked as a bound by bench/tree_attention_audit.py audit.
    assert r["shared"] <= r["estimate"], r
    if case[1] != "float32":
        assert r["estimate"] - r["shared"] <= 1024 * (1 + case[3]), r
