"""draft_expand (contract §2): every backend against an independent float64 computation and
against ``eagle_kernels.reference.draft_expand``.

Ranking ties are only compared exactly where they are exact by construction (equal logits, or
identical rows with equal frontier scores); elsewhere the top ``top_k`` logits of every row are
planted with wide gaps so that float32 rounding cannot reorder them.
"""

import numpy as np
import pytest
import torch

import eagle_kernels
from eagle_kernels import _dispatch, reference
from helpers import (
    SCORE_TOL,
    assert_matches,
    check_frontier,
    check_invariants,
    naive_draft_expand,
    planted_logits,
    random_frontier_scores,
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
SMALL_V = (50, 1000, 1031)
LARGE_V = (49152, 128256)  # only the C++ backend runs these


# ------------------------------------------------------------------------------------ helpers


# ---------------------------------------------------------------------------------- tier 1
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("top_k", [1, 4, 10], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("M", [1, 4, 10], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("V", SMALL_V + LARGE_V, ids=lambda v: f"V{v}")
def test_matches_naive_and_reference(backend, op_impl, V, M, top_k, dtype):
    if V in LARGE_V and (backend != "cpp" or dtype in (torch.float16, torch.float64) or 4 in (M, top_k)):
        pytest.skip("large vocabularies: C++ backend, fp32/bf16, M and top_k in {1, 10} only")
    if backend == "triton":
        # The interpreter takes ~1 s per case: every (V, M, top_k) runs in one dtype, cycling
        # through the four (7, 6, 7 and 7 cases each); the C++ kernel runs the whole grid.
        diagonal = (SMALL_V.index(V) + [1, 4, 10].index(M) + [1, 4, 10].index(top_k)) % 4
        if list(DTYPES.values()).index(dtype) != diagonal:
            pytest.skip("Triton interpreter: one dtype per shape")
    fn = op_impl("draft_expand")
    B = 2
    seed = V * 100 + M * 10 + top_k
    logits = planted_logits(B, M, V, top_k, dtype, seed)
    frontier_scores = random_frontier_scores(B, M, seed)
    out = fn(logits, frontier_scores, top_k)
    check_invariants(out, frontier_scores, top_k, V)
    assert_matches(out, naive_draft_expand(logits, frontier_scores, top_k),
                   reference.draft_expand(logits, frontier_scores, top_k), dtype, top_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_root_expansion(backend, op_impl, dtype):
    """M = 1 with frontier score 0: scores are the log-probs themselves."""
    fn = op_impl("draft_expand")
    logits = planted_logits(3, 1, 1031, 8, dtype, 7)
    zeros = torch.zeros(3, 1)
    out = fn(logits, zeros, 8)
    check_invariants(out, zeros, 8, 1031)
    naive = naive_draft_expand(logits, zeros, 8)
    assert_matches(out, naive, reference.draft_expand(logits, zeros, 8), dtype, 8)
    # The root's candidates are ranks 0..k-1 of a single node: the frontier is all of them.
    np.testing.assert_array_equal(out.frontier.numpy(), np.tile(np.arange(8), (3, 1)))


# ------------------------------------------------------------------ tier 2: ties and masks
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("V", [50, 1031], ids=lambda v: f"V{v}")
def test_exact_logit_ties_rank_by_id(backend, op_impl, V, dtype):
    """Logits drawn from {0, 1, 2}: most ranks are ties, broken by smaller id."""
    fn = op_impl("draft_expand")
    gen = torch.Generator().manual_seed(V)
    B, M, top_k = 2, 4, 10
    logits = torch.randint(0, 3, (B, M, V), generator=gen).to(dtype)
    frontier_scores = random_frontier_scores(B, M, V)
    out = fn(logits, frontier_scores, top_k)
    check_invariants(out, frontier_scores, top_k, V)
    assert_matches(out, naive_draft_expand(logits, frontier_scores, top_k),
                   reference.draft_expand(logits, frontier_scores, top_k), dtype, top_k)
    # Within a node every candidate ties at the maximum: the ids come out ascending.
    for b in range(B):
        for m in range(M):
            row = logits[b, m]
            top_ids = torch.nonzero(row == row.max()).flatten()[:top_k]
            assert out.tokens[b, m * top_k:m * top_k + len(top_ids)].tolist() == top_ids.tolist()


def test_golden_ties(backend, op_impl):
    """Hand-checked: ties inside a row by id, equal scores across rows by candidate index."""
    fn = op_impl("draft_expand")
    row = torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0, 2.0])
    logits = row.expand(1, 3, 6).contiguous()
    out = fn(logits, torch.zeros(1, 3), 2)
    assert out.tokens.tolist() == [[1, 2, 1, 2, 1, 2]]
    # All six candidates score log(1/3 * e^3 / sum) alike: the first two indices win.
    assert out.frontier.tolist() == [[0, 1]]
    logp = torch.log_softmax(row.double(), 0)[1]
    torch.testing.assert_close(out.scores, torch.full((1, 6), float(logp), dtype=torch.float32))


@pytest.mark.parametrize("M,top_k,expected", [
    (4, 4, [0, 4, 8, 12]),
    (3, 2, [0, 2]),
    (2, 3, [0, 3, 1]),
], ids=["M4k4", "M3k2", "M2k3"])
def test_frontier_ties_by_candidate_index(backend, op_impl, M, top_k, expected):
    """Identical rows and equal frontier scores: rank r of every node ties, smaller c first."""
    fn = op_impl("draft_expand")
    row = planted_logits(1, 1, 50, top_k, torch.float32, 3)[0, 0]
    logits = row.expand(2, M, 50).contiguous()
    frontier_scores = torch.full((2, M), -0.5)
    out = fn(logits, frontier_scores, top_k)
    check_invariants(out, frontier_scores, top_k, 50)
    assert out.frontier.tolist() == [expected, expected]
    assert out.frontier.tolist() == reference.draft_expand(logits, frontier_scores, top_k).frontier.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=["fp32", "fp16", "bf16", "fp64"])
def test_neg_inf_logits(backend, op_impl, dtype):
    """-inf entries never outrank finite ones; past the finite ones, ranks are -inf in id order."""
    fn = op_impl("draft_expand")
    B, M, V, top_k = 2, 3, 1000, 4
    logits = planted_logits(B, M, V, top_k, dtype, 11)
    gen = torch.Generator().manual_seed(5)
    # Sparse masking of the unplanted entries keeps the top_k ranks unambiguous.
    logits[(torch.rand(B, M, V, generator=gen) < 0.3) & (logits < 4.5)] = float("-inf")
    logits[0, 1] = float("-inf")
    logits[0, 1, 7] = 2.0
    logits[0, 1, 3] = 1.0  # only two finite entries in this row
    logits[1, 2] = float("-inf")
    logits[1, 2, 999] = 0.0  # a single finite entry, at the end
    frontier_scores = random_frontier_scores(B, M, 11)
    out = fn(logits, frontier_scores, top_k)
    naive = naive_draft_expand(logits, frontier_scores, top_k)
    np.testing.assert_array_equal(out.tokens.numpy(), naive[0])
    assert out.tokens[0, 4:8].tolist() == [7, 3, 0, 1]
    assert out.tokens[1, 8:12].tolist() == [999, 0, 1, 2]
    torch.testing.assert_close(out.scores.double(), torch.from_numpy(naive[1]), **SCORE_TOL[dtype])
    assert bool(torch.isneginf(out.scores[0, 6:8]).all()) and bool(torch.isneginf(out.scores[1, 9:12]).all())
    check_frontier(out.frontier, out.scores, naive[1], top_k, SCORE_TOL[dtype]["atol"])
    ref = reference.draft_expand(logits, frontier_scores, top_k)
    assert out.tokens.tolist() == ref.tokens.tolist()
    torch.testing.assert_close(out.scores, ref.scores, **SCORE_TOL[dtype])


def test_neg_inf_frontier_ties(backend, op_impl):
    """When fewer than top_k candidates are finite, -inf candidates fill the frontier by index."""
    fn = op_impl("draft_expand")
    logits = torch.full((1, 2, 50), float("-inf"))
    logits[0, 0, 10] = 0.0
    logits[0, 1, 20] = 0.0
    frontier_scores = torch.tensor([[-1.0, -0.5]])
    out = fn(logits, frontier_scores, 3)
    assert out.tokens.tolist() == [[10, 0, 1, 20, 0, 1]]
    assert out.scores[0, [0, 3]].tolist() == [-1.0, -0.5]
    assert out.frontier.tolist() == [[3, 0, 1]]


@pytest.mark.parametrize("V", [50, 1031], ids=lambda v: f"V{v}")
def test_d2t_mapping(backend, op_impl, V):
    fn = op_impl("draft_expand")
    B, M, top_k = 2, 4, 4
    logits = planted_logits(B, M, V, top_k, torch.float32, 21)
    gen = torch.Generator().manual_seed(21)
    d2t = torch.randint(0, 120_000, (V,), generator=gen, dtype=torch.int64)
    frontier_scores = random_frontier_scores(B, M, 21)
    out = fn(logits, frontier_scores, top_k, d2t=d2t)
    plain = fn(logits, frontier_scores, top_k)
    torch.testing.assert_close(out.tokens, plain.tokens + d2t[plain.tokens], rtol=0, atol=0)
    torch.testing.assert_close(out.scores, plain.scores, rtol=0, atol=0)
    torch.testing.assert_close(out.frontier, plain.frontier, rtol=0, atol=0)
    check_invariants(out, frontier_scores, top_k, V, d2t=d2t)
    assert_matches(out, naive_draft_expand(logits, frontier_scores, top_k, d2t=d2t),
                   reference.draft_expand(logits, frontier_scores, top_k, d2t=d2t), torch.float32, top_k)


# ------------------------------------------------------------- tier 2: multi-depth golden
def expand_history(expand, build, root_tokens, logits_per_depth, top_k, num_nodes):
    """Root expansion followed by one expansion per entry of ``logits_per_depth[1:]``, then
    build_tree over the whole candidate history."""
    B = root_tokens.shape[0]
    tokens, scores, parents = [], [], []
    frontier_scores = torch.zeros(B, 1)
    frontier_global = None  # [B, top_k]: history index of each frontier node
    offset = 0
    for logits in logits_per_depth:
        out = expand(logits, frontier_scores, top_k)
        M = logits.shape[1]
        if frontier_global is None:
            parent = torch.full((B, M * top_k), -1, dtype=torch.int32)
        else:
            parent = frontier_global.repeat_interleave(top_k, dim=1).to(torch.int32)
        tokens.append(out.tokens)
        scores.append(out.scores)
        parents.append(parent)
        frontier_global = out.frontier.long() + offset
        frontier_scores = torch.gather(out.scores, 1, out.frontier.long())
        offset += M * top_k
    history = (torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1))
    return history, build(root_tokens, *history, num_nodes)


