"""The SGLang plugin against SGLang's own code on CPU (docs/serving.md): its plugin loader, its
``eagle_utils`` / ``spec_tree`` functions, and its Triton tree kernels (under TRITON_INTERPRET=1)
as the reference for the greedy paths. Runs in the venv of scripts/setup_engines_env.sh."""

from __future__ import annotations

import logging
import os
from importlib import metadata

import numpy as np
import pytest
import torch

pytest.importorskip("sglang")

import sglang_cases as cases  # noqa: E402
from chain_law import chi2_p_value, completed_p_value, rejection_chain_law  # noqa: E402
from scipy import stats  # noqa: E402
from sglang.kernels.ops.speculative import spec_tree, verify_sampling  # noqa: E402
from sglang.srt.speculative import eagle_utils  # noqa: E402

from eagle_kernels.integrations import sglang as plugin  # noqa: E402

FULL, QLEN, PACKED = 0, 1, 2


@pytest.fixture(scope="session")
def hooks():
    """SGLang's plugin loader discovers our entry point and applies the hooks (once per process:
    SGLang patches its modules in place)."""
    from sglang.srt import plugins

    os.environ["SGLANG_PLUGINS"] = "eagle_kernels"
    plugins._plugins_loaded = False
    plugins.load_plugins()
    assert hasattr(spec_tree.build_tree_kernel_efficient_func, "__wrapped__"), "the plugin did not load"
    return plugins


def sglang_build(parent_list, top_scores_index, seq_lens, topk, depth, n, mode):
    """SGLang's own build (its Triton kernel), outputs as eagle_utils allocates them."""
    bs = seq_lens.numel()
    if mode == FULL:
        mask = torch.full((int(seq_lens.sum()) * n + n * n * bs,), True)
    else:
        mask = torch.full((n * n * bs,), True)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
    positions = torch.empty(bs * n, dtype=torch.long)
    spec_tree.sgl_build_tree_kernel_triton(parent_list, top_scores_index, seq_lens, mask, positions, retrieve[0],
                                           retrieve[1], retrieve[2], topk, depth, n, mode)
    return mask, positions, retrieve[0], retrieve[1], retrieve[2]


def ours_build(parent_list, top_scores_index, seq_lens, topk, depth, n, mode):
    """The hooked dispatcher through eagle_utils.build_tree_kernel_efficient (the engine's call)."""
    bonus = torch.zeros(seq_lens.numel(), dtype=torch.long)
    drafts = torch.zeros(seq_lens.numel(), n - 1, dtype=torch.long)
    out = eagle_utils.build_tree_kernel_efficient(bonus, parent_list, top_scores_index, drafts, seq_lens,
                                                  int(seq_lens.sum()), topk, depth, n, mode)
    return out[:5]


def test_entry_point_and_hooks(hooks):
    eps = [ep for ep in metadata.entry_points(group="sglang.srt.plugins") if ep.name == "eagle_kernels"]
    assert [ep.value for ep in eps] == ["eagle_kernels.integrations.sglang:register"]
    # The hooks reach the `from X import Y` copies the engine calls through.
    assert eagle_utils.build_tree_kernel_efficient_func is spec_tree.build_tree_kernel_efficient_func
    assert eagle_utils.verify_tree_greedy_func is spec_tree.verify_tree_greedy_func
    assert spec_tree.verify_tree_greedy_func.__name__ == "verify_tree_greedy_func"
    # Where SGLang has no kernel on CPU, the attributes are set directly.
    assert eagle_utils.tree_speculative_sampling_target_only is verify_sampling.tree_speculative_sampling_target_only
    assert eagle_utils.top_k_renorm_prob is plugin.top_k_renorm_prob
    assert eagle_utils.top_p_renorm_prob is plugin.top_p_renorm_prob
    # Unrelated None-valued globals stay None (no REPLACE on a None attribute).
    from sglang.kernels.ops.sampling import renorm

    assert renorm.top_k_renorm_prob is None


