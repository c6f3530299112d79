// CPU launcher of cpu_decoder_layer: one whole Llama decoder layer (RMSNorm, fused q/k/v, RoPE,
// write_kv, tree_attention, o_proj, residual, RMSNorm, fused gate/up, SiLU * up, down_proj,
// residual) in one call, for the few rows of decoding and verification. The same call serves
// the EAGLE-3 draft layer: with `embed`, attention reads [RMSNorm(embed), RMSNorm(x)] (2H wide)
// and x stays the residual; with `slot_offset`, the new tokens follow that many tree slots of
// earlier calls (draft expansion, depth by depth), as LlamaModel's cached_attention does.
//
// At 1-8 rows the arithmetic of a layer outside its four linear layers is a few microseconds,
// but run as a chain of separate operators from Python it is about twenty calls, each paying
// dispatch (and RMSNorm alone about 35 us on a 576-wide row), which measured a third of a
// SmolLM2-135M decoding step on a 2-core CPU. Here the linear layers, write_kv and
// tree_attention are the same C++ kernels the separate ops run (called directly, not through
// the dispatcher) and the elementwise steps are plain loops over the rows.
//
// Every step works row by row in a fixed order, so a row's result does not depend on the other
// rows (as cpu_linear's and tree_attention's): a verify pass gives a tree node what decoding it
// alone would. RoPE is computed as x * cos + rotate_half(x) * sin with separately rounded
// products, SiLU by ATen and its product with up rounded once, as on the PyTorch path; RMSNorm
// agrees with it to fp32 rounding. The intermediate rows live in one workspace per call, and
// q/k/v are read in place from the fused projection's output (no copies, no per-step tensors).
//
// With `row_counts`, the rows of a request past its count are padding: the norms and linear
// layers run over the other rows only, packed together (a batch whose requests verify trees of
// different sizes pays for the rows it has, not for B times the largest); padding rows keep x
// and write zero K/V.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/index_copy.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "checks.h"
#include "cpu_linear_impl.h"
#include "ops.h"
#include "simd.h"

namespace eagle {
namespace {

// out[r * ldo + i] = x[r, i] / sqrt(mean(x[r, :]^2) + eps) * weight[i], rows of width H.
void rms_norm_rows(const float* x, const float* weight, int64_t rows, int64_t H, double eps, float* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * H;
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight partial sums: the compiler vectorises them
    int64_t k = 0;
    for (; k + 8 <= H; k += 8)
      for (int j = 0; j < 8; ++j) part[j] += xr[k + j] * xr[k + j];
    float sum = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (; k < H; ++k) sum += xr[k] * xr[k];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
    float* o = out + r * ldo;
    for (int64_t i = 0; i < H; ++i) o[i] = weight[i] * (xr[i] * inv);
  }
}

// In place on the first `heads` heads of each row of qkv [rows, total_heads, D]: the half-split
// rotation with that row's cos, sin [rows, D].
void rope_rows(float* qkv, int64_t rows, int64_t total_heads, int64_t heads, int64_t D, const float* cos,
               const float* sin) {
  const int64_t half = D / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * D;
    const float* s = sin + r * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = qkv + (r * total_heads + h) * D;
      for (int64_t d = 0; d < half; ++d) {
        const float a = v[d], b = v[d + half];
        const float first = a * c[d];
        const float first_rot = -b * s[d];
        const float second = b * c[d + half];
        const float second_rot = a * s[d + half];
        v[d] = first + first_rot;
        v[d + half] = second + second_rot;
      }
    }
  }
}

