"""A whole EAGLE-2 draft-tree expansion on the device: root -> depth ``depth`` -> build_tree.

EAGLE-2 (Li et al. 2024, §4.1-4.2): the root proposes its ``top_k`` most likely tokens; at each
further depth the ``top_k`` best candidates so far (the frontier, ranked by cumulative log-prob)
each propose ``top_k`` children; finally the ``num_nodes - 1`` best candidates of the whole
history form the verify tree. Every step is one ``eagle_kernels.draft_expand`` call and the
end is one ``eagle_kernels.build_tree`` call; all shapes are static and nothing reads tensor
values on the host, so the loop can run under CUDA graphs (with
``EAGLE_KERNELS_CHECK_VALUES=0`` so the ops skip their data-reading checks).
:class:`eagle_kernels.decoder.SpeculativeDecoder` drafts every step through it, with its EAGLE
head as ``draft_fn`` (docs/decoding.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from . import bookkeeping, ops
from ._types import Tree

DraftFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Expansion(NamedTuple):
    """Result of :func:`expand_tree`. Shapes: ``tree`` as :class:`eagle_kernels.Tree` with
    ``N = num_nodes``; candidate history ``cand_tokens`` int64 [B, C], ``cand_scores``
    float32 [B, C], ``cand_parents`` int32 [B, C] with ``C = top_k + (depth - 1) * top_k**2``."""

    tree: Tree
    cand_tokens: torch.Tensor
    cand_scores: torch.Tensor
    cand_parents: torch.Tensor


class ExpansionStart(NamedTuple):
    """The inputs of an expansion's first step (the root alone), int64 / int64 / float32 [B, 1]:
    no parent row and no history index (-1), score 0. :func:`expansion_start` makes them; a
    caller that expands every decoding step keeps one (never written) and passes it as
    ``expand_tree(..., start=)``, so a step does not fill them again."""

    parent_row: torch.Tensor
    cand_index: torch.Tensor
    frontier_scores: torch.Tensor


def expansion_start(batch: int, device) -> ExpansionStart:
    """:class:`ExpansionStart` for ``batch`` requests on ``device`` (two fills)."""
    parent_row, cand_index = torch.full((2, batch, 1), -1, dtype=torch.int64, device=device).unbind(0)
    return ExpansionStart(parent_row, cand_index, torch.zeros(batch, 1, dtype=torch.float32, device=device))


def _draft_logits(draft_fn: DraftFn, step, tokens, parent_row, cand_index, inputs=None) -> torch.Tensor:
    """``draft_fn``'s logits for the ``M`` nodes of ``tokens`` [B, M], checked to be [B, M, Vd]."""
    B, M = tokens.shape
    logits = (draft_fn(step, tokens, parent_row, cand_index) if inputs is None
              else draft_fn(step, tokens, parent_row, cand_index, inputs=inputs))
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != (B, M):
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"draft_fn: expected logits of shape [B = {B}, M = {M}, Vd] at step {step}, got {got}")
    return logits


def num_candidates(depth: int, top_k: int) -> int:
    """Size ``C`` of the candidate history of :func:`expand_tree`."""
    return top_k + (depth - 1) * top_k * top_k


