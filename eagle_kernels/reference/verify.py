"""Reference ``verify``: greedy and lossless sampling verification of a draft tree.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) generalised to trees whose
draft children are deterministic (EAGLE-2, Li et al. 2024, §4): at node ``u`` the children are
tried in node order; child ``c`` with token ``x`` is accepted with probability ``p_u(x)``
under the *current* residual ``p_u``; a rejection zeroes ``p_u(x)`` and renormalises. When
every child fails, or ``u`` is a leaf, the bonus token is drawn from the residual. The emitted
sequence then has exactly the target distribution.

Children *sampled* from a draft distribution ``q`` without replacement (``draft_expand`` at a
temperature) are verified with ``q``: recursive rejection sampling (Jeon et al. 2024, "Recursive
speculative decoding"; Yang et al. 2024, "Multi-candidate speculative decoding"): child ``x`` is
accepted with probability ``min(1, p(x) / q'(x))``, ``q'`` the draft with the earlier sampled
siblings taken out and renormalised, and a rejection leaves ``norm(max(p - q', 0))``.

Coupled sampling (``positions`` given) makes the target's token at every sequence position a
function of the prefix, the seed and the position: the exponential race (the Gumbel-max trick)
``argmax_x w(x) / E(x)`` over the filtered weights, with ``E(x) = -log U(x)`` drawn per (seed,
position, token). Verification is then greedy verification against that token, exact for any
drafts, and the output does not depend on the drafts, the tree or the batch.
"""

from __future__ import annotations

import torch

from .. import _checks
from .._types import VerifyOutput
from .random import ACCEPT_DRAW, BONUS_DRAW, COUPLED_DRAW, uniform


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Probabilities are float32, float64 when the logits are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_is_bad(row: torch.Tensor) -> bool:
    """NaN or +inf anywhere, or no finite entry (-inf alone is an ordinary mask)."""
    return bool(torch.isnan(row).any() or torch.isposinf(row).any() or not torch.isfinite(row).any())


def greedy_token(row: torch.Tensor) -> int:
    """argmax with ties to the smaller id (torch.argmax returns the first maximum)."""
    return int(torch.argmax(row))


def fallback_token(root_row: torch.Tensor) -> int:
    """Bonus token of a request with a bad row: argmax over its finite root logits, else 0."""
    finite = torch.isfinite(root_row)
    if not bool(finite.any()):
        return 0
    masked = torch.where(finite, root_row, torch.full_like(root_row, float("-inf")))
    return greedy_token(masked)


def mass_strictly_above(p: torch.Tensor) -> torch.Tensor:
    """For each x, the total probability of the tokens strictly more probable than x
    (ties share one value, so the top-p filter never splits a tie)."""
    ascending, _ = torch.sort(p.to(torch.float64))
    # suffix[i] = sum of ascending[i:], with suffix[len] = 0.
    suffix = torch.cat([ascending.flip(0).cumsum(0).flip(0), ascending.new_zeros(1)])
    first_strictly_above = torch.searchsorted(ascending, p.to(torch.float64), right=True)
    return suffix[first_strictly_above]


