"""Every Triton kernel compiles for sm_90 as the JIT compiles it when its launcher runs on a GPU
(bench/compile_audit.py, its ``ci`` grid): within a block's shared memory and without spills in
a loop of the SASS. The interpreted tests cannot see these: the interpreter runs code the
compiler rejects and knows nothing of registers or shared memory. The audit compiles about 25
configurations (about 50 CPU-seconds) once per test session."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys

import pytest
import triton

import eagle_kernels.triton

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
AUDIT = os.path.join(ROOT, "bench", "compile_audit.py")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import compile_audit  # noqa: E402

# Shared memory one block may use on an H100 / H200 (sm_90): Triton refuses the launch above it.
SM90_SHARED_BYTES = 232_448


@pytest.fixture(scope="session")
def compiled():
    if not os.path.exists(CUOBJDUMP):
        pytest.skip("this Triton install has no CUDA backend tools (cuobjdump)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, AUDIT, "--grid", "ci", "--json"], env=env, capture_output=True, text=True,
                         timeout=1800)
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


def _defined_kernels() -> set[str]:
    """Names of the kernels the package defines (jit functions named *_kernel)."""
    names = set()
    for info in pkgutil.iter_modules(eagle_kernels.triton.__path__):
        module = importlib.import_module(f"eagle_kernels.triton.{info.name}")
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "fn") and getattr(obj.fn, "__module__", "") == module.__name__:
                names.add(name)
    return names


def _where(r):
    return f"{r['kernel']} ({r['cases'][0]}; warps {r['num_warps']}, stages {r['num_stages']})"


def test_every_kernel_compiles_for_sm90(compiled):
    assert {r["kernel"] for r in compiled} == _defined_kernels()


def test_shared_memory_fits_sm90(compiled):
    """A launch whose block needs more shared memory than an H200 block may use fails at launch."""
    over = [(_where(r), r["shared_dynamic"]) for r in compiled if r["shared_dynamic"] > SM90_SHARED_BYTES]
    assert not over, over


def test_no_spills_in_loops(compiled):
    """No local-memory load or store (LDL/STL) inside a loop of the SASS."""
    spilling = [(_where(r), f"{r['spill_stores']}/{r['spill_loads']} B spilled",
                 [(loop["instructions"], loop["local_memory"]) for loop in r["loops"] if loop["local_memory"]])
                for r in compiled if any(loop["local_memory"] for loop in r["loops"])]
    assert not spilling, spilling


def test_pdl_waits_before_any_global_memory_access(compiled):
    """On sm_90 every kernel is launched with programmatic dependent launch (the audit's modeled
    H200, EAGLE_KERNELS_PDL unset), and its SASS reaches the wait for the kernel before it
    (ACQBULK) ahead of any branch and any global load, store or atomic."""
    assert {r["pdl"] for r in compiled} == {"waits first"}, [(_where(r), r["pdl"]) for r in compiled
                                                            if r["pdl"] != "waits first"]


def test_pdl_order_reads_the_sass():
    """The audit's PDL check on hand-written SASS: the wait dominates every load, store and atomic;
    an L2 prefetch (and a loop of them) may come before it; a wait on one branch only does not count."""
    def sass(*lines):
        out = []
        for i, line in enumerate(lines):
            if line.endswith(":"):
                out.append(line)
            else:
                out.append(f"        /*{16 * i:04x}*/                   {line} ;")
        return "\n".join(out)
    load, store = "LDG.E R4, desc[UR4][R4.64]", "STG.E desc[UR4][R2.64], R7"
    assert compile_audit.pdl_order(sass("LDC R1, c[0x0][0x28]", "ACQBULK", load, "EXIT")) == "waits first"
    assert compile_audit.pdl_order(sass(load, "ACQBULK", "EXIT")) == "LDG.E before the wait"
    assert compile_audit.pdl_order(sass(".L_x_0:", "UBLKPF.L2 [UR10], UR4", "@P0 BRA.U.ANY `(.L_x_0)", "ACQBULK",
                                        load, store, "EXIT")) == "waits first"
    # A wait on one side of a branch does not cover the store after the join.
    assert compile_audit.pdl_order(sass("@P0 BRA `(.L_x_1)", "ACQBULK", ".L_x_1:", store, "EXIT")) \
        == "STG.E before the wait"
    assert compile_audit.pdl_order(sass("ACQBULK", "@P0 BRA `(.L_x_1)", load, ".L_x_1:", store, "EXIT")) \
        == "waits first"
    assert compile_audit.pdl_order(sass("S2R R7, SR_TID.X", "EXIT")) == "no wait"


def test_compiled_with_the_jits_specialisation(compiled):
    """The audit compiles what the JIT compiles: 16-byte-aligned tensors and integers divisible
    by 16 carry tt.divisibility, integers equal to 1 are constants (write_kv's placeholders
    page_size = max_pages = 1 on a contiguous cache)."""
    assert all(r["registers"] > 0 and r["spill_stores"] >= 0 for r in compiled)
    attention = [r for r in compiled if r["kernel"] == "_tree_attention_kernel"]
    assert all(r["specialised"].get("q_ptr") == "tt.divisibility=16" for r in attention)
    contiguous = [r for r in attention if r["constexprs"]["IS_PAGED"] == "False"]
    assert contiguous and all(r["specialised"].get("page_size") == "==1" for r in contiguous)


def test_occupancy_arithmetic():
    # 255 registers x 128 threads: 8,192 registers a warp after rounding -> 8 warps -> 2 blocks.
    assert compile_audit.occupancy(255, 4, 1024) == (2, "registers")
    assert compile_audit.occupancy(24, 8, 1024) == (8, "threads")
    assert compile_audit.occupancy(64, 4, 100_000) == (2, "shared memory")
    assert compile_audit.occupancy(64, 4, 232_449)[0] == 0
