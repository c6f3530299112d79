"""Programmatic dependent launch (PDL): a kernel's launch overlaps the tail of the kernel before it.

On sm_90 and later a kernel launched with ``launch_pdl=True`` may be scheduled while the kernel
before it on the stream is still running (once every program of that kernel has started and
signalled ``griddepcontrol.launch_dependents``, or finished). Its programs then sit in
``griddepcontrol.wait`` until that kernel has finished and its memory writes are visible. The
gain is the launch and the programs' start-up hidden behind the previous kernel's last wave:
at batch 1 a decoding step is a chain of a few hundred short kernels (docs/gpu_model.md), so
that is where a step's time goes. Inside a CUDA graph the launches become programmatic edges.

The rule every kernel here follows: ``wait_for_prior_grids(USE_PDL)`` comes before any load,
store or atomic, so nothing it touches can race with the kernel before it (the compile audit
checks this in each kernel's SASS: the wait dominates every global memory instruction that moves
data). Only index arithmetic and, in the GEMM kernels, ``prefetch_l2`` of their weights (which
returns nothing; a step's kernels never write weights) come before it. It then signals at once
that the next kernel may launch: the next kernel's programs wait in turn, and they are only
scheduled on SM slots this kernel no longer needs (every program of this one is already resident
when the signal completes). A kernel that is not launched with PDL executes the two instructions
as no-ops; a PDL launch after a kernel that never signals (cuBLAS, torch's own) starts when that
kernel finishes, as without PDL.

``EAGLE_KERNELS_PDL``: ``0`` turns it off, ``1`` or unset leaves it on for CUDA devices of
compute capability 9.0 or more. :func:`forced` overrides the environment (tests, benchmarks side
by side).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._launch_config import interpreted

ENV = "EAGLE_KERNELS_PDL"
_forced: list[bool] = []


@triton.jit
def _wait_and_release(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _nothing_before(USE_PDL: tl.constexpr):
    # The interpreter runs one launch at a time and has no griddepcontrol: nothing to wait for.
    pass


wait_for_prior_grids = _nothing_before if interpreted(_wait_and_release) else _wait_and_release


@triton.jit
def _bulk_prefetch_l2(row_ptrs, row_bytes):
    # One instruction per row: cp.async.bulk.prefetch brings row_bytes (a multiple of 16, from a 16-byte aligned
    # address) into L2 and returns nothing, so it may run before the wait.
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;", "=r,l,r",
                              [row_ptrs, tl.zeros(row_ptrs.shape, tl.int32) + row_bytes], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _no_prefetch(row_ptrs, row_bytes):
    pass


# prefetch_l2(row_ptrs, row_bytes): the rows [row_ptrs[i], + row_bytes) into L2 (a no-op interpreted).
prefetch_l2 = _no_prefetch if interpreted(_bulk_prefetch_l2) else _bulk_prefetch_l2

# A GEMM kernel launched with PDL prefetches its program's weight rows into L2 before its wait, so
# the weights stream in while the kernel before it finishes (they are never written by a step's
# kernels). False: the wait alone (bench/gpu_e2e.py --no-prefetch).
PREFETCH_WEIGHTS = True
# Matrices up to this size are prefetched whole (all programs together): a layer of a small model, well within an
# H200's 50 MB L2. A larger GEMM is bound by its bytes anyway, and prefetching it whole would evict the L2 working set
# of the kernel still running.
PREFETCH_MAX_BYTES = 16 << 20


def enabled() -> bool:
    """Whether PDL is on for devices that support it (the environment, unless :func:`forced`)."""
    if _forced:
        return _forced[-1]
    value = os.environ.get(ENV, "1").strip().lower()
    if value not in ("0", "1", "off", "on", "false", "true", ""):
        raise ValueError(f"{ENV}={value!r}: expected 0 or 1")
    return value not in ("0", "off", "false")


def programmatic_launch(device: torch.device) -> bool:
    """Whether a launch on ``device`` uses PDL: a CUDA device of compute capability >= 9.0 with
    PDL :func:`enabled`; under :func:`forced` ``(True)`` also CPU tensors (the interpreter then
    runs the kernels' PDL branch, whose waits are no-ops there), never an older GPU (its compiler
    has no griddepcontrol)."""
    if not enabled():
        return False
    if device.type != "cuda":
        return bool(_forced)
    return torch.cuda.get_device_properties(device).major >= 9


def launch_options(device: torch.device, *weights: torch.Tensor) -> dict:
    """The keyword arguments a launcher adds to a kernel launch on ``device``: the kernel's
    ``USE_PDL`` and Triton's ``launch_pdl``; for a GEMM kernel (``weights``: its dense matrices as
    the kernel reads them, rows on the last dim; one, or a phased kernel's several) also
    ``PREFETCH``, whether its programs prefetch their weight rows into L2 before the wait: with PDL
    and :data:`PREFETCH_WEIGHTS`, for matrices of at most :data:`PREFETCH_MAX_BYTES` together whose
    every row starts 16-byte aligned and is a multiple of 16 bytes (the bulk prefetch's rule)."""
    pdl = programmatic_launch(device)
    options = {"USE_PDL": pdl, "launch_pdl": pdl}
    if weights:
        options["PREFETCH"] = (pdl and PREFETCH_WEIGHTS
                               and sum(w.numel() * w.element_size() for w in weights) <= PREFETCH_MAX_BYTES
                               and all(w.shape[-1] * w.element_size() % 16 == 0 and w.data_ptr() % 16 == 0
                                       for w in weights))
    return options


@contextlib.contextmanager
def forced(on: bool) -> Iterator[None]:
    """Within the block PDL is on (for CPU tensors under the interpreter too, for GPUs that
    support it) or off, whatever the environment. Graphs captured inside keep the choice."""
    _forced.append(bool(on))
    try:
        yield
    finally:
        _forced.pop()