def sampling_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``p_u`` of docs/ops.md §4: logits / temperature -> top-k -> softmax -> top-p -> renormalise.

    Ties are kept together by both filters: top-k keeps ``x`` iff fewer than ``k`` logits are
    strictly larger, top-p keeps ``x`` iff the mass strictly more probable than ``x`` is below
    ``top_p``.
    """
    dtype = compute_dtype(row.dtype)
    row = row.to(dtype)
    # Shift by the row max before dividing: a tiny temperature then sends the other logits to
    # -inf instead of overflowing the maximum to +inf (which would make the softmax NaN).
    scaled = (row - row.max()) / torch.tensor(temperature, dtype=torch.float32).to(dtype)
    if top_k > 0:
        ascending, _ = torch.sort(scaled)
        strictly_larger = scaled.numel() - torch.searchsorted(ascending, scaled, right=True)
        scaled = torch.where(strictly_larger < top_k, scaled, torch.full_like(scaled, float("-inf")))
    probs = torch.softmax(scaled, dim=0)
    if top_p < 1.0:
        keep = mass_strictly_above(probs) < top_p
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def sample_inverse_cdf(weights: torch.Tensor, coin: float) -> int:
    """Smallest x with cumsum(weights)[x] > coin * sum(weights), summed in float64 in token
    order; the largest x with positive weight if rounding leaves none."""
    cumulative = weights.to(torch.float64).cumsum(0)
    target = coin * float(cumulative[-1])
    above = torch.nonzero(cumulative > target)
    if above.numel() > 0:
        return int(above[0, 0])
    return int(torch.nonzero(weights > 0)[-1, 0])


def coupled_token(weights: torch.Tensor, seed: int, position: int) -> int:
    """The exponential race over ``weights``' support: ``argmax_x w(x) / E(x)`` in float64, ``E(x) =
    -log U(seed, position, x, COUPLED_DRAW)``, ties to the smaller id (``U = 0``: ratio 0). Distributed as
    ``weights / sum(weights)`` for independent ``U`` (Gumbel-max)."""
    ids = torch.arange(weights.shape[0], dtype=torch.int64)
    w = weights.to(torch.float64).cpu()
    ratios = w / -torch.log(uniform(seed, position, ids, COUPLED_DRAW))
    ratios = torch.where(w > 0, ratios, torch.full_like(ratios, -1.0))
    return int(torch.argmax(ratios))


def children_of(parents_row: torch.Tensor, node: int) -> list[int]:
    return [int(c) for c in torch.nonzero(parents_row == node).flatten()]


DRAFT_SUM_TOLERANCE = 1e-3  # |sum(q_u) - 1| above this makes a draft row invalid (docs/ops.md §4)


def draft_row(draft_probs_row: torch.Tensor, d2t: torch.Tensor | None, V: int) -> torch.Tensor | None:
    """``r = Q_u / S`` over the target vocabulary (float64), or None when the row is not a
    distribution (NaN, inf or negative entries, ``|S - 1| > 1e-3``, ``d2t`` out of range)."""
    q = draft_probs_row.to(torch.float64)
    if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
        return None
    total = float(q.sum())
    if abs(total - 1.0) > DRAFT_SUM_TOLERANCE:
        return None
    if d2t is None:
        return q / total
    target_ids = torch.arange(q.shape[0], dtype=torch.int64) + d2t.cpu()
    if bool(((target_ids < 0) | (target_ids >= V)).any()):
        return None
    r = torch.zeros(V, dtype=torch.float64)
    r[target_ids] = q / total
    return r


def sampled_children_valid(r: torch.Tensor | None, child_tokens: list[int]) -> bool:
    """Whether the sampled children's tokens could have been drawn without replacement from ``r``."""
    if r is None or len(set(child_tokens)) != len(child_tokens):
        return False
    removed = 0.0
    for x in child_tokens:
        if float(r[x]) <= 0.0 or removed >= 1.0:
            return False
        removed += float(r[x])
    return True


