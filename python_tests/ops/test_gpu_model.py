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


def test_unrolled_loops_count_once_a_run():
    """A loop LLVM unrolled 4 times (its loads move 4 runs' bytes a pass) is counted once a run:
    its statements' instructions and its main load's latencies divided by 4; a loop whose loads
    move one run's bytes a pass is left as it is. The loads may be filed under another
    statement than the one the interpreter ran (the masked copy after the loop)."""
    gm = _gpu_model()
    load, body, tail_load = 10, 11, 14
    loop = gm.LoopCopies(gm.Counter({load: 12, body: 40, tail_load: 4}), load_bytes=4 * 16 * 32)  # 4 LDG.128
    counts = gm.Counts(chain=34)
    counts.lines.update({load: 32, body: 32, tail_load: 1})
    counts.line_loads.update({load: 32 * 4096, tail_load: 1000})  # 2048 bf16 entries a run, 8 warps
    factor = gm.unroll_factor(loop, [counts], num_warps=8)
    assert factor == 4
    in_loop = gm.per_run(gm.Counter({load: 12, body: 40, tail_load: 4, 99: 7}), [loop], [factor])
    assert in_loop == gm.Counter({load: 3, body: 10, tail_load: 1, 99: 7})
    assert gm.chain_per_pass(counts, [loop], [factor]).chain == 34 - 32 * 3 / 4
    single = gm.LoopCopies(gm.Counter({load: 3}), load_bytes=16 * 32)
    assert gm.unroll_factor(single, [counts], num_warps=8) == 1
    assert gm.unroll_factor(loop, [gm.Counts()], num_warps=8) == 1  # never ran: nothing to compare


def test_load_widths_from_sass():
    """The bytes a thread's global load moves, from its opcode."""
    gm = _gpu_model()
    texts = ("LDG.E.128 R4, desc[UR4][R2.64]", "LDG.E.64 R2, desc[UR4][R6.64]", "@!P0 LDG.E.U16 R3, desc[UR4][R4.64]",
             "LDG.E.STRONG.GPU R12, desc[UR12][R6.64]", "LDG.E R5, desc[UR4][R2.64]", "STG.E.128 desc[UR4][R2.64], R4",
             "LDS.128 R4, [R2]")
    assert [gm.load_width(t) for t in texts] == [16, 8, 2, 4, 4, 0, 0]


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


def _memory_bound_launch(gm):
    return gm.LaunchModel(kernel="k", grid=(132,), programs=132, num_warps=4, num_stages=1, blocks_per_sm=1,
                          waves=1, warp_instructions=10.0, warp_instructions_max=10.0, dram_bytes=4.3e9,
                          requested_bytes=4.3e9, flops=0.0, reductions=0.0, chain=0)


@pytest.mark.parametrize("name, key", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
                                       ("NVIDIA H100 PCIe", "h100-pcie"), ("h100-sxm", "h100-sxm")])
def test_device_profiles_by_name(name, key):
    gm = _gpu_model()
    assert gm.compile_audit.device_named(name) is gm.compile_audit.DEVICES[key]


def test_unknown_device_is_refused():
    gm = _gpu_model()
    with pytest.raises(ValueError, match="A100"):
        gm.compile_audit.device_named("NVIDIA A100-SXM4-80GB")


def test_the_model_prices_the_device_it_is_given():
    """A card picked by use_device (an H100, or a GPU check's measured limits) is what the
    launchers see (its SM count) and what the model prices (a memory-bound launch at its
    bandwidth); the H200 comes back after."""
    gm = _gpu_model()
    audit = gm.compile_audit
    import torch

    h200_s = _memory_bound_launch(gm).finish().memory_s
    assert h200_s == pytest.approx(1e-3)  # 4.3 GB at 4.3 TB/s
    goals = {"device": "NVIDIA H100 PCIe", "sms": 114, "limits": {"copy_GBps": 1720.0, "gemm_TFLOPs": 600.0}}
    measured = audit.measured_device(goals)
    assert (measured.sms, measured.hbm_bytes_per_s, measured.dense_bf16_flops) == (114, 1.72e12, 6e14)
    assert audit.DEVICES["h100-pcie"].hbm_bytes_per_s != 1.72e12  # the profile itself is left as it was
    try:
        audit.use_device(measured)
        assert gm.DEVICE is audit.DEVICE and gm.DEVICE.sms == 114
        assert _memory_bound_launch(gm).finish().memory_s == pytest.approx(4.3e9 / 1.72e12)
        with audit.modeled_gpu([], [""]):
            props = torch.cuda.get_device_properties(0)
            assert (props.name, props.multi_processor_count) == ("NVIDIA H100 PCIe", 114)
    finally:
        audit.use_device(audit.H200)
    assert _memory_bound_launch(gm).finish().memory_s == pytest.approx(h200_s)
    assert vars(audit.DEVICE) == vars(audit.H200)
