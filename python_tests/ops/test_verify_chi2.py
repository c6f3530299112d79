"""verify (docs/ops.md §4), tier 4: sampling is exact. Sequences emitted by repeated draft/verify
steps on a toy model (vocabulary of 6, logits given the last two tokens) have the joint law of
plain autoregressive sampling from the target, checked by a χ² test against the exact joint
distribution; the harness rejects plausible verifier bugs."""

import itertools
import os
import sys

import numpy as np
import pytest
import torch
from scipy import stats

from eagle_kernels import _dispatch, reference
from eagle_kernels._types import VerifyOutput
from eagle_kernels.reference.random import ACCEPT_DRAW, BONUS_DRAW
from eagle_kernels.reference.verify import sampling_probs
from helpers import assert_same, filtered_probs, softmax_np, uniform_py

V_TOY = 6
PROMPT = (0, 1)
_rng = np.random.RandomState(1234)
TOY_TARGET = _rng.randn(V_TOY, V_TOY, V_TOY) * 2.0  # logits of the next token given the last two
# The draft ranks tokens by the target's logits plus noise: its top-2 proposals are usually
# probable under p but still often rejected, which is where verifier bugs show (see
# test_chi2_detects_wrong_verifier).
TOY_DRAFT = TOY_TARGET + 0.5 * _rng.randn(V_TOY, V_TOY, V_TOY)
for _a, _b in itertools.product(range(V_TOY), repeat=2):
    TOY_TARGET[_a, _b, (_a + 2 * _b + 1) % V_TOY] = -np.inf  # a context-dependent impossible token


def draft_children(a, b):
    """Deterministic top-2 draft proposals after context (a, b); a duplicate pair sometimes."""
    order = np.argsort(-TOY_DRAFT[a, b], kind="stable")
    return (order[0], order[0]) if (a + b) % 3 == 0 else (order[0], order[1])


# Tree of depth 2, two proposals per node: node 0 root, 1-2 its children, 3-4 under 1, 5-6 under 2.
TOY_PARENTS = [-1, 0, 0, 1, 1, 2, 2]
TOY_DEPTH = 2
EMIT = 3


def toy_step_inputs(histories):
    """tokens [B, 7], parents [B, 7], target logits [B, 7, V] for contexts ``histories``."""
    B = len(histories)
    tokens = np.zeros((B, 7), dtype=np.int64)
    logits = np.zeros((B, 7, V_TOY))
    for i, h in enumerate(histories):
        a, b = h[-2], h[-1]
        c1, c2 = draft_children(a, b)
        tokens[i, :3] = (b, c1, c2)
        tokens[i, 3:5] = draft_children(b, c1)
        tokens[i, 5:7] = draft_children(b, c2)
        ctx = [(a, b), (b, c1), (b, c2)] + [(tokens[i, p], tokens[i, n]) for n, p in zip(range(3, 7), (1, 1, 2, 2))]
        for node, (x, y) in enumerate(ctx):
            logits[i, node] = TOY_TARGET[x, y]
    parents = np.tile(TOY_PARENTS, (B, 1))
    return torch.from_numpy(tokens), torch.tensor(parents, dtype=torch.int32), torch.tensor(logits, dtype=torch.float32)


def emit_sequences(verify, trials, temperature, top_k, top_p, seed_base):
    """Repeated draft -> verify steps from PROMPT for ``trials`` independent requests (one
    batch, seed = seed_base + trial, offset = step); the first EMIT emitted tokens of each."""
    histories = [list(PROMPT) for _ in range(trials)]
    emitted = [[] for _ in range(trials)]
    step = 0
    while True:
        active = [i for i in range(trials) if len(emitted[i]) < EMIT]
        if not active:
            break
        tokens, parents, logits = toy_step_inputs([histories[i] for i in active])
        B = len(active)
        out = verify(tokens, parents, logits, max_depth=TOY_DEPTH,
                     temperature=torch.full((B,), temperature, dtype=torch.float32),
                     top_k=torch.full((B,), top_k, dtype=torch.int32),
                     top_p=torch.full((B,), top_p, dtype=torch.float32),
                     seed=torch.tensor([seed_base + i for i in active], dtype=torch.int64),
                     offset=torch.full((B,), 1000 + step, dtype=torch.int64))
        for row, i in enumerate(active):
            new = out.out_tokens[row, : int(out.accept_len[row]) + 1].tolist()
            histories[i] += new
            emitted[i] += new
        step += 1
    return np.array([e[:EMIT] for e in emitted])


