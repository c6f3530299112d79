"""Compile audit: every Triton kernel compiled for an H200 (sm_90) exactly as the JIT would.

    python bench/compile_audit.py [--grid ci|full] [--arch 90] [--jobs N] [--json | --from-json FILE]

Run it without ``TRITON_INTERPRET``. The launchers are driven on CPU tensors with a modeled
H200 standing in for the device (``torch.cuda.get_device_properties`` answers 132 SMs and the
tensors report a CUDA device to the launchers' device checks, so they take their GPU branches:
GPU launch configurations, flash-decoding splits, verify's chunk counts), and the launch
itself (``JITFunction.run``) is replaced by a recorder. Each recorded launch is then
specialised by the JIT's own binder (``create_function_from_signature`` and
``JITFunction._pack_args``, the code ``JITFunction.run`` calls): pointer arguments whose
address is divisible by 16 and integers divisible by 16 get ``tt.divisibility = 16``, integers
equal to 1 become constants, ``do_not_specialize`` is honoured, and the JIT's option defaults
apply. The compiled cubin is then read for

- registers per thread (the cubin's resource usage),
- spill stores / loads in bytes (``ptxas -v``: "N bytes spill stores, N bytes spill loads";
  the cubin's LOCAL field is the stack frame, which also holds local arrays, not the spills),
- dynamic shared memory of a block (``metadata.shared``, the figure Triton checks against the
  device's opt-in limit before a launch) and the static shared section (on sm_90 the 1 KiB a
  block reserves),
- occupancy on an H200: blocks per SM from registers, shared memory, threads and the 32-block
  cap,
- the loops of the SASS (natural loops of its control-flow graph: back edges to a dominating
  block), their instruction counts, and local-memory instructions (LDL/STL) inside a loop: a
  spill in a hot loop.

The ``ci`` grid is a representative subset (python_tests/ops/test_triton_compile.py runs it);
``full`` enumerates the layouts the package supports (contiguous and paged caches, with and
without a tree mask, fp16/bf16/fp32, head_dim 64 and 128, N 1-256, the verify modes, draft
vocabularies 32000 and 128256) and takes minutes.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable, Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime import jit as triton_jit

# The H200 (sm_90, 132 SMs). Its per-SM and per-block limits are every sm_90 card's (the audit's
# checks); its copy bandwidth and bf16 GEMM rate are the ones measured on the one H200 run.
H200 = types.SimpleNamespace(
    name="NVIDIA H200", arch=90, sms=132, regs_per_sm=65536, reg_alloc_unit=256, max_regs_per_thread=255,
    smem_per_sm=233_472, smem_per_block=232_448, max_threads_per_sm=2048, max_blocks_per_sm=32, warp=32,
    hbm_bytes_per_s=4.3e12, dense_bf16_flops=790e12, clock_hz=1.98e9, total_memory=141 * 2**30,
)
# The H200's measured share of its datasheet peaks (copy 4.3 of 4.8 TB/s, GEMM 790 of 990 TFLOP/s),
# applied to the H100s' datasheet peaks: estimates until a run on such a card measures them
# (``measured_device``).
_COPY_SHARE, _GEMM_SHARE = 4.3 / 4.8, 790 / 990
DEVICES = {
    "h200": H200,
    "h100-sxm": types.SimpleNamespace(**{**vars(H200), "name": "NVIDIA H100 80GB HBM3",
                                         "hbm_bytes_per_s": 3.35e12 * _COPY_SHARE,
                                         "dense_bf16_flops": 989e12 * _GEMM_SHARE, "total_memory": 80 * 10**9}),
    "h100-pcie": types.SimpleNamespace(**{**vars(H200), "name": "NVIDIA H100 PCIe", "sms": 114, "clock_hz": 1.755e9,
                                          "hbm_bytes_per_s": 2.0e12 * _COPY_SHARE,
                                          "dense_bf16_flops": 756e12 * _GEMM_SHARE, "total_memory": 80 * 10**9}),
}
# The device the recorded launchers see (modeled_gpu) and bench/gpu_model.py prices: the H200
# unless use_device picks another. One shared object, so modules that imported it see the change.
DEVICE = types.SimpleNamespace(**vars(H200))


def device_named(name: str) -> types.SimpleNamespace:
    """The profile of ``DEVICES`` for a device name as CUDA reports it ("NVIDIA H200",
    "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe") or a key of ``DEVICES``; ValueError for any other
    card, whose SM count and rates the model does not know."""
    key = name.lower()
    if key in DEVICES:
        return DEVICES[key]
    if "h200" in key:
        return DEVICES["h200"]
    if "h100" in key and "pcie" in key:
        return DEVICES["h100-pcie"]
    if "h100" in key and ("hbm3" in key or "sxm" in key):
        return DEVICES["h100-sxm"]
    raise ValueError(f"device {name!r}: no profile (known: {', '.join(DEVICES)}); pass its measured limits instead")


def measured_device(goals: dict) -> types.SimpleNamespace:
    """The profile of the card a gpu_goals.json (bench/gpu_goals.py) was measured on, with that
    run's copy bandwidth, bf16 GEMM rate and SM count in place of the profile's."""
    limits = goals["limits"]
    profile = types.SimpleNamespace(**vars(device_named(goals["device"])))
    profile.name = goals["device"]
    profile.hbm_bytes_per_s = limits["copy_GBps"] * 1e9
    profile.dense_bf16_flops = limits["gemm_TFLOPs"] * 1e12
    profile.sms = int(goals.get("sms") or profile.sms)
    return profile


def use_device(profile: types.SimpleNamespace) -> None:
    """Make ``profile`` the modeled device (``DEVICE``) from here on."""
    vars(DEVICE).clear()
    vars(DEVICE).update(vars(profile))
NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
GUARD = re.compile(r"@(!?U?P\w+)\s+")
TARGET = re.compile(r"`?\(?(\.L_x_\d+)")
PREDICATE_OPERAND = re.compile(r"(^|[\s,])!?U?P\d+\b")
LOCAL_MEMORY = re.compile(r"(@!?U?P\w+\s+)?(LDL|STL)\b")
# Opcodes after which a basic block ends (the next instruction starts one).
ENDS_BLOCK = {"BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BPT", "KILL"}
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?);")
# Opcodes (before the first '.') that read or write global memory, or may (generic addresses).
GLOBAL_MEMORY = {"LDG", "STG", "ATOMG", "ATOM", "RED", "REDG", "LDGSTS", "LD", "ST", "UTMALDG", "UTMASTG",
                 "UTMAPF", "UTMAREDG", "UBLKCP", "UBLKRED", "UBLKPF", "SULD", "SUST", "SURED", "SUATOM"}
# griddepcontrol.wait in SASS: programmatic dependent launch's wait for the kernel before.
PDL_WAIT = "ACQBULK"
# L2 prefetches (cp.async.bulk.prefetch.L2, prefetch.global.L2): they return no data, so they may run before the wait.
PREFETCHES = {"UBLKPF", "CCTL"}
LABEL = re.compile(r"^(\.L_x_\d+):")


# --------------------------------------------------------------------------------------------
# Recording: the real launchers, a modeled H200, the launch replaced by a recorder.


@dataclasses.dataclass
class Launch:
    kernel: triton_jit.JITFunction
    args: tuple
    kwargs: dict
    grid: tuple
    case: str  # the call that made it (op and shape)


class _ModeledCudaDevice(str):
    """``"cpu"`` to torch's allocator (so tensors stay on the host), a CUDA device to the
    launchers' ``device.type == "cuda"`` checks."""

    type = "cuda"
    index = 0


