"""draft_expand with sampled children (docs/ops.md §2, "Sampled children"): requests at a temperature
draw their top_k children without replacement by Gumbel-top-k on the counter-based stream.

Every backend against the reference: the same draws bit for bit (tokens, frontier), scores and
logprobs to float tolerance, over dtypes, d2t, mixed batches (greedy rows beside sampled rows),
-inf logits, top_k above the number of finite entries and bad rows. The draws follow the exact
law of k ordered draws without replacement (χ² over the ordered k-tuples, small V), and the
sampling arguments are validated like the others.
"""

import inspect
import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from eagle_kernels import _dispatch, reference
from eagle_kernels.reference.draft_expand import DEPTH_STRIDE, DRAFT_DRAW
from helpers import SCORE_TOL

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}


@pytest.fixture(params=["cpp", "triton"])
def expand(request):
    """The backend under test (the reference is the truth it is compared with)."""
    fn, reason = _dispatch.implementation("draft_expand", request.param, "cpu")
    if fn is None:
        pytest.skip(reason)
    if request.param == "triton" and "temperature" not in inspect.signature(fn).parameters:
        pytest.skip(f"the {request.param} draft_expand does not take sampling arguments")
    return fn


def sampling_args(B, seed, temperatures=(0.0, 0.5, 1.0, 1.7)):
    gen = torch.Generator().manual_seed(seed)
    temperature = torch.tensor(temperatures, dtype=torch.float32)[torch.randint(0, len(temperatures), (B,),
                                                                                generator=gen)]
    return dict(temperature=temperature, seed=torch.randint(-2**62, 2**62, (B,), generator=gen),
                offset=torch.randint(0, 2**40, (B,), generator=gen))


def assert_same_draws(out, want, dtype):
    assert out.tokens.dtype == torch.int64 and out.frontier.dtype == torch.int32
    assert out.scores.dtype == torch.float32 and out.logprobs.dtype == torch.float32
    assert torch.equal(out.tokens, want.tokens), (out.tokens, want.tokens)
    assert torch.equal(out.frontier, want.frontier), (out.frontier, want.frontier)
    torch.testing.assert_close(out.scores, want.scores, equal_nan=True, **SCORE_TOL[dtype])
    torch.testing.assert_close(out.logprobs, want.logprobs, equal_nan=True, **SCORE_TOL[dtype])


# ---------------------------------------------------------------------------------- tier 1
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("use_d2t", [False, True], ids=["ids", "d2t"])
@pytest.mark.parametrize("B, M, V, top_k", [(6, 1, 50, 4), (4, 5, 1031, 8), (3, 2, 7, 7)],
                         ids=["root-V50", "M5-V1031", "k=V"])
def test_matches_reference(expand, B, M, V, top_k, dtype, use_d2t):
    """Mixed batches (T = 0 rows beside sampled ones): the same draws as the reference."""
    gen = torch.Generator().manual_seed(V + M)
    logits = (torch.randn(B, M, V, generator=gen) * 3).to(dtype)
    frontier_scores = -torch.rand(B, M, generator=gen) * 4
    d2t = torch.randint(0, 1000, (V,), generator=gen) if use_d2t else None
    kwargs = dict(d2t=d2t, depth=3, **sampling_args(B, seed=V))
    out = expand(logits, frontier_scores, top_k, **kwargs)
    assert_same_draws(out, reference.draft_expand(logits, frontier_scores, top_k, **kwargs), dtype)


