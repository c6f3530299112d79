"""Sampled drafts in the decoder: requests at a temperature draw each expanded node's children
from the head (draft_expand's Gumbel-top-k), the tree keeps every draw (expand_sampled_tree), and
verify accepts them with the draft's probabilities. The tokens must still follow plain sampling
exactly (chi-square on the exact joint of the first three generated tokens, with a planted bug
showing the test's power), and greedy requests still get plain greedy decoding's tokens."""

import pytest
import torch
from scipy import stats

from eagle_kernels import decoder as decoder_module
from eagle_kernels import expansion, reference
from eagle_kernels.decoder import (
    CPU_BATCH_ALL_SAMPLED_TREE,
    CPU_BATCH_SAMPLED_TREE,
    CPU_SAMPLED_TREE,
    SAMPLED_TREE,
    SpeculativeDecoder,
    TreeConfig,
    default_tree,
    sampled_tree,
)
from eagle_kernels.expansion import draft_distribution, expand_sampled_tree, sampled_num_candidates
from eagle_kernels.reference.verify import sampling_probs
from helpers import HEADS, PROMPTS, repeat_head, tiny_hf_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")
from eagle_kernels.models import LlamaModel  # noqa: E402

V, H = 50, 8


class ToyHead:
    """A draft function with state: hidden per frontier node from its parent's and its token."""

    def __init__(self, B, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(1000, H, generator=gen, dtype=torch.float64)
        self.w = torch.randn(H, V, generator=gen, dtype=torch.float64) * 1.5
        self.start = torch.randn(B, 1, H, generator=gen, dtype=torch.float64)
        self.hidden = None
        self.logits = []

    def __call__(self, step, tokens, parent_row, cand_index):
        prev = self.start if step == 0 else torch.gather(self.hidden, 1, parent_row[..., None].expand(-1, -1, H))
        self.hidden = torch.tanh(0.7 * prev + self.emb[tokens % 1000])
        logits = (self.hidden @ self.w).float()
        self.logits.append((cand_index.clone(), logits))
        return logits


@pytest.mark.parametrize("depth,top_k,frontier", [(3, 3, 3), (3, 3, 2), (4, 2, 1)])
def test_expand_sampled_tree_keeps_every_draw(depth, top_k, frontier):
    """Every expanded node keeps all its draws (draft_expand's, at its depth), the frontier is the
    stable top-``frontier`` of the depth's scores, the tree is every candidate in candidate order,
    and draft_probs row u is softmax(logits / T) of node u's draft logits (zeros elsewhere)."""
    B = 3
    temperature = torch.tensor([1.0, 0.7, 0.0])
    seed, offset = torch.tensor([5, 6, 7]), torch.tensor([3, 3, 9])
    d2t = torch.arange(V, dtype=torch.int64) * 2  # draft id x -> target id 3x
    roots = torch.tensor([1, 2, 3])
    head = ToyHead(B)
    got = expand_sampled_tree(head, roots, depth=depth, top_k=top_k, frontier=frontier, temperature=temperature,
                              seed=seed, offset=offset, d2t=d2t)
    C = sampled_num_candidates(depth, top_k, frontier)
    assert got.tree.tokens.shape == (B, C + 1) and got.draft_probs.shape == (B, C + 1, V)
    torch.testing.assert_close(got.tree.tokens, torch.cat([roots[:, None], got.cand_tokens], 1), rtol=0, atol=0)
    expanded = torch.zeros(B, C + 1, dtype=torch.bool)
    start, scores = 0, torch.zeros(B, 1)
    for step, (cand_index, logits) in enumerate(head.logits):
        M = logits.shape[1]
        want = reference.draft_expand(logits, scores, top_k, d2t=d2t, temperature=temperature, seed=seed,
                                      offset=offset, depth=step)
        torch.testing.assert_close(got.cand_tokens[:, start:start + M * top_k], want.tokens, rtol=0, atol=0)
        step_scores = got.cand_scores[:, start:start + M * top_k]  # backends agree to rounding (docs/ops.md §2)
        torch.testing.assert_close(step_scores, want.scores, rtol=1e-6, atol=1e-6)
        parents = got.tree.parents[:, 1 + start:1 + start + M * top_k].long()
        torch.testing.assert_close(parents, (cand_index + 1).repeat_interleave(top_k, 1), rtol=0, atol=0)
        q = torch.softmax((logits - logits.amax(-1, keepdim=True)) / torch.where(
            temperature > 0, temperature, 1.0)[:, None, None], -1)
        rows = torch.gather(got.draft_probs, 1, (cand_index + 1)[..., None].expand(-1, -1, V))
        torch.testing.assert_close(rows, q, rtol=1e-6, atol=1e-7)
        expanded.scatter_(1, cand_index + 1, True)
        order = torch.sort(step_scores, dim=1, descending=True, stable=True).indices[:, :frontier]
        scores = torch.gather(step_scores, 1, order)
        if step + 1 < depth:
            torch.testing.assert_close(head.logits[step + 1][0], order + start, rtol=0, atol=0)
        start += M * top_k
    assert start == C
    assert bool((got.draft_probs[~expanded] == 0).all())


def test_draft_distribution_matches_draft_expand_logprobs():
    """The rows verify gets are the distribution draft_expand drew from (its own logprobs)."""
    logits = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(1)) * 3
    temperature = torch.tensor([0.7, 1.3])
    out = reference.draft_expand(logits, torch.zeros(2, 3), 4, temperature=temperature,
                                 seed=torch.tensor([1, 2]), offset=torch.tensor([0, 0]))
    q = draft_distribution(logits, temperature)
    ids = out.tokens.reshape(2, 3, 4)
    torch.testing.assert_close(torch.gather(q, 2, ids).log().reshape(2, 12), out.logprobs, rtol=1e-5, atol=1e-6)


