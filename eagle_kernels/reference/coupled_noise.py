"""Reference ``coupled_noise``: the Gumbel noise ``-log(-log U)`` of coupled sampling (docs/ops.md
§15), from the stream numbers ``verify``'s coupled race draws at the same (seed, position, token id),
so that drafts perturbed with it race against the target with the target's own noise."""

from __future__ import annotations

import torch

from .. import _checks
from .random import COUPLED_DRAW, uniform


def coupled_noise(seed, positions, num_tokens, *, d2t=None) -> torch.Tensor:
    """``G[b, w, x] = -log(-log U(seed[b], positions[b, w], id(x), COUPLED_DRAW))`` with ``id(x) = x +
    d2t[x]`` (a draft vocabulary's target ids) or ``x``; ``U = 0`` gives ``-inf``.

    Shapes
    ------
    seed int64 [B], positions int64 [B, W], d2t int64 [num_tokens] -> float32 [B, W, num_tokens]
    (computed in float64, rounded once).
    """
    _checks.check_coupled_noise(seed, positions, num_tokens, d2t=d2t)
    ids = torch.arange(num_tokens, dtype=torch.int64)
    if d2t is not None:
        ids = ids + d2t.cpu()
    u = uniform(seed.cpu()[:, None, None], positions.cpu()[:, :, None], ids[None, None, :], COUPLED_DRAW)
    return (-torch.log(-torch.log(u))).to(torch.float32).to(seed.device)