def test_disabled_without_whitelist(monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    monkeypatch.delenv("EAGLE_KERNELS_ENGINE_PLUGINS", raising=False)
    assert plugin.register() is False


@pytest.mark.parametrize("mode", [FULL, QLEN, PACKED], ids=["full_mask", "qlen_only", "qlen_only_bitpacking"])
def test_build_tree_golden(hooks, mode):
    scores, tokens, parents = cases.golden_build_inputs()
    parent_list, top_index, drafts = eagle_utils.organize_draft_results(scores, tokens, parents,
                                                                         cases.BUILD_NUM_DRAFT)
    seq_lens = torch.tensor(cases.BUILD_SEQ_LENS)
    bonus = torch.tensor(cases.BUILD_VERIFIED_ID)
    mask, positions, ri, nt, ns, draft_tokens = eagle_utils.build_tree_kernel_efficient(
        bonus, parent_list, top_index, drafts, seq_lens, int(seq_lens.sum()), cases.BUILD_TOPK, cases.BUILD_DEPTH,
        cases.BUILD_NUM_DRAFT, mode)
    assert positions.tolist() == cases.BUILD_POSITIONS
    assert ri.tolist() == cases.BUILD_RETRIEVE_INDEX
    assert nt.tolist() == cases.BUILD_NEXT_TOKEN
    assert ns.tolist() == cases.BUILD_NEXT_SIBLING
    assert draft_tokens.tolist() == cases.BUILD_DRAFT_TOKENS
    n = cases.BUILD_NUM_DRAFT
    ref = sglang_build(parent_list, top_index, seq_lens, cases.BUILD_TOPK, cases.BUILD_DEPTH, n,
                       QLEN if mode == PACKED else mode)
    if mode == PACKED:
        bits = ref[0].view(2, n, n).long() << torch.arange(n)
        assert mask.dtype == torch.uint8
        assert mask.long().tolist() == bits.sum(-1).flatten().tolist()
    else:
        assert torch.equal(mask, ref[0])


# (batch, topk, depth, verify tokens); the interpreted Triton reference costs ~N^2 * depth per request.
CONFIGS = [(1, 1, 1, 2), (2, 2, 3, 6), (3, 4, 4, 8), (1, 8, 5, 24)]


@pytest.mark.parametrize("bs,topk,depth,n", CONFIGS, ids=[f"bs{c[0]}-topk{c[1]}-depth{c[2]}-n{c[3]}" for c in CONFIGS])
@pytest.mark.parametrize("mode", [FULL, QLEN], ids=["full_mask", "qlen_only"])
def test_build_tree_random_matches_sglang(hooks, bs, topk, depth, n, mode):
    gen = torch.Generator().manual_seed(bs * 100 + topk * 10 + depth + n)
    if n - 1 > topk + (depth - 1) * topk * topk:
        pytest.skip("more verify tokens than candidates")
    for trial in range(2):
        score_list, token_list, parents_list = cases.random_draft(bs, topk, depth, 50, gen)
        parent_list, top_index, _ = eagle_utils.organize_draft_results(score_list, token_list, parents_list, n)
        seq_lens = torch.randint(1, 30, (bs,), generator=gen)
        ours = ours_build(parent_list, top_index, seq_lens, topk, depth, n, mode)
        ref = sglang_build(parent_list, top_index, seq_lens, topk, depth, n, mode)
        for name, a, b in zip(("tree_mask", "positions", "retrieve_index", "next_token", "next_sibling"), ours, ref):
            assert torch.equal(a, b), (name, trial)


def test_build_tree_node_without_selected_parent(hooks):
    """A candidate whose parent was not selected (SGLang: "invalid eagle tree", the node is left
    out of the links): same links, positions and mask as SGLang's Triton kernel."""
    topk, depth, n = 2, 3, 4
    # Candidates: 0,1 (depth 1); 2..5 (depth 2, children of parent_list[1..2]); 6..9 (depth 3).
    parent_list = torch.tensor([[-1, 0, 1, 3, 2]])
    top_index = torch.tensor([[0, 2, 8]])  # 8 // 2 = 4 -> parent candidate 2 (selected); fine
    bad_index = torch.tensor([[0, 1, 6]])  # 6 // 2 = 3 -> parent candidate 3 (not selected)
    for index in (top_index, bad_index):
        seq_lens = torch.tensor([7])
        for mode in (FULL, QLEN):
            ours = ours_build(parent_list, index, seq_lens, topk, depth, n, mode)
            ref = sglang_build(parent_list, index, seq_lens, topk, depth, n, mode)
            for a, b in zip(ours, ref):
                assert torch.equal(a, b)


def greedy_outputs(bs, n, num_spec):
    return (torch.full((bs * n,), -1, dtype=torch.int32), torch.full((bs, num_spec), -1, dtype=torch.int32),
            torch.empty(bs, dtype=torch.int32))


def test_verify_greedy_golden(hooks):
    predicts, accept_index, accept_num = greedy_outputs(2, 6, cases.GREEDY_NUM_SPEC_TOKENS)
    eagle_utils.verify_tree_greedy_func(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
        candidates=torch.tensor(cases.GREEDY_CANDIDATES), retrieve_index=torch.tensor(cases.GREEDY_RETRIEVE_INDEX),
        retrieve_next_token=torch.tensor(cases.GREEDY_NEXT_TOKEN),
        retrieve_next_sibling=torch.tensor(cases.GREEDY_NEXT_SIBLING),
        target_predict=cases.greedy_target_predict(), topk=-1)
    assert predicts.tolist() == cases.GREEDY_PREDICTS
    assert accept_index.tolist() == cases.GREEDY_ACCEPT_INDEX
    assert accept_num.tolist() == cases.GREEDY_ACCEPT_NUM


def random_sglang_tree(bs, topk, depth, n, gen):
    score_list, token_list, parents_list = cases.random_draft(bs, topk, depth, 50, gen)
    parent_list, top_index, _ = eagle_utils.organize_draft_results(score_list, token_list, parents_list, n)
    seq_lens = torch.randint(1, 30, (bs,), generator=gen)
    _, _, ri, nt, ns = sglang_build(parent_list, top_index, seq_lens, topk, depth, n, QLEN)
    return ri, nt, ns


def relabel(ri, nt, ns, gen):
    """The same trees with nodes 1..N-1 in a random order (siblings no longer in index order,
    children possibly before parents): a layout SGLang's verify kernels take as well."""
    bs, n = nt.shape
    perm = torch.cat([torch.zeros(bs, 1, dtype=torch.long),
                      torch.argsort(torch.rand(bs, n - 1, generator=gen), -1) + 1], 1)  # new -> old
    inv = torch.argsort(perm, -1)  # old -> new

    def move(links):
        moved = links.gather(1, perm)
        return torch.where(moved >= 0, inv.gather(1, moved.clamp(min=0)), -1)

    return ri, move(nt), move(ns)


@pytest.mark.parametrize("relabelled", [False, True], ids=["sglang_order", "shuffled_nodes"])
@pytest.mark.parametrize("bs,topk,depth,n", CONFIGS, ids=[f"bs{c[0]}-topk{c[1]}-depth{c[2]}-n{c[3]}" for c in CONFIGS])
def test_verify_greedy_random_matches_sglang(hooks, bs, topk, depth, n, relabelled):
    if n - 1 > topk + (depth - 1) * topk * topk:
        pytest.skip("more verify tokens than candidates")
    gen = torch.Generator().manual_seed(7 + bs * 31 + n)
    for trial in range(3):
        ri, nt, ns = random_sglang_tree(bs, topk, depth, n, gen)
        if relabelled:
            ri, nt, ns = relabel(ri, nt, ns, gen)
        vocab = 2 + trial  # few tokens: many matches, duplicate siblings
        candidates = torch.randint(0, vocab, (bs, n), generator=gen)
        target = torch.randint(0, vocab, (bs, n), generator=gen)
        num_spec = depth + 1
        ours = greedy_outputs(bs, n, num_spec)
        eagle_utils.verify_tree_greedy_func(ours[0], ours[1], ours[2], candidates, ri, nt, ns, target, topk)
        ref = greedy_outputs(bs, n, num_spec)
        spec_tree.verify_tree_greedy_triton(ref[0], ref[1], ref[2], candidates, ri, nt, ns, target)
        for name, a, b in zip(("predicts", "accept_index", "accept_token_num"), ours, ref):
            assert torch.equal(a, b), (name, trial)


# ------------------------------------------------------------------------------ host reads
class HostReads:
    """Counts the Python-level reads of tensor values on the host (item, tolist, bool, int,
    float, numpy, cpu) while active."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, original))

    def _counting(self, name, original):
        def counted(t, *args, **kwargs):
            self.calls.append(name)
            return original(t, *args, **kwargs)

        return counted


@pytest.mark.parametrize("native", [True, False], ids=["native_cpu", "tensor_path"])
def test_no_host_reads_in_wrapped_calls(hooks, monkeypatch, native):
    """No host reads in the wrapped calls: with the native CPU conversion (its reads are C++ on
    CPU tensors) and on the tensor path every other device takes (capturable in a CUDA graph)."""
    if not native:
        monkeypatch.setattr(plugin, "_native_op", lambda name: None)
    gen = torch.Generator().manual_seed(3)
    bs, topk, depth, n = 3, 4, 4, 8
    score_list, token_list, parents_list = cases.random_draft(bs, topk, depth, 50, gen)
    parent_list, top_index, _ = eagle_utils.organize_draft_results(score_list, token_list, parents_list, n)
    seq_lens = torch.randint(1, 30, (bs,), generator=gen)
    candidates = torch.randint(0, 3, (bs, n), generator=gen)
    target = torch.randint(0, 3, (bs, n), generator=gen)
    probs = torch.softmax(torch.randn(bs, n, 11, generator=gen), -1)
    coins = torch.rand(bs, n, generator=gen)
    final = torch.rand(bs, generator=gen)
    mask = torch.full((n * n * bs,), True)
    packed = torch.zeros(n * bs, dtype=torch.uint8)
    full = torch.full((int(seq_lens.sum()) * n + n * n * bs,), True)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
    positions = torch.empty(bs * n, dtype=torch.long)
    outs = greedy_outputs(bs, n, depth + 1)
    reads = HostReads(monkeypatch)
    for tree_mask, mode in ((mask, QLEN), (packed, PACKED), (full, FULL)):
        eagle_utils.build_tree_kernel_efficient_func(parent_list, top_index, seq_lens, tree_mask, positions,
                                                     retrieve[0], retrieve[1], retrieve[2], topk, depth, n, mode)
    eagle_utils.verify_tree_greedy_func(outs[0], outs[1], outs[2], candidates, retrieve[0], retrieve[1], retrieve[2],
                                        target, topk)
    eagle_utils.tree_speculative_sampling_target_only(
        predicts=outs[0], accept_index=outs[1], accept_token_num=outs[2], candidates=candidates,
        retrive_index=retrieve[0], retrive_next_token=retrieve[1], retrive_next_sibling=retrieve[2],
        uniform_samples=coins, uniform_samples_for_final_sampling=final, target_probs=probs,
        draft_probs=torch.zeros_like(probs), threshold_single=1.0, threshold_acc=1.0, deterministic=True)
    eagle_utils.top_k_renorm_prob(probs.view(-1, 11), torch.full((bs * n,), 3))
    eagle_utils.top_p_renorm_prob(probs.view(-1, 11), torch.full((bs * n,), 0.7))
    # The sampling verify from the logits SGLang's probabilities were made of.
    logits = torch.randn(bs * n, 11, generator=gen)
    made = eagle_utils.sampling_softmax(logits, temperatures=torch.full((bs * n, 1), 0.8))
    made = eagle_utils.top_k_renorm_prob(made, torch.full((bs * n,), 3))
    assert plugin._handed_logits(made) is not None
    eagle_utils.tree_speculative_sampling_target_only(
        predicts=outs[0], accept_index=outs[1], accept_token_num=outs[2], candidates=candidates,
        retrive_index=retrieve[0], retrive_next_token=retrieve[1], retrive_next_sibling=retrieve[2],
        uniform_samples=coins, uniform_samples_for_final_sampling=final, target_probs=made.view(bs, n, 11),
        draft_probs=torch.zeros_like(probs), threshold_single=1.0, threshold_acc=1.0, deterministic=True)
    assert reads.calls == []


def test_host_read_counter_counts(monkeypatch):
    reads = HostReads(monkeypatch)
    torch.ones(2).sum().item()
    bool(torch.ones(1))
    assert reads.calls == ["item", "__bool__"]


# ------------------------------------------------------------------------------ bad input
def test_bad_input_falls_back_with_a_log_line(hooks, caplog):
    candidates = torch.tensor(cases.GREEDY_CANDIDATES, dtype=torch.float32)
    predicts, accept_index, accept_num = greedy_outputs(2, 6, cases.GREEDY_NUM_SPEC_TOKENS)
    plugin._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="eagle_kernels.integrations"):
        eagle_utils.verify_tree_greedy_func(
            predicts, accept_index, accept_num, candidates, torch.tensor(cases.GREEDY_RETRIEVE_INDEX),
            torch.tensor(cases.GREEDY_NEXT_TOKEN), torch.tensor(cases.GREEDY_NEXT_SIBLING),
            cases.greedy_target_predict())
    assert "candidates" in caplog.text and "falls back to SGLang" in caplog.text


def test_unknown_mask_mode_falls_back(hooks, caplog):
    plugin._log_fallback.cache_clear()
    seq_lens = torch.tensor([3])
    with caplog.at_level(logging.WARNING, logger="eagle_kernels.integrations"):
        try:
            eagle_utils.build_tree_kernel_efficient_func(torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]),
                                                         seq_lens, torch.ones(16, dtype=torch.bool),
                                                         torch.empty(4, dtype=torch.long),
                                                         *torch.full((3, 1, 4), -1, dtype=torch.long), 2, 2, 4, 7)
        except Exception:
            pass
    assert "tree_mask_mode" in caplog.text


def test_relaxed_thresholds_fall_back(hooks, caplog):
    plugin._log_fallback.cache_clear()
    probs = torch.softmax(torch.randn(1, 2, 5), -1)
    with caplog.at_level(logging.WARNING, logger="eagle_kernels.integrations"):
        with pytest.raises(NotImplementedError, match="relaxed acceptance"):
            eagle_utils.tree_speculative_sampling_target_only(
                predicts=torch.zeros(2, dtype=torch.int32), accept_index=torch.full((1, 2), -1, dtype=torch.int32),
                accept_token_num=torch.zeros(1, dtype=torch.int32), candidates=torch.tensor([[0, 1]]),
                retrive_index=torch.tensor([[0, 1]]), retrive_next_token=torch.tensor([[1, -1]]),
                retrive_next_sibling=torch.tensor([[-1, -1]]), uniform_samples=torch.rand(1, 2),
                uniform_samples_for_final_sampling=torch.rand(1), target_probs=probs,
                draft_probs=torch.zeros_like(probs), threshold_single=0.9, threshold_acc=1.0)
    assert "relaxed acceptance" in caplog.text


# ------------------------------------------------------------------------------ sampling
# A fixed tree (SGLang layout) over a vocabulary of 4: root 0 with children 1, 2 (tokens 0, 0:
# a duplicate) and 3 (token 2); node 1 has children 4 (token 1) and 5 (token 3).
SAMPLE_NEXT_TOKEN = [1, 4, -1, -1, -1, -1]
SAMPLE_NEXT_SIBLING = [-1, 2, 3, -1, 5, -1]
SAMPLE_TOKENS = [9, 0, 0, 2, 1, 3]
SAMPLE_PARENT = [-1, 0, 0, 0, 1, 1]
V_SAMPLE = 4


def exact_emitted_law(probs: np.ndarray, max_steps: int) -> dict:
    """The exact law of the emitted tokens (accepted drafts + bonus) under plain sampling from
    each node's distribution: the sequence continues while the sampled token is a child's token
    (the first such child; duplicates carry no extra mass) and stops at the first other token."""
    law = {}

    def walk(node, prefix, mass, steps):
        for x in range(V_SAMPLE):
            p = mass * probs[node, x]
            if p == 0:
                continue
            child = next((c for c in range(6) if SAMPLE_PARENT[c] == node and SAMPLE_TOKENS[c] == x), None)
            if child is None or steps + 1 >= max_steps:
                law[prefix + (x,)] = law.get(prefix + (x,), 0) + p
            else:
                walk(child, prefix + (x,), p, steps + 1)

    walk(0, (), 1.0, 0)
    return law


def sample_case(draws, gen):
    probs = torch.softmax(torch.randn(6, V_SAMPLE, generator=gen) * 1.5, -1)
    probs[1, 2] = 0  # an impossible token
    probs = probs / probs.sum(-1, keepdim=True)
    n = 6
    expand = lambda rows: torch.tensor(rows).expand(draws, n).contiguous()  # noqa: E731
    tree = dict(candidates=expand(SAMPLE_TOKENS), retrive_index=torch.arange(draws * n).view(draws, n),
                retrive_next_token=expand(SAMPLE_NEXT_TOKEN), retrive_next_sibling=expand(SAMPLE_NEXT_SIBLING))
    return probs, tree


def emitted_p_value(probs, tree, predicts, accept_index, accept_num, num_spec):
    """χ² p-value of the emitted sequences against :func:`exact_emitted_law`."""
    draws, n = tree["candidates"].shape
    counts = {}
    pred = predicts.view(draws, n)
    for b in range(draws):
        k = int(accept_num[b])
        rows = accept_index[b, : k + 1] - b * n
        seq = tuple(int(pred[b, r]) for r in rows)
        counts[seq] = counts.get(seq, 0) + 1
        assert seq[:k] == tuple(SAMPLE_TOKENS[int(r)] for r in rows[1:]), "accepted tokens are the nodes' tokens"
    exact = probs.double() / probs.double().sum(-1, keepdim=True)  # verify renormalises each row
    law = exact_emitted_law(exact.numpy(), num_spec)
    if not set(counts) <= set(law):
        return 0.0
    keys = sorted(law)
    observed = np.array([counts.get(k, 0) for k in keys], dtype=np.float64)
    expected = np.array([law[k] for k in keys])
    assert abs(expected.sum() - 1) < 1e-9
    expected *= draws / expected.sum()
    return stats.chisquare(observed, expected)[1]


def test_cpu_sampling_verify_is_exact(hooks):
    """χ² of the emitted sequences of the hooked ``tree_speculative_sampling_target_only`` (our
    verify; SGLang has no such kernel on CPU and falls back to greedy) against the exact law."""
    gen = torch.Generator().manual_seed(11)
    draws, num_spec = 6000, 3
    probs, tree = sample_case(draws, gen)
    predicts, accept_index, accept_num = greedy_outputs(draws, 6, num_spec)
    target_probs = probs.expand(draws, 6, V_SAMPLE).contiguous()
    eagle_utils.tree_speculative_sampling_target_only(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, **tree,
        uniform_samples=torch.rand(draws, 6, generator=gen),
        uniform_samples_for_final_sampling=torch.rand(draws, generator=gen), target_probs=target_probs,
        draft_probs=torch.zeros_like(target_probs))
    p_value = emitted_p_value(probs, tree, predicts, accept_index, accept_num, num_spec)
    assert p_value > 1e-3, p_value


def test_chi2_rejects_sglang_cpu_greedy_fallback(hooks):
    """The harness fails what SGLang does on CPU without the plugin: greedy verify of sampling
    requests."""
    gen = torch.Generator().manual_seed(11)
    draws, num_spec = 6000, 3
    probs, tree = sample_case(draws, gen)
    predicts, accept_index, accept_num = greedy_outputs(draws, 6, num_spec)
    target = probs.argmax(-1).expand(draws, 6).contiguous()
    eagle_utils.verify_tree_greedy_func(  # greedy as SGLang's kernels do it (tested above)
        predicts, accept_index, accept_num, tree["candidates"], tree["retrive_index"], tree["retrive_next_token"],
        tree["retrive_next_sibling"], target)
    assert emitted_p_value(probs, tree, predicts, accept_index, accept_num, num_spec) < 1e-6


def test_cpu_sampling_path_is_taken(hooks, monkeypatch):
    """On CPU SGLang verifies sampling batches greedily; with the plugin its predicate sends them
    to the sampling path (and keeps greedy batches, rejection sampling and relaxed thresholds as
    SGLang has them)."""
    from types import SimpleNamespace

    from sglang.srt import runtime_context

    spec = SimpleNamespace(speculative_accept_threshold_single=1.0, speculative_accept_threshold_acc=1.0)
    monkeypatch.setattr(runtime_context, "get_spec", lambda: spec)
    args = dict(is_cpu=True, is_hip=False, is_xpu=False)
    uses_greedy = eagle_utils._verify_uses_greedy
    assert uses_greedy(is_all_greedy=True, use_rejection_sampling=False, **args) is True
    assert uses_greedy(is_all_greedy=False, use_rejection_sampling=False, **args) is False
    assert uses_greedy.__wrapped__(is_all_greedy=False, use_rejection_sampling=False, **args) is True
    assert uses_greedy(is_all_greedy=False, use_rejection_sampling=True, **args) is False  # our chain sampler
    spec.speculative_accept_threshold_acc = 0.5
    assert uses_greedy(is_all_greedy=False, use_rejection_sampling=False, **args) is True


# ------------------------------------------------------------------------------ rejection sampling (chains)
def chain_case(draws, gen, n=3, vocab=4):
    """Chains of ``n - 1`` drafts, each drawn from its row of q, with SGLang's chain-kernel inputs."""
    p = torch.softmax(torch.randn(n, vocab, generator=gen) * 1.5, -1)
    p[1, 0] = 0
    p /= p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(n - 1, vocab, generator=gen), -1)
    q[0, 3] = 0  # a token the drafter never proposes
    q /= q.sum(-1, keepdim=True)
    drafts = torch.stack([torch.multinomial(q[j], draws, replacement=True, generator=gen) for j in range(n - 1)], 1)
    predicts, accept_index, accept_num = greedy_outputs(draws, n, n)
    kwargs = dict(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
                  candidates=torch.cat([torch.full((draws, 1), 9), drafts], 1),
                  retrive_index=torch.arange(draws * n).view(draws, n),
                  retrive_next_token=torch.full((draws, n), -1), retrive_next_sibling=torch.full((draws, n), -1),
                  uniform_samples=torch.rand(draws, n, generator=gen),
                  uniform_samples_for_final_sampling=torch.rand(draws, generator=gen),
                  target_probs=p.expand(draws, n, vocab).contiguous(),
                  draft_probs=q.expand(draws, n - 1, vocab).contiguous(), threshold_single=1.0, threshold_acc=1.0,
                  deterministic=True)
    return kwargs, p, q


