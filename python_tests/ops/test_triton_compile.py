"""Every Triton kernel compiles for sm_90 as its launcher configures it on a GPU, without
register spills and within a block's shared memory (python_tests/ops/triton_cuda_compile.py). The
interpreted tests cannot see these: the interpreter runs code the compiler rejects."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
KERNELS = {"_verify_kernel", "_tree_attention_kernel", "_tree_attention_merge_kernel", "_draft_chunk_kernel",
           "_draft_merge_kernel", "_write_kv_kernel", "_rmsnorm_kernel", "_rope_write_kv_kernel", "_silu_mul_kernel"}


@pytest.fixture(scope="module")
def compiled():
    if not os.path.exists(CUOBJDUMP):
        pytest.skip("this Triton install has no CUDA backend tools (cuobjdump)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, os.path.join(HERE, "triton_cuda_compile.py"), "90"], env=env,
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


def test_every_kernel_compiles_for_sm90(compiled):
    assert {r["kernel"] for r in compiled} == KERNELS


def test_no_register_spills(compiled):
    spilling = [(r["kernel"], r["constexprs"], r["local_bytes"]) for r in compiled if r["local_bytes"] > 0]
    assert not spilling, spilling


# Shared memory one block may use on an H100 / H200 (sm_90).
SM90_SHARED_BYTES = 232_448


def test_shared_memory_fits_sm90(compiled):
    """A launch whose block needs more shared memory than the GPU has fails at launch time."""
    over = [(r["kernel"], r["constexprs"], r["options"], r["dynamic_shared_bytes"]) for r in compiled
            if r["dynamic_shared_bytes"] + r["shared_bytes"] > SM90_SHARED_BYTES]
    assert not over, over


def test_verify_searches_fewer_key_bits_for_16_bit_logits(compiled):
    rows = {r["constexprs"]["SIG_BITS"] for r in compiled if r["kernel"] == "_verify_kernel"}
    assert rows == {"16", "19", "32", "64"}
