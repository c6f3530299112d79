// CUDA build_tree: one thread block per request running the three phases of
// csrc/core/build_tree.h with the block's threads spread over candidates, then over nodes.
#include "core/build_tree.h"
#include "cuda/launch.h"

namespace eagle {
namespace cuda {
namespace {

constexpr int kThreads = 256;
// Per-request scratch: ranking keys (float [C]) then selection flags (uint8 [C]). In shared
// memory up to this many candidates (40 KiB, under the 48 KiB default limit), in the caller's
// global workspace above it.
constexpr int64_t kMaxSharedCandidates = 8 * 1024;
constexpr int64_t kScratchPerCandidate = sizeof(float) + sizeof(uint8_t);

__global__ void build_tree_kernel(const int64_t* __restrict__ root_tokens,   // [B]
                                  const int64_t* __restrict__ cand_tokens,   // [B, C]
                                  const float* __restrict__ cand_scores,     // [B, C]
                                  const int32_t* __restrict__ cand_parents,  // [B, C]
                                  int64_t C, int64_t N,
                                  int64_t* __restrict__ tokens,    // [B, N]
                                  int32_t* __restrict__ parents,   // [B, N]
                                  int32_t* __restrict__ depths,    // [B, N]
                                  int64_t* __restrict__ mask,      // [B, N, W]
                                  char* __restrict__ workspace) {  // [B*C*5] bytes or null
  extern __shared__ float4 shared_scratch[];                       // float4: 16-byte aligned
  const int64_t b = blockIdx.x;
  const int64_t W = mask_words(N);
  // Global layout: keys [B, C] floats, then flags [B, C] bytes (keeps every key 4-aligned).
  float* keys;
  uint8_t* selected;
  if (workspace != nullptr) {
    keys = reinterpret_cast<float*>(workspace) + b * C;
    selected = reinterpret_cast<uint8_t*>(workspace + gridDim.x * C * sizeof(float)) + b * C;
  } else {
    keys = reinterpret_cast<float*>(shared_scratch);
    selected = reinterpret_cast<uint8_t*>(keys + C);
  }
  const float* scores = cand_scores + b * C;
  int64_t* tok = tokens + b * N;
  int32_t* par = parents + b * N;

  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) keys[c] = build_tree::rank_key(scores[c]);
  __syncthreads();
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    selected[c] = build_tree::select_candidate(keys, C, c, N - 1) ? 1 : 0;
  __syncthreads();
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    build_tree::place_candidate(selected, cand_tokens + b * C, cand_parents + b * C, c, tok, par);
  if (threadIdx.x == 0) build_tree::place_root(root_tokens[b], tok, par);
  // Phase 3 reads parents written by other threads; __syncthreads makes global writes of the
  // block visible to the whole block.
  __syncthreads();
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
    build_tree::fill_depth_mask(par, N, i, depths + b * N, mask + (b * N + i) * W);
}

}  // namespace

size_t build_tree_workspace_bytes(int64_t B, int64_t C) {
  return C > kMaxSharedCandidates ? static_cast<size_t>(B * C * kScratchPerCandidate) : 0;
}

cudaError_t launch_build_tree(const int64_t* root_tokens, const int64_t* cand_tokens, const float* cand_scores,
                              const int32_t* cand_parents, int64_t B, int64_t C, int64_t N, int64_t* tokens,
                              int32_t* parents, int32_t* depths, int64_t* mask, uint8_t* workspace,
                              cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  if (B > 0x7fffffff || N < 1 || N - 1 > C) return cudaErrorInvalidValue;
  const bool use_shared = C <= kMaxSharedCandidates;
  if (!use_shared && workspace == nullptr) return cudaErrorInvalidValue;
  const size_t shared_bytes = use_shared ? static_cast<size_t>(C * kScratchPerCandidate) : 0;
  build_tree_kernel<<<static_cast<unsigned>(B), kThreads, shared_bytes, stream>>>(
      root_tokens, cand_tokens, cand_scores, cand_parents, C, N, tokens, parents, depths, mask,
      use_shared ? nullptr : reinterpret_cast<char*>(workspace));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace eagle
