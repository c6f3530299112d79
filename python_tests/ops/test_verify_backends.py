"""verify: the backends agree with each other token for token (contract §4, docs/design.md
"Counter-based random stream": same stream, same float32 / float64 arithmetic).

Random trees built to hit the edges of the sampling rules: logits on a coarse grid (many exact
ties, so top-k and top-p thresholds fall inside tie groups), -inf masks, draft tokens with
p(x) = 0 (masked or filtered out), duplicate sibling tokens, greedy and sampling rows mixed in
one batch, and V not a multiple of the Triton block (and above one block). The C++ path is also
checked at V = 262144 and for batch invariance when its parallel_for splits the batch.
Differences between paths can only come from the last bit of an exp or a sum, which flips a
decision only when a coin lands within that of a threshold; the inputs here keep no top-p mass
within 1e-6 of its threshold.
"""

import dataclasses
import math

import pytest
import torch

from eagle_kernels import _dispatch, reference
from eagle_kernels._types import VerifyOutput
from eagle_kernels.reference.verify import sampling_probs
from helpers import top_p_margin


def backend_impl(name):
    fn, reason = _dispatch.implementation("verify", name, "cpu")
    if fn is None:
        pytest.skip(reason)
    return fn


def assert_same(a, b, what=""):
    for field, x, y in zip(VerifyOutput._fields, a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), (what, field, x, y)


def tricky_batch(seed, B, N, V, dtype=torch.float32, greedy_fraction=0.3):
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    for i in range(1, N):
        # shallow-ish trees with many siblings
        parents[:, i] = torch.randint(max(0, i - 4), i, (B,), generator=gen, dtype=torch.int32)
    # Grid logits: 8 levels, 0.5 apart, so every row has large tie groups.
    logits = torch.randint(-5, 3, (B, N, V), generator=gen).double() * 0.5
    masked = torch.rand(B, N, V, generator=gen) < 0.15
    masked[..., 0] &= ~masked[..., 1:].all(-1)
    logits = logits.masked_fill(masked, float("-inf"))
    tokens = torch.randint(0, V, (B, N), generator=gen)
    kind = torch.randint(0, 5, (B, N), generator=gen)
    parent_rows = torch.gather(logits, 1, parents.clamp(min=0).long()[..., None].expand(B, N, V))
    top = parent_rows.argmax(-1)
    lowest = torch.where(torch.isinf(parent_rows), float("inf"), parent_rows).argmin(-1)
    masked_token = torch.where(torch.isinf(parent_rows), 1.0, 0.0).argmax(-1)  # a -inf logit if any
    tokens = torch.where(kind == 0, top, tokens)
    tokens = torch.where(kind == 1, lowest, tokens)  # often cut by top-k / top-p
    tokens = torch.where(kind == 2, masked_token, tokens)  # p(x) = 0 where the row has a -inf
    for b in range(B):  # kind 3: duplicate an earlier sibling's token
        for i in range(2, N):
            if int(kind[b, i]) == 3:
                sibs = [j for j in range(1, i) if int(parents[b, j]) == int(parents[b, i])]
                if sibs:
                    tokens[b, i] = tokens[b, sibs[0]]
    greedy = torch.rand(B, generator=gen) < greedy_fraction
    temperature = torch.tensor([0.5, 1.0, 1.7, 0.25])[torch.randint(0, 4, (B,), generator=gen)]
    sampling = dict(
        temperature=torch.where(greedy, 0.0, temperature).float(),
        top_k=torch.where(torch.rand(B, generator=gen) < 0.3, 0,
                          torch.randint(1, min(V, 40) + 1, (B,), generator=gen)).int(),
        top_p=torch.where(torch.rand(B, generator=gen) < 0.3, 1.0, 0.2 + 0.75 * torch.rand(B, generator=gen)).float(),
        seed=torch.randint(-2**62, 2**62, (B,), generator=gen),
        offset=torch.randint(0, 2**40, (B,), generator=gen),
    )
    return tokens, parents, logits.to(dtype), sampling


