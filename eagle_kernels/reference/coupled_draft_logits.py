"""Reference ``coupled_draft_logits`` (docs/ops.md §16): a drafting step's rows under coupled
sampling, the head's log-probabilities at the request's temperature plus the target's race noise
(§15) at the position the rows' children take, so that the most likely perturbed tokens are the
tokens the target's race most likely picks there."""

from __future__ import annotations

import torch

from .. import _checks
from .coupled_noise import coupled_noise


def coupled_draft_logits(logits, temperature, seed, positions, *, d2t=None) -> torch.Tensor:
    """``out[b, m] = log_softmax(logits[b, m] / T[b]) + G(seed[b], positions[b])`` for ``T[b] > 0``
    (float32 arithmetic, the row's max subtracted before the division; the noise ``G`` of ``coupled_noise``
    over the ids ``x + d2t[x]``), and the row as it is (in float32) for a greedy request (``T[b] = 0``).

    Shapes
    ------
    logits [B, M, n] float32 / bfloat16 / float16, temperature float32 [B], seed int64 [B],
    positions int64 [B], d2t int64 [n] -> float32 [B, M, n].
    """
    _checks.check_coupled_draft_logits(logits, temperature, seed, positions, d2t=d2t)
    rows = logits.float()
    sampling = temperature > 0
    t = torch.where(sampling, temperature, torch.ones_like(temperature))
    noise = coupled_noise(seed, positions[:, None], logits.shape[2], d2t=d2t)  # [B, 1, n]
    # The max subtracted before the division (as verify's): a tiny temperature sends the other entries to -inf
    # (the T -> 0 limit), never inf - inf.
    shifted = (rows - rows.amax(dim=-1, keepdim=True)) / t[:, None, None]
    perturbed = torch.log_softmax(shifted, dim=-1) + noise
    return torch.where(sampling[:, None, None], perturbed, rows)
