"""The law of rejection sampling on a draft chain, and a χ² of observed emitted sequences against
it: the engines' chain samplers (SGLang's, vLLM's V1 and Model Runner V2) and ours through their
adapters are all held to it."""

from __future__ import annotations

import numpy as np
from scipy import stats


def rejection_chain_law(p: np.ndarray, q: np.ndarray, bonus: int | None = None) -> dict:
    """Law of the emitted tokens of a chain whose draft j is drawn from q_j and verified by
    rejection sampling: at draft j, token x is emitted and the chain goes on with probability
    min(p_j(x), q_j(x)), emitted as the corrected (residual) token, ending it, with
    p_j(x) - min(p_j(x), q_j(x)); after every draft, ``bonus`` (a token fixed beforehand, vLLM
    V1) or, when None, x ~ p of the row after the drafts (``p`` has one row more than ``q``)."""
    steps = q.shape[0]
    law = {}

    def add(seq, mass):
        law[seq] = law.get(seq, 0) + mass

    def walk(j, prefix, mass):
        if j == steps:
            if bonus is not None:
                add(prefix + (bonus,), mass)
            else:
                for x in np.flatnonzero(p[j] > 0):
                    add(prefix + (int(x),), mass * p[j, x])
            return
        for x in range(p.shape[1]):
            kept = min(p[j, x], q[j, x])
            if kept > 0:
                walk(j + 1, prefix + (x,), mass * kept)
            if p[j, x] - kept > 0:
                add(prefix + (x,), mass * (p[j, x] - kept))

    walk(0, (), 1.0)
    return law


def chi2_p_value(seen: dict, law: dict) -> float:
    """χ² p-value of the counts ``seen`` (emitted sequence -> count) against ``law``; 0 when a
    sequence the law gives no mass was seen."""
    if not set(seen) <= set(law):
        return 0.0
    keys = sorted(law)
    observed = np.array([seen.get(k, 0) for k in keys], dtype=np.float64)
    expected = np.array([law[k] for k in keys])
    expected *= observed.sum() / expected.sum()
    return stats.chisquare(observed, expected)[1]
