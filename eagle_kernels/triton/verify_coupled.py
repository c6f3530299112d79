"""Coupled sampling for the Triton ``verify`` (docs/ops.md §4, ``positions``): the walk of the
coupled requests, step by step over the visited rows, without a host read.

Each walk step gathers the current node's row of every request ([B, V]), builds the filtered
weights with the reference's rule in batched torch ops (scale, top-k keeping ties, softmax, top-p
by the float64 mass strictly above, renormalise), and ``_coupled_race_kernel`` (one program per
row) runs the exponential race ``argmax_x w(x) / E(x)``, ``E = -log U`` from the stream's numbers
at (seed, position + depth, x, COUPLED_DRAW), in float64, ties to the smaller id. The walk then
moves to the first child holding the winner. ``max_depth + 1`` steps of O(B V) each: the rows a
walk visits, never the [B, N, V] tensor. The launcher merges these requests' results with the main
kernel's for the greedy ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._types import VerifyOutput
from ..reference.random import COUPLED_DRAW
from .philox import _uniform

RACE_BLOCK = 1024


@triton.jit
def _coupled_race_kernel(
    weights_ptr,  # [R, V] float32 / float64, dense: the filtered weights (0 outside the support)
    seed_ptr,  # [R] int64
    position_ptr,  # [R] int64: the sequence position the row predicts
    out_ptr,  # [R] int64: the winner (-1 for a row without support)
    V,
    DRAW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + row)
    position = tl.load(position_ptr + row)
    best = tl.full((), -1.0, tl.float64)
    best_id = tl.full((), -1, tl.int64)
    for start in range(0, V, BLOCK):
        ids = start + tl.arange(0, BLOCK).to(tl.int64)
        valid = ids < V
        w = tl.load(weights_ptr + row * V + ids, mask=valid, other=0.0).to(tl.float64)
        u = _uniform(seed, position, ids, DRAW)
        ratio = tl.where(w > 0.0, w / -tl.log(u), -1.0)  # U = 0: E = inf, ratio 0
        block_best = tl.max(ratio, axis=0)
        # The block's first maximum; a later block must be strictly better (ties to the smaller id).
        block_id = tl.min(tl.where(ratio == block_best, ids, V), axis=0)
        better = block_best > best
        best_id = tl.where(better, block_id, best_id)
        best = tl.where(better, block_best, best)
    tl.store(out_ptr + row, best_id)


def coupled_race(weights: torch.Tensor, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The race's winner of each row of ``weights`` [R, V] (float32 / float64), int64 [R]."""
    R, V = weights.shape
    out = torch.empty(R, dtype=torch.int64, device=weights.device)
    if R:
        _coupled_race_kernel[(R,)](weights.contiguous(), seed.contiguous(), position.contiguous(), out, V,
                                   DRAW=COUPLED_DRAW, BLOCK=min(RACE_BLOCK, triton.next_power_of_2(V)), num_warps=4)
    return out