# (id, B, N, V): the V values straddle the Triton block (min(1024, next_pow2(V)) wide).
CASES = [("V37", 8, 12, 37), ("V64", 6, 16, 64), ("V1100-two-blocks", 4, 10, 1100)]
# The Triton interpreter takes 10-35 s per (case, seed) here: it runs one seed per case, along
# the anti-diagonal (V37: seed 2, greedy, temperature-only, top-p and top-k + top-p rows; V64:
# seed 1, temperature-only, top-k, top-p and top-k + top-p rows, greedy through the greedy-only
# call; V1100: seed 0, greedy and top-k + top-p rows across two blocks). The C++ kernel runs
# every seed.
TRITON_SEEDS = {"V37": 2, "V64": 1, "V1100-two-blocks": 0}


@pytest.mark.parametrize("other", ["cpp", "triton"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"seed{s}")
def test_backends_match_reference_on_tricky_trees(other, case, seed):
    name, B, N, V = case
    if other == "triton" and seed != TRITON_SEEDS[name]:
        pytest.skip("Triton interpreter: one seed per case")
    verify = backend_impl(other)
    tokens, parents, logits, sampling = tricky_batch(1000 * seed + V, B, N, V)
    if top_p_margin(logits, sampling) < 1e-6:
        pytest.skip("a top-p mass within rounding of its threshold")
    for max_depth in (2, 5):
        want = reference.verify(tokens, parents, logits, max_depth=max_depth, **sampling)
        assert_same(verify(tokens, parents, logits, max_depth=max_depth, **sampling), want, (other, max_depth))
    # greedy only (no sampling tensors at all)
    assert_same(verify(tokens, parents, logits, max_depth=5), reference.verify(tokens, parents, logits, max_depth=5))


ISA_LEVELS = ("scalar", "avx2", "avx512-ymm", "avx512", "avx512-bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpp_instruction_sets_match_reference(case, dtype, monkeypatch):
    """EAGLE_KERNELS_CPU_ISA caps the C++ kernel's variant (baseline x86-64, AVX2, AVX-512; a cap
    above what the CPU has runs its best), so every variant is checked on one machine: each gives
    the reference's outputs, token for token."""
    name, B, N, V = case
    verify = backend_impl("cpp")
    tokens, parents, logits, sampling = tricky_batch(3000 + V, B, N, V, dtype=dtype)
    if top_p_margin(logits.double(), sampling) < 1e-6:
        pytest.skip("a top-p mass within rounding of its threshold")
    want = reference.verify(tokens, parents, logits, max_depth=5, **sampling)
    for isa in ISA_LEVELS:
        monkeypatch.setenv("EAGLE_KERNELS_CPU_ISA", isa)
        assert_same(verify(tokens, parents, logits, max_depth=5, **sampling), want, isa)


def test_tricky_batch_covers_the_edges():
    """The generator really produces what the cases above claim to cover."""
    tokens, parents, logits, sampling = tricky_batch(7, 8, 12, 37)
    B, N, V = logits.shape
    dup = zero_p = 0
    for b in range(B):
        for i in range(1, N):
            p = int(parents[b, i])
            sibs = [j for j in range(1, i) if int(parents[b, j]) == p]
            dup += any(int(tokens[b, j]) == int(tokens[b, i]) for j in sibs)
            zero_p += bool(torch.isinf(logits[b, p, tokens[b, i]]))
    assert dup > 0 and zero_p > 0
    assert (sampling["temperature"] == 0).any() and (sampling["temperature"] > 0).any()
    assert ((sampling["top_k"] > 0) & (sampling["temperature"] > 0)).any()
    assert ((sampling["top_p"] < 1) & (sampling["temperature"] > 0)).any()
    # top-k boundaries fall inside tie groups: the k-th largest logit is tied with the (k+1)-th
    row = logits[0, 0]
    ordered = row.sort(descending=True).values
    assert any(bool(ordered[k - 1] == ordered[k]) for k in range(1, 20))


def test_cpp_matches_reference_at_v_262144():
    verify = backend_impl("cpp")
    B, N, V = 3, 6, 262144
    gen = torch.Generator().manual_seed(3)
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]] * B, dtype=torch.int32)
    logits = torch.randn(B, N, V, generator=gen) * 2.0
    spikes = torch.randint(0, V, (B, N), generator=gen)
    logits.scatter_add_(2, spikes[..., None], torch.full((B, N, 1), 14.0))  # walks go deep
    tokens = torch.gather(spikes, 1, parents.clamp(min=0).long())
    tokens[:, 2] = torch.randint(0, V, (B,), generator=gen)
    sampling = dict(temperature=torch.tensor([0.0, 1.0, 0.7]), top_k=torch.tensor([0, 0, 1000], dtype=torch.int32),
                    top_p=torch.tensor([1.0, 0.95, 0.9]), seed=torch.tensor([1, 2, 3]),
                    offset=torch.tensor([4, 5, 6]))
    for max_depth in (1, 3):
        got = verify(tokens, parents, logits, max_depth=max_depth, **sampling)
        assert_same(got, reference.verify(tokens, parents, logits, max_depth=max_depth, **sampling))
    assert int(got.accept_len.max()) >= 2


