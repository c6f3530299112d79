"""bench/gpu_model.py on small shapes: every launch compiles, its sampled programs run in the
interpreter with the counters, and the counts hold at least the work the op must do (every
logit read once, the attention's QK^T and PV FLOPs over the prefix)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton install has no CUDA backend tools")
def test_model_smoke(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_model.py"), "smoke", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = {row["case"].split()[0]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"tree_attention", "draft_expand", "verify"}
    for row in rows.values():
        launches = row["launches"]
        assert launches and all(m["time_s"] > 0 and m["warp_instructions"] > 0 for m in launches)
        assert row["modeled_us"] >= row["roofline_us"] - 1e-6  # the model never beats the roofline
        requested = sum(m["requested_bytes"] for m in launches)
        assert requested >= row["minimal"]["bytes"]
        assert sum(m["dram_bytes"] for m in launches) >= row["minimal"]["bytes"]
    assert sum(m["flops"] for m in rows["tree_attention"]["launches"]) >= rows["tree_attention"]["minimal"]["flops"]
    # draft_expand is one launch whose last program of each request merges it: a tail after the waves.
    (expand,) = rows["draft_expand"]["launches"]
    assert expand["tail_warp_instructions"] > 0 and expand["tail_s"] > 0
    # verify is one cooperative launch: a request's programs share each phase's chunks (claimed
    # atomically), one merges; under the interpreter one program did all of it, the model puts
    # the chunks back in parallel.
    from eagle_kernels.triton import verify as triton_verify

    (walk,) = rows["verify"]["launches"]
    _, splits, _ = triton_verify._chunking(2, 32768, triton_verify.GPU_CONFIG, 132)  # as on an H200
    assert splits > 1 and walk["group_size"] == splits and len(walk["groups"]) == 2
    assert walk["group_programs"] == splits  # at batch 2 every program of a request is resident
    for group in walk["groups"]:
        phases = group["phases"]
        # temperature rows: a max, a levels and a mass phase per visited row, at least the root
        assert phases and len(phases) % 3 == 0
        assert all(p["chunks"] == splits and p["chunk"]["warp_instructions"] > 0
                   and p["merge"]["warp_instructions"] > 0 for p in phases)
    # in parallel, faster than one program running every chunk
    rate = 1.25 * 1.98e9  # warp instructions a second on one SM: gpu_model.ISSUE_RATE at the H200's clock
    serial = max(sum(p["chunks"] * p["chunk"]["warp_instructions"] + p["merge"]["warp_instructions"]
                     for p in g["phases"]) for g in walk["groups"]) / rate
    assert walk["group_s"] < serial

