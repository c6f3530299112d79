"""Reference ``build_tree``: EAGLE-2 re-ranking of the expansion history into a verify tree
(Li et al. 2024, "EAGLE-2", §4.2: keep the top ``N - 1`` candidates by cumulative score)."""

from __future__ import annotations

import torch

from .. import _checks
from .._types import Tree


def selection_order(scores: torch.Tensor) -> torch.Tensor:
    """Candidate indices by score descending (NaN ranked as -inf), ties by smaller index."""
    # (nan_to_num would also clamp a real -inf to the lowest finite float, splitting the tie.)
    key = torch.where(scores.isnan(), float("-inf"), scores)
    return torch.sort(key, descending=True, stable=True).indices


def build_tree(root_tokens, cand_tokens, cand_scores, cand_parents, num_nodes) -> Tree:
    """Pick the ``num_nodes - 1`` best candidates and lay them out as a tree.

    Shapes
    ------
    root_tokens int64 [B]; cand_tokens int64 [B, C]; cand_scores float32 [B, C];
    cand_parents int32 [B, C] (parent candidate, -1 for children of the root).

    Returns
    -------
    Tree(tokens int64 [B, N], parents int32 [B, N], depths int32 [B, N], mask int64 [B, N, W])
    with N = num_nodes, W = ceil(N / 64); node 0 is the root, then the selected candidates in
    increasing candidate index.
    """
    _checks.check_build_tree(root_tokens, cand_tokens, cand_scores, cand_parents, num_nodes)
    B = cand_tokens.shape[0]
    N = num_nodes
    device = cand_tokens.device
    tokens = torch.empty(B, N, dtype=torch.int64, device=device)
    parents = torch.empty(B, N, dtype=torch.int32, device=device)
    depths = torch.empty(B, N, dtype=torch.int32, device=device)
    mask = torch.zeros(B, N, _checks.mask_words(N), dtype=torch.int64, device=device)

    for b in range(B):
        chosen = sorted(int(c) for c in selection_order(cand_scores[b])[: N - 1])
        node_of = {c: i + 1 for i, c in enumerate(chosen)}
        node_tokens = [int(root_tokens[b])] + [int(cand_tokens[b, c]) for c in chosen]
        node_parents = [-1] + [node_of.get(int(cand_parents[b, c]), 0) for c in chosen]
        node_depths = [0] * N
        for node in range(1, N):
            node_depths[node] = node_depths[node_parents[node]] + 1
        for node in range(N):
            ancestor = node
            while ancestor >= 0:
                word, bit = divmod(ancestor, 64)
                # Bit 63 is the int64 sign bit: build the word with Python ints, wrap at the end.
                current = int(mask[b, node, word]) & 0xFFFFFFFFFFFFFFFF
                current |= 1 << bit
                mask[b, node, word] = current - (1 << 64) if current >= 1 << 63 else current
                ancestor = node_parents[ancestor]
        tokens[b] = torch.tensor(node_tokens, dtype=torch.int64)
        parents[b] = torch.tensor(node_parents, dtype=torch.int32)
        depths[b] = torch.tensor(node_depths, dtype=torch.int32)
    return Tree(tokens, parents, depths, mask)