@pytest.mark.parametrize("threads", [1, 2], ids=["threads1", "threads2"])
def test_cpp_batch_invariance_parallel(threads):
    """A request's result does not depend on its batch, also when parallel_for splits the
    batch across threads (V large enough for a grain of one request)."""
    verify = backend_impl("cpp")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokens, parents, logits, sampling = tricky_batch(11, 12, 8, 20000)
        full = verify(tokens, parents, logits, max_depth=4, **sampling)
        for b in (0, 5, 11):
            sl = slice(b, b + 1)
            alone = verify(tokens[sl], parents[sl], logits[sl], max_depth=4,
                           **{k: v[sl] for k, v in sampling.items()})
            for field in range(4):
                assert torch.equal(alone[field][0], full[field][b])
        reversed_ = verify(tokens.flip(0), parents.flip(0), logits.flip(0), max_depth=4,
                           **{k: v.flip(0) for k, v in sampling.items()})
        for field in range(4):
            assert torch.equal(reversed_[field].flip(0), full[field])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_candidate_lists_match_full_row_search(dtype):
    """Triton sampling rows with top-k or top-p take a candidate list when one holds every
    token the filters keep, and search the whole row otherwise. Both paths, and the
    reference, give the same tokens; the batch exercises both (a capacity of 32 entries under
    the interpreter: V 70 rows at T 0.25 fit, flat rows do not)."""
    backend_impl("triton")
    from eagle_kernels.triton import verify as triton_verify

    tokens, parents, logits, sampling = tricky_batch(77, 16, 10, 70, dtype=dtype, greedy_fraction=0.0)
    sampling["temperature"][::2] = 0.25  # peaked rows: short lists
    if top_p_margin(logits, sampling) < 1e-6:
        pytest.skip("a top-p mass within rounding of its threshold")
    args = (tokens, parents, logits, 4, sampling["temperature"], sampling["top_k"], sampling["top_p"],
            sampling["seed"], sampling["offset"])
    config = dataclasses.replace(triton_verify.INTERPRETER_CONFIG, candidates=32)
    listed = triton_verify._launch(*args, config)
    searched = triton_verify._launch(*args, dataclasses.replace(config, candidates=0))
    counts = listed.cand_count
    # Only the rows the walk visits are read (-2 elsewhere); both launches visit the same rows.
    visited = counts > -2
    assert torch.equal(visited, searched.cand_count > -2)
    assert int(visited.sum()) <= int((listed.output.accept_len + 1).sum()) < counts.numel()
    filtered = ((sampling["top_k"] > 0) | (sampling["top_p"] < 1))[:, None].expand_as(counts) & visited
    assert (counts[filtered] >= 0).any() and (counts[filtered] == -1).any()
    assert (counts[visited & ~filtered] == -1).all() and (searched.cand_count[visited] == -1).all()
    # The row scalars agree: thresholds exactly, normalisers to the last bit of a float64 sum
    # rounded to float32, the weights' mass to float64 rounding.
    rows = counts >= 0
    a, b = listed.stats[rows], searched.stats[rows]
    slots = triton_verify
    for slot in (slots.STAT_MAX, slots.STAT_KTH, slots.STAT_CUT):
        assert torch.equal(a[:, slot.value], b[:, slot.value]), slot
    for slot in (slots.STAT_DENOM, slots.STAT_NORM):
        torch.testing.assert_close(a[:, slot.value], b[:, slot.value], rtol=2.4e-7, atol=0)
    torch.testing.assert_close(a[:, slots.STAT_MASS.value], b[:, slots.STAT_MASS.value], rtol=1e-12, atol=0)
    assert_same(listed.output, searched.output, "list vs full row")
    assert_same(listed.output, reference.verify(tokens, parents, logits, max_depth=4, **sampling), "list vs reference")


