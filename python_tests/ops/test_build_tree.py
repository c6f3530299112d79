"""build_tree (contract §3): golden hand-built trees, invariants on simulated EAGLE-2
histories, backend == reference (hypothesis), and bad input.

Expected trees are written out by hand (or from hand-written parent lists through
``mask_of``); only the property test compares against ``eagle_kernels.reference``.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_kernels import reference
from helpers import NAN, NINF, mask_of, simulate_history


# ------------------------------------------------------------------------------------ helpers
def as_inputs(root, tokens, scores, parents):
    """Build the four input tensors, batch-first, from nested lists."""
    return (torch.tensor(root, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(scores, dtype=torch.float32), torch.tensor(parents, dtype=torch.int32))


def assert_tree(out, tokens, parents, depths, mask=None):
    """Compare one request (B = 1) or a batch with expected nested lists."""
    t = torch.tensor(tokens, dtype=torch.int64)
    batched = t.dim() == 2
    if mask is None:
        mask = [mask_of(p) for p in parents] if batched else mask_of(parents)
    m = torch.tensor(mask, dtype=torch.int64)
    if not batched:
        t = t[None]
        m = m[None] if m.dim() == 3 else m[None, :, None]
        parents, depths = [parents], [depths]
    elif m.dim() == 2:
        m = m[..., None]
    assert out.tokens.dtype == torch.int64 and out.mask.dtype == torch.int64
    assert out.parents.dtype == torch.int32 and out.depths.dtype == torch.int32
    assert out.tokens.tolist() == t.tolist()
    assert out.parents.tolist() == parents
    assert out.depths.tolist() == depths
    assert out.mask.tolist() == m.tolist()


def naive_selection(scores_row, n_select):
    """Selected candidate indices (sorted) via numpy lexsort: score desc (NaN = -inf), index asc."""
    s = scores_row.numpy().astype(np.float64)
    s = np.where(np.isnan(s), -np.inf, s)  # not nan_to_num: it maps -inf to a finite value
    order = np.lexsort((np.arange(s.shape[0]), -s))
    return sorted(order[:n_select].tolist())


def check_invariants(out, inputs, num_nodes):
    root, ctok, cscore, cpar = inputs
    B, N, W = root.shape[0], num_nodes, math.ceil(num_nodes / 64)
    assert out.tokens.shape == (B, N) and out.parents.shape == (B, N)
    assert out.depths.shape == (B, N) and out.mask.shape == (B, N, W)
    assert out.tokens[:, 0].tolist() == root.tolist()
    for b in range(B):
        parents = out.parents[b].tolist()
        depths = out.depths[b].tolist()
        assert parents[0] == -1 and depths[0] == 0
        chosen = naive_selection(cscore[b], N - 1)
        node_of = {c: i + 1 for i, c in enumerate(chosen)}
        for i in range(1, N):
            assert 0 <= parents[i] < i, "topological order"
            assert depths[i] == depths[parents[i]] + 1
            c = chosen[i - 1]
            assert int(out.tokens[b, i]) == int(ctok[b, c])
            p = int(cpar[b, c])
            assert p == -1 or p in node_of, "ancestor closure: a selected node's parent is selected"
            assert parents[i] == (0 if p == -1 else node_of[p])
        assert out.mask[b].tolist() == mask_of(parents)


# ------------------------------------------------------------------------------- golden trees
R = 7  # root token in the golden cases

GOLDEN = [
    pytest.param(  # chain: every candidate is the child of the previous one
        ([R], [[5, 6, 7, 8]], [[-0.1, -0.2, -0.3, -0.4]], [[-1, 0, 1, 2]]), 4,
        ([[R, 5, 6, 7]], [[-1, 0, 1, 2]], [[0, 1, 2, 3]], [[[1], [3], [7], [15]]]),
        id="chain"),
    pytest.param(  # star: all children of the root, top 3 of 5, laid out by candidate index
        ([R], [[20, 21, 22, 23, 24]], [[-1.0, -0.5, -2.0, -0.7, -0.6]], [[-1] * 5]), 4,
        ([[R, 21, 23, 24]], [[-1, 0, 0, 0]], [[0, 1, 1, 1]], [[[1], [3], [5], [9]]]),
        id="star"),
    pytest.param(  # depth 1: only the root
        ([R], [[5, 6]], [[-0.1, -0.2]], [[-1, 0]]), 1,
        ([[R]], [[-1]], [[0]], [[[1]]]),
        id="root_only"),
    pytest.param(  # no candidates at all
        ([R, 9], [[], []], [[], []], [[], []]), 1,
        ([[R], [9]], [[-1], [-1]], [[0], [0]], [[[1]], [[1]]]),
        id="no_candidates"),
    pytest.param(  # duplicate sibling tokens are kept as separate nodes
        ([R], [[42, 42, 7]], [[-0.1, -0.2, -0.3]], [[-1, -1, 0]]), 4,
        ([[R, 42, 42, 7]], [[-1, 0, 0, 1]], [[0, 1, 1, 2]], [[[1], [3], [5], [11]]]),
        id="duplicate_siblings"),
    pytest.param(  # ties across depths: equal scores go by smaller candidate index
        ([R], [[1, 2, 3, 4, 5]], [[-0.5, -0.5, -0.5, -0.5, -0.9]], [[-1, -1, 0, 1, -1]]), 4,
        ([[R, 1, 2, 3]], [[-1, 0, 0, 1]], [[0, 1, 1, 2]], [[[1], [3], [5], [11]]]),
        id="ties"),
    pytest.param(
        ([R], [[1, 2, 3, 4, 5]], [[-0.5, -0.5, -0.5, -0.5, -0.9]], [[-1, -1, 0, 1, -1]]), 5,
        ([[R, 1, 2, 3, 4]], [[-1, 0, 0, 1, 2]], [[0, 1, 1, 2, 2]],
         [[[1], [3], [5], [11], [21]]]),
        id="ties_n5"),
    pytest.param(  # NaN ranks as -inf: both NaN candidates lose to every finite one
        ([R], [[1, 2, 3, 4]], [[NAN, -1.0, NAN, -2.0]], [[-1, -1, 0, 1]]), 3,
        ([[R, 2, 4]], [[-1, 0, 1]], [[0, 1, 2]], [[[1], [3], [7]]]),
        id="nan"),
    pytest.param(  # NaN vs -inf tie: by index (candidate 0 is NaN, 2 is -inf)
        ([R], [[1, 2, 3, 4]], [[NAN, -1.0, NINF, -2.0]], [[-1, -1, -1, 1]]), 4,
        ([[R, 1, 2, 4]], [[-1, 0, 0, 2]], [[0, 1, 1, 2]], [[[1], [3], [5], [13]]]),
        id="nan_vs_ninf"),
    pytest.param(  # batch of two different trees in one call
        ([R, 8], [[5, 6, 7], [15, 16, 17]], [[-0.1, -0.2, -0.3], [-0.3, -0.1, -0.2]],
         [[-1, 0, 1], [-1, -1, 1]]), 3,
        ([[R, 5, 6], [8, 16, 17]], [[-1, 0, 1], [-1, 0, 1]], [[0, 1, 2], [0, 1, 2]],
         [[[1], [3], [7]], [[1], [3], [7]]]),
        id="batch2"),
]


@pytest.mark.parametrize("inputs,num_nodes,expected", GOLDEN)
def test_golden(op_impl, inputs, num_nodes, expected):
    out = op_impl("build_tree")(*as_inputs(*inputs), num_nodes)
    assert_tree(out, *expected)


# A full EAGLE-2 history, depth 3 x top-k 3, expanded by hand:
#   depth 1 (root, score 0): c0..c2 tokens 10 11 12, logp -0.2 -1.0 -2.5
#   frontier = c0, c1, c2
#   depth 2: c0 -> c3..c5 tokens 20 21 22, scores -0.3 -1.1 -3.2
#            c1 -> c6..c8 tokens 23 24 25, scores -1.3 -1.6 -3.0
#            c2 -> c9..c11 tokens 26 27 28, scores -2.55 -3.5 -4.0
#   frontier = c3 (-0.3), c4 (-1.1), c6 (-1.3)
#   depth 3: c3 -> c12..c14 tokens 30 31 32, scores -0.45 -0.8 -2.5
#            c4 -> c15..c17 tokens 33 34 35, scores -1.35 -2.5 -3.0
#            c6 -> c18..c20 tokens 36 37 38, scores -1.4 -2.0 -2.5
EAGLE2_TOKENS = [10, 11, 12, 20, 21, 22, 23, 24, 25, 26, 27, 28, 30, 31, 32, 33, 34, 35, 36, 37, 38]
EAGLE2_SCORES = [-0.2, -1.0, -2.5, -0.3, -1.1, -3.2, -1.3, -1.6, -3.0, -2.55, -3.5, -4.0,
                 -0.45, -0.8, -2.5, -1.35, -2.5, -3.0, -1.4, -2.0, -2.5]
EAGLE2_PARENTS = [-1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 6, 6, 6]


@pytest.mark.parametrize("num_nodes,tokens,parents,depths", [
    # Best 9 by score: c0 c3 c12 c13 c1 c4 c6 c15 c18; node order by candidate index:
    # c0 c1 c3 c4 c6 c12 c13 c15 c18.
    pytest.param(10, [R, 10, 11, 20, 21, 23, 30, 31, 33, 36],
                 [-1, 0, 0, 1, 1, 2, 3, 3, 4, 5], [0, 1, 1, 2, 2, 2, 3, 3, 3, 3], id="N10"),
    # Next: c7 (-1.6), c19 (-2.0), then a four-way tie at -2.5 (c2 c14 c16 c20) won by c2.
    pytest.param(13, [R, 10, 11, 12, 20, 21, 23, 24, 30, 31, 33, 36, 37],
                 [-1, 0, 0, 0, 1, 1, 2, 2, 4, 4, 5, 6, 6],
                 [0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3], id="N13_tie_at_cut"),
])
def test_golden_eagle2_depth3_topk3(op_impl, num_nodes, tokens, parents, depths):
    inputs = as_inputs([R], [EAGLE2_TOKENS], [EAGLE2_SCORES], [EAGLE2_PARENTS])
    out = op_impl("build_tree")(*inputs, num_nodes)
    assert_tree(out, [tokens], [parents], [depths])
    if num_nodes == 10:  # spelled out once: node 9 = c18 -> c6 (node 5) -> c1 (node 2) -> root
        assert out.mask[0, :, 0].tolist() == [1, 3, 5, 11, 19, 37, 75, 139, 275, 549]


def test_chain_256_mask_words(op_impl):
    """N = 256: four mask words per row, bit 63 (the int64 sign bit) set along a chain."""
    C = 300
    inputs = as_inputs([3], [list(range(100, 100 + C))], [[-0.01 * c for c in range(C)]],
                       [list(range(-1, C - 1))])
    out = op_impl("build_tree")(*inputs, 256)
    assert out.mask.shape == (1, 256, 4)
    assert out.parents[0].tolist() == list(range(-1, 255))
    assert out.depths[0].tolist() == list(range(256))
    assert out.mask[0, 255].tolist() == [-1, -1, -1, -1]
    assert out.mask[0, 64].tolist() == [-1, 1, 0, 0]
    assert out.mask[0, 63].tolist() == [-1, 0, 0, 0]


# --------------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("B,depth,top_k,num_nodes,extra", [
    pytest.param(2, 3, 3, 10, {}, id="d3k3N10"),
    pytest.param(3, 5, 4, 60, {"quantum": 0.25}, id="d5k4N60_ties"),
    pytest.param(2, 6, 8, 256, {"nan_prob": 0.05, "ninf_prob": 0.05}, id="d6k8N256_nan"),
    pytest.param(1, 10, 10, 256, {"quantum": 0.5, "nan_prob": 0.02}, id="d10k10N256_ties_nan"),
    pytest.param(4, 1, 6, 7, {}, id="d1k6_all"),
])
def test_invariants_random(op_impl, B, depth, top_k, num_nodes, extra):
    inputs = simulate_history(B, depth, top_k, seed=B * 1000 + depth * 10 + top_k, **extra)
    out = op_impl("build_tree")(*inputs, num_nodes)
    check_invariants(out, inputs, num_nodes)


# ------------------------------------------------------------------------ property vs reference
@st.composite
def histories(draw):
    top_k = draw(st.integers(1, 8))
    depth = draw(st.integers(1, 6))
    B = draw(st.integers(1, 3))
    C = top_k + (depth - 1) * top_k * top_k
    num_nodes = draw(st.integers(1, min(C + 1, 256)))
    nan_prob = draw(st.sampled_from([0.0, 0.0, 0.1]))
    ninf_prob = draw(st.sampled_from([0.0, 0.05]))
    quantum = draw(st.sampled_from([None, 0.25, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    inputs = simulate_history(B, depth, top_k, seed, nan_prob=nan_prob, ninf_prob=ninf_prob,
                              quantum=quantum)
    return inputs, num_nodes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(case=histories())
def test_matches_reference(op_impl, backend, case):
    inputs, num_nodes = case
    fn = op_impl("build_tree")
    if backend == "reference":
        check_invariants(fn(*inputs, num_nodes), inputs, num_nodes)
        return
    got = fn(*inputs, num_nodes)
    want = reference.build_tree(*inputs, num_nodes)
    for name in ("tokens", "parents", "depths", "mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


# ---------------------------------------------------------------------------------- bad input
def good_inputs():
    return list(as_inputs([R], [EAGLE2_TOKENS], [EAGLE2_SCORES], [EAGLE2_PARENTS]))


def _bad(index, value):
    def make():
        args = good_inputs()
        args[index] = value(args[index])
        return args
    return make


def _bad_parent():
    args = good_inputs()
    args[3][0, 5] = 5  # its own index
    return args


def _bad_parent_ahead():
    args = good_inputs()
    args[3][0, 4] = 9
    return args


def _bad_parent_below():
    args = good_inputs()
    args[3][0, 4] = -2
    return args


def _child_outscores_parent():
    args = good_inputs()
    args[2][0, 12] = -0.1  # c12's parent c3 scores -0.3
    return args


def _finite_child_of_nan():
    args = good_inputs()
    args[2][0, 3] = NAN  # c3 becomes NaN (-inf) but its children stay finite
    return args


BAD = [
    pytest.param(_bad(2, lambda t: t.double()), 10, "cand_scores", id="scores_fp64"),
    pytest.param(_bad(1, lambda t: t.int()), 10, "cand_tokens", id="tokens_int32"),
    pytest.param(_bad(3, lambda t: t.long()), 10, "cand_parents", id="parents_int64"),
    pytest.param(_bad(0, lambda t: t.int()), 10, "root_tokens", id="root_int32"),
    pytest.param(_bad(1, lambda t: t[0]), 10, "cand_tokens", id="tokens_rank1"),
    pytest.param(_bad(2, lambda t: t[None]), 10, "cand_scores", id="scores_rank3"),
    pytest.param(_bad(0, lambda t: t.repeat(2)), 10, "root_tokens", id="root_batch"),
    pytest.param(_bad(3, lambda t: t[:, :-1]), 10, "cand_parents", id="parents_short"),
    pytest.param(_bad_parent, 10, "cand_parents", id="parent_is_self"),
    pytest.param(_bad_parent_ahead, 10, "cand_parents", id="parent_after_child"),
    pytest.param(_bad_parent_below, 10, "cand_parents", id="parent_below_minus1"),
    pytest.param(_child_outscores_parent, 10, "cand_scores", id="child_outscores_parent"),
    pytest.param(_finite_child_of_nan, 10, "cand_scores", id="finite_child_of_nan"),
    pytest.param(good_inputs, 23, "num_nodes", id="too_many_nodes"),
    pytest.param(good_inputs, 0, "num_nodes", id="zero_nodes"),
]
# The op schema's int takes a bool as 0 / 1 before the C++ kernel sees it, so this one is the
# public entry point's (and the other backends') alone.
BOOL_NODES = pytest.param(good_inputs, True, "num_nodes", id="bool_nodes")  # was a tree of one node


@pytest.mark.parametrize("make,num_nodes,name", BAD + [BOOL_NODES])
def test_bad_input(op_impl, make, num_nodes, name):
    fn = op_impl("build_tree")
    with pytest.raises(ValueError, match=name):
        fn(*make(), num_nodes)


@pytest.mark.parametrize("make,num_nodes,name", BAD)
def test_bad_input_registered_op(make, num_nodes, name):
    """``torch.ops.eagle_kernels.build_tree`` on CPU tensors (the C++ kernel when built, which
    validates on its own, without the Python checks in front)."""
    with pytest.raises(ValueError, match=name):
        torch.ops.eagle_kernels.build_tree(*make(), num_nodes)


def test_num_nodes_max_is_fine(op_impl):
    out = op_impl("build_tree")(*good_inputs(), 22)  # N - 1 == C: everything selected
    assert out.tokens[0, 1:].tolist() == EAGLE2_TOKENS


@pytest.mark.gpu
def test_device_mismatch(op_impl):
    args = good_inputs()
    args[2] = args[2].cuda()
    with pytest.raises(ValueError, match="cand_scores"):
        op_impl("build_tree")(*args, 10)
