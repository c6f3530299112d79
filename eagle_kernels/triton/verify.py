"""Triton ``verify``: greedy and lossless sampling verification of a draft tree, from logits.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) on trees with deterministic
draft children (EAGLE-2, Li et al. 2024, §4); semantics and random stream as in
``eagle_kernels/reference/verify.py`` and docs/design.md ("Counter-based random stream",
"verify details").

One program per request walks its tree. At a visited node ``u`` it makes passes over the row
in ``BLOCK_V`` tiles: max and the NaN/+inf/finite flags (greedy rows stop there with the
argmax); for sampling rows ``s = (logits - max) / T`` into a ``[B, V]`` work row, the top-k
threshold (the k-th largest ``s``) by a radix-16 search over the order key of ``s`` that
counts keys at or above 15 candidate thresholds per pass, ``p = softmax(s)``, and the top-p
threshold by the same search summing the mass above each candidate. Both filters are then
"keep x iff key(x) >= threshold", which keeps ties together exactly as the reference does.
Children are tried in node order against the residual held in the work row; the bonus is an
inverse-CDF draw with a float64 cumulative sum. Philox4x32-10 runs in-kernel on uint32 words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import os

from .. import _checks
from .._types import VerifyOutput

# Bits per radix digit of the threshold searches: 16 candidates per pass on the GPU (the
# [BLOCK_V, 16] comparison stays in registers); 256 under the interpreter, where the cost is
# per operation rather than per element, so half the passes run twice as fast.
RADIX_BITS = 8 if os.environ.get("TRITON_INTERPRET") == "1" else 4

PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
ACCEPT_DRAW = tl.constexpr(0)
BONUS_DRAW = tl.constexpr(1)


@triton.jit
def _uniform(seed, offset, nodes, DRAW: tl.constexpr):
    """U in [0, 1) (float64, 53 bits) of the stream at (seed, offset, node, DRAW) for every
    entry of the int32 tensor ``nodes``; seed and offset are int64 scalars."""
    c2 = nodes.to(tl.uint32)
    zero = c2 * 0
    k0 = zero + (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = zero + ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = zero + (offset & 0xFFFFFFFF).to(tl.uint32)
    c1 = zero + ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c3 = zero + DRAW
    for round_index in tl.static_range(10):
        if round_index > 0:
            k0 = tl.add(k0, PHILOX_W0, sanitize_overflow=False)
            k1 = tl.add(k1, PHILOX_W1, sanitize_overflow=False)
        hi0 = tl.umulhi(c0, PHILOX_M0)
        lo0 = tl.mul(c0, PHILOX_M0, sanitize_overflow=False)
        hi1 = tl.umulhi(c2, PHILOX_M1)
        lo1 = tl.mul(c2, PHILOX_M1, sanitize_overflow=False)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    bits53 = ((c0 >> 5).to(tl.uint64) << 26) | (c1 >> 6).to(tl.uint64)
    return bits53.to(tl.float64) * 1.1102230246251565e-16  # 2**-53


@triton.jit
def _order_key(x, IS_FP64: tl.constexpr):
    """Unsigned key, monotone in the value; -0.0 and +0.0 share a key as they compare equal."""
    x = tl.where(x == 0, 0.0, x).to(x.dtype)
    if IS_FP64:
        u = x.to(tl.uint64, bitcast=True)
        sign = u >> 63
        return tl.where(sign == 1, ~u, u | 0x8000000000000000)
    else:
        u = x.to(tl.uint32, bitcast=True)
        sign = u >> 31
        return tl.where(sign == 1, ~u, u | 0x80000000)


@triton.jit
def _row_sum64(work_row_ptr, V, BLOCK_V: tl.constexpr):
    total = tl.zeros([], dtype=tl.float64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        w = tl.load(work_row_ptr + offs, mask=offs < V, other=0.0)
        total += tl.sum(w.to(tl.float64), axis=0)
    return total


@triton.jit
def _threshold_key(work_row_ptr, V, rank_k, top_p, IS_TOP_P: tl.constexpr, IS_FP64: tl.constexpr,
                   BLOCK_V: tl.constexpr, RADIX_BITS: tl.constexpr):
    """Radix search, most significant digit first, over the order keys of the work row; returns
    the value whose key is the threshold.

    top-k (IS_TOP_P false): the k-th largest key counted with multiplicity, i.e. the largest t
    with #(key >= t) >= k. top-p: the smallest t with mass(key >= t') < top_p for t' = t + 1,
    i.e. with the mass strictly above t below top_p. Either way a filter keeps x iff
    key(x) >= t. Each digit of RADIX_BITS bits takes one pass that evaluates the candidates P + j * 2^shift."""
    if IS_FP64:
        KT: tl.constexpr = tl.uint64
        KEY_BITS: tl.constexpr = 64
    else:
        KT: tl.constexpr = tl.uint32
        KEY_BITS: tl.constexpr = 32
    lanes = tl.arange(0, 1 << RADIX_BITS)
    prefix = tl.zeros([], dtype=KT)
    for level in tl.static_range(KEY_BITS // RADIX_BITS):
        shift = KEY_BITS - RADIX_BITS * (level + 1)
        candidates = prefix + (lanes.to(KT) << shift)  # lane 0 is never counted
        counts = tl.zeros([1 << RADIX_BITS], dtype=tl.int64)
        masses = tl.zeros([1 << RADIX_BITS], dtype=tl.float64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < V
            x = tl.load(work_row_ptr + offs, mask=valid, other=0.0)
            keys = _order_key(x, IS_FP64)
            above = (keys[:, None] >= candidates[None, :]) & valid[:, None]
            if IS_TOP_P:
                masses += tl.sum(tl.where(above, x.to(tl.float64)[:, None], 0.0), axis=0)
            else:
                counts += tl.sum(above.to(tl.int64), axis=0)
        if IS_TOP_P:
            digit = tl.sum(((masses >= top_p) & (lanes > 0)).to(tl.int32), axis=0)
        else:
            digit = tl.sum(((counts >= rank_k) & (lanes > 0)).to(tl.int32), axis=0)
        prefix = prefix + (digit.to(KT) << shift)
    # Back from key to value: keep x iff x >= value (the key order is the value order).
    if IS_FP64:
        bits = tl.where((prefix >> 63) == 1, prefix & 0x7FFFFFFFFFFFFFFF, ~prefix)
        return bits.to(tl.float64, bitcast=True)
    else:
        bits = tl.where((prefix >> 31) == 1, prefix & 0x7FFFFFFF, ~prefix)
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def _build_weights(row_ptr, work_row_ptr, V, row_max, temperature, top_k, top_p,
                   CT: tl.constexpr, IS_FP64: tl.constexpr, BLOCK_V: tl.constexpr, RADIX_BITS: tl.constexpr):
    """p_u of the contract into the work row: (logits - max) / T -> top-k -> softmax -> top-p
    -> renormalise."""
    t = temperature.to(CT)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < V
        x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(CT)
        # Shift before dividing: a tiny T sends the other logits to -inf, never the max to +inf.
        tl.store(work_row_ptr + offs, (x - row_max) / t, mask=valid)
    tl.debug_barrier()
    use_top_k = (top_k > 0) & (top_k < V)
    kth = tl.full([], float("-inf"), CT)
    if use_top_k:
        kth = _threshold_key(work_row_ptr, V, top_k.to(tl.int64), 1.0, False, IS_FP64, BLOCK_V, RADIX_BITS)
    # The scaled max is exactly 0 and survives top-k, so the softmax needs no second shift.
    total = tl.zeros([], dtype=tl.float64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < V
        s = tl.load(work_row_ptr + offs, mask=valid, other=float("-inf"))
        e = tl.where(s >= kth, tl.exp(s), 0.0).to(CT)
        e = tl.where(valid, e, 0.0)
        tl.store(work_row_ptr + offs, e, mask=valid)
        total += tl.sum(e.to(tl.float64), axis=0)
    tl.debug_barrier()
    denom = total.to(CT)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < V
        e = tl.load(work_row_ptr + offs, mask=valid, other=0.0)
        tl.store(work_row_ptr + offs, e / denom, mask=valid)
    tl.debug_barrier()
    if top_p < 1.0:
        cut = _threshold_key(work_row_ptr, V, 1, top_p.to(tl.float64), True, IS_FP64, BLOCK_V, RADIX_BITS)
        kept = tl.zeros([], dtype=tl.float64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < V
            p = tl.load(work_row_ptr + offs, mask=valid, other=0.0)
            kept += tl.sum(tl.where(p >= cut, p.to(tl.float64), 0.0), axis=0)
        norm = kept.to(CT)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < V
            p = tl.load(work_row_ptr + offs, mask=valid, other=0.0)
            w = tl.where(p >= cut, p / norm, 0.0).to(CT)
            tl.store(work_row_ptr + offs, w, mask=valid)
        tl.debug_barrier()


@triton.jit
def _inverse_cdf(work_row_ptr, V, u, BLOCK_V: tl.constexpr):
    """Smallest x with cumsum64(w)[x] > u * sum(w); the largest x with w[x] > 0 if none."""
    target = u * _row_sum64(work_row_ptr, V, BLOCK_V)
    found = V
    last_positive = -1
    carry = tl.zeros([], dtype=tl.float64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < V
        w = tl.load(work_row_ptr + offs, mask=valid, other=0.0).to(tl.float64)
        cumulative = tl.cumsum(w, axis=0) + carry
        found = tl.minimum(found, tl.min(tl.where((cumulative > target) & valid, offs, V), axis=0))
        last_positive = tl.maximum(last_positive, tl.max(tl.where((w > 0) & valid, offs, -1), axis=0))
        carry += tl.sum(w, axis=0)
    result = tl.where(found < V, found, tl.maximum(last_positive, 0))
    return result


@triton.jit
def _verify_kernel(
    tokens_ptr,  # [B, N] int64
    parents_ptr,  # [B, N] int32
    logits_ptr,  # [B, N, V] fp32 / fp16 / bf16 / fp64, unit stride over V
    temperature_ptr,  # [B] float32 (0 = greedy row)
    top_k_ptr,  # [B] int32 (0 = off)
    top_p_ptr,  # [B] float32 (1 = off)
    seed_ptr,  # [B] int64
    offset_ptr,  # [B] int64
    work_ptr,  # [B, V] float32 (float64 for fp64 logits): residual weights of the current node
    accept_len_ptr,  # [B] int32
    accept_nodes_ptr,  # [B, A] int32, A = max_depth + 1
    out_tokens_ptr,  # [B, A] int64
    status_ptr,  # [B] int32
    N, V, max_depth, stride_lb, stride_ln,
    IS_FP64: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_A: tl.constexpr,
    RADIX_BITS: tl.constexpr,
):
    if IS_FP64:
        CT: tl.constexpr = tl.float64
    else:
        CT: tl.constexpr = tl.float32
    b = tl.program_id(0).to(tl.int64)
    A = max_depth + 1
    temperature = tl.load(temperature_ptr + b)
    top_k = tl.load(top_k_ptr + b)
    top_p = tl.load(top_p_ptr + b)
    seed = tl.load(seed_ptr + b)
    offset = tl.load(offset_ptr + b)
    greedy = temperature == 0.0
    logits_b = logits_ptr + b * stride_lb
    work_row = work_ptr + b * V

    offs_n = tl.arange(0, BLOCK_N)
    parents = tl.load(parents_ptr + b * N + offs_n, mask=offs_n < N, other=-2)
    tokens = tl.load(tokens_ptr + b * N + offs_n, mask=offs_n < N, other=-1)
    # Every coin the walk may need, in two vectorised Philox calls: accept coin of each node
    # (as a child) and bonus coin of each node (as the last accepted node).
    accept_coins = _uniform(seed, offset, offs_n, ACCEPT_DRAW)
    bonus_coins = _uniform(seed, offset, offs_n, BONUS_DRAW)
    offs_a = tl.arange(0, BLOCK_A)
    tl.store(accept_nodes_ptr + b * A + offs_a, tl.where(offs_a == 0, 0, -1), mask=offs_a < A)
    tl.store(out_tokens_ptr + b * A + offs_a, tl.full([BLOCK_A], -1, tl.int64), mask=offs_a < A)

    node = tl.zeros([], tl.int32)
    depth = tl.zeros([], tl.int32)
    done = tl.zeros([], tl.int32)
    bad = tl.zeros([], tl.int32)
    while done == 0:
        row = logits_b + node * stride_ln
        # Pass 1: max, first argmax, and the bad-row flags.
        row_max = tl.full([], float("-inf"), CT)
        arg = 0
        flags = 0  # bit 0: NaN or +inf seen, bit 1: a finite entry seen
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < V
            x = tl.load(row + offs, mask=valid, other=float("-inf")).to(CT)
            nonfinite_bad = (x != x) | (x == float("inf"))
            finite = (x > float("-inf")) & (x < float("inf"))
            flags = flags | tl.max((nonfinite_bad & valid).to(tl.int32), axis=0) \
                | (tl.max((finite & valid).to(tl.int32), axis=0) * 2)
            tile_max = tl.max(tl.where(valid & (x == x), x, float("-inf")), axis=0)
            tile_arg = tl.min(tl.where(valid & (x == tile_max), offs, V), axis=0)
            better = tile_max > row_max
            arg = tl.where(better, tile_arg, arg)
            row_max = tl.where(better, tile_max, row_max)
        if ((flags & 1) != 0) | ((flags & 2) == 0):
            bad = 1
            done = 1
        else:
            may_descend = depth < max_depth  # a node at max_depth is a leaf
            child = -1
            if greedy:
                hit = (parents == node) & (tokens == arg) & (offs_n > node) & may_descend
                first = tl.min(tl.where(hit, offs_n, BLOCK_N), axis=0)
                child = tl.where(first < BLOCK_N, first, -1)
                if child < 0:
                    tl.store(out_tokens_ptr + b * A + depth, arg.to(tl.int64))
                    done = 1
            else:
                _build_weights(row, work_row, V, row_max, temperature, top_k, top_p, CT, IS_FP64, BLOCK_V, RADIX_BITS)
                if may_descend:
                    mass = _row_sum64(work_row, V, BLOCK_V)
                    for c in range(node + 1, N):
                        parent = tl.load(parents_ptr + b * N + c)
                        if (parent == node) & (child < 0):
                            x = tl.load(tokens_ptr + b * N + c)
                            wx = tl.load(work_row + x)
                            u = tl.sum(tl.where(offs_n == c, accept_coins, 0.0), axis=0)
                            # w[x] > 0 first: a coin of 0 never accepts a zero-probability token.
                            if (wx > 0) & (u < wx.to(tl.float64) / mass):
                                child = c
                            elif wx > 0:  # reject: zero p(x) and renormalise
                                tl.store(work_row + x, tl.zeros([], CT))
                                tl.debug_barrier()
                                mass = _row_sum64(work_row, V, BLOCK_V)
                if child < 0:
                    u = tl.sum(tl.where(offs_n == node, bonus_coins, 0.0), axis=0)
                    bonus = _inverse_cdf(work_row, V, u, BLOCK_V)
                    tl.store(out_tokens_ptr + b * A + depth, bonus.to(tl.int64))
                    done = 1
            if done == 0:
                depth += 1
                tl.store(accept_nodes_ptr + b * A + depth, child)
                tl.store(out_tokens_ptr + b * A + depth - 1, tl.load(tokens_ptr + b * N + child))
                node = child
    if bad != 0:
        # Fallback: accept nothing; the bonus is the argmax over the finite root logits (0 if none).
        best = tl.full([], float("-inf"), CT)
        arg = -1
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < V
            x = tl.load(logits_b + offs, mask=valid, other=float("-inf")).to(CT)
            finite = valid & (x > float("-inf")) & (x < float("inf"))
            tile_best = tl.max(tl.where(finite, x, float("-inf")), axis=0)
            tile_arg = tl.min(tl.where(finite & (x == tile_best), offs, V), axis=0)
            better = (tile_arg < V) & ((arg < 0) | (tile_best > best))
            arg = tl.where(better, tile_arg, arg)
            best = tl.where(better, tile_best, best)
        tl.store(accept_nodes_ptr + b * A + offs_a, tl.where(offs_a == 0, 0, -1), mask=offs_a < A)
        tl.store(out_tokens_ptr + b * A + offs_a,
                 tl.where(offs_a == 0, tl.maximum(arg, 0).to(tl.int64), -1), mask=offs_a < A)
        depth = 0
    tl.store(accept_len_ptr + b, depth)
    tl.store(status_ptr + b, bad)


def verify(tokens, parents, target_logits, *, max_depth, temperature=None, top_k=None, top_p=None,
           seed=None, offset=None) -> VerifyOutput:
    """Triton launcher with the contract signature (shapes as ``eagle_kernels.reference.verify``).

    Shapes
    ------
    tokens int64 [B, N], parents int32 [B, N], target_logits [B, N, V]; optional float32 /
    int32 / float32 / int64 / int64 [B] temperature, top_k, top_p, seed, offset.
    Returns VerifyOutput(accept_len [B], accept_nodes [B, max_depth + 1],
    out_tokens [B, max_depth + 1], status [B]).
    """
    _checks.check_verify(tokens, parents, target_logits, max_depth=max_depth, temperature=temperature,
                         top_k=top_k, top_p=top_p, seed=seed, offset=offset)
    B, N, V = target_logits.shape
    device = target_logits.device
    # Rows are read in place when their entries are contiguous; otherwise one dense copy.
    logits = target_logits if target_logits.stride(2) == 1 else target_logits.contiguous()

    def given(t, fill, dtype):
        return torch.full((B,), fill, dtype=dtype, device=device) if t is None else t.contiguous()

    temperature = given(temperature, 0.0, torch.float32)
    top_k = given(top_k, 0, torch.int32)
    top_p = given(top_p, 1.0, torch.float32)
    seed = given(seed, 0, torch.int64)
    offset = given(offset, 0, torch.int64)
    is_fp64 = target_logits.dtype == torch.float64
    work = torch.empty((B, V), dtype=torch.float64 if is_fp64 else torch.float32, device=device)

    A = max_depth + 1
    accept_len = torch.empty(B, dtype=torch.int32, device=device)
    accept_nodes = torch.empty((B, A), dtype=torch.int32, device=device)
    out_tokens = torch.empty((B, A), dtype=torch.int64, device=device)
    status = torch.empty(B, dtype=torch.int32, device=device)
    if B == 0:
        return VerifyOutput(accept_len, accept_nodes, out_tokens, status)
    block_v = min(1024, triton.next_power_of_2(V))
    _verify_kernel[(B,)](
        tokens.contiguous(), parents.contiguous(), logits, temperature, top_k, top_p, seed, offset, work,
        accept_len, accept_nodes, out_tokens, status,
        N, V, max_depth, logits.stride(0), logits.stride(1),
        IS_FP64=is_fp64, BLOCK_V=block_v, BLOCK_N=triton.next_power_of_2(N),
        BLOCK_A=triton.next_power_of_2(A), RADIX_BITS=RADIX_BITS, num_warps=4,
    )
    return VerifyOutput(accept_len, accept_nodes, out_tokens, status)
