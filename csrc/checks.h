// Argument checks shared by the CPU and CUDA launchers of csrc/.
//
// Every failure raises c10::ValueError (Python ValueError) through TORCH_CHECK_VALUE, naming
// the op and the tensor and giving expected vs got, the same way eagle_kernels/_checks.py does
// for the Python paths. Only metadata is read here; value checks that read tensor data live in
// the CPU launchers (the CUDA path must stay sync-free).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <optional>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "core/compact_kv.h"

namespace eagle {

inline std::string shape_str(c10::IntArrayRef sizes) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  os << "]";
  return os.str();
}

inline void check_dtype(const at::Tensor& t, const char* op, const char* name, at::ScalarType expected) {
  TORCH_CHECK_VALUE(t.scalar_type() == expected, op, ": ", name, ": expected dtype ", expected, ", got ",
                    t.scalar_type());
}

inline void check_dim(const at::Tensor& t, const char* op, const char* name, int64_t expected, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == expected, op, ": ", name, ": expected ", expected, "-D ", layout, ", got ", t.dim(),
                    "-D shape ", shape_str(t.sizes()));
}

inline void check_shape(const at::Tensor& t, const char* op, const char* name, const std::vector<int64_t>& expected,
                        const char* layout) {
  TORCH_CHECK_VALUE(t.sizes() == c10::IntArrayRef(expected), op, ": ", name, ": expected shape ", layout, " = ",
                    shape_str(expected), ", got ", shape_str(t.sizes()));
}

inline void check_device(const at::Tensor& t, const char* op, const char* name, const at::Device& expected) {
  TORCH_CHECK_VALUE(t.device() == expected, op, ": ", name, ": expected device ", expected,
                    " (like the other inputs), got ", t.device());
}

// The float dtypes every op that reads activations or logits accepts.
inline void check_float_dtype(const at::Tensor& t, const char* op, const char* name) {
  const at::ScalarType dt = t.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kDouble, op, ": ", name,
                    ": expected dtype float32, float16, bfloat16 or float64, got ", dt);
}

// Sampling temperatures t[0..B): finite and >= 0 (0 is a greedy request).
inline void check_temperature_values(const float* t, int64_t B, const char* op) {
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(std::isfinite(t[b]) && t[b] >= 0.0f, op, ": temperature: expected finite values >= 0, got ", t[b],
                      " at ", b);
  }
}

// The dtypes of a weight matrix or a K/V cache that the fp32-compute CPU kernels widen as they read.
inline void check_32_or_16_bit_float(const at::Tensor& t, const char* op, const char* name) {
  const at::ScalarType dt = t.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op, ": ", name,
                    ": expected dtype float32, bfloat16 or float16, got ", dt);
}

// Checks shared by every op that takes a K/V cache, in the order eagle_kernels/_checks.py runs
// them: v_cache like k_cache, cache_seqlens int32 [B], then the block table (paged) or the
// batch dim of k_cache at `batch_dim` (contiguous). Returns max_pages (0 when contiguous).
inline int64_t check_kv_cache_args(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
                                   int64_t B, int64_t batch_dim, const char* layout, at::Device dev) {
  TORCH_CHECK_VALUE(v_cache.scalar_type() == k_cache.scalar_type(), op, ": v_cache: expected the dtype of k_cache ",
                    k_cache.scalar_type(), ", got ", v_cache.scalar_type());
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), op, ": v_cache: expected the shape of k_cache ",
                    shape_str(k_cache.sizes()), ", got ", shape_str(v_cache.sizes()));
  check_device(v_cache, op, "v_cache", dev);
  check_dtype(cache_seqlens, op, "cache_seqlens", at::kInt);
  check_shape(cache_seqlens, op, "cache_seqlens", {B}, "[B]");
  check_device(cache_seqlens, op, "cache_seqlens", dev);
  if (!block_table.has_value()) {
    TORCH_CHECK_VALUE(k_cache.size(batch_dim) == B, op, ": k_cache: expected batch dim ", B, " in ", layout,
                      ", got shape ", shape_str(k_cache.sizes()));
    return 0;
  }
  check_dtype(*block_table, op, "block_table", at::kInt);
  check_dim(*block_table, op, "block_table", 2, "[B, max_pages]");
  check_device(*block_table, op, "block_table", dev);
  const int64_t max_pages = block_table->size(1);
  check_shape(*block_table, op, "block_table", {B, max_pages}, "[B, max_pages]");
  return max_pages;
}

// The kernels address a head's row as D consecutive elements.
inline void check_dense_head_dim(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const int64_t D = k_cache.size(-1);
  TORCH_CHECK_VALUE(k_cache.stride(-1) == 1 || D <= 1, op, ": k_cache: expected a dense last (head) dim, got strides ",
                    shape_str(k_cache.strides()));
  TORCH_CHECK_VALUE(v_cache.stride(-1) == 1 || D <= 1, op, ": v_cache: expected a dense last (head) dim, got strides ",
                    shape_str(v_cache.strides()));
}

// ---------------------------------------------------------------------------------------------
// build_tree

struct BuildTreeDims {
  int64_t B, C, N;
};