@pytest.mark.parametrize("num_nodes", [1, 20, 53], ids=lambda n: f"N{n}")
def test_multi_depth_expansion_then_build_tree(backend, op_impl, num_nodes):
    """root -> depth 3 with top_k 4 (C = 4 + 3 * 16 = 52), then build_tree, node for node."""
    fn = op_impl("draft_expand")
    B, V, top_k = 2, 1000, 4
    depths = [planted_logits(B, 1, V, top_k, torch.float32, 100)]
    depths += [planted_logits(B, top_k, V, top_k, torch.float32, 101 + d) for d in range(3)]
    roots = torch.tensor([11, 22])
    (r_tok, r_sc, r_par), ref_tree = expand_history(reference.draft_expand, reference.build_tree,
                                                     roots, depths, top_k, num_nodes)
    # Precondition on the data: no two candidate scores of a request within 1e-4, so float32
    # rounding differences between paths cannot reorder the selection.
    for row in r_sc:
        gaps = torch.diff(torch.sort(row.double()).values)
        assert float(gaps.min()) > 1e-4
    (tok, sc, par), tree = expand_history(fn, eagle_kernels.build_tree, roots, depths, top_k, num_nodes)
    torch.testing.assert_close(tok, r_tok, rtol=0, atol=0)
    torch.testing.assert_close(par, r_par, rtol=0, atol=0)
    torch.testing.assert_close(sc, r_sc, **SCORE_TOL[torch.float32])
    for name, got, want in zip(tree._fields, tree, ref_tree):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    # The tree really spans several depths.
    if num_nodes > 20:
        assert int(tree.depths.max()) >= 3