def test_sampled_tree_config():
    tree = sampled_tree(8, 4, 2)
    assert tree.sampled and tree.frontier_width == 2 and tree.num_nodes == 1 + 4 + 7 * 2 * 4 == 61
    assert SAMPLED_TREE.verify_nodes == TreeConfig().verify_nodes + 1
    assert CPU_SAMPLED_TREE.num_nodes == default_tree("cpu").num_nodes
    assert sampled_tree(3, 3).num_nodes == 1 + 3 + 2 * 9
    with pytest.raises(ValueError, match="frontier"):
        TreeConfig(3, 2, 4, frontier=1)  # a frontier size needs a sampled tree
    with pytest.raises(ValueError, match="frontier"):
        sampled_tree(3, 2, 3)  # more frontier nodes than children of the root
    with pytest.raises(ValueError, match="every candidate"):
        TreeConfig(3, 2, 4, sampled=True)  # a sampled tree must keep every draw
    assert sampled_tree(4, 1, block=True).num_nodes == 5
    for not_a_chain in (dict(sampled=False), dict(top_k=2), dict(lookup=4)):
        with pytest.raises(ValueError, match="block=True"):
            fields = dict(depth=3, top_k=1, num_nodes=4, sampled=True, block=True) | not_a_chain
            fields["num_nodes"] = TreeConfig(**(fields | dict(block=False, sampled=False))).num_candidates + 1
            TreeConfig(**fields)


def test_block_trees_call_block_verify(target32, monkeypatch):
    """A block tree's steps verify through block_verify (a sampled chain), other trees through verify; coupled
    sampling refuses a block tree."""
    from eagle_kernels import ops
    from eagle_kernels.policy import FittedPolicy

    calls = []
    for name in ("verify", "block_verify"):
        original = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    head = HEADS["eagle3-random"](target32)
    SpeculativeDecoder(target32, head, sampled_tree(3, 1, block=True)).generate(PROMPTS, 4, temperature=1.0, seed=1)
    assert "block_verify" in calls
    calls.clear()
    SpeculativeDecoder(target32, head, sampled_tree(3, 1)).generate(PROMPTS, 4, temperature=1.0, seed=1)
    assert "block_verify" not in calls and "verify" in calls
    with pytest.raises(ValueError, match="block=True"):
        SpeculativeDecoder(target32, head, sampled_tree(3, 1, block=True), policy=FittedPolicy(coupled_sampling=True))


@pytest.fixture(scope="module")
def target32():
    return LlamaModel.from_transformers(tiny_hf_model(torch.float32))


def test_default_trees_with_sampled_drafts(target32):
    """Without a tree, a call in which some request samples runs a sampled tree (sampled_drafts
    on by default); greedy calls and sampled_drafts=False keep the deterministic trees."""
    decoder = SpeculativeDecoder(target32, repeat_head(target32))
    assert decoder.generate(PROMPTS[:1], 3, temperature=1.0).tree == CPU_SAMPLED_TREE
    assert decoder.generate(PROMPTS, 3, temperature=0.7, seed=[0, 1, 2]).tree == CPU_BATCH_ALL_SAMPLED_TREE
    assert decoder.generate(PROMPTS, 3, temperature=[0.7, 0.0, 1.0]).tree == CPU_BATCH_SAMPLED_TREE
    assert decoder.generate(PROMPTS[:1], 3).tree == default_tree("cpu")
    off = SpeculativeDecoder(target32, repeat_head(target32), sampled_drafts=False)
    assert off.generate(PROMPTS[:1], 3, temperature=1.0).tree == default_tree("cpu", 1, sampling=True)
    assert default_tree("cuda", 1, sampled_drafts=True) == SAMPLED_TREE