@contextlib.contextmanager
def modeled_gpu(launches: list[Launch], case: list[str]) -> Iterator[None]:
    """Within the block, tensors report a CUDA device, the device has the modeled device's SM
    count (``DEVICE``, an H200 unless ``use_device``), and JITFunction.run records instead of
    compiling or launching."""
    device = _ModeledCudaDevice("cpu")
    props = types.SimpleNamespace(name=DEVICE.name, multi_processor_count=DEVICE.sms, major=9, minor=0,
                                  total_memory=DEVICE.total_memory, shared_memory_per_block_optin=DEVICE.smem_per_block)

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, dict(kwargs), tuple(grid) if not callable(grid) else grid, case[0]))

    saved = (torch.Tensor.device, torch.cuda.get_device_properties, triton_jit.JITFunction.run)
    torch.Tensor.device = property(lambda self: device)
    torch.cuda.get_device_properties = lambda *a, **k: props
    triton_jit.JITFunction.run = record
    try:
        yield
    finally:
        torch.Tensor.device, torch.cuda.get_device_properties, triton_jit.JITFunction.run = saved


MODES = {  # verify's sampling modes: temperature, top_k, top_p per request
    "greedy": (0.0, 0, 1.0), "temperature": (0.8, 0, 1.0), "top-k": (0.8, 50, 1.0), "top-p": (0.8, 0, 0.9),
}
# verify called without a temperature (every request greedy): the all-rows kernel, not the walk.
GREEDY_ROWS = "greedy-rows"
# verify with a temperature and no filters: the all-rows temperature kernel (verify_temperature.py).
TEMPERATURE_ROWS = "temperature-rows"


# The draft vocabulary of the sampled-draft verify cases (EAGLE-3's d2t over a larger target vocabulary).
DRAFT_VOCAB = 32000


def _verify_case(dtype, B, N, V, mode, drafts=False, coupled=False):
    """``drafts``: sampled children with their draft rows (draft_probs over DRAFT_VOCAB ids mapped by d2t
    when V is larger, a draft_sampled mask): the draft-aware specialisation. ``coupled``: with
    ``positions`` (coupled sampling: the race's specialisation of the kernel)."""
    from eagle_kernels.triton import verify as triton_verify

    tokens = torch.zeros(B, N, dtype=torch.int64)
    parents = (torch.arange(N, dtype=torch.int32) - 1).repeat(B, 1)  # a chain
    if mode == GREEDY_ROWS:  # no temperature: a greedy call, every row read at once (verify_greedy.py)
        triton_verify.verify(tokens, parents, torch.empty(B, N, V, dtype=dtype), max_depth=min(N - 1, 8))
        return
    if mode == TEMPERATURE_ROWS:  # a temperature and no filters: every row read at once (verify_temperature.py)
        triton_verify.verify(tokens, parents, torch.empty(B, N, V, dtype=dtype), max_depth=min(N - 1, 8),
                             temperature=torch.full((B,), 0.8), seed=torch.zeros(B, dtype=torch.int64),
                             offset=torch.zeros(B, dtype=torch.int64))
        return
    temperature, top_k, top_p = MODES[mode]
    sampling = dict(temperature=torch.full((B,), temperature), top_k=torch.full((B,), top_k, dtype=torch.int32),
                    top_p=torch.full((B,), top_p), seed=torch.zeros(B, dtype=torch.int64),
                    offset=torch.zeros(B, dtype=torch.int64))
    logits = torch.empty(B, N, V, dtype=dtype)
    if drafts:
        Vd = min(V, DRAFT_VOCAB)
        sampling.update(draft_probs=torch.full((B, N, Vd), 1.0 / Vd), draft_sampled=torch.ones(B, N, dtype=torch.bool),
                        d2t=torch.zeros(Vd, dtype=torch.int64) if Vd < V else None)
    if coupled:
        sampling["positions"] = torch.zeros(B, dtype=torch.int64)
    triton_verify.verify(tokens, parents, logits, max_depth=min(N - 1, 8), **sampling)


def _block_verify_case(dtype, B, N, V, mode, drafts=False, Vd=DRAFT_VOCAB):
    """block_verify of full chains; ``drafts``: draft rows over min(V, Vd) ids (mapped by d2t when fewer than V),
    else point-mass drafts."""
    from eagle_kernels.triton import block_verify as triton_block_verify

    temperature, top_k, top_p = MODES[mode]
    sampling = dict(temperature=torch.full((B,), temperature), top_k=torch.full((B,), top_k, dtype=torch.int32),
                    top_p=torch.full((B,), top_p), seed=torch.zeros(B, dtype=torch.int64),
                    offset=torch.zeros(B, dtype=torch.int64), num_drafts=torch.full((B,), N - 1, dtype=torch.int32))
    draft_probs = None
    if drafts:
        Vd = min(V, Vd)
        draft_probs = torch.full((B, N, Vd), 1.0 / Vd)
        sampling["d2t"] = torch.zeros(Vd, dtype=torch.int64) if Vd < V else None
    triton_block_verify.block_verify(torch.zeros(B, N, dtype=torch.int64), torch.empty(B, N, V, dtype=dtype),
                                     draft_probs, **sampling)


def _coupled_noise_case(B, W, n, d2t):
    from eagle_kernels.triton import coupled_noise as triton_coupled_noise

    triton_coupled_noise.coupled_noise(torch.zeros(B, dtype=torch.int64), torch.zeros(B, W, dtype=torch.int64), n,
                                       d2t=torch.zeros(n, dtype=torch.int64) if d2t else None)


def _coupled_draft_logits_case(dtype, B, M, n, d2t):
    from eagle_kernels.triton import coupled_draft_logits as triton_coupled_draft_logits

    positions = torch.zeros(B, 6, dtype=torch.int64)  # one depth's column, as the decoder passes it
    triton_coupled_draft_logits.coupled_draft_logits(torch.empty(B, M, n, dtype=dtype), torch.ones(B),
                                                     torch.zeros(B, dtype=torch.int64), positions[:, 1],
                                                     d2t=torch.zeros(n, dtype=torch.int64) if d2t else None)


