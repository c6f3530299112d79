"""block_verify (docs/ops.md §21): a chain of drafts verified as one block.

Tier 1: the backends agree with the reference token for token on random chains (greedy and
sampling requests mixed, top-k / top-p, d2t, point-mass drafts, ragged chains, every logits
dtype), bad target rows give status 1 and invalid draft rows status 2, and bad input is a
ValueError naming the tensor. Tier 4: the rule is exact (χ² of the first three emitted tokens of
repeated draft / verify steps on the toy model of test_verify_chi2 against plain sampling's
joint law), an independent numpy block verifier with planted bugs fails the same check, and the
block keeps at least as many drafts on average as token-by-token verification of the same chains.
"""

import sys

import numpy as np
import pytest
import torch
from test_verify_backends import assert_same
from test_verify_chi2 import PROMPT, chi2_pvalue, exact_joint
from test_verify_sampled_chi2 import SHAPES, Shape, draft_step

import eagle_kernels
from eagle_kernels import _dispatch, reference
from eagle_kernels._types import VerifyOutput
from eagle_kernels.reference.random import ACCEPT_DRAW, BONUS_DRAW
from helpers import filtered_probs, uniform_py

BACKENDS = ["cpp", "triton"]


def backend_impl(name):
    fn, reason = _dispatch.implementation("block_verify", name, "cpu")
    if fn is None:
        pytest.skip(reason)
    return fn


