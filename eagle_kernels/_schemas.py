"""Operator schemas of ``torch.ops.eagle_kernels``.

The C++ extension defines the same strings in ``csrc/torch_bindings.cpp``; this copy defines
the library when the extension is not built. ``python_tests/ops/test_registration.py`` keeps the
two identical. ``LAYER_SCHEMAS`` are defined here only.
"""

SCHEMAS = {
    "tree_attention": (
        "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
        "Tensor? tree_mask=None, *, Tensor? block_table=None, float? sm_scale=None) -> Tensor"
    ),
    "draft_expand": (
        "draft_expand(Tensor logits, Tensor frontier_scores, int top_k, *, Tensor? d2t=None, "
        "Tensor? temperature=None, Tensor? seed=None, Tensor? offset=None, int depth=0) "
        "-> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "build_tree": (
        "build_tree(Tensor root_tokens, Tensor cand_tokens, Tensor cand_scores, "
        "Tensor cand_parents, int num_nodes) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "verify": (
        "verify(Tensor tokens, Tensor parents, Tensor target_logits, *, int max_depth, "
        "Tensor? temperature=None, Tensor? top_k=None, Tensor? top_p=None, Tensor? seed=None, "
        "Tensor? offset=None, Tensor? draft_probs=None, Tensor? draft_sampled=None, Tensor? d2t=None, "
        "Tensor? positions=None) "
        "-> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "block_verify": (
        "block_verify(Tensor tokens, Tensor target_logits, Tensor? draft_probs=None, *, Tensor? num_drafts=None, "
        "Tensor? temperature=None, Tensor? top_k=None, Tensor? top_p=None, Tensor? seed=None, Tensor? offset=None, "
        "Tensor? d2t=None) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "coupled_noise": "coupled_noise(Tensor seed, Tensor positions, int num_tokens, *, Tensor? d2t=None) -> Tensor",
    "coupled_draft_logits": (
        "coupled_draft_logits(Tensor logits, Tensor temperature, Tensor seed, Tensor positions, *, "
        "Tensor? d2t=None) -> Tensor"
    ),
    "compact_kv": (
        "compact_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
        "Tensor accept_nodes, Tensor accept_len, *, Tensor? block_table=None) -> ()"
    ),
    "write_kv": (
        "write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k_new, Tensor v_new, "
        "Tensor cache_seqlens, *, Tensor? block_table=None) -> ()"
    ),
    "cpu_linear": "cpu_linear(Tensor x, Tensor weight) -> Tensor",
    "cpu_decoder_layer": (
        "cpu_decoder_layer(Tensor x, Tensor input_norm, Tensor qkv_weight, Tensor o_weight, "
        "Tensor post_norm, Tensor gate_up_weight, Tensor down_weight, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? tree_mask=None, *, "
        "int num_heads, float eps, Tensor? embed=None, Tensor? embed_norm=None, int slot_offset=0, "
        "Tensor? row_counts=None) -> Tensor"
    ),
    "cpu_decoder_layers": (
        "cpu_decoder_layers(Tensor x, Tensor[] input_norm, Tensor[] qkv_weight, Tensor[] o_weight, "
        "Tensor[] post_norm, Tensor[] gate_up_weight, Tensor[] down_weight, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? tree_mask=None, *, "
        "int num_heads, float eps, int[] state_layers=[], Tensor? row_counts=None) -> (Tensor, Tensor)"
    ),
    "cpu_decoder_forward": (
        "cpu_decoder_forward(Tensor tokens, Tensor embed_table, Tensor rope_cos, Tensor rope_sin, Tensor? positions, "
        "Tensor[] input_norm, Tensor[] qkv_weight, Tensor[] o_weight, Tensor[] post_norm, Tensor[] gate_up_weight, "
        "Tensor[] down_weight, Tensor final_norm, Tensor lm_head, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor cache_seqlens, Tensor? tree_mask=None, *, int num_heads, float eps, int[] state_layers=[], "
        "Tensor? row_counts=None, Tensor? logit_rows=None) -> (Tensor, Tensor, Tensor)"
    ),
    "cpu_head_forward": (
        "cpu_head_forward(Tensor tokens, Tensor embed_table, Tensor features, Tensor? fc_weight, Tensor rope_cos, "
        "Tensor rope_sin, Tensor positions, Tensor input_norm, Tensor embed_norm, Tensor qkv_weight, Tensor o_weight, "
        "Tensor post_norm, Tensor gate_up_weight, Tensor down_weight, Tensor? final_norm, Tensor? lm_head, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? tree_mask=None, *, int num_heads, "
        "float eps, int slot_offset=0) -> (Tensor, Tensor)"
    ),
}

OPS = tuple(SCHEMAS)

# The ops of the GPU decoder layer (docs/ops.md §9-11, §17-20): a Triton kernel for CUDA tensors and the
# reference elsewhere; no C++ kernel, so these schemas are defined from Python only (a fragment
# of the same library), with or without the extension.
LAYER_SCHEMAS = {
    "rmsnorm": (
        "rmsnorm(Tensor x, Tensor weight, float eps, *, Tensor? embed=None, Tensor? embed_weight=None) "
        "-> (Tensor, Tensor)"
    ),
    "rope_write_kv": (
        "rope_write_kv(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor cache_seqlens, *, int num_heads, int slot_offset=0) -> Tensor"
    ),
    "silu_mul": "silu_mul(Tensor gate_up) -> Tensor",
    "rmsnorm_linear": (
        "rmsnorm_linear(Tensor x, Tensor weight, Tensor? norm_weight, float eps, *, bool gated=False, "
        "Tensor? add=None) "
        "-> (Tensor, Tensor)"
    ),
    "rmsnorm_qkv_rope": (
        "rmsnorm_qkv_rope(Tensor x, Tensor weight, Tensor? norm_weight, float eps, Tensor positions, Tensor cos, "
        "Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, *, int num_heads, "
        "int slot_offset=0) -> (Tensor, Tensor)"
    ),
    "o_proj_mlp": (
        "o_proj_mlp(Tensor attention, Tensor residual, Tensor o_weight, Tensor norm_weight, Tensor gate_up_weight, "
        "Tensor down_weight, float eps) -> Tensor"
    ),
    "q8_0_linear": "q8_0_linear(Tensor x, Tensor quants, Tensor scales, *, Tensor? residual=None) -> Tensor",
    "fp8_linear": "fp8_linear(Tensor x, Tensor weight, Tensor weight_scale, *, Tensor? residual=None) -> Tensor",
}

LAYER_OPS = tuple(LAYER_SCHEMAS)

# Native CPU helpers of the engine adapters (eagle_kernels/integrations/): SGLang's tree verify
# calls and vLLM's chain rejection sampling with the layout conversion fused around verify
# (csrc/cpu/engine_layout.cpp, which defines them; not public ops: without the extension, and on
# other devices, the adapters run their tensor path).
ENGINE_SCHEMAS = {
    "sglang_build_tree": (
        "sglang_build_tree(Tensor parent_list, Tensor top_scores_index, Tensor seq_lens, Tensor(a!) tree_mask, "
        "Tensor(b!) positions, Tensor(c!) retrieve_index, Tensor(d!) retrieve_next_token, "
        "Tensor(e!) retrieve_next_sibling, int topk, int spec_steps, int num_verify_tokens, int tree_mask_mode) -> ()"
    ),
    "sglang_verify_greedy": (
        "sglang_verify_greedy(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
        "Tensor candidates, Tensor retrieve_index, Tensor retrieve_next_token, Tensor retrieve_next_sibling, "
        "Tensor target_predict) -> ()"
    ),
    "sglang_greedy_verify_inputs": (
        "sglang_greedy_verify_inputs(Tensor candidates, Tensor retrieve_next_token, Tensor retrieve_next_sibling, "
        "Tensor target_predict, int max_depth=-1) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "sglang_tree_sampling": (
        "sglang_tree_sampling(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
        "Tensor candidates, Tensor retrieve_index, Tensor retrieve_next_token, Tensor retrieve_next_sibling, "
        "Tensor uniform_samples, Tensor uniform_samples_for_final_sampling, Tensor target_probs) -> ()"
    ),
    "sglang_tree_sampling_logits": (
        "sglang_tree_sampling_logits(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
        "Tensor candidates, Tensor retrieve_index, Tensor retrieve_next_token, Tensor retrieve_next_sibling, "
        "Tensor uniform_samples, Tensor uniform_samples_for_final_sampling, Tensor logits, Tensor? temperatures=None, "
        "Tensor? top_ks=None, Tensor? top_ps=None) -> ()"
    ),
    "vllm_chains": (
        "vllm_chains(Tensor draft_token_ids, Tensor cu_num_draft_tokens, Tensor target_logits, "
        "Tensor bonus_token_ids, int max_spec_len, Tensor? temperature=None, Tensor? uniform=None) -> Tensor"
    ),
}
ALL_OPS = OPS + LAYER_OPS