// x[i] + y[i] into out[i], n elements (out may be y).
void add_rows(const float* x, const float* y, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

void check_weight(const at::Tensor& w, const char* op, const char* name, int64_t rows, int64_t cols, const char* layout,
                  at::Device dev) {
  if (linear_impl::is_quantized(w)) {
    check_device(w, op, name, dev);
    linear_impl::check_quantized(w, op, name, rows, cols);
    return;
  }
  check_32_or_16_bit_float(w, op, name);
  check_device(w, op, name, dev);
  if (w.dim() == 4 || linear_impl::is_pair_packed(w)) {  // packed (cpu_linear_pack); rows not a multiple of 32 fail
    linear_impl::check_packed_float(w, op, name, rows, cols);
    return;
  }
  check_shape(w, op, name, {rows, cols}, layout);
  TORCH_CHECK_VALUE(w.stride(1) == 1 || cols <= 1, op, ": ", name,
                    ": expected a dense last dim (stride 1), got strides ", shape_str(w.strides()));
}

// Bytes of K and V prefix that prefetch_kv_prefix asks for per call: what L2 does not hold stays in L3. At a
// 1,000-token prefix (1.5 MB of fp32 K/V a layer), one thread, 8-bit weights: 512 KiB 1.008x, 2 MiB 1.036x,
// 8 MiB 1.028x over no prefetch.
constexpr int64_t kKvPrefetchBytes = 2 * 1024 * 1024;

// Asks for the cached K/V rows [0, cache_seqlens[b]) of every request to be brought into L2. By the time a layer
// runs, the weight stream of the layers before it has evicted its cache to DRAM, and tree_attention reads it a key
// row (256 bytes for SmolLM2) at a time, a KV head at a time: strided misses that waited on DRAM latency, ~30 us a
// layer at a 96-token prefix, about a tenth of a decoding step with 8-bit weights. Issued before the q/k/v
// projection, the loads overlap with it. Only dense [B, S, Hkv, D] rows; a hint, the results do not change.
void prefetch_kv_prefix(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens) {
#if EAGLE_X86_SIMD
  const int64_t S = k_cache.size(1), Hkv = k_cache.size(2), D = k_cache.size(3);
  const int32_t* lens = cache_seqlens.data_ptr<int32_t>();
  const int64_t stride_b = cache_seqlens.stride(0);
  int64_t budget = kKvPrefetchBytes;
  for (int64_t b = 0; b < k_cache.size(0) && budget > 0; ++b) {
    const int64_t len = std::min<int64_t>(std::max<int32_t>(lens[b * stride_b], 0), S);
    for (const at::Tensor* cache : {&k_cache, &v_cache}) {
      if (cache->stride(3) != 1 || cache->stride(2) != D || cache->stride(1) != Hkv * D) continue;
      const int64_t es = static_cast<int64_t>(cache->element_size());
      const int64_t bytes = std::min(len * Hkv * D * es, budget);
      const char* base = static_cast<const char*>(cache->data_ptr()) + b * cache->stride(0) * es;
      for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(base + off, _MM_HINT_T1);
      budget -= bytes;
    }
  }
#else
  (void)k_cache, (void)v_cache, (void)cache_seqlens;
#endif
}

// N of a cpu_linear weight, row-major [N, K] or packed [N / 32, 2, K, 16].
int64_t out_features(const at::Tensor& w) { return w.dim() >= 4 ? w.size(0) * linear_impl::kPackWidth : w.size(0); }

// The sizes of one layer's call, from its checked arguments.
struct LayerDims {
  int64_t B, N, H, Hq, Hkv, D, I, attn_in;
  const char* op;  // the op whose call these are, named by the cache writes' errors
};

// eps of the norms: a number >= 0 (a negative or NaN one gives NaN rows), as _checks.check_eps.
void check_eps(const char* op, double eps) {
  TORCH_CHECK_VALUE(eps >= 0.0, op, ": eps: expected a number >= 0, got ", eps);
}

// Every check of one layer's arguments (same order and wording as eagle_kernels/_checks.py::check_cpu_decoder_layer).
// `suffix` follows the names of the per-layer tensors (cpu_decoder_layers: "[3]" for layer 3). The cache capacity
// (cache_seqlens + slot_offset + N) is checked by write_kv in run_layer, before anything is written.
LayerDims check_layer(const char* op, const std::string& suffix, const at::Tensor& x_in, const at::Tensor& input_norm,
                      const at::Tensor& qkv_weight, const at::Tensor& o_weight, const at::Tensor& post_norm,
                      const at::Tensor& gate_up_weight, const at::Tensor& down_weight, const at::Tensor& cos_in,
                      const at::Tensor& sin_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& tree_mask, int64_t num_heads,
                      const std::optional<at::Tensor>& embed, const std::optional<at::Tensor>& embed_norm,
                      int64_t slot_offset) {
  const auto named = [&](const char* name) { return std::string(name) + suffix; };
  check_dtype(x_in, op, "x", at::kFloat);
  check_dim(x_in, op, "x", 3, "[B, N, H]");
  const at::Device dev = x_in.device();
  TORCH_CHECK_VALUE(dev.is_cpu(), op, ": x: expected device cpu, got ", dev);
  const int64_t B = x_in.size(0), N = x_in.size(1), H = x_in.size(2);
  check_32_or_16_bit_float(k_cache, op, "k_cache");
  check_dim(k_cache, op, "k_cache", 4, "[B, S, Hkv, D]");
  check_device(k_cache, op, "k_cache", dev);
  check_kv_cache_args(op, k_cache, v_cache, cache_seqlens, std::nullopt, B, 0, "[B, S, Hkv, D]", dev);
  const int64_t Hkv = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK_VALUE(num_heads >= 1 && Hkv >= 1 && num_heads % Hkv == 0, op,
                    ": num_heads: expected a positive multiple of the KV head count ", Hkv, ", got ", num_heads);
  TORCH_CHECK_VALUE(D % 2 == 0, op, ": k_cache: expected an even head dim (RoPE), got ", D);
  for (const auto& [norm, name] : {std::pair{&input_norm, "input_norm"}, std::pair{&post_norm, "post_norm"}}) {
    const std::string full = named(name);
    check_dtype(*norm, op, full.c_str(), at::kFloat);
    check_shape(*norm, op, full.c_str(), {H}, "[H]");
    check_device(*norm, op, full.c_str(), dev);
  }
  TORCH_CHECK_VALUE(embed.has_value() == embed_norm.has_value(), op,
                    ": embed_norm: expected embed and embed_norm together, got ",
                    embed.has_value() ? "embed only" : "embed_norm only");
  if (embed.has_value()) {
    check_dtype(*embed, op, "embed", at::kFloat);
    check_shape(*embed, op, "embed", {B, N, H}, "[B, N, H] like x");
    check_device(*embed, op, "embed", dev);
    check_dtype(*embed_norm, op, "embed_norm", at::kFloat);
    check_shape(*embed_norm, op, "embed_norm", {H}, "[H]");
    check_device(*embed_norm, op, "embed_norm", dev);
  }
  const int64_t Hq = num_heads;
  const int64_t attn_in = embed.has_value() ? 2 * H : H;
  check_weight(qkv_weight, op, named("qkv_weight").c_str(), (Hq + 2 * Hkv) * D, attn_in,
               embed.has_value() ? "[(num_heads + 2 Hkv) D, 2 H]" : "[(num_heads + 2 Hkv) D, H]", dev);
  check_weight(o_weight, op, named("o_weight").c_str(), H, Hq * D, "[H, num_heads D]", dev);
  TORCH_CHECK_VALUE((gate_up_weight.dim() == 2 || gate_up_weight.dim() == 4 || gate_up_weight.dim() == 5) &&
                        out_features(gate_up_weight) % 2 == 0,
                    op, ": ", named("gate_up_weight"),
                    ": expected 2-D [2 I, H] (gate rows, then up rows) or its packed form, got shape ",
                    shape_str(gate_up_weight.sizes()));
  const int64_t I = out_features(gate_up_weight) / 2;
  check_weight(gate_up_weight, op, named("gate_up_weight").c_str(), 2 * I, H, "[2 I, H]", dev);
  check_weight(down_weight, op, named("down_weight").c_str(), H, I, "[H, I]", dev);
  check_dtype(cos_in, op, "cos", at::kFloat);
  check_shape(cos_in, op, "cos", {B, N, D}, "[B, N, D]");
  check_device(cos_in, op, "cos", dev);
  check_dtype(sin_in, op, "sin", at::kFloat);
  check_shape(sin_in, op, "sin", {B, N, D}, "[B, N, D]");
  check_device(sin_in, op, "sin", dev);
  TORCH_CHECK_VALUE(slot_offset >= 0, op, ": slot_offset: expected a non-negative int, got ", slot_offset);
  const int64_t slots = slot_offset + N;  // tree slots attention sees: earlier calls' and these
  if (tree_mask.has_value()) {
    check_dtype(*tree_mask, op, "tree_mask", at::kLong);
    check_shape(*tree_mask, op, "tree_mask", {B, slots, (slots + 63) / 64},
                "[B, slot_offset + N, ceil((slot_offset + N) / 64)]");
    check_device(*tree_mask, op, "tree_mask", dev);
  }
  return {B, N, H, Hq, Hkv, D, I, attn_in, op};
}

// Flat indices (b * N + i) of the rows to compute when `row_counts` makes some padding, else none.
std::optional<at::Tensor> kept_rows(const char* op, const std::optional<at::Tensor>& row_counts, int64_t B, int64_t N,
                                    at::Device dev) {
  if (!row_counts.has_value()) return std::nullopt;
  check_dtype(*row_counts, op, "row_counts", at::kLong);
  check_shape(*row_counts, op, "row_counts", {B}, "[B]");
  check_device(*row_counts, op, "row_counts", dev);
  const at::Tensor counts = row_counts->contiguous();
  const int64_t* count = counts.data_ptr<int64_t>();
  std::vector<int64_t> index;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(count[b] >= 0 && count[b] <= N, op, ": row_counts: expected values in [0, N = ", N, "], got ",
                      count[b], " for request ", b);
    for (int64_t i = 0; i < count[b]; ++i) index.push_back(b * N + i);
  }
  if (static_cast<int64_t>(index.size()) == B * N) return std::nullopt;
  return at::from_blob(index.data(), {static_cast<int64_t>(index.size())}, at::kLong).clone();
}

