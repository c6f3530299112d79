"""Reference ``draft_expand``: one depth of EAGLE-2 dynamic tree expansion (Li et al. 2024,
§4.1: each frontier node proposes its top-k tokens; cumulative log-probs rank the next
frontier)."""

from __future__ import annotations

import torch

from .. import _checks
from .._types import DraftCandidates
from .build_tree import selection_order


def draft_expand(logits, frontier_scores, top_k, *, d2t=None) -> DraftCandidates:
    """Expand the M frontier nodes of each request by their ``top_k`` most likely tokens.

    Shapes
    ------
    logits [B, M, Vd] (any float dtype); frontier_scores float32 [B, M]; d2t int64 [Vd].

    Returns
    -------
    DraftCandidates(tokens int64 [B, M * top_k], scores float32 [B, M * top_k],
    frontier int32 [B, top_k]); candidate ``m * top_k + r`` is rank ``r`` of node ``m``.
    """
    _checks.check_draft_expand(logits, frontier_scores, top_k, d2t=d2t)
    B, M, _ = logits.shape
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    # A stable descending sort keeps equal log-probs in id order (ties: smaller id first).
    order = torch.sort(logp, dim=-1, descending=True, stable=True)
    ids = order.indices[..., :top_k]
    scores = (frontier_scores.to(dtype)[..., None] + order.values[..., :top_k]).to(torch.float32)
    scores = scores.reshape(B, M * top_k)
    tokens = ids if d2t is None else ids + d2t[ids]
    frontier = torch.stack([selection_order(row)[:top_k] for row in scores]).to(torch.int32)
    return DraftCandidates(tokens.reshape(B, M * top_k), scores, frontier)