def random_chains(seed, B, N, V, *, dtype=torch.float32, d2t=False, point_mass=False, ragged=True,
                  greedy_fraction=0.25, filters=True):
    """A batch of chains whose drafts are drawn from their draft rows (so most are valid), logits
    on a coarse grid with -inf masks, greedy and sampling requests mixed."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randint(-8, 8, (B, N, V), generator=gen).float() * 0.5)
    logits = torch.where(torch.rand(B, N, V, generator=gen) < 0.1, torch.tensor(float("-inf")), logits)
    logits[..., 0] = 1.0  # every row keeps a finite entry
    Vd = V // 2 if d2t else V
    draft_probs = torch.softmax(torch.randn(B, N, Vd, generator=gen) * 2.0, dim=-1)
    tokens = torch.zeros(B, N, dtype=torch.int64)
    draws = torch.multinomial(draft_probs.reshape(B * N, Vd), 1, generator=gen).reshape(B, N)
    d2t_map = None
    if d2t:
        targets = torch.randperm(V, generator=gen)[:Vd].sort().values
        d2t_map = targets - torch.arange(Vd)
        tokens[:, 1:] = targets[draws[:, :-1]]
    else:
        tokens[:, 1:] = draws[:, :-1]
    # Some drafts that the target takes greedily, so greedy chains accept a few.
    greedy_tokens = logits.argmax(-1)
    take = torch.rand(B, N - 1, generator=gen) < 0.5
    greedy = torch.rand(B, generator=gen) < greedy_fraction
    tokens[:, 1:] = torch.where(take & greedy[:, None], greedy_tokens[:, :-1], tokens[:, 1:])
    temperature = torch.where(greedy, torch.tensor(0.0), torch.rand(B, generator=gen) * 1.5 + 0.3)
    kwargs = dict(
        temperature=temperature, seed=torch.randint(0, 2**40, (B,), generator=gen),
        offset=torch.randint(0, 1000, (B,), generator=gen))
    if filters:
        kwargs["top_k"] = torch.where(torch.rand(B, generator=gen) < 0.5, torch.randint(1, V, (B,), generator=gen),
                                      torch.tensor(0)).to(torch.int32)
        kwargs["top_p"] = torch.where(torch.rand(B, generator=gen) < 0.5, torch.rand(B, generator=gen) * 0.6 + 0.35,
                                      torch.tensor(1.0))
    if ragged:
        kwargs["num_drafts"] = torch.randint(0, N, (B,), generator=gen, dtype=torch.int32)
    if not point_mass:
        kwargs["draft_probs"] = draft_probs
        kwargs["d2t"] = d2t_map
    return tokens, logits.to(dtype), kwargs


CASES = {
    "plain": dict(),
    "d2t": dict(d2t=True),
    "point-mass": dict(point_mass=True),
    "full-chains": dict(ragged=False),
    "no-filters": dict(filters=False),
    "bf16": dict(dtype=torch.bfloat16),
    "fp16": dict(dtype=torch.float16),
    "fp64": dict(dtype=torch.float64),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_backends_match_reference(backend, case):
    fn = backend_impl(backend)
    # Triton runs interpreted, at Python speed: one seed a case (a different one each),
    # test_block_verify_triton.py checks its launches further.
    for seed in range(3) if backend == "cpp" else [list(CASES).index(case)]:
        tokens, logits, kwargs = random_chains(seed, 6, 5, 97, **CASES[case])
        draft_probs = kwargs.pop("draft_probs", None)
        expected = reference.block_verify(tokens, logits, draft_probs, **kwargs)
        assert_same(fn(tokens, logits, draft_probs, **kwargs), expected, (case, seed))


def test_cpp_large_vocabulary_and_batch_split():
    """V above a few SIMD blocks and a batch the C++ parallel_for splits: still the reference's."""
    fn = backend_impl("cpp")
    tokens, logits, kwargs = random_chains(11, 16, 4, 4099)
    draft_probs = kwargs.pop("draft_probs")
    expected = reference.block_verify(tokens, logits, draft_probs, **kwargs)
    assert_same(fn(tokens, logits, draft_probs, **kwargs), expected)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_bad_rows_and_invalid_draft_rows(backend):
    fn = reference.block_verify if backend == "reference" else backend_impl(backend)
    B, N, V = 6, 4, 16
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(B, N, V, generator=gen)
    q = torch.softmax(torch.randn(B, N, V, generator=gen), -1)
    tokens = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(B, N)
    logits[0, 2, 5] = float("nan")  # a sampling request reads every row of its block: status 1
    logits[1, 3] = float("-inf")  # no finite entry in its bonus row: status 1
    q[2, 1, 0] = -0.5  # a negative entry: the block ends before draft 2
    q[3, 0] *= 1.5  # a sum of 1.5: the block ends before draft 1
    q[4, 2, tokens[4, 3]] = 0.0  # draft 3 has draft probability 0: the block ends before it
    q[4, 2] /= q[4, 2].sum()
    temperature = torch.ones(B)
    temperature[5] = 0.0
    logits[5, 1, 2] = float("inf")  # greedy: status 1 only if the walk reaches row 1
    logits[5, 0, tokens[5, 1]] = 100.0  # it does
    out = fn(tokens, logits, q, temperature=temperature, seed=torch.arange(B), offset=torch.zeros(B, dtype=torch.int64))
    assert out.status.tolist() == [1, 1, 2, 2, 2, 1]
    for b in (0, 1, 5):
        finite = torch.where(torch.isfinite(logits[b, 0]), logits[b, 0], torch.tensor(float("-inf")))
        assert int(out.accept_len[b]) == 0 and int(out.out_tokens[b, 0]) == int(finite.argmax())
    assert int(out.accept_len[2]) <= 1 and int(out.accept_len[3]) == 0 and int(out.accept_len[4]) <= 2
    assert ((out.out_tokens >= -1) & (out.out_tokens < V)).all()