@pytest.mark.parametrize("other", ["cpp", "triton"])
def test_top_p_above_the_rounded_total_mass_keeps_every_token(other):
    """Two logits whose float32 probabilities sum (in float64) to 0.99999993, below the
    largest float32 top_p under 1: the mass strictly above either token is below top_p, so
    the reference keeps both. An earlier Triton search found no threshold and kept neither
    (its bonus then fell back to token 0 on every coin)."""
    verify = backend_impl(other)
    top_p = torch.nextafter(torch.tensor([1.0]), torch.tensor([0.0]))
    logits = torch.tensor([[[-2.3693237, 0.0]]])
    tokens, parents = torch.tensor([[0]]), torch.tensor([[-1]], dtype=torch.int32)
    bonus = []
    for seed in range(8):
        sampling = dict(temperature=torch.tensor([1.0]), top_k=torch.tensor([0], dtype=torch.int32), top_p=top_p,
                        seed=torch.tensor([seed]), offset=torch.tensor([0]))
        want = reference.verify(tokens, parents, logits, max_depth=0, **sampling)
        assert_same(verify(tokens, parents, logits, max_depth=0, **sampling), want, seed)
        bonus.append(int(want.out_tokens[0, 0]))
    assert set(bonus) == {0, 1}


def test_triton_full_row_bonus_over_many_tiles():
    """Temperature-only rows keep weight on every token, so the Triton bonus draw runs over the
    whole row: per-tile sums, the rejected tokens' tiles summed again, then one tile scanned.
    Flat rows (T = 3) over three 1024-entry tiles put the drawn tokens in every tile; each
    equals the reference's."""
    verify = backend_impl("triton")
    gen = torch.Generator().manual_seed(5)
    B, N, V = 6, 6, 3000
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]] * B, dtype=torch.int32)
    logits = torch.randn(B, N, V, generator=gen)
    tokens = torch.randint(0, V, (B, N), generator=gen)
    tokens[:, 1] = logits[:, 0].argmax(-1)  # a likely child of the root, mostly rejected at T = 3
    sampling = dict(temperature=torch.full((B,), 3.0), top_k=torch.zeros(B, dtype=torch.int32),
                    top_p=torch.ones(B), seed=torch.arange(B), offset=torch.zeros(B, dtype=torch.int64))
    want = reference.verify(tokens, parents, logits, max_depth=3, **sampling)
    assert_same(verify(tokens, parents, logits, max_depth=3, **sampling), want)
    bonus = want.out_tokens[torch.arange(B), want.accept_len.long()]
    assert len(set((bonus // 1024).tolist())) >= 2


def test_triton_top_p_nucleus_just_above_a_level_takes_the_list():
    """Top-p alone, the nucleus ending at s = -1.4, just above the first list level (-1.5): the
    cut must clear the listed level by 1 in s (so that no unlisted token ties with it in p),
    which that level does not give. The list is taken one level lower (-3) instead of searching
    the whole row (the bench's top-p rows did), and gives the reference's tokens."""
    backend_impl("triton")
    from eagle_kernels.triton import verify as triton_verify

    V = 70
    logits = torch.full((1, 2, V), -8.0)
    logits[:, :, 5], logits[:, :, 40] = 0.0, -1.4  # p about 0.79 and 0.19: top-p 0.9 needs both
    tokens, parents = torch.tensor([[0, 9]]), torch.tensor([[-1, 0]], dtype=torch.int32)
    for seed in range(4):
        sampling = dict(temperature=torch.tensor([1.0]), top_k=torch.tensor([0], dtype=torch.int32),
                        top_p=torch.tensor([0.9]), seed=torch.tensor([seed]), offset=torch.tensor([3]))
        args = (tokens, parents, logits, 1, *sampling.values())
        launch = triton_verify._launch(*args, triton_verify.INTERPRETER_CONFIG)
        assert int(launch.cand_count[0, 0]) == 2, launch.cand_count  # the two tokens at or above s = -3
        assert_same(launch.output, reference.verify(tokens, parents, logits, max_depth=1, **sampling), seed)
        assert int(launch.output.out_tokens[0, 0]) in (5, 40)


# Huge nuclei: (temperature, top_k, top_p) per request; "topkp-list": a top-k set no level list
# holds but a list of the entries at or above the searched kth does; the last request repeats
# top-p with a NaN in its root row (status 1).
HUGE_NUCLEUS_MODES = [("temp", 1.0, 0, 1.0), ("topk", 0.9, 400, 1.0), ("topp", 1.0, 0, 0.9),
                      ("topkp", 0.8, 500, 0.95), ("topkp-list", 1.0, 20, 0.9), ("topp-nan", 1.0, 0, 0.9)]


def huge_nucleus_batch(seed, V, dtype):
    """Flat rows (logits 0.3 * randn: top-k and top-p keep hundreds of tokens, beyond any
    interpreter list) with one planted child per node (p about 0.5, so the walk goes several rows
    deep); in bf16 the flat logits hold many ties."""
    gen = torch.Generator().manual_seed(seed)
    B, N = len(HUGE_NUCLEUS_MODES), 7
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3, 5]] * B, dtype=torch.int32)
    logits = torch.randn(B, N, V, generator=gen) * 0.3
    tokens = torch.randint(0, V, (B, N), generator=gen)
    for b in range(B):
        for c in (1, 3, 5, 6):  # the first child of each node: about half the mass
            logits[b, int(parents[b, c]), int(tokens[b, c])] = math.log(V)
    logits[-1, 0, 3] = float("nan")
    sampling = dict(temperature=torch.tensor([m[1] for m in HUGE_NUCLEUS_MODES]),
                    top_k=torch.tensor([m[2] for m in HUGE_NUCLEUS_MODES], dtype=torch.int32),
                    top_p=torch.tensor([m[3] for m in HUGE_NUCLEUS_MODES]), seed=torch.arange(B) + 10 * seed,
                    offset=torch.arange(B, dtype=torch.int64))
    return tokens, parents, logits.to(dtype), sampling


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_huge_nuclei_match_reference(dtype):
    """Every sampling mode on rows whose kept set spans most of the vocabulary (V 700, lists of
    32 under the interpreter: the threshold searches, seeded by the levels where a band is
    certain, with their normalisers, and the mass pass over several chunks), and top-k + top-p
    with a top-k set that only a list at the searched kth holds: the reference's tokens, and
    status 1 for the request with a NaN."""
    backend_impl("triton")
    from eagle_kernels.triton import verify as triton_verify

    for seed in (0, 2):  # seeds whose top-p masses keep clear of the targets (top_p_margin)
        tokens, parents, logits, sampling = huge_nucleus_batch(seed, 700, dtype)
        assert top_p_margin(logits[:-1], {k: v[:-1] for k, v in sampling.items()}) > 1e-6
        want = reference.verify(tokens, parents, logits, max_depth=4, **sampling)
        launch = triton_verify._launch(tokens, parents, logits, 4, *sampling.values(),
                                       triton_verify.INTERPRETER_CONFIG)
        assert_same(launch.output, want, seed)
        assert want.status.tolist() == [0, 0, 0, 0, 0, 1]
        visited = launch.cand_count > -2
        listed = launch.cand_count[4][visited[4]]
        assert (listed >= 20).all() and (listed <= 32).all(), launch.cand_count  # the top-k set, listed
        assert (launch.cand_count[:4][visited[:4]] == -1).all(), launch.cand_count  # no list holds them
        assert int(want.accept_len[:-1].sum()) >= 3, want.accept_len  # the walk goes past the root
        for b in range(4):  # the kept sets are huge
            t, k, p = (float(sampling[n][b]) for n in ("temperature", "top_k", "top_p"))
            kept = int((sampling_probs(logits[b, 0], t, int(k), p) > 0).sum())
            assert kept > 200, (b, kept)