// One layer over checked arguments (see the comment at the top of the file); `kept` from kept_rows.
at::Tensor run_layer(const LayerDims& dims, const at::Tensor& x_in, const at::Tensor& input_norm,
                     const at::Tensor& qkv_weight, const at::Tensor& o_weight, const at::Tensor& post_norm,
                     const at::Tensor& gate_up_weight, const at::Tensor& down_weight, const at::Tensor& cos_in,
                     const at::Tensor& sin_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& tree_mask, double eps,
                     const std::optional<at::Tensor>& embed, const std::optional<at::Tensor>& embed_norm,
                     int64_t slot_offset, const std::optional<at::Tensor>& kept) {
  const int64_t B = dims.B, N = dims.N, H = dims.H, Hq = dims.Hq, Hkv = dims.Hkv, D = dims.D, I = dims.I;
  const int64_t attn_in = dims.attn_in;
  const int64_t slots = slot_offset + N;
  const at::Tensor x = x_in.contiguous();
  const at::Tensor cos = cos_in.contiguous();
  const at::Tensor sin = sin_in.contiguous();
  const at::Tensor norm1 = input_norm.contiguous();
  const at::Tensor norm2 = post_norm.contiguous();
  const int64_t rows = B * N;
  if (rows == 0) return x.clone();
  // The computed rows [R, C] of a contiguous [B, N, C] tensor.
  const auto pick = [&](const at::Tensor& t) {
    const at::Tensor flat = t.view({rows, t.size(-1)});
    return kept.has_value() ? at::index_select(flat, 0, *kept) : flat;
  };
  const at::Tensor xr = pick(x);
  const int64_t R = xr.size(0);
  const int64_t qkv_width = (Hq + 2 * Hkv) * D;

  const int64_t I2 = 2 * I;
  // The linear layers call cpu_linear's kernels on the workspace directly (a cpu_linear call adds its checks, a
  // reshape and an output tensor, a few microseconds each time, four times a layer).
  const isa::Level level = isa::current();
  // The layer's intermediate rows in one allocation: h [R, attn_in] (the attention input; the MLP's norm reuses
  // it), qkv [R, qkv_width], x1 [R, H] (the residual after attention), gate_up [R, 2 I].
  at::Tensor workspace = at::empty({R * (attn_in + qkv_width + H + I2)}, x.options());
  float* h = workspace.data_ptr<float>();
  float* qkv_rows = h + R * attn_in;
  float* x1 = qkv_rows + R * qkv_width;
  float* gate_up = x1 + R * H;
  const auto rows_of = [&](float* data, int64_t width) { return at::from_blob(data, {R, width}, x.options()); };
  // Padding rows get zero q/k/v.
  at::Tensor qkv =
      kept.has_value() || R == 0 ? at::zeros({rows, qkv_width}, x.options()) : rows_of(qkv_rows, qkv_width);
  if (R > 0) {
    prefetch_kv_prefix(k_cache, v_cache, cache_seqlens);  // attention follows (R == 0 returns before it)
    if (embed.has_value()) {  // EAGLE-3: [norm(embed), norm(x)] feeds attention, x is the residual
      const at::Tensor e = pick(embed->contiguous());
      const at::Tensor enorm = embed_norm->contiguous();
      rms_norm_rows(e.data_ptr<float>(), enorm.data_ptr<float>(), R, H, eps, h, attn_in);
    }
    rms_norm_rows(xr.data_ptr<float>(), norm1.data_ptr<float>(), R, H, eps, h + (attn_in - H), attn_in);
    linear_impl::linear_rows(qkv_weight, h, attn_in, R, attn_in, qkv_rows, qkv_width, level);
    rope_rows(qkv_rows, R, Hq + 2 * Hkv, Hq + Hkv, D, pick(cos).data_ptr<float>(), pick(sin).data_ptr<float>());
    if (kept.has_value()) qkv.index_copy_(0, *kept, rows_of(qkv_rows, qkv_width));
  }
  // [B, N, Hq + 2 Hkv, D] views of q, k and v, read in place by write_kv and tree_attention.
  const auto heads = [&](int64_t first, int64_t count) {
    return at::from_blob(qkv.data_ptr<float>() + first * D, {B, N, count, D}, {N * qkv_width, qkv_width, D, 1},
                         x.options());
  };
  const at::Tensor starts = slot_offset ? at::add(cache_seqlens, slot_offset) : cache_seqlens;
  // A 16-bit cache stores k and v rounded to its dtype, and attention runs in it (q rounded, the output widened
  // back), as LlamaModel's op-by-op path does with such a cache (cached_attention).
  const at::ScalarType cache_dtype = k_cache.scalar_type();
  const auto in_cache_dtype = [&](const at::Tensor& t) { return cache_dtype == at::kFloat ? t : t.to(cache_dtype); };
  write_kv_named(dims.op, k_cache, v_cache, in_cache_dtype(heads(Hq, Hkv)), in_cache_dtype(heads(Hq + Hkv, Hkv)),
                 starts, std::nullopt);
  if (R == 0) return x.clone();
  at::Tensor q = heads(0, Hq);
  if (slot_offset) {  // the earlier slots' queries are zero rows whose outputs are dropped
    at::Tensor padded = at::zeros({B, slots, Hq, D}, x.options());
    padded.narrow(1, slot_offset, N).copy_(q);
    q = padded;
  }
  at::Tensor attn =
      tree_attention_cpu(in_cache_dtype(q), k_cache, v_cache, cache_seqlens, tree_mask, std::nullopt, std::nullopt);
  if (cache_dtype != at::kFloat) attn = attn.to(at::kFloat);
  if (slot_offset) attn = attn.narrow(1, slot_offset, N).contiguous();
  const at::Tensor attn_rows = pick(attn.view({B, N, Hq * D}));  // [R, Hq D]
  linear_impl::linear_rows(o_weight, attn_rows.data_ptr<float>(), Hq * D, R, Hq * D, x1, H, level);
  add_rows(xr.data_ptr<float>(), x1, R * H, x1);

  rms_norm_rows(x1, norm2.data_ptr<float>(), R, H, eps, h, H);               // h's first R x H floats: the MLP's input
  linear_impl::linear_rows(gate_up_weight, h, H, R, H, gate_up, I2, level);  // [R, 2 I]: gate, then up
  // ATen's vectorised SiLU, in place on the gate half (the op-by-op path's F.silu values), then * up into the
  // gate half (the op-by-op path's product: one rounding each).
  at::Tensor gate = at::from_blob(gate_up, {R, I}, {I2, 1}, x.options());
  at::silu_(gate);
  for (int64_t r = 0; r < R; ++r) {
    float* gate_row = gate_up + r * I2;
    const float* up_row = gate_row + I;
    for (int64_t i = 0; i < I; ++i) gate_row[i] *= up_row[i];
  }
  at::Tensor out_rows = at::empty({R, H}, x.options());
  float* out_data = out_rows.data_ptr<float>();
  linear_impl::linear_rows(down_weight, gate_up, I2, R, I, out_data, H, level);
  add_rows(x1, out_data, R * H, out_data);
  if (!kept.has_value()) return out_rows.view({B, N, H});
  at::Tensor out = x.clone();  // padding rows keep x
  out.view({rows, H}).index_copy_(0, *kept, out_rows);
  return out;
}

}  // namespace

