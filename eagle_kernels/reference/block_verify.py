"""Reference ``block_verify``: a chain of drafts verified as one block (docs/ops.md §21).

Token-by-token verification (§4) accepts draft ``i`` with probability ``min(1, p(x_i) / q(x_i))``
and stops at the first rejection. Block verification (Sun, Mendlovic, Leviathan, Aharoni,
Beirami, Ro and Suresh 2024) carries the product of those ratios along the chain, capped at 1
(``p_i``), and keeps the longest prefix ``i`` whose coin falls under ``h_i``: the weight of the
ways the block could still continue past ``i`` (the residual mass ``R_i``) against the weight it
was cut at ``i`` (``1 - p_i``). A rejected block continues from ``max(p_t P_t - r_t, 0)``. The
output law is plain sampling's, and for a chain drawn from the draft no exact rule keeps more
drafts on average.
"""

from __future__ import annotations

import torch

from .. import _checks
from .._types import VerifyOutput
from .random import ACCEPT_DRAW, BONUS_DRAW, uniform
from .verify import draft_row, fallback_token, greedy_token, row_is_bad, sample_inverse_cdf, sampling_probs


def point_mass(token: int, V: int) -> torch.Tensor:
    """The draft row of a deterministic draft: all of its mass on ``token`` (float64)."""
    r = torch.zeros(V, dtype=torch.float64)
    r[token] = 1.0
    return r


def greedy_chain(logits: torch.Tensor, chain: list[int]) -> tuple[list[int], bool]:
    """§4's greedy walk along a chain: the emitted tokens (accepted drafts, then the bonus), and
    whether a walked row was bad."""
    emitted = []
    for i in range(len(chain) + 1):
        row = logits[i]
        if row_is_bad(row):
            return [], True
        best = greedy_token(row)
        if i == len(chain) or chain[i] != best:
            return emitted + [best], False
        emitted.append(chain[i])
    raise AssertionError("unreachable")


def block_chain(logits, chain, draft_rows, temperature, top_k, top_p, seed, offset):
    """Block verification of one sampling request: (emitted tokens, status). ``draft_rows[i]`` is
    ``r_i`` (float64 over the target vocabulary) or None where row ``i`` is invalid."""
    G = len(chain)
    if any(row_is_bad(logits[i]) for i in range(G + 1)):
        return None, 1
    status = 0
    for i in range(1, G + 1):  # the block ends before the first draft its row could not have drawn
        r = draft_rows[i - 1]
        if r is None or float(r[chain[i - 1]]) <= 0.0:
            status, G = 2, i - 1
            break
    weights = [sampling_probs(logits[i], temperature, top_k, top_p) for i in range(G + 1)]
    probs = [(w.to(torch.float64) / float(w.to(torch.float64).sum())).cpu() for w in weights]
    p = [1.0]
    for i in range(1, G + 1):
        x = chain[i - 1]
        p.append(min(1.0, p[i - 1] * float(probs[i - 1][x]) / float(draft_rows[i - 1][x])))
    accepted = 0
    for i in range(1, G + 1):
        if i < G:
            residual_mass = float(torch.clamp(p[i] * probs[i] - draft_rows[i], min=0).sum())
            denominator = residual_mass + 1.0 - p[i]
            h = residual_mass / denominator if denominator > 0.0 else 1.0
        else:
            h = p[G]
        if float(uniform(seed, offset, i, ACCEPT_DRAW)) < h:
            accepted = i
    coin = float(uniform(seed, offset, accepted, BONUS_DRAW))
    if accepted == G:
        bonus = sample_inverse_cdf(weights[G], coin)
    else:
        residual = torch.clamp(p[accepted] * probs[accepted] - draft_rows[accepted], min=0)
        if float(residual.sum()) == 0.0:  # rounding only
            residual = weights[accepted]
        bonus = sample_inverse_cdf(residual, coin)
    return chain[:accepted] + [bonus], status


def block_verify(tokens, target_logits, draft_probs=None, *, num_drafts=None, temperature=None, top_k=None,
                 top_p=None, seed=None, offset=None, d2t=None) -> VerifyOutput:
    """Verify a batch of draft chains, each as one block.

    Shapes
    ------
    tokens int64 [B, N] (node i >= 1: draft i, child of node i - 1), target_logits [B, N, V] (any
    float dtype); optional draft_probs float32 [B, N, Vd] (row i: the distribution draft i + 1 was
    drawn from; None: deterministic drafts), num_drafts int32 [B] (None: N - 1 each), per-request
    temperature float32 [B] (0 = greedy), top_k int32 [B], top_p float32 [B], seed int64 [B],
    offset int64 [B], d2t int64 [Vd].

    Returns
    -------
    VerifyOutput(accept_len int32 [B], accept_nodes int32 [B, N], out_tokens int64 [B, N],
    status int32 [B]); padding is -1.
    """
    _checks.check_block_verify(tokens, target_logits, draft_probs, num_drafts=num_drafts, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed, offset=offset, d2t=d2t)
    B, N, V = target_logits.shape
    device = target_logits.device
    accept_len = torch.zeros(B, dtype=torch.int32, device=device)
    accept_nodes = torch.full((B, N), -1, dtype=torch.int32, device=device)
    out_tokens = torch.full((B, N), -1, dtype=torch.int64, device=device)
    status = torch.zeros(B, dtype=torch.int32, device=device)

    for b in range(B):
        G = N - 1 if num_drafts is None else int(num_drafts[b])
        chain = [int(t) for t in tokens[b, 1: G + 1]]
        row_temperature = 0.0 if temperature is None else float(temperature[b])
        logits = target_logits[b]
        if row_temperature == 0.0:
            emitted, bad = greedy_chain(logits, chain)
            row_status = 1 if bad else 0
        else:
            if draft_probs is None:
                draft_rows = [point_mass(x, V) for x in chain]
            else:
                draft_rows = [draft_row(draft_probs[b, i], d2t, V) for i in range(G)]
            emitted, row_status = block_chain(
                logits, chain, draft_rows, row_temperature, 0 if top_k is None else int(top_k[b]),
                1.0 if top_p is None else float(top_p[b]), 0 if seed is None else int(seed[b]),
                0 if offset is None else int(offset[b]))
        if row_status == 1:
            emitted = [fallback_token(logits[0])]
        status[b] = row_status
        accept_len[b] = len(emitted) - 1
        accept_nodes[b, : len(emitted)] = torch.arange(len(emitted), dtype=torch.int32)
        out_tokens[b, : len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
    return VerifyOutput(accept_len, accept_nodes, out_tokens, status)
