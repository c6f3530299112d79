// Shared helpers for the torch-free kernel cores (compiled by both g++ and nvcc).
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define HOST_DEVICE __host__ __device__
#else
#define HOST_DEVICE
#endif

namespace eagle {

HOST_DEVICE inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Number of int64 words per row of a tree mask over n nodes.
HOST_DEVICE inline int64_t mask_words(int64_t n) { return ceil_div(n, 64); }

// NaN compares false against everything, which would make ranking by score inconsistent
// (not a strict weak order); the contract ranks NaN as -inf instead.
HOST_DEVICE inline float nan_as_neg_inf(float x) { return x != x ? -__builtin_huge_valf() : x; }

}  // namespace eagle
