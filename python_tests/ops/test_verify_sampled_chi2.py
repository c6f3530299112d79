"""verify with sampled drafts (docs/ops.md §4, "Draft-aware rule for sampled drafts"), tier 4: the
rule is exact. Repeated draft/verify steps on the toy model of test_verify_chi2 (vocabulary of 6,
logits given the last two tokens), with children *drawn* from a draft distribution q that differs
from the target (Gumbel-top-k: k draws without replacement, in draw order) and verified with q,
emit sequences whose first three tokens have the joint law of plain autoregressive sampling from
the target: χ² against the exact joint distribution. Chains and trees, sampled and deterministic
siblings mixed (draft_sampled), a draft vocabulary mapped by d2t, top-k / top-p on the target,
and rows made invalid by duplicate sampled siblings independently of the draws (status 2, the
bonus from p_u: still exact). Planted bugs (d without the renormalisation by 1 - removed; the
deterministic residual after a sampled rejection) fail the same check decisively, so it has
power; so do children drawn *with* replacement: flagging their duplicates is not enough, since
keeping only the distinct pairs biases their law away from draws without replacement.
"""

import inspect
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy import stats

from eagle_kernels import _dispatch, reference
from eagle_kernels._types import VerifyOutput
from eagle_kernels.reference.random import ACCEPT_DRAW, BONUS_DRAW
from helpers import assert_same, filtered_probs, uniform_py
from test_verify_chi2 import PROMPT, TOY_TARGET, V_TOY, chi2_pvalue, exact_joint

EMIT = 3
_rng = np.random.RandomState(4321)
# The draft: the target's finite logits shrunk and blurred, so q often disagrees with p (many
# rejections, where a wrong residual shows), and it proposes the target's impossible tokens too.
DRAFT_LOGITS = np.where(np.isfinite(TOY_TARGET), TOY_TARGET, 0.0) * 0.5 + 0.9 * _rng.randn(V_TOY, V_TOY, V_TOY)
DRAFT_IDS = np.array([0, 2, 3, 5])  # the draft vocabulary of the d2t variants (Vd = 4)


def draft_q(use_d2t):
    """q[a, b] over the draft vocabulary, float64."""
    z = DRAFT_LOGITS[..., DRAFT_IDS] if use_d2t else DRAFT_LOGITS
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@dataclass(frozen=True)
class Shape:
    """A draft tree: parents, and per node "S" (sampled from its parent's row) or "D"
    (deterministic: the parent's j-th most likely draft token for its j-th such child)."""

    parents: tuple
    kinds: str
    max_depth: int


SHAPES = {
    "chain": Shape((-1, 0, 1, 2), "-SSS", 3),
    "tree": Shape((-1, 0, 0, 1, 1, 2, 2), "-SSSSSS", 2),
    "wide": Shape((-1, 0, 0, 0, 1), "-SSSS", 2),
    # Deterministic children before, between and after sampled siblings.
    "mixed": Shape((-1, 0, 0, 0, 1, 1, 2), "-SDSDSS", 2),
}


def draft_step(histories, shape, use_d2t, draws_mode, rng):
    """tokens [B, N], parents, target logits [B, N, V], draft_probs [B, N, Vd], draft_sampled [B, N]
    for contexts ``histories``, the sampled children drawn from q (numpy's generator) without
    replacement, ``with`` replacement, or without and then, for a third of the nodes (a coin
    independent of the draws), the second sampled child given the first one's token
    (``duplicates``)."""
    B, N = len(histories), len(shape.parents)
    q_table = draft_q(use_d2t)
    Vd = q_table.shape[-1]
    to_target = DRAFT_IDS if use_d2t else np.arange(V_TOY)
    tokens = np.zeros((B, N), dtype=np.int64)
    ctx = np.zeros((B, N, 2), dtype=np.int64)
    ctx[:, 0] = [h[-2:] for h in histories]
    tokens[:, 0] = ctx[:, 0, 1]
    for u in range(N):
        q = q_table[ctx[:, u, 0], ctx[:, u, 1]]  # [B, Vd]
        children = [c for c in range(1, N) if shape.parents[c] == u]
        sampled = [c for c in children if shape.kinds[c] == "S"]
        if draws_mode == "with":
            draws = (np.cumsum(q, -1)[:, None, :] > rng.random((B, len(sampled), 1))).argmax(-1)
        else:  # Gumbel-top-k: ordered draws without replacement
            keys = np.log(q) - np.log(-np.log(rng.random((B, Vd))))
            draws = np.argsort(-keys, axis=-1, kind="stable")[:, : len(sampled)]
        ranked = np.argsort(-q, axis=-1, kind="stable")
        deterministic = [c for c in children if shape.kinds[c] == "D"]
        for j, c in enumerate(sampled):
            tokens[:, c] = to_target[draws[:, j]]
        if draws_mode == "duplicates" and len(sampled) >= 2:
            tokens[:, sampled[1]] = np.where(rng.random(B) < 1 / 3, tokens[:, sampled[0]], tokens[:, sampled[1]])
        for j, c in enumerate(deterministic):
            tokens[:, c] = to_target[ranked[:, j]]
        for c in children:
            ctx[:, c] = np.stack([tokens[:, u], tokens[:, c]], -1)
    logits = TOY_TARGET[ctx[..., 0], ctx[..., 1]]
    draft_probs = q_table[ctx[..., 0], ctx[..., 1]]
    sampled_mask = np.array([k == "S" for k in shape.kinds])[None].repeat(B, 0)
    parents = torch.tensor(shape.parents, dtype=torch.int32)[None].repeat(B, 1)
    d2t = torch.from_numpy(DRAFT_IDS - np.arange(len(DRAFT_IDS))) if use_d2t else None
    return (torch.from_numpy(tokens), parents, torch.tensor(logits, dtype=torch.float32),
            dict(draft_probs=torch.tensor(draft_probs, dtype=torch.float32),
                 draft_sampled=torch.from_numpy(sampled_mask), d2t=d2t))


