"""Vectorised conversions between the engines' tree layouts and ours (docs/ops.md §0).

Everything here is tensor code with shapes fixed by the inputs' shapes: no Python loop runs over
nodes or requests, and nothing reads a tensor's values on the host, so the adapters can be
captured in a CUDA graph. The loops that remain run over ``ceil(log2(N))`` pointer-jumping
rounds or over the tree depth, both known from shapes or arguments.

SGLang's layout (``sglang.srt.speculative``): node ``i`` of request ``b`` is row ``b * N + i``
of the flattened verify batch; ``retrieve_next_token[b, i]`` is the first child of ``i`` and
``retrieve_next_sibling[b, i]`` the next sibling (``-1``: none); node 0 is the root.
"""

from __future__ import annotations

import math

import torch

from .._types import Tree


def _jump_rounds(n: int) -> int:
    return max(1, math.ceil(math.log2(max(n, 2))))


def tree_from_selection(parent_list: torch.Tensor, selected: torch.Tensor, topk: int, depth: int):
    """Our tree (parents, depths, ancestor mask) from SGLang's choice of candidates.

    ``selected`` int64 ``[B, N - 1]``: the chosen candidates (indices into the flattened
    ``[topk + (depth - 1) * topk^2]`` candidate list of all draft steps, ascending).
    ``parent_list`` int64 ``[B, 1 + (depth - 1) * topk]``: entry ``s // topk`` of candidate ``s``
    is its parent candidate; ``s // topk == 0`` means a child of the root.

    Returns ``(parents, linked, depths, ancestors)``: ``parents`` int64 ``[B, N]`` (node 0: -1),
    ``linked`` bool ``[B, N]`` (False for a node whose parent candidate was not selected: SGLang
    leaves such a node out of the tree links and masks it as a child of the root, as its Triton
    kernel does), ``depths`` int64 ``[B, N]``, ``ancestors`` bool ``[B, N, N]`` (row ``i``: ``i``
    itself and its ancestors, root included).
    """
    B, M = selected.shape
    N = M + 1
    device = selected.device
    sel = selected.long()
    tb = torch.div(sel, topk, rounding_mode="floor")
    if parent_list.shape[1] > 0:
        parent_cand = parent_list.long().gather(1, tb.clamp(0, parent_list.shape[1] - 1))
    else:
        parent_cand = torch.full_like(sel, -1)
    # Node of the parent candidate: the first selected position holding it, plus one.
    eq = sel[:, None, :] == parent_cand[:, :, None]  # [B, M (child), M (candidate position)]
    found = eq.any(-1)
    pos = eq.to(torch.uint8).argmax(-1) + 1
    of_root = tb == 0
    parent_nodes = torch.where(of_root, 0, torch.where(found, pos, 0))
    linked_nodes = of_root | found
    minus_one = torch.full((B, 1), -1, dtype=torch.long, device=device)
    parents = torch.cat([minus_one, parent_nodes], dim=1)
    linked = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=device), linked_nodes], dim=1)
    # Ancestors by walking every node up `depth` levels at once (SGLang's trees are at most
    # `depth` deep; its kernels stop there too).
    ar = torch.arange(N, device=device)
    ancestors = torch.zeros(B, N, N, dtype=torch.bool, device=device)
    ancestors[:, :, 0] = True
    depths = torch.zeros(B, N, dtype=torch.long, device=device)
    cur = ar.expand(B, N).clone()
    hop = torch.where(parents >= 0, parents, 0)
    for _ in range(depth):
        active = cur > 0
        ancestors.scatter_(2, cur[:, :, None], active[:, :, None] | (cur == 0)[:, :, None])
        depths += active.long()
        cur = hop.gather(1, cur)
    return parents, linked, depths, ancestors


def first_child_next_sibling(parents: torch.Tensor, linked: torch.Tensor):
    """SGLang's links from parents: the first child is the smallest child index, siblings follow
    in increasing index (what its build kernels produce). Unlinked nodes get no links.
    Returns ``(next_token, next_sibling)`` int64 ``[B, N]``."""
    B, N = parents.shape
    device = parents.device
    ar = torch.arange(N, device=device)
    eff = torch.where(linked, parents, -2)
    eff[:, 0] = -2
    # same[b, i, j]: j is a linked child of i's parent after i (a later sibling of i).
    same = (eff[:, :, None] == eff[:, None, :]) & (eff[:, :, None] >= 0) & (ar[None, None, :] > ar[None, :, None])
    big = torch.full((), N, device=device)
    nxt = torch.where(same, ar, big).amin(-1)
    next_sibling = torch.where(nxt < N, nxt, -1)
    child = eff[:, None, :] == ar[None, :, None]  # [B, parent, child]
    first = torch.where(child, ar, big).amin(-1)
    next_token = torch.where(first < N, first, -1)
    return next_token, next_sibling