def chain_law_p_value(kwargs, p, q):
    """χ² p-value of the emitted sequences against rejection sampling's law (chain_law)."""
    draws, n = kwargs["candidates"].shape
    pred = kwargs["predicts"].view(draws, n)
    seen = {}
    for b in range(draws):
        k = int(kwargs["accept_token_num"][b])
        rows = kwargs["accept_index"][b, : k + 1] - b * n
        seq = tuple(int(pred[b, r]) for r in rows)
        seen[seq] = seen.get(seq, 0) + 1
    return chi2_p_value(seen, rejection_chain_law(p.double().numpy(), q.double().numpy()))


@pytest.mark.parametrize("handed", [False, True], ids=["from_probs", "from_logits"])
def test_chain_rejection_sampling_is_exact(hooks, caplog, monkeypatch, handed):
    """SGLang's rejection-sampling chains (the name eagle_utils calls) run our verify, with no
    fallback: the law of rejection sampling against the drafter's q (χ²); the links are not read.
    ``from_logits``: the probabilities made by SGLang's softmax (hooked) at T 0.8, verified from
    the logits they were made of."""
    plugin._log_fallback.cache_clear()
    kwargs, p, q = chain_case(4000, torch.Generator().manual_seed(21))
    if handed:
        draws, n, vocab = kwargs["target_probs"].shape
        logits = (0.8 * torch.log(p)).repeat(draws, 1)
        probs = plugin.softmax_hook(lambda x, t: torch.softmax(x / t, -1), logits, torch.full((draws * n, 1), 0.8))
        kwargs["target_probs"] = probs.view(draws, n, vocab)
        p = torch.softmax(torch.log(p), -1)
    calls, original = [], plugin.tree_sampling_tensors
    monkeypatch.setattr(plugin, "tree_sampling_tensors",
                        lambda *a, **kw: calls.append(len(a) > 10 and a[10] is not None) or original(*a, **kw))
    with caplog.at_level(logging.WARNING, logger="eagle_kernels.integrations"):
        eagle_utils.chain_speculative_sampling_triton(**kwargs)
    assert calls == [handed] and "falls back" not in caplog.text
    assert chain_law_p_value(kwargs, p, q) > 1e-3