def emit_sequences(verify, trials, shape, use_d2t, draws_mode, target, seed_base):
    """Repeated draft -> verify steps from PROMPT for ``trials`` requests in one batch (seed =
    seed_base + trial, offset = step); the first EMIT tokens of each, and the statuses seen."""
    temperature, top_k, top_p = target
    rng = np.random.default_rng(seed_base)
    histories = [list(PROMPT) for _ in range(trials)]
    emitted = [[] for _ in range(trials)]
    statuses = set()
    step = 0
    while True:
        active = [i for i in range(trials) if len(emitted[i]) < EMIT]
        if not active:
            break
        tokens, parents, logits, drafts = draft_step([histories[i] for i in active], shape, use_d2t, draws_mode,
                                                     rng)
        B = len(active)
        out = verify(tokens, parents, logits, max_depth=shape.max_depth,
                     temperature=torch.full((B,), temperature, dtype=torch.float32),
                     top_k=torch.full((B,), top_k, dtype=torch.int32),
                     top_p=torch.full((B,), top_p, dtype=torch.float32),
                     seed=torch.tensor([seed_base + i for i in active], dtype=torch.int64),
                     offset=torch.full((B,), 1000 + step, dtype=torch.int64), **drafts)
        statuses |= set(out.status.tolist())
        for row, i in enumerate(active):
            new = out.out_tokens[row, : int(out.accept_len[row]) + 1].tolist()
            histories[i] += new
            emitted[i] += new
        step += 1
    return np.array([e[:EMIT] for e in emitted]), statuses


# (id, shape, d2t, draws, target (temperature, top_k, top_p))
VARIANTS = [
    ("chain-t1", "chain", False, "without", (1.0, 0, 1.0)),
    ("tree-t1", "tree", False, "without", (1.0, 0, 1.0)),
    ("wide-d2t-t0.7-k3", "wide", True, "without", (0.7, 3, 1.0)),
    ("mixed-p0.8", "mixed", False, "without", (1.0, 0, 0.8)),
    ("mixed-d2t-t1", "mixed", True, "without", (1.0, 0, 1.0)),
    ("wide-duplicates", "wide", False, "duplicates", (1.0, 0, 1.0)),
]
TRIALS = 2000


@pytest.fixture(params=[pytest.param("reference", marks=pytest.mark.slow), "cpp", "triton"])
def sampled_verify(request, monkeypatch):
    """The verify under test; the reference runs in the slow lane (Python loops per request)."""
    fn, reason = _dispatch.implementation("verify", request.param, "cpu")
    if fn is None:
        pytest.skip(reason)
    if request.param == "triton" and "draft_probs" not in inspect.signature(fn).parameters:
        pytest.skip("the triton verify does not take draft distributions")
    if request.param == "reference":
        # The bit-identical Python-int stream (test_uniform_py_matches_reference) keeps it fast.
        monkeypatch.setattr(sys.modules["eagle_kernels.reference.verify"], "uniform", uniform_py)
    return fn


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_sampled_drafts_are_exact_chi2(sampled_verify, variant):
    """Sequences emitted with sampled drafts have the joint law of plain sampling from p."""
    _, shape, use_d2t, draws_mode, target = variant
    samples, statuses = emit_sequences(sampled_verify, TRIALS, SHAPES[shape], use_d2t, draws_mode, target,
                                       seed_base=20_000)
    assert statuses <= {0, 2}
    assert (2 in statuses) == (draws_mode == "duplicates")  # duplicate sampled siblings are flagged, only they
    pvalue = chi2_pvalue(samples, exact_joint(*target))
    assert pvalue > 1e-3, pvalue