def test_masked_rows_and_bad_rows(expand):
    """-inf logits are never drawn before a finite one; top_k above the number of finite entries
    fills with the -inf ids in id order; NaN, +inf and all -inf rows yield ids 0..k-1 with NaN
    scores (as the deterministic rule); a tiny temperature is the argmax first."""
    V, k = 40, 6
    logits = torch.randn(6, 1, V, generator=torch.Generator().manual_seed(5))
    logits[0, 0, 4:] = float("-inf")  # 4 finite entries, k = 6
    logits[1, 0, 7] = float("nan")
    logits[2, 0, 9] = float("inf")
    logits[3, 0] = float("-inf")
    logits[4, 0, ::2] = float("-inf")
    fs = torch.zeros(6, 1)
    kwargs = dict(temperature=torch.tensor([1.0, 1.0, 0.8, 2.0, 1.0, 1e-30]), seed=torch.arange(6),
                  offset=torch.full((6,), 11), depth=1)
    out = expand(logits, fs, k, **kwargs)
    assert_same_draws(out, reference.draft_expand(logits, fs, k, **kwargs), torch.float32)
    assert sorted(out.tokens[0, :4].tolist()) == [0, 1, 2, 3] and out.tokens[0, 4:].tolist() == [4, 5]
    assert torch.isneginf(out.logprobs[0, 4:]).all()
    for b in (1, 2, 3):
        assert out.tokens[b].tolist() == list(range(k)) and torch.isnan(out.scores[b]).all()
    assert all(int(t) % 2 == 1 for t in out.tokens[4, :k])
    assert int(out.tokens[5, 0]) == int(logits[5, 0].argmax())


def test_greedy_rows_unchanged(expand):
    """Rows at T = 0 are the deterministic expansion, logprobs included, whatever the stream."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 300, generator=gen)
    fs = -torch.rand(3, 4, generator=gen)
    plain = expand(logits, fs, 5)
    zero = expand(logits, fs, 5, temperature=torch.zeros(3), seed=torch.tensor([1, 2, 3]),
                  offset=torch.tensor([4, 5, 6]), depth=7)
    for a, b in zip(plain, zero):
        assert torch.equal(a, b)
    want = reference.draft_expand(logits, fs, 5)
    torch.testing.assert_close(plain.logprobs, want.logprobs, **SCORE_TOL[torch.float32])


def test_stream_counters(expand):
    """The draws depend on (seed, offset, depth, frontier row) only: another request in the batch,
    or another batch position, changes nothing; changing any of them changes the draws."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(1, 3, 500, generator=gen).expand(4, 3, 500).contiguous()
    fs = torch.zeros(4, 3)
    kw = dict(temperature=torch.ones(4), seed=torch.tensor([5, 5, 6, 5]), offset=torch.tensor([9, 9, 9, 10]))
    out = expand(logits, fs, 8, depth=2, **kw)
    assert torch.equal(out.tokens[0], out.tokens[1])
    assert not torch.equal(out.tokens[0], out.tokens[2]) and not torch.equal(out.tokens[0], out.tokens[3])
    rows = out.tokens[0].reshape(3, 8)
    assert not torch.equal(rows[0], rows[1])  # frontier rows draw on their own counters
    assert not torch.equal(out.tokens, expand(logits, fs, 8, depth=3, **kw).tokens)
    single = expand(logits[:1], fs[:1], 8, depth=2, **{k: v[:1] for k, v in kw.items()})
    assert torch.equal(single.tokens[0], out.tokens[0])


# ---------------------------------------------------------------------------------- tier 4
def ordered_draw_law(q, k):
    """P(x_1, ..., x_k) of k ordered draws without replacement from q."""
    law = {}
    for seq in itertools.permutations(range(len(q)), k):
        prob, left = 1.0, 1.0
        for x in seq:
            prob *= q[x] / left if left > 0 else 0.0
            left -= q[x]
        law[seq] = prob
    return law


