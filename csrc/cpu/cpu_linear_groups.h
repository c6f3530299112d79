// Internal to cpu_linear: the GEMM scaffolding of the packed layout, shared by its two kernels (fp32 / bf16 /
// fp16 weights in cpu_linear_packed.cpp, Q8_0 / Q4_1 blocks in cpu_linear_quant.cpp). A kernel brings its
// tiles; this header runs them over a range of 32-column groups (row tiles of near-equal size, groups side by
// side at few rows, only the first row tile streaming the weights from DRAM) at the instruction set of the
// call, and splits the groups over the threads.
//
// A tile set `T` provides:
//   using Elem;                                 the packed weight's element type (a pointer to it walks a group)
//   using X;                                    a row of x's element type (float; a block of 8-bit activations)
//   static int64_t group_elems(int64_t depth);  Elems per group (depth: K, or the blocks per half)
//   static constexpr int kMaxRows;              rows of x per AVX-512 tile (1 .. kMaxRows)
//   static constexpr int groups_for(int C);     groups side by side in an AVX-512 tile of C rows
//   template <int G, int C> static void tile512(const Elem* w, int64_t depth, const X* x, int64_t ldx,
//                                               float* out, int64_t ldo, bool prefetch);
//   static constexpr int kMaxRows256;           rows of x per AVX2 tile
//   template <int C> static void tile256(...);  the same arguments, one half of a group (16 columns)
//   static void group_scalar(const Elem* w, int64_t depth, const X* x, int64_t ldx, int64_t M, float* out,
//                            int64_t ldo);      one group, all M rows, portable
// The tile functions exist where EAGLE_X86_SIMD is set.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "cpu_linear_impl.h"
#include "simd.h"

