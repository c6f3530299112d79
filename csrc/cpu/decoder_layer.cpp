// CPU launcher of cpu_decoder_layer: one whole Llama decoder layer (RMSNorm, fused q/k/v, RoPE,
// write_kv, tree_attention, o_proj, residual, RMSNorm, fused gate/up, SiLU * up, down_proj,
// residual) in one call, for the few rows of decoding and verification.
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
// products and SiLU * up by ATen, as on the PyTorch path; RMSNorm agrees with it to fp32
// rounding.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "checks.h"
#include "ops.h"

namespace eagle {
namespace {

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight, rows of width H.
void rms_norm_rows(const float* x, const float* weight, int64_t rows, int64_t H, double eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * H;
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight partial sums: the compiler vectorises them
    int64_t k = 0;
    for (; k + 8 <= H; k += 8)
      for (int j = 0; j < 8; ++j) part[j] += xr[k + j] * xr[k + j];
    float sum = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (; k < H; ++k) sum += xr[k] * xr[k];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
    float* o = out + r * H;
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

// x + y, elementwise, into a new tensor like x.
at::Tensor add(const at::Tensor& x, const at::Tensor& y) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* a = x.data_ptr<float>();
  const float* b = y.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) o[i] = a[i] + b[i];
  return out;
}

void check_weight(const at::Tensor& w, const char* op, const char* name, int64_t rows, int64_t cols,
                  const char* layout, at::Device dev) {
  const at::ScalarType t = w.scalar_type();
  TORCH_CHECK_VALUE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, op, ": ", name,
                    ": expected dtype float32, bfloat16 or float16, got ", t);
  check_shape(w, op, name, {rows, cols}, layout);
  check_device(w, op, name, dev);
  TORCH_CHECK_VALUE(w.stride(1) == 1 || cols <= 1, op, ": ", name,
                    ": expected a dense last dim (stride 1), got strides ", shape_str(w.strides()));
}

}  // namespace

