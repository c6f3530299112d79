"""The native CPU conversions of the SGLang adapter (csrc/cpu/engine_layout.cpp) against their
reference, the adapter's tensor path: identical outputs on random trees, in SGLang's node order
and shuffled, with nodes no link reaches. Needs neither engine (the main suite runs them too)."""

from __future__ import annotations

import pytest
import torch

from eagle_kernels import _dispatch
from eagle_kernels._schemas import ENGINE_SCHEMAS
from eagle_kernels.integrations import _layout
from eagle_kernels.integrations import sglang as plugin
from eagle_kernels.integrations import vllm as vllm_plugin

pytestmark = pytest.mark.skipif(not _dispatch.HAS_CPP, reason="C++ extension not built")


def random_links(bs, n, gen, shuffled, unlinked):
    """SGLang links of random trees (parents before children, siblings in index order), then
    optionally with nodes 1..N-1 relabelled and with one node cut from the links."""
    # parents[b, i] uniform in [0, i): floor(u * i)
    parents = (torch.rand(bs, n, generator=gen) * torch.arange(n)).long()
    parents[:, 0] = -1
    linked = torch.ones(bs, n, dtype=torch.bool)
    if unlinked and n > 2:
        linked[:, n - 1] = False  # a leaf whose parent was not selected: no link reaches it
    nt, ns = _layout.first_child_next_sibling(parents, linked)
    if shuffled:
        perm = torch.cat([torch.zeros(bs, 1, dtype=torch.long),
                          torch.argsort(torch.rand(bs, n - 1, generator=gen), -1) + 1], 1)  # new -> old
        inv = torch.argsort(perm, -1)

        def move(links):
            moved = links.gather(1, perm)
            return torch.where(moved >= 0, inv.gather(1, moved.clamp(min=0)), -1)

        nt, ns = move(nt), move(ns)
    ri = torch.arange(bs * n).view(bs, n)
    return ri, nt, ns


def outputs(bs, n, num_spec, dtype=torch.int32):
    return (torch.full((bs * n,), -1, dtype=dtype), torch.full((bs, num_spec), -1, dtype=dtype),
            torch.full((bs,), -7, dtype=dtype))


CASES = [(1, 1, 1), (1, 8, 4), (3, 8, 5), (4, 16, 6), (2, 64, 7)]
LAYOUTS = [(False, False), (True, False), (False, True), (True, True)]
LAYOUT_IDS = ["sglang_order", "shuffled", "unlinked", "shuffled_unlinked"]