def filtered_weights(rows: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """The reference's ``sampling_probs`` of every row of ``rows`` [R, V] at once (float32, float64
    for float64 rows): (rows - max) / T -> top-k (ties kept) -> softmax -> top-p (float64 mass strictly
    above, ties kept) -> renormalise. ``temperature`` float32 [R] (> 0), ``top_k`` int32 [R], ``top_p``
    float32 [R]."""
    dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    rows = rows.to(dtype)
    V = rows.shape[1]
    scaled = (rows - rows.max(dim=1, keepdim=True).values) / temperature.to(dtype)[:, None]
    ascending = torch.sort(scaled, dim=1).values
    strictly_larger = V - torch.searchsorted(ascending, scaled, right=True)
    k = top_k.to(torch.int64)[:, None]
    keep = (k <= 0) | (strictly_larger < k)
    probs = torch.softmax(torch.where(keep, scaled, torch.full_like(scaled, float("-inf"))), dim=1)
    p64 = probs.to(torch.float64)
    ascending_p = torch.sort(p64, dim=1).values
    suffix = torch.cat([ascending_p.flip(1).cumsum(1).flip(1), ascending_p.new_zeros(len(rows), 1)], dim=1)
    above = torch.gather(suffix, 1, torch.searchsorted(ascending_p, p64, right=True))
    nucleus = (top_p[:, None] >= 1.0) | (above < top_p.to(torch.float64)[:, None])
    cut = torch.where(nucleus, probs, torch.zeros_like(probs))
    renormalised = cut / cut.sum(dim=1, keepdim=True)
    return torch.where(top_p[:, None] < 1.0, renormalised, probs)


def coupled_walk(tokens, parents, target_logits, max_depth, temperature, top_k, top_p, seed, positions) -> VerifyOutput:
    """VerifyOutput of every request walked by the coupled rule (the caller keeps it for the sampling
    requests only); shapes as ``verify``'s."""
    B, N, V = target_logits.shape
    device = target_logits.device
    A = max_depth + 1
    batch = torch.arange(B, device=device)
    nodes = torch.arange(N, device=device)
    t = temperature.clamp(min=torch.finfo(torch.float32).tiny)  # greedy requests' rows: discarded
    k = top_k if top_k is not None else torch.zeros(B, dtype=torch.int32, device=device)
    p = top_p if top_p is not None else torch.ones(B, dtype=torch.float32, device=device)
    s = seed if seed is not None else torch.zeros(B, dtype=torch.int64, device=device)
    accept_nodes = torch.full((B, A), -1, dtype=torch.int32, device=device)
    accept_nodes[:, 0] = 0
    out_tokens = torch.full((B, A), -1, dtype=torch.int64, device=device)
    accept_len = torch.zeros(B, dtype=torch.int32, device=device)
    current = torch.zeros(B, dtype=torch.int64, device=device)
    walking = torch.ones(B, dtype=torch.bool, device=device)
    bad = torch.zeros(B, dtype=torch.bool, device=device)
    for depth in range(A):
        rows = target_logits[batch, current]  # [B, V]
        row_bad = torch.isnan(rows).any(1) | torch.isposinf(rows).any(1) | ~torch.isfinite(rows).any(1)
        bad |= walking & row_bad
        weights = filtered_weights(torch.where(row_bad[:, None], torch.zeros_like(rows), rows), t, k, p)
        winner = coupled_race(weights, s, positions + depth)
        is_child = (parents == current[:, None].to(parents.dtype)) & (tokens == winner[:, None])
        child = torch.where(is_child, nodes, N).min(dim=1).values
        descend = walking & ~row_bad & (child < N) & (depth < max_depth)
        stop = walking & ~descend
        out_tokens[:, depth] = torch.where(descend, tokens[batch, child.clamp(max=N - 1)],
                                           torch.where(stop, winner, out_tokens[:, depth]))
        if depth + 1 < A:
            accept_nodes[:, depth + 1] = torch.where(descend, child.to(torch.int32), accept_nodes[:, depth + 1])
        accept_len += descend.to(torch.int32)
        current = torch.where(descend, child, current)
        walking = descend
    # A bad row on the walk: nothing accepted, the bonus is the argmax of the root's finite logits (0 if none).
    root = target_logits[:, 0]
    finite = torch.isfinite(root)
    fallback = torch.where(finite, root, torch.full_like(root, float("-inf"))).argmax(1)
    fallback = torch.where(finite.any(1), fallback, torch.zeros_like(fallback))
    bad_nodes = torch.full_like(accept_nodes, -1)
    bad_nodes[:, 0] = 0
    bad_tokens = torch.full_like(out_tokens, -1)
    bad_tokens[:, 0] = fallback
    return VerifyOutput(torch.where(bad, 0, accept_len), torch.where(bad[:, None], bad_nodes, accept_nodes),
                        torch.where(bad[:, None], bad_tokens, out_tokens), bad.to(torch.int32))
