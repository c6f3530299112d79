// CUDA compact_kv: blockDim.y workers of (layer, request, head) per block, blockDim.x lanes
// per worker splitting each row into words; every lane runs the accepted path's j loop in
// increasing order (csrc/core/compact_kv.h explains why that makes overlapping moves safe).
#include "core/compact_kv.h"
#include "cuda/launch.h"

namespace eagle {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <typename Word>
__global__ void compact_kv_kernel(const compact_kv::Params p) {
  const int64_t worker = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (worker >= compact_kv::num_workers(p)) return;
  compact_kv::run_worker<Word>(p, worker, threadIdx.x, blockDim.x);
}

template <typename Word>
cudaError_t launch(const compact_kv::Params& p, cudaStream_t stream) {
  const int64_t workers = compact_kv::num_workers(p);
  const int64_t n_words = p.row_bytes / static_cast<int64_t>(sizeof(Word));
  if (workers == 0 || n_words == 0) return cudaSuccess;
  int lanes = 1;
  while (lanes < n_words && lanes < kThreads) lanes <<= 1;
  const int per_block = kThreads / lanes;
  const int64_t blocks = (workers + per_block - 1) / per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  compact_kv_kernel<Word><<<static_cast<unsigned>(blocks), dim3(lanes, per_block), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_compact_kv(const compact_kv::Params& p, int word_bytes, cudaStream_t stream) {
  switch (word_bytes) {
    case 16:
      return launch<compact_kv::WordOf<16>::type>(p, stream);
    case 8:
      return launch<compact_kv::WordOf<8>::type>(p, stream);
    case 4:
      return launch<compact_kv::WordOf<4>::type>(p, stream);
    case 2:
      return launch<compact_kv::WordOf<2>::type>(p, stream);
    case 1:
      return launch<compact_kv::WordOf<1>::type>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace eagle
