// CPU launcher of compact_kv: validate -> read-only inputs made dense -> value checks ->
// parallel over (layer, request, head) workers of the shared core (csrc/core/compact_kv.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>

#include "checks.h"
#include "core/compact_kv.h"
#include "ops.h"

namespace eagle {
namespace {

namespace core = compact_kv;

// Reads accept_len / accept_nodes / cache_seqlens / block_table on the host so that the copy
// loop never leaves the cache (the core would skip such rows, but silently). Same conditions
// as eagle_kernels/_checks.py::check_compact_kv, so every path rejects the same inputs.
void check_compact_kv_values(const core::Params& p) {
  const int64_t capacity = p.paged ? p.max_pages * p.seq_len : p.seq_len;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t len = p.accept_len[b];
    TORCH_CHECK_VALUE(len >= 0 && len <= p.accept_width - 1, "compact_kv: accept_len: expected values in [0, ",
                      p.accept_width - 1, "] (max_depth), got accept_len[", b, "] = ", len);
    const int32_t* nodes = p.accept_nodes + b * p.accept_width;
    TORCH_CHECK_VALUE(nodes[0] == 0, "compact_kv: accept_nodes: expected accept_nodes[:, 0] == 0 ",
                      "(the root), got accept_nodes[", b, ", 0] = ", nodes[0]);
    for (int64_t j = 1; j <= len; ++j) {
      TORCH_CHECK_VALUE(nodes[j] > nodes[j - 1],
                        "compact_kv: accept_nodes: expected strictly increasing node indices "
                        "along the accepted path, got accept_nodes[",
                        b, ", ", j, "] = ", nodes[j], " after ", nodes[j - 1]);
    }
    const int64_t base = p.cache_seqlens[b];
    TORCH_CHECK_VALUE(base >= 0, "compact_kv: cache_seqlens: expected non-negative lengths, got ", "cache_seqlens[", b,
                      "] = ", base);
    const int64_t needed = base + nodes[len] + 1;  // positions the request addresses
    TORCH_CHECK_VALUE(needed <= capacity, "compact_kv: cache_seqlens: expected cache_seqlens + ",
                      "accept_nodes[accept_len] + 1 <= cache capacity ", capacity, ", got ", needed, " for request ",
                      b);
    if (!p.paged) continue;
    for (int64_t slot = 0; slot * p.seq_len < needed; ++slot) {
      const int64_t page = p.block_table[b * p.max_pages + slot];
      TORCH_CHECK_VALUE(page >= 0 && page < p.num_pages, "compact_kv: block_table: expected page ids in [0, ",
                        p.num_pages, ") for the pages in use, got block_table[", b, ", ", slot, "] = ", page);
    }
  }
}

template <typename Word>
void run(const core::Params& p) {
  const int64_t workers = core::num_workers(p);
  const int64_t bytes_per_worker = std::max<int64_t>(1, 2 * p.row_bytes * p.accept_width);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / bytes_per_worker);
  at::parallel_for(0, workers, grain, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) core::run_worker<Word>(p, w, 0, 1);
  });
}

}  // namespace

void compact_kv_cpu(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                    const at::Tensor& accept_nodes, const at::Tensor& accept_len,
                    const std::optional<at::Tensor>& block_table) {
  TORCH_CHECK_VALUE(k_cache.device().is_cpu(), "compact_kv: k_cache: expected device cpu, got ", k_cache.device());
  const at::Tensor seqlens = cache_seqlens.contiguous();
  const at::Tensor nodes = accept_nodes.contiguous();
  const at::Tensor lens = accept_len.contiguous();
  std::optional<at::Tensor> table;
  if (block_table.has_value()) table = block_table->contiguous();
  const core::Params p = check_compact_kv_args(k_cache, v_cache, seqlens, nodes, lens, table);
  check_compact_kv_values(p);
  if (k_cache.numel() == 0) return;
  switch (compact_kv_word_bytes(p)) {
    case 16:
      run<core::WordOf<16>::type>(p);
      break;
    case 8:
      run<core::WordOf<8>::type>(p);
      break;
    case 4:
      run<core::WordOf<4>::type>(p);
      break;
    case 2:
      run<core::WordOf<2>::type>(p);
      break;
    default:
      run<core::WordOf<1>::type>(p);
      break;
  }
}

}  // namespace eagle
