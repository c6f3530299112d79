// cpu_linear over a packed weight (eagle_kernels.cpu_linear_pack): W [N, K] stored as groups of
// 32 output columns, each group as two halves of 16 columns one after the other, K-major inside a
// half: packed [N / 32, 2, K, 16], packed[g, h, k, j] = W[32 g + 16 h + j, k] (every dtype; bf16 with K
// even in pairs of k, see "bf16 pair layout" below).
//
// Why a second layout: with row-major weights every FMA pairs a weight vector with a vector of
// x along K, so a tile of 4 weight rows reloads x for every 4 outputs and one output is
// reduced across lanes; at 8-12 rows of x that ran at ~60 GFLOP/s per forward on an Intel Xeon
// (AVX-512, two FMA units), a verify pass 1.3x the cost of a one-row pass. K-major, a vector
// holds 16 output columns of one k and x[m, k] is a broadcast memory operand: a tile of C rows
// of x and 32 columns keeps 2 C accumulators (up to 24 of 32 zmm registers), loads each weight
// vector once for C FMAs, and needs no horizontal sums: the classic GEMM micro-kernel. The two
// halves of a group are two separate weight streams: at 8-12 rows, where one group at a time is
// in flight, one SmolLM2 forward's linear layers took 21.4 / 22.5 ms with the halves apart
// against 25.0 / 25.1 ms with each k step's 32 columns side by side (2 threads, Intel Xeon):
// more streams for the hardware prefetchers to run ahead on while the FMAs are busy.
//
// Each output is one fp32 FMA chain over k = 0 .. K-1, starting from zero: its summation order
// is fixed by K alone, whatever M, the tiling, the vector width or the ISA. Rows are
// batch-invariant (a verify pass gives a token's row what decoding it alone gives), and the
// AVX-512, AVX2 and scalar paths (std::fma) give identical bits. The order differs from the
// row-major kernel's (eight lanes along K, then a lane sum), so the two layouts agree to fp32
// rounding, not bit for bit.
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_linear_groups.h"
#include "cpu_linear_impl.h"