def test_chain_rejection_sampling_law_is_sglangs(hooks):
    """SGLang's own chain kernel (under the interpreter) follows the same law: the law the test above
    holds ours to is SGLang's rule."""
    from sglang.kernels.ops.speculative import reject_sampling

    kwargs, p, q = chain_case(1500, torch.Generator().manual_seed(22))
    reject_sampling.chain_speculative_sampling_triton(**kwargs)
    assert chain_law_p_value(kwargs, p, q) > 1e-3


def test_chain_rejection_sampling_harness_has_power(hooks, monkeypatch):
    """The drafts verified as deterministic (the draft rows dropped: a planted bug) fail the law."""
    kwargs, p, q = chain_case(4000, torch.Generator().manual_seed(21))
    original = plugin.tree_sampling_tensors
    monkeypatch.setattr(plugin, "tree_sampling_tensors",
                        lambda *args, draft_probs=None, **kw: original(*args, **kw))
    plugin.chain_sampling(**kwargs)
    assert chain_law_p_value(kwargs, p, q) < 1e-6


def test_chain_rejection_sampling_no_host_reads(hooks, monkeypatch):
    kwargs, _, _ = chain_case(3, torch.Generator().manual_seed(24))
    reads = HostReads(monkeypatch)
    eagle_utils.chain_speculative_sampling_triton(**kwargs)
    assert reads.calls == []


