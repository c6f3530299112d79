// Plain launch API of the CUDA kernels in csrc/cuda/*.cu: raw pointers, sizes and a stream in,
// cudaError_t out. No torch headers here or in the .cu files; csrc/cuda/ops_cuda.cpp is the
// torch-facing side (validation, allocation, device guard, current stream).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/compact_kv.h"

namespace eagle {
namespace cuda {

// Bytes of global scratch build_tree needs (0 when the per-request selection flags fit in
// shared memory). The caller passes a buffer of at least this size as `workspace`.
size_t build_tree_workspace_bytes(int64_t B, int64_t C);

// Inputs: root_tokens [B], cand_tokens [B, C], cand_scores [B, C], cand_parents [B, C].
// Outputs: tokens [B, N], parents [B, N], depths [B, N], mask [B, N, ceil(N / 64)].
// All dense, on the current device. Values are not validated (sync-free path): malformed
// cand_parents give a wrong tree but never an out-of-bounds access.
cudaError_t launch_build_tree(const int64_t* root_tokens, const int64_t* cand_tokens, const float* cand_scores,
                              const int32_t* cand_parents, int64_t B, int64_t C, int64_t N, int64_t* tokens,
                              int32_t* parents, int32_t* depths, int64_t* mask, uint8_t* workspace,
                              cudaStream_t stream);

// In-place compaction described by `p` (device pointers). `word_bytes` (1, 2, 4, 8 or 16)
// must divide the row size, every stride and both base addresses. Rows outside the cache are
// skipped.
cudaError_t launch_compact_kv(const compact_kv::Params& p, int word_bytes, cudaStream_t stream);

}  // namespace cuda
}  // namespace eagle