def _tree_attention_case(dtype, B, N, Hq, Hkv, D, prefix, paged, tree_mask, page=64):
    from eagle_kernels.triton import tree_attention as triton_tree_attention

    cap = prefix + N
    q = torch.empty(B, N, Hq, D, dtype=dtype)
    seqlens = torch.full((B,), prefix, dtype=torch.int32)
    if paged:
        pages = triton.cdiv(cap, page)
        k = torch.empty(B * pages, page, Hkv, D, dtype=dtype)
        table = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
    else:
        k, table = torch.empty(B, cap, Hkv, D, dtype=dtype), None
    mask = torch.empty(B, N, triton.cdiv(N, 64), dtype=torch.int64) if tree_mask else None
    triton_tree_attention.tree_attention(q, k, torch.empty_like(k), seqlens, mask, block_table=table)


def _draft_expand_case(dtype, B, M, V, top_k, d2t, sampled=False):
    """``sampled``: a temperature per request, the sampled specialisation (Gumbel keys)."""
    from eagle_kernels.triton import draft_expand as triton_draft_expand

    logits = torch.empty(B, M, V, dtype=dtype)
    sampling = dict(temperature=torch.ones(B), seed=torch.zeros(B, dtype=torch.int64),
                    offset=torch.zeros(B, dtype=torch.int64), depth=1) if sampled else {}
    triton_draft_expand.draft_expand(logits, torch.zeros(B, M), top_k,
                                     d2t=torch.arange(V, dtype=torch.int64) if d2t else None, **sampling)


def _write_kv_case(dtype, B, N, Hkv, D, paged, page=64, cap=4096):
    from eagle_kernels.triton import write_kv as triton_write_kv

    new = torch.empty(B, N, Hkv, D, dtype=dtype)
    seqlens = torch.full((B,), cap - N, dtype=torch.int32)
    if paged:
        pages = cap // page
        cache = torch.empty(B * pages, page, Hkv, D, dtype=dtype)
        table = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
    else:
        cache, table = torch.empty(B, cap, Hkv, D, dtype=dtype), None
    triton_write_kv.write_kv(cache, torch.empty_like(cache), new, new, seqlens, block_table=table)