namespace eagle {
namespace linear_impl {
namespace {

constexpr int64_t kW = kPackWidth;
constexpr int64_t kHalf = kPackWidth / 2;  // columns per half of a group: one zmm of fp32
constexpr int kMaxRows = 12;               // rows of x per AVX-512 tile: 2 x 12 accumulators + 2 weights + 1 x

// Rows of x per tile and groups side by side per tile for C rows: 2 G C accumulators and 2 G
// weight vectors fit 32 registers; at few rows several groups give the FMA chains to hide
// their latency and more weight streams in flight.
constexpr int groups_for(int C) { return C <= 2 ? 4 : C == 3 ? 3 : C <= 6 ? 2 : 1; }

// Weight bytes ahead of the current k step that a tile prefetches in each of its weight streams
// (two per group, into L2): the DRAM latency times the stream's rate, with margin.
// Measured on an Intel Xeon (2 threads, one SmolLM2 forward's linear layers at 12 rows, with a
// group's halves side by side, one stream): no prefetch 33.7 ms, 2 KiB 26.1, 4 KiB 24.5, 8-16
// KiB 24.5-25.5; T0 hints 26.1, NTA 41.4.
constexpr int64_t kPrefetchAhead = 4096;
// At one row of x (decoding) a k step is 2 G multiply-adds, and the streams ran faster with the prefetch 16 k steps
// ahead (1 KiB of fp32, 512 bytes of bf16 per stream): plain decoding of SmolLM2-135M, 1 thread, CPU time per
// token, interleaved in one process (Intel Xeon, busy VM): fp32 38.94 ms at 4 KiB, 38.27 at 2 KiB, 38.00 at 1 KiB,
// 39.04 at 8 KiB; bf16 22.58 at 4 KiB (128 steps), 22.05 at 1 KiB, 21.72 at 512 bytes.
constexpr int64_t kPrefetchStepsOneRow = 16;

using isa::Level;

// ------------------------------------------------------------------------------- scalar path
template <typename W>
void group_scalar(const W* w, const float* x, int64_t ldx, int64_t M, int64_t K, float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * ldx;
    for (int64_t j = 0; j < kW; ++j) {
      const W* column = w + (j / kHalf) * K * kHalf + j % kHalf;  // [K] with stride kHalf
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(widen(column[k * kHalf]), xm[k], acc);
      out[m * ldo + j] = acc;
    }
  }
}

#if EAGLE_X86_SIMD
// ---------------------------------------------------------------------------------- AVX-512
// The 16 columns of one k step of a half (load16) or 8 of them (load8), widened to fp32.
using simd::avx2::load8;
using simd::avx512::load16;
// G consecutive groups (w: the first, [G][2][K][16]) times C rows of x: out[c * ldo + 32 g + j].
template <int G, int C, typename W>
EAGLE_TARGET_AVX512 void tile512(const W* w, int64_t K, const float* x, int64_t ldx, float* out, int64_t ldo,
                                 bool prefetch) {
  constexpr int64_t step_bytes = kHalf * static_cast<int64_t>(sizeof(W));                 // per half and k step
  constexpr int64_t ahead = C == 1 ? kPrefetchStepsOneRow : kPrefetchAhead / step_bytes;  // k steps
  constexpr int64_t steps_per_line = 64 / step_bytes;                                     // 1 (fp32) or 2
  __m512 acc[G][2][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][0][c] = acc[g][1][c] = _mm512_setzero_ps();
  const int64_t half_stride = K * kHalf;
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch && k % steps_per_line == 0) {
      // Past the halves' ends each stream runs on into the same stream of the next tile (the 2 G
      // halves after these), so that a tile starts with its first lines on the way: reading on
      // into the next half instead left 2 G - 1 of a tile's streams to start on demand misses.
      // Past the last group's end a prefetch is a hint that never faults.
      const int64_t kp = k + ahead;
      const W* line = kp < K ? w + kp * kHalf : w + (2 * G - 1) * half_stride + (kp - K) * kHalf;
      for (int g = 0; g < 2 * G; ++g) _mm_prefetch(reinterpret_cast<const char*>(line + g * half_stride), _MM_HINT_T1);
    }
    __m512 lo[G], hi[G];
    for (int g = 0; g < G; ++g) {
      lo[g] = load16(w + (2 * g) * half_stride + k * kHalf);
      hi[g] = load16(w + (2 * g + 1) * half_stride + k * kHalf);
    }
    for (int c = 0; c < C; ++c) {
      const __m512 xv = _mm512_set1_ps(x[c * ldx + k]);
      for (int g = 0; g < G; ++g) {
        acc[g][0][c] = _mm512_fmadd_ps(lo[g], xv, acc[g][0][c]);
        acc[g][1][c] = _mm512_fmadd_ps(hi[g], xv, acc[g][1][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int g = 0; g < G; ++g) {
      _mm512_storeu_ps(out + c * ldo + g * kW, acc[g][0][c]);
      _mm512_storeu_ps(out + c * ldo + g * kW + kHalf, acc[g][1][c]);
    }
}

// ------------------------------------------------------------------------------------- AVX2
// AVX2 tiles take one half of a group: 2 x 6 accumulators + 2 weights + 1 x of 16 registers, each
// weight vector serving up to 6 FMAs (the loops over C unrolled by EAGLE_UNROLL: rolled, GCC 12 kept
// the accumulators in memory and stored all 2 C of them every k step, which ran these tiles at about
// a third of the FMA rate; docs/cpu_kernels.md, "Accumulators kept in registers"). Since then, in
// cache, 2.4-2.9x the earlier rate at 4-16 rows and about even with the row-major AVX2 kernel's
// tiles in a whole SmolLM2 forward's linear layers (weights streamed from DRAM; Zen AVX2 VM), so
// the model still packs weights only for the AVX-512 path.
constexpr int kMaxRows256 = 6;

// One half (w: [K][16], a contiguous stream) times C rows of x: out[c * ldo + j], j < 16.
template <int C, typename W>
EAGLE_TARGET_AVX2 void tile256(const W* w, int64_t K, const float* x, int64_t ldx, float* out, int64_t ldo,
                               bool prefetch) {
  constexpr int64_t step_bytes = kHalf * static_cast<int64_t>(sizeof(W));
  constexpr int64_t ahead = kPrefetchAhead / step_bytes;
  constexpr int64_t steps_per_line = 64 / step_bytes;
  __m256 acc_a[C], acc_b[C];
  EAGLE_UNROLL
  for (int c = 0; c < C; ++c) acc_a[c] = acc_b[c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch && k % steps_per_line == 0)
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + ahead) * kHalf), _MM_HINT_T1);
    half_step256<C>(load8(w + k * kHalf), load8(w + k * kHalf + 8), x + k, ldx, acc_a, acc_b);
  }
  store_half256<C>(acc_a, acc_b, out, ldo);
}

#endif  // EAGLE_X86_SIMD