at::Tensor cpu_decoder_layer_cpu(const at::Tensor& x_in, const at::Tensor& input_norm,
                                 const at::Tensor& qkv_weight, const at::Tensor& o_weight,
                                 const at::Tensor& post_norm, const at::Tensor& gate_up_weight,
                                 const at::Tensor& down_weight, const at::Tensor& cos_in,
                                 const at::Tensor& sin_in, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                 const std::optional<at::Tensor>& tree_mask, int64_t num_heads,
                                 double eps) {
  // Same order and wording as eagle_kernels/_checks.py::check_cpu_decoder_layer.
  const char* op = "cpu_decoder_layer";
  check_dtype(x_in, op, "x", at::kFloat);
  check_dim(x_in, op, "x", 3, "[B, N, H]");
  const at::Device dev = x_in.device();
  TORCH_CHECK_VALUE(dev.is_cpu(), op, ": x: expected device cpu, got ", dev);
  const int64_t B = x_in.size(0), N = x_in.size(1), H = x_in.size(2);
  check_dtype(k_cache, op, "k_cache", at::kFloat);
  check_dim(k_cache, op, "k_cache", 4, "[B, S, Hkv, D]");
  check_device(k_cache, op, "k_cache", dev);
  check_kv_cache_args(op, k_cache, v_cache, cache_seqlens, std::nullopt, B, 0, "[B, S, Hkv, D]", dev);
  const int64_t Hkv = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK_VALUE(num_heads >= 1 && Hkv >= 1 && num_heads % Hkv == 0, op,
                    ": num_heads: expected a positive multiple of the KV head count ", Hkv, ", got ",
                    num_heads);
  TORCH_CHECK_VALUE(D % 2 == 0, op, ": k_cache: expected an even head dim (RoPE), got ", D);
  check_dtype(input_norm, op, "input_norm", at::kFloat);
  check_shape(input_norm, op, "input_norm", {H}, "[H]");
  check_device(input_norm, op, "input_norm", dev);
  check_dtype(post_norm, op, "post_norm", at::kFloat);
  check_shape(post_norm, op, "post_norm", {H}, "[H]");
  check_device(post_norm, op, "post_norm", dev);
  const int64_t Hq = num_heads;
  check_weight(qkv_weight, op, "qkv_weight", (Hq + 2 * Hkv) * D, H, "[(num_heads + 2 Hkv) D, H]", dev);
  check_weight(o_weight, op, "o_weight", H, Hq * D, "[H, num_heads D]", dev);
  TORCH_CHECK_VALUE(gate_up_weight.dim() == 2 && gate_up_weight.size(0) % 2 == 0, op,
                    ": gate_up_weight: expected 2-D [2 I, H] (gate rows, then up rows), got shape ",
                    shape_str(gate_up_weight.sizes()));
  const int64_t I = gate_up_weight.size(0) / 2;
  check_weight(gate_up_weight, op, "gate_up_weight", 2 * I, H, "[2 I, H]", dev);
  check_weight(down_weight, op, "down_weight", H, I, "[H, I]", dev);
  check_dtype(cos_in, op, "cos", at::kFloat);
  check_shape(cos_in, op, "cos", {B, N, D}, "[B, N, D]");
  check_device(cos_in, op, "cos", dev);
  check_dtype(sin_in, op, "sin", at::kFloat);
  check_shape(sin_in, op, "sin", {B, N, D}, "[B, N, D]");
  check_device(sin_in, op, "sin", dev);
  // tree_mask and the cache capacity are checked by tree_attention and write_kv below, before
  // anything is written.
  if (tree_mask.has_value()) {
    check_dtype(*tree_mask, op, "tree_mask", at::kLong);
    check_shape(*tree_mask, op, "tree_mask", {B, N, (N + 63) / 64}, "[B, N, ceil(N / 64)]");
    check_device(*tree_mask, op, "tree_mask", dev);
  }

  const at::Tensor x = x_in.contiguous();
  const at::Tensor cos = cos_in.contiguous();
  const at::Tensor sin = sin_in.contiguous();
  const at::Tensor norm1 = input_norm.contiguous();
  const at::Tensor norm2 = post_norm.contiguous();
  const int64_t rows = B * N;
  if (rows == 0) return x.clone();

  at::Tensor h = at::empty({B, N, H}, x.options());
  rms_norm_rows(x.data_ptr<float>(), norm1.data_ptr<float>(), rows, H, eps, h.data_ptr<float>());
  at::Tensor qkv = cpu_linear_cpu(h, qkv_weight).view({B, N, Hq + 2 * Hkv, D});
  rope_rows(qkv.data_ptr<float>(), rows, Hq + 2 * Hkv, Hq + Hkv, D, cos.data_ptr<float>(), sin.data_ptr<float>());
  write_kv_cpu(k_cache, v_cache, qkv.narrow(2, Hq, Hkv), qkv.narrow(2, Hq + Hkv, Hkv), cache_seqlens,
               std::nullopt);
  at::Tensor attn = tree_attention_cpu(qkv.narrow(2, 0, Hq), k_cache, v_cache, cache_seqlens, tree_mask,
                                       std::nullopt, std::nullopt);
  at::Tensor x1 = add(x, cpu_linear_cpu(attn.view({B, N, Hq * D}), o_weight));

  rms_norm_rows(x1.data_ptr<float>(), norm2.data_ptr<float>(), rows, H, eps, h.data_ptr<float>());
  at::Tensor gate_up = cpu_linear_cpu(h, gate_up_weight);  // [B, N, 2 I]: gate, then up
  // ATen's vectorised SiLU, in place on the gate half, then * up: two calls per layer, and the
  // same values as the op-by-op path's F.silu(gate) * up.
  at::Tensor gate = gate_up.narrow(2, 0, I);
  at::silu_(gate);
  const at::Tensor act = at::mul(gate, gate_up.narrow(2, I, I));
  return add(x1, cpu_linear_cpu(act, down_weight));
}

}  // namespace eagle
