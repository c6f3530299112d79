// cpu_linear over Q8_0 / Q4_1 weights with 8-bit activations: GGML's arithmetic (each block of 32 elements of a
// row of x quantized to int8 with one fp32 scale, exact integer dot products per block, scaled in fp32), packed
// by eagle_kernels.cpu_linear_pack(blocks, activations="int8") as uint8 / int8 [N / 32, 2, K / 32, lines, 32]: the
// block layout of cpu_linear_blocks.h in lines of 32 bytes.
//
// Arithmetic, on every ISA: x's block b of a row: amax = max |x|, dx = amax / 127, qx = round-to-even(x * (1 / dx))
// (qx = 0 where dx = 0), s = sum qx, dxs = dx * float(s). Per output, from acc = 0, block by block:
//   Q8_0: acc = fma(float(sum q * qx), d * dx, acc)
//   Q4_1: acc = fma(float(sum q * qx), d * dx, acc); acc = fma(m, dxs, acc)
// The integer sums are exact (|sum| < 2^20) and so is their conversion; every fp32 operation is the same IEEE
// operation in the scalar, AVX2 and AVX-512 paths: the results agree bit for bit across ISAs. A row of the output
// depends only on its own row of x (each row is quantized alone): batch-invariant, so a verify pass gives a token's
// row what decoding it alone gives, and greedy speculative decoding stays equal to plain decoding with these
// weights. Against the fp32-activation kernel the outputs differ by the activations' rounding (|x| / 254 per
// element at most, per block), as GGML's do.
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

// One block of 32 elements of a row of x, quantized (see the top of the file).
struct XBlock {
  int8_t q[kBlock];
  float d;      // dx
  int32_t sum;  // s
  float dsum;   // dx * float(s)
  int32_t pad;
};
static_assert(sizeof(XBlock) == 48, "XBlock: 48 bytes");

// Rows of x per tile (BlockTiles): AVX-512 tiles of G groups (S = 2 G streams of 16 columns) x C rows hold S C fp32
// accumulators, S C integer block sums and S weights; AVX2 tiles of one half 2 C accumulators, 2 C block sums and
// 2 weights.
struct Rows {
  static constexpr int kMaxRows = 6;
  static constexpr int groups_for(int C) { return C <= 1 ? 3 : C <= 3 ? 2 : 1; }
  static constexpr int kMaxRows256 = 2;
};
struct Q8 : Q8Layout, Rows {};
struct Q41 : Q41Layout, Rows {};

// ------------------------------------------------------------------------------- activations
void quantize_block_scalar(const float* x, XBlock* out) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < kBlock; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  if (!finite) {  // the block's outputs are NaN, as the fp32 kernels' would be non-finite
    std::memset(out->q, 0, sizeof(out->q));
    out->d = out->dsum = std::numeric_limits<float>::quiet_NaN();
    out->sum = 0;
    return;
  }
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  int32_t sum = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const int32_t q = static_cast<int32_t>(std::nearbyint(x[i] * id));  // the default mode: to nearest even
    out->q[i] = static_cast<int8_t>(q);
    sum += q;
  }
  out->d = d;
  out->sum = sum;
  out->dsum = d * static_cast<float>(sum);
}

#if EAGLE_X86_SIMD
EAGLE_TARGET_AVX512 void quantize_block512(const float* x, XBlock* out) {
  __m512 a, b;
  float amax = 0.0f;
  if (!load_block512(x, a, b, amax)) return quantize_block_scalar(x, out);
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m512 idv = _mm512_set1_ps(id);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, idv));  // MXCSR's default: to nearest even
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, idv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out->q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out->q + 16), _mm512_cvtepi32_epi8(qb));
  const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  out->d = d;
  out->sum = sum;
  out->dsum = d * static_cast<float>(sum);
}

// The same arithmetic in four 8-lane vectors (the scalar path's before: about 5% of a GGUF speculative step's CPU
// time on an AVX2 VM).
EAGLE_TARGET_AVX2 void quantize_block256(const float* x, XBlock* out) {
  __m256 v[4];
  float amax = 0.0f;
  if (!load_block256(x, v, amax)) return quantize_block_scalar(x, out);
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m256 idv = _mm256_set1_ps(id);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));  // MXCSR's default: to nearest even
  // |q| <= 127: the saturating packs are exact; they interleave 4-element groups, which the permute puts back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out->q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
  out->d = d;
  out->sum = sum;
  out->dsum = d * static_cast<float>(sum);
}
#endif