# ------------------------------------------------------------------------------ planted bugs
def toy_verify(tokens, parents, target_logits, *, max_depth, temperature, top_k, top_p, seed, offset,
               draft_probs, draft_sampled, d2t, bug=None):
    """An independent float64 numpy verifier of the draft-aware rule, optionally with a planted
    bug: ``no_removed_renorm`` uses d = r(x) for every sampled child (the earlier siblings not
    taken out of q); ``deterministic_residual`` zeroes w(x) after a sampled rejection, as for a
    deterministic draft, instead of w <- max(w / mass - r', 0)."""
    B, N, V = target_logits.shape
    coins = reference.uniform(seed[:, None, None], offset[:, None, None], torch.arange(N)[None, :, None],
                              torch.tensor([ACCEPT_DRAW, BONUS_DRAW])[None, None, :]).numpy()
    tok, par, x = tokens.numpy(), parents.numpy(), target_logits.double().numpy()
    q_all = draft_probs.double().numpy()
    Vd = q_all.shape[-1]
    targets = np.arange(Vd) + (d2t.numpy() if d2t is not None else 0)
    accept_len = torch.zeros(B, dtype=torch.int32)
    accept_nodes = torch.full((B, max_depth + 1), -1, dtype=torch.int32)
    out_tokens = torch.full((B, max_depth + 1), -1, dtype=torch.int64)
    status = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        path, emitted, node = [0], [], 0
        while True:
            w = filtered_probs(x[b, node], float(temperature[b]), int(top_k[b]), float(top_p[b]))
            children = [c for c in range(1, N) if par[b, c] == node] if len(path) <= max_depth else []
            sampled = [c for c in children if draft_sampled is None or bool(draft_sampled[b, c])]
            r = np.zeros(V)
            if sampled:
                q = q_all[b, node]
                ok = bool(np.isfinite(q).all() and (q >= 0).all() and abs(q.sum() - 1) <= 1e-3)
                ok = ok and bool(((targets >= 0) & (targets < V)).all())
                if ok:
                    r[targets] = q / q.sum()
                    xs = [int(tok[b, c]) for c in sampled]
                    ok = len(set(xs)) == len(xs) and all(r[t] > 0 for t in xs)
                    ok = ok and all(r[xs[:i]].sum() < 1 for i in range(len(xs)))
                if not ok:
                    status[b], children = 2, []
            removed, child, done = 0.0, None, []
            for c in children:
                t = int(tok[b, c])
                mass = w.sum()
                is_sampled = c in sampled
                d = 1.0
                if is_sampled:
                    d = r[t] if bug == "no_removed_renorm" else r[t] / (1.0 - removed)
                if w[t] > 0 and coins[b, c, ACCEPT_DRAW] < (w[t] / mass) / d:
                    child = c
                    break
                new = w.copy()
                new[t] = 0.0
                if is_sampled and bug != "deterministic_residual":
                    rest = r.copy()
                    rest[done] = 0.0
                    new = np.maximum(w / mass - rest / (1.0 - removed), 0.0)
                if is_sampled:
                    removed += r[t]
                    done.append(t)
                if new.sum() == 0:
                    new = w.copy()
                    new[t] = 0.0
                    if new.sum() == 0:
                        new = w
                w = new
            if child is None:
                cdf = np.cumsum(w)
                emitted.append(int(np.argmax(cdf > coins[b, node, BONUS_DRAW] * cdf[-1])))
                break
            path.append(child)
            emitted.append(int(tok[b, child]))
            node = child
        accept_len[b] = len(path) - 1
        accept_nodes[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        out_tokens[b, : len(emitted)] = torch.tensor(emitted)
    return VerifyOutput(accept_len, accept_nodes, out_tokens, status)


def test_toy_verifier_matches_reference():
    """The bug-free toy verifier is the reference's rule: same outputs on a batch of draft steps
    (every shape, with and without d2t and replacement)."""
    rng = np.random.default_rng(5)
    for shape, use_d2t, draws_mode in [("tree", False, "without"), ("mixed", True, "without"),
                                       ("wide", False, "with"), ("tree", True, "duplicates")]:
        histories = [list(PROMPT), [3, 3], [2, 5], [4, 0], [1, 1], [5, 2]] * 3
        tokens, parents, logits, drafts = draft_step(histories, SHAPES[shape], use_d2t, draws_mode, rng)
        B = tokens.shape[0]
        sampling = dict(temperature=torch.full((B,), 1.0), top_k=torch.zeros(B, dtype=torch.int32),
                        top_p=torch.ones(B), seed=torch.arange(B, dtype=torch.int64), offset=torch.full((B,), 3))
        max_depth = SHAPES[shape].max_depth
        assert_same(toy_verify(tokens, parents, logits, max_depth=max_depth, **sampling, **drafts),
                    reference.verify(tokens, parents, logits, max_depth=max_depth, **sampling, **drafts))


# One node, k sampled children: a draft that puts 0.6 on a token the target rarely takes, so the
# first child is usually rejected and the later ones are tried against a residual that is
# spread thin (where both bugs above change acceptance probabilities).
STAR_P = np.array([0.1, 0.2, 0.2, 0.2, 0.15, 0.15])
STAR_Q = np.array([0.6, 0.1, 0.1, 0.1, 0.05, 0.05])
STAR_TRIALS = 4000


def star_first_tokens(verify, k, trials=STAR_TRIALS, seed=0):
    """The bonus-or-accepted token of a root whose k children are drawn without replacement from
    STAR_Q (Gumbel-top-k), for ``trials`` requests in one call; its law must be STAR_P."""
    rng = np.random.default_rng(seed)
    keys = np.log(STAR_Q) - np.log(-np.log(rng.random((trials, V_TOY))))
    tokens = torch.zeros(trials, k + 1, dtype=torch.int64)
    tokens[:, 1:] = torch.from_numpy(np.argsort(-keys, axis=-1, kind="stable")[:, :k])
    logits = torch.tensor(np.log(STAR_P), dtype=torch.float32).expand(trials, k + 1, V_TOY).contiguous()
    out = verify(tokens, torch.tensor([-1] + [0] * k, dtype=torch.int32).repeat(trials, 1), logits, max_depth=1,
                 temperature=torch.ones(trials), top_k=torch.zeros(trials, dtype=torch.int32),
                 top_p=torch.ones(trials), seed=torch.arange(trials), offset=torch.full((trials,), 5),
                 draft_probs=torch.tensor(STAR_Q, dtype=torch.float32).expand(trials, k + 1, V_TOY).contiguous(),
                 draft_sampled=None, d2t=None)
    assert (out.status == 0).all()
    return np.bincount(out.out_tokens[:, 0].numpy(), minlength=V_TOY)


def star_pvalue(counts):
    return float(stats.chisquare(counts, STAR_P * counts.sum()).pvalue)


@pytest.mark.parametrize("k", [2, 3], ids=["k2", "k3"])
def test_star_is_exact(sampled_verify, k):
    """One node with k sampled siblings: the emitted token has the target's law (χ², p > 1e-3)."""
    assert star_pvalue(star_first_tokens(sampled_verify, k)) > 1e-3


@pytest.mark.parametrize("bug", ["no_removed_renorm", "deterministic_residual"])
def test_chi2_detects_wrong_draft_rule(bug):
    """The χ² checks above reject plausible draft-aware bugs decisively: on the star (both bugs;
    the right rule passes on the same draws, test_star_is_exact) and on the joint law of the toy
    model's trees (the deterministic residual)."""

    def wrong(*args, **kwargs):
        return toy_verify(*args, bug=bug, **kwargs)

    assert star_pvalue(star_first_tokens(wrong, 2)) < 1e-6
    if bug == "deterministic_residual":
        samples, _ = emit_sequences(wrong, TRIALS, SHAPES["tree"], False, "without", (1.0, 0, 1.0), seed_base=20_000)
        assert chi2_pvalue(samples, exact_joint(1.0, 0, 1.0)) < 1e-6


def test_drafts_drawn_with_replacement_are_not_exact(sampled_verify):
    """The rule needs children drawn *without* replacement (as draft_expand draws them): children
    drawn with replacement, their duplicates flagged (status 2), give a biased law, because the
    distinct pairs that remain are weighted q(x1) q(x2) instead of q(x1) q(x2) / (1 - q(x1)). A
    drafter must not do that; this check also shows the χ² test has the power to see it."""
    samples, statuses = emit_sequences(sampled_verify, TRIALS, SHAPES["tree"], False, "with", (1.0, 0, 1.0),
                                       seed_base=20_000)
    assert 2 in statuses
    assert chi2_pvalue(samples, exact_joint(1.0, 0, 1.0)) < 1e-6