@pytest.mark.parametrize("temperature, top_k", [(1.0, 2), (0.6, 3)], ids=["T1-k2", "T0.6-k3"])
def test_draws_follow_without_replacement_law(expand, temperature, top_k):
    """The ordered k-tuples drawn for 6000 requests (one batch, offsets 0..5999) fit the exact law
    of k draws without replacement from softmax(logits / T), in draw order (χ², p > 1e-3)."""
    V, B = 5, 6000
    row = torch.tensor([1.0, 0.3, -0.5, 0.9, float("-inf")])
    logits = row.expand(B, 1, V).contiguous()
    out = expand(logits, torch.zeros(B, 1), top_k, temperature=torch.full((B,), temperature),
                 seed=torch.full((B,), 77), offset=torch.arange(B), depth=0)
    q = torch.softmax(row.double() / temperature, 0).numpy()
    law = ordered_draw_law(q, top_k)
    seqs = [tuple(t) for t in out.tokens.tolist()]
    keys = [s for s in law if law[s] * B >= 5]
    observed = np.array([sum(1 for s in seqs if s == key) for key in keys] + [0])
    observed[-1] = B - observed[:-1].sum()
    expected = np.array([law[s] * B for s in keys] + [B * (1 - sum(law[s] for s in keys))])
    assert all(law[s] > 0 for s in seqs)  # never the -inf token before the finite ones run out
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    # The logprobs are the tempered draft log-probabilities of the drawn ids.
    want = np.log(q[out.tokens.numpy()])
    np.testing.assert_allclose(out.logprobs.double().numpy(), want, atol=1e-5)


def test_reference_keys_on_documented_counters():
    """The reference's Gumbel keys use draw = 2 + depth * 65536 + m at node = the draft id."""
    from eagle_kernels.reference.random import uniform

    logp = torch.log_softmax(torch.randn(9, generator=torch.Generator().manual_seed(1)), 0)
    keys = reference.draft_expand.__globals__["gumbel_keys"](logp, 4, 5, 2, 3)
    u = uniform(4, 5, torch.arange(9), DRAFT_DRAW + 2 * DEPTH_STRIDE + 3)
    torch.testing.assert_close(keys, logp.double() - torch.log(-torch.log(u)), rtol=0, atol=0)


# ---------------------------------------------------------------------------------- tier 5
BAD_SAMPLING = {
    "temperature_negative": ("temperature", dict(temperature=torch.tensor([1.0, -0.5]))),
    "temperature_nan": ("temperature", dict(temperature=torch.tensor([float("nan"), 1.0]))),
    "temperature_inf": ("temperature", dict(temperature=torch.tensor([float("inf"), 1.0]))),
    "temperature_float64": ("temperature", dict(temperature=torch.ones(2, dtype=torch.float64))),
    "temperature_shape": ("temperature", dict(temperature=torch.ones(3))),
    "seed_int32": ("seed", dict(temperature=torch.ones(2), seed=torch.zeros(2, dtype=torch.int32))),
    "seed_shape": ("seed", dict(temperature=torch.ones(2), seed=torch.zeros(2, 1, dtype=torch.int64))),
    "offset_float": ("offset", dict(temperature=torch.ones(2), offset=torch.zeros(2))),
    "depth_negative": ("depth", dict(temperature=torch.ones(2), depth=-1)),
    "depth_too_large": ("depth", dict(temperature=torch.ones(2), depth=65535)),
}


@pytest.mark.parametrize("case", list(BAD_SAMPLING), ids=list(BAD_SAMPLING))
@pytest.mark.parametrize("path", ["reference", "backend", "registered"])
def test_bad_sampling_arguments_raise(expand, path, case):
    """Each bad sampling argument is a ValueError naming it, on every path (the C++ kernel
    validates natively, NATIVE_VALIDATION)."""
    name, kwargs = BAD_SAMPLING[case]
    fn = {"reference": reference.draft_expand, "backend": expand,
          "registered": torch.ops.eagle_kernels.draft_expand}[path]
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        fn(torch.randn(2, 3, 20), torch.zeros(2, 3), 4, **kwargs)


def test_too_many_frontier_rows_raise(expand):
    with pytest.raises(ValueError, match=r"\blogits\b"):
        expand(torch.zeros(1, 65537, 1), torch.zeros(1, 65537), 1, temperature=torch.ones(1))