def test_triton_verify_launches_no_fills_and_leaves_its_workspace_ready():
    """A call with filter tensors launches the all-rows kernel (for its greedy and unfiltered
    requests) and the walk (for the filtering ones), nothing else (no fills: the per-shape
    workspace is cached, its control words left zero by the kernel's last program of each
    request), and calls reusing the workspace give the reference's tokens."""
    backend_impl("triton")
    from eagle_kernels.launch_count import counting
    from eagle_kernels.triton import verify as triton_verify

    tokens, parents, logits, sampling = huge_nucleus_batch(3, 200, torch.bfloat16)
    want = reference.verify(tokens, parents, logits, max_depth=4, **sampling)
    for _ in range(2):
        assert_same(triton_verify.verify(tokens, parents, logits, max_depth=4, **sampling), want)
    with counting() as count:
        got = triton_verify.verify(tokens, parents, logits, max_depth=4, **sampling)
    assert count.total == 2 and count.by_kernel["_verify_kernel"] == 1, count.by_kernel
    assert count.by_kernel["_verify_temperature_kernel"] == 1, count.by_kernel
    assert_same(got, want)
    controls = [ws["control"] for key, ws in triton_verify._WORKSPACES.items() if key[1:4] == tuple(logits.shape)]
    assert controls and all(int(c.abs().sum()) == 0 for c in controls)
    triton_verify.verify(tokens, parents, logits, max_depth=4)  # greedy, sampling arguments left out
    with counting() as count:  # their defaults are kept too
        triton_verify.verify(tokens, parents, logits, max_depth=4)
    assert count.total == 1, count.by_kernel


