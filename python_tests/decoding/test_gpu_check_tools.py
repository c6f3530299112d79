"""The GPU check's tools on a CPU: the script parses, its dry run finds every stage's command and
round-trips the model parts, the parts tool rejects corrupt and missing parts, and the
steady-state benchmark runs end to end at toy shapes."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import model_parts  # noqa: E402

SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")


def test_gpu_check_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    run = subprocess.run(["bash", SCRIPT, "--dry-run", str(tmp_path / "out")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "dry run" in summary and "Overall: PASS" in summary
    for stage in ("build", "compile_audit", "gpu_tests", "e2e_smollm2", "e2e_llama3_8b", "real_weights", "goals"):
        assert f"| {stage} | DRY (found) |" in summary, stage
    assert "| parts_logic | PASS |" in summary


def test_gpu_check_dry_run_fails_on_a_missing_file(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, CPU_TAU=str(tmp_path / "absent.json"))
    run = subprocess.run(["bash", SCRIPT, "--dry-run", str(tmp_path / "out")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1
    assert "absent.json | FAIL (missing)" in (tmp_path / "out" / "summary.md").read_text()


def test_model_parts_round_trip_and_faults(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(10_000))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [[1, 2, 3]]}))
    folder = str(tmp_path / "parts")
    manifest = model_parts.split(str(src), folder, 4096, str(prompts))
    assert [p["size"] for p in manifest["parts"]] == [4096, 4096, 1808]
    assert model_parts.plan(folder)[0][-3:] == [os.path.relpath(os.path.join(folder, n), ROOT)
                                                for n in ("manifest.json", "prompts.json", "part-000")]
    out = model_parts.join(folder, str(tmp_path))
    assert open(out, "rb").read() == src.read_bytes() and os.path.basename(out) == "model.gguf"
    part = tmp_path / "parts" / "part-001"
    data = bytearray(part.read_bytes())
    data[5] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=r"corrupt \['part-001'\]"):
        model_parts.join(folder, str(tmp_path / "again.gguf"))
    assert not (tmp_path / "again.gguf").exists() and not (tmp_path / "again.gguf.partial").exists()
    part.unlink()
    with pytest.raises(RuntimeError, match=r"missing \['part-001'\]"):
        model_parts.join(folder, str(tmp_path / "again.gguf"))
    assert model_parts.main(["status", "--dir", folder]) == 1
    with pytest.raises(FileNotFoundError, match="no manifest"):
        model_parts.read_manifest(str(tmp_path))


def test_gpu_e2e_smoke(tmp_path):
    """The steady-state benchmark at toy shapes on the CPU with stand-in graphs: every case is
    warmed up, the timed calls replay and capture nothing."""
    import gpu_e2e

    assert gpu_e2e.main(["--smoke", "--batches", "1", "2", "--temperatures", "0", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_e2e_tiny.json").read_text())
    assert len(summary["rows"]) == 4
    for row in summary["rows"]:
        assert row["captures"] == 0 and row["graph"] == ["replayed"] and row["replay_steps"] >= 1
        assert row["step_ms"] > 0 and row["tau"] >= 1.0


def test_gpu_e2e_smoke_unfused(tmp_path):
    """--unfused runs the cases with the layer norms apart (its own files) and leaves the fusion limit as it was."""
    import gpu_e2e

    from eagle_kernels.models import layers

    limit = layers.FUSED_NORM_MAX_MATRIX_BYTES
    assert gpu_e2e.main(["--smoke", "--unfused", "--batches", "1", "--temperatures", "0", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_e2e_tiny_unfused.json").read_text())
    assert "layer norms unfused" in summary["source"] and len(summary["rows"]) == 2
    assert layers.FUSED_NORM_MAX_MATRIX_BYTES == limit
    with gpu_e2e.norms_apart():
        assert layers.FUSED_NORM_MAX_MATRIX_BYTES == 0
    assert layers.FUSED_NORM_MAX_MATRIX_BYTES == limit


def test_gpu_e2e_smoke_pdl_side_by_side(tmp_path):
    """--no-pdl, --no-prefetch, --cublas-residual and --mlp-apart (the GPU check's e2e_pdl stage) write their own
    files and leave the switches as they were."""
    import gpu_e2e

    from eagle_kernels.models import layers
    from eagle_kernels.triton import _pdl

    for flag, stem in (("--no-pdl", "nopdl"), ("--no-prefetch", "noprefetch"), ("--mlp-apart", "mlpapart"),
                       ("--cublas-residual", "cublasres")):
        assert gpu_e2e.main(["--smoke", flag, "--batches", "1", "--temperatures", "0", "--out", str(tmp_path)]) == 0
        summary = json.loads((tmp_path / f"gpu_e2e_tiny_{stem}.json").read_text())
        assert len(summary["rows"]) == 2
    assert "o / down GEMMs cuBLAS" in summary["source"]
    assert layers.RESIDUAL_GEMMS_IN_TRITON and layers.O_PROJ_MLP_IN_ONE_LAUNCH and not _pdl._forced
    assert _pdl.PREFETCH_WEIGHTS
    with gpu_e2e.mlp_apart():
        assert not layers.O_PROJ_MLP_IN_ONE_LAUNCH
    with gpu_e2e.residual_gemms_in_cublas():
        assert not layers.RESIDUAL_GEMMS_IN_TRITON
    assert layers.RESIDUAL_GEMMS_IN_TRITON


def test_gpu_e2e_smoke_q8_0_head(tmp_path):
    """--head-weights q8_0: the random head's matrices as Q8_0 blocks, its own files, a speculative case replayed."""
    import gpu_e2e

    assert gpu_e2e.main(["--smoke", "--head-weights", "q8_0", "--batches", "1", "--temperatures", "0",
                         "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_e2e_tiny_q8head.json").read_text())
    assert "head matrices q8_0" in summary["source"] and len(summary["rows"]) == 2
    assert all(row["captures"] == 0 and row["replay_steps"] >= 1 for row in summary["rows"])


def test_gpu_e2e_smoke_coupled(tmp_path):
    """The coupled mode: StaticPolicy(coupled_sampling=True) cases at T > 0 only, replayed like the others."""
    import gpu_e2e

    assert gpu_e2e.main(["--smoke", "--modes", "plain", "coupled", "--batches", "1", "--temperatures", "0", "1",
                         "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_e2e_tiny.json").read_text())
    assert [(r["mode"], r["T"]) for r in summary["rows"]] == [("plain", 0.0), ("plain", 1.0), ("coupled", 1.0)]
    for row in summary["rows"]:
        assert row["captures"] == 0 and row["graph"] == ["replayed"] and row["replay_steps"] >= 1
    assert "coupled step / plain step" in (tmp_path / "gpu_e2e_tiny.md").read_text()


def test_gpu_e2e_cpu_tau_coupled(tmp_path):
    """A CPU tau measured under coupled sampling at T 1 gives the coupled case's real-weights estimate (tau
    over that case's step); a tau of another tree is refused."""
    import gpu_e2e

    tau_file = tmp_path / "tau.json"
    tau_file.write_text(json.dumps({"tree": "2,2,4", "temperature": 1.0, "policy": "coupled", "tau": 2.5,
                                    "prompts": 3, "max_new_tokens": 64}))
    args = ["--smoke", "--modes", "plain", "coupled", "--batches", "1", "--temperatures", "1", "--out", str(tmp_path)]
    assert gpu_e2e.main(args + ["--cpu-tau", str(tau_file)]) == 0
    summary = json.loads((tmp_path / "gpu_e2e_tiny.json").read_text())
    estimate = summary["real_weights_estimate"]
    coupled = next(r for r in summary["rows"] if r["mode"] == "coupled")
    assert estimate["mode"] == "coupled" and estimate["temperature"] == 1.0
    assert estimate["spec_tok_s"] == pytest.approx(2.5 / (coupled["step_ms"] * 1e-3))
    tau_file.write_text(json.dumps({"tree": "6,8,60", "temperature": 1.0, "policy": "coupled", "tau": 2.5,
                                    "prompts": 3, "max_new_tokens": 64}))
    with pytest.raises(SystemExit, match="tree"):
        gpu_e2e.main(args + ["--cpu-tau", str(tau_file)])


def test_gpu_e2e_smoke_profile(tmp_path):
    """--profile: per case, the launches and time per kernel of a replayed step (two calls' difference), in both
    outputs (on the CPU the profiler's CPU events: a check of the code path, not a measurement)."""
    import gpu_e2e

    assert gpu_e2e.main(["--smoke", "--batches", "1", "--temperatures", "0", "--profile", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_e2e_tiny.json").read_text())
    for row in summary["rows"]:
        profile = row["profile"]
        # Launch counts are exact; the CPU's event times are wall clock, and a difference of two calls' times
        # can come out negative in a noisy run (on a GPU they are device times): only their presence is checked.
        assert profile["steps"] >= 1 and profile["launches"] > 0 and math.isfinite(profile["kernel_us"])
        assert all(k["launches"] > 0 for k in profile["kernels"].values())
    text = (tmp_path / "gpu_e2e_tiny.md").read_text()
    assert "Where a replayed step's device time goes" in text and "#### speculative, B 1, T 0" in text