def chain_block_p_value(kwargs, p, seed):
    """Block verification's emitted sequences completed from p (chain_law.completed_p_value)."""
    draws, n = kwargs["candidates"].shape
    pred = kwargs["predicts"].view(draws, n)
    sequences = []
    for b in range(draws):
        rows = kwargs["accept_index"][b, : int(kwargs["accept_token_num"][b]) + 1] - b * n
        sequences.append([int(pred[b, r]) for r in rows])
    return completed_p_value(sequences, p.double().numpy(), seed)


@pytest.mark.parametrize("handed", [False, True], ids=["from_probs", "from_logits"])
def test_chain_block_verification_is_exact(hooks, caplog, handed):
    """SGLang's rejection-sampling chains with block verification run our block_verify (no
    fallback): the emitted sequences completed from p have the target's law (χ²), as SGLang's own
    block kernel's do; drafts verified against sharper rows than they were drawn from (a planted
    bug) do not; the block keeps more drafts than the draft-by-draft rule on the same chains."""
    from sglang.kernels.ops.speculative import reject_sampling

    plugin._log_fallback.cache_clear()
    kwargs, p, q = chain_case(4000, torch.Generator().manual_seed(25))
    if handed:
        draws, n, vocab = kwargs["target_probs"].shape
        logits = (0.8 * torch.log(p)).repeat(draws, 1)
        probs = plugin.softmax_hook(lambda x, t: torch.softmax(x / t, -1), logits, torch.full((draws * n, 1), 0.8))
        kwargs["target_probs"] = probs.view(draws, n, vocab)
    with caplog.at_level(logging.WARNING, logger="eagle_kernels.integrations"):
        eagle_utils.chain_speculative_sampling_triton(**kwargs, block_verification=True)
    assert "falls back" not in caplog.text
    assert chain_block_p_value(kwargs, p, 1) > 1e-3
    block_accepted = kwargs["accept_token_num"].double().mean()
    eagle_utils.chain_speculative_sampling_triton(**kwargs)
    assert float(block_accepted) > float(kwargs["accept_token_num"].double().mean())
    sharp = q ** 3 / (q ** 3).sum(-1, keepdim=True)
    plugin.chain_sampling(**{**kwargs, "draft_probs": sharp.expand_as(kwargs["draft_probs"]).contiguous()},
                          block_verification=True)
    assert chain_block_p_value(kwargs, p, 2) < 1e-6
    if not handed:
        small, p2, _ = chain_case(800, torch.Generator().manual_seed(26))
        reject_sampling.chain_speculative_sampling_triton(**small, block_verification=True)
        assert chain_block_p_value(small, p2, 3) > 1e-3