// ------------------------------------------------------------------------- bf16 pair layout
// bf16 weights with an even K are packed in pairs of k steps, [N / 32, 2, K / 2, 16, 2]:
// packed[g, h, p, j, i] = W[32 g + 16 h + j, 2 p + i]. A 32-bit lane holds one column's weights at
// k = 2p (low half) and 2p + 1 (high half), so a 64-byte line is two k steps of a half, widened
// to fp32 by a shift left by 16 (even k) and a mask of the high half (odd k): two plain integer
// operations with the load folded in, where the K-major layout needs a zero-extending lane shuffle
// and a shift per k step. The FMA chain of every output is the same (k = 0 .. K-1 in order), so
// the two layouts give the same bits. Measured (Zen 4, 1 thread, SmolLM2-135M's bf16 matrices at
// one row of x, interleaved): see docs/cpu_kernels.md.
constexpr int64_t kPairLine = 2 * kHalf;  // bf16 elements per pair step of a half (64 bytes)

inline float pair_weight(const Bf16Bits* half, int64_t k, int64_t j) {
  return widen(half[(k / 2) * kPairLine + 2 * j + k % 2]);
}

void pair_group_scalar(const Bf16Bits* w, const float* x, int64_t ldx, int64_t M, int64_t K, float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * ldx;
    for (int64_t j = 0; j < kW; ++j) {
      const Bf16Bits* half = w + (j / kHalf) * K * kHalf;
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(pair_weight(half, k, j % kHalf), xm[k], acc);
      out[m * ldo + j] = acc;
    }
  }
}

#if EAGLE_X86_SIMD
// Pair steps ahead of the current one that a tile prefetches per weight stream (64 bytes per step).
constexpr int64_t kPairPrefetchStepsOneRow = 32;
constexpr int64_t kPairPrefetchSteps = kPrefetchAhead / 64;

// The fp32 weights of k = 2p (kOdd false: the low halves of the lanes, shifted up) or k = 2p + 1 (the high halves).
template <bool kOdd>
EAGLE_TARGET_AVX512 inline __m512 pair_widen512(const Bf16Bits* line) {
  const __m512i v = _mm512_loadu_si512(line);
  return _mm512_castsi512_ps(kOdd ? _mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))
                                  : _mm512_slli_epi32(v, 16));
}

// One k step (k = 2p + kOdd) of pair_tile512's G groups and C rows.
template <bool kOdd, int G, int C>
EAGLE_TARGET_AVX512 inline void pair_step512(const Bf16Bits* w, int64_t half_stride, int64_t p, const float* x,
                                             int64_t ldx, __m512 (&acc)[G][2][C]) {
  __m512 lo[G], hi[G];
  for (int g = 0; g < G; ++g) {
    lo[g] = pair_widen512<kOdd>(w + (2 * g) * half_stride + p * kPairLine);
    hi[g] = pair_widen512<kOdd>(w + (2 * g + 1) * half_stride + p * kPairLine);
  }
  for (int c = 0; c < C; ++c) {
    const __m512 xv = _mm512_set1_ps(x[c * ldx + 2 * p + kOdd]);
    for (int g = 0; g < G; ++g) {
      acc[g][0][c] = _mm512_fmadd_ps(lo[g], xv, acc[g][0][c]);
      acc[g][1][c] = _mm512_fmadd_ps(hi[g], xv, acc[g][1][c]);
    }
  }
}

// G consecutive groups (w: the first, [G][2][K / 2][16][2]) times C rows of x: out[c * ldo + 32 g + j].
template <int G, int C>
EAGLE_TARGET_AVX512 void pair_tile512(const Bf16Bits* w, int64_t K, const float* x, int64_t ldx, float* out,
                                      int64_t ldo, bool prefetch) {
  constexpr int64_t ahead = C == 1 ? kPairPrefetchStepsOneRow : kPairPrefetchSteps;
  __m512 acc[G][2][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][0][c] = acc[g][1][c] = _mm512_setzero_ps();
  const int64_t half_stride = K * kHalf;
  const int64_t steps = K / 2;
  for (int64_t p = 0; p < steps; ++p) {
    if (prefetch) {
      // As tile512: past the halves' ends each stream runs on into the same stream of the next tile.
      const int64_t pp = p + ahead;
      const Bf16Bits* line = pp < steps ? w + pp * kPairLine : w + (2 * G - 1) * half_stride + (pp - steps) * kPairLine;
      for (int g = 0; g < 2 * G; ++g) _mm_prefetch(reinterpret_cast<const char*>(line + g * half_stride), _MM_HINT_T1);
    }
    pair_step512<false, G, C>(w, half_stride, p, x, ldx, acc);
    pair_step512<true, G, C>(w, half_stride, p, x, ldx, acc);
  }
  for (int c = 0; c < C; ++c)
    for (int g = 0; g < G; ++g) {
      _mm512_storeu_ps(out + c * ldo + g * kW, acc[g][0][c]);
      _mm512_storeu_ps(out + c * ldo + g * kW + kHalf, acc[g][1][c]);
    }
}

