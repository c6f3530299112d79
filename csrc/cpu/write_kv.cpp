// CPU launcher of write_kv: store the K/V of N new tokens at logical positions
// cache_seqlens[b] + i (contiguous or paged cache), in place. Parallel over (request, token)
// rows; each row copies Hkv * D elements of K and of V.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>

#include "checks.h"
#include "ops.h"

namespace eagle {

void write_kv_cpu(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_new,
                  const at::Tensor& v_new, const at::Tensor& cache_seqlens,
                  const std::optional<at::Tensor>& block_table) {
  write_kv_named("write_kv", k_cache, v_cache, k_new, v_new, cache_seqlens, block_table);
}

void write_kv_named(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_new,
                    const at::Tensor& v_new, const at::Tensor& cache_seqlens,
                    const std::optional<at::Tensor>& block_table) {
  // Same order and wording as eagle_kernels/_checks.py::check_write_kv.
  check_float_dtype(k_new, op, "k_new");
  check_dim(k_new, op, "k_new", 4, "[B, N, Hkv, D]");
  const at::Device dev = k_new.device();
  TORCH_CHECK_VALUE(dev.is_cpu(), op, ": k_new: expected device cpu, got ", dev);
  const int64_t B = k_new.size(0), N = k_new.size(1), Hkv = k_new.size(2), D = k_new.size(3);
  check_dtype(v_new, op, "v_new", k_new.scalar_type());
  check_shape(v_new, op, "v_new", k_new.sizes().vec(), "[B, N, Hkv, D] like k_new");
  check_device(v_new, op, "v_new", dev);
  const bool paged = block_table.has_value();
  const char* layout = paged ? "[P, page_size, Hkv, D]" : "[B, S, Hkv, D]";
  check_dtype(k_cache, op, "k_cache", k_new.scalar_type());
  check_dim(k_cache, op, "k_cache", 4, layout);
  check_device(k_cache, op, "k_cache", dev);
  const int64_t max_pages = check_kv_cache_args(op, k_cache, v_cache, cache_seqlens, block_table, B, 0, layout, dev);
  const at::Tensor table = paged ? block_table->contiguous() : at::Tensor();
  TORCH_CHECK_VALUE(k_cache.size(2) == Hkv && k_cache.size(3) == D, op,
                    ": k_cache: expected heads and head dim [*, *, ", Hkv, ", ", D, "] as in k_new, got shape ",
                    shape_str(k_cache.sizes()));
  check_dense_head_dim(op, k_cache, v_cache);

  const at::Tensor seqlens = cache_seqlens.contiguous();
  const int32_t* lens = seqlens.data_ptr<int32_t>();
  const int32_t* bt = paged ? table.data_ptr<int32_t>() : nullptr;
  const int64_t page_size = k_cache.size(1);
  const int64_t capacity = paged ? max_pages * page_size : page_size;
  const int64_t num_pages = k_cache.size(0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b];
    TORCH_CHECK_VALUE(len >= 0, op, ": cache_seqlens: expected non-negative lengths, got ", "cache_seqlens[", b,
                      "] = ", len);
    TORCH_CHECK_VALUE(len + N <= capacity, op, ": cache_seqlens: expected cache_seqlens + N ", "<= cache capacity ",
                      capacity, ", got ", len + N, " for request ", b);
    if (!paged) continue;
    for (int64_t slot = 0; slot * page_size < len + N; ++slot) {
      const int64_t page = bt[b * max_pages + slot];
      TORCH_CHECK_VALUE(page >= 0 && page < num_pages, op, ": block_table: expected page ids in [0, ", num_pages,
                        ") for the pages in use, got block_table[", b, ", ", slot, "] = ", page);
    }
  }
  if (k_new.numel() == 0) return;

  // Rows of k_new / v_new are read where they are (e.g. the K and V columns of a fused q/k/v
  // projection, as cpu_decoder_layer passes them): only a head dim that is not dense is copied.
  const at::Tensor kn = k_new.stride(3) == 1 ? k_new : k_new.contiguous();
  const at::Tensor vn = v_new.stride(3) == 1 ? v_new : v_new.contiguous();
  const int64_t es = static_cast<int64_t>(k_cache.element_size());
  const int64_t row_bytes = D * es;
  const char* ksrc = static_cast<const char*>(kn.data_ptr());
  const char* vsrc = static_cast<const char*>(vn.data_ptr());
  const int64_t kns[3] = {kn.stride(0) * es, kn.stride(1) * es, kn.stride(2) * es};
  const int64_t vns[3] = {vn.stride(0) * es, vn.stride(1) * es, vn.stride(2) * es};
  char* kdst = static_cast<char*>(k_cache.data_ptr());
  char* vdst = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks[3] = {k_cache.stride(0) * es, k_cache.stride(1) * es, k_cache.stride(2) * es};
  const int64_t vs[3] = {v_cache.stride(0) * es, v_cache.stride(1) * es, v_cache.stride(2) * es};
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, 2 * Hkv * row_bytes));
  at::parallel_for(0, B * N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / N, i = row % N;
      const int64_t t = lens[b] + i;
      int64_t outer = b, pos = t;
      if (paged) {
        outer = bt[b * max_pages + t / page_size];
        pos = t % page_size;
      }
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(kdst + outer * ks[0] + pos * ks[1] + h * ks[2], ksrc + b * kns[0] + i * kns[1] + h * kns[2],
                    row_bytes);
        std::memcpy(vdst + outer * vs[0] + pos * vs[1] + h * vs[2], vsrc + b * vns[0] + i * vns[1] + h * vns[2],
                    row_bytes);
      }
    }
  });
}

}  // namespace eagle