def test_chain_rejection_sampling_contract(hooks, caplog, monkeypatch):
    """Relaxed thresholds fall back with their log line; on CPU the predicate sends
    rejection-sampling batches to the sampling path (our chain sampler), block verification
    included."""
    from types import SimpleNamespace

    from sglang.srt import runtime_context

    plugin._log_fallback.cache_clear()
    kwargs, _, _ = chain_case(4, torch.Generator().manual_seed(23))
    with pytest.raises(plugin.OutsideContract, match="relaxed acceptance"):
        plugin.chain_sampling(**{**kwargs, "threshold_acc": 0.5})
    with pytest.raises(plugin.OutsideContract, match="draft_probs"):
        plugin.chain_sampling(**{**kwargs, "draft_probs": kwargs["draft_probs"][..., :3]})
    spec = SimpleNamespace(speculative_accept_threshold_single=1.0, speculative_accept_threshold_acc=1.0,
                           speculative_use_block_verification=False)
    monkeypatch.setattr(runtime_context, "get_spec", lambda: spec)
    args = dict(is_all_greedy=False, use_rejection_sampling=True, is_cpu=True, is_hip=False, is_xpu=False)
    assert eagle_utils._verify_uses_greedy(**args) is False
    spec.speculative_use_block_verification = True
    assert eagle_utils._verify_uses_greedy(**args) is False


