"""The adaptive fitted policy (CPU default): the draft-shape ladder, the choice logic of DraftStats on synthetic
acceptance and cost sequences, and exactness of greedy decoding whatever shapes the steps draft."""

import random

import pytest
import torch

from eagle_kernels.decoder import CPU_BATCH_TREE, CPU_SAMPLED_TREE, CPU_TREE, SpeculativeDecoder, TreeConfig
from eagle_kernels.models import LlamaModel
from eagle_kernels.policy import (
    FULL_MATCH,
    NO_MATCH,
    PARTIAL_MATCH,
    DraftStats,
    FittedPolicy,
    StaticPolicy,
    draft_ladder,
    match_context,
    policy_for,
)
from helpers import HEADS, PROMPTS, repeat_head, tiny_hf_model

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    return LlamaModel.from_transformers(tiny_hf_model(torch.float64))


# ------------------------------------------------------------------------------ ladder
@pytest.mark.parametrize("tree", [CPU_TREE, CPU_BATCH_TREE, CPU_SAMPLED_TREE, TreeConfig(4, 2, 7)],
                         ids=["cpu", "cpu-batch", "cpu-sampled", "no-chain"])
def test_ladder_shapes_fit_the_tree(tree):
    for match in (NO_MATCH, PARTIAL_MATCH, FULL_MATCH):
        shapes = draft_ladder(tree, match)
        assert shapes[0] is None and shapes[-1] == tree and len(set(shapes)) == len(shapes)
        for shape in shapes[1:]:
            assert shape.depth <= tree.depth and shape.top_k <= tree.top_k and shape.lookup <= tree.lookup
            assert shape.verify_nodes <= tree.verify_nodes and shape.sampled == tree.sampled
    one = TreeConfig(1, 1, 2, lookup_ngram=4)
    assert draft_ladder(CPU_TREE) == (None, one, TreeConfig(1, 1, 2, lookup=8, lookup_ngram=4, lookup_trim=True,
                                                            lookup_alone=True), CPU_TREE)
    # After a full match a lookup_alone tree verifies its chain alone, and without a match the trimmed chain is
    # empty: the chained draft would be the same step as another.
    assert draft_ladder(CPU_TREE, FULL_MATCH) == draft_ladder(CPU_TREE, NO_MATCH) == (None, one, CPU_TREE)
    untrimmed = TreeConfig(3, 2, 4, lookup=4)
    assert len(draft_ladder(untrimmed, NO_MATCH)) == len(draft_ladder(untrimmed, FULL_MATCH)) == 4
    assert draft_ladder(CPU_TREE, head=False) == (None, CPU_TREE)


def test_policies_and_stats():
    assert policy_for("cpu").adaptive and not FittedPolicy().adaptive
    assert StaticPolicy().draft_stats(CPU_TREE) is None and FittedPolicy().draft_stats(CPU_TREE) is None
    stats = FittedPolicy(adaptive=True).draft_stats(CPU_TREE)
    assert set(stats) == {NO_MATCH, PARTIAL_MATCH, FULL_MATCH} and stats[PARTIAL_MATCH].shapes == draft_ladder(CPU_TREE)
    assert set(FittedPolicy(adaptive=True).draft_stats(TreeConfig(3, 2, 4))) == {NO_MATCH}
    matched = torch.tensor([4, 5])
    assert match_context(CPU_TREE, matched) == FULL_MATCH and match_context(CPU_TREE, None) == NO_MATCH
    assert match_context(CPU_TREE, torch.tensor([0, 0])) == NO_MATCH
    assert match_context(CPU_TREE, torch.tensor([0, 4])) == match_context(CPU_TREE, torch.tensor([2])) == PARTIAL_MATCH
    for bad in (dict(shapes=()), dict(shapes=(None,), alpha=0.0), dict(shapes=(None,), probe_every=1)):
        with pytest.raises(ValueError):
            DraftStats(**bad)


# ------------------------------------------------------------------------------ choice logic
def simulate(stats, tokens_of, seconds_of, steps, seed=0):
    """Run ``steps`` steps: ``tokens_of(step, index)`` / ``seconds_of(index)`` are the synthetic acceptance and
    cost of a shape (noisy: +-10% on the time); returns the chosen indices."""
    rng = random.Random(seed)
    chosen = []
    for step in range(steps):
        index = stats.choose()
        stats.record(index, tokens_of(step, index), seconds_of(index) * rng.uniform(0.9, 1.1))
        chosen.append(index)
    return chosen


