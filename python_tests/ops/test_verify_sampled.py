"""verify with sampled drafts (docs/ops.md §4, "Draft-aware rule", "Invalid draft rows"): every
backend against the reference token for token, the invalid-row fallback (status 2, the bonus from
p_u), and the argument checks. Exactness itself is test_verify_sampled_chi2.py.
"""

import inspect

import pytest
import torch

from eagle_kernels import _dispatch, reference
from helpers import ISA_ENV, assert_same, skip_unavailable_isa


@pytest.fixture(params=["cpp", "triton"])
def verify_fn(request):
    """The backend under test (the reference is the truth it is compared with)."""
    fn, reason = _dispatch.implementation("verify", request.param, "cpu")
    if fn is None:
        pytest.skip(reason)
    if request.param == "triton" and "draft_probs" not in inspect.signature(fn).parameters:
        pytest.skip("the triton verify does not take draft distributions")
    return fn


def sampled_tree_batch(seed, B, N, V, Vd=None, dtype=torch.float32, invalid=True):
    """Random trees whose sampled children are drawn without replacement from their parent's draft
    row (torch.multinomial), some deterministic children, greedy rows, filters, and (``invalid``)
    a few invalid draft rows of every kind."""
    gen = torch.Generator().manual_seed(seed)
    Vd = Vd or V
    parents = torch.full((B, N), -1, dtype=torch.int32)
    for i in range(1, N):
        parents[:, i] = torch.randint(max(0, i - 3), i, (B,), generator=gen, dtype=torch.int32)
    # The target: the draft's logits plus noise, so that children are often accepted.
    draft_logits = torch.randn(B, N, Vd, generator=gen) * 2
    d2t = None
    if Vd != V:
        ids = torch.randperm(V, generator=gen)[:Vd].sort().values
        d2t = ids - torch.arange(Vd)
    target_ids = torch.arange(Vd) if d2t is None else torch.arange(Vd) + d2t
    logits = torch.randn(B, N, V, generator=gen) - 3.0
    logits[..., target_ids] = draft_logits + 0.7 * torch.randn(B, N, Vd, generator=gen)
    logits = logits.masked_fill(torch.rand(B, N, V, generator=gen) < 0.1, float("-inf"))
    q = torch.softmax(draft_logits, -1)
    sampled = torch.rand(B, N, generator=gen) < 0.75
    tokens = torch.zeros(B, N, dtype=torch.int64)
    for b in range(B):
        for u in range(N):
            children = [c for c in range(1, N) if int(parents[b, c]) == u]
            drawn = torch.multinomial(q[b, u], Vd, replacement=False, generator=gen)[: len(children)]
            for j, c in enumerate(children):
                x = drawn[j] if bool(sampled[b, c]) else torch.argmax(q[b, u])
                tokens[b, c] = target_ids[x]
    if invalid:
        q[0, 0, 1] = float("nan")
        q[1, 0] *= 1.01
        # A negative last entry (the last chunk of a draft row split over programs) whose row
        # still sums to 1: only the entries' check finds it.
        q[2, 0, 0] += q[2, 0, -1] + 1e-6
        q[2, 0, -1] = -1e-6
        q[3, 0] = 0.0  # S = 0
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.4])[torch.randint(0, 4, (B,), generator=gen)]
    temperature[:4] = 1.0
    sampling = dict(
        temperature=temperature,
        top_k=torch.where(torch.rand(B, generator=gen) < 0.5, 0, torch.randint(1, V, (B,), generator=gen)).int(),
        top_p=torch.where(torch.rand(B, generator=gen) < 0.5, 1.0, 0.5 + 0.5 * torch.rand(B, generator=gen)),
        seed=torch.randint(-2**62, 2**62, (B,), generator=gen), offset=torch.randint(0, 2**40, (B,), generator=gen),
        draft_probs=q, draft_sampled=sampled, d2t=d2t)
    return tokens, parents, logits.to(dtype), sampling


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("B, N, V, Vd", [(12, 9, 40, None), (10, 12, 300, 120), (6, 6, 1100, None)],
                         ids=["V40", "V300-d2t", "V1100"])
def test_matches_reference(verify_fn, B, N, V, Vd, dtype):
    tokens, parents, logits, sampling = sampled_tree_batch(B * N + V, B, N, V, Vd, dtype)
    out = verify_fn(tokens, parents, logits, max_depth=4, **sampling)
    assert_same(out, reference.verify(tokens, parents, logits, max_depth=4, **sampling))
    assert set(out.status.tolist()) <= {0, 2} and (out.status[:4] == 2).any()
    assert int(out.accept_len.sum()) > 0  # drafts do get accepted


def test_draft_sampled_none_means_every_node(verify_fn):
    tokens, parents, logits, sampling = sampled_tree_batch(3, 8, 7, 50, invalid=False)
    every = dict(sampling, draft_sampled=torch.ones(8, 7, dtype=torch.bool))
    assert_same(verify_fn(tokens, parents, logits, max_depth=3, **dict(sampling, draft_sampled=None)),
                verify_fn(tokens, parents, logits, max_depth=3, **every))