def exact_joint(temperature, top_k, top_p):
    """P(x1, x2, x3) of plain autoregressive sampling from p after PROMPT."""
    P = np.zeros((V_TOY,) * EMIT)
    for seq in itertools.product(range(V_TOY), repeat=EMIT):
        history, prob = list(PROMPT), 1.0
        for x in seq:
            prob *= filtered_probs(TOY_TARGET[history[-2], history[-1]], temperature, top_k, top_p)[x]
            history.append(x)
        P[seq] = prob
    return P


def chi2_pvalue(samples, P, min_expected=5.0):
    """χ² goodness of fit of the emitted triples against P; bins with small expected counts are
    merged (in increasing order of expectation); any triple with P = 0 gives p-value 0."""
    n = len(samples)
    counts = np.zeros(P.size)
    np.add.at(counts, np.ravel_multi_index(samples.T, P.shape), 1)
    flat = P.flatten()
    if counts[flat == 0].sum() > 0:
        return 0.0
    order = [i for i in np.argsort(flat, kind="stable") if flat[i] > 0]
    groups, current, mass = [], [], 0.0
    for i in order:
        current.append(i)
        mass += flat[i]
        if mass * n >= min_expected:
            groups.append(current)
            current, mass = [], 0.0
    if current:
        groups[-1] += current
    f_obs = np.array([counts[g].sum() for g in groups])
    f_exp = np.array([flat[g].sum() for g in groups])
    return float(stats.chisquare(f_obs, f_exp / f_exp.sum() * n).pvalue)


def toy_verify(tokens, parents, target_logits, *, max_depth, temperature, top_k, top_p, seed, offset,
               bug=None):
    """A small independent sampling verifier on the reference's random stream, optionally with a
    deliberate bug: ``no_renorm`` accepts a later sibling with its unnormalised residual weight;
    ``bonus_from_p`` samples the bonus from p instead of the residual."""
    B, N, V = target_logits.shape
    coins = reference.uniform(seed[:, None, None], offset[:, None, None], torch.arange(N)[None, :, None],
                              torch.tensor([ACCEPT_DRAW, BONUS_DRAW])[None, None, :]).numpy()
    tok, par, x = tokens.numpy(), parents.numpy(), target_logits.double().numpy()
    accept_len = torch.zeros(B, dtype=torch.int32)
    accept_nodes = torch.full((B, max_depth + 1), -1, dtype=torch.int32)
    out_tokens = torch.full((B, max_depth + 1), -1, dtype=torch.int64)
    for b in range(B):
        path, emitted, node = [0], [], 0
        while True:
            p = filtered_probs(x[b, node], float(temperature[b]), int(top_k[b]), float(top_p[b]))
            w = p.copy()
            children = [c for c in range(1, N) if par[b, c] == node] if len(path) <= max_depth else []
            child = None
            for c in children:
                mass = 1.0 if bug == "no_renorm" else w.sum()
                if w[tok[b, c]] > 0 and coins[b, c, ACCEPT_DRAW] < w[tok[b, c]] / mass:
                    child = c
                    break
                w[tok[b, c]] = 0.0
            if child is None:
                source = p if bug == "bonus_from_p" else w
                cdf = np.cumsum(source)
                emitted.append(int(np.argmax(cdf > coins[b, node, BONUS_DRAW] * cdf[-1])))
                break
            path.append(child)
            emitted.append(int(tok[b, child]))
            node = child
        accept_len[b] = len(path) - 1
        accept_nodes[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        out_tokens[b, : len(emitted)] = torch.tensor(emitted)
    return VerifyOutput(accept_len, accept_nodes, out_tokens, torch.zeros(B, dtype=torch.int32))


# (temperature, top_k, top_p); 1000 trials each, batched 1000 requests per verify call.
CHI2_VARIANTS = [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.0, 0, 0.8)]
CHI2_IDS = ["t1", "t0.7-k3", "p0.8"]
CHI2_TRIALS = 1000


def test_toy_model_sanity():
    """The toy setup exercises what the χ² test needs: zero-probability tokens after the
    filters, draft proposals that are rejected, duplicate siblings; no top-p threshold within
    rounding of a decision; and filtered_probs agrees with the reference's p."""
    assert any(draft_children(a, b)[0] == draft_children(a, b)[1] for a, b in itertools.product(range(V_TOY), repeat=2))
    for (t, k, tp), (a, b) in itertools.product(CHI2_VARIANTS, itertools.product(range(V_TOY), repeat=2)):
        p = filtered_probs(TOY_TARGET[a, b], t, k, tp)
        ref = sampling_probs(torch.tensor(TOY_TARGET[a, b], dtype=torch.float32), t, k, tp)
        np.testing.assert_allclose(ref.double().numpy(), p, atol=1e-6)
        if tp < 1.0:
            q = softmax_np(TOY_TARGET[a, b] / t)
            above = np.where(q[None, :] > q[:, None], q[None, :], 0.0).sum(1)
            assert np.abs(above - tp).min() > 1e-4
    assert (exact_joint(1.0, 0, 0.8) == 0).sum() > 0 and (exact_joint(0.7, 3, 1.0) == 0).sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize("variant", CHI2_VARIANTS, ids=CHI2_IDS)