# ------------------------------------------------------------ sampled drafts (draft-aware rule)
def sampled_draft_batch(seed, B, N, V, Vd=None, noise=1.0, dtype=torch.float32):
    """Trees whose children were drawn without replacement (Gumbel-top-k) from draft rows close to
    the target (so children are accepted, and rejected, at several depths); 15% of the children
    deterministic (``draft_sampled`` False, any token); requests greedy, temperature-only, top-k
    and top-p in turn. ``Vd < V``: a draft vocabulary of ``Vd`` target ids mapped by ``d2t``."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    for i in range(1, N):
        parents[:, i] = torch.randint(max(0, i - 3), i, (B,), generator=gen, dtype=torch.int32)
    logits = torch.randn(B, N, V, generator=gen, dtype=torch.float64) * 2
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.0])[torch.arange(B) % 4]
    Vd = Vd or V
    d2t = None
    draft_logits = logits
    if Vd != V:
        target = torch.sort(torch.randperm(V, generator=gen)[:Vd]).values
        d2t = target - torch.arange(Vd)
        draft_logits = logits[..., target]
    q = torch.softmax(draft_logits / temperature.clamp(min=0.5)[:, None, None]
                      + noise * torch.randn(B, N, Vd, generator=gen, dtype=torch.float64), -1).float()
    tokens = torch.zeros(B, N, dtype=torch.int64)
    sampled = torch.rand(B, N, generator=gen) < 0.85
    for b in range(B):
        for u in range(N):
            kids = [c for c in range(u + 1, N) if int(parents[b, c]) == u]
            u_draw = torch.rand(Vd, generator=gen, dtype=torch.float64)
            drawn = torch.sort(torch.log(q[b, u].double()) - torch.log(-torch.log(u_draw)), descending=True,
                               stable=True).indices[: len(kids)].tolist()
            for c, x in zip(kids, drawn):
                if not bool(sampled[b, c]):
                    x = int(torch.randint(0, Vd, (1,), generator=gen))
                tokens[b, c] = x if d2t is None else x + int(d2t[x])
    sampling = dict(temperature=temperature.float(), top_k=torch.tensor([0, 5, 0, 0])[torch.arange(B) % 4].int(),
                    top_p=torch.tensor([1.0, 1.0, 0.8, 1.0])[torch.arange(B) % 4].float(),
                    seed=torch.arange(B) * 7 + seed, offset=torch.arange(B) + 3 * seed)
    return tokens, parents, logits.to(dtype), sampling, dict(draft_probs=q, draft_sampled=sampled, d2t=d2t)


# (id, launch configuration, B, N, V, Vd): the interpreter's candidate lists and tiles, the GPU's
# configuration interpreted (one chunk, long lists), and the whole-row searches (no lists); a draft
# vocabulary mapped by d2t.
SAMPLED_DRAFT_CASES = [("interp-V50", "interpreter", 8, 12, 50, None), ("gpu-V80-d2t", "gpu", 8, 12, 80, 60),
                       ("search-V300-d2t", "search", 4, 10, 300, 250)]


@pytest.mark.parametrize("case", SAMPLED_DRAFT_CASES, ids=[c[0] for c in SAMPLED_DRAFT_CASES])
def test_triton_sampled_drafts_match_reference(case):
    """Triton's draft-aware rule gives the reference's outputs token for token (the same stream,
    the same float32 residuals and float64 masses), over several seeds' worth of accepted and
    rejected sampled children, deterministic children among them, and greedy rows in the batch."""
    backend_impl("triton")
    from eagle_kernels.triton import verify as triton_verify

    name, config, B, N, V, Vd = case
    config = {"interpreter": triton_verify.INTERPRETER_CONFIG, "gpu": triton_verify.GPU_CONFIG,
              "search": dataclasses.replace(triton_verify.INTERPRETER_CONFIG, candidates=0)}[config]
    tokens, parents, logits, sampling, drafts = sampled_draft_batch(V, B, N, V, Vd, noise=0.3)
    want = reference.verify(tokens, parents, logits, max_depth=6, **sampling, **drafts)
    got = triton_verify.verify(tokens, parents, logits, max_depth=6, **sampling, **drafts, _config=config)
    assert_same(got, want, name)
    sampling_rows = sampling["temperature"] > 0
    assert int(want.accept_len[sampling_rows].sum()) >= 1  # sampled children accepted ...
    assert int((want.accept_len[sampling_rows] < 6).sum()) >= 1  # ... and rejected


def test_triton_invalid_draft_rows():
    """Draft rows that are not a distribution the sampled children could come from: no child is
    tried, the bonus is drawn from p (a valid token), status 2, as the reference; the other
    requests of the batch are unaffected."""
    backend_impl("triton")
    from eagle_kernels.triton import verify as triton_verify

    B, N, V = 8, 4, 40
    tokens, parents, logits, sampling, drafts = sampled_draft_batch(3, B, N, V)
    parents[:] = torch.tensor([-1, 0, 0, 1], dtype=torch.int32)
    sampling["temperature"][:] = 1.0
    drafts["draft_sampled"][:] = True
    q = drafts["draft_probs"]
    q[0] = torch.softmax(logits[0].double(), -1).float()  # valid: the reference row
    tokens[0, 1:] = torch.tensor([3, 7, 9])
    q[1, 0, 5] = float("nan")
    q[2, 0, 6] = -0.01
    q[3, 0] *= 1.01  # |S - 1| > 1e-3
    q[4, 0, int(tokens[4, 2])] = 0.0  # a sampled child with r(x) = 0
    q[4, 0] /= q[4, 0].sum()
    tokens[5, 2] = tokens[5, 1]  # two sampled siblings with one token
    q[6, 0] = 0.0
    q[6, 0, int(tokens[6, 1])] = 1.0  # removed reaches 1 before the second sampled child
    q[6, 0, int(tokens[6, 2])] = 1e-30  # S rounds to 1: r(x) of the first child is 1
    logits[7, 0, 0] = float("nan")  # a bad target row: status 1
    want = reference.verify(tokens, parents, logits, max_depth=3, **sampling, **drafts)
    assert want.status.tolist() == [0, 2, 2, 2, 2, 2, 2, 1]
    assert_same(triton_verify.verify(tokens, parents, logits, max_depth=3, **sampling, **drafts), want)
    # d2t mapping a draft id outside [0, V): every sampled node's row is invalid.
    Vd = 30
    d2t = torch.arange(Vd) * 0 + 5
    d2t[-1] = V  # Vd - 1 + V is out of range
    probs = torch.softmax(torch.randn(2, N, Vd, generator=torch.Generator().manual_seed(1)), -1)
    child_tokens = torch.tensor([[0, 5, 6, 7]] * 2)
    kwargs = dict(draft_probs=probs, d2t=d2t)
    sampling = {k: v[-2:] for k, v in sampling.items()}
    want = reference.verify(child_tokens, parents[-2:], logits[-2:], max_depth=3, **sampling, **kwargs)
    assert want.status.tolist() == [2, 1]
    assert_same(triton_verify.verify(child_tokens, parents[-2:], logits[-2:], max_depth=3, **sampling, **kwargs),
                want)


def test_draft_arguments_are_checked():
    """Shape and dtype mismatches of the draft arguments are ValueErrors naming the tensor."""
    verify = backend_impl("triton")
    B, N, V = 2, 3, 10
    tokens, parents = torch.zeros(B, N, dtype=torch.int64), torch.tensor([[-1, 0, 1]] * B, dtype=torch.int32)
    logits = torch.zeros(B, N, V)
    sampling = dict(temperature=torch.ones(B))
    cases = [("draft_probs", dict(draft_probs=torch.zeros(B, N, V + 1))),
             ("draft_probs", dict(draft_probs=torch.zeros(B, N, V, dtype=torch.float64))),
             ("draft_probs", dict(draft_probs=torch.zeros(B, N + 1, V))),
             ("draft_sampled", dict(draft_sampled=torch.ones(B, N, dtype=torch.bool))),
             ("draft_sampled", dict(draft_probs=torch.zeros(B, N, V), draft_sampled=torch.ones(B, N))),
             ("d2t", dict(draft_probs=torch.zeros(B, N, 4), d2t=torch.zeros(5, dtype=torch.int64))),
             ("d2t", dict(d2t=torch.zeros(V, dtype=torch.int64)))]
    for name, kwargs in cases:
        with pytest.raises(ValueError, match=name):
            verify(tokens, parents, logits, max_depth=2, **sampling, **kwargs)