inline BuildTreeDims check_build_tree_args(const at::Tensor& root_tokens, const at::Tensor& cand_tokens,
                                           const at::Tensor& cand_scores, const at::Tensor& cand_parents,
                                           int64_t num_nodes) {
  // Same order as eagle_kernels/_checks.py, so both name the same tensor: B and C come from
  // cand_tokens.
  const char* op = "build_tree";
  const at::Device dev = cand_tokens.device();
  check_dtype(cand_tokens, op, "cand_tokens", at::kLong);
  check_dim(cand_tokens, op, "cand_tokens", 2, "[B, C]");
  const int64_t B = cand_tokens.size(0);
  const int64_t C = cand_tokens.size(1);
  check_dtype(root_tokens, op, "root_tokens", at::kLong);
  check_shape(root_tokens, op, "root_tokens", {B}, "[B]");
  check_device(root_tokens, op, "root_tokens", dev);
  check_dtype(cand_scores, op, "cand_scores", at::kFloat);
  check_shape(cand_scores, op, "cand_scores", {B, C}, "[B, C]");
  check_device(cand_scores, op, "cand_scores", dev);
  check_dtype(cand_parents, op, "cand_parents", at::kInt);
  check_shape(cand_parents, op, "cand_parents", {B, C}, "[B, C]");
  check_device(cand_parents, op, "cand_parents", dev);
  TORCH_CHECK_VALUE(num_nodes >= 1, op, ": num_nodes: expected >= 1 (the root), got ", num_nodes);
  TORCH_CHECK_VALUE(num_nodes - 1 <= C, op, ": num_nodes: expected num_nodes - 1 <= C = ", C,
                    " (number of candidates), got num_nodes = ", num_nodes);
  return {B, C, num_nodes};
}

// ---------------------------------------------------------------------------------------------
// compact_kv

// Checks metadata and fills the raw-pointer parameters of the core. `accept_nodes` and
// `block_table` must already be the dense tensors the kernel will read.
inline compact_kv::Params check_compact_kv_args(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                const at::Tensor& cache_seqlens, const at::Tensor& accept_nodes,
                                                const at::Tensor& accept_len,
                                                const std::optional<at::Tensor>& block_table) {
  // Same order as eagle_kernels/_checks.py, so both name the same tensor: B comes from
  // accept_nodes.
  const char* op = "compact_kv";
  const bool paged = block_table.has_value();
  const at::Device dev = k_cache.device();
  // The copy moves raw rows of any element size, but the contract's caches are float (first, as in
  // _checks.py): an integer or bool cache is a caller's bug, rejected on every path.
  check_float_dtype(k_cache, op, "k_cache");
  check_dtype(accept_nodes, op, "accept_nodes", at::kInt);
  check_dim(accept_nodes, op, "accept_nodes", 2, "[B, max_depth + 1]");
  check_device(accept_nodes, op, "accept_nodes", dev);
  const int64_t B = accept_nodes.size(0);
  const int64_t A = accept_nodes.size(1);
  TORCH_CHECK_VALUE(A >= 1, op, ": accept_nodes: expected shape [B, max_depth + 1] with ", "max_depth >= 0, got shape ",
                    shape_str(accept_nodes.sizes()));
  check_dtype(accept_len, op, "accept_len", at::kInt);
  check_shape(accept_len, op, "accept_len", {B}, "[B]");
  check_device(accept_len, op, "accept_len", dev);

  const char* layout =
      paged ? "[P, page_size, Hkv, D] or [L, P, page_size, Hkv, D]" : "[B, S, Hkv, D] or [L, B, S, Hkv, D]";
  TORCH_CHECK_VALUE(k_cache.dim() == 4 || k_cache.dim() == 5, op, ": k_cache: expected ", layout, ", got shape ",
                    shape_str(k_cache.sizes()));
  const bool has_layer = k_cache.dim() == 5;
  const int64_t off = has_layer ? 1 : 0;
  const int64_t outer = k_cache.size(off);
  const int64_t max_pages = check_kv_cache_args(op, k_cache, v_cache, cache_seqlens, block_table, B, off, layout, dev);
  check_dense_head_dim(op, k_cache, v_cache);
  const int64_t D = k_cache.size(-1);

  const int64_t esize = static_cast<int64_t>(k_cache.element_size());
  auto view = [&](const at::Tensor& t) {
    compact_kv::CacheView v;
    v.base = static_cast<char*>(t.data_ptr());
    v.stride_layer = has_layer ? t.stride(0) * esize : 0;
    v.stride_outer = t.stride(off) * esize;
    v.stride_pos = t.stride(off + 1) * esize;
    v.stride_head = t.stride(off + 2) * esize;
    return v;
  };
  compact_kv::Params p;
  p.k = view(k_cache);
  p.v = view(v_cache);
  p.num_layers = has_layer ? k_cache.size(0) : 1;
  p.batch = B;
  p.num_heads = k_cache.size(off + 2);
  p.row_bytes = D * esize;
  p.seq_len = k_cache.size(off + 1);
  p.paged = paged;
  p.num_pages = paged ? outer : 0;
  p.block_table = paged ? block_table->data_ptr<int32_t>() : nullptr;
  p.max_pages = max_pages;
  p.cache_seqlens = cache_seqlens.data_ptr<int32_t>();
  p.accept_nodes = accept_nodes.data_ptr<int32_t>();
  p.accept_width = A;
  p.accept_len = accept_len.data_ptr<int32_t>();
  return p;
}

// Word size for the row copies: divides the row, every stride and both base addresses.
inline int compact_kv_word_bytes(const compact_kv::Params& p) {
  const int64_t values[] = {p.row_bytes,
                            p.k.stride_layer,
                            p.k.stride_outer,
                            p.k.stride_pos,
                            p.k.stride_head,
                            p.v.stride_layer,
                            p.v.stride_outer,
                            p.v.stride_pos,
                            p.v.stride_head,
                            static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.k.base) % 16),
                            static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.v.base) % 16)};
  return compact_kv::pick_word_bytes(values, static_cast<int>(sizeof(values) / sizeof(values[0])));
}

}  // namespace eagle