def _layer_cases(dtype, H, I, Hq, Hkv, D):
    """The GPU decoder layer's own kernels (rmsnorm, its EAGLE-3 two-input form, silu_mul,
    rope_write_kv, rmsnorm_linear for q/k/v, gate/up, and o and down with the residual added,
    o_proj_mlp and rmsnorm_qkv_rope, at a decoding pass's rows and a verify tree's) at one model's
    widths."""
    from eagle_kernels.models.layers import FUSED_NORM_MAX_MATRIX_BYTES
    from eagle_kernels.triton import o_proj_mlp as triton_o_proj_mlp
    from eagle_kernels.triton import rmsnorm as triton_rmsnorm
    from eagle_kernels.triton import rmsnorm_linear as triton_rmsnorm_linear
    from eagle_kernels.triton import rmsnorm_qkv_rope as triton_rmsnorm_qkv_rope
    from eagle_kernels.triton import rope_write_kv as triton_rope_write_kv
    from eagle_kernels.triton import silu_mul as triton_silu_mul

    x = torch.empty(2, 3, H, dtype=dtype)
    weight = torch.ones(H, dtype=dtype)
    triton_rmsnorm.rmsnorm(x, weight, 1e-5)
    triton_rmsnorm.rmsnorm(x, weight, 1e-5, embed=x, embed_weight=weight)
    triton_silu_mul.silu_mul(torch.empty(2, 3, 2 * I, dtype=dtype))
    for rows in (x, torch.empty(1, 61, H, dtype=dtype)):
        triton_rmsnorm_linear.rmsnorm_linear(rows, torch.empty((Hq + 2 * Hkv) * D, H, dtype=dtype), weight, 1e-5)
        triton_rmsnorm_linear.rmsnorm_linear(rows, torch.empty(2 * I, H, dtype=dtype), weight, 1e-5, gated=True)
        for K in (Hq * D, I):  # the o and down projections, the residual added
            triton_rmsnorm_linear.rmsnorm_linear(rows.new_empty(*rows.shape[:2], K), torch.empty(H, K, dtype=dtype),
                                                 None, 1e-5, add=rows)
        # o_proj_mlp: the three GEMMs after attention in one launch (their tiles rmsnorm_linear's), where the GPU
        # layer path takes it (matrices it folds: SmolLM2's, not Llama-3-8B's).
        if 2 * I * H * x.element_size() <= FUSED_NORM_MAX_MATRIX_BYTES:
            attention = rows.new_empty(*rows.shape[:2], Hq * D)
            triton_o_proj_mlp.o_proj_mlp(attention, rows, torch.empty(H, Hq * D, dtype=dtype), weight,
                                         torch.empty(2 * I, H, dtype=dtype), torch.empty(H, I, dtype=dtype), 1e-5)
    cos = torch.zeros(64, D // 2)
    cache = torch.zeros(2, 16, Hkv, D, dtype=dtype)
    triton_rope_write_kv.rope_write_kv(torch.empty(2, 3, (Hq + 2 * Hkv) * D, dtype=dtype),
                                       torch.zeros(2, 3, dtype=torch.int64), cos, cos, cache, cache.clone(),
                                       torch.tensor([1, 2], dtype=torch.int32), num_heads=Hq, slot_offset=2)
    for rows in (x, torch.empty(1, 61, H, dtype=dtype)):
        B, N = rows.shape[:2]
        kv = torch.zeros(B, 80, Hkv, D, dtype=dtype)
        triton_rmsnorm_qkv_rope.rmsnorm_qkv_rope(rows, torch.empty((Hq + 2 * Hkv) * D, H, dtype=dtype), weight, 1e-5,
                                                 torch.zeros(B, N, dtype=torch.int64), cos, cos, kv, kv.clone(),
                                                 torch.ones(B, dtype=torch.int32), num_heads=Hq, slot_offset=2)


def _q8_0_linear_case(dtype, K, N, rows, residual):
    """q8_0_linear at one matrix's shape: a draft pass's few rows (one block of 16) or a commit's."""
    from eagle_kernels.triton import q8_0_linear as triton_q8_0_linear

    x = torch.empty(rows, K, dtype=dtype)
    triton_q8_0_linear.q8_0_linear(x, torch.empty(N, K, dtype=torch.int8), torch.empty(N, K // 32, dtype=torch.float16),
                                   residual=torch.empty(rows, N, dtype=dtype) if residual else None)


def _fp8_linear_case(dtype, K, N, rows, residual):
    """fp8_linear at one matrix's shape and a draft pass's rows."""
    from eagle_kernels.triton import fp8_linear as triton_fp8_linear

    x = torch.empty(rows, K, dtype=dtype)
    triton_fp8_linear.fp8_linear(x, torch.empty(N, K, dtype=torch.float8_e4m3fn), torch.ones(N),
                                 residual=torch.empty(rows, N, dtype=dtype) if residual else None)


def _bookkeeping_cases(dtype, H, B=8, depth=6, k=8, P=7, V=1000):
    """The speculative step's bookkeeping kernels (eagle_kernels/triton/bookkeeping.py) at one
    model's hidden width, tree (6, 8, 60): every depth's expansion step (the root's, a
    frontier's, with the next head pass's inputs at step 1 and later, the last depth's without; with an
    EAGLE-3 layer's normed input too),
    a head pass's inputs alone, the commit's inputs (with EAGLE-3's three feature rows) and the
    commit (with the root's final norm), the target's first-layer token rows (a tree's, with
    positions, and a plain step's)."""
    from eagle_kernels.bookkeeping import DraftInputs
    from eagle_kernels.triton import bookkeeping

    i64 = dict(dtype=torch.int64)
    C = k + (depth - 1) * k * k
    history = (torch.empty(B, C, **i64), torch.empty(B, C), torch.empty(B, C, dtype=torch.int32))
    masks, seqlens = torch.zeros(B, depth * k, 1, **i64), torch.zeros(B, dtype=torch.int32)
    table = torch.empty(V, H, dtype=dtype)
    norm = (torch.ones(H, dtype=dtype), torch.ones(H, dtype=dtype), 1e-5)  # an EAGLE-3 layer's input norms
    for M, step, norms in ((1, 1, None), (k, 2, None), (k, None, None), (1, 1, norm), (k, 2, norm)):
        draft = None if step is None else DraftInputs(torch.empty(B, M, H, dtype=dtype), masks, seqlens, table, step,
                                                      norms)
        bookkeeping.expansion_step(torch.zeros(B, M * k, **i64), torch.empty(B, M * k),
                                   torch.zeros(B, k, dtype=torch.int32), torch.zeros(B, M, **i64), *history, k, k,
                                   draft)
    for step, norms in ((1, None), (2, None), (2, norm)):
        bookkeeping.draft_inputs(torch.empty(B, k, H, dtype=dtype), torch.zeros(B, k, **i64), masks, seqlens, step,
                                 torch.zeros(B, k, **i64), table, norms)
    nodes, tokens = torch.zeros(B, P, dtype=torch.int32), torch.zeros(B, P, **i64)
    bookkeeping.commit_inputs(nodes, tokens, seqlens, P, table, dtype,
                              [torch.empty(B, 64, H, dtype=dtype) for _ in range(3)])
    bookkeeping.gather_rows([torch.empty(B, 64, H, dtype=dtype) for _ in range(3)], tokens)
    out = torch.zeros(B, 256, **i64)
    counters = [torch.zeros(B, **i64) for _ in range(5)]  # out_len, steps, root, offset, limit
    for norm in (None, (torch.ones(H, dtype=dtype), 1e-5)):
        bookkeeping.commit(tokens, torch.zeros(B, dtype=torch.int32), torch.zeros(B, dtype=torch.bool), out,
                           *counters[:4], counters[4], torch.full((B, 1), -1, **i64), None, None, seqlens,
                           seqlens.clone(), torch.empty(B, P, H, dtype=dtype), torch.empty(B, H, dtype=dtype), norm,
                           torch.empty(B, H, dtype=dtype))
    for N, depths in ((60, torch.zeros(B, 60, dtype=torch.int32)), (1, None)):
        bookkeeping.token_rows(torch.zeros(B, N, **i64), table, torch.ones(H, dtype=dtype), 1e-5, seqlens, depths)


# (name, hidden, intermediate, Hq, Hkv, head_dim) of the models the GPU layer path is audited at.
LAYER_SHAPES = [("SmolLM2-135M", 576, 1536, 9, 3, 64), ("Llama-3-8B", 4096, 14336, 32, 8, 128)]


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


# The ci grid: the 128-row (B 1, split) and 64-row (B 8) 16-bit head_dim-128 launches in
# every cache layout, one fp32 and one head_dim-64 layout, verify from bf16 and fp32 logits
# in every mode, draft_expand at both vocabularies, write_kv paged.
CI_TREE = [("bf16", B, 64, 32, 8, 128, 4096, paged, mask) for B in (1, 8) for paged in (False, True)
           for mask in (True, False)] + [("fp32", 8, 64, 32, 8, 64, 4096, False, False),
                                         ("bf16", 8, 64, 32, 8, 64, 4096, True, True)] + [
    # SmolLM2-135M heads: a decoded token and a 61-node tree over a split prefix, whose splits
    # merge in their last programs (folds_merge; at 4k in 32-row blocks of 2 warps that fold, _folding_config).
    ("bf16", 1, 1, 9, 3, 64, 4096, False, False), ("bf16", 1, 61, 9, 3, 64, 2048, False, True),
    ("bf16", 1, 61, 9, 3, 64, 4096, False, True)]


def cases(grid: str) -> Iterator[tuple[str, Callable[[], None]]]:
    """(name, call) of every launcher call of ``grid``."""
    full = grid == "full"
    if full:  # Llama-3-8B heads (Hq 32 / Hkv 8) and plain MHA, every cache layout
        tree = [(dt, B, N, Hq, Hkv, D, prefix, paged, mask) for dt in ("bf16", "fp16", "fp32") for D in (64, 128)
                for paged in (False, True) for mask in (True, False)
                for B, N in ((1, 1), (1, 16), (1, 64), (8, 64), (32, 64), (1, 256), (4, 256))
                for Hq, Hkv in ((32, 8), (8, 8)) for prefix in (4096, 16384)]
    else:
        tree = CI_TREE
    for dt, B, N, Hq, Hkv, D, prefix, paged, mask in tree:
        name = (f"tree_attention {dt} B{B} N{N} Hq{Hq}/Hkv{Hkv} D{D} prefix{prefix} "
                f"{'paged' if paged else 'contiguous'} {'tree-mask' if mask else 'causal'}")
        yield name, (lambda a=(DTYPES[dt], B, N, Hq, Hkv, D, prefix, paged, mask): _tree_attention_case(*a))
    # verify: every mode; the row count sets the chunk count of the max pass, and at batch 1 its tile
    # (verify._chunking): 1024-entry tiles, one a chunk at 49,152 entries (SmolLM2), two at 128,256.
    if not full:
        for V in (49152, 128256):
            for mode in ("greedy", GREEDY_ROWS, TEMPERATURE_ROWS):
                yield f"verify bf16 B1 N61 V{V} {mode}", lambda V=V, m=mode: _verify_case(torch.bfloat16, 1, 61, V, m)
        for mode in (GREEDY_ROWS, TEMPERATURE_ROWS):
            yield f"verify fp64 B8 N64 V32000 {mode}", lambda m=mode: _verify_case(torch.float64, 8, 64, 32000, m)
    shapes = [(1, 1), (1, 8), (1, 64), (8, 64), (32, 64), (1, 256), (8, 256)] if full else [(8, 64)]
    for dt in ("bf16", "fp16", "fp32", "fp64") if full else ("bf16", "fp32"):
        for V in (32000, 128256) if full else (128256,):
            for B, N in shapes:
                for mode in [*MODES, GREEDY_ROWS, TEMPERATURE_ROWS]:
                    yield (f"verify {dt} B{B} N{N} V{V} {mode}",
                           lambda a=(DTYPES[dt], B, N, V, mode): _verify_case(*a))
                # Coupled sampling: the kernel with the race (HAS_POSITIONS).
                for mode in [m for m in MODES if m != "greedy"] if full else ["top-p"]:
                    yield (f"verify {dt} B{B} N{N} V{V} {mode} coupled",
                           lambda a=(DTYPES[dt], B, N, V, mode, False, True): _verify_case(*a))
                # Sampled drafts (the draft-aware rule): greedy rows never read the drafts.
                for mode in [m for m in MODES if m != "greedy"] if full else ["temperature", "top-p"]:
                    yield (f"verify {dt} B{B} N{N} V{V} {mode} sampled-drafts",
                           lambda a=(DTYPES[dt], B, N, V, mode, True): _verify_case(*a))
    # block_verify: five launches (four over a row's chunks, one per request), its modes runtime branches of one
    # specialisation per logits dtype and draft kind (point masses, rows mapped by d2t, full-vocabulary rows); ci: bf16
    # at both vocabularies of the verify cases above (the same 2048-entry tiles: one compile each), point-mass and d2t
    # drafts.
    for dt in ("bf16", "fp16", "fp32", "fp64") if full else ("bf16",):
        for V in (32000, 49152, 128256) if full else (49152, 128256):
            for drafts in (False, True):
                yield (f"block_verify {dt} B8 N8 V{V} top-p {'sampled-drafts' if drafts else 'point-mass'}",
                       lambda a=(DTYPES[dt], 8, 8, V, "top-p", drafts): _block_verify_case(*a))
    # draft_expand, ci: bf16 B 8 top_k 8 at both vocabularies, sampled or not; the sampled launch whose
    # temperature-0 merge once took it to 168 registers and spills (V 32000, B 32, top_k 10); and top_k 40, past
    # the filter (the plain rounds alone), which once did not compile at all.
    for dt in ("bf16", "fp16", "fp32") if full else ("bf16",):
        for V in (32000, 128256):
            for B, M, k in [(1, 1, 8), (8, 8, 8), (32, 8, 10), (1, 4, 40)] if full else [(8, 8, 8)]:
                for d2t in (False, True) if full else (False,):
                    for sampled in (False, True):
                        yield (f"draft_expand {dt} B{B} M{M} V{V} top_k{k}{' d2t' if d2t else ''}"
                               f"{' sampled' if sampled else ''}",
                               lambda a=(DTYPES[dt], B, M, V, k, d2t, sampled): _draft_expand_case(*a))
    if not full:
        yield ("draft_expand bf16 B32 M8 V32000 top_k10 sampled",
               lambda: _draft_expand_case(torch.bfloat16, 32, 8, 32000, 10, False, True))
        for sampled in (False, True):
            yield (f"draft_expand bf16 B1 M4 V32000 top_k40{' sampled' if sampled else ''}",
                   lambda a=(torch.bfloat16, 1, 4, 32000, 40, False, sampled): _draft_expand_case(*a))
    for B, W, n, d2t in [(1, 6, 32000, True), (8, 6, 128256, False)] if full else [(8, 6, 32000, True)]:
        yield (f"coupled_noise B{B} W{W} n{n}{' d2t' if d2t else ''}",
               lambda a=(B, W, n, d2t): _coupled_noise_case(*a))
    for dt in ("bf16", "fp16", "fp32") if full else ("bf16",):
        for B, M, n, d2t in [(1, 1, 8192, True), (8, 8, 32000, True), (8, 8, 128256, False)] if full \
                else [(8, 8, 8192, True)]:
            yield (f"coupled_draft_logits {dt} B{B} M{M} n{n}{' d2t' if d2t else ''}",
                   lambda a=(DTYPES[dt], B, M, n, d2t): _coupled_draft_logits_case(*a))
    for dt in ("bf16", "fp16", "fp32") if full else ("bf16",):
        for D in (64, 128) if full else (128,):
            for paged in (False, True) if full else (True,):
                yield (f"write_kv {dt} B8 N64 Hkv8 D{D} {'paged' if paged else 'contiguous'}",
                       lambda a=(DTYPES[dt], 8, 64, 8, D, paged): _write_kv_case(*a))
    for dt in ("bf16", "fp16", "fp32") if full else ("bf16", "fp32"):
        for model, *widths in LAYER_SHAPES if full or dt == "bf16" else LAYER_SHAPES[:1]:
            yield f"layer kernels {dt} {model}", lambda a=(DTYPES[dt], *widths): _layer_cases(*a)
    # q8_0_linear and fp8_linear: a Llama-3-8B EAGLE-3 head's qkv (K 2 x 4096) and down (into the residual) at a
    # draft pass's rows; and a SmolLM2-sized head's gate/up (K 640 for fp8's 128-k blocks), small enough that a PDL
    # launch prefetches its weights. fp8_linear rounds the rows in a launch of their own where its GEMM has several
    # column programs (these), in the GEMM's program where it has one.
    for dt in ("bf16", "fp16", "fp32") if full else ("bf16", "fp32"):
        for K, N, residual in ((8192, 6144, False), (14336, 4096, True)) + (((640, 3072, False),) if dt == "bf16"
                                                                            else ()):
            yield (f"q8_0_linear {dt} rows8 K{K} N{N}{' residual' if residual else ''}",
                   lambda a=(DTYPES[dt], K, N, 8, residual): _q8_0_linear_case(*a))
            yield (f"fp8_linear {dt} rows8 K{K} N{N}{' residual' if residual else ''}",
                   lambda a=(DTYPES[dt], K, N, 8, residual): _fp8_linear_case(*a))
        # One column program (N 32): the activations rounded in the GEMM's program, no rounding launch.
        yield (f"fp8_linear {dt} rows8 K4096 N32", lambda a=(DTYPES[dt], 4096, 32, 8, False): _fp8_linear_case(*a))
    for model, H, *_ in LAYER_SHAPES if full else LAYER_SHAPES[:1]:  # H is a runtime size: the same code
        yield f"step bookkeeping bf16 {model}", lambda a=(torch.bfloat16, H): _bookkeeping_cases(*a)


def record(grid: str) -> list[Launch]:
    launches: list[Launch] = []
    case = [""]
    with modeled_gpu(launches, case):
        for name, call in cases(grid):
            case[0] = name
            call()
    return launches


# --------------------------------------------------------------------------------------------
# Specialisation: the JIT's own binder.


def _run_kwargs(kernel, kwargs: dict) -> dict:
    """The options JITFunction.run adds before binding (debug, instrumentation, ...)."""
    knobs = triton.knobs
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    return kwargs


def specialise(launch: Launch, target: GPUTarget):
    """(options, signature, constexprs, attrs) of a launch, as JITFunction.run derives them."""
    backend = make_backend(target)
    kernel = launch.kernel
    kwargs = _run_kwargs(kernel, launch.kwargs)
    binder = triton_jit.create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound_args, specialization, options)


def specialisation_key(launch: Launch, target: GPUTarget) -> str:
    options, signature, constexprs, attrs = specialise(launch, target)
    return json.dumps([launch.kernel.fn.__name__, signature, {str(k): str(v) for k, v in constexprs.items()},
                       {str(k): v for k, v in attrs.items()}, _options_text(options)], sort_keys=True)


def _options_text(options) -> dict:
    return {k: getattr(options, k) for k in ("num_warps", "num_stages", "num_ctas", "maxnreg") if hasattr(options, k)}


# --------------------------------------------------------------------------------------------
# Compilation and what the cubin says.


@dataclasses.dataclass
class Loop:
    start: int  # byte offsets in the SASS
    end: int
    instructions: int
    innermost: bool
    local_memory: int  # LDL/STL instructions inside


@dataclasses.dataclass
class Audit:
    kernel: str
    cases: list[str]
    grid: list
    constexprs: dict
    specialised: dict  # argument -> "tt.divisibility=16" or "==1"
    num_warps: int
    num_stages: int
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    shared_dynamic: int
    shared_static: int
    blocks_per_sm: int
    limiter: str
    sass_instructions: int
    loops: list[Loop]
    hot_loop_instructions: int
    pdl: str = "off"  # launched with PDL: "waits first" or what comes before the wait (pdl_order)
    sass: str = dataclasses.field(default="", repr=False)

    @property
    def threads(self) -> int:
        return self.num_warps * H200.warp

    @property
    def fits(self) -> bool:
        return self.shared_dynamic <= H200.smem_per_block and self.registers <= H200.max_regs_per_thread

    @property
    def spills_in_loop(self) -> bool:
        return any(loop.local_memory for loop in self.loops)

    def row(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("sass")
        d["fits"] = self.fits
        d["spills_in_loop"] = self.spills_in_loop
        return d


def occupancy(registers: int, num_warps: int, shared: int) -> tuple[int, str]:
    """Resident blocks per SM on an H200 and the resource that limits them; 0 when a block
    cannot launch at all."""
    if shared > H200.smem_per_block or registers > H200.max_regs_per_thread:
        return 0, "shared memory" if shared > H200.smem_per_block else "registers"
    regs_per_warp = math.ceil(max(registers, 1) * H200.warp / H200.reg_alloc_unit) * H200.reg_alloc_unit
    limits = {
        "registers": (H200.regs_per_sm // regs_per_warp) // num_warps,
        "threads": H200.max_threads_per_sm // (num_warps * H200.warp),
        "shared memory": H200.smem_per_sm // max(shared, 1),
        "blocks": H200.max_blocks_per_sm,
    }
    limiter = min(limits, key=lambda k: limits[k])
    return limits[limiter], limiter


def _tool(name: str) -> str:
    path = os.path.join(NVIDIA_BIN, name)
    return path if os.path.exists(path) else name


def _control(text: str) -> tuple[str, bool, str | None]:
    """(opcode, conditional, target label) of one SASS instruction (its text without the ';').
    conditional: the instruction may fall through to the next one as well as take its effect:
    a guard predicate other than PT (``@P0``, ``@!UP1``), a predicate operand (``BRA.U !UP0, ...``)
    or a convergence-dependent branch (``BRA.DIV``: taken only when the warp is not converged;
    ``BRA.CONV``)."""
    guard = GUARD.match(text)
    rest = text[guard.end():] if guard else text
    opcode = rest.split(None, 1)[0] if rest.strip() else ""
    if guard and guard.group(1) == "!PT":
        return opcode, True, None  # never taken
    conditional = bool(guard) and guard.group(1) != "PT"
    operands = rest[len(opcode):]
    target = TARGET.search(operands)
    if opcode.startswith("BRA") and (".DIV" in opcode or ".CONV" in opcode
                                     or PREDICATE_OPERAND.search(operands.split("`")[0])):
        conditional = True
    return opcode, conditional, target.group(1) if target else None


def sass_cfg(sass: str) -> tuple[list[tuple[int, str]], list[list[int]], list[set[int]], set[tuple[int, int]]]:
    """Control-flow graph of a disassembly: (instructions as (offset, text), basic blocks as lists
    of instruction indices, successors of each block (block indices), the ``BRA.DIV`` edges as
    (block, successor)).

    Blocks start at a label (nvdisasm labels only branch targets) and after any control
    instruction. Edges: ``BRA`` (any form) to its target, and to the next instruction when it
    is conditional (see ``_control``); ``EXIT``, ``RET`` and ``BPT.TRAP`` end a path unless
    predicated; ``CALL`` goes to its target (when it names one) and returns to the next
    instruction; ``BRX``/``JMX`` (indirect) have unknown targets and are taken as ending the
    path (no loop is invented through them); ``BSSY``/``BSYNC``/``WARPSYNC``/``BREAK`` fall
    through (``BSSY``'s label is a reconvergence point, not a jump). A ``BRA.DIV`` edge leads to
    out-of-line code for a non-converged warp."""
    labels, instructions, pending = {}, [], []
    for line in sass.splitlines():
        if m := LABEL.match(line):
            pending.append(m.group(1))
        elif m := INSTRUCTION.match(line):
            for label in pending:
                labels[label] = len(instructions)
            pending = []
            instructions.append((int(m.group(1), 16), m.group(2).strip()))
    controls = [_control(text) for _, text in instructions]
    leaders = {0} | set(labels.values())
    for i, (opcode, _, _) in enumerate(controls):
        if opcode.split(".")[0] in ENDS_BLOCK:
            leaders.add(i + 1)
    leaders = sorted(leader for leader in leaders if leader < len(instructions))
    blocks = [list(range(a, b)) for a, b in zip(leaders, leaders[1:] + [len(instructions)])]
    block_of = {leader: b for b, leader in enumerate(leaders)}
    successors, divergent_edges = [set() for _ in blocks], set()
    for b, block in enumerate(blocks):
        opcode, conditional, target = controls[block[-1]]
        base = opcode.split(".")[0]
        fall = b + 1 if b + 1 < len(blocks) else None
        if base in ("BRA", "CALL") and target in labels:
            successors[b].add(block_of[labels[target]])
            if ".DIV" in opcode:
                divergent_edges.add((b, block_of[labels[target]]))
        falls = base not in ENDS_BLOCK or conditional or base == "CALL"
        if base == "BRA" and target not in labels:
            falls = True  # a branch we cannot resolve: keep the straight path
        if falls and fall is not None:
            successors[b].add(fall)
    return instructions, blocks, successors, divergent_edges


def _reachable(successors: list[set[int]], skip: set[tuple[int, int]] = frozenset()) -> set[int]:
    seen, stack = {0}, [0]
    while stack:
        b = stack.pop()
        for s in successors[b]:
            if s not in seen and (b, s) not in skip:
                seen.add(s)
                stack.append(s)
    return seen


def predecessors_of(successors: list[set[int]]) -> dict[int, list[int]]:
    """Predecessors of each block reachable from the entry (block 0), among those blocks."""
    reachable = _reachable(successors)
    return {b: [p for p in reachable if b in successors[p]] for b in reachable}


def dominators(predecessors: dict[int, list[int]]) -> dict[int, set[int]]:
    """Dominator sets of the reachable blocks (``predecessors_of``: its keys)."""
    reachable = set(predecessors)
    order = sorted(reachable)
    dom = {b: set(reachable) for b in reachable}
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in order[1:]:
            new = set.intersection(*(dom[p] for p in predecessors[b])) | {b}
            if new != dom[b]:
                dom[b], changed = new, True
    return dom


def sass_loops(sass: str) -> tuple[int, list[Loop]]:
    """(instruction count, loops) of a disassembly. A loop is a natural loop of the control-flow
    graph (``sass_cfg``): a back edge is an edge whose target (the header) dominates its source;
    its loop is the header and every block that reaches the edge's source without passing the
    header. Back edges to one header with different bodies are different loops (a spin-wait at
    the head of an outer loop is its own, inner loop: the same control flow as a ``continue``).
    A backward jump whose target does not dominate it is no loop: ptxas places the code a
    ``BRA.DIV`` (non-converged warp) jumps to after ``EXIT`` and branches back into the body from
    there. A loop's ``instructions`` count its blocks other than such out-of-line divergence code
    (blocks only a ``BRA.DIV`` edge reaches) and ``start``/``end`` are the first and last of those
    (a loop with a ``continue`` path need not be contiguous in between); ``local_memory`` counts
    LDL/STL in all its blocks. Unreachable code (the ``BRA``-to-self trailer after the last
    ``EXIT``) is no loop; innermost: no other loop's blocks are a proper subset of its blocks."""
    instructions, blocks, successors, div_edges = sass_cfg(sass)
    if not instructions:
        return 0, []
    predecessors = predecessors_of(successors)
    dom = dominators(predecessors)
    converged = _reachable(successors, div_edges)
    bodies: list[tuple[int, frozenset[int]]] = []  # (header, body) of each back edge, distinct
    for source in sorted(dom):
        for header in sorted(successors[source]):
            if header in dom and header in dom[source]:
                body, stack = {header, source}, [source] if source != header else []
                while stack:
                    for p in predecessors[stack.pop()]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                if (header, frozenset(body)) not in bodies:
                    bodies.append((header, frozenset(body)))
    loops = []
    for header, body in bodies:
        # A loop wholly inside divergence code keeps all its blocks.
        inline = [i for b in sorted(body) if b in converged or header not in converged for i in blocks[b]]
        offsets = [instructions[i][0] for i in inline]
        inner = not any(other < body for _, other in bodies)
        local = sum(1 for b in body for i in blocks[b] if LOCAL_MEMORY.match(instructions[i][1]))
        loops.append(Loop(min(offsets), max(offsets), len(inline), inner, local))
    loops.sort(key=lambda loop: (loop.end, loop.start))
    return len(instructions), loops


def pdl_order(sass: str) -> str:
    """Where a PDL kernel's wait stands: "waits first" when every global memory instruction that
    moves data (loads, stores, atomics; L2 prefetches, which return nothing, excepted) lies in a
    block dominated by a block holding an unguarded ``griddepcontrol.wait`` (ACQBULK), after it
    where it is the same block, so no access can race with the kernel before; else the first
    offending instruction ("LDG.E before the wait"), or "no wait"."""
    instructions, blocks, successors, _ = sass_cfg(sass)
    predecessors = predecessors_of(successors) if instructions else {}
    dom = dominators(predecessors) if predecessors else {}
    waits = {}  # block -> index of its first unguarded wait
    for b, block in enumerate(blocks):
        for i in block:
            if instructions[i][1].split(None, 1)[0].split(".")[0] == PDL_WAIT:
                waits.setdefault(b, i)
    if not waits:
        return "no wait"
    for b, block in enumerate(blocks):
        if b not in dom:
            continue  # unreachable (the trailer after the last EXIT)
        for i in block:
            opcode = _control(instructions[i][1])[0]
            if opcode.split(".")[0] not in GLOBAL_MEMORY or opcode.split(".")[0] in PREFETCHES:
                continue
            if not any(w in dom[b] and (w != b or waits[w] < i) for w in waits):
                return f"{opcode} before the wait"
    return "waits first"


def compile_specialised(launch: Launch, target: GPUTarget):
    """(compiled kernel, ptxas -v log, (signature, constexprs, attrs)) of a launch compiled as the
    JIT would compile it."""
    options, signature, constexprs, attrs = specialise(launch, target)
    compiled, log = _compile_with_ptxas_log(ASTSource(launch.kernel, signature, constexprs, attrs), target, options)
    return compiled, log, (signature, constexprs, attrs)


def ptxas_spills(log: str) -> tuple[int, int, int] | None:
    """(stack frame, spill stores, spill loads) in bytes from a ptxas -v log; the cubin's LOCAL
    resource field is not the spill figure (it reads 0 for kernels that spill)."""
    found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return tuple(int(g) for g in found.groups()) if found else None


def compile_launch(launch: Launch, target: GPUTarget) -> Audit:
    kernel = launch.kernel
    compiled, log, (signature, constexprs, attrs) = compile_specialised(launch, target)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", "-gi", cubin], capture_output=True, text=True,
                              check=True).stdout
    resources = {key: int(value) for key, value in re.findall(r"(REG|LOCAL|SHARED|STACK):(\d+)", usage)}
    spills = ptxas_spills(log)
    registers_v = re.search(r"Used (\d+) registers", log)
    if not spills or not registers_v or int(registers_v.group(1)) != resources["REG"]:
        raise RuntimeError(f"{kernel.fn.__name__}: no ptxas -v log matching the cubin ({log[-500:]!r})")
    shared = compiled.metadata.shared
    num_warps = compiled.metadata.num_warps
    blocks, limiter = occupancy(resources["REG"], num_warps, shared + resources["SHARED"])
    count, loops = sass_loops(sass)
    inner = [loop for loop in loops if loop.innermost]
    names = list(signature)
    specialised = {}
    for path, value in attrs.items():
        for attr, v in value:
            specialised[names[path[0]]] = f"{attr}={v}"
    declared = {param.name for param in kernel.params if param.is_constexpr}
    for path, value in constexprs.items():
        if names[path[0]] not in declared:  # an integer argument equal to 1
            specialised[names[path[0]]] = f"=={value}"
    return Audit(
        kernel=kernel.fn.__name__, cases=[launch.case], grid=list(launch.grid) if not callable(launch.grid) else [],
        constexprs={names[p[0]]: str(v) for p, v in constexprs.items() if names[p[0]] in declared},
        specialised=specialised, num_warps=num_warps, num_stages=compiled.metadata.num_stages,
        registers=resources["REG"], stack_bytes=spills[0], spill_stores=spills[1], spill_loads=spills[2],
        shared_dynamic=shared, shared_static=resources["SHARED"], blocks_per_sm=blocks, limiter=limiter,
        sass_instructions=count, loops=loops,
        hot_loop_instructions=max((loop.instructions for loop in inner), default=0),
        pdl=pdl_order(sass) if launch.kwargs.get("launch_pdl") else "off", sass=sass,
    )


def _compile_with_ptxas_log(source, target, options):
    """triton.compile, always compiling (not from Triton's cache) with the log of the ptxas run
    Triton makes ("ptxas -v": registers, stack frame, spill stores and loads)."""
    knobs = triton.knobs
    saved = (knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile)
    knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            compiled = triton.compile(source, target=target, options=options.__dict__)
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
    return compiled, out.getvalue()


# The distinct launches of an audit and its target, read by the forked compile workers (audit(jobs > 1)).
_TO_COMPILE: list = []


def _compile_one(index: int) -> Audit:
    launch, target = _TO_COMPILE[index]
    try:
        return compile_launch(launch, target)
    except Exception as error:  # a compile error is a finding: report it with its launch
        raise RuntimeError(f"{launch.kernel.fn.__name__} ({launch.case}) does not compile: {error}") from error


def audit(grid: str = "ci", arch: int = 90, progress: bool = False, jobs: int = 1) -> list[Audit]:
    """Compile every distinct specialisation the launchers make over ``grid``; ``jobs`` > 1 compiles them in that
    many forked processes (each compile is one thread: Triton's passes, then ptxas), the results in the same order."""
    target = GPUTarget("cuda", arch, 32)
    firsts: dict[str, Launch] = {}
    cases: dict[str, list[str]] = {}
    for launch in record(grid):
        key = specialisation_key(launch, target)
        firsts.setdefault(key, launch)
        cases.setdefault(key, []).append(launch.case)
    _TO_COMPILE[:] = [(launch, target) for launch in firsts.values()]
    try:
        if jobs > 1:
            import concurrent.futures
            import multiprocessing

            with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
                results = list(pool.map(_compile_one, range(len(_TO_COMPILE))))
        else:
            results = [_compile_one(i) for i in range(len(_TO_COMPILE))]
    finally:
        _TO_COMPILE.clear()
    for r, key in zip(results, firsts):
        r.cases = cases[key]
        if progress:
            print(f"  {r.kernel} {r.registers} regs {r.shared_dynamic} B smem ({r.cases[0]})", file=sys.stderr)
    return results


def markdown(rows: list[dict]) -> str:
    """One table row per compiled configuration (rows: Audit.row() dicts); of the constexprs,
    those that differ between configurations of a kernel."""
    varying = {}
    for r in rows:
        for k, v in r["constexprs"].items():
            varying.setdefault(r["kernel"], {}).setdefault(k, set()).add(v)
    lines = ["| kernel | constexprs | warps/stages | regs | spill st/ld (B) | smem dyn+static (B) | blocks/SM "
             "(limit) | SASS | innermost loops (instr) | first case (+more) |",
             "|---|---|---|---:|---:|---:|---|---:|---|---|"]
    for r in sorted(rows, key=lambda r: (r["kernel"], r["cases"][0])):
        const = " ".join(f"{k}={v}" for k, v in r["constexprs"].items() if len(varying[r["kernel"]][k]) > 1)
        loops = " ".join(f"{loop['instructions']}{'+LDL/STL' if loop['local_memory'] else ''}" for loop in r["loops"]
                         if loop["innermost"]) or "-"
        flag = " **over**" if r["shared_dynamic"] > H200.smem_per_block else ""
        lines.append(f"| {r['kernel']} | {const or '-'} | {r['num_warps']}/{r['num_stages']} | {r['registers']} | "
                     f"{r['spill_stores']}/{r['spill_loads']} | {r['shared_dynamic']}+{r['shared_static']}{flag} | "
                     f"{r['blocks_per_sm']} ({r['limiter']}) | {r['sass_instructions']} | {loops} | {r['cases'][0]} "
                     f"(+{len(r['cases']) - 1}) |")
    return "\n".join(lines)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: interpreted kernels cannot be compiled")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", choices=("ci", "full"), default="ci")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--json", action="store_true", help="one JSON line per configuration")
    parser.add_argument("--from-json", help="print the table of a --json output instead of compiling")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes (default 1)")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            print(markdown([json.loads(line) for line in f if line.startswith("{")]))
        return
    results = audit(args.grid, args.arch, progress=not args.json, jobs=args.jobs)
    if args.json:
        for r in results:
            print(json.dumps(r.row()), flush=True)
    else:
        print(f"triton {triton.__version__}, torch {torch.__version__}, sm_{args.arch}, {args.grid} grid: "
              f"{len(results)} configurations")
        print(markdown([r.row() for r in results]))
        pdl = collections.Counter(r.pdl for r in results)
        print(f"\nprogrammatic dependent launch: {', '.join(f'{n} {k}' for k, n in sorted(pdl.items()))}")
        bad = [r for r in results if not r.fits or r.spills_in_loop or r.pdl not in ("off", "waits first")]
        for r in bad:
            print(f"FAIL {r.kernel}: smem {r.shared_dynamic} B (limit {H200.smem_per_block}), "
                  f"spill instructions in loops {sum(loop.local_memory for loop in r.loops)}, PDL {r.pdl}; "
                  f"{r.cases[0]}")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