def mask_words_from_ancestors(ancestors: torch.Tensor) -> torch.Tensor:
    """Our int64 mask words ``[B, N, ceil(N / 64)]`` from a bool ancestor matrix."""
    B, N, _ = ancestors.shape
    W = (N + 63) // 64
    padded = torch.zeros(B, N, W * 64, dtype=torch.long, device=ancestors.device)
    padded[:, :, :N] = ancestors.long()
    shifts = torch.arange(64, device=ancestors.device)
    # Bit 63 is the sign bit: the sum wraps exactly as the two's-complement word.
    return (padded.view(B, N, W, 64) << shifts).sum(-1)


def tree_of_selection(root_tokens, draft_tokens, parent_list, selected, topk, depth) -> Tree:
    """Our :class:`~eagle_kernels.Tree` of SGLang's selected candidates (see
    :func:`tree_from_selection`), with ``tokens = [root, drafts...]``."""
    parents, linked, depths, ancestors = tree_from_selection(parent_list, selected, topk, depth)
    tokens = torch.cat([root_tokens.long()[:, None], draft_tokens.long()], dim=1)
    return Tree(tokens, parents.int(), depths.int(), mask_words_from_ancestors(ancestors))


def parents_from_links(next_token: torch.Tensor, next_sibling: torch.Tensor):
    """Invert SGLang's first-child / next-sibling links.

    Returns ``(parent, rank)`` int64 ``[B, N]``: ``parent`` is -1 for the root and for nodes no
    link reaches; ``rank`` is a node's place in its sibling chain (0 for the first child).
    """
    B, N = next_token.shape
    device = next_token.device
    ar = torch.arange(N, device=device).expand(B, N)
    nt = next_token.long()
    ns = next_sibling.long()
    dummy = torch.full_like(nt, N)
    first_of = torch.full((B, N + 1), -1, dtype=torch.long, device=device)
    first_of.scatter_(1, torch.where((nt >= 0) & (nt < N), nt, dummy), ar)
    prev = torch.full((B, N + 1), -1, dtype=torch.long, device=device)
    prev.scatter_(1, torch.where((ns >= 0) & (ns < N), ns, dummy), ar)
    prev = prev[:, :N]
    head = torch.where(prev >= 0, prev, ar)
    rank = (prev >= 0).long()
    for _ in range(_jump_rounds(N)):
        rank = rank + rank.gather(1, head)
        head = head.gather(1, head)
    parent = first_of[:, :N].gather(1, head)
    parent[:, 0] = -1
    return parent, rank


def topological_order(parent: torch.Tensor):
    """A node order in which parents come first: by depth, then by node index.

    ``parent`` int64 ``[B, N]`` with -1 for the root and for unreached nodes (these are placed
    at depth 1, under the root). Returns ``(order, new_parents)``: ``order[b, k]`` is the node at
    new index ``k`` (``order[:, 0] == 0``), ``new_parents`` int32 ``[B, N]`` in new indices.
    """
    B, N = parent.shape
    device = parent.device
    ar = torch.arange(N, device=device).expand(B, N)
    par = torch.where(parent >= 0, parent, 0)
    par[:, 0] = 0
    hop = par.clone()
    depth = (ar > 0).long()
    for _ in range(_jump_rounds(N)):
        depth = depth + depth.gather(1, hop)
        hop = hop.gather(1, hop)
    order = torch.argsort(depth * N + ar, dim=1)
    inverse = torch.empty_like(order).scatter_(1, order, ar)
    new_parents = inverse.gather(1, par.gather(1, order))
    new_parents[:, 0] = -1
    return order, new_parents.int()


def verify_order(parent: torch.Tensor):
    """The node order verify gets: the nodes' own indices where every parent already precedes
    its child (SGLang's own build; unreached nodes count as children of the root), else
    :func:`topological_order`, decided per request without reading values on the host. The
    native CPU conversion (``torch.ops.eagle_kernels.sglang_*``) uses the same rule.
    Returns ``(order, new_parents)`` as :func:`topological_order`."""
    B, N = parent.shape
    ar = torch.arange(N, device=parent.device).expand(B, N)
    par = torch.where(parent >= 0, parent, 0)
    in_order = (par[:, 1:] < ar[:, 1:]).all(-1, keepdim=True)
    order, new_parents = topological_order(parent)
    own = par.int()
    own[:, 0] = -1
    return torch.where(in_order, ar, order), torch.where(in_order, own, new_parents)
