// Internal to cpu_linear: what its two kernels (row-major weights in cpu_linear.cpp, packed
// weights in cpu_linear_packed.cpp) share. Not part of the op API.
#pragma once

#include <ATen/core/ScalarType.h>

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
// with the vector path of `level` (isa::current()).
void packed_linear(const void* packed, at::ScalarType wtype, int64_t groups, const float* x, int64_t ldx, int64_t M,
                   int64_t K, float* out, int64_t ldo, isa::Level level);

}  // namespace linear_impl
}  // namespace eagle