def verify(tokens, parents, target_logits, *, max_depth, temperature=None, top_k=None, top_p=None,
           seed=None, offset=None, draft_probs=None, draft_sampled=None, d2t=None, positions=None) -> VerifyOutput:
    """Verify a batch of draft trees against the target's logits.

    Shapes
    ------
    tokens int64 [B, N], parents int32 [B, N], target_logits [B, N, V] (any float dtype);
    optional per-request temperature float32 [B] (0 = greedy row), top_k int32 [B] (0 = off),
    top_p float32 [B] (1 = off), seed int64 [B], offset int64 [B]; for sampled drafts
    draft_probs float32 [B, N, Vd] (node u's row: the distribution its sampled children were drawn
    from), draft_sampled bool [B, N] (None: every node but the root), d2t int64 [Vd]; for coupled
    sampling positions int64 [B]: the sequence position of the token the root row predicts (a
    depth-d row predicts position ``positions[b] + d``). With it every sampling request is verified
    by coupled sampling and ``draft_probs`` plays no part for it.

    Returns
    -------
    VerifyOutput(accept_len int32 [B], accept_nodes int32 [B, max_depth + 1],
    out_tokens int64 [B, max_depth + 1], status int32 [B]); padding is -1.
    """
    _checks.check_verify(tokens, parents, target_logits, max_depth=max_depth, temperature=temperature,
                         top_k=top_k, top_p=top_p, seed=seed, offset=offset, draft_probs=draft_probs,
                         draft_sampled=draft_sampled, d2t=d2t, positions=positions)
    B, N, V = target_logits.shape
    device = target_logits.device
    accept_len = torch.zeros(B, dtype=torch.int32, device=device)
    accept_nodes = torch.full((B, max_depth + 1), -1, dtype=torch.int32, device=device)
    out_tokens = torch.full((B, max_depth + 1), -1, dtype=torch.int64, device=device)
    status = torch.zeros(B, dtype=torch.int32, device=device)

    for b in range(B):
        row_temperature = 0.0 if temperature is None else float(temperature[b])
        row_top_k = 0 if top_k is None else int(top_k[b])
        row_top_p = 1.0 if top_p is None else float(top_p[b])
        row_seed = 0 if seed is None else int(seed[b])
        row_offset = 0 if offset is None else int(offset[b])
        logits = target_logits[b]

        path, emitted, bad, draft_bad = [0], [], False, False
        node = 0
        while True:
            row = logits[node]
            if row_is_bad(row):
                bad = True
                break
            children = children_of(parents[b], node) if len(path) <= max_depth else []
            if row_temperature == 0.0 or positions is not None:
                if row_temperature == 0.0:
                    target_token = greedy_token(row)
                else:
                    weights = sampling_probs(row, row_temperature, row_top_k, row_top_p)
                    target_token = coupled_token(weights, row_seed, int(positions[b]) + len(path) - 1)
                child = next((c for c in children if int(tokens[b, c]) == target_token), None)
                if child is None:
                    emitted.append(target_token)
                    break
            else:
                weights = sampling_probs(row, row_temperature, row_top_k, row_top_p)
                sampled = [c for c in children if draft_probs is not None
                           and (draft_sampled is None or bool(draft_sampled[b, c]))]
                r = None
                if sampled:
                    r = draft_row(draft_probs[b, node], d2t, V)
                    if not sampled_children_valid(r, [int(tokens[b, c]) for c in sampled]):
                        draft_bad, children = True, []  # no valid drafts here: sample from p_u
                # r_left: r without the sampled siblings rejected so far (their mass: removed).
                r_left, removed, sampled = r, 0.0, set(sampled)
                child = None
                for c in children:
                    x = int(tokens[b, c])
                    mass = float(weights.to(torch.float64).sum())
                    coin = float(uniform(row_seed, row_offset, c, ACCEPT_DRAW))
                    is_sampled = c in sampled
                    d = float(r[x]) / (1.0 - removed) if is_sampled else 1.0
                    if weights[x] > 0 and coin < (float(weights[x]) / mass) / d:
                        child = c
                        break
                    previous = weights
                    if is_sampled:
                        # r' = r without the earlier sampled siblings, renormalised.
                        r_now = (r_left / (1.0 - removed)).to(device=weights.device, dtype=weights.dtype)
                        weights = torch.clamp(weights / mass - r_now, min=0)
                        r_left = r_left.clone()
                        r_left[x] = 0.0
                        removed += float(r[x])
                    else:
                        weights = weights.clone()
                        weights[x] = 0
                    if float(weights.to(torch.float64).sum()) == 0.0:  # only through rounding
                        weights = previous.clone()
                        weights[x] = 0
                        if float(weights.to(torch.float64).sum()) == 0.0:
                            weights = previous
                if child is None:
                    coin = float(uniform(row_seed, row_offset, node, BONUS_DRAW))
                    emitted.append(sample_inverse_cdf(weights, coin))
                    break
            path.append(child)
            emitted.append(int(tokens[b, child]))
            node = child

        if bad:
            status[b] = 1
            path, emitted = [0], [fallback_token(logits[0])]
        elif draft_bad:
            status[b] = 2
        accept_len[b] = len(path) - 1
        accept_nodes[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        out_tokens[b, : len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
    return VerifyOutput(accept_len, accept_nodes, out_tokens, status)
