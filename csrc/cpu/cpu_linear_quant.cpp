// cpu_linear over weight-only quantized weights (Q8_0 / Q4_1 blocks, packed by eagle_kernels.cpu_linear_pack in the
// layout of cpu_linear_blocks.h, 4-D) with fp32 activations.
//
// Arithmetic, on every ISA. Block b of a row of x (32 elements) is held as integers: with E the exponent of its
// largest |x| (frexp: amax = f 2^E, f in [0.5, 1)) and s = 2^(E - 22),
//   X[k] = round-to-even(x[k] / s),  |X[k]| <= 2^22,
// so x[k] is kept to within s / 2, 2^-23 of amax (the largest elements keep 23 of fp32's 24 significant bits).
// With X = 256 U + l (l in [-128, 127], U = (X - l) / 256 in [-2^14, 2^14]), per output column j of a block the
// integers A = sum_k q[k, j] U[k] (|A| < 2^26) and B = sum_k q[k, j] l[k] (|B| < 2^20) are exact, the block's dot
// product is I = 256 A + B, and from acc = 0, block by block:
//   Q8_0: acc = fma(fma(float(A), 256, float(B)), d[j] * s, acc)
//   Q4_1: the same, then acc = fma(m[j], float(sum_k X[k]) * s, acc)
// Two roundings of the block's dot product (float(A), the inner fma) instead of 32 (an fp32 FMA chain over the
// dequantized weights), so the results are as close to the exact product as the fp32 kernels' (reference.cpu_linear:
// float64, rounded once).
// A block holding inf or nan gives NaN outputs, as the fp32 kernels'.
//
// Why integers: widening 16 int8 weights to fp32 and scaling them takes three vector operations before the FMA,
// which at one row bound the fp32 chain by the core's vector ports (about 16 G weights/s on the Zen 4 here, below
// the rate one core streams memory at). With x split into three signed bytes, X = 65536 h + 256 m + l (each in
// [-128, 127], U = 256 h + m), one VPDPBUSD per byte multiplies 64 weights (16 columns by 4 k) exactly, and the
// block's three integer sums give A and B: three operations per 64 weights. The AVX2 path (no VNNI) widens Q8_0's
// weights to 16 bits and multiplies U and l as int16 (VPMADDWD), and Q4_1's nibbles by the three bytes (VPMADDUBSW);
// the scalar path sums in int32. A and B are the same exact integers on every path and every fp32 operation the same
// IEEE operation, so the results agree bit for bit across ISAs; each row of the output depends only on its own row of
// x (batch-invariant: a verify pass gives a token's row what decoding it alone gives).
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_linear_blocks.h"
#include "cpu_linear_groups.h"
#include "cpu_linear_impl.h"

