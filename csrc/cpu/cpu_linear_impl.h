// Internal to cpu_linear: what its two kernels (row-major weights in cpu_linear.cpp, packed
// weights in cpu_linear_packed.cpp) share. Not part of the op API.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "simd.h"

namespace eagle {
namespace linear_impl {

// Multiply-adds per parallel task (EAGLE_KERNELS_CPU_LINEAR_CHUNK, default 2^20).
int64_t parallel_chunk();

// Columns per group of a packed weight [N / 32, 2, K, 16] (two halves of 16 columns, K-major).
constexpr int64_t kPackWidth = 32;

// out[m * ldo + n] = sum_k x[m * ldx + k] * W[n, k] for the packed weight `packed` (groups of
// kPackWidth columns, dtype `wtype`: float, or the raw bits of bf16 / fp16), N = groups * 32,
// with the vector path of `level` (isa::current()). `pairs`: bf16 in the pair layout
// [N / 32, 2, K / 2, 16, 2] (K even), else [N / 32, 2, K, 16].
void packed_linear(const void* packed, at::ScalarType wtype, bool pairs, int64_t groups, const float* x, int64_t ldx,
                   int64_t M, int64_t K, float* out, int64_t ldo, isa::Level level);

// Whether a packed fp32 / bf16 / fp16 weight is in the bf16 pair layout (5-D).
inline bool is_pair_packed(const at::Tensor& w) { return w.dim() == 5 && w.scalar_type() == at::kBFloat16; }

// Weight-only quantized weights (cpu_linear_quant.cpp): packed blocks of kQuantBlock k steps per half of a group,
// int8 [N / 32, 2, K / 32, kQ8BlockBytes] for Q8_0, uint8 [N / 32, 2, K / 32, kQ41BlockBytes] for Q4_1.
constexpr int64_t kQuantBlock = 32;
constexpr int64_t kQ8BlockBytes = 32 + 32 * 16;   // 16 fp16 scales, 32 x 16 int8 quants
constexpr int64_t kQ41BlockBytes = 64 + 16 * 16;  // 16 fp16 scales, 16 fp16 minimums, 16 x 16 bytes of nibble pairs
// The same blocks packed for 8-bit activations (cpu_linear_dot.cpp): 5-D [N / 32, 2, K / 32, lines, 32], lines of 32
// bytes per block of a half (kQ8BlockBytes / 32 = 17, kQ41BlockBytes / 32 = 10).
enum class QuantFormat { kQ8_0, kQ4_1, kQ8_0Int8, kQ4_1Int8 };
constexpr int64_t kDotLineBytes = 32;

// Checks a packed fp32 / bf16 / fp16 weight (4-D, or bf16 pairs 5-D) for `rows` output features (-1: any multiple
// of 32) and K input features (ValueError naming `name`).
void check_packed_float(const at::Tensor& w, const char* op, const char* name, int64_t rows, int64_t K);

// Whether `w` has a quantized dtype (int8: Q8_0, uint8: Q4_1).
bool is_quantized(const at::Tensor& w);

// The format of a quantized weight (is_quantized): int8 Q8_0, uint8 Q4_1; 5-D: packed for 8-bit activations.
QuantFormat quant_format(const at::Tensor& w);

// Checks a quantized packed weight for `rows` output features (-1: any multiple of 32) and K input features
// (ValueError naming `name`); returns its format.
QuantFormat check_quantized(const at::Tensor& w, const char* op, const char* name, int64_t rows, int64_t K);

// out[m * ldo + n] = sum_k x[m * ldx + k] * W[n, k] for the quantized packed weight `packed` (groups of 32
// columns, K a multiple of 32).
void quant_linear(const uint8_t* packed, QuantFormat format, int64_t groups, const float* x, int64_t ldx, int64_t M,
                  int64_t K, float* out, int64_t ldo, isa::Level level);

// The same for a weight packed for 8-bit activations (format kQ8_0Int8 / kQ4_1Int8): x quantized per row and block
// of 32 (GGML's Q8 activations), exact integer dot products per block.
void dot_linear(const uint8_t* packed, QuantFormat format, int64_t groups, const float* x, int64_t ldx, int64_t M,
                int64_t K, float* out, int64_t ldo, isa::Level level);

// out[m * ldo + n] = sum_k x[m * ldx + k] * W[n, k] for any weight cpu_linear takes (row-major fp32 / bf16 / fp16,
// packed, or quantized packed), already checked: the kernel of its layout. cpu_linear and cpu_decoder_layer (on its
// workspace) both call it.
void linear_rows(const at::Tensor& weight, const float* x, int64_t ldx, int64_t M, int64_t K, float* out, int64_t ldo,
                 isa::Level level);

}  // namespace linear_impl
}  // namespace eagle