SHAPES = (None, "one", "chained", "tree")
COST = [1.0, 1.15, 1.4, 1.9]  # a plain step's time, one more row and head pass, a chain, the tree's rows


def test_new_shapes_run_first_largest_first():
    stats = DraftStats(SHAPES)
    assert simulate(stats, lambda step, i: 1.0, COST.__getitem__, 8) == [3, 3, 2, 2, 1, 1, 0, 0]


def test_low_acceptance_settles_on_no_draft_and_high_on_the_tree():
    """Nothing accepted: a draft only costs, the steps draft nothing but the probes; everything accepted: the
    tree's many tokens pay its rows."""
    low = simulate(DraftStats(SHAPES), lambda step, i: 1.0, COST.__getitem__, 200)
    assert low[8:].count(0) >= 0.85 * len(low[8:])
    assert all(i in (0, 1) for i in low[8:])  # the probes try the next shape only
    tokens = [1.0, 1.9, 2.5, 4.0]
    high = simulate(DraftStats(SHAPES), lambda step, i: tokens[i], COST.__getitem__, 200)
    assert high[8:].count(3) >= 0.85 * len(high[8:])


def test_probes_find_the_draft_again_when_acceptance_returns():
    """Chat then code then chat: the choice follows the phase within a few probes."""
    def tokens_of(step, i):
        code = 100 <= step < 200
        return [1.0, 1.9, 3.2, 5.0][i] if code else [1.0, 1.05, 1.05, 1.1][i]

    chosen = simulate(DraftStats(SHAPES), tokens_of, COST.__getitem__, 300)
    chat, code, chat_again = chosen[20:100], chosen[150:200], chosen[250:]
    assert chat.count(0) >= 0.8 * len(chat)
    assert code.count(3) >= 0.8 * len(code), code
    # The larger shapes' token averages are still the code phase's until their next steps: each
    # wins a step now and then until they have come down.
    assert chat_again.count(0) >= 0.7 * len(chat_again), chat_again


def test_a_cheaper_shape_wins_when_costs_change():
    """The same acceptance, the tree's rows dearer (a busier machine, more threads): the choice moves down."""
    tokens = [1.0, 1.6, 1.8, 2.4]
    costs = {"cheap": [1.0, 1.1, 1.2, 1.5], "dear": [1.0, 1.1, 1.5, 3.0]}
    phase = ["cheap"]
    stats = DraftStats(SHAPES)
    first = simulate(stats, lambda step, i: tokens[i], lambda i: costs[phase[0]][i], 100)
    phase[0] = "dear"
    second = simulate(stats, lambda step, i: tokens[i], lambda i: costs[phase[0]][i], 100, seed=1)
    assert first[20:].count(3) >= 0.8 * len(first[20:])
    assert second[40:].count(1) >= 0.8 * len(second[40:]), second


# ------------------------------------------------------------------------------ exactness
class CyclingStats(DraftStats):
    """Every shape of the ladder in turn (to reach each one on a tiny model, whatever the timings)."""

    def choose(self) -> int:
        return self.steps % len(self.shapes)


class CyclingPolicy(FittedPolicy):
    def __init__(self, adaptive_sampling=False, defer_head=True, stats=None):
        super().__init__(adaptive=True, adaptive_sampling=adaptive_sampling, defer_head=defer_head)
        self.made, self.stats = [], stats or CyclingStats

    def draft_stats(self, tree, head=True):
        made = {full: self.stats(stats.shapes) for full, stats in super().draft_stats(tree, head).items()}
        self.made.append(made)
        return made


class NoDraftRunsStats(DraftStats):
    """No draft for three steps in every four, then the tree: waiting head commits of up to three pairs."""

    def choose(self) -> int:
        return len(self.shapes) - 1 if self.steps % 4 == 3 else 0


