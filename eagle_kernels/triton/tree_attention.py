"""Triton tree attention (contract §1): flash attention over the committed prefix and the tree.

For request ``b``, node ``i`` and query head ``h`` (KV head ``h // G``)::

    out[b, i, h] = softmax_t(q . k_t * sm_scale) @ v     over t < cache_seqlens[b] (prefix,
                   no mask) and t = cache_seqlens[b] + j for tree slots j visible to i
                   (mask bit (i, j), or j <= i when tree_mask is None)

(SpecInfer, Miao et al. 2024, §4.2 tree-based parallel decoding; online softmax of
FlashAttention, Dao et al. 2022, Alg. 1, in base 2: q is pre-scaled by sm_scale * log2 e.)

Layout of one program: its rows are the (node, query head) pairs of ``NODES`` consecutive nodes
and the ``G`` query heads sharing one KV head (GQA packing), so each K/V tile is loaded once for
all of them. Prefix tiles need no mask beyond the length bound; tree tiles read the int64 mask
words. Long prefixes with few programs are split over ``NUM_SPLITS`` programs per row block
(flash-decoding); a small merge kernel then combines the partial results by their log-sum-exp.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import _checks
from ._launch_config import interpreted


@triton.jit
def _attend_tile(q, k, v, valid, m_i, l_i, acc, scale_log2,
                 MASKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a key tile; with MASKED, ``valid`` [BLOCK_M, BLOCK_K] says
    which scores count (else all do). A row that has seen no valid key keeps m = -inf and is
    shifted by 0 instead, so no -inf - -inf NaN appears."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _kv_offsets(b, kvh, t, t_valid, block_table_ptr, page_size, max_pages,
                stride0, stride1, stride2, IS_PAGED: tl.constexpr):
    """int64 element offsets [BLOCK_K] of logical positions ``t`` of request ``b``."""
    if IS_PAGED:
        page = tl.load(block_table_ptr + b * max_pages + t // page_size, mask=t_valid, other=0)
        return page.to(tl.int64) * stride0 + (t % page_size).to(tl.int64) * stride1 + kvh * stride2
    else:
        return b * stride0 + t.to(tl.int64) * stride1 + kvh * stride2


@triton.jit
def _tree_attention_kernel(
    q_ptr,  # [B, N, Hq, D] q.dtype (strided)
    k_ptr,  # [B, S, Hkv, D] or paged [P, page_size, Hkv, D], last dim dense
    v_ptr,  # like k_ptr
    seqlens_ptr,  # [B] int32
    mask_ptr,  # [B, N, W] int64, contiguous (unused when IS_CAUSAL)
    block_table_ptr,  # [B, max_pages] int32, contiguous (unused unless IS_PAGED)
    out_ptr,  # [B, N, Hq, D] q.dtype, contiguous (written when NUM_SPLITS == 1)
    part_o_ptr,  # [NUM_SPLITS, B * N * Hq, D] float32 (written when NUM_SPLITS > 1)
    part_lse_ptr,  # [NUM_SPLITS, B * N * Hq] float32, base-2 log-sum-exp
    N, Hq, Hkv, D, W, page_size, max_pages, scale_log2,
    stride_qb, stride_qn, stride_qh,
    stride_k0, stride_k1, stride_k2,
    stride_v0, stride_v1, stride_v2,
    GROUP: tl.constexpr, NODES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IS_PAGED: tl.constexpr, IS_CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr,  # D == BLOCK_D: whole-tile loads need no mask at all
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    node_blocks = tl.cdiv(N, NODES)
    nblk = pid % node_blocks
    kvh = ((pid // node_blocks) % Hkv).to(tl.int64)
    b = (pid // (node_blocks * Hkv)).to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    node_local = offs_m // GROUP
    node = nblk * NODES + node_local
    head = kvh * GROUP + offs_m % GROUP
    row_valid = (node_local < NODES) & (node < N)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < D

    q_off = b * stride_qb + node[:, None].to(tl.int64) * stride_qn + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    prefix = tl.load(seqlens_ptr + b)
    if NUM_SPLITS == 1:
        start = 0
        stop = prefix
    else:
        chunk = tl.cdiv(tl.cdiv(prefix, NUM_SPLITS), BLOCK_K) * BLOCK_K
        start = split * chunk
        stop = tl.minimum(prefix, start + chunk)

    offs_k = tl.arange(0, BLOCK_K)
    # Committed prefix: every node sees every position. Whole tiles first, with no key mask
    # and no score masking (as the off-diagonal blocks of causal flash attention); then the
    # one partial tile, where only the length bound masks.
    full_stop = start + tl.maximum(stop - start, 0) // BLOCK_K * BLOCK_K
    all_keys = offs_k < BLOCK_K
    kd_full = all_keys[:, None] & d_valid[None, :]
    for t0 in range(start, full_stop, BLOCK_K):
        t = t0 + offs_k
        k_off = _kv_offsets(b, kvh, t, all_keys, block_table_ptr, page_size, max_pages,
                            stride_k0, stride_k1, stride_k2, IS_PAGED)
        v_off = _kv_offsets(b, kvh, t, all_keys, block_table_ptr, page_size, max_pages,
                            stride_v0, stride_v1, stride_v2, IS_PAGED)
        if EVEN_D:
            k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :])
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :])
        else:
            k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kd_full, other=0.0)
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kd_full, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, all_keys[None, :], m_i, l_i, acc, scale_log2,
                                     False, UPCAST, DOT_PRECISION)
    if full_stop < stop:
        t = full_stop + offs_k
        t_valid = t < stop
        kd_mask = t_valid[:, None] & d_valid[None, :]
        k_off = _kv_offsets(b, kvh, t, t_valid, block_table_ptr, page_size, max_pages,
                            stride_k0, stride_k1, stride_k2, IS_PAGED)
        v_off = _kv_offsets(b, kvh, t, t_valid, block_table_ptr, page_size, max_pages,
                            stride_v0, stride_v1, stride_v2, IS_PAGED)
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kd_mask, other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kd_mask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, t_valid[None, :], m_i, l_i, acc, scale_log2,
                                     True, UPCAST, DOT_PRECISION)

    # Tree slots (last split only). Ancestors precede descendants, so no row of this block
    # sees a slot past its last node.
    if split == NUM_SPLITS - 1:
        last = tl.minimum(N, (nblk + 1) * NODES) - 1
        for j0 in range(0, last + 1, BLOCK_K):
            j = j0 + offs_k
            j_valid = j <= last
            kd_mask = j_valid[:, None] & d_valid[None, :]
            t = prefix + j
            k_off = _kv_offsets(b, kvh, t, j_valid, block_table_ptr, page_size, max_pages,
                                stride_k0, stride_k1, stride_k2, IS_PAGED)
            v_off = _kv_offsets(b, kvh, t, j_valid, block_table_ptr, page_size, max_pages,
                                stride_v0, stride_v1, stride_v2, IS_PAGED)
            k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kd_mask, other=0.0)
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kd_mask, other=0.0)
            both = row_valid[:, None] & j_valid[None, :]
            if IS_CAUSAL:
                visible = both & (j[None, :] <= node[:, None])
            else:
                # BLOCK_K divides 64: the tile's keys share one mask word per row, loaded as a
                # [BLOCK_M] vector (not a [BLOCK_M, BLOCK_K] tile of repeated words).
                words = tl.load(mask_ptr + (b * N + node.to(tl.int64)) * W + j0 // 64, mask=row_valid, other=0)
                bits = (words[:, None] >> (j[None, :] % 64).to(tl.int64)) & 1
                visible = both & (bits != 0)
            m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, scale_log2,
                                         True, UPCAST, DOT_PRECISION)

    # A row with no visible key (a mask without the node's own bit and an empty prefix)
    # outputs zeros.
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    row = (b * N + node.to(tl.int64)) * Hq + head  # flat (b, node, head) index
    o_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + row[:, None] * D + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        rows_total = tl.num_programs(0) // node_blocks * N * GROUP  # B * N * Hq
        base = split.to(tl.int64) * rows_total + row
        tl.store(part_o_ptr + base[:, None] * D + offs_d[None, :], o, mask=o_mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + base, lse, mask=row_valid)


@triton.jit
def _tree_attention_merge_kernel(
    part_o_ptr,  # [NUM_SPLITS, R, D] float32, R = B * N * Hq
    part_lse_ptr,  # [NUM_SPLITS, R] float32
    out_ptr,  # [R, D] q.dtype
    R, D,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M): the splits' softmaxes recombined."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_valid = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < D
    lse = tl.load(part_lse_ptr + offs_s.to(tl.int64) * R + row, mask=s_valid, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)
    total = tl.sum(weight, 0)
    o_off = (offs_s.to(tl.int64)[:, None] * R + row) * D + offs_d[None, :]
    o = tl.load(part_o_ptr + o_off, mask=s_valid[:, None] & d_valid[None, :], other=0.0)
    merged = tl.sum(o * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + row * D + offs_d, merged.to(out_ptr.dtype.element_ty), mask=d_valid)


@dataclasses.dataclass(frozen=True)
class TreeAttentionConfig:
    """Tiles and launch options of one tree_attention launch.

    block_m: (node, query head) rows per program (at least next_pow2 of the GQA group).
    block_k: keys per tile. num_warps, num_stages: Triton launch options. waves: GPU waves
    the flash-decoding split aims at.
    """

    block_m: int
    block_k: int
    num_warps: int
    num_stages: int
    waves: int = 2

    def shared_bytes(self, head_dim: int, element_size: int, causal: bool, paged: bool = False) -> int:
        """Dynamic shared memory Triton allocates for a block (triton 3.6 and 3.9, sm_90): the Q
        tile (a Hopper MMA operand, kept in shared memory), K and V tiles once per pipeline
        stage, and with a tree mask one int64 word per row per stage but one. The paged gather
        pipelines K/V over at most two buffers and its mask words over one, plus the
        block-table indices (1 KiB bound). Exact for 16-bit blocks of 64 rows or more (the
        128-row bf16 D 128 tree launch: 133,120 B at 3 stages, 99,328 B at 2); an upper bound
        for fp32 (FMA dots) and smaller blocks (python_tests/ops/test_tree_attention_compile.py)."""
        block_d = max(16, triton.next_power_of_2(head_dim))
        q_tile = self.block_m * block_d * element_size
        kv_tiles = 2 * self.block_k * block_d * element_size
        mask_words = 0 if causal else self.block_m * 8
        stages = self.num_stages
        if paged:
            return (q_tile + min(stages, 2) * kv_tiles + min(stages - 1, 1) * mask_words
                    + (1024 if stages >= 3 else 0))
        return q_tile + stages * kv_tiles + (stages - 1) * mask_words


# Shared memory an H200 (sm_90) block may use.
SHARED_MEMORY_BUDGET = 232_448

# GPU launch configurations, from a sweep on an H200 (triton 3.6, bf16, Hq 32, Hkv 8, D 128,
# N 64): 128-row blocks with 8 warps won at B 1 / prefix 16k (0.105 vs 0.158 ms) and B 32 /
# prefix 16k (2.43 vs 2.75 ms); 64-row blocks won at B 8 / prefix 4k (0.193 vs 0.226 ms), where
# 128-row blocks leave the GPU short of one wave and need splitting while 64-row ones fill it.
# Head dim 256 keeps 64 x 32 tiles (register pressure; correct, not tuned).
GPU_CONFIG = TreeAttentionConfig(block_m=128, block_k=64, num_warps=8, num_stages=3)
GPU_CONFIG_SMALL = TreeAttentionConfig(block_m=64, block_k=64, num_warps=4, num_stages=3)
GPU_CONFIG_D256 = TreeAttentionConfig(block_m=64, block_k=32, num_warps=8, num_stages=2)
# Under the interpreter the cost is per program and per operation: small row blocks keep the
# tests' node counts spread over several programs; warps and stages mean nothing there.
INTERPRETER_CONFIG = TreeAttentionConfig(block_m=16, block_k=64, num_warps=4, num_stages=1)


def _fp32(config: TreeAttentionConfig) -> TreeAttentionConfig:
    """fp32 tiles take twice the shared memory of 16-bit ones: at most 64 x 32 tiles, 2 stages."""
    return dataclasses.replace(config, block_m=min(config.block_m, 64), block_k=min(config.block_k, 32),
                               num_stages=2)


def _fit(config: TreeAttentionConfig, head_dim: int, element_size: int, causal: bool,
         paged: bool = False) -> TreeAttentionConfig:
    """A table entry adapted to the dtype and the layout: fp32 tiles, then fewer pipeline
    stages until the block's shared memory (with Triton's 1 KiB of static shared memory) fits
    the budget."""
    if element_size == 4:
        config = _fp32(config)
    while config.num_stages > 1 and (config.shared_bytes(head_dim, element_size, causal, paged) + 1024
                                     > SHARED_MEMORY_BUDGET):
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return config


def _table_config(B, Hkv, N, group, D, device) -> TreeAttentionConfig:
    """The sweep's choice for the call's shapes (before the dtype and mask kind)."""
    if D > 128:
        return GPU_CONFIG_D256
    if device.type != "cuda":
        return GPU_CONFIG
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = lambda rows: B * Hkv * triton.cdiv(N, max(rows, group) // group)  # noqa: E731
    return GPU_CONFIG_SMALL if programs(128) < sms <= programs(64) else GPU_CONFIG


def gpu_config(B, Hkv, N, group, D, dtype, causal, device, paged=False) -> TreeAttentionConfig:
    """The GPU launch configuration for a call's shapes, dtype and layout."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return _fit(_table_config(B, Hkv, N, group, D, device), D, element_size, causal, paged)


