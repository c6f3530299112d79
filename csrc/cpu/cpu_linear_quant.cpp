// cpu_linear over weight-only quantized weights, packed (eagle_kernels.cpu_linear_pack of GGML block rows): the
// layout of cpu_linear_packed.cpp (groups of 32 output columns, two halves of 16, K-major inside a half) in blocks
// of 32 k steps, each block of a half holding its 16 columns' block parameters, then their quants:
//
//   Q8_0 (int8 [N / 32, 2, K / 32, 544]): 16 fp16 scales d[j] (32 bytes), then 32 k steps x 16 int8 quants
//        (512 bytes, k-major); w[k, j] = d[j] * q[k, j].
//   Q4_1 (uint8 [N / 32, 2, K / 32, 320]): 16 fp16 scales d[j], 16 fp16 minimums m[j] (64 bytes), then 16 pairs of
//        k steps x 16 bytes (256 bytes), byte j of pair p holding column j's 4-bit quant of k = 2p in its low
//        nibble and of k = 2p + 1 in its high nibble; w[k, j] = d[j] * q[k, j] + m[j].
//
// The weights are widened in registers, one k step of 16 columns at a time: the quants to fp32, then w as above
// in fp32 (Q8_0: d * q, exact, 8 x 11 significant bits; Q4_1: one FMA, d * q exact, so the one rounding of the
// exact d * q + m). Activations stay fp32, as the accumulation: each output is one fp32 FMA chain over
// k = 0 .. K-1, fma(w[k], x[k], acc) from zero, the chain of the fp32 packed kernel on the dequantized matrix.
// So the result is bit for bit cpu_linear on cpu_linear_pack(dequantized weight) in fp32, on every ISA (AVX-512,
// AVX2 and the scalar std::fma path give the same w and the same chain), and a row of the output does not depend
// on the other rows (batch-invariant: a verify pass gives a token's row what decoding it alone gives).
//
// Why not GGML's own arithmetic (x quantized to 8 bits per block, integer dot products): that changes the
// activations, and greedy outputs then depend on the batch shape of the quantization; here only the weights are
// approximate, the arithmetic is that of the fp32 kernels.
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_linear_groups.h"
#include "cpu_linear_impl.h"