@pytest.mark.parametrize("tree", [sampled_tree(3, 3, 2), sampled_tree(3, 1, lookup=4, lookup_trim=True),
                                  sampled_tree(3, 1, block=True)], ids=["d3k3f2", "chain-lookup", "block"])
@pytest.mark.parametrize("head_name", ["eagle1-repeat", "eagle3-random"])
def test_greedy_requests_in_sampled_trees_equal_plain(target32, tree, head_name):
    """Greedy requests in a sampled tree (alone, or beside sampling requests of the batch) get
    plain greedy decoding's tokens."""
    decoder = SpeculativeDecoder(target32, HEADS[head_name](target32), tree)
    plain = decoder.generate(PROMPTS, 10, speculative=False)
    assert decoder.generate(PROMPTS, 10).sequences == plain.sequences
    mixed = decoder.generate(PROMPTS, 10, temperature=[0.0, 1.0, 0.0], seed=[0, 1, 2])
    assert mixed.sequences[0] == plain.sequences[0] and mixed.sequences[2] == plain.sequences[2]
    assert all(0 <= t < target32.config.vocab_size for t in mixed.sequences[1])


# ------------------------------------------------------------------------------ exactness
PROMPT = [1, 2, 3, 4, 5]
REQUESTS = 2000
P_MIN = 1e-3  # false-alarm rate per test


@pytest.fixture(scope="module")
def target():
    """The tiny float64 Llama with a scaled LM head (peaked distributions, as a trained model's:
    drafts get accepted and rejected alike), as in test_decoder_sampling.py."""
    model = LlamaModel.from_transformers(tiny_hf_model(torch.float64))
    weights = dict(model.weights)
    weights["lm_head.weight"] = weights["lm_head.weight"] * 10
    return LlamaModel(model.config, weights)


def exact_joint(model, temperature, top_k, top_p):
    """The joint distribution of generated tokens 1-3 under plain sampling from the filtered target,
    over the (t1, t2) pairs holding the mass (the rest is below 1e-7 each): ``pairs`` [P, 2] and
    ``probs`` [P, V]."""
    def next_probs(prefixes):
        cache = model.new_cache(prefixes.shape[0], prefixes.shape[1] + 1)
        logits = model(prefixes, cache).logits[:, -1]
        return torch.stack([sampling_probs(row, temperature, top_k, top_p) for row in logits])

    V = model.config.vocab_size
    p1 = next_probs(torch.tensor([PROMPT]))[0]
    p2_given = next_probs(torch.cat([torch.tensor(PROMPT).expand(V, -1), torch.arange(V)[:, None]], 1))
    joint12 = p1[:, None] * p2_given
    pairs = (joint12 > 1e-7).nonzero()
    prefixes = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], 1)
    return pairs, joint12[pairs[:, 0], pairs[:, 1]][:, None] * next_probs(prefixes)


def joint_chi_square_p(sequences, pairs, probs):
    """Chi-square of the observed (t1, t2, t3) triples against the exact joint; cells with an
    expected count below 5 (and triples off the listed pairs) pooled into one cell."""
    V = probs.shape[1]
    index = {(int(a), int(b)): i for i, (a, b) in enumerate(pairs)}
    counts = torch.zeros(probs.numel() + 1, dtype=torch.float64)
    for t1, t2, t3 in sequences:
        i = index.get((t1, t2))
        counts[probs.numel() if i is None else i * V + t3] += 1
    expected = torch.cat([probs.flatten(), (1 - probs.sum()).clamp(min=0)[None]]) * len(sequences)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if bool((obs[exp == 0] > 0).any()):
        return 0.0
    keep = exp > 0
    obs, exp = obs[keep].double().numpy(), exp[keep].double().numpy()
    return float(stats.chisquare(obs, exp / exp.sum() * obs.sum()).pvalue)


CASES = {"t1": (1.0, 0, 1.0), "t0.7-k8-p0.9": (0.7, 8, 0.9)}