@pytest.mark.parametrize("make_head", [repeat_head, HEADS["eagle3-random"]], ids=["eagle1-repeat", "eagle3-random"])
def test_deferred_head_commits_draft_as_per_step_commits(target, make_head):
    """``defer_head``: after no-draft steps the head drafts from the outputs the per-step commits give (the root
    hidden state of every unfinished request at every drafting step, to float64 rounding), and greedy tokens are
    plain decoding's."""
    head = make_head(target)
    roots, plain = {}, None
    for defer in (True, False):
        decoder = SpeculativeDecoder(target, head, CPU_TREE, policy=CyclingPolicy(defer_head=defer,
                                                                                  stats=NoDraftRunsStats))
        plain = plain or decoder.generate(PROMPTS, 20, speculative=False)
        seen = roots[defer] = []
        real_expand = decoder._expand

        def expand(state, shape, positions, real_expand=real_expand, seen=seen):
            assert state.pending_tokens is None  # committed before drafting
            seen.append((state.root_hidden.clone(), ~state.done))
            return real_expand(state, shape, positions)

        decoder._expand = expand
        assert decoder.generate(PROMPTS, 20).sequences == plain.sequences
    assert len(roots[True]) == len(roots[False]) >= 3
    for (deferred, active), (committed, _) in zip(roots[True], roots[False]):
        assert active.any()
        torch.testing.assert_close(deferred[active], committed[active], rtol=1e-9, atol=1e-9)  # finished: unused


@pytest.mark.parametrize("tree", [CPU_TREE, TreeConfig(3, 3, 8, lookup=4), CPU_BATCH_TREE, CPU_SAMPLED_TREE],
                         ids=["cpu", "d3k3n8-chain", "cpu-batch", "cpu-sampled"])
@pytest.mark.parametrize("make_head", [repeat_head, HEADS["eagle3-random"], None],
                         ids=["eagle1-repeat", "eagle3-random", "lookup-only"])
def test_greedy_equals_plain_whatever_the_shapes(target, make_head, tree):
    head = make_head(target) if make_head else None
    policy = CyclingPolicy()
    decoder = SpeculativeDecoder(target, head, tree, policy=policy)
    plain = decoder.generate(PROMPTS, 16, speculative=False)
    spec = decoder.generate(PROMPTS, 16)
    assert spec.sequences == plain.sequences
    (made,) = policy.made
    runs = [sum(stats.runs[i] for stats in made.values() if i < len(stats.shapes)) for i in range(4)]
    assert all(runs[: max(len(stats.shapes) for stats in made.values())]), runs  # every shape ran
    # The default (adaptive) policy by measured rates: the same tokens, one batch or one request.
    adaptive = SpeculativeDecoder(target, head, tree)
    assert adaptive.generate(PROMPTS, 16).sequences == plain.sequences
    assert adaptive.generate(PROMPTS[:1], 16).sequences == plain.sequences[:1]
    assert sum(sum(s.runs) for stats in adaptive._draft_stats.values() for s in stats.values()) > 0


def test_sampling_calls_keep_the_tree(target):
    """A call that samples drafts the tree at every step: a seed gives the same tokens on every run."""
    decoder = SpeculativeDecoder(target, repeat_head(target), TreeConfig(3, 3, 8, lookup=4))
    sampled = dict(temperature=[0.0, 1.0, 0.7], seed=[1, 2, 3])
    first = decoder.generate(PROMPTS, 12, **sampled)
    assert not decoder._draft_stats
    assert decoder.generate(PROMPTS, 12, **sampled).sequences == first.sequences
    decoder.generate(PROMPTS, 12)
    assert decoder._draft_stats
    decoder.release()
    assert not decoder._draft_stats


@pytest.mark.parametrize("tree", [TreeConfig(3, 3, 8, lookup=4), CPU_SAMPLED_TREE], ids=["d3k3n8-chain", "cpu-sampled"])
def test_adaptive_sampling_adapts_sampled_calls(target, tree):
    """``FittedPolicy(adaptive_sampling=True)``: a call that samples keeps statistics of its own (not the greedy
    calls'), every shape of the ladder runs, and greedy requests of the same batch still get plain decoding's
    tokens."""
    policy = CyclingPolicy(adaptive_sampling=True)
    decoder = SpeculativeDecoder(target, repeat_head(target), tree, policy=policy)
    plain = decoder.generate(PROMPTS, 12, speculative=False)
    sampled = decoder.generate(PROMPTS, 12, temperature=[0.0, 1.0, 0.7], seed=[1, 2, 3])
    assert sampled.sequences[0] == plain.sequences[0]
    assert [key[2] for key in decoder._draft_stats] == ["sampled"]  # a sampled call's own statistics
    (made,) = policy.made
    assert all(all(stats.runs) for stats in made.values() if stats.steps >= len(stats.shapes)), made
    decoder.generate(PROMPTS, 12)
    assert sorted(key[2] for key in decoder._draft_stats) == ["greedy", "sampled"]