at::Tensor cpu_decoder_layer_cpu(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& qkv_weight,
                                 const at::Tensor& o_weight, const at::Tensor& post_norm,
                                 const at::Tensor& gate_up_weight, const at::Tensor& down_weight, const at::Tensor& cos,
                                 const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& tree_mask,
                                 int64_t num_heads, double eps, const std::optional<at::Tensor>& embed,
                                 const std::optional<at::Tensor>& embed_norm, int64_t slot_offset,
                                 const std::optional<at::Tensor>& row_counts) {
  const char* op = "cpu_decoder_layer";
  check_eps(op, eps);
  const LayerDims dims =
      check_layer(op, "", x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin,
                  k_cache, v_cache, cache_seqlens, tree_mask, num_heads, embed, embed_norm, slot_offset);
  const std::optional<at::Tensor> kept = kept_rows(op, row_counts, dims.B, dims.N, x.device());
  return run_layer(dims, x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin, k_cache,
                   v_cache, cache_seqlens, tree_mask, eps, embed, embed_norm, slot_offset, kept);
}

namespace {

// The [L, B, S, Hkv, D] cache of a stack (the first checks of cpu_decoder_layers, which cpu_decoder_forward makes
// before it reads D for its RoPE tables).
void check_stack_cache(const char* op, const at::Tensor& x, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& cache_seqlens) {
  check_32_or_16_bit_float(k_cache, op, "k_cache");
  check_dim(k_cache, op, "k_cache", 5, "[L, B, S, Hkv, D]");
  check_device(k_cache, op, "k_cache", x.device());
  check_kv_cache_args(op, k_cache, v_cache, cache_seqlens, std::nullopt, x.size(0), 1, "[L, B, S, Hkv, D]", x.device());
}

// A stack's checked arguments: the per-layer cache views, each layer's sizes and the rows to compute.
struct StackPlan {
  std::vector<at::Tensor> k_layers, v_layers;
  std::vector<LayerDims> dims;
  std::optional<at::Tensor> kept;
};

// Every check of a stack's arguments after check_stack_cache (same order and wording as
// eagle_kernels/_checks.py::check_cpu_decoder_layers).
StackPlan check_stack(const char* op, const at::Tensor& x, at::TensorList input_norm, at::TensorList qkv_weight,
                      at::TensorList o_weight, at::TensorList post_norm, at::TensorList gate_up_weight,
                      at::TensorList down_weight, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                      const std::optional<at::Tensor>& tree_mask, int64_t num_heads, at::IntArrayRef state_layers,
                      const std::optional<at::Tensor>& row_counts) {
  const int64_t L = k_cache.size(0);
  for (const auto& [list, name] :
       {std::pair{&input_norm, "input_norm"}, std::pair{&qkv_weight, "qkv_weight"}, std::pair{&o_weight, "o_weight"},
        std::pair{&post_norm, "post_norm"}, std::pair{&gate_up_weight, "gate_up_weight"},
        std::pair{&down_weight, "down_weight"}})
    TORCH_CHECK_VALUE(static_cast<int64_t>(list->size()) == L, op, ": ", name, ": expected one tensor per layer of ",
                      "k_cache (L = ", L, "), got ", list->size());
  for (const int64_t layer : state_layers)
    TORCH_CHECK_VALUE(layer >= 0 && layer < L, op, ": state_layers: expected layer indices in [0, L = ", L, "), got ",
                      layer);
  StackPlan plan{k_cache.unbind(0), v_cache.unbind(0), {}, std::nullopt};
  plan.dims.reserve(L);
  for (int64_t l = 0; l < L; ++l)
    plan.dims.push_back(check_layer(op, "[" + std::to_string(l) + "]", x, input_norm[l], qkv_weight[l], o_weight[l],
                                    post_norm[l], gate_up_weight[l], down_weight[l], cos, sin, plan.k_layers[l],
                                    plan.v_layers[l], cache_seqlens, tree_mask, num_heads, std::nullopt, std::nullopt,
                                    0));
  plan.kept = kept_rows(op, row_counts, x.size(0), x.size(1), x.device());
  return plan;
}

// The stack over checked arguments: layer by layer, as cpu_decoder_layer L times, with no Python (and no dispatcher)
// between the layers, whose interpreter state the weight stream evicts from the caches between two calls.
std::tuple<at::Tensor, at::Tensor> run_stack(const StackPlan& plan, const at::Tensor& x, at::TensorList input_norm,
                                             at::TensorList qkv_weight, at::TensorList o_weight,
                                             at::TensorList post_norm, at::TensorList gate_up_weight,
                                             at::TensorList down_weight, const at::Tensor& cos, const at::Tensor& sin,
                                             const at::Tensor& cache_seqlens,
                                             const std::optional<at::Tensor>& tree_mask, double eps,
                                             at::IntArrayRef state_layers) {
  const int64_t L = static_cast<int64_t>(plan.dims.size());
  const int64_t num_states = static_cast<int64_t>(state_layers.size());
  at::Tensor states = at::empty({num_states, x.size(0), x.size(1), x.size(2)}, x.options());
  at::Tensor h = x;
  for (int64_t l = 0; l < L; ++l) {
    h = run_layer(plan.dims[l], h, input_norm[l], qkv_weight[l], o_weight[l], post_norm[l], gate_up_weight[l],
                  down_weight[l], cos, sin, plan.k_layers[l], plan.v_layers[l], cache_seqlens, tree_mask, eps,
                  std::nullopt, std::nullopt, 0, plan.kept);
    for (int64_t i = 0; i < num_states; ++i)
      if (state_layers[i] == l) states[i].copy_(h);
  }
  return {L > 0 ? h : x.clone(), states};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cpu_decoder_layers_cpu(
    const at::Tensor& x, at::TensorList input_norm, at::TensorList qkv_weight, at::TensorList o_weight,
    at::TensorList post_norm, at::TensorList gate_up_weight, at::TensorList down_weight, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& tree_mask, int64_t num_heads, double eps, at::IntArrayRef state_layers,
    const std::optional<at::Tensor>& row_counts) {
  // Same order and wording as eagle_kernels/_checks.py::check_cpu_decoder_layers.
  const char* op = "cpu_decoder_layers";
  check_eps(op, eps);
  check_dtype(x, op, "x", at::kFloat);
  check_dim(x, op, "x", 3, "[B, N, H]");
  TORCH_CHECK_VALUE(x.device().is_cpu(), op, ": x: expected device cpu, got ", x.device());
  check_stack_cache(op, x, k_cache, v_cache, cache_seqlens);
  const StackPlan plan =
      check_stack(op, x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin, k_cache,
                  v_cache, cache_seqlens, tree_mask, num_heads, state_layers, row_counts);
  return run_stack(plan, x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin,
                   cache_seqlens, tree_mask, eps, state_layers);
}

namespace {

// cos or sin rows [B, N, D] of cpu_decoder_layer from a [P, D / 2] table: row positions[b, i] written twice.
at::Tensor rope_rows(const at::Tensor& table, const std::vector<int64_t>& positions, int64_t B, int64_t N) {
  const int64_t half = table.size(1);
  at::Tensor rows = at::empty({B, N, 2 * half}, table.options());
  const float* src = table.data_ptr<float>();
  float* dst = rows.data_ptr<float>();
  for (size_t r = 0; r < positions.size(); ++r) {
    const float* row = src + positions[r] * half;
    std::copy(row, row + half, dst + r * 2 * half);
    std::copy(row, row + half, dst + r * 2 * half + half);
  }
  return rows;
}

// Every token position of a pass (positions, or cache_seqlens[b] + i), checked against the tables' P rows.
std::vector<int64_t> pass_positions(const char* op, const std::optional<at::Tensor>& positions,
                                    const at::Tensor& cache_seqlens, int64_t B, int64_t N, int64_t P, at::Device dev) {
  std::vector<int64_t> out(B * N);
  if (positions.has_value()) {
    check_dtype(*positions, op, "positions", at::kLong);
    check_shape(*positions, op, "positions", {B, N}, "[B, N]");
    check_device(*positions, op, "positions", dev);
    const at::Tensor p = positions->contiguous();
    const int64_t* data = p.data_ptr<int64_t>();
    for (int64_t r = 0; r < B * N; ++r) {
      TORCH_CHECK_VALUE(data[r] >= 0 && data[r] < P, op, ": positions: expected values in [0, P = ", P,
                        ") (rope_cos rows), got ", data[r], " at (", r / N, ", ", r % N, ")");
      out[r] = data[r];
    }
    return out;
  }
  const at::Tensor lens = cache_seqlens.to(at::kLong).contiguous();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(len[b] + N <= P, op,
                      ": rope_cos: expected a row per position up to cache_seqlens + N - 1 = ", len[b] + N - 1,
                      " (positions None), got P = ", P, " rows");
    for (int64_t i = 0; i < N; ++i) out[b * N + i] = len[b] + i;
  }
  return out;
}

// The rows of embed_table for token ids [B, N], widened to float32 [B, N, H] (as
// torch.nn.functional.embedding(tokens, embed_table).float()), after the checks of both.
at::Tensor embedded_tokens(const char* op, const at::Tensor& tokens, const at::Tensor& embed_table) {
  check_dtype(tokens, op, "tokens", at::kLong);
  check_dim(tokens, op, "tokens", 2, "[B, N]");
  const at::Device dev = tokens.device();
  TORCH_CHECK_VALUE(dev.is_cpu(), op, ": tokens: expected device cpu, got ", dev);
  check_32_or_16_bit_float(embed_table, op, "embed_table");
  check_dim(embed_table, op, "embed_table", 2, "[V, H]");
  check_device(embed_table, op, "embed_table", dev);
  TORCH_CHECK_VALUE(embed_table.stride(1) == 1 || embed_table.size(1) <= 1, op,
                    ": embed_table: expected a dense last dim (stride 1), got strides ",
                    shape_str(embed_table.strides()));
  const int64_t B = tokens.size(0), N = tokens.size(1), V_e = embed_table.size(0), H = embed_table.size(1);
  const at::Tensor t = tokens.contiguous();
  const int64_t* id = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < B * N; ++r)
    TORCH_CHECK_VALUE(id[r] >= 0 && id[r] < V_e, op, ": tokens: expected ids in [0, V = ", V_e,
                      ") (embed_table rows), got ", id[r], " at (", r / N, ", ", r % N, ")");
  return embed_table.index_select(0, t.reshape({-1})).to(at::kFloat).view({B, N, H});
}

// rope_cos and rope_sin: contiguous float32 [P, D / 2] tables with the same P.
void check_rope_tables(const char* op, const at::Tensor& rope_cos, const at::Tensor& rope_sin, int64_t D,
                       at::Device dev) {
  for (const auto& [table, name] : {std::pair{&rope_cos, "rope_cos"}, std::pair{&rope_sin, "rope_sin"}}) {
    check_dtype(*table, op, name, at::kFloat);
    check_dim(*table, op, name, 2, "[P, D / 2]");
    check_device(*table, op, name, dev);
    TORCH_CHECK_VALUE(table->size(1) * 2 == D && table->is_contiguous(), op, ": ", name,
                      ": expected a contiguous [P, D / 2 = ", D / 2, "] table, got shape ", shape_str(table->sizes()),
                      " and strides ", shape_str(table->strides()));
  }
  TORCH_CHECK_VALUE(rope_sin.size(0) == rope_cos.size(0), op, ": rope_sin: expected P = ", rope_cos.size(0),
                    " rows (as rope_cos), got ", rope_sin.size(0));
}

// The final RMSNorm's weight float32 [H] and an LM head [V, H] in any form cpu_linear takes.
void check_final_norm_and_lm_head(const char* op, const at::Tensor& final_norm, const at::Tensor& lm_head, int64_t H,
                                  at::Device dev) {
  check_dtype(final_norm, op, "final_norm", at::kFloat);
  check_shape(final_norm, op, "final_norm", {H}, "[H]");
  check_device(final_norm, op, "final_norm", dev);
  TORCH_CHECK_VALUE(lm_head.dim() >= 2, op, ": lm_head: expected [V, H] or its packed form, got shape ",
                    shape_str(lm_head.sizes()));
  check_weight(lm_head, op, "lm_head", out_features(lm_head), H, "[V, H]", dev);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_decoder_forward_cpu(
    const at::Tensor& tokens, const at::Tensor& embed_table, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
    const std::optional<at::Tensor>& positions, at::TensorList input_norm, at::TensorList qkv_weight,
    at::TensorList o_weight, at::TensorList post_norm, at::TensorList gate_up_weight, at::TensorList down_weight,
    const at::Tensor& final_norm, const at::Tensor& lm_head, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& tree_mask, int64_t num_heads, double eps,
    at::IntArrayRef state_layers, const std::optional<at::Tensor>& row_counts,
    const std::optional<at::Tensor>& logit_rows) {
  // Same order and wording as eagle_kernels/_checks.py::check_cpu_decoder_forward. Everything is checked before
  // the stack writes the cache.
  const char* op = "cpu_decoder_forward";
  check_eps(op, eps);
  const at::Tensor x = embedded_tokens(op, tokens, embed_table);  // the stack's input
  const at::Device dev = tokens.device();
  const int64_t B = tokens.size(0), N = tokens.size(1), H = embed_table.size(1);
  check_stack_cache(op, x, k_cache, v_cache, cache_seqlens);
  const int64_t D = k_cache.size(4);
  check_rope_tables(op, rope_cos, rope_sin, D, dev);
  const std::vector<int64_t> pos = pass_positions(op, positions, cache_seqlens, B, N, rope_cos.size(0), dev);
  const at::Tensor cos = rope_rows(rope_cos, pos, B, N), sin = rope_rows(rope_sin, pos, B, N);
  const StackPlan plan =
      check_stack(op, x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin, k_cache,
                  v_cache, cache_seqlens, tree_mask, num_heads, state_layers, row_counts);
  check_final_norm_and_lm_head(op, final_norm, lm_head, H, dev);
  if (logit_rows.has_value()) {
    check_dtype(*logit_rows, op, "logit_rows", at::kLong);
    check_dim(*logit_rows, op, "logit_rows", 2, "[B, R]");
    TORCH_CHECK_VALUE(logit_rows->size(0) == B, op, ": logit_rows: expected shape [B = ", B, ", R], got ",
                      shape_str(logit_rows->sizes()));
    check_device(*logit_rows, op, "logit_rows", dev);
    const at::Tensor rows = logit_rows->contiguous();
    const int64_t* row = rows.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows.numel(); ++r)
      TORCH_CHECK_VALUE(row[r] >= 0 && row[r] < N, op, ": logit_rows: expected values in [0, N = ", N, "), got ",
                        row[r]);
  }

  auto [out, states] = run_stack(plan, x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos,
                                 sin, cache_seqlens, tree_mask, eps, state_layers);
  const at::Tensor hidden = at::rms_norm(out, {H}, final_norm, eps);
  at::Tensor logits;
  if (logit_rows.has_value()) {
    logits =
        cpu_linear_cpu(at::gather(hidden, 1, logit_rows->unsqueeze(-1).expand({B, logit_rows->size(1), H})), lm_head);
  } else if (plan.kept.has_value()) {  // padding rows: not computed, zero logits
    const at::Tensor computed = cpu_linear_cpu(hidden.view({B * N, H}).index_select(0, *plan.kept), lm_head);
    logits = at::zeros({B * N, computed.size(1)}, hidden.options())
                 .index_copy_(0, *plan.kept, computed)
                 .view({B, N, computed.size(1)});
  } else {
    logits = cpu_linear_cpu(hidden, lm_head);
  }
  return {logits, hidden, states};
}

std::tuple<at::Tensor, at::Tensor> cpu_head_forward_cpu(
    const at::Tensor& tokens, const at::Tensor& embed_table, const at::Tensor& features,
    const std::optional<at::Tensor>& fc_weight, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
    const at::Tensor& positions, const at::Tensor& input_norm, const at::Tensor& embed_norm,
    const at::Tensor& qkv_weight, const at::Tensor& o_weight, const at::Tensor& post_norm,
    const at::Tensor& gate_up_weight, const at::Tensor& down_weight, const std::optional<at::Tensor>& final_norm,
    const std::optional<at::Tensor>& lm_head, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& tree_mask, int64_t num_heads, double eps,
    int64_t slot_offset) {
  // Same order and wording as eagle_kernels/_checks.py::check_cpu_head_forward. Everything is checked before the
  // layer writes the cache.
  const char* op = "cpu_head_forward";
  check_eps(op, eps);
  const at::Tensor embed = embedded_tokens(op, tokens, embed_table);  // the layer's embedding input
  const at::Device dev = tokens.device();
  const int64_t B = tokens.size(0), N = tokens.size(1), H = embed_table.size(1);
  check_dtype(features, op, "features", at::kFloat);
  check_dim(features, op, "features", 3, "[B, N, F]");
  check_device(features, op, "features", dev);
  TORCH_CHECK_VALUE(features.size(0) == B && features.size(1) == N, op, ": features: expected shape [B = ", B,
                    ", N = ", N, ", F], got ", shape_str(features.sizes()));
  if (fc_weight.has_value()) {
    TORCH_CHECK_VALUE(fc_weight->dim() >= 2, op, ": fc_weight: expected [H, F] or its packed form, got shape ",
                      shape_str(fc_weight->sizes()));
    check_weight(*fc_weight, op, "fc_weight", H, features.size(2), "[H, F]", dev);
  } else {
    TORCH_CHECK_VALUE(features.size(2) == H, op, ": features: expected F = H = ", H,
                      " (no fc_weight: the features are the layer's input), got shape ", shape_str(features.sizes()));
  }
  check_32_or_16_bit_float(k_cache, op, "k_cache");
  check_dim(k_cache, op, "k_cache", 4, "[B, S, Hkv, D]");
  check_device(k_cache, op, "k_cache", dev);
  const int64_t D = k_cache.size(3);
  check_rope_tables(op, rope_cos, rope_sin, D, dev);
  const std::vector<int64_t> pos = pass_positions(op, positions, cache_seqlens, B, N, rope_cos.size(0), dev);
  const at::Tensor cos = rope_rows(rope_cos, pos, B, N), sin = rope_rows(rope_sin, pos, B, N);
  // check_layer reads x for its dtype and shape only: the fc output's (features' rows at width H).
  const at::Tensor x_shape = fc_weight.has_value() ? at::empty({B, N, H}, features.options()) : features;
  const LayerDims dims =
      check_layer(op, "", x_shape, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin,
                  k_cache, v_cache, cache_seqlens, tree_mask, num_heads, embed, embed_norm, slot_offset);
  TORCH_CHECK_VALUE(final_norm.has_value() == lm_head.has_value(), op,
                    ": lm_head: expected final_norm and lm_head together, got ",
                    lm_head.has_value() ? "lm_head only" : "final_norm only");
  if (lm_head.has_value()) check_final_norm_and_lm_head(op, *final_norm, *lm_head, H, dev);

  const at::Tensor x = fc_weight.has_value() ? cpu_linear_cpu(features, *fc_weight) : features;
  const at::Tensor hidden =
      run_layer(dims, x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin, k_cache,
                v_cache, cache_seqlens, tree_mask, eps, embed, embed_norm, slot_offset, std::nullopt);
  if (!lm_head.has_value()) return {at::empty({B, N, 0}, hidden.options()), hidden};
  return {cpu_linear_cpu(at::rms_norm(hidden, {H}, *final_norm, eps), *lm_head), hidden};
}

}  // namespace eagle
