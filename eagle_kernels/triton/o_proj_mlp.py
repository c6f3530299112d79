"""Triton o_proj_mlp (docs/ops.md §22): a decoder layer after its attention in one launch, its
programs handing three GEMM phases to each other.

Where a layer's matrices are small (SmolLM2-135M: 0.7-3.5 MB), the o projection, the gate/up
GEMM with SwiGLU and the down projection are three launches of about the floor of a replayed
graph node each (about 3.4 us on an H200, docs/gpu_model.md), longer than their GEMMs. Here they
are the three phases of one launch:

- **items.** Every output tile of every phase is an item: phase 0 the (row block, column block)
  tiles of ``mid = residual + attention @ o.T``, phase 1 those of ``act = silu(gate) * up`` over
  ``norm(mid)``, phase 2 those of ``out = mid + act @ down.T``, numbered phase by phase. A
  program takes items from one counter (``atomic_add``) until none is left, so an item is only
  ever held by a program that is running.
- **hand-offs.** A tile of phase 1 needs its row block's whole ``mid`` (the norm reads the full
  rows), a tile of phase 2 its row block's whole ``act``: before computing one, its program waits
  (polling with acquire) until the row block's count of finished tiles of the phase before is
  complete. Each finished tile adds one to that count with release semantics after a barrier
  (every thread's stores issued). Every item a waiter waits for was taken before its own, by a
  program that is running, and the first phase waits for nothing: the launch cannot deadlock,
  however many of its programs are resident. Interpreted (one program at a time) the first
  program takes every item in order and never waits.
- **each tile** is ``rmsnorm_linear``'s (``_linear_tile``: the same loads, MMAs and rounding), so
  the op's results equal the three ``rmsnorm_linear`` calls' bit for bit.
- **control words** (the counter, the exit count, the two phases' counts per row block) are the
  device's ticket counters (``_launch_config.tickets``), zero between launches: the last program
  to exit zeroes them, so a CUDA graph replays the launch alone.

With programmatic dependent launch each program first prefetches into L2 the weight rows of the
first-row-block items ``pid, pid + P, ...``, so all three matrices stream in during the wait.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import _layer_checks
from ._launch_config import dot_mode, gpu_sms, interpreted, tickets
from ._pdl import launch_options, wait_for_prior_grids
from .rmsnorm_linear import _linear_tile, _prefetch_rows, column_block, gemm_inputs, tile


@dataclasses.dataclass(frozen=True)
class OProjMlpConfig:
    block_m: int  # the largest row block; fewer rows take the next power of two >= 16
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    programs: int | None  # at most this many programs; None: one per SM


GPU_CONFIG = OProjMlpConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, programs=None)
# Three programs: the first takes every item, the other two find none left (the late programs' path).
INTERPRETER_CONFIG = OProjMlpConfig(block_m=64, block_n=128, block_k=128, num_warps=1, num_stages=1, programs=3)

# Control words in the ticket buffer: the item counter, the exit count, then per row block the
# finished o tiles and the finished gate/up tiles.
CTL_CLAIM = tl.constexpr(0)
CTL_EXITED = tl.constexpr(1)
CTL_DONE = tl.constexpr(2)


@triton.jit
def _wait_for(count_ptr, target):
    """Poll ``count_ptr`` (acquire) until it reaches ``target``."""
    seen = tl.atomic_add(count_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _finished(count_ptr):
    """Every thread's stores of the tile issued, then one release add to the row block's count."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release")


