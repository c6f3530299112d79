"""Launch configurations of the Triton tree_attention kernel, their shared memory and occupancy.

``gpu_config`` picks a configuration from the call's shapes, dtype and layout: the row block
``block_m`` holds the (node, query head) pairs of a (request, KV head) up to 128 rows (GQA
packing: Llama-3-8B's 32 / 8 heads at N 64 are 256 rows, two blocks of 128), or up to 256 when
the call has enough (request, KV head) pairs (``wide_blocks``: one block, one K/V read a pair);
warps scale with the rows; pipeline stages are the most that keep the target blocks per SM (2 up
to 64 rows, 1 at 128 and 256 rows, whose registers fill the SM's file).

``TreeAttentionConfig.shared_bytes`` is the dynamic shared memory Triton allocates for the
kernel (triton 3.6 and 3.9, sm_90), term by term: the Q tile (an operand of the Hopper MMA,
kept in shared memory), the K and V tiles once per pipeline stage, and with a tree mask one
int64 word per row per stage but one. The paged gather pipelines its K/V tiles over at most
two buffers, its mask words over one, and adds the block-table indices (1 KiB bound); 16-bit
inputs add the conditional rescale's reduction scratch (1 KiB bound) and the ones operand of
the row sums' MMA (block_k x 16 values). For the 16-bit
configurations of 64 rows or more this is at most 1 KiB above the compiled figure, never below
(python_tests/ops/test_tree_attention_compile.py compiles some; ``python
bench/tree_attention_audit.py audit`` compiles every configuration ``gpu_config`` can return),
and an upper bound for fp32 (FMA dots) and for 16 and 32 rows (the pre-Hopper MMA keeps its
operands in registers).
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

import torch
import triton

from ._launch_config import gpu_sms

# Shared memory an H100 / H200 (sm_90) block may use, and an SM holds (each resident block also
# takes 1 KiB the driver reserves); 32-bit registers of an SM; warps an SM can hold.
SHARED_MEMORY_BUDGET = 232_448
SM_SHARED_MEMORY = 233_472
SM_RESERVED_PER_BLOCK = 1024
SM_REGISTERS = 65_536
SM_MAX_WARPS = 64
H200_SMS = 132
# Static shared memory of the compiled kernel (Triton's, reported beside the dynamic bytes).
STATIC_SHARED = 1024
MAX_ROWS = 128
# 16-bit inputs, head dims up to 128: all 256 rows of a (request, KV head) in one block (Llama-3-8B
# heads at N 64) when there are enough (request, KV head) pairs (``wide_blocks``).
WIDE_ROWS = 256
# Triton 3.6 (the GPU machine's version) keeps fewer values in registers across the 256-row
# prefix loop at head dim 128: 1-3 local-memory reloads an iteration (3.9: spills outside the
# loops only). Wide blocks need 3.9 or later.
WIDE_BLOCKS_SUPPORTED = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2]) >= (3, 9)
RESCALE_SCRATCH = 1024
# Columns of the 16-bit path's row-sum MMA (tree_attention.LSUM_COLS).
ROW_SUM_COLUMNS = 16


@dataclasses.dataclass(frozen=True)
class TreeAttentionConfig:
    """Tiles and launch options of one tree_attention launch.

    block_m: (node, query head) rows per program (at least next_pow2 of the GQA group).
    block_k: keys per tile, a divisor of 64 (a tile's mask bits then lie in one int64 word per
    row). num_warps, num_stages, max_registers (ptxas ``maxnreg``, None: ptxas's choice):
    Triton launch options. blocks_per_sm: the occupancy the configuration is chosen for.
    """

    block_m: int
    block_k: int
    num_warps: int
    num_stages: int
    max_registers: int | None = None
    blocks_per_sm: int = 1

    def __post_init__(self):
        if 64 % self.block_k or self.num_stages < 1:
            raise ValueError(f"config: block_k must divide 64 and num_stages be >= 1, got {self}")

    def shared_bytes(self, head_dim: int, element_size: int, causal: bool, paged: bool) -> int:
        """Dynamic shared memory of a block (see the module docstring for what is exact)."""
        block_d = max(16, triton.next_power_of_2(head_dim))
        q_tile = self.block_m * block_d * element_size
        kv_tiles = 2 * self.block_k * block_d * element_size
        mask_words = 0 if causal else self.block_m * 8
        stages = self.num_stages
        # 16-bit inputs: the conditional rescale's block-wide maximum (4 B a warp, placed at the
        # allocator's alignment: 16 B to 1 KiB more in the compiled kernels, bounded by 1 KiB).
        scratch = RESCALE_SCRATCH if element_size == 2 else 0
        # 16-bit inputs: the ones operand [block_k, 16] of the row sums' MMA (p @ ones).
        ones = self.block_k * ROW_SUM_COLUMNS * element_size if element_size == 2 else 0
        scratch += ones
        if paged:
            return (q_tile + min(stages, 2) * kv_tiles + min(stages - 1, 1) * mask_words
                    + (1024 if stages >= 3 else 0) + scratch)
        return q_tile + stages * kv_tiles + (stages - 1) * mask_words + scratch


def blocks_per_sm(shared_bytes: int, registers: int, num_warps: int) -> int:
    """Resident blocks of one SM by shared memory, registers (per-warp allocation in units of
    256) and warps."""
    by_shared = SM_SHARED_MEMORY // (shared_bytes + STATIC_SHARED + SM_RESERVED_PER_BLOCK)
    warp_registers = triton.cdiv(registers * 32, 256) * 256
    by_registers = SM_REGISTERS // (warp_registers * num_warps)
    return max(0, min(by_shared, by_registers, SM_MAX_WARPS // num_warps, 32))


# Row-block entries for 16-bit inputs and head dims up to 128: block_m -> (block_k, num_warps,
# max_registers, most stages). 128 rows take 8 warps (2 warpgroups of 64 rows) over 64-key tiles
# and 3 stages, registers at ptxas's choice (190-254 at D 128: one block an SM). Per key and
# row this issues fewer instructions than 256 rows of 16 warps over 32-key tiles capped at 128
# registers (a 64 x 32 x 16 wgmma does half the work of a 64 x 64 x 16 one for the same
# descriptor arithmetic; 64-key tiles at that cap spill in the loop), so the 256 rows of a
# (request, KV head) at N 64 are two node blocks whose K/V reads repeat (from L2, as the
# neighbouring program of the same head reads them at the same time; docs/gpu_kernels.md).
# Smaller blocks come from short trees (N x group rows) and leave ptxas its choice (<= 255
# registers, two blocks of 4 warps an SM). 256 rows (``wide_blocks``) take the same 8 warps and
# 64-key tiles (each warpgroup two 64-row wgmma halves: 128 accumulator registers a thread, 255
# registers with a few spills outside the loops, none inside): one K/V read per (request, KV
# head) and fewer instructions per key and row than 128 rows (docs/gpu_kernels.md, "Wide
# blocks"); but twice the per-program work, so only where they need at most 2 prefix splits.
ROW_TABLE = {
    WIDE_ROWS: (64, 8, None, 3),
    128: (64, 8, None, 3),
    64: (64, 4, None, 3),
    32: (64, 4, None, 3),
    16: (64, 4, None, 3),
}
# fp32 (IEEE dots on FMA units): 64 x 16 tiles, 8 warps; the earlier 64 x 32 tiles of 4 warps
# spilled inside the key loop (1,489 spill instructions in the loops at D 128, contiguous),
# these do not. Head dims above 128: 64 x 32 tiles of 8 warps (16-bit; correct, not tuned).
FP32_ENTRY = (64, 16, 8, None, 2)
D256_ENTRY = (64, 32, 8, None, 2)
# Registers a thread is assumed to take when ptxas chooses (the compiled figures of these
# entries stay below it; ``bench/tree_attention_audit.py audit`` prints them).
DEFAULT_REGISTERS = 255


def _stages_for(block_m, block_k, num_warps, max_registers, most, target, head_dim, element_size, causal, paged):
    """The most pipeline stages (``most`` down to 1) whose shared memory fits a block and keeps
    ``target`` blocks per SM; 1 if none does."""
    registers = max_registers or DEFAULT_REGISTERS
    for stages in range(most, 0, -1):
        config = TreeAttentionConfig(block_m, block_k, num_warps, stages, max_registers, target)
        shared = config.shared_bytes(head_dim, element_size, causal, paged)
        if shared + STATIC_SHARED <= SHARED_MEMORY_BUDGET and blocks_per_sm(shared, registers, num_warps) >= target:
            return stages
    return 1


def rows_for(N: int, group: int, most: int = MAX_ROWS) -> int:
    """block_m for N nodes of ``group`` query heads: every row of a (request, KV head) up to
    ``most`` (MAX_ROWS, or WIDE_ROWS), at least 16 (the smallest dot) and next_pow2(group)."""
    return max(16, triton.next_power_of_2(group), min(most, triton.next_power_of_2(N * group)))


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA ``device``; elsewhere (the interpreter, the launch count's modeled GPU) the H200's."""
    return gpu_sms(device) or H200_SMS


def wide_blocks(heads: int | None, sms: int = H200_SMS) -> bool:
    """Whether ``heads`` (request, KV head) pairs take 256-row blocks (16-bit, D <= 128, more than
    128 rows a pair): when those programs need at most 2 prefix splits to fill ``sms`` SMs
    (``num_splits``: sms // heads <= 2), e.g. B 8 and B 32 at Llama-3-8B heads (64 and 256 pairs),
    not B 1 (8 pairs: 16 splits of 256 rows would re-read Q and write partials 16 times, and
    each program's fixed work would be a third of its time). Never with triton before 3.9
    (``WIDE_BLOCKS_SUPPORTED``)."""
    return WIDE_BLOCKS_SUPPORTED and heads is not None and 3 * heads > sms


# Few (request, KV head) pairs over a short cache: a call's programs (blocks x prefix splits) should
# reach at least this share of the SMs before its row blocks stop halving (``gpu_config`` with
# ``capacity``). SmolLM2-135M's 61-node verify pass at B 1 (3 pairs) took 6 programs of 128 rows
# and no split at a 384-entry capacity: the kernel model gives 7.1 us, against 2.5 us for 39
# programs of 16 rows (docs/gpu_kernels.md, "Row blocks that fill the SMs").
FILL_SHARE = 0.5


def gpu_config(N, group, D, dtype, causal, paged, heads: int | None = None, sms: int = H200_SMS,
               capacity: int | None = None) -> TreeAttentionConfig:
    """The GPU launch configuration for a call's shapes, dtype and layout; ``heads`` = B x Hkv
    (request, KV head) pairs of the call (None: at most 128 rows a block), ``sms`` the device's.
    With ``capacity`` (the cache's, as the launcher's split count takes it) and ``heads``, 16-bit
    row blocks of up to 128 rows halve (down to 16 rows, or the group's) while the call's programs,
    blocks times ``num_splits``, fill less than FILL_SHARE of the SMs: each block then re-reads
    the prefix's K/V (from L2, as its neighbours read them at the same time), but the tree's rows
    are spread over more SMs; and further where smaller blocks fold partials that would otherwise
    need a merge launch (``_folding_config``)."""
    config = _config(N, group, D, dtype, causal, paged, wide_blocks(heads, sms))
    element_size = dtype.itemsize
    if capacity is None or heads is None or element_size != 2 or D > 128 or config.block_m > MAX_ROWS:
        return config

    def programs(c: TreeAttentionConfig) -> int:
        layout = split_layout(N, group, heads, capacity, c, sms)
        return layout.blocks * layout.splits

    smallest = max(16, triton.next_power_of_2(group))
    while config.block_m > smallest and programs(config) < FILL_SHARE * sms:
        config = _config(N, group, D, dtype, causal, paged, False, rows=config.block_m // 2)
    config = _folding_config(config, N, group, D, dtype, causal, paged, heads, capacity, sms, smallest)
    if config.block_m == PAIRED_WARP_ROWS and programs(config) > sms:
        config = dataclasses.replace(config, num_warps=PAIRED_WARP_ROWS // 16)
    return config


# A 32-row block of 4 warps lays its warps out 2 x 2 over a tile's rows and keys (a pre-Hopper MMA
# is 16 rows high), so every key tile's row maxima and the probabilities' handover to the P @ V
# product cross warps through shared memory; 2 warps of 16 rows each keep a row in one warp
# (FlashAttention-2's layout). sm_90, SmolLM2-135M's verify pass at a 4k cache (32 rows, 12
# splits, 252 programs): 812 warp instructions a 64-key tile and block against 1,096, and 6.1
# against 7.2 us of device time in the kernel model. But 2 warps issue one program at most at
# half an SM's rate, so only launches of more programs than SMs (a wave then lasts as long as an
# SM's two programs) take them; at a 1k cache (84 programs) 2 warps would be slower (5.4 against
# 3.6 us). docs/gpu_kernels.md, "Two warps for 32-row blocks".
PAIRED_WARP_ROWS = 32


# Merge-free row blocks (``_folding_config``): the K/V bytes a launch's blocks may read in all
# (every node block of a (request, KV head) reads its prefix) for a smaller row block taken so
# that its split partials fold, and the most dependent read rounds its fold may take (each an L2
# round trip of the folding program, ``fold_chunk``). The node blocks of a head read the same
# tiles at about the same time, so the repeats come from L2; the bound keeps SmolLM2-135M's
# 22 MB (32-row blocks at a 4k cache: 7.2 us modeled against 6.4 + 1.6 us of device time for
# 128-row blocks and a merge launch) and excludes Llama-3-8B's heads (134 MB at 32 rows: 32.3
# against 11.2 + 1.6 us; docs/gpu_kernels.md, "Row blocks whose partials fold").
FOLD_KV_READ_BYTES = 32 * 1024 * 1024
FOLD_ROUNDS = 4


def _folding_config(config, N, group, D, dtype, causal, paged, heads, capacity, sms, smallest):
    """``config``, or, when its split partials need a merge launch, the largest halving of its
    row block (down to ``smallest``) whose partials fold in at most FOLD_ROUNDS rounds, as long
    as the launch's K/V reads stay within FOLD_KV_READ_BYTES: a launch fewer, for more blocks
    re-reading the prefix."""
    partial_bytes = partial_dtype(dtype).itemsize
    block_d = max(16, triton.next_power_of_2(D))
    layout = split_layout(N, group, heads, capacity, config, sms)
    if layout.splits == 1 or folds_merge(layout.splits, layout.rows, D, partial_bytes):
        return config
    element_size = dtype.itemsize
    candidate = config
    while candidate.block_m > smallest:
        candidate = _config(N, group, D, dtype, causal, paged, False, rows=candidate.block_m // 2)
        layout = split_layout(N, group, heads, capacity, candidate, sms)
        if layout.blocks * capacity * D * 2 * element_size > FOLD_KV_READ_BYTES:
            break
        rounds = triton.cdiv(layout.splits, fold_chunk(layout.splits, layout.block_m, block_d, candidate.num_warps))
        if folds_merge(layout.splits, layout.rows, D, partial_bytes) and rounds <= FOLD_ROUNDS:
            return candidate
    return config


class SplitLayout(NamedTuple):
    block_m: int  # rows a block (the configuration's, at least next_pow2(group))
    rows: int  # of them valid: the block's nodes (at most N) x group
    blocks: int  # (request, KV head, node block) programs
    splits: int  # prefix splits on a GPU (num_splits)


def split_layout(N: int, group: int, heads: int, capacity: int, config: TreeAttentionConfig,
                 sms: int = H200_SMS) -> SplitLayout:
    """How a launch over ``heads`` (request, KV head) pairs and a cache of ``capacity`` entries
    lays out with ``config`` on ``sms`` SMs: the one computation the launcher, the capacity rule
    of ``gpu_config`` and the decoding-step model (bench/gpu_step_model.py) share."""
    block_m = max(config.block_m, triton.next_power_of_2(group))
    nodes = block_m // group
    blocks = heads * triton.cdiv(N, nodes)
    return SplitLayout(block_m, min(nodes, N) * group, blocks,
                       num_splits(blocks, capacity, config.block_k, sms, config.blocks_per_sm))


def _config(N, group, D, dtype, causal, paged, wide: bool, rows: int | None = None) -> TreeAttentionConfig:
    """The configuration of ``rows``-row blocks (default: ``rows_for``'s)."""
    element_size = dtype.itemsize
    if rows is None:
        rows = rows_for(N, group, WIDE_ROWS if element_size == 2 and D <= 128 and wide else MAX_ROWS)
    if D > 128:
        block_m, block_k, num_warps, max_registers, most = D256_ENTRY
        block_m = max(block_m, triton.next_power_of_2(group))
    elif element_size == 4:
        block_m, block_k, num_warps, max_registers, most = FP32_ENTRY
        block_m = max(block_m, triton.next_power_of_2(group))
    else:
        block_m = rows
        block_k, num_warps, max_registers, most = ROW_TABLE[min(block_m, WIDE_ROWS)]
    target = 1 if block_m >= 128 or D > 128 or element_size == 4 else 2
    stages = _stages_for(block_m, block_k, num_warps, max_registers, most, target, D, element_size, causal, paged)
    return TreeAttentionConfig(block_m, block_k, num_warps, stages, max_registers, target)


def every_gpu_config() -> dict:
    """{config: [(D, dtype, causal, paged), ...]}: every configuration gpu_config can return for
    head dims 64 / 128 / 256, fp16 / bf16 / fp32, both mask kinds and both cache layouts, N 1-256,
    GQA groups 1-8, with and without wide blocks."""
    configs: dict = {}
    for D in (64, 128, 256):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for causal in (True, False):
                for paged in (False, True):
                    for group in (1, 2, 4, 8):
                        for N in (1, 2, 4, 8, 16, 32, 64, 128, 256):
                            for heads in (None, H200_SMS):  # H200_SMS pairs: wide blocks where supported
                                config = gpu_config(N, group, D, dtype, causal, paged, heads)
                                configs.setdefault(config, []).append((D, dtype, causal, paged))
    return configs


def num_splits(programs: int, capacity: int, block_k: int, sms: int, occupancy: int) -> int:
    """Flash-decoding split count from shapes only (no device sync). With at least one program
    per SM there is no split (no fp32 round trip of partial results); with fewer, the prefix is
    split so that the programs fill the SMs' resident blocks once (``occupancy`` per SM), each
    split keeping at least 4 key tiles of the cache's capacity, at most 32 splits."""
    if programs >= sms:
        return 1
    return max(1, min(32, (sms * occupancy) // programs, capacity // (4 * block_k)))


# Folded merge: with at most this many bytes of partial outputs a program's split group must
# combine, the program of the group's last split merges them itself (a ticket counter) instead
# of a separate merge launch. One SM reads L2 at roughly 64 B a cycle (~120 GB/s at 1.98 GHz),
# so 128 KiB take ~1.1 us, under the ~3.5 us a launch cost in a replayed H200 step
# (bench/results/nvidia-h200/gpu_check_2026-12-04.md); larger groups (long trees split many
# ways) keep the merge kernel, whose programs share the partials' read, as do 256-row blocks
# (their 255 registers spill more in the merge's epilogue: 40 -> 80 B at D 128 in the sm_90
# audit). A modeled threshold, to be timed on a device (bench/bench_tree_attention.py).
FOLD_MERGE_BYTES = 128 * 1024
# Partial values the folding program holds per round of its merge: 64 a thread (its main loop's
# registers are free by then). Rounds are dependent L2 reads (~0.2 us each): SmolLM2's decoded
# token reads 16 splits in 2, its 61-node tree 8 splits in 4. sm_90: no spill with triton 3.9 or
# 3.6; 3.6 takes 254 registers for the 16-row block (2 blocks an SM, the split count's target;
# 113 at 32 values a thread, in twice the rounds).
FOLD_VALUES_PER_THREAD = 64


def fold_chunk(splits: int, block_m: int, block_d: int, num_warps: int) -> int:
    """Splits a folded merge reads per round (a power of two, at most next_pow2(splits)):
    FOLD_VALUES_PER_THREAD partial values a thread of ``block_m`` rows x ``block_d``, as many as
    4 warps hold for a block of fewer (2-warp 32-row blocks: 128 a thread, the rounds of the
    4-warp block; sm_90, no spill with triton 3.9 or 3.6)."""
    values = FOLD_VALUES_PER_THREAD * 32 * max(num_warps, 4)
    return min(max(2, triton.next_power_of_2(splits)), 1 << max(0, (values // (block_m * block_d)).bit_length() - 1))


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a split launch's partial outputs for inputs of ``dtype``: fp16 scaled per row for
    bf16 inputs (half the bytes; the error they add is below the output's rounding), else fp32."""
    return torch.float16 if dtype == torch.bfloat16 else torch.float32


def folds_merge(splits: int, rows: int, head_dim: int, partial_bytes: int) -> bool:
    """Whether a split launch merges in its last programs (``rows``: valid rows of a block,
    ``partial_bytes``: bytes of one partial value) rather than in a merge launch."""
    return splits > 1 and rows <= MAX_ROWS and splits * rows * head_dim * partial_bytes <= FOLD_MERGE_BYTES


# The goal layout (Llama-3-8B heads, N 64: 256 rows, two 128-row blocks), a shorter tree's 128
# rows, head dim 256.
GPU_CONFIG = gpu_config(64, 4, 128, torch.bfloat16, False, False)
GPU_CONFIG_SMALL = gpu_config(32, 4, 128, torch.bfloat16, False, False)
GPU_CONFIG_D256 = gpu_config(64, 4, 256, torch.bfloat16, False, False)
# The goal layout at B 8 / B 32 (64 / 256 (request, KV head) pairs): one 256-row block a pair
# (with triton 3.9 or later: WIDE_BLOCKS_SUPPORTED).
GPU_CONFIG_WIDE = _config(64, 4, 128, torch.bfloat16, False, False, wide=True)

# Under the interpreter the cost is per program and per operation: small row blocks keep the
# tests' node counts spread over several programs; warps and stages mean nothing there.
INTERPRETER_CONFIG = TreeAttentionConfig(block_m=16, block_k=64, num_warps=4, num_stages=1)
