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



def _gpu_model():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import gpu_model
    finally:
        sys.path.pop(0)
    return gpu_model


def test_helpers_from_other_files_are_counted_per_run():
    """The kernel's helpers include those it imports from other files (verify's passes over a
    chunk live in verify_rows.py), keyed by (file name, statement line): a loop inside one is
    charged per iteration, not once per call of the kernel statement."""
    gm = _gpu_model()
    from eagle_kernels.triton import verify_rows, verify_walk

    helpers = gm.helper_statements(verify_walk._verify_kernel.fn)
    rows_file = os.path.realpath(verify_rows.__file__)
    statements = helpers[(rows_file, "_range_max")]
    assert statements and all(name == "verify_rows.py" and first in statements
                              for name, first in statements.values())
    assert (rows_file, "_fold1") in helpers  # called only by other helpers of that file
    own = helpers[(os.path.realpath(verify_walk.__file__), "_children_of")]
    assert all(isinstance(key, int) for key in own.values())


def test_runs_divide_by_inlined_copies():
    """A helper called twice in one statement (two ``_max1`` calls, each folding twice) has one
    SASS copy per call under one key: each copy runs once per run of the statement. A statement
    in a helper's loop has one copy that runs once per iteration."""
    gm = _gpu_model()
    kernel_statement = 5
    outer = (("h.py", 20), kernel_statement)  # the helper's statement calling the inner helper twice
    inner = (("h.py", 10),) + outer  # the inner helper's statement: 2 calls x 2 copies of the outer
    loop = (("h.py", 30), kernel_statement)  # a loop body of a helper called once
    counts = gm.Counts()
    counts.lines.update({kernel_statement: 1, outer: 2, inner: 4, loop: 48})
    counts.entered.update({outer: 2, inner: 4, loop: 1})
    assert gm.copies(counts, outer) == 2 and gm.copies(counts, inner) == 4 and gm.copies(counts, loop) == 1
    assert gm.runs(counts, outer) == 1 and gm.runs(counts, inner) == 1 and gm.runs(counts, loop) == 48
    assert gm.runs(counts, kernel_statement) == 1


@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_verify_walk_of_a_given_length(accepted):
    """The decode rows' walks of a step's length: ``_verify_inputs(accepted=)`` plants inputs whose
    greedy walk accepts exactly that many drafts (the reference says so), from the bench's inputs
    that accept one at every depth."""
    import torch

    gm = _gpu_model()
    from eagle_kernels import reference

    tokens, parents, logits, sampling = gm._verify_inputs(1, 61, 512, "greedy", torch.float32, accepted)
    result = reference.verify(tokens, parents, logits, max_depth=6, **sampling)
    assert result.accept_len.tolist() == [accepted]