def test_greedy_requests_ignore_drafts(verify_fn):
    tokens, parents, logits, sampling = sampled_tree_batch(4, 8, 7, 50)
    sampling["temperature"] = torch.zeros(8)
    plain = {k: v for k, v in sampling.items() if k not in ("draft_probs", "draft_sampled", "d2t")}
    out = verify_fn(tokens, parents, logits, max_depth=3, **sampling)
    assert_same(out, verify_fn(tokens, parents, logits, max_depth=3, **plain))
    assert (out.status == 0).all()


def test_bonus_after_mixed_rejections(verify_fn):
    """A root whose sampled child and then deterministic child are both rejected: the bonus is
    drawn from the residual with the sampled child's correction and the deterministic child's
    token zeroed, both. (The Triton walk draws a bonus from the chunk sums of the last residual
    phase when nothing changed since; here the deterministic rejection came after it, so those
    sums are stale and a new phase must run.) Flat target rows make both rejections common;
    32 requests with their own seeds."""
    B, V = 32, 300
    gen = torch.Generator().manual_seed(11)
    q = torch.softmax(torch.randn(B, 3, V, generator=gen), -1)
    logits = torch.randn(B, 3, V, generator=gen) * 0.5
    x1 = torch.multinomial(q[:, 0], 1, generator=gen)[:, 0]
    x2 = (x1 + 1 + torch.randint(0, V - 1, (B,), generator=gen)) % V
    logits[torch.arange(B), 0, x2] += 4.0  # the deterministic child holds a large share of p
    tokens = torch.stack([torch.zeros(B, dtype=torch.int64), x1, x2], 1)
    parents = torch.tensor([[-1, 0, 0]] * B, dtype=torch.int32)
    sampling = dict(temperature=torch.ones(B), seed=torch.arange(B, dtype=torch.int64) * 7919,
                    offset=torch.zeros(B, dtype=torch.int64), draft_probs=q,
                    draft_sampled=torch.tensor([[False, True, False]] * B))
    out = verify_fn(tokens, parents, logits, max_depth=1, **sampling)
    want = reference.verify(tokens, parents, logits, max_depth=1, **sampling)
    assert_same(out, want)
    assert int((want.accept_len == 0).sum()) >= 8  # the path is taken


# ------------------------------------------------------------------------------ invalid rows
V_SMALL = 8


