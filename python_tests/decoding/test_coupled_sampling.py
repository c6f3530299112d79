"""Coupled sampling in the decoder (FittedPolicy(coupled_sampling=True), docs/decoding.md): every
token of a sampling request is the exponential race of the target's filtered distribution under
noise keyed by (seed, position, token), so

- speculative decoding emits, token for token, what plain decoding emits with the same seeds,
  whatever the head, the tree, the lookup chain, the adaptive shapes or the batch (the property
  greedy decoding has, now at any temperature), and greedy requests in the batch are unchanged;
- the tokens follow the target's filtered distribution (chi-square on the tiny model of
  test_decoder_sampling, slow).
"""

import pytest
import torch
from test_decoder_sampling import PROMPT, REQUESTS, generate_and_check, target  # noqa: F401

from eagle_kernels import ops
from eagle_kernels.decoder import SpeculativeDecoder, TreeConfig, default_tree
from eagle_kernels.policy import FittedPolicy, StaticPolicy
from helpers import HEADS

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [PROMPT, [7, 8, 9, 7, 8, 9, 7, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
SAMPLING = dict(temperature=[1.0, 0.0, 0.7], top_k=[0, 0, 8], top_p=[1.0, 1.0, 0.9], seed=[11, 12, 13])


@pytest.mark.parametrize("head_name,tree", [
    ("eagle1-repeat", TreeConfig(3, 3, 8)), ("eagle3-random", TreeConfig(3, 3, 8, lookup=4)),
    ("eagle1-repeat", TreeConfig(4, 2, 8, lookup=8, lookup_trim=True)), (None, TreeConfig(1, 1, 1, lookup=4)),
    ("eagle3-random", None)], ids=["eagle1", "eagle3-chain", "eagle1-trim", "chain-alone", "eagle3-default"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_speculative_emits_plain_decoding_tokens(target, head_name, tree, adaptive):  # noqa: F811
    head = HEADS[head_name](target) if head_name else None
    policy = FittedPolicy(adaptive=adaptive, coupled_sampling=True)
    decoder = SpeculativeDecoder(target, head, tree, policy=policy)
    speculative = decoder.generate(PROMPTS, 10, **SAMPLING)
    plain = decoder.generate(PROMPTS, 10, speculative=False, **SAMPLING)
    assert speculative.sequences == plain.sequences
    assert head is None or sum(speculative.tau) > len(PROMPTS), speculative.tau  # drafts were accepted
    # A request's tokens do not depend on the batch around it.
    alone = decoder.generate(PROMPTS[2:], 10, **{name: values[2:] for name, values in SAMPLING.items()})
    assert alone.sequences[0] == speculative.sequences[2]
    # The greedy request is greedy decoding's, and the call drafts the greedy calls' tree.
    greedy = SpeculativeDecoder(target, head, tree).generate(PROMPTS[1:2], 10)
    assert speculative.sequences[1] == greedy.sequences[0]
    assert speculative.tree == (tree or default_tree(target.device, len(PROMPTS)))


def test_a_seed_is_a_stream_of_its_own(target):  # noqa: F811
    """Different seeds give different tokens; the same seed the same ones on every call."""
    decoder = SpeculativeDecoder(target, HEADS["eagle1-repeat"](target), TreeConfig(3, 3, 8),
                                 policy=FittedPolicy(coupled_sampling=True))
    runs = [decoder.generate([PROMPT] * 4, 8, temperature=1.0, seed=[0, 1, 2, 0]).sequences for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][0] == runs[0][3]
    assert len({tuple(s) for s in runs[0]}) == 3


def test_draft_logits_race_with_the_target_noise():
    """A sampling request's draft row is its log-probabilities at its temperature plus the noise of
    its children's position; a greedy request's row is kept."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=gen)
    temperature = torch.tensor([0.5, 0.0])
    noise = ops.coupled_noise(torch.tensor([4, 5]), torch.tensor([[10, 11], [20, 21]]), 11)
    got = ops.coupled_draft_logits(logits, temperature, torch.tensor([4, 5]), torch.tensor([11, 21]))
    torch.testing.assert_close(got[0], torch.log_softmax(logits[0] / 0.5, -1) + noise[0, 1])
    assert torch.equal(got[1], logits[1])


@pytest.mark.slow
@pytest.mark.parametrize("case,head_name,lookup", [("t1", "eagle1-repeat", 0), ("t0.7-k8-p0.9", "eagle3-random", 3)])
def test_coupled_sampling_follows_the_target(target, case, head_name, lookup):  # noqa: F811
    decoder = SpeculativeDecoder(target, HEADS[head_name](target), TreeConfig(3, 3, 8, lookup=lookup),
                                 policy=FittedPolicy(coupled_sampling=True))
    result = generate_and_check(target, decoder, case)
    assert sum(result.tau) / REQUESTS > 1.2 or head_name != "eagle1-repeat", result.tau[:10]


def test_static_policy_gives_the_fitted_policys_tokens(target):  # noqa: F811
    """StaticPolicy(coupled_sampling=True), the GPU steps' policy (no host read in a step), run here on
    the CPU: the tokens of the fitted policy and of plain decoding, greedy request included."""
    head = HEADS["eagle3-random"](target)
    tree = TreeConfig(3, 3, 8, lookup=4)
    static = SpeculativeDecoder(target, head, tree, policy=StaticPolicy(coupled_sampling=True))
    fitted = SpeculativeDecoder(target, head, tree, policy=FittedPolicy(coupled_sampling=True))
    want = fitted.generate(PROMPTS, 10, speculative=False, **SAMPLING).sequences
    assert static.generate(PROMPTS, 10, **SAMPLING).sequences == want
    assert fitted.generate(PROMPTS, 10, **SAMPLING).sequences == want