def expand_tree(draft_fn: DraftFn, root_tokens: torch.Tensor, *, depth: int, top_k: int,
                num_nodes: int, d2t: torch.Tensor | None = None, start: ExpansionStart | None = None) -> Expansion:
    """Run an EAGLE-2 expansion of ``depth`` steps with ``draft_fn`` and build the verify tree.

    Parameters
    ----------
    draft_fn
        ``draft_fn(step, tokens, parent_row, cand_index) -> logits``, called once per step
        ``step = 0 .. depth - 1`` with the ``M`` nodes to expand (``M = 1`` at step 0, else
        ``top_k``):

        - ``tokens`` int64 [B, M]: the nodes' tokens (step 0: the root tokens), in the target
          vocabulary when ``d2t`` is given (as ``draft_expand`` returns them);
        - ``parent_row`` int64 [B, M]: for each node, the row of the previous call's logits
          that proposed it (-1 at step 0). An EAGLE head keeps its last hidden states
          ``h [B, M_prev, H]`` in its closure and continues from
          ``h.gather(1, parent_row[..., None].expand(-1, -1, H))``;
        - ``cand_index`` int64 [B, M]: each node's index in the candidate history (-1 for the
          root), for heads that keep per-candidate state or build a draft attention mask from
          ``cand_parents``.

        It returns the draft logits ``[B, M, Vd]`` (any float dtype ``draft_expand`` takes).
        It must not read tensor values on the host if the expansion is to stay sync-free.

        A draft function with a method ``next_inputs(step)`` (an EAGLE head's: the decoder's)
        returns there the :class:`~eagle_kernels.bookkeeping.DraftInputs` its pass at ``step``
        reads; each step's ``bookkeeping.expansion_step`` then gathers that pass's inputs in
        the same launch and the call gets them as ``draft_fn(..., inputs=(feature, positions,
        embed))`` (:func:`eagle_kernels.bookkeeping.draft_inputs`'s result).
    root_tokens
        int64 [B]: the last committed token of each request (node 0 of the tree).
    depth
        Number of expansion steps (>= 1): the deepest draft node sits at depth ``depth``.
    top_k
        Children per expanded node, and frontier size.
    num_nodes
        Tree size ``N`` including the root; ``num_nodes - 1 <= C``.
    d2t
        Optional int64 [Vd] draft-to-target offsets (EAGLE-3), passed to ``draft_expand``.
    start
        The first step's inputs for ``B`` requests (:func:`expansion_start`), kept by the
        caller; None: made here (two fills).

    Returns
    -------
    Expansion
        ``(tree, cand_tokens, cand_scores, cand_parents)``.

    Shapes
    ------
    root_tokens [B] -> tree.tokens [B, N], tree.parents [B, N], tree.depths [B, N],
    tree.mask [B, N, ceil(N / 64)]; cand_* [B, C] with C = top_k + (depth - 1) * top_k**2.
    Candidate ``c`` of step ``s >= 1`` sits at ``top_k + (s - 1) * top_k**2 + m * top_k + r``
    (child ``r`` of frontier node ``m``), as in ``draft_expand``'s layout.
    """
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth: expected an int >= 1, got {depth!r}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k: expected an int >= 1, got {top_k!r}")
    if not isinstance(root_tokens, torch.Tensor) or root_tokens.dim() != 1 or root_tokens.dtype != torch.int64:
        got = f"dtype {root_tokens.dtype}, shape {tuple(root_tokens.shape)}" if isinstance(
            root_tokens, torch.Tensor) else type(root_tokens).__name__
        raise ValueError(f"root_tokens: expected an int64 tensor of shape [B], got {got}")
    C = num_candidates(depth, top_k)
    if not isinstance(num_nodes, int) or not 1 <= num_nodes <= C + 1:
        raise ValueError(f"num_nodes: expected an int in [1, C + 1 = {C + 1}], got {num_nodes!r}")
    B = root_tokens.shape[0]
    device = root_tokens.device
    k = top_k

    cand_tokens = torch.empty(B, C, dtype=torch.int64, device=device)
    cand_scores = torch.empty(B, C, dtype=torch.float32, device=device)
    cand_parents = torch.empty(B, C, dtype=torch.int32, device=device)

    tokens = root_tokens[:, None]
    # Step 0 expands the root alone: no parent row, no history index (-1), score 0.
    if start is None:
        start = expansion_start(B, device)
    elif any(tuple(t.shape) != (B, 1) or t.device != device for t in start):
        raise ValueError(f"start: expected tensors of shape [B = {B}, 1] on {device}, got "
                         f"{[(tuple(t.shape), str(t.device)) for t in start]}")
    parent_row, cand_index, frontier_scores = start
    next_inputs = getattr(draft_fn, "next_inputs", None)
    inputs, offset = None, 0
    for step in range(depth):
        M = tokens.shape[1]
        logits = _draft_logits(draft_fn, step, tokens, parent_row, cand_index, inputs)
        out = ops.draft_expand(logits, frontier_scores, k, d2t=d2t)
        # The candidates into the history (child r of node m has the node's history index as
        # parent, -1 under the root); the frontier's tokens, scores, parent rows (indices into
        # this step's M nodes) and history indices, and the next head pass's inputs: one
        # launch on the GPU path.
        draft = next_inputs(step + 1) if next_inputs is not None and step + 1 < depth else None
        tokens, frontier_scores, parent_row, cand_index, inputs = bookkeeping.expansion_step(
            out.tokens, out.scores, out.frontier, cand_index, cand_tokens, cand_scores, cand_parents, offset, k,
            draft)
        offset += M * k
    tree = ops.build_tree(root_tokens, cand_tokens, cand_scores, cand_parents, num_nodes)
    return Expansion(tree, cand_tokens, cand_scores, cand_parents)


class SampledExpansion(NamedTuple):
    """Result of :func:`expand_sampled_tree`: ``tree`` holds every candidate (``N = C + 1``
    nodes, node ``c + 1`` is candidate ``c``); ``draft_probs`` float32 [B, N, Vd] is row ``u`` =
    the draft distribution node ``u``'s children were drawn from (zeros for the nodes that were
    not expanded), as ``verify`` takes it; ``cand_*`` as in :class:`Expansion`."""

    tree: Tree
    draft_probs: torch.Tensor
    cand_tokens: torch.Tensor
    cand_scores: torch.Tensor
    cand_parents: torch.Tensor


def sampled_num_candidates(depth: int, top_k: int, frontier: int) -> int:
    """Size ``C`` of the candidate history of :func:`expand_sampled_tree`: ``top_k`` children of
    the root, then ``frontier * top_k`` per further depth."""
    return top_k + (depth - 1) * frontier * top_k