namespace eagle {
namespace linear_impl {

#if EAGLE_X86_SIMD
// One k step of an AVX2 tile over one half of a group (16 columns: a, b hold 8 each, widened to fp32) and C rows
// of x (x: column k of the first row): acc_a[c] += a * x[c * ldx], acc_b[c] += b * x[c * ldx].
template <int C>
EAGLE_TARGET_AVX2 inline void half_step256(__m256 a, __m256 b, const float* x, int64_t ldx, __m256 (&acc_a)[C],
                                           __m256 (&acc_b)[C]) {
  EAGLE_UNROLL
  for (int c = 0; c < C; ++c) {
    const __m256 xv = _mm256_broadcast_ss(x + c * ldx);
    acc_a[c] = _mm256_fmadd_ps(a, xv, acc_a[c]);
    acc_b[c] = _mm256_fmadd_ps(b, xv, acc_b[c]);
  }
}

// An AVX2 half tile's results: out[c * ldo + j], j < 16.
template <int C>
EAGLE_TARGET_AVX2 inline void store_half256(const __m256 (&acc_a)[C], const __m256 (&acc_b)[C], float* out,
                                            int64_t ldo) {
  EAGLE_UNROLL
  for (int c = 0; c < C; ++c) {
    _mm256_storeu_ps(out + c * ldo, acc_a[c]);
    _mm256_storeu_ps(out + c * ldo + 8, acc_b[c]);
  }
}

// T::tile512<G, C> for a C (1 .. C_max) known at run time; G = T::groups_for(C) if `wide`, else 1.
template <typename T, int C>
void tile512_rows(int64_t C_run, bool wide, const typename T::Elem* w, int64_t depth, const typename T::X* x,
                  int64_t ldx, float* out, int64_t ldo, bool prefetch) {
  if constexpr (C > 1) {
    if (C_run < C) return tile512_rows<T, C - 1>(C_run, wide, w, depth, x, ldx, out, ldo, prefetch);
  }
  if (wide)
    T::template tile512<T::groups_for(C), C>(w, depth, x, ldx, out, ldo, prefetch);
  else
    T::template tile512<1, C>(w, depth, x, ldx, out, ldo, prefetch);
}

// T::tile256<C> for a C (1 .. C_max) known at run time.
template <typename T, int C>
void tile256_rows(int64_t C_run, const typename T::Elem* w, int64_t depth, const typename T::X* x, int64_t ldx,
                  float* out, int64_t ldo, bool prefetch) {
  if constexpr (C > 1) {
    if (C_run < C) return tile256_rows<T, C - 1>(C_run, w, depth, x, ldx, out, ldo, prefetch);
  }
  T::template tile256<C>(w, depth, x, ldx, out, ldo, prefetch);
}
#endif  // EAGLE_X86_SIMD

// The tile set of a block-quantized layout (cpu_linear_quant.cpp, cpu_linear_dot.cpp): Elem uint8_t, a group of two
// halves of `depth` blocks of F::kBytes, rows of x of type X. F, the format's tag type, carries the row counts
// (F::kMaxRows, F::groups_for(C), F::kMaxRows256); the kernel's functions taking F as their first argument are found
// by argument-dependent lookup in F's namespace: block_group_scalar(F, ...), block_tile512<G, C>(F, ...),
// block_tile256<C>(F, ...).
// Before C++20 (torch 2.11 builds extensions with -std=c++17) block_tile512<G, C>(F{}, ...) parses as a call only if
// a function template of that name is visible here: these two, never defined and taking no format, make it one, and
// argument-dependent lookup still finds the format's own overloads.
struct NoBlockFormat;
template <int G, int C>
void block_tile512(NoBlockFormat*);
template <int C>
void block_tile256(NoBlockFormat*);

template <typename F, typename XType>
struct BlockTiles {
  using Elem = uint8_t;
  using X = XType;
  static int64_t group_elems(int64_t nb) { return 2 * nb * F::kBytes; }
  static void group_scalar(const uint8_t* w, int64_t nb, const X* x, int64_t ldx, int64_t M, float* out, int64_t ldo) {
    block_group_scalar(F{}, w, nb, x, ldx, M, out, ldo);
  }
#if EAGLE_X86_SIMD
  static constexpr int kMaxRows = F::kMaxRows;
  static constexpr int groups_for(int C) { return F::groups_for(C); }
  static constexpr int kMaxRows256 = F::kMaxRows256;
  template <int G, int C>
  static void tile512(const uint8_t* w, int64_t nb, const X* x, int64_t ldx, float* out, int64_t ldo, bool prefetch) {
    block_tile512<G, C>(F{}, w, nb, x, ldx, out, ldo, prefetch);
  }
  template <int C>
  static void tile256(const uint8_t* w, int64_t nb, const X* x, int64_t ldx, float* out, int64_t ldo, bool prefetch) {
    block_tile256<C>(F{}, w, nb, x, ldx, out, ldo, prefetch);
  }
#endif
};

// Groups [begin, end) of the packed weight against all M rows of x: out[m * ldo + 32 g + j].
template <typename T>
void run_groups(const typename T::Elem* packed, int64_t begin, int64_t end, int64_t depth, const typename T::X* x,
                int64_t ldx, int64_t M, float* out, int64_t ldo, isa::Level level) {
  constexpr int64_t kW = kPackWidth;
  const int64_t group_elems = T::group_elems(depth);
#if EAGLE_X86_SIMD
  if (level >= isa::Level::kAvx512Ymm) {
    // Row tiles of near-equal size (8 + 8 at M = 16 rather than 12 + 4). Groups side by side
    // (G > 1) only when one tile holds all M rows (two tiles have 7 rows or more, G = 1), so the
    // tile's own groups_for(C) is G. Later row tiles find the weights in L2: only the first
    // streams (and prefetches) them from DRAM.
    const int64_t tiles = (M + T::kMaxRows - 1) / T::kMaxRows;
    const int64_t G = tiles == 1 ? T::groups_for(static_cast<int>(M)) : 1;
    for (int64_t g = begin; g < end;) {
      const bool wide = G > 1 && g + G <= end;  // the range's last groups may not fill a wide tile
      const typename T::Elem* w = packed + g * group_elems;
      for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int64_t C = (M - m) / (tiles - t);
        tile512_rows<T, T::kMaxRows>(C, wide, w, depth, x + m * ldx, ldx, out + m * ldo + g * kW, ldo, t == 0);
        m += C;
      }
      g += wide ? G : 1;
    }
    return;
  }
  if (level >= isa::Level::kAvx2) {
    // Half by half (16 registers hold one half's tile): each half is read once from DRAM, by the
    // first row tile, and from L2 by the others.
    const int64_t tiles = (M + T::kMaxRows256 - 1) / T::kMaxRows256;
    for (int64_t g = begin; g < end; ++g)
      for (int64_t h = 0; h < 2; ++h) {
        const typename T::Elem* w = packed + g * group_elems + h * (group_elems / 2);
        for (int64_t t = 0, m = 0; t < tiles; ++t) {
          const int64_t C = (M - m) / (tiles - t);
          tile256_rows<T, T::kMaxRows256>(C, w, depth, x + m * ldx, ldx, out + m * ldo + g * kW + h * (kW / 2), ldo,
                                          t == 0);
          m += C;
        }
      }
    return;
  }
#endif
  (void)level;
  for (int64_t g = begin; g < end; ++g) T::group_scalar(packed + g * group_elems, depth, x, ldx, M, out + g * kW, ldo);
}

// fn(begin, end) over the `groups` 32-column groups of a weight with K input features, split over the threads in
// tasks of about parallel_chunk() multiply-adds (M counted as at least 8: few-row calls stay on fewer threads).
template <typename Fn>
void parallel_groups(int64_t groups, int64_t K, int64_t M, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, parallel_chunk() / (kPackWidth * K * std::max<int64_t>(M, 8)));
  at::parallel_for(0, groups, grain, fn);
}

}  // namespace linear_impl
}  // namespace eagle