namespace eagle {
namespace linear_impl {
namespace {

using isa::Level;
using namespace blocks;

// Digits of X, least significant first: X = digit[0] + 256 digit[1] + 65536 digit[2].
constexpr int kDigits = 3;
// X = round(x 2^(kFraction - E)): |X| <= 2^kFraction, so the top digit stays within [-64, 64].
constexpr int kFraction = 22;

// One block of 32 elements of a row of x in integer form (see the top of the file).
struct XDigits {
  int8_t digit[kDigits][kBlock];  // VNNI: X = digit[0] + 256 digit[1] + 65536 digit[2]
  int16_t low[kBlock];            // AVX2 and scalar: l = digit[0]
  int16_t upper[kBlock];          // U = digit[1] + 256 digit[2] = (X - l) / 256
  float s;                        // 2^(E - 22); NaN for a non-finite block
  float x_sum_scaled;             // float(sum_k X[k]) * s (Q4_1's minimums); NaN for a non-finite block
  // Q8_0's VNNI operand is q + 128: 128 sum(digit[0]) comes off B's block sum, 128 sum(U) off A's.
  int32_t q8_low_excess;
  int32_t q8_upper_excess;
  int32_t pad[4];
};
static_assert(sizeof(XDigits) == 256, "XDigits: 256 bytes");

// Rows of x per tile (BlockTiles). AVX-512 tiles of G groups (S = 2 G streams) x C rows hold 3 S C integer block
// sums and S C fp32 accumulators; AVX2 tiles of one half 4 integer sums (Q4_1: 6 int16 ones) and 2 accumulators per
// row.
struct Rows {
  static constexpr int kMaxRows = 2;
  static constexpr int groups_for(int C) { return C <= 1 ? 2 : 1; }
  static constexpr int kMaxRows256 = 2;
};
struct Q8 : Q8Layout, Rows {
  static constexpr int64_t kAhead = 0;
};
struct Q41 : Q41Layout, Rows {
  static constexpr int kMaxRows256 = 1;  // its own AVX2 tile: 6 int16 sums, 2 accumulators, the nibbles, 3 digits
};

// ------------------------------------------------------------------------------- activations
void set_non_finite(XDigits* out) {
  std::memset(out, 0, sizeof(*out));
  out->s = out->x_sum_scaled = std::numeric_limits<float>::quiet_NaN();
}

// X[k] -> digits and the block's sums (X[k] for k < 32, |X[k]| <= 2^22).
void set_digits(const int32_t* X, float s, XDigits* out) {
  std::memset(out, 0, sizeof(*out));
  int32_t x_sum = 0, digit_sum[kDigits] = {0, 0, 0};
  for (int64_t k = 0; k < kBlock; ++k) {
    int32_t rest = X[k];
    x_sum += rest;
    for (int p = 0; p < kDigits; ++p) {
      const int32_t digit = ((rest + 128) & 255) - 128;
      out->digit[p][k] = static_cast<int8_t>(digit);
      digit_sum[p] += digit;
      rest = (rest - digit) / 256;  // exact
    }
    out->low[k] = out->digit[0][k];
    out->upper[k] = static_cast<int16_t>(out->digit[1][k] + 256 * out->digit[2][k]);
  }
  out->s = s;
  out->x_sum_scaled = static_cast<float>(x_sum) * s;
  out->q8_low_excess = 128 * digit_sum[0];
  out->q8_upper_excess = 128 * (256 * digit_sum[2] + digit_sum[1]);
}

void digits_block_scalar(const float* x, XDigits* out) {
  float amax = 0.0f;
  for (int64_t k = 0; k < kBlock; ++k) {
    if (!std::isfinite(x[k])) return set_non_finite(out);
    amax = std::max(amax, std::fabs(x[k]));
  }
  int E = 0;
  std::frexp(amax, &E);
  int32_t X[kBlock];
  // x 2^(22 - E) is exact in double and below 2^22 in magnitude.
  for (int64_t k = 0; k < kBlock; ++k)
    X[k] = static_cast<int32_t>(std::nearbyint(std::ldexp(static_cast<double>(x[k]), kFraction - E)));
  set_digits(X, std::ldexp(1.0f, E - kFraction), out);
}

#if EAGLE_X86_SIMD
// The AVX-512 form of digits_block_scalar for blocks whose scale 2^(22 - E) is a normal float (E >= -104; smaller
// blocks, and non-finite ones, take the scalar path). x times the scale is exact (or rounds to an integer 0 where it
// is below fp32's normal range), as in double.
EAGLE_TARGET_AVX512 void digits_block512(const float* x, XDigits* out) {
  __m512 a, b;
  float amax = 0.0f;
  if (!load_block512(x, a, b, amax)) return set_non_finite(out);
  int E = 0;
  std::frexp(amax, &E);
  if (E < -104) return digits_block_scalar(x, out);
  const __m512 scale = _mm512_set1_ps(std::ldexp(1.0f, kFraction - E));
  alignas(64) int32_t X[kBlock];
  _mm512_store_si512(X, _mm512_cvtps_epi32(_mm512_mul_ps(a, scale)));  // MXCSR's default: to nearest even
  _mm512_store_si512(X + 16, _mm512_cvtps_epi32(_mm512_mul_ps(b, scale)));
  set_digits(X, std::ldexp(1.0f, E - kFraction), out);
}

// The same in four 8-lane vectors (AVX2 CPUs ran the scalar form, a frexp / ldexp / nearbyint per element).
EAGLE_TARGET_AVX2 void digits_block256(const float* x, XDigits* out) {
  __m256 v[4];
  float amax = 0.0f;
  if (!load_block256(x, v, amax)) return set_non_finite(out);
  int E = 0;
  std::frexp(amax, &E);
  if (E < -104) return digits_block_scalar(x, out);
  const __m256 scale = _mm256_set1_ps(std::ldexp(1.0f, kFraction - E));
  alignas(32) int32_t X[kBlock];
  EAGLE_UNROLL
  for (int i = 0; i < 4; ++i)  // MXCSR's default: to nearest even
    _mm256_store_si256(reinterpret_cast<__m256i*>(X + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale)));
  set_digits(X, std::ldexp(1.0f, E - kFraction), out);
}
#endif

// ------------------------------------------------------------------------------- scalar path
// fma(fma(float(A), 256, float(B)), scale, acc): a block's contribution (the top of the file).
inline float add_block(int32_t A, int32_t B, float scale, float acc) {
  return std::fma(std::fma(static_cast<float>(A), 256.0f, static_cast<float>(B)), scale, acc);
}
template <typename F>
void block_group_scalar(F, const uint8_t* w, int64_t nb, const XDigits* x, int64_t ldx, int64_t M, float* out,
                        int64_t ldo) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t col = 0; col < kPackWidth; ++col) {
      const uint8_t* half = w + (col / kHalf) * nb * F::kBytes;
      const int64_t j = col % kHalf;
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* base = half + b * F::kBytes;
        const XDigits& xb = x[m * ldx + b];
        int32_t A = 0, B = 0;
        for (int64_t k = 0; k < kBlock; ++k) {
          const int32_t q = quant_at<F>(base, k, j);
          A += q * xb.upper[k];
          B += q * xb.low[k];
        }
        acc = add_block(A, B, half_at(base, j) * xb.s, acc);
        if constexpr (!F::kSigned) acc = std::fma(half_at(base, kHalf + j), xb.x_sum_scaled, acc);
      }
      out[m * ldo + col] = acc;
    }
}