@pytest.mark.parametrize("shuffled,unlinked", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("bs,n,num_spec", CASES, ids=[f"bs{c[0]}-n{c[1]}-spec{c[2]}" for c in CASES])
def test_native_greedy_equals_tensor_path(bs, n, num_spec, shuffled, unlinked):
    gen = torch.Generator().manual_seed(bs * 100 + n)
    for trial in range(3):
        ri, nt, ns = random_links(bs, n, gen, shuffled, unlinked)
        vocab = 2 + trial  # few tokens: many matches, duplicate siblings
        cand = torch.randint(0, vocab, (bs, n), generator=gen)
        target = torch.randint(0, vocab, (bs, n), generator=gen)
        native = outputs(bs, n, num_spec)
        ints = (lambda t: t.int()) if trial == 1 else (lambda t: t)  # SGLang's int32 and int64 tensors
        torch.ops.eagle_kernels.sglang_verify_greedy(*native, ints(cand), ints(ri), ints(nt), ints(ns), ints(target))
        ref = outputs(bs, n, num_spec)
        plugin.verify_greedy_tensors(*ref, cand, ri, nt, ns, target)
        for name, a, b in zip(("predicts", "accept_index", "accept_token_num"), native, ref):
            assert torch.equal(a, b), (name, trial)


@pytest.mark.parametrize("mode", [0, 1, 2], ids=["full_mask", "qlen_only", "qlen_only_bitpacking"])
@pytest.mark.parametrize("bs,topk,depth,n", [(1, 1, 1, 2), (2, 4, 4, 8), (3, 8, 6, 32), (2, 8, 6, 64)])
def test_native_build_tree_equals_tensor_path(bs, topk, depth, n, mode):
    """SGLang's tree build, native (CPU) against the adapter's tensor path: random selections of
    candidates (sorted and not), parent candidates selected or not (unlinked nodes), int32 and
    int64 tensors, every mask mode over a pre-filled mask."""
    if mode == 2 and n > 32:
        pytest.skip("QLEN_ONLY_BITPACKING takes at most 32 nodes")
    gen = torch.Generator().manual_seed(bs * 1000 + n + mode)
    num_cand = topk + (depth - 1) * topk * topk
    for trial in range(3):
        sel = torch.stack([torch.randperm(num_cand, generator=gen)[: n - 1] for _ in range(bs)])
        if trial != 1:
            sel = sel.sort(-1).values  # SGLang's order; trial 1 unsorted
        parent_list = torch.randint(-1, num_cand, (bs, 1 + (depth - 1) * topk), generator=gen)
        parent_list[:, 0] = -1
        # Most parent candidates among the selected ones, some not (no link reaches those nodes).
        pick = sel.gather(1, torch.randint(0, n - 1, parent_list.shape, generator=gen))
        parent_list[:, 1:] = torch.where(torch.rand(bs, parent_list.shape[1] - 1, generator=gen) < 0.8,
                                         pick[:, 1:], parent_list[:, 1:])
        seq_lens = torch.randint(1, 20, (bs,), generator=gen)
        ints = (lambda t: t.int()) if trial == 2 else (lambda t: t)
        if mode == 0:
            size = int(n * n * bs + seq_lens.sum() * n)
        else:
            size = bs * n * n if mode == 1 else bs * n * (4 if n > 16 else 2 if n > 8 else 1) // 4 + 1
        dtype = torch.int32 if mode == 2 else torch.bool
        outs = []
        for fn in (plugin.build_tree, plugin.build_tree_tensors):
            mask = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(trial)).to(dtype)
            ret = torch.full((3, bs, n), -5, dtype=torch.int32 if trial == 2 else torch.long)
            pos = torch.full((bs * n,), -5, dtype=ret.dtype)
            fn(ints(parent_list), ints(sel), ints(seq_lens), mask, pos, ret[0], ret[1], ret[2], topk, depth, n, mode)
            outs.append((mask, pos, ret))
        for name, a, b in zip(("tree_mask", "positions", "retrieve"), *outs):
            assert torch.equal(a, b), (name, trial)


def test_native_build_tree_runs_natively(monkeypatch):
    """On CPU the adapter's build runs the native op, not the tensor path."""
    monkeypatch.setattr(_layout, "tree_from_selection", lambda *a: pytest.fail("the tensor path ran"))
    ret = torch.full((3, 1, 4), -1, dtype=torch.long)
    pos = torch.empty(4, dtype=torch.long)
    mask = torch.zeros(16, dtype=torch.bool)
    plugin.build_tree(torch.tensor([[-1, 0]]), torch.tensor([[0, 1, 2]]), torch.tensor([5]), mask, pos, ret[0],
                      ret[1], ret[2], 2, 2, 4, 1)
    assert pos.tolist() == [5, 6, 6, 7]
    assert ret[1, 0].tolist() == [1, 3, -1, -1] and ret[2, 0].tolist() == [-1, 2, -1, -1]


@pytest.mark.parametrize("shuffled", [False, True], ids=["sglang_order", "shuffled"])
def test_native_greedy_verifies_only_the_nodes_the_walk_looks_at(shuffled):
    """verify's inputs of the fused greedy op hold the root and the children of each accepted
    node only (fewer than N nodes), and our verify on them gives the fused op's accepted path."""
    gen = torch.Generator().manual_seed(7)
    bs, n, num_spec = 4, 32, 5
    ri, nt, ns = random_links(bs, n, gen, shuffled, False)
    cand = torch.randint(0, 2, (bs, n), generator=gen)
    target = torch.randint(0, 2, (bs, n), generator=gen)
    tokens, parents, logits, order = torch.ops.eagle_kernels.sglang_greedy_verify_inputs(
        cand, nt, ns, target, num_spec - 1)
    parent, _ = _layout.parents_from_links(nt, ns)
    out = outputs(bs, n, num_spec)
    torch.ops.eagle_kernels.sglang_verify_greedy(*out, cand, ri, nt, ns, target)
    for b in range(bs):
        # The walk looks at the root and at the children of each accepted node it goes on from
        # (not from the last one when it reached num_spec - 1 drafts).
        path = [int(i) - b * n for i in out[1][b] if i >= 0][: num_spec - 1]
        expected = {0} | {i for i in range(1, n) if int(parent[b, i]) in path}
        looked = order[b][order[b] >= 0].tolist()
        assert looked[0] == 0 and len(looked) == len(set(looked)) and set(looked) == expected, b
    assert tokens.shape[1] < n and logits.shape == (bs, tokens.shape[1], 3)
    lengths, nodes = torch.ops.eagle_kernels.verify(tokens, parents, logits, max_depth=num_spec - 1)[:2]
    rows = torch.where(nodes >= 0, order.gather(1, nodes.clamp(min=0).long()) + ri[:, :1], -1)
    assert torch.equal(rows.int(), out[1]) and torch.equal(lengths.int(), out[2])