def test_sampling_is_exact_chi2(op_impl, backend, monkeypatch, variant):
    """Sequences emitted by repeated draft/verify steps have the joint law of plain
    autoregressive sampling from p (contract §4 "Guarantee")."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        # Under the interpreter each variant takes 7-16 minutes (1000 programs): that run is
        # test_sampling_is_exact_chi2_interpreted (-m manual); the compiled kernel runs it on a
        # GPU (test_verify_gpu_chi2), and test_verify_backends checks the Triton path bit for bit
        # against the C++ one, which passes this test.
        pytest.skip("Triton chi-square under the interpreter: test_sampling_is_exact_chi2_interpreted, -m manual")
    if backend == "reference":
        # The reference spends ~2.5 ms per coin on scalar tensor arithmetic; swap in the
        # bit-identical Python-int stream (test_uniform_py_matches_reference) to keep this fast.
        monkeypatch.setattr(sys.modules["eagle_kernels.reference.verify"], "uniform", uniform_py)
    samples = emit_sequences(op_impl("verify"), CHI2_TRIALS, *variant, seed_base=10_000)
    pvalue = chi2_pvalue(samples, exact_joint(*variant))
    assert pvalue > 1e-3, pvalue


@pytest.mark.manual
@pytest.mark.parametrize("variant", CHI2_VARIANTS, ids=CHI2_IDS)
def test_sampling_is_exact_chi2_interpreted(variant):
    """The χ² exactness test on the Triton kernel under the interpreter (7-16 minutes each)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the compiled Triton kernel runs test_verify_gpu_chi2")
    fn, reason = _dispatch.implementation("verify", "triton", "cpu")
    if fn is None:
        pytest.skip(reason)
    samples = emit_sequences(fn, CHI2_TRIALS, *variant, seed_base=10_000)
    assert chi2_pvalue(samples, exact_joint(*variant)) > 1e-3


def on_cuda(fn):
    """Run a verify implementation on CUDA copies of CPU inputs; results back on the CPU."""
    def move(x):
        return x.cuda() if isinstance(x, torch.Tensor) else x

    def run(*args, **kwargs):
        out = fn(*[move(a) for a in args], **{k: move(v) for k, v in kwargs.items()})
        return VerifyOutput(*(t.cpu() for t in out))
    return run


@pytest.mark.gpu
@pytest.mark.parametrize("variant", CHI2_VARIANTS, ids=CHI2_IDS)
def test_verify_gpu_chi2(gpu_op_impl, variant):
    """The same exactness test on the GPU path, compiled."""
    samples = emit_sequences(on_cuda(gpu_op_impl("verify")), CHI2_TRIALS, *variant, seed_base=10_000)
    assert chi2_pvalue(samples, exact_joint(*variant)) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["no_renorm", "bonus_from_p"])
def test_chi2_detects_wrong_verifier(bug):
    """The χ² harness above has the power to reject plausible bugs: the same harness run on a
    verifier that skips renormalisation after a rejection, or samples the bonus from the
    unmodified p, fails decisively. The bug-free toy_verify matches the reference exactly."""
    variant = CHI2_VARIANTS[0]
    tokens, parents, logits = toy_step_inputs([list(PROMPT), [3, 3], [2, 5], [4, 0]] * 8)
    B = tokens.shape[0]
    sampling = dict(temperature=torch.full((B,), 1.0), top_k=torch.zeros(B, dtype=torch.int32),
                    top_p=torch.ones(B), seed=torch.arange(B, dtype=torch.int64), offset=torch.full((B,), 3))
    assert_same(toy_verify(tokens, parents, logits, max_depth=TOY_DEPTH, **sampling),
                reference.verify(tokens, parents, logits, max_depth=TOY_DEPTH, **sampling))

    def wrong(*args, **kwargs):
        return toy_verify(*args, bug=bug, **kwargs)

    samples = emit_sequences(wrong, CHI2_TRIALS, *variant, seed_base=10_000)
    pvalue = chi2_pvalue(samples, exact_joint(*variant))
    assert pvalue < 1e-6, pvalue