def sampled_run(target, case, head_name, tree):
    temperature, top_k, top_p = CASES[case]
    decoder = SpeculativeDecoder(target, HEADS[head_name](target), tree)
    return decoder.generate([PROMPT] * REQUESTS, 3, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=list(range(REQUESTS)))


@pytest.mark.slow
@pytest.mark.parametrize("case,head_name,tree", [
    ("t1", "eagle1-repeat", sampled_tree(3, 3, 2)),
    ("t0.7-k8-p0.9", "eagle3-random", sampled_tree(2, 3, lookup=3)),
    ("t1", "eagle1-repeat", sampled_tree(3, 1, block=True)),
    ("t0.7-k8-p0.9", "eagle3-random", sampled_tree(3, 1, block=True)),
], ids=["t1-eagle1-d3k3f2", "t0.7-k8-p0.9-eagle3-d2k3-lookup", "t1-eagle1-block3", "t0.7-k8-p0.9-eagle3-block3"])
def test_sampled_drafts_follow_the_target(target, case, head_name, tree):
    """The joint of the first three tokens (the 2nd and 3rd come from speculative steps: accepted
    sampled drafts, residual draws, bonus tokens) is plain sampling's. The eagle3 case has a draft
    vocabulary (d2t) and a lookup chain grafted beside the sampled children (deterministic drafts
    in the same verify call)."""
    pairs, probs = exact_joint(target, *CASES[case])
    result = sampled_run(target, case, head_name, tree)
    p = joint_chi_square_p(result.sequences, pairs, probs)
    assert p > P_MIN, f"joint of tokens 1-3: chi-square p = {p:.2e}"
    # The test has power only if drafts were accepted, not just bonus tokens emitted.
    assert sum(result.tau) / REQUESTS > (1.2 if head_name == "eagle1-repeat" else 1.02), result.tau[:10]


@pytest.mark.slow
def test_planted_bug_is_detected(target, monkeypatch):
    """The same check rejects a decoder that gives verify draft rows at a wrong temperature (a
    flatter q than the draws came from: the draft-aware rule then over-accepts drafted tokens)."""
    pairs, probs = exact_joint(target, *CASES["t1"])
    true_distribution = expansion.draft_distribution
    monkeypatch.setattr(expansion, "draft_distribution", lambda logits, t: true_distribution(logits, t * 3))
    result = sampled_run(target, "t1", "eagle1-repeat", sampled_tree(3, 3, 2))
    assert joint_chi_square_p(result.sequences, pairs, probs) < 1e-6
    assert decoder_module.expand_sampled_tree is expand_sampled_tree  # the patched module is the one used


SYNC_METHODS = ["item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"]


@pytest.mark.parametrize("lookup", [0, 3, "block"])
def test_sampled_steps_never_synchronise_and_stay_in_place(target32, lookup, monkeypatch):
    """The static-shape (GPU, CUDA-graph) steps with sampled drafts read no value on the host and
    write only into the state's tensors, as deterministic steps."""
    import eagle_kernels
    from eagle_kernels._schemas import OPS
    from eagle_kernels.policy import StaticPolicy

    missing = [op for op in OPS if eagle_kernels.backend_of(op, "cpu") != "cpp"]
    if missing:
        pytest.skip(f"reference paths read values on the host; no native CPU kernel for {missing}")
    monkeypatch.setenv("EAGLE_KERNELS_CHECK_VALUES", "0")
    tree = sampled_tree(3, 1, block=True) if lookup == "block" else sampled_tree(3, 3, 2, lookup=lookup)
    decoder = SpeculativeDecoder(target32, HEADS["eagle3-random"](target32), tree, sync_every=1000,
                                 policy=StaticPolicy())
    state = decoder._prefill(PROMPTS, tree, 8, torch.tensor([1.0, 0.0, 0.7]), 0, 1.0, torch.tensor([1, 2, 3]),
                             None, True)
    before = {name: (t, t.data_ptr()) for name, t in vars(state).items() if isinstance(t, torch.Tensor)}

    def refuse(*args, **kwargs):
        raise AssertionError("host synchronisation inside a decoding step")

    for _ in range(3):
        with monkeypatch.context() as patch:
            for name in SYNC_METHODS:
                patch.setattr(torch.Tensor, name, refuse)
            decoder._speculative_step(state)
    for name, (tensor, address) in before.items():
        assert getattr(state, name) is tensor and tensor.data_ptr() == address, name
    assert bool((state.out_len > 3).all())  # three steps emitted tokens