def every_gpu_config() -> dict:
    """{config: [(D, dtype, causal, paged), ...]}: every configuration gpu_config can return for
    head dims 64 / 128 (256 for the D256 entry), fp16 / bf16 / fp32, both mask kinds and cache
    layouts."""
    configs: dict = {}
    for table_config in (GPU_CONFIG, GPU_CONFIG_SMALL, GPU_CONFIG_D256):
        for D in ((256,) if table_config is GPU_CONFIG_D256 else (64, 128)):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                element_size = torch.empty((), dtype=dtype).element_size()
                for causal in (True, False):
                    for paged in (False, True):
                        config = _fit(table_config, D, element_size, causal, paged)
                        configs.setdefault(config, []).append((D, dtype, causal, paged))
    return configs


def blocks_per_sm(shared_bytes: int, registers: int, num_warps: int) -> int:
    """Resident blocks of one SM (sm_90: 228 KiB of shared memory, 1 KiB reserved and 1 KiB
    static a block; 64 Ki registers allocated per warp in units of 256; 64 warps)."""
    by_shared = 233_472 // (shared_bytes + 2048)
    by_registers = 65_536 // (triton.cdiv(registers * 32, 256) * 256 * num_warps)
    return max(0, min(by_shared, by_registers, 64 // num_warps, 32))


def _num_splits(programs: int, capacity: int, block_k: int, device: torch.device, waves: int) -> int:
    """Flash-decoding split count from shapes only (no device sync): enough programs for
    ``waves`` waves of the GPU, each split keeping at least 4 key tiles of the cache's capacity."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return max(1, min(32, triton.cdiv(waves * sms, programs), capacity // (4 * block_k)))


def _launch(q, k_cache, v_cache, cache_seqlens, tree_mask=None, *, block_table=None, sm_scale=None,
            num_splits=None, config: TreeAttentionConfig | None = None):
    """Launcher: validate → reject unsupported layouts → allocate → grid → launch.
    ``num_splits`` overrides the flash-decoding split count (tests); ``config`` overrides the
    configuration: :func:`gpu_config`, or INTERPRETER_CONFIG when the kernel runs interpreted
    (tests run GPU configurations interpreted; bench/gpu_goals.py sweeps them)."""
    _checks.check_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask,
                                 block_table=block_table, sm_scale=sm_scale)
    if q.dtype == torch.float64:
        raise ValueError("q: expected dtype float32, float16 or bfloat16 for the triton path, got torch.float64")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:
            raise ValueError(f"{name}: expected a dense last (head) dim, got strides {tuple(cache.stride())}")
    B, N, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    out = torch.empty(B, N, Hq, D, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()  # a copy of q only; the caches are never copied
    # Index tensors are small: made contiguous so that the kernel indexes them flat.
    seqlens = cache_seqlens.contiguous()
    paged = block_table is not None
    table = block_table.contiguous() if paged else seqlens  # placeholder pointer when unused
    causal = tree_mask is None
    mask = seqlens if causal else tree_mask.contiguous()
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)

    interpret = interpreted(_tree_attention_kernel)
    if config is None:
        config = INTERPRETER_CONFIG if interpret else gpu_config(B, Hkv, N, group, D, q.dtype, causal, q.device, paged)
    block_d = max(16, triton.next_power_of_2(D))
    block_m = max(config.block_m, triton.next_power_of_2(group))
    block_k = config.block_k
    if 64 % block_k:
        raise ValueError(f"config: block_k must divide 64 (one mask word per row and tile), got {block_k}")
    nodes = block_m // group
    programs = B * Hkv * triton.cdiv(N, nodes)
    capacity = _checks.kv_capacity(k_cache, block_table)
    if num_splits is None:
        splits = _num_splits(programs, capacity, block_k, q.device, config.waves)
    else:
        splits = int(num_splits)
    if splits > 1:
        part_o = torch.empty(splits, B * N * Hq, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, B * N * Hq, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    upcast = interpret and q.dtype != torch.float32  # the interpreter's bf16 dot is wrong
    precision = "ieee" if (q.dtype == torch.float32 or upcast) else "tf32"
    page_size = k_cache.shape[1] if paged else 1
    max_pages = table.shape[1] if paged else 1
    _tree_attention_kernel[(programs, splits)](
        q, k_cache, v_cache, seqlens, mask, table, out, part_o, part_lse,
        N, Hq, Hkv, D, mask.shape[-1] if not causal else 1, page_size, max_pages,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group, NODES=nodes, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_D=block_d,
        NUM_SPLITS=splits, IS_PAGED=paged, IS_CAUSAL=causal, EVEN_D=block_d == D, UPCAST=upcast,
        DOT_PRECISION=precision,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        _tree_attention_merge_kernel[(B * N * Hq,)](
            part_o, part_lse, out, B * N * Hq, D,
            NUM_SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask=None, *, block_table=None, sm_scale=None,
                   _config: TreeAttentionConfig | None = None):
    """Triton tree attention with the contract signature; see
    :func:`eagle_kernels.reference.tree_attention` for shapes and semantics.

    Shapes
    ------
    q [B, N, Hq, D] (fp32/fp16/bf16, any strides); k_cache, v_cache [B, S, Hkv, D] or paged
    [P, page_size, Hkv, D] (dense last dim) with block_table int32 [B, max_pages];
    cache_seqlens int32 [B]; tree_mask int64 [B, N, ceil(N / 64)] or None (causal).
    Returns [B, N, Hq, D] in q.dtype. ``_config`` overrides the launch configuration (tests).
    """
    return _launch(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table=block_table, sm_scale=sm_scale,
                   config=_config)
