"""The law of rejection sampling on a draft chain, and a χ² of observed emitted sequences against
it: the engines' chain samplers (SGLang's, vLLM's V1 and Model Runner V2) and ours through their
adapters are all held to it. Block verification emits another law a step (it is exact over whole
sequences, not step by step): its sequences are completed from the target first
(:func:`completed_p_value`)."""

from __future__ import annotations

import itertools

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


def completed_p_value(sequences, p: np.ndarray, seed: int) -> float:
    """χ² p-value of emitted sequences, each completed to ``len(p)`` tokens by sampling its missing
    positions from the rows of ``p`` (rows that do not depend on the prefix), against the product
    law of those rows: what any exact rule, block verification included, gives."""
    rng = np.random.default_rng(seed)
    exact = p / p.sum(-1, keepdims=True)
    seen = {}
    for seq in sequences:
        seq = list(seq) + [int(rng.choice(exact.shape[1], p=exact[j])) for j in range(len(seq), exact.shape[0])]
        seen[tuple(seq)] = seen.get(tuple(seq), 0) + 1
    law = {seq: float(np.prod([exact[j, x] for j, x in enumerate(seq)]))
           for seq in itertools.product(range(exact.shape[1]), repeat=exact.shape[0])}
    return chi2_p_value(seen, {k: v for k, v in law.items() if v > 0})
