// Torch-facing entry points of csrc/, registered in csrc/torch_bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace eagle {

using TreeTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// (tokens, scores, frontier, logprobs)
using DraftCandidateTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

DraftCandidateTensors draft_expand_cpu(const at::Tensor& logits, const at::Tensor& frontier_scores, int64_t top_k,
                                       const std::optional<at::Tensor>& d2t,
                                       const std::optional<at::Tensor>& temperature,
                                       const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                                       int64_t depth);

TreeTensors build_tree_cpu(const at::Tensor& root_tokens, const at::Tensor& cand_tokens, const at::Tensor& cand_scores,
                           const at::Tensor& cand_parents, int64_t num_nodes);

void compact_kv_cpu(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                    const at::Tensor& accept_nodes, const at::Tensor& accept_len,
                    const std::optional<at::Tensor>& block_table);

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& tree_mask,
                              const std::optional<at::Tensor>& block_table, std::optional<double> sm_scale);

void write_kv_cpu(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_new,
                  const at::Tensor& v_new, const at::Tensor& cache_seqlens,
                  const std::optional<at::Tensor>& block_table);
// write_kv_cpu whose errors name `op` (the decoder layer ops write their caches through it).
void write_kv_named(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_new,
                    const at::Tensor& v_new, const at::Tensor& cache_seqlens,
                    const std::optional<at::Tensor>& block_table);

// out [..., N] fp32 = x [..., K] fp32 @ weight [N, K] (fp32 or bf16)^T, fp32 accumulation.
at::Tensor cpu_linear_cpu(const at::Tensor& x, const at::Tensor& weight);

// One Llama decoder layer on few rows (decoding, verification, EAGLE-3 drafting): returns the
// layer's output [B, N, H] fp32 and writes the new tokens' K/V at cache_seqlens + slot_offset + i
// (contiguous cache). row_counts int64 [B] (optional): rows past a request's count are padding,
// not computed (they keep x and write zero K/V).
at::Tensor cpu_decoder_layer_cpu(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& qkv_weight,
                                 const at::Tensor& o_weight, const at::Tensor& post_norm,
                                 const at::Tensor& gate_up_weight, const at::Tensor& down_weight, const at::Tensor& cos,
                                 const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& tree_mask,
                                 int64_t num_heads, double eps, const std::optional<at::Tensor>& embed,
                                 const std::optional<at::Tensor>& embed_norm, int64_t slot_offset,
                                 const std::optional<at::Tensor>& row_counts);
// cpu_decoder_layer over the L layers of a [L, B, S, Hkv, D] cache in one call; returns the last layer's output and
// the outputs of the layers in state_layers, stacked [len(state_layers), B, N, H].
std::tuple<at::Tensor, at::Tensor> cpu_decoder_layers_cpu(
    const at::Tensor& x, at::TensorList input_norm, at::TensorList qkv_weight, at::TensorList o_weight,
    at::TensorList post_norm, at::TensorList gate_up_weight, at::TensorList down_weight, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& tree_mask, int64_t num_heads, double eps, at::IntArrayRef state_layers,
    const std::optional<at::Tensor>& row_counts);
// A Llama target's forward pass in one call (docs/ops.md §13): embedding, RoPE rows from [P, D / 2] tables,
// cpu_decoder_layers, the final RMSNorm and the LM head; returns (logits, hidden, states).
std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_decoder_forward_cpu(
    const at::Tensor& tokens, const at::Tensor& embed_table, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
    const std::optional<at::Tensor>& positions, at::TensorList input_norm, at::TensorList qkv_weight,
    at::TensorList o_weight, at::TensorList post_norm, at::TensorList gate_up_weight, at::TensorList down_weight,
    const at::Tensor& final_norm, const at::Tensor& lm_head, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& tree_mask, int64_t num_heads, double eps,
    at::IntArrayRef state_layers, const std::optional<at::Tensor>& row_counts,
    const std::optional<at::Tensor>& logit_rows);
// An EAGLE-3 draft head's pass in one call (docs/ops.md §14): the embedding, fc over the features, RoPE rows from
// [P, D / 2] tables, the head's decoder layer and, with final_norm and lm_head, its draft logits; returns
// (logits, hidden).
std::tuple<at::Tensor, at::Tensor> cpu_head_forward_cpu(
    const at::Tensor& tokens, const at::Tensor& embed_table, const at::Tensor& features,
    const std::optional<at::Tensor>& fc_weight, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
    const at::Tensor& positions, const at::Tensor& input_norm, const at::Tensor& embed_norm,
    const at::Tensor& qkv_weight, const at::Tensor& o_weight, const at::Tensor& post_norm,
    const at::Tensor& gate_up_weight, const at::Tensor& down_weight, const std::optional<at::Tensor>& final_norm,
    const std::optional<at::Tensor>& lm_head, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& tree_mask, int64_t num_heads, double eps,
    int64_t slot_offset);

// (accept_len, accept_nodes, out_tokens, status)
using VerifyTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

at::Tensor coupled_noise_cpu(const at::Tensor& seed, const at::Tensor& positions, int64_t num_tokens,
                             const std::optional<at::Tensor>& d2t);
at::Tensor coupled_draft_logits_cpu(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& seed,
                                    const at::Tensor& positions, const std::optional<at::Tensor>& d2t);

VerifyTensors verify_cpu(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& target_logits,
                         int64_t max_depth, const std::optional<at::Tensor>& temperature,
                         const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                         const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                         const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& draft_sampled,
                         const std::optional<at::Tensor>& d2t, const std::optional<at::Tensor>& positions);

VerifyTensors block_verify_cpu(const at::Tensor& tokens, const at::Tensor& target_logits,
                               const std::optional<at::Tensor>& draft_probs,
                               const std::optional<at::Tensor>& num_drafts,
                               const std::optional<at::Tensor>& temperature, const std::optional<at::Tensor>& top_k,
                               const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& seed,
                               const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& d2t);

#ifdef EAGLE_WITH_CUDA
TreeTensors build_tree_cuda(const at::Tensor& root_tokens, const at::Tensor& cand_tokens, const at::Tensor& cand_scores,
                            const at::Tensor& cand_parents, int64_t num_nodes);

void compact_kv_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                     const at::Tensor& accept_nodes, const at::Tensor& accept_len,
                     const std::optional<at::Tensor>& block_table);
#endif

}  // namespace eagle