#if EAGLE_X86_SIMD
// ---------------------------------------------------------------------------- AVX-512 VNNI
// fma(fma(float(A), 256, float(B)), scale, acc) per lane (add_block).
EAGLE_TARGET_AVX512_VNNI inline __m512 add_block512(__m512i A, __m512i B, __m512 scale, __m512 acc) {
  const __m512 I = _mm512_fmadd_ps(_mm512_cvtepi32_ps(A), _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(B));
  return _mm512_fmadd_ps(I, scale, acc);
}

// G groups (S = 2 G streams of 16 columns) times C rows of x: out[c * ldo + 32 g + j].
template <int G, int C, typename F>
EAGLE_TARGET_AVX512_VNNI void block_tile512(F, const uint8_t* w, int64_t nb, const XDigits* x, int64_t ldx, float* out,
                                            int64_t ldo, bool prefetch) {
  constexpr int S = 2 * G;
  const int64_t stride = nb * F::kBytes;
  const int64_t ahead = F::kAhead > 0 ? F::kAhead : S * stride;
  __m512 acc[S][C];
  for (int s = 0; s < S; ++s)
    for (int c = 0; c < C; ++c) acc[s][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* base[S];
    for (int s = 0; s < S; ++s) {
      base[s] = w + s * stride + b * F::kBytes;
      if (prefetch) prefetch_block<F>(base[s], ahead);
    }
    __m512i isum[kDigits][S][C];
    for (int p = 0; p < kDigits; ++p)
      for (int s = 0; s < S; ++s)
        for (int c = 0; c < C; ++c) isum[p][s][c] = _mm512_setzero_si512();
    for (int64_t t = 0; t < F::kChunks; ++t)
      for (int part = 0; part < F::kParts; ++part) {
        const int64_t i = x_step(t, part);
        for (int s = 0; s < S; ++s) {
          const __m512i wv = chunk512<F>(base[s], t, part);
          for (int c = 0; c < C; ++c)
            for (int p = 0; p < kDigits; ++p)
              isum[p][s][c] = _mm512_dpbusd_epi32(isum[p][s][c], wv, bytes4_512(x[c * ldx + b].digit[p] + i));
        }
      }
    for (int s = 0; s < S; ++s) {
      const __m512 d = params16(base[s]);
      for (int c = 0; c < C; ++c) {
        const XDigits& xb = x[c * ldx + b];
        __m512i A = _mm512_add_epi32(_mm512_slli_epi32(isum[2][s][c], 8), isum[1][s][c]);  // |.| < 2^27
        __m512i B = isum[0][s][c];
        if constexpr (F::kSigned) {
          A = _mm512_sub_epi32(A, _mm512_set1_epi32(xb.q8_upper_excess));
          B = _mm512_sub_epi32(B, _mm512_set1_epi32(xb.q8_low_excess));
        }
        acc[s][c] = add_block512(A, B, _mm512_mul_ps(d, _mm512_set1_ps(xb.s)), acc[s][c]);
        if constexpr (!F::kSigned)
          acc[s][c] = _mm512_fmadd_ps(params16(base[s] + 2 * kHalf), _mm512_set1_ps(xb.x_sum_scaled), acc[s][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(out + c * ldo + s * kHalf, acc[s][c]);
}

// ------------------------------------------------------------------------------------- AVX2
// Q8_0's tile: one half (16 columns) times C rows. The weights widen to int16, four columns by their 4 k steps per 16
// bytes (a quarter); VPMADDWD by U or l at those 4 steps (repeated) sums pairs of products exactly in int32, and
// VPHADDD the pairs of pairs, two quarters at a time (lanes: columns 0, 1, 4, 5 | 2, 3, 6, 7 of the two, put in order
// at the block's end).

// add_block per lane.
EAGLE_TARGET_AVX2 inline __m256 add_block256(__m256i A, __m256i B, __m256 scale, __m256 acc) {
  const __m256 I = _mm256_fmadd_ps(_mm256_cvtepi32_ps(A), _mm256_set1_ps(256.0f), _mm256_cvtepi32_ps(B));
  return _mm256_fmadd_ps(I, scale, acc);
}

// Quarter v (columns 4 v .. 4 v + 3) of a Q8_0 chunk's weights, as int16.
EAGLE_TARGET_AVX2 inline __m256i quarter256(const uint8_t* base, int64_t t, int v) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + Q8::kParams + t * 64 + 16 * v)));
}

// Four int16 values from p, repeated over the vector.
EAGLE_TARGET_AVX2 inline __m256i steps4_256(const int16_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_set1_epi64x(v);
}

template <int C>
EAGLE_TARGET_AVX2 void block_tile256(Q8, const uint8_t* w, int64_t nb, const XDigits* x, int64_t ldx, float* out,
                                     int64_t ldo, bool prefetch) {
  __m256 acc[2][C];
  for (int v = 0; v < 2; ++v)
    for (int c = 0; c < C; ++c) acc[v][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* base = w + b * Q8::kBytes;
    if (prefetch) prefetch_block<Q8>(base, kPrefetchAhead);
    __m256i upper[2][C], low[2][C];  // A, B: [columns 0-7, 8-15][row]
    for (int v = 0; v < 2; ++v)
      for (int c = 0; c < C; ++c) upper[v][c] = low[v][c] = _mm256_setzero_si256();
    for (int64_t t = 0; t < Q8::kChunks; ++t) {
      const int64_t i = x_step(t, 0);
      for (int v = 0; v < 2; ++v) {
        const __m256i qa = quarter256(base, t, 2 * v), qb = quarter256(base, t, 2 * v + 1);
        for (int c = 0; c < C; ++c) {
          const XDigits& xb = x[c * ldx + b];
          const __m256i xl = steps4_256(xb.low + i), xu = steps4_256(xb.upper + i);
          low[v][c] =
              _mm256_add_epi32(low[v][c], _mm256_hadd_epi32(_mm256_madd_epi16(qa, xl), _mm256_madd_epi16(qb, xl)));
          upper[v][c] =
              _mm256_add_epi32(upper[v][c], _mm256_hadd_epi32(_mm256_madd_epi16(qa, xu), _mm256_madd_epi16(qb, xu)));
        }
      }
    }
    for (int v = 0; v < 2; ++v) {
      const __m256 d = params8(base + 16 * v);
      for (int c = 0; c < C; ++c) {
        const XDigits& xb = x[c * ldx + b];
        const __m256i A = _mm256_permute4x64_epi64(upper[v][c], 0xD8);  // columns in order
        const __m256i B = _mm256_permute4x64_epi64(low[v][c], 0xD8);
        acc[v][c] = add_block256(A, B, _mm256_mul_ps(d, _mm256_set1_ps(xb.s)), acc[v][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(out + c * ldo + 8 * v, acc[v][c]);
}

// Q4_1's AVX2 tile (one half, C rows): its nibbles are VPMADDUBSW's unsigned operand as they are, by the three
// signed bytes of X (as VNNI's), into int16 pairs that never saturate (2 x 15 x 128) and stay below 2^15 over a
// block's 8 reads of a chunk (8 x 3840 = 30720); VPMADDWD by ones then sums each column's pairs in int32, in column
// order. Two operations per digit and 32 weights against the int16 path's four and a half.
template <int C>
EAGLE_TARGET_AVX2 void block_tile256(Q41, const uint8_t* w, int64_t nb, const XDigits* x, int64_t ldx, float* out,
                                     int64_t ldo, bool prefetch) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[2][C];
  for (int v = 0; v < 2; ++v)
    for (int c = 0; c < C; ++c) acc[v][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* base = w + b * Q41::kBytes;
    if (prefetch) prefetch_block<Q41>(base, kPrefetchAhead);
    __m256i pairs[kDigits][2][C];  // int16 pair sums: [digit][columns 0-7, 8-15][row]
    for (int p = 0; p < kDigits; ++p)
      for (int v = 0; v < 2; ++v)
        for (int c = 0; c < C; ++c) pairs[p][v][c] = _mm256_setzero_si256();
    for (int64_t t = 0; t < Q41::kChunks; ++t) {
      __m256i raw[2];
      for (int v = 0; v < 2; ++v)
        raw[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + Q41::kParams + t * 64 + 32 * v));
      for (int part = 0; part < Q41::kParts; ++part) {
        const int64_t i = x_step(t, part);
        __m256i q[2];
        for (int v = 0; v < 2; ++v) q[v] = _mm256_and_si256(part == 0 ? raw[v] : _mm256_srli_epi16(raw[v], 4), low4);
        for (int c = 0; c < C; ++c)
          for (int p = 0; p < kDigits; ++p) {
            int32_t four;
            std::memcpy(&four, x[c * ldx + b].digit[p] + i, 4);
            const __m256i xv = _mm256_set1_epi32(four);
            for (int v = 0; v < 2; ++v)
              pairs[p][v][c] = _mm256_add_epi16(pairs[p][v][c], _mm256_maddubs_epi16(q[v], xv));
          }
      }
    }
    for (int v = 0; v < 2; ++v) {
      const __m256 d = params8(base + 16 * v);
      for (int c = 0; c < C; ++c) {
        const XDigits& xb = x[c * ldx + b];
        __m256i sums[kDigits];
        for (int p = 0; p < kDigits; ++p) sums[p] = _mm256_madd_epi16(pairs[p][v][c], ones);
        const __m256i A = _mm256_add_epi32(_mm256_slli_epi32(sums[2], 8), sums[1]);
        acc[v][c] = add_block256(A, sums[0], _mm256_mul_ps(d, _mm256_set1_ps(xb.s)), acc[v][c]);
        acc[v][c] = _mm256_fmadd_ps(params8(base + 32 + 16 * v), _mm256_set1_ps(xb.x_sum_scaled), acc[v][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(out + c * ldo + 8 * v, acc[v][c]);
}
#endif  // EAGLE_X86_SIMD

}  // namespace

void quant_linear(const uint8_t* packed, QuantFormat format, int64_t groups, const float* x, int64_t ldx, int64_t M,
                  int64_t K, float* out, int64_t ldo, Level level) {
#if EAGLE_X86_SIMD
  void (*const block512)(const float*, XDigits*) = digits_block512;
  void (*const block256)(const float*, XDigits*) = digits_block256;
#else
  void (*const block512)(const float*, XDigits*) = nullptr;
  void (*const block256)(const float*, XDigits*) = nullptr;
#endif
  block_linear<Q8, Q41, XDigits>(packed, format == QuantFormat::kQ8_0, groups, x, ldx, M, K, out, ldo, level, block512,
                                 digits_block_scalar, block256);
}

}  // namespace linear_impl
}  // namespace eagle
