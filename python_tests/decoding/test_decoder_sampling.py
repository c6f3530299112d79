"""Loop-level exactness of speculative sampling: the tokens the whole decoder emits (draft tree,
target verify pass, verify, KV compaction, head commit) follow the target's own filtered
distribution. Many requests with different seeds run as one batch on a tiny float64 Llama; the
empirical distributions of the 2nd and 3rd generated tokens (the first two that decoding steps
produce) are compared with the exact marginals by a chi-square test."""

import pytest
import torch
from scipy import stats

from eagle_kernels.decoder import CPU_SAMPLED_TREE, SpeculativeDecoder, TreeConfig
from eagle_kernels.policy import DraftStats, FittedPolicy
from eagle_kernels.reference.verify import sampling_probs
from helpers import (
    HEADS,
    tiny_hf_model,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")
from eagle_kernels.models import LlamaModel  # noqa: E402

PROMPT = [1, 2, 3, 4, 5]
REQUESTS = 3000
P_MIN = 1e-3  # false-alarm rate per test


@pytest.fixture(scope="module")
def target():
    """The tiny random Llama with its LM head scaled up: its next-token distributions are
    peaked (top-3 mass ~0.6 at T = 1) like a trained model's, so drafts get accepted and the
    test exercises acceptance, rejection and residual sampling alike."""
    model = LlamaModel.from_transformers(tiny_hf_model(torch.float64))
    weights = dict(model.weights)
    weights["lm_head.weight"] = weights["lm_head.weight"] * 10
    return LlamaModel(model.config, weights)


def filtered(logits, temperature, top_k, top_p):
    return torch.stack([sampling_probs(row, temperature, top_k, top_p) for row in logits])


def exact_marginals(model, temperature, top_k, top_p):
    """Distributions of generated tokens 1, 2 and 3 under plain sampling from the filtered target."""
    V = model.config.vocab_size

    def next_probs(prefixes):
        cache = model.new_cache(prefixes.shape[0], prefixes.shape[1] + 1)
        return filtered(model(prefixes, cache).logits[:, -1], temperature, top_k, top_p)

    p1 = next_probs(torch.tensor([PROMPT]))[0]  # [V]
    firsts = torch.arange(V)[:, None]
    p2_given = next_probs(torch.cat([torch.tensor(PROMPT).expand(V, -1), firsts], 1))  # [V, V]
    joint12 = p1[:, None] * p2_given
    p2 = joint12.sum(0)
    # Token 3: condition on the (t1, t2) pairs that carry the mass (the rest is below 1e-7).
    pairs = (joint12 > 1e-7).nonzero()
    prefixes = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], 1)
    p3 = (joint12[pairs[:, 0], pairs[:, 1]][:, None] * next_probs(prefixes)).sum(0)
    return p1, p2, p3 / p3.sum()


def chi_square_p(counts, probs):
    """Chi-square goodness of fit, cells with expected count < 5 pooled into one."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).double()
    keep = exp > 0
    if bool((obs[~keep] > 0).any()):
        return 0.0  # a token with probability zero was emitted
    return float(stats.chisquare(obs[keep], exp[keep] * obs.sum() / exp[keep].sum()).pvalue)


CASES = {"t1": (1.0, 0, 1.0), "t0.7-k8-p0.9": (0.7, 8, 0.9)}


def generate_and_check(target, decoder, case):
    """REQUESTS requests of PROMPT (seeds 0, 1, ...) through ``decoder`` at ``CASES[case]``: generated tokens
    1-3 each pass the chi-square test against the exact marginals. Returns the GenerationResult."""
    temperature, top_k, top_p = CASES[case]
    marginals = exact_marginals(target, temperature, top_k, top_p)
    result = decoder.generate([PROMPT] * REQUESTS, 3, temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=list(range(REQUESTS)))
    tokens = torch.tensor(result.sequences)  # [REQUESTS, 3]
    for position, probs in enumerate(marginals):
        p = chi_square_p(torch.bincount(tokens[:, position], minlength=target.config.vocab_size), probs)
        assert p > P_MIN, f"token {position + 1}: chi-square p = {p:.2e}"
    return result


@pytest.mark.slow
@pytest.mark.parametrize("case,head_name,lookup", [
    ("t1", "eagle1-repeat", 0), ("t0.7-k8-p0.9", "eagle3-random", 0), ("t0.7-k8-p0.9", "eagle1-repeat", 0),
    ("t1", "eagle1-repeat", 3), ("t1", None, 4), ("t1", "eagle1-repeat", "trim")])
def test_speculative_sampling_follows_the_target(target, case, head_name, lookup):
    """``lookup`` grafts a prompt-lookup chain onto the tree; head None: the chain alone. This
    prompt has no repeats for the lookup to find, so its chains are filler that verify must
    reject without bias (often a repeat of a sibling's token, rejected after the sibling).
    "trim": an 8-token chain trimmed each step by the batch's longest match (the CPU default's
    rule), so the verify tree changes size from step to step."""
    head = HEADS[head_name](target) if head_name else None
    tree = TreeConfig(3, 3, 8, lookup=8, lookup_trim=True) if lookup == "trim" else TreeConfig(3, 3, 8, lookup=lookup)
    result = generate_and_check(target, SpeculativeDecoder(target, head, tree), case)
    # The test has power: the steps must have accepted drafts, not only emitted bonus tokens.
    assert sum(result.tau) / REQUESTS > 1.2 or head_name != "eagle1-repeat", result.tau[:10]


class OutcomeStats(DraftStats):
    """The next step's shape chosen by the tokens the last step emitted (its draws): a choice that depends on
    what was sampled, as a wall-time choice may."""

    def choose(self) -> int:
        return self.last_tokens % len(self.shapes) if self.steps else len(self.shapes) - 1

    def record(self, index, tokens, seconds):
        super().record(index, tokens, seconds)
        self.last_tokens = int(tokens)


class OutcomePolicy(FittedPolicy):
    def __init__(self):
        super().__init__(adaptive=True, adaptive_sampling=True)

    def draft_stats(self, tree, head=True):
        return {match: OutcomeStats(stats.shapes) for match, stats in super().draft_stats(tree, head).items()}


@pytest.mark.slow
@pytest.mark.parametrize("tree", [TreeConfig(3, 3, 8, lookup=4), CPU_SAMPLED_TREE], ids=["d3k3n8-chain", "cpu-sampled"])
def test_adaptive_sampling_follows_the_target(target, tree):
    """FittedPolicy(adaptive_sampling=True) with a shape chosen from the last step's draws (every shape of the
    ladder, the plain step included): generated tokens 1-3 still follow the target's filtered distribution."""
    decoder = SpeculativeDecoder(target, HEADS["eagle1-repeat"](target), tree, policy=OutcomePolicy())
    generate_and_check(target, decoder, "t0.7-k8-p0.9")
    runs = [sum(s.runs) for stats in decoder._draft_stats.values() for s in stats.values()]
    assert sum(runs) >= 2, runs  # the steps went through the policy


@pytest.mark.slow
def test_chi_square_detects_a_biased_sampler(target):
    """The same statistic on tokens drawn from the *unfiltered* distribution rejects, so the
    test above can fail."""
    temperature, top_k, top_p = CASES["t0.7-k8-p0.9"]
    _, p2, _ = exact_marginals(target, temperature, top_k, top_p)
    _, wrong, _ = exact_marginals(target, 1.0, 0, 1.0)
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(wrong, REQUESTS, replacement=True, generator=g)
    counts = torch.bincount(draws, minlength=target.config.vocab_size)
    assert chi_square_p(counts, p2) < 1e-6