@pytest.mark.parametrize("k", [1, 2, 5, 0])
def test_top_k_renorm(k):
    probs = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.1]])
    out = plugin.top_k_renorm_prob(probs, torch.tensor([k]))
    keep = {1: [0, 1, 1, 0, 0], 2: [0, 1, 1, 0, 0], 5: [1] * 5, 0: [1] * 5}[k]  # ties kept together
    expected = probs * torch.tensor(keep)
    torch.testing.assert_close(out, expected / expected.sum())


def test_top_p_renorm():
    probs = torch.tensor([[0.1, 0.4, 0.3, 0.2]])
    out = plugin.top_p_renorm_prob(probs, torch.tensor([0.7]))
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.4, 0.3, 0.0]]) / 0.7)


# ------------------------------------------------------------------------------ the engine's step
def test_eagle_sample_on_cpu_is_exact(hooks, monkeypatch):
    """SGLang's own ``eagle_utils.eagle_sample`` (the verify step of its EAGLE worker) on CPU,
    sampling requests with temperature and top-k: with the plugin it samples exactly (χ² against
    the law of plain sampling from the engine's top-k-filtered, tempered target)."""
    from types import SimpleNamespace

    from sglang.srt import runtime_context
    from sglang.srt.layers import dp_attention

    spec = SimpleNamespace(speculative_use_rejection_sampling=False, speculative_accept_threshold_single=1.0,
                           speculative_accept_threshold_acc=1.0, speculative_use_block_verification=False)
    group = SimpleNamespace(world_size=1)
    monkeypatch.setattr(runtime_context, "get_spec", lambda: spec)
    monkeypatch.setattr(eagle_utils, "get_spec", lambda: spec)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: SimpleNamespace(tp_group=group, attn_tp_group=group))
    monkeypatch.setattr(dp_attention, "is_dp_attention_enabled", lambda: False)

    gen = torch.Generator().manual_seed(21)
    draws, n, num_spec, temperature, top_k = 4000, 6, 3, 0.7, 3
    logits = torch.randn(n, V_SAMPLE, generator=gen) * 1.5
    expand = lambda rows: torch.tensor(rows).expand(draws, n).contiguous()  # noqa: E731
    verify_input = SimpleNamespace(
        draft_token=expand(SAMPLE_TOKENS).reshape(-1), draft_token_num=n, max_tree_depth=num_spec,
        retrieve_index=torch.arange(draws * n).view(draws, n), retrieve_next_token=expand(SAMPLE_NEXT_TOKEN),
        retrieve_next_sibling=expand(SAMPLE_NEXT_SIBLING), tree_topk=2, draft_probs=None)
    sampling_info = SimpleNamespace(
        acc_additive_penalties=None, acc_scaling_penalties=None, logit_bias=None, has_watermark_candidates=False,
        is_all_greedy=False, temperatures=torch.full((draws, 1), temperature), need_top_k_sampling=True,
        top_ks=torch.full((draws,), top_k, dtype=torch.int32), need_top_p_sampling=False, top_ps=None,
        need_min_p_sampling=False, sampling_seed=None)
    batch = SimpleNamespace(device="cpu", forward_mode=SimpleNamespace(is_idle=lambda: False),
                            seq_lens=torch.full((draws,), 10), sampling_info=sampling_info, return_logprob=False)
    logits_output = SimpleNamespace(next_token_logits=logits.repeat(draws, 1))
    handed = []
    original = plugin._handed_logits
    monkeypatch.setattr(plugin, "_handed_logits", lambda probs: handed.append(original(probs)) or handed[-1])
    predict, accept_lens, accept_index = eagle_utils.eagle_sample(verify_input, batch, logits_output)
    # The verify took the logits and parameters SGLang's probabilities were made of.
    assert len(handed) == 1 and handed[0] is not None and handed[0][2] is not None

    probs = torch.softmax(logits.double() / temperature, -1)
    kth = probs.sort(-1, descending=True).values[:, top_k - 1 : top_k]
    probs = torch.where(probs >= kth, probs, 0)
    probs = probs / probs.sum(-1, keepdim=True)
    tree = dict(candidates=expand(SAMPLE_TOKENS))
    p_value = emitted_p_value(probs, tree, predict, accept_index, accept_lens - 1, num_spec)
    assert p_value > 1e-3, p_value