namespace eagle {
namespace linear_impl {
namespace {

using isa::Level;

constexpr int64_t kW = kPackWidth;
constexpr int64_t kHalf = kPackWidth / 2;
constexpr int64_t kBlock = kQuantBlock;  // k steps per block

// The AVX-512 tiles prefetch (into L2), per block and weight stream, the lines kAhead bytes ahead in the same stream,
// or with kAhead = 0 the lines at the same place in the next tile's stream (the next G groups). Measured on the Intel
// Xeon (the linear layers of one SmolLM2 forward at one row, 1 thread, CPU time, repeated runs on a busy machine):
// Q8_0 15.0 ms at 4096 bytes ahead, 13.4-14.0 at 512, 14.1-14.3 in the next tile; Q4_1 10.8 ms at 4096, 9.3-9.8
// at 512, 8.5-9.2 in the next tile (distances of 2-8 KiB, which land in the tile's own other streams, were the
// slowest for both).
// Rows of x per tile (BlockTiles): AVX-512 tiles of G groups x C rows hold 2 G C accumulators, 2 G scales (and
// 2 G minimums), 2 G widened weights and one x; AVX2 tiles of one half 2 C accumulators, 2 scales (and 2
// minimums), 2 widened weights and one x of 16 registers.
struct Rows {
  static constexpr int kMaxRows = 12;
  static constexpr int groups_for(int C) { return C <= 1 ? 3 : C <= 3 ? 2 : 1; }
  static constexpr int kMaxRows256 = 4;
};
struct Q8 : Rows {
  static constexpr int64_t kBytes = kQ8BlockBytes;  // per block of a half
  static constexpr int64_t kParams = 32;            // bytes of block parameters before the quants
  static constexpr int64_t kAhead = 512;
};
struct Q41 : Rows {
  static constexpr int64_t kBytes = kQ41BlockBytes;
  static constexpr int64_t kParams = 64;
  static constexpr int64_t kAhead = 0;
};

// Weight bytes ahead of the current block that an AVX2 tile (one half) prefetches in its stream (into L2).
constexpr int64_t kPrefetchAhead = 4096;

inline float half_at(const uint8_t* p, int64_t j) {
  uint16_t bits;
  std::memcpy(&bits, p + 2 * j, 2);
  return widen(static_cast<Fp16Bits>(bits));
}

// ------------------------------------------------------------------------------- scalar path
// The weight of column j at step i of a block (base: the block's first byte).
inline float weight_scalar(Q8, const uint8_t* base, int64_t i, int64_t j) {
  return half_at(base, j) * static_cast<float>(static_cast<int8_t>(base[Q8::kParams + i * kHalf + j]));
}
inline float weight_scalar(Q41, const uint8_t* base, int64_t i, int64_t j) {
  const uint8_t byte = base[Q41::kParams + (i / 2) * kHalf + j];
  const int q = i % 2 == 0 ? (byte & 0xF) : (byte >> 4);
  return std::fma(static_cast<float>(q), half_at(base, j), half_at(base, kHalf + j));
}

template <typename F>
void block_group_scalar(F, const uint8_t* w, int64_t nb, const float* x, int64_t ldx, int64_t M, float* out,
                        int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * ldx;
    for (int64_t col = 0; col < kW; ++col) {
      const uint8_t* half = w + (col / kHalf) * nb * F::kBytes;
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t i = 0; i < kBlock; ++i)
          acc = std::fma(weight_scalar(F{}, half + b * F::kBytes, i, col % kHalf), xm[b * kBlock + i], acc);
      out[m * ldo + col] = acc;
    }
  }
}

#if EAGLE_X86_SIMD
// ---------------------------------------------------------------------------------- AVX-512
// G consecutive groups (2 G weight streams, one per half) times C rows of x: out[c * ldo + 32 g + j].

EAGLE_TARGET_AVX512 inline __m512 params16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int G, int C>
EAGLE_TARGET_AVX512 void block_tile512(Q8, const uint8_t* w, int64_t nb, const float* x, int64_t ldx, float* out,
                                       int64_t ldo, bool prefetch) {
  constexpr int S = 2 * G;  // weight streams
  const int64_t stride = nb * Q8::kBytes;
  const int64_t ahead = Q8::kAhead > 0 ? Q8::kAhead : S * stride;
  __m512 acc[S][C];
  for (int s = 0; s < S; ++s)
    for (int c = 0; c < C; ++c) acc[s][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* base[S];
    __m512 d[S];
    for (int s = 0; s < S; ++s) {
      base[s] = w + s * stride + b * Q8::kBytes;
      if (prefetch)
        for (int64_t off = 0; off < Q8::kBytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(base[s] + ahead + off), _MM_HINT_T1);
      d[s] = params16(base[s]);
    }
    const float* xb = x + b * kBlock;
    for (int64_t i = 0; i < kBlock; ++i) {
      __m512 wv[S];
      for (int s = 0; s < S; ++s) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base[s] + Q8::kParams + i * kHalf));
        wv[s] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d[s]);
      }
      for (int c = 0; c < C; ++c) {
        const __m512 xv = _mm512_set1_ps(xb[c * ldx + i]);
        for (int s = 0; s < S; ++s) acc[s][c] = _mm512_fmadd_ps(wv[s], xv, acc[s][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(out + c * ldo + s * kHalf, acc[s][c]);
}

template <int G, int C>
EAGLE_TARGET_AVX512 void block_tile512(Q41, const uint8_t* w, int64_t nb, const float* x, int64_t ldx, float* out,
                                       int64_t ldo, bool prefetch) {
  constexpr int S = 2 * G;
  const int64_t stride = nb * Q41::kBytes;
  const int64_t ahead = Q41::kAhead > 0 ? Q41::kAhead : S * stride;
  // float(q) of a 4-bit q by a table lookup (vpermps reads its index's low 4 bits: no mask for the low nibble) on
  // the shuffle port, where vcvtdq2ps and the mask take two operations of the FMA ports: at one row the kernel is
  // bound by these operations, not by the weight stream.
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[S][C];
  for (int s = 0; s < S; ++s)
    for (int c = 0; c < C; ++c) acc[s][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* base[S];
    __m512 d[S], m[S];
    for (int s = 0; s < S; ++s) {
      base[s] = w + s * stride + b * Q41::kBytes;
      if (prefetch)
        for (int64_t off = 0; off < Q41::kBytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(base[s] + ahead + off), _MM_HINT_T1);
      d[s] = params16(base[s]);
      m[s] = params16(base[s] + 2 * kHalf);
    }
    const float* xb = x + b * kBlock;
    for (int64_t p = 0; p < kBlock / 2; ++p) {
      __m512i q[S];
      for (int s = 0; s < S; ++s)
        q[s] =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base[s] + Q41::kParams + p * kHalf)));
      {  // k = 2p: the low nibbles
        __m512 wv[S];
        for (int s = 0; s < S; ++s) wv[s] = _mm512_fmadd_ps(_mm512_permutexvar_ps(q[s], values), d[s], m[s]);
        for (int c = 0; c < C; ++c) {
          const __m512 xv = _mm512_set1_ps(xb[c * ldx + 2 * p]);
          for (int s = 0; s < S; ++s) acc[s][c] = _mm512_fmadd_ps(wv[s], xv, acc[s][c]);
        }
      }
      {  // k = 2p + 1: the high nibbles
        __m512 wv[S];
        for (int s = 0; s < S; ++s)
          wv[s] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q[s], 4), values), d[s], m[s]);
        for (int c = 0; c < C; ++c) {
          const __m512 xv = _mm512_set1_ps(xb[c * ldx + 2 * p + 1]);
          for (int s = 0; s < S; ++s) acc[s][c] = _mm512_fmadd_ps(wv[s], xv, acc[s][c]);
        }
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(out + c * ldo + s * kHalf, acc[s][c]);
}