def test_bad_input_is_a_value_error():
    tokens, logits, kwargs = random_chains(0, 3, 4, 20)
    q = kwargs.pop("draft_probs")
    kwargs.pop("d2t")
    with pytest.raises(ValueError, match="num_drafts"):
        reference.block_verify(tokens, logits, q, num_drafts=torch.tensor([0, 4, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="num_drafts"):
        reference.block_verify(tokens, logits, q, num_drafts=torch.tensor([0, 1, 1]))  # int64
    bad_tokens = tokens.clone()
    bad_tokens[1, 2] = 20
    with pytest.raises(ValueError, match="tokens"):
        reference.block_verify(bad_tokens, logits, q)
    bad_tokens[1, 2] = -1  # padding past num_drafts is never read
    reference.block_verify(bad_tokens, logits, q, num_drafts=torch.tensor([3, 1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="d2t"):
        reference.block_verify(tokens, logits, None, d2t=torch.zeros(20, dtype=torch.int64))
    with pytest.raises(ValueError, match="draft_probs"):
        reference.block_verify(tokens, logits, q[:, :, :10])
    with pytest.raises(ValueError, match="draft_probs"):
        reference.block_verify(tokens, logits, q.double())
    with pytest.raises(ValueError, match="top_p"):
        reference.block_verify(tokens, logits, q, temperature=torch.ones(3), top_p=torch.zeros(3))
    with pytest.raises(ValueError, match="temperature"):
        reference.block_verify(tokens, logits, q, temperature=torch.ones(2))
    for backend in BACKENDS:
        fn, _ = _dispatch.implementation("block_verify", backend, "cpu")
        if fn is not None:
            with pytest.raises(ValueError, match="num_drafts"):
                fn(tokens, logits, q, num_drafts=torch.tensor([0, 4, 1], dtype=torch.int32))
            # Mixed devices: the tensor off the logits' device is named.
            with pytest.raises(ValueError, match="draft_probs"):
                fn(tokens, logits, q.to("meta"))
            with pytest.raises(ValueError, match="seed"):
                fn(tokens, logits, q, temperature=torch.ones(3), seed=torch.zeros(3, dtype=torch.int64, device="meta"))


@pytest.mark.parametrize("case", ["num-drafts-past-N", "num-drafts-negative", "token-past-V", "token-negative",
                                  "temperature-nan", "temperature-negative", "top-k-negative", "top-p-zero",
                                  "top-p-nan"])
@pytest.mark.parametrize("route", ["registered-op", "values-unchecked"])
def test_native_kernel_checks_values(case, route, monkeypatch):
    """The C++ kernel repeats the value checks (as verify's does): called as the registered op, or through the public
    op with EAGLE_KERNELS_CHECK_VALUES=0, a num_drafts past N - 1 or a draft token past V read outside the request's
    rows (a crash), and a NaN temperature accepted every draft."""
    if not _dispatch.HAS_CPP:
        pytest.skip(f"extension not built: {_dispatch.CPP_IMPORT_ERROR}")
    tokens, logits, kwargs = random_chains(0, 3, 4, 20)
    B, N, V = logits.shape
    kwargs = {**kwargs, "temperature": torch.full((B,), 0.8), "top_k": torch.zeros(B, dtype=torch.int32),
              "top_p": torch.ones(B), "num_drafts": torch.full((B,), N - 1, dtype=torch.int32)}
    spoil = {"num-drafts-past-N": ("num_drafts", 1, N), "num-drafts-negative": ("num_drafts", 2, -1),
             "temperature-nan": ("temperature", 0, float("nan")), "temperature-negative": ("temperature", 1, -1.0),
             "top-k-negative": ("top_k", 2, -5), "top-p-zero": ("top_p", 0, 0.0),
             "top-p-nan": ("top_p", 1, float("nan"))}
    if case.startswith("token"):
        name = "tokens"
        tokens = tokens.clone()
        tokens[1, 2] = 10**12 if case == "token-past-V" else -3
    else:
        name, row, value = spoil[case]
        kwargs[name] = kwargs[name].clone()
        kwargs[name][row] = value
    if route == "registered-op":
        call = torch.ops.eagle_kernels.block_verify
    else:
        monkeypatch.setenv("EAGLE_KERNELS_CHECK_VALUES", "0")
        monkeypatch.setenv(_dispatch.BACKEND_ENV, "cpp")
        call = eagle_kernels.block_verify
    with pytest.raises(ValueError, match=rf"block_verify: {name}: expected"):
        call(tokens, logits, kwargs.pop("draft_probs"), **kwargs)


def test_greedy_chain_is_verifys_walk():
    """A greedy request accepts exactly what §4 accepts on the same chain."""
    tokens, logits, kwargs = random_chains(5, 12, 6, 50, ragged=False, greedy_fraction=1.0)
    out = reference.block_verify(tokens, logits, kwargs["draft_probs"])
    parents = torch.arange(-1, 5, dtype=torch.int32).repeat(12, 1)
    assert_same(out, reference.verify(tokens, parents, logits, max_depth=5))


# ------------------------------------------------------------------------------ exactness (tier 4)
EMIT = 3
CHAIN = SHAPES["chain"]
POINT_CHAIN = Shape(CHAIN.parents, "-DDD", CHAIN.max_depth)


def block_sequences(fn, trials, shape, use_d2t, target, seed_base, point_mass=False):
    """Repeated draft (a chain drawn from the toy draft) -> block_verify steps from PROMPT; the first
    EMIT tokens of each request, the statuses seen and the mean accepted length."""
    temperature, top_k, top_p = target
    rng = np.random.default_rng(seed_base)
    histories = [list(PROMPT) for _ in range(trials)]
    emitted = [[] for _ in range(trials)]
    statuses, accepted, steps = set(), 0, 0
    step = 0
    while True:
        active = [i for i in range(trials) if len(emitted[i]) < EMIT]
        if not active:
            break
        tokens, _, logits, drafts = draft_step([histories[i] for i in active], shape, use_d2t, "without", rng)
        B = len(active)
        out = fn(tokens, logits, None if point_mass else drafts["draft_probs"],
                 temperature=torch.full((B,), temperature, dtype=torch.float32),
                 top_k=torch.full((B,), top_k, dtype=torch.int32), top_p=torch.full((B,), top_p, dtype=torch.float32),
                 seed=torch.tensor([seed_base + i for i in active], dtype=torch.int64),
                 offset=torch.full((B,), 1000 + step, dtype=torch.int64), d2t=None if point_mass else drafts["d2t"])
        statuses |= set(out.status.tolist())
        accepted += int(out.accept_len.sum())
        steps += B
        for row, i in enumerate(active):
            new = out.out_tokens[row, : int(out.accept_len[row]) + 1].tolist()
            histories[i] += new
            emitted[i] += new
        step += 1
    return np.array([e[:EMIT] for e in emitted]), statuses, accepted / steps


VARIANTS = [
    ("t1", False, (1.0, 0, 1.0), False),
    ("d2t-t0.7-k3", True, (0.7, 3, 1.0), False),
    ("p0.8", False, (1.0, 0, 0.8), False),
    ("point-mass-t1", False, (1.0, 0, 1.0), True),
]
TRIALS = 2000


@pytest.fixture(params=[pytest.param("reference", marks=pytest.mark.slow), "cpp"])
def block_fn(request, monkeypatch):
    """The block_verify under test (the Triton path equals the reference token for token above)."""
    if request.param == "reference":
        monkeypatch.setattr(sys.modules["eagle_kernels.reference.block_verify"], "uniform", uniform_py)
        return reference.block_verify
    return backend_impl(request.param)


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_block_verification_is_exact_chi2(block_fn, variant):
    _, use_d2t, target, point_mass = variant
    shape = POINT_CHAIN if point_mass else CHAIN
    samples, statuses, _ = block_sequences(block_fn, TRIALS, shape, use_d2t, target, 30_000, point_mass)
    assert statuses == {0}
    assert chi2_pvalue(samples, exact_joint(*target)) > 1e-3


def toy_block_verify(tokens, target_logits, draft_probs=None, *, temperature, top_k, top_p, seed, offset, d2t=None,
                     bug=None):
    """An independent float64 numpy block verifier of full chains with sampled drafts, optionally
    with a planted bug: ``token_ratio`` takes h_i = p_i at every i (the residual masses ignored);
    ``target_bonus`` draws the bonus of a cut block from P_t, as if nothing had been drafted there."""
    B, N, V = target_logits.shape
    G = N - 1
    coins = reference.uniform(seed[:, None, None], offset[:, None, None], torch.arange(N)[None, :, None],
                              torch.tensor([ACCEPT_DRAW, BONUS_DRAW])[None, None, :]).numpy()
    x = target_logits.double().numpy()
    q_all = draft_probs.double().numpy()
    targets = np.arange(q_all.shape[-1]) + (d2t.numpy() if d2t is not None else 0)
    accept_len = torch.zeros(B, dtype=torch.int32)
    accept_nodes = torch.full((B, N), -1, dtype=torch.int32)
    out_tokens = torch.full((B, N), -1, dtype=torch.int64)
    for b in range(B):
        P = [filtered_probs(x[b, i], float(temperature[b]), int(top_k[b]), float(top_p[b])) for i in range(N)]
        r = np.zeros((N, V))
        r[:, targets] = q_all[b] / q_all[b].sum(-1, keepdims=True)
        chain = tokens[b, 1:].numpy()
        p = [1.0]
        for i in range(1, G + 1):
            p.append(min(1.0, p[-1] * P[i - 1][chain[i - 1]] / r[i - 1][chain[i - 1]]))
        t = 0
        for i in range(1, G + 1):
            if i < G and bug != "token_ratio":
                R = np.maximum(p[i] * P[i] - r[i], 0).sum()
                h = R / (R + 1 - p[i]) if R + 1 - p[i] > 0 else 1.0
            else:
                h = p[i]
            if coins[b, i, ACCEPT_DRAW] < h:
                t = i
        if t == G:
            w = P[G]
        else:
            w = np.maximum(p[t] * P[t] - r[t], 0)
            w = w if w.sum() > 0 and bug != "target_bonus" else P[t]
        cdf = np.cumsum(w)
        bonus = int(np.argmax(cdf > coins[b, t, BONUS_DRAW] * cdf[-1]))
        emitted = list(chain[:t]) + [bonus]
        accept_len[b] = t
        accept_nodes[b, : t + 1] = torch.arange(t + 1, dtype=torch.int32)
        out_tokens[b, : t + 1] = torch.tensor(emitted)
    return VerifyOutput(accept_len, accept_nodes, out_tokens, torch.zeros(B, dtype=torch.int32))


def test_toy_block_verifier_matches_reference():
    rng = np.random.default_rng(7)
    histories = [list(PROMPT), [3, 3], [2, 5], [4, 0], [1, 1], [5, 2]] * 4
    for use_d2t in (False, True):
        tokens, _, logits, drafts = draft_step(histories, CHAIN, use_d2t, "without", rng)
        B = tokens.shape[0]
        sampling = dict(temperature=torch.full((B,), 0.9), top_k=torch.zeros(B, dtype=torch.int32),
                        top_p=torch.ones(B), seed=torch.arange(B, dtype=torch.int64), offset=torch.full((B,), 3))
        assert_same(toy_block_verify(tokens, logits, drafts["draft_probs"], d2t=drafts["d2t"], **sampling),
                    reference.block_verify(tokens, logits, drafts["draft_probs"], d2t=drafts["d2t"], **sampling))


@pytest.mark.parametrize("bug", ["token_ratio", "target_bonus"])
def test_chi2_detects_wrong_block_rule(bug):
    def wrong(*args, **kwargs):
        return toy_block_verify(*args, bug=bug, **kwargs)

    samples, _, _ = block_sequences(wrong, TRIALS, CHAIN, False, (1.0, 0, 1.0), 30_000)
    assert chi2_pvalue(samples, exact_joint(1.0, 0, 1.0)) < 1e-6


def test_block_keeps_at_least_what_token_verification_keeps():
    """Same chains, same targets: the block's mean accepted length is not below verify's (§4) by
    more than sampling noise, and on this toy draft it is above it."""
    fn = backend_impl("cpp")
    rng = np.random.default_rng(99)
    histories = [list(PROMPT), [3, 3], [2, 5], [4, 0], [1, 1], [5, 2], [0, 4], [2, 2]] * 1000
    tokens, parents, logits, drafts = draft_step(histories, CHAIN, False, "without", rng)
    B = tokens.shape[0]
    sampling = dict(temperature=torch.ones(B), top_k=torch.zeros(B, dtype=torch.int32), top_p=torch.ones(B),
                    seed=torch.arange(B, dtype=torch.int64), offset=torch.full((B,), 11))
    token_wise = reference.verify if _dispatch.implementation("verify", "cpp", "cpu")[0] is None else \
        _dispatch.implementation("verify", "cpp", "cpu")[0]
    token_len = token_wise(tokens, parents, logits, max_depth=CHAIN.max_depth, **sampling, **drafts).accept_len.double()
    block_len = fn(tokens, logits, drafts["draft_probs"], **sampling).accept_len.double()
    difference = block_len.mean() - token_len.mean()
    noise = (block_len.std() + token_len.std()) / B ** 0.5
    assert difference > 3 * noise, (float(block_len.mean()), float(token_len.mean()), float(noise))
