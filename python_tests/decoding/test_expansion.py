"""eagle_kernels.expansion.expand_tree: a whole EAGLE-2 expansion (root -> depth -> build_tree)
against a straightforward loop written here, node for node, and free of host syncs."""

import contextlib

import pytest
import torch

import eagle_kernels
from eagle_kernels import reference
from eagle_kernels.expansion import expand_tree, num_candidates

V, H = 300, 16


class ToyHead:
    """Deterministic stand-in for an EAGLE head: a hidden state per frontier node that mixes
    the parent's hidden state with the node's token embedding; logits = hidden @ W. Records
    every call so the test can check what the helper passed."""

    def __init__(self, B, seed=0, dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(V, H, generator=gen, dtype=torch.float64)
        self.w = torch.randn(H, V, generator=gen, dtype=torch.float64) * 2.0
        self.start = torch.randn(B, 1, H, generator=gen, dtype=torch.float64)
        self.dtype = dtype
        self.hidden = None
        self.calls = []

    def __call__(self, step, tokens, parent_row, cand_index):
        self.calls.append((step, tokens.clone(), parent_row.clone(), cand_index.clone()))
        if step == 0:
            prev = self.start
        else:
            # parent_row is >= 0 after the root: the row of the previous call's output.
            prev = torch.gather(self.hidden, 1, parent_row[..., None].expand(-1, -1, H))
        self.hidden = torch.tanh(0.7 * prev + self.emb[tokens % V] + 0.1 * (step + 1))
        return (self.hidden @ self.w).to(self.dtype)


def loop_expansion(expand, build, head, root_tokens, depth, top_k, num_nodes):
    """The plain loop: Python lists, one draft_expand per depth, torch.cat, then build_tree."""
    B = root_tokens.shape[0]
    tokens, scores, parents = [], [], []
    node_tokens = root_tokens[:, None]
    node_rows = torch.full((B, 1), -1, dtype=torch.int64)
    node_index = torch.full((B, 1), -1, dtype=torch.int64)
    node_scores = torch.zeros(B, 1)
    offset = 0
    for step in range(depth):
        out = expand(head(step, node_tokens, node_rows, node_index), node_scores, top_k)
        M = node_tokens.shape[1]
        tokens.append(out.tokens)
        scores.append(out.scores)
        parents.append(node_index.repeat_interleave(top_k, dim=1).to(torch.int32))
        picked = out.frontier.long()
        node_tokens = out.tokens.gather(1, picked)
        node_scores = out.scores.gather(1, picked)
        node_rows = picked // top_k
        node_index = picked + offset
        offset += M * top_k
    history = torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1)
    return history, build(root_tokens, *history, num_nodes)


def assert_same(exp, history, tree):
    for name, got, want in zip(("cand_tokens", "cand_scores", "cand_parents"), exp[1:], history):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    for name, got, want in zip(tree._fields, exp.tree, tree):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


@pytest.fixture
def forced_backend(backend, monkeypatch, op_impl):
    """Route the public ops through ``backend`` (skips when it has no draft_expand kernel)."""
    op_impl("draft_expand")
    monkeypatch.setenv("EAGLE_KERNELS_BACKEND", backend)
    return backend


@pytest.mark.parametrize("depth,top_k,num_nodes", [
    (1, 4, 5), (3, 4, 30), (4, 3, 22), (2, 2, 1),
], ids=["d1k4N5", "d3k4N30", "d4k3N22", "d2k2N1"])
def test_matches_plain_loop(forced_backend, depth, top_k, num_nodes):
    B = 3
    roots = torch.tensor([5, 77, 123])
    head = ToyHead(B, seed=depth * 10 + top_k)
    exp = expand_tree(head, roots, depth=depth, top_k=top_k, num_nodes=num_nodes)
    assert exp.cand_tokens.shape == (B, num_candidates(depth, top_k))
    loop_head = ToyHead(B, seed=depth * 10 + top_k)
    history, tree = loop_expansion(eagle_kernels.draft_expand, eagle_kernels.build_tree, loop_head,
                                   roots, depth, top_k, num_nodes)
    assert_same(exp, history, tree)
    # What the head saw: M = 1 then top_k nodes per call, rows and history indices in range.
    assert [c[0] for c in head.calls] == list(range(depth))
    for step, tokens, rows, index in head.calls:
        M = 1 if step == 0 else top_k
        assert tokens.shape == rows.shape == index.shape == (B, M)
        if step == 0:
            assert rows.tolist() == [[-1]] * B and tokens[:, 0].tolist() == roots.tolist()
        else:
            prev_m = 1 if step == 1 else top_k
            assert bool(((rows >= 0) & (rows < prev_m)).all())