// ------------------------------------------------------------------------------- scalar path
template <typename F>
void block_group_scalar(F, const uint8_t* w, int64_t nb, const XBlock* x, int64_t ldx, int64_t M, float* out,
                        int64_t ldo) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t col = 0; col < kPackWidth; ++col) {
      const uint8_t* half = w + (col / kHalf) * nb * F::kBytes;
      const int64_t j = col % kHalf;
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* base = half + b * F::kBytes;
        const XBlock& xb = x[m * ldx + b];
        int32_t isum = 0;
        for (int64_t i = 0; i < kBlock; ++i) isum += quant_at<F>(base, i, j) * xb.q[i];
        acc = std::fma(static_cast<float>(isum), half_at(base, j) * xb.d, acc);
        if constexpr (!F::kSigned) acc = std::fma(half_at(base, kHalf + j), xb.dsum, acc);
      }
      out[m * ldo + col] = acc;
    }
}

#if EAGLE_X86_SIMD
// ---------------------------------------------------------------------------- AVX-512 VNNI
// G groups (S = 2 G streams of 16 columns) times C rows of x: out[c * ldo + 32 g + j]. The weights are VPDPBUSD's
// unsigned operand (chunk512); Q8_0's are q + 128, so 128 s comes off each block sum.
template <int G, int C, typename F>
EAGLE_TARGET_AVX512_VNNI void block_tile512(F, const uint8_t* w, int64_t nb, const XBlock* x, int64_t ldx, float* out,
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
    __m512i isum[S][C];
    for (int s = 0; s < S; ++s)
      for (int c = 0; c < C; ++c) isum[s][c] = _mm512_setzero_si512();
    for (int64_t t = 0; t < F::kChunks; ++t)
      for (int part = 0; part < F::kParts; ++part) {
        __m512i wv[S];
        for (int s = 0; s < S; ++s) wv[s] = chunk512<F>(base[s], t, part);
        for (int c = 0; c < C; ++c) {
          const __m512i xv = bytes4_512(x[c * ldx + b].q + x_step(t, part));
          for (int s = 0; s < S; ++s) isum[s][c] = _mm512_dpbusd_epi32(isum[s][c], wv[s], xv);
        }
      }
    __m512 d[S], m[S];
    for (int s = 0; s < S; ++s) {
      d[s] = params16(base[s]);
      if constexpr (!F::kSigned) m[s] = params16(base[s] + 2 * kHalf);
    }
    for (int c = 0; c < C; ++c) {
      const XBlock& xb = x[c * ldx + b];
      const __m512 dx = _mm512_set1_ps(xb.d);
      for (int s = 0; s < S; ++s) {
        __m512i sum = isum[s][c];
        if constexpr (F::kSigned) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * xb.sum));
        acc[s][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d[s], dx), acc[s][c]);
        if constexpr (!F::kSigned) acc[s][c] = _mm512_fmadd_ps(m[s], _mm512_set1_ps(xb.dsum), acc[s][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(out + c * ldo + s * kHalf, acc[s][c]);
}

// ------------------------------------------------------------------------------------- AVX2
// One half (16 columns: two vectors of 8 lanes) times C rows. VPMADDUBSW adds pairs of unsigned x signed byte products
// into int16 with saturation, so the operands stay small enough never to saturate: Q8_0 as |q| by qx with q's sign (|q|
// <= 128, |qx| <= 127: 2 x 128 x 127 = 32512), Q4_1 as q by qx (2 x 15 x 127 = 3810); VPMADDWD by ones then adds the
// pairs of pairs exactly in int32. Q8_0 does that at every step; Q4_1's int16 pairs take a whole block's 8 steps
// first (8 x 3810 = 30480 < 2^15, so the int16 adds never wrap) and VPMADDWD once a block: two instructions a step and
// vector instead of three. Integer sums in another order: the same exact sums, the same bits.

// An empty asm statement that claims to read and write v in a vector register, so each product joins its running
// sum in program order: GCC 12 otherwise reassociated a block's integer adds into a tree over all 32 products of a
// 2-row tile, computed ahead and spilled (25 stores a block). The sums are exact in any order: only the schedule
// changes.
EAGLE_TARGET_AVX2 inline void in_order(__m256i& v) { asm("" : "+x"(v)); }

EAGLE_TARGET_AVX2 inline __m256i x4_256(const XBlock& xb, int64_t i) {
  int32_t v;
  std::memcpy(&v, xb.q + i, 4);
  return _mm256_set1_epi32(v);
}

template <int C, typename F>
EAGLE_TARGET_AVX2 void block_tile256(F, const uint8_t* w, int64_t nb, const XBlock* x, int64_t ldx, float* out,
                                     int64_t ldo, bool prefetch) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][C];
  EAGLE_UNROLL
  for (int v = 0; v < 2; ++v) {
    EAGLE_UNROLL
    for (int c = 0; c < C; ++c) acc[v][c] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* base = w + b * F::kBytes;
    if (prefetch) prefetch_block<F>(base, kPrefetchAhead);
    __m256i isum[2][C];  // Q8_0: int32 sums; Q4_1: int16 pair sums until the block's end
    EAGLE_UNROLL
    for (int v = 0; v < 2; ++v) {
      EAGLE_UNROLL
      for (int c = 0; c < C; ++c) isum[v][c] = _mm256_setzero_si256();
    }
    EAGLE_UNROLL
    for (int t = 0; t < F::kChunks; ++t) {
      EAGLE_UNROLL
      for (int part = 0; part < F::kParts; ++part) {
        __m256i q[2];
        EAGLE_UNROLL
        for (int v = 0; v < 2; ++v) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + F::kParams + t * 64 + 32 * v));
          if constexpr (F::kSigned)
            q[v] = raw;
          else
            q[v] = _mm256_and_si256(part == 0 ? raw : _mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
        }
        EAGLE_UNROLL
        for (int c = 0; c < C; ++c) {
          const __m256i xv = x4_256(x[c * ldx + b], x_step(t, part));
          EAGLE_UNROLL
          for (int v = 0; v < 2; ++v) {
            if constexpr (F::kSigned)
              isum[v][c] = _mm256_add_epi32(
                  isum[v][c],
                  _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q[v]), _mm256_sign_epi8(xv, q[v])), ones));
            else
              isum[v][c] = _mm256_add_epi16(isum[v][c], _mm256_maddubs_epi16(q[v], xv));
            in_order(isum[v][c]);
          }
        }
      }
    }
    const __m256 d[2] = {params8(base), params8(base + 16)};
    EAGLE_UNROLL
    for (int c = 0; c < C; ++c) {
      const XBlock& xb = x[c * ldx + b];
      const __m256 dx = _mm256_set1_ps(xb.d);
      EAGLE_UNROLL
      for (int v = 0; v < 2; ++v) {
        const __m256i sum = F::kSigned ? isum[v][c] : _mm256_madd_epi16(isum[v][c], ones);
        acc[v][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d[v], dx), acc[v][c]);
        if constexpr (!F::kSigned)
          acc[v][c] = _mm256_fmadd_ps(params8(base + 32 + 16 * v), _mm256_set1_ps(xb.dsum), acc[v][c]);
      }
    }
  }
  EAGLE_UNROLL
  for (int c = 0; c < C; ++c) {
    EAGLE_UNROLL
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(out + c * ldo + 8 * v, acc[v][c]);
  }
}
#endif  // EAGLE_X86_SIMD

}  // namespace

void dot_linear(const uint8_t* packed, QuantFormat format, int64_t groups, const float* x, int64_t ldx, int64_t M,
                int64_t K, float* out, int64_t ldo, Level level) {
#if EAGLE_X86_SIMD
  void (*const block512)(const float*, XBlock*) = quantize_block512;
  void (*const block256)(const float*, XBlock*) = quantize_block256;
#else
  void (*const block512)(const float*, XBlock*) = nullptr;
  void (*const block256)(const float*, XBlock*) = nullptr;
#endif
  block_linear<Q8, Q41, XBlock>(packed, format == QuantFormat::kQ8_0Int8, groups, x, ldx, M, K, out, ldo, level,
                                block512, quantize_block_scalar, block256);
}

}  // namespace linear_impl
}  // namespace eagle