// ------------------------------------------------------------------------------------- AVX2
// One half (16 columns: two 8-lane vectors) times C rows of x.

EAGLE_TARGET_AVX2 inline __m256 params8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <int C>
EAGLE_TARGET_AVX2 void block_tile256(Q8, const uint8_t* w, int64_t nb, const float* x, int64_t ldx, float* out,
                                     int64_t ldo, bool prefetch) {
  __m256 acc_a[C], acc_b[C];
  for (int c = 0; c < C; ++c) acc_a[c] = acc_b[c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* base = w + b * Q8::kBytes;
    if (prefetch)
      for (int64_t off = 0; off < Q8::kBytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(base + kPrefetchAhead + off), _MM_HINT_T1);
    const __m256 da = params8(base), db = params8(base + 16);
    const float* xb = x + b * kBlock;
    for (int64_t i = 0; i < kBlock; ++i) {
      const uint8_t* q = base + Q8::kParams + i * kHalf;
      const __m256 wa = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)))), da);
      const __m256 wb = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)))), db);
      half_step256<C>(wa, wb, xb + i, ldx, acc_a, acc_b);
    }
  }
  store_half256<C>(acc_a, acc_b, out, ldo);
}

template <int C>
EAGLE_TARGET_AVX2 void block_tile256(Q41, const uint8_t* w, int64_t nb, const float* x, int64_t ldx, float* out,
                                     int64_t ldo, bool prefetch) {
  const __m256i low4 = _mm256_set1_epi32(0xF);
  __m256 acc_a[C], acc_b[C];
  for (int c = 0; c < C; ++c) acc_a[c] = acc_b[c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* base = w + b * Q41::kBytes;
    if (prefetch)
      for (int64_t off = 0; off < Q41::kBytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(base + kPrefetchAhead + off), _MM_HINT_T1);
    const __m256 da = params8(base), db = params8(base + 16);
    const __m256 ma = params8(base + 32), mb = params8(base + 48);
    const float* xb = x + b * kBlock;
    for (int64_t p = 0; p < kBlock / 2; ++p) {
      const uint8_t* q = base + Q41::kParams + p * kHalf;
      const __m256i qa = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
      const __m256i qb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
      for (int h = 0; h < 2; ++h) {  // k = 2p (low nibbles), then 2p + 1 (high nibbles)
        const __m256i na = h == 0 ? _mm256_and_si256(qa, low4) : _mm256_srli_epi32(qa, 4);
        const __m256i nb2 = h == 0 ? _mm256_and_si256(qb, low4) : _mm256_srli_epi32(qb, 4);
        const __m256 wa = _mm256_fmadd_ps(_mm256_cvtepi32_ps(na), da, ma);
        const __m256 wb = _mm256_fmadd_ps(_mm256_cvtepi32_ps(nb2), db, mb);
        half_step256<C>(wa, wb, xb + 2 * p + h, ldx, acc_a, acc_b);
      }
    }
  }
  store_half256<C>(acc_a, acc_b, out, ldo);
}

#endif  // EAGLE_X86_SIMD

}  // namespace

void quant_linear(const uint8_t* packed, QuantFormat format, int64_t groups, const float* x, int64_t ldx, int64_t M,
                  int64_t K, float* out, int64_t ldo, Level level) {
  const int64_t nb = K / kBlock;
  parallel_groups(groups, K, M, [&](int64_t begin, int64_t end) {
    if (format == QuantFormat::kQ8_0)
      run_groups<BlockTiles<Q8, float>>(packed, begin, end, nb, x, ldx, M, out, ldo, level);
    else
      run_groups<BlockTiles<Q41, float>>(packed, begin, end, nb, x, ldx, M, out, ldo, level);
  });
}

}  // namespace linear_impl
}  // namespace eagle