# ------------------------------------------------------------------------ tier 5: bad input
def _good():
    return torch.randn(2, 3, 50), torch.zeros(2, 3)


@pytest.mark.parametrize("case,name", [
    ("frontier_float64", "frontier_scores"),
    ("frontier_shape", "frontier_scores"),
    ("frontier_rank", "frontier_scores"),
    ("logits_rank", "logits"),
    ("logits_int", "logits"),
    ("d2t_int32", "d2t"),
    ("d2t_shape", "d2t"),
    ("top_k_zero", "top_k"),
    ("top_k_above_V", "top_k"),
    ("top_k_float", "top_k"),
    ("top_k_numpy", "top_k"),
    ("top_k_tensor", "top_k"),
    ("top_k_bool", "top_k"),
    ("depth_float", "depth"),
    ("depth_bool", "depth"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_input(backend, op_impl, case, name):
    fn = op_impl("draft_expand")
    logits, fs = _good()
    top_k, d2t, sampling = 4, None, {}
    if case == "frontier_float64":
        fs = fs.double()
    elif case == "frontier_shape":
        fs = torch.zeros(2, 4)
    elif case == "frontier_rank":
        fs = torch.zeros(2, 3, 1)
    elif case == "logits_rank":
        logits = logits[0]
    elif case == "logits_int":
        logits = logits.to(torch.int32)
    elif case == "d2t_int32":
        d2t = torch.zeros(50, dtype=torch.int32)
    elif case == "d2t_shape":
        d2t = torch.zeros(49, dtype=torch.int64)
    elif case == "top_k_zero":
        top_k = 0
    elif case == "top_k_above_V":
        top_k = 51
    elif case == "top_k_float":  # the C++ op's schema used to raise a RuntimeError for these three
        top_k = 4.0
    elif case == "top_k_numpy":  # ... and to convert these two
        top_k = np.int64(4)
    elif case == "top_k_tensor":
        top_k = torch.tensor(4)
    elif case == "top_k_bool":  # a bool is an int to Python and to the op's schema: True was top-1
        top_k = True
    elif case == "depth_float":
        sampling = dict(temperature=torch.ones(2), depth=1.5)
    elif case == "depth_bool":
        sampling = dict(temperature=torch.ones(2), depth=True)
    with pytest.raises(ValueError, match=name):
        fn(logits, fs, top_k, d2t=d2t, **sampling)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_empty_batch(backend, op_impl, sampled):
    """B = 0: empty outputs of the C++ op's shapes and dtypes, on every backend (the reference used to fail
    stacking no frontier rows)."""
    fn = op_impl("draft_expand")
    cpp, reason = _dispatch.implementation("draft_expand", "cpp", "cpu")
    if cpp is None:
        pytest.skip(reason)
    logits, fs = torch.randn(0, 2, 5), torch.zeros(0, 2)
    kwargs = dict(d2t=torch.arange(5) * 3)
    if sampled:
        kwargs.update(temperature=torch.ones(0), seed=torch.zeros(0, dtype=torch.int64),
                      offset=torch.zeros(0, dtype=torch.int64), depth=1)
    got, want = fn(logits, fs, 2, **kwargs), cpp(logits, fs, 2, **kwargs)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
    assert [t.shape for t in want] == [(0, 4), (0, 4), (0, 2), (0, 4)]


def test_top_k_equal_V(backend, op_impl):
    """top_k == V is allowed: every id ranked, a full permutation per node."""
    fn = op_impl("draft_expand")
    logits = planted_logits(1, 2, 50, 50, torch.float32, 4)
    fs = torch.tensor([[0.0, -1.0]])
    out = fn(logits, fs, 50)
    for m in range(2):
        assert sorted(out.tokens[0, m * 50:(m + 1) * 50].tolist()) == list(range(50))
    assert_matches(out, naive_draft_expand(logits, fs, 50), reference.draft_expand(logits, fs, 50),
                   torch.float32, 50)
