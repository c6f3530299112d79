"""bench/gpu_goals.py, the one script a GPU session runs for the kernel issues' goals: its
``--smoke`` mode runs every op and goal column at toy shapes on the CPU, so the script is known
to work before a device is lent (the numbers themselves mean nothing on the CPU)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench")
SCRIPT = os.path.join(BENCH, "gpu_goals.py")
sys.path.insert(0, BENCH)
import bench_verify  # noqa: E402
import gpu_goals  # noqa: E402


@pytest.mark.slow
def test_smoke_run_fills_every_goal_column(tmp_path):
    # The sweep drives the Triton launcher itself: interpreted on CPU tensors.
    run = subprocess.run([sys.executable, SCRIPT, "--smoke", "--sweep", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_goals.json").read_text())
    assert set(result["limits"]) == {"copy_GBps", "read_GBps", "gemm_TFLOPs"}
    ops = {}
    for row in result["rows"]:
        ops.setdefault(row["op"], []).append(row)
        assert all(math.isfinite(v) and v > 0 for v in row.values() if isinstance(v, float)), row
    assert sorted(ops) == ["draft_expand", "tree_attention", "verify"]
    assert {"share_of_copy", "share_bound", "speedup_over_baseline"} <= set(ops["tree_attention"][0])
    assert all("x_one_read" in row for row in ops["draft_expand"] + ops["verify"])
    # One row per mode of bench_verify: greedy, temperature, top-k + top-p, top-p, the draft-aware rule (± d2t).
    assert [row["shape"].rsplit("-", 1)[1] for row in ops["verify"]] == list(bench_verify.MODES)
    (sweep,) = result["sweep"]
    # The launcher's own choice, then each configuration of SWEEP_CONFIGS.
    assert sweep["default_us"] > 0 and sum(key.endswith("_us") for key in sweep) == 1 + len(gpu_goals.SWEEP_CONFIGS)
    table = (tmp_path / "gpu_goals.md").read_text()
    assert table.count("\n| tree_attention |") == 1 and "share bound" in table


def test_refuses_without_a_device_unless_smoke():
    run = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert run.returncode == 2 and "--smoke" in run.stderr


def test_a_spent_budget_measures_nothing_more_and_says_so(tmp_path):
    """--budget-s: no case starts once it is spent; what was not measured is listed in both outputs."""
    run = subprocess.run([sys.executable, SCRIPT, "--smoke", "--budget-s", "0", "--ops", "verify", "draft_expand",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_goals.json").read_text())
    assert result["rows"] == [] and result["unmeasured"] == ["verify (all)", "draft_expand (all)"]
    assert "Not measured (the --budget-s of 0 s was spent): verify (all), draft_expand (all)" in \
        (tmp_path / "gpu_goals.md").read_text()