def test_native_greedy_terminates_on_cyclic_links():
    """Malformed links (a sibling chain that loops, a child that is its own ancestor) end the walk."""
    nt = torch.tensor([[1, 2, 1, -1]])
    ns = torch.tensor([[-1, 3, -1, 1]])
    cand = torch.tensor([[0, 5, 5, 5]])
    target = torch.tensor([[5, 5, 5, 5]])
    ri = torch.arange(4).view(1, 4)
    out = outputs(1, 4, 6)
    torch.ops.eagle_kernels.sglang_verify_greedy(*out, cand, ri, nt, ns, target)
    assert out[1][0, 0] == 0 and 1 <= int(out[2][0]) <= 3


@pytest.mark.parametrize("shuffled,unlinked", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("bs,n,num_spec", CASES, ids=[f"bs{c[0]}-n{c[1]}-spec{c[2]}" for c in CASES])
def test_native_sampling_equals_tensor_path(bs, n, num_spec, shuffled, unlinked):
    gen = torch.Generator().manual_seed(bs * 100 + n + 1)
    vocab = 5
    for trial in range(4):
        ri, nt, ns = random_links(bs, n, gen, shuffled, unlinked)
        cand = torch.randint(0, vocab, (bs, n), generator=gen)
        probs = torch.softmax(torch.randn(bs, n, vocab, generator=gen) * 2, -1)
        probs[:, :, 1] = 0  # zero-probability drafts are never accepted
        probs = probs / probs.sum(-1, keepdim=True)
        coins, final = torch.rand(bs, n, generator=gen), torch.rand(bs, generator=gen)
        native = outputs(bs, n, num_spec, torch.int64)
        torch.ops.eagle_kernels.sglang_tree_sampling(*native, cand, ri, nt, ns, coins, final, probs)
        ref = outputs(bs, n, num_spec, torch.int64)
        # The native op reads the rows in place (no probability-0 column) when it can.
        plugin.tree_sampling_tensors(*ref, cand, ri, nt, ns, coins, final, probs, compact=not (shuffled or unlinked))
        for name, a, b in zip(("predicts", "accept_index", "accept_token_num"), native, ref):
            assert torch.equal(a, b), (name, trial)


def test_adapter_takes_the_native_path(monkeypatch):
    calls = []
    monkeypatch.setattr(plugin, "verify_greedy_tensors", lambda *a: calls.append(a))
    ri, nt, ns = random_links(2, 8, torch.Generator().manual_seed(0), False, False)
    out = outputs(2, 8, 4)
    plugin.verify_greedy(*out, torch.zeros(2, 8, dtype=torch.long), ri, nt, ns, torch.zeros(2, 8, dtype=torch.long))
    assert calls == []  # the tensor path did not run
    assert out[2].min() >= 0 and out[1][:, 0].tolist() == ri[:, 0].tolist()


@pytest.mark.parametrize("name,bad,match", [
    ("candidates", lambda a: {**a, "candidates": a["candidates"].float()}, "candidates: expected dtype"),
    ("retrieve_next_token", lambda a: {**a, "retrieve_next_token": a["retrieve_next_token"][:, :3]},
     "retrieve_next_token: expected shape"),
    ("accept_index", lambda a: {**a, "accept_index": a["accept_index"][0]}, "accept_index: expected 2-D"),
    ("target_predict", lambda a: {**a, "target_predict": a["target_predict"][:, :2]}, "target_predict: expected"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_native_bad_input_names_the_tensor(name, bad, match):
    ri, nt, ns = random_links(2, 6, torch.Generator().manual_seed(1), False, False)
    predicts, accept_index, accept_num = outputs(2, 6, 3)
    args = dict(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
                candidates=torch.zeros(2, 6, dtype=torch.long), retrieve_index=ri, retrieve_next_token=nt,
                retrieve_next_sibling=ns, target_predict=torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=match):
        torch.ops.eagle_kernels.sglang_verify_greedy(**bad(args))


@pytest.mark.parametrize("op", sorted(ENGINE_SCHEMAS))
def test_engine_schemas_match_the_extension(op):
    assert str(getattr(torch.ops.eagle_kernels, op).default._schema) == "eagle_kernels::" + ENGINE_SCHEMAS[op]


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("bs,L,V", [(1, 1, 3), (3, 2, 4), (5, 4, 6), (2, 6, 50)], ids=lambda x: str(x))
def test_native_full_chains_equal_tensor_path(bs, L, V, sampling):
    gen = torch.Generator().manual_seed(bs * 10 + L)
    for trial in range(4):
        # Few tokens and peaked rows: chains of every acceptance length.
        drafts = torch.randint(0, min(V, 3), (bs * L,), generator=gen, dtype=torch.int32)
        logits = torch.randn(bs * L, V, generator=gen) * 3
        logits[:, :3] += 2
        bonus = torch.randint(0, V, (bs, 1), generator=gen, dtype=torch.int32)
        temperature = uniform = None
        if sampling:
            temperature = torch.rand(bs, generator=gen)
            temperature[0] = 0  # a greedy request in a sampling batch
            uniform = torch.rand(bs * L, generator=gen, dtype=torch.float64)
        cu = torch.arange(1, bs + 1) * L
        native = torch.ops.eagle_kernels.vllm_chains(drafts, cu, logits, bonus, L, temperature, uniform)
        ref = vllm_plugin.full_chains(drafts, logits, bonus, temperature, uniform)
        assert native.dtype == ref.dtype == torch.int32
        assert torch.equal(native, ref), trial


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_native_ragged_chains_are_full_chains_per_request(sampling):
    """Ragged batches: each request verified alone as a full chain, padded to max_spec_len + 1."""
    gen = torch.Generator().manual_seed(3)
    V, L = 5, 4
    for trial in range(5):
        counts = torch.randint(0, L + 1, (6,), generator=gen).tolist()
        T = sum(counts)
        drafts = torch.randint(0, 3, (T,), generator=gen)
        logits = torch.randn(T, V, generator=gen) * 3
        bonus = torch.randint(0, V, (len(counts), 1), generator=gen)
        temperature = torch.rand(len(counts), generator=gen) if sampling else None
        uniform = torch.rand(T, generator=gen, dtype=torch.float64) if sampling else None
        cu = torch.tensor(counts).cumsum(0)
        native = torch.ops.eagle_kernels.vllm_chains(drafts, cu, logits, bonus, L, temperature, uniform)
        start = 0
        for b, n in enumerate(counts):
            expected = torch.full((L + 1,), -1, dtype=torch.int32)
            if n == 0:
                expected[0] = bonus[b, 0]
            else:
                rows = slice(start, start + n)
                one = vllm_plugin.full_chains(drafts[rows], logits[rows], bonus[b], None if not sampling else
                                              temperature[b : b + 1], None if not sampling else uniform[rows])
                expected[: n + 1] = one[0]
            assert torch.equal(native[b], expected), (trial, b, counts)
            start += n


@pytest.mark.parametrize("filters", ["temperature", "top_k", "top_p", "top_k_top_p"])
@pytest.mark.parametrize("shuffled,unlinked", LAYOUTS, ids=LAYOUT_IDS)
def test_native_sampling_from_logits_equals_tensor_path(shuffled, unlinked, filters):
    """The sampling verify from the logits SGLang's probabilities were made of (per-row
    temperature / top-k / top-p, as SGLang expands them over a request's N rows)."""
    gen = torch.Generator().manual_seed(len(filters) + 10 * shuffled + 100 * unlinked)
    bs, n, num_spec, vocab = 3, 8, 5, 7
    for trial in range(4):
        ri, nt, ns = random_links(bs, n, gen, shuffled, unlinked)
        cand = torch.randint(0, vocab, (bs, n), generator=gen)
        logits = torch.randn(bs * n, vocab, generator=gen) * 2
        temps = (torch.rand(bs, 1, generator=gen) + 0.3).repeat_interleave(n, 0)
        ks = torch.tensor([2, 0, vocab + 3]).repeat_interleave(n) if "top_k" in filters else None
        ps = torch.tensor([0.5, 1.0, 0.8]).repeat_interleave(n) if "top_p" in filters else None
        coins, final = torch.rand(bs, n, generator=gen), torch.rand(bs, generator=gen)
        native = outputs(bs, n, num_spec, torch.int64)
        torch.ops.eagle_kernels.sglang_tree_sampling_logits(*native, cand, ri, nt, ns, coins, final, logits, temps,
                                                            ks, ps)
        ref = outputs(bs, n, num_spec, torch.int64)
        plugin.tree_sampling_tensors(*ref, cand, ri, nt, ns, coins, final, None, (logits, temps, ks, ps),
                                     compact=not (shuffled or unlinked))
        for name, a, b in zip(("predicts", "accept_index", "accept_token_num"), native, ref):
            assert torch.equal(a, b), (name, trial)


def test_handoff_only_for_the_recorded_unmodified_probabilities(monkeypatch):
    logits = torch.randn(4, 5)
    temps = torch.full((4, 1), 0.5)
    probs = plugin.softmax_hook(lambda x, t: torch.softmax(x / t, -1), logits, temps)
    assert plugin._handed_logits(probs.view(2, 2, 5))[0] is logits
    filtered = plugin.top_k_renorm_prob(probs, torch.full((4,), 2))
    handed = plugin._handed_logits(filtered.view(2, 2, 5))
    assert handed[0] is logits and handed[2] is not None and handed[3] is None
    assert plugin._handed_logits(probs) is None  # no longer the latest record
    filtered.mul_(1.0)  # modified in place: not the recorded values any more
    assert plugin._handed_logits(filtered) is None
    probs = plugin.softmax_hook(lambda x, t: torch.softmax(x / t, -1), logits, temps)
    nucleus = plugin.top_p_renorm_prob(probs, torch.full((4,), 0.9))
    assert plugin._handed_logits(plugin.top_k_renorm_prob(nucleus, torch.full((4,), 2))) is None  # top-p first
    assert plugin._handed_logits(probs.clone()) is None


def test_no_handoff_for_inference_tensors():
    """SGLang under SGLANG_ENABLE_TORCH_INFERENCE_MODE: its probabilities keep no version counter, so a change in
    place could not be seen; the hooks record them without a handoff (the probabilities path), and raise nothing."""
    logits = torch.randn(4, 5)
    temps = torch.full((4, 1), 0.5)
    with torch.inference_mode():
        probs = plugin.softmax_hook(lambda x, t: torch.softmax(x / t, -1), logits, temps)
        assert plugin._handed_logits(probs) is None
        filtered = plugin.top_k_renorm_prob(probs, torch.full((4,), 2))
        assert plugin._handed_logits(filtered) is None
    assert torch.allclose(filtered.sum(-1), torch.ones(4))


def test_handed_logits_outside_the_contract_verify_from_the_probabilities(caplog):
    """A top_p outside (0, 1] (verify's contract) on the logits path: logged, and the
    probabilities path runs instead (SGLang has no kernel to fall back to on CPU)."""
    import logging

    bs, n, vocab = 2, 4, 5
    ri, nt, ns = random_links(bs, n, torch.Generator().manual_seed(2), False, False)
    logits = torch.randn(bs * n, vocab)
    probs = plugin.softmax_hook(lambda x, t: torch.softmax(x / t, -1), logits, torch.ones(bs * n, 1))
    probs = plugin.top_p_renorm_prob(probs, torch.full((bs * n,), 1.5))
    assert plugin._handed_logits(probs) is not None
    out = outputs(bs, n, 3, torch.int64)
    plugin._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="eagle_kernels.integrations"):
        plugin.tree_sampling(*out, torch.zeros(bs, n, dtype=torch.long), ri, nt, ns, torch.rand(bs, n),
                             torch.rand(bs), probs.view(bs, n, vocab))
    assert "top_p" in caplog.text and "from the probabilities" in caplog.text
    assert out[2].min() >= 0