@triton.jit
def _o_proj_mlp_kernel(
    attn_ptr,  # [M, Ka] rows, row stride stride_am, unit column stride
    residual_ptr,  # [M, H] dense
    o_ptr,  # [H, Ka] dense
    norm_ptr,  # [H]
    gate_up_ptr,  # [2I, H] dense: gate rows, then up rows
    down_ptr,  # [H, I] dense
    mid_ptr,  # [M, H] dense scratch: residual + attention @ o.T, rounded (phase 0)
    act_ptr,  # [M, I] dense scratch: silu(gate) * up over norm(mid), rounded (phase 1)
    out_ptr,  # [M, H] dense: mid + act @ down.T, rounded (phase 2)
    ctl_ptr,  # [CTL_DONE + 2 * row blocks] int32, zero between launches
    M, H, Ka, I, stride_am, eps,
    BLOCK_M: tl.constexpr, BLOCK_N_O: tl.constexpr, BLOCK_N_G: tl.constexpr, BLOCK_N_D: tl.constexpr,
    BLOCK_K_O: tl.constexpr, BLOCK_K_G: tl.constexpr, BLOCK_K_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
    PREFETCH: tl.constexpr = False,  # the first row block's weight rows of items pid, pid + P, ... into L2
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    row_blocks = tl.cdiv(M, BLOCK_M)
    tiles_o = tl.cdiv(H, BLOCK_N_O)
    tiles_g = tl.cdiv(I, BLOCK_N_G)
    tiles_d = tl.cdiv(H, BLOCK_N_D)
    if PREFETCH:
        for j in range(pid, tiles_o + tiles_g + tiles_d, programs):
            if j < tiles_o:
                _prefetch_rows(o_ptr, j, H, Ka, False, BLOCK_N_O)
            elif j < tiles_o + tiles_g:
                _prefetch_rows(gate_up_ptr, j - tiles_o, I, H, True, BLOCK_N_G)
            else:
                _prefetch_rows(down_ptr, j - tiles_o - tiles_g, H, I, False, BLOCK_N_D)
    wait_for_prior_grids(USE_PDL)
    items_o = row_blocks * tiles_o
    items_g = row_blocks * tiles_g
    total = items_o + items_g + row_blocks * tiles_d
    done_o = ctl_ptr + CTL_DONE
    done_g = done_o + row_blocks
    item = tl.atomic_add(ctl_ptr + CTL_CLAIM, 1)
    while item < total:
        if item < items_o:  # mid = residual + attention @ o.T
            m = item // tiles_o
            _linear_tile(attn_ptr, norm_ptr, o_ptr, mid_ptr, mid_ptr, residual_ptr, M, H, Ka, stride_am, eps, m,
                         item % tiles_o, False, False, True, False, BLOCK_M, BLOCK_N_O, BLOCK_K_O, UPCAST,
                         DOT_PRECISION)
            _finished(done_o + m)
        elif item < items_o + items_g:  # act = silu(gate) * up over norm(mid)
            j = item - items_o
            m = j // tiles_g
            _wait_for(done_o + m, tiles_o)
            _linear_tile(mid_ptr, norm_ptr, gate_up_ptr, act_ptr, act_ptr, act_ptr, M, I, H, H, eps, m,
                         j % tiles_g, True, True, False, False, BLOCK_M, BLOCK_N_G, BLOCK_K_G, UPCAST, DOT_PRECISION)
            _finished(done_g + m)
        else:  # out = mid + act @ down.T
            j = item - items_o - items_g
            m = j // tiles_d
            _wait_for(done_g + m, tiles_g)
            _linear_tile(act_ptr, norm_ptr, down_ptr, out_ptr, out_ptr, mid_ptr, M, H, I, I, eps, m, j % tiles_d,
                         False, False, True, False, BLOCK_M, BLOCK_N_D, BLOCK_K_D, UPCAST, DOT_PRECISION)
        item = tl.atomic_add(ctl_ptr + CTL_CLAIM, 1)
    # The last program out zeroes the control words for the next launch (no program reads them after its exit
    # count; stream order makes the zeros visible to the next launch).
    if tl.atomic_add(ctl_ptr + CTL_EXITED, 1) == programs - 1:
        words = CTL_DONE + 2 * row_blocks
        for w0 in range(0, words, 128):
            offs = w0 + tl.arange(0, 128)
            tl.store(ctl_ptr + offs, tl.zeros([128], tl.int32), mask=offs < words)


def o_proj_mlp(attention, residual, o_weight, norm_weight, gate_up_weight, down_weight, eps, *,
               _config: OProjMlpConfig | None = None):
    """Triton o_proj_mlp with the contract signature; see :func:`eagle_kernels.reference.o_proj_mlp`.

    Shapes
    ------
    attention [..., Ka] fp32/fp16/bf16 (rows may be strided; the last dim dense); residual
    [..., H]; o_weight [H, Ka]; norm_weight [H]; gate_up_weight [2I, H]; down_weight [H, I].
    Returns out [..., H], contiguous. ``_config`` overrides the launch configuration (tests).
    Launches on one device must not run concurrently (the control words are the device's
    ticket counters; the decoder issues its launches on one stream).
    """
    _layer_checks.check_o_proj_mlp(attention, residual, o_weight, norm_weight, gate_up_weight, down_weight, eps)
    Ka = attention.shape[-1]
    H = o_weight.shape[0]
    inner = gate_up_weight.shape[0] // 2
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    M = residual.numel() // H if H else 0
    if M == 0 or H == 0:
        return out
    rows, norm = gemm_inputs(attention, M, norm_weight)
    residual_rows = residual.reshape(M, H).contiguous()
    o, gate_up, down = (w.contiguous() for w in (o_weight, gate_up_weight, down_weight))
    mid = torch.empty(M, H, dtype=out.dtype, device=out.device)
    act = torch.empty(M, inner, dtype=out.dtype, device=out.device)
    config = _config or (INTERPRETER_CONFIG if interpreted(_o_proj_mlp_kernel) else GPU_CONFIG)
    # The tiles rmsnorm_linear's launches would take: the same bits.
    block_m = tile(config.block_m, M)
    block_n_o, block_n_d = tile(config.block_n, H), tile(config.block_n, H)
    block_n_g = tile(column_block(config.block_n, True, attention.dtype), inner)
    block_k_o, block_k_g, block_k_d = tile(config.block_k, Ka), tile(config.block_k, H), tile(config.block_k, inner)
    row_blocks = triton.cdiv(M, block_m)
    items = row_blocks * (triton.cdiv(H, block_n_o) + triton.cdiv(inner, block_n_g) + triton.cdiv(H, block_n_d))
    programs = min(items, config.programs or gpu_sms(out.device) or items)
    ctl = tickets(out.device, CTL_DONE.value + 2 * row_blocks)
    upcast, precision = dot_mode(_o_proj_mlp_kernel, attention.dtype)
    _o_proj_mlp_kernel[(programs,)](
        rows, residual_rows, o, norm, gate_up, down, mid, act, out, ctl,
        M, H, Ka, inner, rows.stride(0), float(eps),
        BLOCK_M=block_m, BLOCK_N_O=block_n_o, BLOCK_N_G=block_n_g, BLOCK_N_D=block_n_d,
        BLOCK_K_O=block_k_o, BLOCK_K_G=block_k_g, BLOCK_K_D=block_k_d, UPCAST=upcast, DOT_PRECISION=precision,
        **launch_options(out.device, o, gate_up, down), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