# ------------------------------------------------------------------------------ KV commit
def test_kv_commit_matches_sglang(hooks, caplog):
    """``spec_utils.move_accept_tokens_to_target_kvcache`` through compact_kv: the same pool
    contents as SGLang's own move (its cache-location kernels and ``move_kv_cache``)."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.speculative import spec_utils

    gen = torch.Generator().manual_seed(4)
    bs, n, num_spec, heads, dim, layers, slots = 3, 6, 4, 2, 8, 3, 40

    def pool():
        p = object.__new__(MHATokenToKVPool)  # its buffers, without a device allocator behind them
        p.layer_num, p.size, p.page_size, p.use_hnd, p.use_native_move_kv_cache = layers, slots, 1, False, True
        p.native_k_scale_buffer = p.k_scale_buffer = None
        g = torch.Generator().manual_seed(9)
        p.k_buffer = [torch.randn(slots + 1, heads, dim, generator=g) for _ in range(layers)]
        p.v_buffer = [torch.randn(slots + 1, heads, dim, generator=g) for _ in range(layers)]
        return p

    out_cache_loc = (torch.randperm(slots, generator=gen)[: bs * n] + 1).long()
    accept_len = torch.tensor([0, 2, 3], dtype=torch.int32)
    accept_index = torch.full((bs, num_spec), -1, dtype=torch.int32)
    for b in range(bs):
        picked = torch.sort(torch.randperm(n - 1, generator=gen)[: int(accept_len[b])] + 1).values
        accept_index[b, : int(accept_len[b]) + 1] = torch.cat([torch.zeros(1, dtype=torch.long), picked]) + b * n
    batch = SimpleNamespace(seq_lens=torch.full((bs,), 9), out_cache_loc=out_cache_loc)
    ours, ref, before = pool(), pool(), pool()
    plugin._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="eagle_kernels.integrations"):
        spec_utils.move_accept_tokens_to_target_kvcache(batch, accept_index, accept_len,
                                                        SimpleNamespace(get_kvcache=lambda: ours))
    assert "falls back" not in caplog.text
    spec_utils.move_accept_tokens_to_target_kvcache.__wrapped__(batch, accept_index, accept_len,
                                                                SimpleNamespace(get_kvcache=lambda: ref))
    moved = False
    for a, b, c in zip(ours.k_buffer + ours.v_buffer, ref.k_buffer + ref.v_buffer, before.k_buffer + before.v_buffer):
        assert torch.equal(a, b)
        moved |= not torch.equal(a, c)
    assert moved


def test_kv_commit_other_pools_fall_back(hooks, caplog):
    from types import SimpleNamespace

    from sglang.srt.speculative import spec_utils

    calls = []
    other = SimpleNamespace(move_kv_cache=lambda tgt, src: calls.append((tgt.clone(), src.clone())))
    batch = SimpleNamespace(seq_lens=torch.full((1,), 9), out_cache_loc=torch.arange(1, 5))
    plugin._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="eagle_kernels.integrations"):
        spec_utils.move_accept_tokens_to_target_kvcache(batch, torch.tensor([[0, 2, -1]], dtype=torch.int32),
                                                        torch.tensor([1], dtype=torch.int32),
                                                        SimpleNamespace(get_kvcache=lambda: other))
    assert "only MHATokenToKVPool" in caplog.text
    assert calls and calls[0][1][:2].tolist() == [1, 3]  # SGLang's own move ran