def draft_distribution(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``q = softmax((logits - max) / T)`` float32 [B, M, Vd] per request, computed as
    ``draft_expand`` computes the log-probabilities it draws from (docs/ops.md §2); requests with
    ``T = 0`` get ``T = 1`` (their drafts are deterministic and verify never reads their rows)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    rows = logits.to(dtype)
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(dtype)
    scaled = (rows - rows.amax(dim=-1, keepdim=True)) / scale[:, None, None]
    return torch.log_softmax(scaled, dim=-1).exp().to(torch.float32)


def expand_sampled_tree(draft_fn: DraftFn, root_tokens: torch.Tensor, *, depth: int, top_k: int, frontier: int,
                        temperature: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                        d2t: torch.Tensor | None = None) -> SampledExpansion:
    """A draft tree whose children are sampled (``draft_expand`` at the requests' temperatures),
    kept whole so that ``verify``'s draft-aware rule is exact.

    EAGLE-2's final re-ranking (``build_tree`` keeping the best ``num_nodes - 1``) would keep a
    sampled child depending on its own draw, which biases the draws ``verify`` assumes. Here the
    choice of which nodes to expand may depend on everything drawn before (the frontier: the
    ``frontier`` best candidates of a depth by cumulative score, ties toward the smaller index),
    but every expanded node keeps all its ``top_k`` draws, and the tree is every candidate. The
    draws of step ``s`` use ``depth = s`` of the request's stream (``seed``, ``offset``), so no two
    draws of a step share a counter, nor with ``verify``'s draws at the same offset.

    Parameters
    ----------
    draft_fn, root_tokens, depth, top_k, d2t
        As in :func:`expand_tree`; ``draft_fn`` gets ``M = frontier`` nodes at steps >= 1.
    frontier
        Nodes expanded per depth after the root, in ``[1, top_k]``.
    temperature, seed, offset
        float32 / int64 / int64 [B], as ``draft_expand`` takes them. Requests with temperature 0
        take the ``top_k`` most likely children (deterministic drafts, in the same tree shape).

    Returns
    -------
    SampledExpansion
        ``tree`` with ``N = C + 1`` nodes, ``C = top_k + (depth - 1) * frontier * top_k``, and
        ``draft_probs`` [B, N, Vd]. Static shapes, no host reads.
    """
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth: expected an int >= 1, got {depth!r}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k: expected an int >= 1, got {top_k!r}")
    if not isinstance(frontier, int) or not 1 <= frontier <= top_k:
        raise ValueError(f"frontier: expected an int in [1, top_k = {top_k}], got {frontier!r}")
    if not isinstance(root_tokens, torch.Tensor) or root_tokens.dim() != 1 or root_tokens.dtype != torch.int64:
        got = f"dtype {root_tokens.dtype}, shape {tuple(root_tokens.shape)}" if isinstance(
            root_tokens, torch.Tensor) else type(root_tokens).__name__
        raise ValueError(f"root_tokens: expected an int64 tensor of shape [B], got {got}")
    B, device, k = root_tokens.shape[0], root_tokens.device, top_k
    C = sampled_num_candidates(depth, k, frontier)
    cand_tokens = torch.empty(B, C, dtype=torch.int64, device=device)
    cand_scores = torch.empty(B, C, dtype=torch.float32, device=device)
    cand_parents = torch.empty(B, C, dtype=torch.int32, device=device)
    draft_probs = None

    tokens = root_tokens[:, None]
    parent_row = torch.full((B, 1), -1, dtype=torch.int64, device=device)
    cand_index = torch.full((B, 1), -1, dtype=torch.int64, device=device)
    frontier_scores = torch.zeros(B, 1, dtype=torch.float32, device=device)
    start = 0
    for step in range(depth):
        M = tokens.shape[1]
        logits = _draft_logits(draft_fn, step, tokens, parent_row, cand_index)
        if draft_probs is None:
            draft_probs = torch.zeros(B, C + 1, logits.shape[-1], dtype=torch.float32, device=device)
        # Row of each expanded node: the root is node 0, candidate c is node c + 1.
        nodes = (cand_index + 1)[..., None].expand(-1, -1, logits.shape[-1])
        draft_probs.scatter_(1, nodes, draft_distribution(logits, temperature))
        out = ops.draft_expand(logits, frontier_scores, k, d2t=d2t, temperature=temperature, seed=seed,
                               offset=offset, depth=step)
        width = M * k
        cand_tokens[:, start:start + width] = out.tokens
        cand_scores[:, start:start + width] = out.scores
        cand_parents[:, start:start + width] = cand_index[:, :, None].expand(B, M, k).reshape(B, width)
        if frontier == k:
            chosen = out.frontier.long()
        else:  # the draft_expand frontier rule with another size: stable, NaN ranked as -inf
            key = torch.where(out.scores.isnan(), float("-inf"), out.scores)
            chosen = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :frontier]
        tokens = torch.gather(out.tokens, 1, chosen)
        frontier_scores = torch.gather(out.scores, 1, chosen)
        parent_row = torch.div(chosen, k, rounding_mode="floor")
        cand_index = chosen + start
        start += width
    # Every candidate is kept: build_tree with N = C + 1 only lays them out (in candidate order).
    tree = ops.build_tree(root_tokens, cand_tokens, cand_scores, cand_parents, C + 1)
    return SampledExpansion(tree, draft_probs, cand_tokens, cand_scores, cand_parents)
