"""Reference ``draft_expand``: one depth of EAGLE-2 dynamic tree expansion (Li et al. 2024,
§4.1: each frontier node proposes its top-k tokens; cumulative log-probs rank the next
frontier), with optionally *sampled* children for requests decoded at a temperature: k draws
without replacement from the draft distribution by Gumbel-top-k (Kool, van Hoof, Welling 2019,
"Stochastic beams and where to find them"), which ``verify``'s draft-aware rule then accepts
exactly (docs/ops.md §2, §4)."""

from __future__ import annotations

import torch

from .. import _checks
from .._types import DraftCandidates
from .build_tree import selection_order
from .random import uniform

DRAFT_DRAW = 2  # first draw index of draft_expand's Gumbel draws (docs/design.md)
DEPTH_STRIDE = 65536  # draw = DRAFT_DRAW + depth * DEPTH_STRIDE + frontier row


def gumbel_keys(logp: torch.Tensor, seed: int, offset: int, depth: int, row: int) -> torch.Tensor:
    """``logp(x) - log(-log U_x)`` in float64 for one frontier row: the exponential-race keys
    whose ``top_k`` largest are ``top_k`` draws without replacement from ``exp(logp)``."""
    ids = torch.arange(logp.shape[-1], dtype=torch.int64)
    u = uniform(seed, offset, ids, DRAFT_DRAW + depth * DEPTH_STRIDE + row)
    # U = 0 gives -log U = inf and a key of -inf: never drawn before a finite key.
    return logp.to(torch.float64).cpu() - torch.log(-torch.log(u))


def draft_expand(logits, frontier_scores, top_k, *, d2t=None, temperature=None, seed=None, offset=None,
                 depth=0) -> DraftCandidates:
    """Expand the M frontier nodes of each request by ``top_k`` tokens: the most likely ones, or,
    for a request with ``temperature[b] > 0``, ``top_k`` draws without replacement from
    ``softmax(logits / temperature)`` in draw order.

    Shapes
    ------
    logits [B, M, Vd] (any float dtype); frontier_scores float32 [B, M]; d2t int64 [Vd];
    temperature float32 [B]; seed, offset int64 [B]; depth: int, the expansion step.

    Returns
    -------
    DraftCandidates(tokens int64 [B, M * top_k], scores float32 [B, M * top_k],
    frontier int32 [B, top_k], logprobs float32 [B, M * top_k]); candidate ``m * top_k + r`` is
    rank ``r`` (the ``r``-th draw) of node ``m``.
    """
    _checks.check_draft_expand(logits, frontier_scores, top_k, d2t=d2t, temperature=temperature, seed=seed,
                               offset=offset, depth=depth)
    B, M, _ = logits.shape
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    ids = torch.empty(B, M, top_k, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, M, top_k, dtype=dtype, device=logits.device)
    for b in range(B):
        row_temperature = 0.0 if temperature is None else float(temperature[b])
        if row_temperature > 0.0:
            row_seed = 0 if seed is None else int(seed[b])
            row_offset = 0 if offset is None else int(offset[b])
            # Shift before dividing (as verify does): a tiny temperature then gives -inf, not inf - inf.
            rows = logits[b].to(dtype)
            scaled = (rows - rows.max(dim=-1, keepdim=True).values) / torch.tensor(
                row_temperature, dtype=torch.float32).to(dtype)
            logp = torch.log_softmax(scaled, dim=-1)
            for m in range(M):
                keys = gumbel_keys(logp[m], row_seed, row_offset, depth, m)
                # Stable descending sort: equal keys in id order (ties: smaller id first).
                drawn = torch.sort(keys, descending=True, stable=True).indices[:top_k].to(logits.device)
                ids[b, m] = drawn
                logprobs[b, m] = logp[m, drawn]
        else:
            logp = torch.log_softmax(logits[b].to(dtype), dim=-1)
            order = torch.sort(logp, dim=-1, descending=True, stable=True)
            ids[b] = order.indices[..., :top_k]
            logprobs[b] = order.values[..., :top_k]
    scores = (frontier_scores.to(dtype)[..., None] + logprobs).to(torch.float32).reshape(B, M * top_k)
    tokens = ids if d2t is None else ids + d2t[ids]
    frontier = torch.empty(B, top_k, dtype=torch.int32, device=logits.device)  # B = 0: no rows to stack
    for b, row in enumerate(scores):
        frontier[b] = selection_order(row)[:top_k]
    return DraftCandidates(tokens.reshape(B, M * top_k), scores, frontier,
                           logprobs.to(torch.float32).reshape(B, M * top_k))