// One half ([K / 2][16][2], a contiguous stream) times C rows of x: out[c * ldo + j], j < 16.
template <int C>
EAGLE_TARGET_AVX2 void pair_tile256(const Bf16Bits* w, int64_t K, const float* x, int64_t ldx, float* out, int64_t ldo,
                                    bool prefetch) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc_a[C], acc_b[C];
  EAGLE_UNROLL
  for (int c = 0; c < C; ++c) acc_a[c] = acc_b[c] = _mm256_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (p + kPairPrefetchSteps) * kPairLine), _MM_HINT_T1);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * kPairLine));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * kPairLine + kHalf));
    // k = 2p, then 2p + 1, written out: a run-time parity would leave both widenings and a blend in the loop.
    half_step256<C>(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)),
                    x + 2 * p, ldx, acc_a, acc_b);
    half_step256<C>(_mm256_castsi256_ps(_mm256_and_si256(a, high)), _mm256_castsi256_ps(_mm256_and_si256(b, high)),
                    x + 2 * p + 1, ldx, acc_a, acc_b);
  }
  store_half256<C>(acc_a, acc_b, out, ldo);
}
#endif  // EAGLE_X86_SIMD

// The tiles above as cpu_linear_groups.h takes them (depth: K): the K-major layout's for weights of type W, or
// with kPairs the bf16 pair layout's (K even).
template <typename W, bool kPairs = false>
struct Tiles {
  static_assert(!kPairs || std::is_same_v<W, Bf16Bits>, "the pair layout is bf16's");
  using Elem = W;
  using X = float;
  static int64_t group_elems(int64_t K) { return K * kW; }
  static void group_scalar(const W* w, int64_t K, const float* x, int64_t ldx, int64_t M, float* out, int64_t ldo) {
    if constexpr (kPairs)
      pair_group_scalar(w, x, ldx, M, K, out, ldo);
    else
      linear_impl::group_scalar<W>(w, x, ldx, M, K, out, ldo);
  }
#if EAGLE_X86_SIMD
  static constexpr int kMaxRows = linear_impl::kMaxRows;
  static constexpr int groups_for(int C) { return linear_impl::groups_for(C); }
  static constexpr int kMaxRows256 = linear_impl::kMaxRows256;
  template <int G, int C>
  static void tile512(const W* w, int64_t K, const float* x, int64_t ldx, float* out, int64_t ldo, bool prefetch) {
    if constexpr (kPairs)
      pair_tile512<G, C>(w, K, x, ldx, out, ldo, prefetch);
    else
      linear_impl::tile512<G, C, W>(w, K, x, ldx, out, ldo, prefetch);
  }
  template <int C>
  static void tile256(const W* w, int64_t K, const float* x, int64_t ldx, float* out, int64_t ldo, bool prefetch) {
    if constexpr (kPairs)
      pair_tile256<C>(w, K, x, ldx, out, ldo, prefetch);
    else
      linear_impl::tile256<C, W>(w, K, x, ldx, out, ldo, prefetch);
  }
#endif
};

}  // namespace

void packed_linear(const void* packed, at::ScalarType wtype, bool pairs, int64_t groups, const float* x, int64_t ldx,
                   int64_t M, int64_t K, float* out, int64_t ldo, Level level) {
  parallel_groups(groups, K, M, [&](int64_t begin, int64_t end) {
    if (pairs)
      run_groups<Tiles<Bf16Bits, true>>(static_cast<const Bf16Bits*>(packed), begin, end, K, x, ldx, M, out, ldo,
                                        level);
    else if (wtype == at::kFloat)
      run_groups<Tiles<float>>(static_cast<const float*>(packed), begin, end, K, x, ldx, M, out, ldo, level);
    else if (wtype == at::kBFloat16)
      run_groups<Tiles<Bf16Bits>>(static_cast<const Bf16Bits*>(packed), begin, end, K, x, ldx, M, out, ldo, level);
    else
      run_groups<Tiles<Fp16Bits>>(static_cast<const Fp16Bits*>(packed), begin, end, K, x, ldx, M, out, ldo, level);
  });
}

}  // namespace linear_impl
}  // namespace eagle