def test_matches_reference_ops(forced_backend):
    """Against the loop over the reference ops: the planted head keeps candidate scores far
    apart, so float32 differences between paths cannot reorder anything."""
    B, depth, top_k = 2, 3, 4
    roots = torch.tensor([1, 2])
    head = ToyHead(B, seed=3)
    exp = expand_tree(head, roots, depth=depth, top_k=top_k, num_nodes=25)
    history, tree = loop_expansion(reference.draft_expand, reference.build_tree, ToyHead(B, seed=3),
                                   roots, depth, top_k, 25)
    for row in history[1]:
        gaps = torch.diff(torch.sort(row.double()).values)
        assert float(gaps.min()) > 1e-4, "data precondition: candidate scores well separated"
    torch.testing.assert_close(exp.cand_tokens, history[0], rtol=0, atol=0)
    torch.testing.assert_close(exp.cand_scores, history[1], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(exp.cand_parents, history[2], rtol=0, atol=0)
    for name, got, want in zip(tree._fields, exp.tree, tree):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_tree_invariants_and_d2t(forced_backend):
    B, depth, top_k, N = 2, 3, 3, 16
    roots = torch.tensor([9, 10])
    d2t = torch.arange(V, dtype=torch.int64) * 3  # target id = 4 * draft id
    exp = expand_tree(ToyHead(B, seed=8), roots, depth=depth, top_k=top_k, num_nodes=N, d2t=d2t)
    plain = expand_tree(ToyHead(B, seed=8), roots, depth=depth, top_k=top_k, num_nodes=N)
    assert bool((exp.cand_tokens % 4 == 0).all())
    # The head reduces tokens mod V, so mapped ids change the later logits; the root's step
    # sees the same logits either way.
    torch.testing.assert_close(exp.cand_tokens[:, :top_k], plain.cand_tokens[:, :top_k] * 4, rtol=0, atol=0)
    tree = exp.tree
    assert tree.parents[:, 0].tolist() == [-1, -1]
    idx = torch.arange(1, N)
    assert bool(((tree.parents[:, 1:] >= 0) & (tree.parents[:, 1:] < idx)).all())
    assert int(tree.depths.max()) <= depth
    # Children never outscore parents, so every parent pointer stays inside the history order.
    assert bool((exp.cand_parents < torch.arange(exp.cand_parents.shape[1], dtype=torch.int32)).all())


@contextlib.contextmanager
def no_host_reads():
    """Make every tensor -> Python conversion raise while the block runs."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def forbidden(name):
        def fn(self, *args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name} called during the expansion")
        return fn

    try:
        for n in names:
            setattr(torch.Tensor, n, forbidden(n))
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


def test_sync_free(backend, monkeypatch, op_impl):
    """With value checks off, the helper and the ops never convert a tensor to a Python value
    (the reference ops do, by design; they are not meant for a sync-free loop)."""
    if backend == "reference":
        pytest.skip("the reference ops read values on the host")
    op_impl("draft_expand")
    op_impl("build_tree")  # skips while this backend has no build_tree (it would run the reference)
    monkeypatch.setenv("EAGLE_KERNELS_BACKEND", backend)
    monkeypatch.setenv("EAGLE_KERNELS_CHECK_VALUES", "0")
    B = 2
    roots = torch.tensor([3, 4])
    # Warm-up outside the patch (lazy imports and kernel compilation may read values).
    expected = expand_tree(ToyHead(B, seed=1), roots, depth=3, top_k=4, num_nodes=20)
    with no_host_reads():
        got = expand_tree(ToyHead(B, seed=1), roots, depth=3, top_k=4, num_nodes=20)
    for name, a, b in zip(("tree", "tokens", "scores", "parents"), got, expected):
        if name == "tree":
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, rtol=0, atol=0)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The patch really bites: a conversion inside it raises.
    with no_host_reads(), pytest.raises(AssertionError, match="host sync"):
        int(roots[0])


def test_draft_expand_sync_free(backend, monkeypatch, op_impl):
    """One draft_expand call of the backend, with d2t, under the same patch."""
    if backend == "reference":
        pytest.skip("the reference op reads values on the host")
    fn = op_impl("draft_expand")
    monkeypatch.setenv("EAGLE_KERNELS_CHECK_VALUES", "0")
    logits = torch.randn(2, 4, 300, generator=torch.Generator().manual_seed(0))
    fs = torch.zeros(2, 4)
    d2t = torch.arange(300, dtype=torch.int64)
    expected = fn(logits, fs, 4, d2t=d2t)
    with no_host_reads():
        got = fn(logits, fs, 4, d2t=d2t)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,name", [
    (dict(depth=0, top_k=2, num_nodes=2), "depth"),
    (dict(depth=2, top_k=0, num_nodes=2), "top_k"),
    (dict(depth=2, top_k=2, num_nodes=8), "num_nodes"),
], ids=["depth0", "top_k0", "num_nodes_above_C"])
def test_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        expand_tree(ToyHead(1), torch.tensor([1]), **kwargs)


def test_bad_draft_fn_output():
    with pytest.raises(ValueError, match="draft_fn"):
        expand_tree(lambda *a: torch.zeros(1, 2, V), torch.tensor([1]), depth=1, top_k=2, num_nodes=2)
