// Torch-facing CUDA launchers: validate metadata (no value reads: the CUDA path stays
// sync-free) -> make read-only inputs dense -> allocate -> device guard + current stream ->
// plain launch (csrc/cuda/launch.h) -> launch-error check. Compiled only with EAGLE_WITH_CUDA.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "checks.h"
#include "cuda/launch.h"
#include "ops.h"

namespace eagle {

TreeTensors build_tree_cuda(const at::Tensor& root_tokens, const at::Tensor& cand_tokens, const at::Tensor& cand_scores,
                            const at::Tensor& cand_parents, int64_t num_nodes) {
  const BuildTreeDims d = check_build_tree_args(root_tokens, cand_tokens, cand_scores, cand_parents, num_nodes);
  TORCH_CHECK_VALUE(cand_tokens.is_cuda(),
                    "build_tree: cand_tokens: expected a CUDA device, "
                    "got ",
                    cand_tokens.device());
  const c10::cuda::CUDAGuard guard(cand_tokens.device());
  const int64_t B = d.B, C = d.C, N = d.N, W = mask_words(N);

  const at::Tensor root = root_tokens.contiguous();
  const at::Tensor ctok = cand_tokens.contiguous();
  const at::Tensor cscore = cand_scores.contiguous();
  const at::Tensor cpar = cand_parents.contiguous();
  const auto opts = root.options();
  at::Tensor tokens = at::empty({B, N}, opts.dtype(at::kLong));
  at::Tensor parents = at::empty({B, N}, opts.dtype(at::kInt));
  at::Tensor depths = at::empty({B, N}, opts.dtype(at::kInt));
  at::Tensor mask = at::empty({B, N, W}, opts.dtype(at::kLong));
  const size_t ws_bytes = cuda::build_tree_workspace_bytes(B, C);
  at::Tensor workspace;
  if (ws_bytes > 0) workspace = at::empty({static_cast<int64_t>(ws_bytes)}, opts.dtype(at::kByte));

  const cudaError_t err = cuda::launch_build_tree(
      root.data_ptr<int64_t>(), ctok.data_ptr<int64_t>(), cscore.data_ptr<float>(), cpar.data_ptr<int32_t>(), B, C, N,
      tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(), depths.data_ptr<int32_t>(), mask.data_ptr<int64_t>(),
      ws_bytes > 0 ? workspace.data_ptr<uint8_t>() : nullptr,
      c10::cuda::getCurrentCUDAStream(root.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, "build_tree: CUDA launch failed: ", cudaGetErrorString(err));
  return {tokens, parents, depths, mask};
}

void compact_kv_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                     const at::Tensor& accept_nodes, const at::Tensor& accept_len,
                     const std::optional<at::Tensor>& block_table) {
  // Shapes, dtypes and devices first, so that a tensor on the wrong device is named even when
  // it is the one that sent the call here (k_cache on the CPU, another argument on CUDA).
  (void)check_compact_kv_args(k_cache, v_cache, cache_seqlens, accept_nodes, accept_len, block_table);
  TORCH_CHECK_VALUE(k_cache.is_cuda(), "compact_kv: k_cache: expected a CUDA device, got ", k_cache.device());
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const at::Tensor seqlens = cache_seqlens.contiguous();
  const at::Tensor nodes = accept_nodes.contiguous();
  const at::Tensor lens = accept_len.contiguous();
  std::optional<at::Tensor> table;
  if (block_table.has_value()) table = block_table->contiguous();
  const compact_kv::Params p = check_compact_kv_args(k_cache, v_cache, seqlens, nodes, lens, table);
  if (k_cache.numel() == 0) return;
  const cudaError_t err = cuda::launch_compact_kv(p, compact_kv_word_bytes(p),
                                                  c10::cuda::getCurrentCUDAStream(k_cache.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, "compact_kv: CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace eagle