def root_case(kind):
    """One request: a root with children 1 (sampled), 2 (sampled), 3 (deterministic) and a draft
    row made invalid as ``kind`` says (None: valid); returns (tokens, parents, logits, sampling)."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(1, 4, V_SMALL, generator=gen)
    q = torch.softmax(torch.randn(1, 4, V_SMALL, generator=gen), -1)
    tokens = torch.tensor([[0, 2, 5, 1]])
    d2t = None
    if kind == "nan":
        q[0, 0, 3] = float("nan")
    elif kind == "inf":
        q[0, 0, 3] = float("inf")
    elif kind == "negative":
        q[0, 0, 3] = -q[0, 0, 3]
    elif kind == "unnormalised":
        q[0, 0] *= 1.002
    elif kind == "zero_child":
        q[0, 0, 5] = 0.0
        q[0, 0] /= q[0, 0].sum()
    elif kind == "duplicate":
        tokens[0, 2] = 2
    elif kind in ("d2t_negative", "d2t_above"):
        d2t = torch.zeros(V_SMALL, dtype=torch.int64)
        d2t[4] = -5 if kind == "d2t_negative" else V_SMALL
    sampling = dict(temperature=torch.ones(1), seed=torch.tensor([7]), offset=torch.tensor([3]), draft_probs=q,
                    draft_sampled=torch.tensor([[False, True, True, False]]), d2t=d2t)
    return tokens, torch.tensor([[-1, 0, 0, 0]], dtype=torch.int32), logits, sampling


INVALID = ["nan", "inf", "negative", "unnormalised", "zero_child", "duplicate", "d2t_negative", "d2t_above"]


@pytest.mark.parametrize("kind", INVALID)
def test_invalid_row_falls_back_to_target(verify_fn, kind):
    """No child of the node is tried, the bonus is drawn from p_u (the token a childless root
    draws on the same stream), status 2; the same as the reference."""
    tokens, parents, logits, sampling = root_case(kind)
    out = verify_fn(tokens, parents, logits, max_depth=2, **sampling)
    assert_same(out, reference.verify(tokens, parents, logits, max_depth=2, **sampling))
    assert int(out.status[0]) == 2 and int(out.accept_len[0]) == 0
    plain = {k: sampling[k] for k in ("temperature", "seed", "offset")}
    alone = verify_fn(tokens[:, :1], parents[:, :1], logits[:, :1], max_depth=2, **plain)
    assert int(out.out_tokens[0, 0]) == int(alone.out_tokens[0, 0])
    assert 0 <= int(out.out_tokens[0, 0]) < V_SMALL


def test_valid_root_row_is_used(verify_fn):
    tokens, parents, logits, sampling = root_case(None)
    out = verify_fn(tokens, parents, logits, max_depth=2, **sampling)
    assert_same(out, reference.verify(tokens, parents, logits, max_depth=2, **sampling))
    assert int(out.status[0]) == 0


def test_bad_logits_override_invalid_drafts(verify_fn):
    """A NaN target row is status 1 even when the draft row is invalid too."""
    tokens, parents, logits, sampling = root_case("nan")
    logits[0, 0, 2] = float("nan")
    out = verify_fn(tokens, parents, logits, max_depth=2, **sampling)
    assert int(out.status[0]) == 1 and int(out.accept_len[0]) == 0


def test_rows_off_the_walk_are_not_read(verify_fn):
    """Invalid rows of unvisited nodes, of leaves and of nodes with deterministic children only
    never raise the status."""
    tokens, parents, logits, sampling = root_case(None)
    q = sampling["draft_probs"]
    q[0, 1:] = float("nan")  # rows of the leaves (max_depth = 1 stops there) and of node 3
    out = verify_fn(tokens, parents, logits, max_depth=1, **sampling)
    assert_same(out, reference.verify(tokens, parents, logits, max_depth=1, **sampling))
    assert int(out.status[0]) == 0
    deterministic = dict(sampling, draft_sampled=torch.zeros(1, 4, dtype=torch.bool))
    deterministic["draft_probs"] = torch.full_like(q, float("nan"))
    assert int(verify_fn(tokens, parents, logits, max_depth=2, **deterministic).status[0]) == 0


# ------------------------------------------------------------------------------ bad arguments
def bad_arguments():
    tokens, parents, logits, sampling = root_case(None)
    q = sampling.pop("draft_probs")
    sampling.pop("draft_sampled")
    sampling.pop("d2t")
    ok_sampled = torch.ones(1, 4, dtype=torch.bool)
    cases = {
        "draft_probs_float64": ("draft_probs", dict(draft_probs=q.double())),
        "draft_probs_2d": ("draft_probs", dict(draft_probs=q[0])),
        "draft_probs_nodes": ("draft_probs", dict(draft_probs=q[:, :3])),
        "draft_probs_vocab": ("draft_probs", dict(draft_probs=q[..., :5])),
        "draft_probs_empty": ("draft_probs", dict(draft_probs=q[..., :0], d2t=torch.zeros(0, dtype=torch.int64))),
        "d2t_int32": ("d2t", dict(draft_probs=q, d2t=torch.zeros(V_SMALL, dtype=torch.int32))),
        "d2t_length": ("d2t", dict(draft_probs=q, d2t=torch.zeros(V_SMALL + 1, dtype=torch.int64))),
        "draft_sampled_int": ("draft_sampled", dict(draft_probs=q, draft_sampled=ok_sampled.int())),
        "draft_sampled_shape": ("draft_sampled", dict(draft_probs=q, draft_sampled=ok_sampled[:, :3])),
        "draft_sampled_alone": ("draft_sampled", dict(draft_sampled=ok_sampled)),
        "d2t_alone": ("d2t", dict(d2t=torch.zeros(V_SMALL, dtype=torch.int64))),
    }
    return tokens, parents, logits, sampling, cases


BAD = list(bad_arguments()[4])


@pytest.mark.parametrize("case", BAD, ids=BAD)
@pytest.mark.parametrize("path", ["reference", "backend", "registered"])
def test_bad_draft_arguments_raise(verify_fn, path, case):
    """A ValueError naming the tensor on every path (the C++ kernel validates natively)."""
    tokens, parents, logits, sampling, cases = bad_arguments()
    name, extra = cases[case]
    fn = {"reference": reference.verify, "backend": verify_fn, "registered": torch.ops.eagle_kernels.verify}[path]
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        fn(tokens, parents, logits, max_depth=2, **sampling, **extra)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_cpp_instruction_sets_agree(isa, monkeypatch):
    """The C++ kernel's draft-aware walk gives the same outputs at every instruction-set level
    (the draft-row pass has a variant per level, same lanes), and the reference's."""
    fn, reason = _dispatch.implementation("verify", "cpp", "cpu")
    if fn is None:
        pytest.skip(reason)
    skip_unavailable_isa(isa)
    monkeypatch.setenv(ISA_ENV, isa)
    for seed, Vd in ((1, None), (2, 300)):
        tokens, parents, logits, sampling = sampled_tree_batch(seed, 10, 10, 1000, Vd)
        assert_same(fn(tokens, parents, logits, max_depth=4, **sampling),
                    reference.verify(tokens, parents, logits, max_depth=4, **sampling))
