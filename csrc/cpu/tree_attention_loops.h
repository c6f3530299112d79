// Hot loops of the CPU tree_attention kernel (csrc/cpu/tree_attention.cpp), in three variants:
// portable scalar (also float64 and head dims not divisible by 16), AVX2+FMA+F16C and AVX-512
// (function multiversioning through the target attributes and target regions of simd.h; the
// caller picks one per call from isa::current()), plus bf16 pair loops for AVX512_BF16. QK and
// PV of the vector variants come from one register-blocked source, tree_attention_blocks.inc.
// Included by tree_attention.cpp only.
//
// Layouts (see tree_attention.cpp): Qt [D][Rp] pre-scaled queries, St [TK][Rp] scores then
// probabilities, acc [R][D] un-normalised outputs; krows / vrows: nk pointers to fp32 rows of D.
#pragma once

#include "simd.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace eagle {
namespace tree_attention_loops {
// ------------------------------------------------------------------------- portable hot loops
// St[k][r] = sum_d K[k][d] * Qt[d][r] for k < nk, r < Rp.
template <typename Acc>
void qk_scalar(const Acc* const* krows, int nk, const Acc* Qt, int D, int Rp, Acc* St) {
  for (int k = 0; k < nk; ++k) {
    Acc* s = St + static_cast<int64_t>(k) * Rp;
    for (int r = 0; r < Rp; ++r) s[r] = 0;
    const Acc* kr = krows[k];
    for (int d = 0; d < D; ++d) {
      const Acc kv = kr[d];
      const Acc* qd = Qt + static_cast<int64_t>(d) * Rp;
      for (int r = 0; r < Rp; ++r) s[r] += kv * qd[r];
    }
  }
}

// Online softmax update of one tile (base 2): m, l running max and sum per row; alpha = the
// factor acc must be rescaled by. St is overwritten with the probabilities.
template <typename Acc>
void softmax_scalar(Acc* St, int nk, int Rp, Acc* m, Acc* l, Acc* alpha) {
  const Acc ninf = -std::numeric_limits<Acc>::infinity();
  for (int r = 0; r < Rp; ++r) {
    Acc mx = m[r];
    for (int k = 0; k < nk; ++k) mx = std::max(mx, St[static_cast<int64_t>(k) * Rp + r]);
    // A row that has seen only masked keys keeps m = -inf; shift by 0 so that no -inf - -inf
    // NaN appears (its probabilities and alpha are then exactly 0).
    const Acc shift = mx == ninf ? Acc(0) : mx;
    alpha[r] = std::exp2(m[r] - shift);
    Acc sum = 0;
    for (int k = 0; k < nk; ++k) {
      Acc& s = St[static_cast<int64_t>(k) * Rp + r];
      s = std::exp2(s - shift);
      sum += s;
    }
    l[r] = l[r] * alpha[r] + sum;
    m[r] = mx;
  }
}

// acc[r][:] = alpha[r] * acc[r][:] + sum_k P[k][r] * V[k][:] for r < R.
template <typename Acc>
void pv_scalar(const Acc* P, int nk, int Rp, int R, const Acc* const* vrows, int D, Acc* acc, const Acc* alpha) {
  for (int r = 0; r < R; ++r) {
    Acc* a = acc + static_cast<int64_t>(r) * D;
    const Acc s = alpha[r];
    for (int d = 0; d < D; ++d) a[d] *= s;
    for (int k = 0; k < nk; ++k) {
      const Acc p = P[static_cast<int64_t>(k) * Rp + r];
      if (p == Acc(0)) continue;
      const Acc* v = vrows[k];
      for (int d = 0; d < D; ++d) a[d] += p * v[d];
    }
  }
}

template <typename T, typename Acc>
void to_acc_scalar(const T* src, Acc* dst, int D) {
  for (int d = 0; d < D; ++d) dst[d] = static_cast<Acc>(src[d]);
}

// --------------------------------------------------------------------------- AVX-512 hot loops
#if EAGLE_X86_SIMD
// The vector softmax steps take 2^(score - running max) from simd.h's exp2 (FMA form; -inf
// gives 0).
using simd::avx2::exp2_nonpositive;
using simd::avx512::exp2_nonpositive;

// K / V rows of a 16-bit dtype widened to fp32 (D values).
template <typename T>
using Bits = std::conditional_t<std::is_same_v<T, c10::BFloat16>, Bf16Bits, Fp16Bits>;
template <typename T>
EAGLE_TARGET_AVX512 void to_float_avx512(const T* src, float* dst, int D) {
  simd::avx512::widen_row(reinterpret_cast<const Bits<T>*>(src), dst, D);
}
template <typename T>
EAGLE_TARGET_AVX2 void to_float_avx2(const T* src, float* dst, int D) {
  simd::avx2::widen_row(reinterpret_cast<const Bits<T>*>(src), dst, D);
}

// Rows r .. r + 15 of an online-softmax step, before the exponentials: the new running max
// over the tile's nk scores and the shift of the scores (0 for rows that have seen only masked
// keys, so that no -inf - -inf NaN appears).
EAGLE_TARGET_AVX512 inline void softmax_shift_avx512(const float* St, int nk, int Rp, int r, const float* m, __m512& mx,
                                                     __m512& shift) {
  mx = _mm512_loadu_ps(m + r);
  for (int k = 0; k < nk; ++k) mx = _mm512_max_ps(mx, _mm512_loadu_ps(St + static_cast<int64_t>(k) * Rp + r));
  const __mmask16 dead = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
  shift = _mm512_mask_mov_ps(mx, dead, _mm512_setzero_ps());
}

// ... and after them: alpha = 2^(m_old - shift), l = l * alpha + sum, m = the new max.
EAGLE_TARGET_AVX512 inline void softmax_commit_avx512(int r, __m512 mx, __m512 shift, __m512 sum, float* m, float* l,
                                                      float* alpha) {
  const __m512 a = exp2_nonpositive<true>(_mm512_sub_ps(_mm512_loadu_ps(m + r), shift));
  _mm512_storeu_ps(alpha + r, a);
  _mm512_storeu_ps(l + r, _mm512_fmadd_ps(_mm512_loadu_ps(l + r), a, sum));
  _mm512_storeu_ps(m + r, mx);
}

EAGLE_TARGET_AVX512 inline void softmax_avx512(float* St, int nk, int Rp, float* m, float* l, float* alpha) {
  for (int r = 0; r < Rp; r += 16) {
    __m512 mx, shift;
    softmax_shift_avx512(St, nk, Rp, r, m, mx, shift);
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < nk; ++k) {
      float* s = St + static_cast<int64_t>(k) * Rp + r;
      const __m512 p = exp2_nonpositive<true>(_mm512_sub_ps(_mm512_loadu_ps(s), shift));
      _mm512_storeu_ps(s, p);
      sum = _mm512_add_ps(sum, p);
    }
    softmax_commit_avx512(r, mx, shift, sum, m, l, alpha);
  }
}

// ------------------------------------------------------------------------------ AVX2 hot loops
// Same algorithms at 8 lanes (AVX2 + FMA + F16C), for x86-64 CPUs without AVX-512.
EAGLE_TARGET_AVX2 inline void softmax_avx2(float* St, int nk, int Rp, float* m, float* l, float* alpha) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < Rp; r += 8) {
    const __m256 m_old = _mm256_loadu_ps(m + r);
    __m256 mx = m_old;
    for (int k = 0; k < nk; ++k) mx = _mm256_max_ps(mx, _mm256_loadu_ps(St + static_cast<int64_t>(k) * Rp + r));
    const __m256 dead = _mm256_cmp_ps(mx, ninf, _CMP_EQ_OQ);
    const __m256 shift = _mm256_andnot_ps(dead, mx);  // 0 where the row saw no key yet
    const __m256 a = exp2_nonpositive<true>(_mm256_sub_ps(m_old, shift));
    __m256 sum = _mm256_setzero_ps();
    for (int k = 0; k < nk; ++k) {
      float* s = St + static_cast<int64_t>(k) * Rp + r;
      const __m256 p = exp2_nonpositive<true>(_mm256_sub_ps(_mm256_loadu_ps(s), shift));
      _mm256_storeu_ps(s, p);
      sum = _mm256_add_ps(sum, p);
    }
    _mm256_storeu_ps(alpha + r, a);
    _mm256_storeu_ps(l + r, _mm256_fmadd_ps(_mm256_loadu_ps(l + r), a, sum));
    _mm256_storeu_ps(m + r, mx);
  }
}

// ------------------------------------------------------------- AVX-512 BF16 dot-product loops
// For bf16 inputs on CPUs with AVX512_BF16: vdpbf16ps multiplies 32 bf16 pairs and adds them to
// 16 fp32 lanes, twice the multiply-adds of an fp32 FMA. Operands come as pairs along the
// reduction dim: Qp[dp][r][2] (q at d = 2dp, 2dp + 1; unscaled, exact bf16), K rows as stored
// (d pairs are adjacent), Pp[kp][r][2] (probabilities of keys 2kp, 2kp + 1 rounded to bf16, as
// the GPU kernel rounds p for its p.v product) and Vp[kp][d][2] (rows 2kp and 2kp + 1
// interleaved). Scores, softmax and outputs stay fp32.

// 32-bit word at p (a bf16 pair), without alignment or aliasing assumptions.
inline int32_t bf16_pair(const void* p) {
  int32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// [lo[0], hi[0], lo[1], hi[1], ...]: 16 bf16 of each row into 16 pairs.
EAGLE_TARGET_AVX512_BF16 inline __m512i interleave_bf16(__m256i lo, __m256i hi) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_permutexvar_epi16(_mm512_load_si512(order), both);
}

// softmax_avx512 over scores St[k][r], writing the probabilities as bf16 pairs Pp[kp][r][2]
// (an odd last key pairs with 0) instead of back into St; m, l, alpha as there, the sum of
// each row in the same key order.
EAGLE_TARGET_AVX512_BF16 inline void softmax_pack_bf16(const float* St, int nk, int Rp, float* m, float* l,
                                                       float* alpha, uint16_t* Pp) {
  for (int r = 0; r < Rp; r += 16) {
    __m512 mx, shift;
    softmax_shift_avx512(St, nk, Rp, r, m, mx, shift);
    __m512 sum = _mm512_setzero_ps();
    for (int kp = 0; kp < (nk + 1) / 2; ++kp) {
      const float* s0 = St + static_cast<int64_t>(2 * kp) * Rp + r;
      const __m512 p0 = exp2_nonpositive<true>(_mm512_sub_ps(_mm512_loadu_ps(s0), shift));
      sum = _mm512_add_ps(sum, p0);
      __m256i hi = _mm256_setzero_si256();
      if (2 * kp + 1 < nk) {
        const __m512 p1 = exp2_nonpositive<true>(_mm512_sub_ps(_mm512_loadu_ps(s0 + Rp), shift));
        sum = _mm512_add_ps(sum, p1);
        hi = (__m256i)_mm512_cvtneps_pbh(p1);
      }
      _mm512_storeu_si512(Pp + (static_cast<int64_t>(kp) * Rp + r) * 2,
                          interleave_bf16((__m256i)_mm512_cvtneps_pbh(p0), hi));
    }
    softmax_commit_avx512(r, mx, shift, sum, m, l, alpha);
  }
}

// Vp[kp][d][2] from nk value rows of D bf16 (D % 16 == 0); an odd last row pairs with 0.
EAGLE_TARGET_AVX512_BF16 inline void pack_values_bf16(const uint16_t* const* vrows, int nk, int D, uint16_t* Vp) {
  for (int kp = 0; kp < (nk + 1) / 2; ++kp) {
    const uint16_t* v0 = vrows[2 * kp];
    const uint16_t* v1 = 2 * kp + 1 < nk ? vrows[2 * kp + 1] : nullptr;
    for (int d = 0; d < D; d += 16) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d));
      const __m256i hi = v1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + d)) : _mm256_setzero_si256();
      _mm512_storeu_si512(Vp + (static_cast<int64_t>(kp) * D + d) * 2, interleave_bf16(lo, hi));
    }
  }
}

// ------------------------------------------------------------------- register-blocked QK / PV
// Operand accessors of the register-blocked loops (plain pointer arithmetic, inlined into
// them). Row x of the vector operand: a fixed stride apart, or one pointer per row; shifted(n)
// starts each row n elements further.
template <typename E>
struct StridedRows {
  const E* base;
  int64_t stride;
  const E* operator()(int x) const { return base + static_cast<int64_t>(x) * stride; }
  StridedRows shifted(int n) const { return {base + n, stride}; }
};
template <typename E>
struct PointedRows {
  const E* const* rows;
  int offset;
  const E* operator()(int x) const { return rows[x] + offset; }
  PointedRows shifted(int n) const { return {rows, offset + n}; }
};
// Element (j, x) of the broadcast operand (STEP elements each: 1 float or a bf16 pair):
// rows[first + j][STEP x], or base[x * stride + STEP j].
template <typename E, int STEP>
struct PointedElems {
  const E* const* rows;
  int first;
  const E* operator()(int j, int x) const { return rows[first + j] + STEP * x; }
};
template <typename E, int STEP>
struct StridedElems {
  const E* base;
  int64_t stride;
  const E* operator()(int j, int x) const { return base + static_cast<int64_t>(x) * stride + STEP * j; }
};

// tree_attention_blocks.inc compiled three times, once per target region (simd.h), as
// cpu_linear compiles its tiles.

EAGLE_TARGET_PUSH(EAGLE_ISA_AVX2)
namespace avx2 {
using Vec = __m256;
using Operand = __m256;
using Elem = float;
constexpr int kLanes = 8, kStep = 1;
// 12 accumulators (QK 6 keys x 16 rows or 12 x 8, PV 6 rows x 16 columns) and their operands
// fill the 16 ymm registers.
constexpr int kAccumulators = 12, kQkRowVecs = 2, kPvRows = 6, kPvColVecs = 2;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Operand load_operand(const float* p) { return _mm256_loadu_ps(p); }
// set1 of a loaded float: with _mm256_broadcast_ss (a builtin taking the pointer) GCC stored
// every accumulator to the stack after every FMA (55 instead of ~100 GFLOP/s).
inline Operand broadcast_operand(const float* p) { return _mm256_set1_ps(*p); }
inline Vec multiply_add(Vec c, Operand a, Operand b) { return _mm256_fmadd_ps(a, b, c); }
inline Vec load_lanes(const float* p) { return _mm256_loadu_ps(p); }
inline Operand lanes_operand(Vec v) { return v; }
// 8 x 8: 8 + 8 in-lane unpacks, then the 128-bit halves.
inline void transpose_lanes(Vec (&r)[8]) {
  Vec t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  Vec u[8];  // u[4 i + m], half L: rows 4 i .. 4 i + 3 at column 4 L + m
  for (int i = 0; i < 2; ++i) {
    const __m256d a = _mm256_castps_pd(t[4 * i]), b = _mm256_castps_pd(t[4 * i + 1]);
    const __m256d c = _mm256_castps_pd(t[4 * i + 2]), d = _mm256_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(b, d));
  }
  for (int m = 0; m < 4; ++m) {
    r[m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x20);
    r[4 + m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x31);
  }
}
inline void store_rows4(Vec a, Vec b, Vec c, Vec d, float* dst, int64_t stride, int n) {
  const __m256d ab_lo = _mm256_castps_pd(_mm256_unpacklo_ps(a, b)), ab_hi = _mm256_castps_pd(_mm256_unpackhi_ps(a, b));
  const __m256d cd_lo = _mm256_castps_pd(_mm256_unpacklo_ps(c, d)), cd_hi = _mm256_castps_pd(_mm256_unpackhi_ps(c, d));
  alignas(32) float w[4][8];  // w[m], half L: the four values of key 4 L + m
  _mm256_store_pd(reinterpret_cast<double*>(w[0]), _mm256_unpacklo_pd(ab_lo, cd_lo));
  _mm256_store_pd(reinterpret_cast<double*>(w[1]), _mm256_unpackhi_pd(ab_lo, cd_lo));
  _mm256_store_pd(reinterpret_cast<double*>(w[2]), _mm256_unpacklo_pd(ab_hi, cd_hi));
  _mm256_store_pd(reinterpret_cast<double*>(w[3]), _mm256_unpackhi_pd(ab_hi, cd_hi));
  for (int j = 0; j < n; ++j) _mm_storeu_ps(dst + j * stride, _mm_load_ps(w[j % 4] + 4 * (j / 4)));
}
#include "tree_attention_blocks.inc"
}  // namespace avx2
EAGLE_TARGET_POP

EAGLE_TARGET_PUSH(EAGLE_ISA_AVX512)
namespace avx512 {
using Vec = __m512;
using Operand = __m512;
using Elem = float;
constexpr int kLanes = 16, kStep = 1;
// 24 accumulators: QK 8 keys x 48 rows (11 loads per 24 FMAs, against 6 per 8 with 4 x 32),
// PV 6 rows x 64 columns (10 per 24).
constexpr int kAccumulators = 24, kQkRowVecs = 3, kPvRows = 6, kPvColVecs = 4;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Operand load_operand(const float* p) { return _mm512_loadu_ps(p); }
inline Operand broadcast_operand(const float* p) { return _mm512_set1_ps(*p); }
inline Vec multiply_add(Vec c, Operand a, Operand b) { return _mm512_fmadd_ps(a, b, c); }
inline Vec load_lanes(const float* p) { return _mm512_loadu_ps(p); }
inline Operand lanes_operand(Vec v) { return v; }
// 16 x 16: in-lane unpacks of 32- then 64-bit words, then two rounds of 128-bit block shuffles
// (64 shuffles).
inline void transpose_lanes(Vec (&r)[16]) {
  Vec t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  Vec u[16];  // u[4 i + m], 128-bit block L: rows 4 i .. 4 i + 3 at column 4 L + m
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int m = 0; m < 4; ++m) {
    // Blocks 0, 1 and 2, 3 of u[m], u[4 + m], then of u[8 + m], u[12 + m].
    const Vec lo01 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x44), hi01 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xEE);
    const Vec lo23 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x44);
    const Vec hi23 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_shuffle_f32x4(lo01, lo23, 0x88);
    r[4 + m] = _mm512_shuffle_f32x4(lo01, lo23, 0xDD);
    r[8 + m] = _mm512_shuffle_f32x4(hi01, hi23, 0x88);
    r[12 + m] = _mm512_shuffle_f32x4(hi01, hi23, 0xDD);
  }
}
inline void store_rows4(Vec a, Vec b, Vec c, Vec d, float* dst, int64_t stride, int n) {
  const __m512d ab_lo = _mm512_castps_pd(_mm512_unpacklo_ps(a, b)), ab_hi = _mm512_castps_pd(_mm512_unpackhi_ps(a, b));
  const __m512d cd_lo = _mm512_castps_pd(_mm512_unpacklo_ps(c, d)), cd_hi = _mm512_castps_pd(_mm512_unpackhi_ps(c, d));
  alignas(64) float w[4][16];  // w[m], 128-bit block L: the four values of key 4 L + m
  _mm512_store_pd(w[0], _mm512_unpacklo_pd(ab_lo, cd_lo));
  _mm512_store_pd(w[1], _mm512_unpackhi_pd(ab_lo, cd_lo));
  _mm512_store_pd(w[2], _mm512_unpacklo_pd(ab_hi, cd_hi));
  _mm512_store_pd(w[3], _mm512_unpackhi_pd(ab_hi, cd_hi));
  for (int j = 0; j < n; ++j) _mm_storeu_ps(dst + j * stride, _mm_load_ps(w[j % 4] + 4 * (j / 4)));
}
#include "tree_attention_blocks.inc"
}  // namespace avx512
EAGLE_TARGET_POP

// vdpbf16ps: a lane adds the two products of a bf16 pair, twice the multiply-adds of an FMA.
EAGLE_TARGET_PUSH(EAGLE_ISA_AVX512_BF16)
namespace avx512_bf16 {
using avx512::kAccumulators, avx512::kQkRowVecs, avx512::kPvRows, avx512::kPvColVecs;
using avx512::kLanes, avx512::Vec, avx512::vzero, avx512::vload, avx512::vstore, avx512::vmul, avx512::vset1;
using Operand = __m512bh;
using Elem = uint16_t;
constexpr int kStep = 2;
inline Operand load_operand(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline Operand broadcast_operand(const uint16_t* p) { return (__m512bh)_mm512_set1_epi32(bf16_pair(p)); }
inline Vec multiply_add(Vec c, Operand a, Operand b) { return _mm512_dpbf16_ps(c, a, b); }
using avx512::transpose_lanes, avx512::store_rows4;
inline Vec load_lanes(const uint16_t* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
inline Operand lanes_operand(Vec v) { return (__m512bh)_mm512_castps_si512(v); }
#include "tree_attention_blocks.inc"
}  // namespace avx512_bf16
EAGLE_TARGET_POP

// The kernel's entry points (Ops in tree_attention.cpp). fp32 queries come pre-scaled.
inline void qk_avx2(const float* const* krows, int nk, const float* Qt, int D, int Rp, float* St) {
  avx2::qk(krows, nk, Qt, D, Rp, 1.0f, St);
}
inline void pv_avx2(const float* P, int nk, int Rp, int R, const float* const* vrows, int D, float* acc,
                    const float* alpha) {
  avx2::pv(P, nk, Rp, R, PointedRows<float>{vrows, 0}, D, acc, alpha);
}
inline void qk_avx512(const float* const* krows, int nk, const float* Qt, int D, int Rp, float* St) {
  avx512::qk(krows, nk, Qt, D, Rp, 1.0f, St);
}
// Few rows, keys in the lanes (qk_few in tree_attention_blocks.inc): rows r < R of the same St.
inline void qk_few_avx2(const float* const* krows, int nk, const float* Qt, int D, int Rp, int R, float* St) {
  avx2::qk_few(krows, nk, Qt, D, Rp, R, 1.0f, St);
}
inline void qk_few_avx512(const float* const* krows, int nk, const float* Qt, int D, int Rp, int R, float* St) {
  avx512::qk_few(krows, nk, Qt, D, Rp, R, 1.0f, St);
}
inline void pv_avx512(const float* P, int nk, int Rp, int R, const float* const* vrows, int D, float* acc,
                      const float* alpha) {
  avx512::pv(P, nk, Rp, R, PointedRows<float>{vrows, 0}, D, acc, alpha);
}
// Qp[d / 2][r][2] unscaled (the scale goes on the scores); Pp[kp][r][2] and Vp[kp][d][2] as
// softmax_pack_bf16 and pack_values_bf16 write them.
inline void qk_bf16_pairs(const uint16_t* const* krows, int nk, const uint16_t* Qp, int D, int Rp, float scale,
                          float* St) {
  avx512_bf16::qk(krows, nk, Qp, D, Rp, scale, St);
}
inline void qk_few_bf16_pairs(const uint16_t* const* krows, int nk, const uint16_t* Qp, int D, int Rp, int R,
                              float scale, float* St) {
  avx512_bf16::qk_few(krows, nk, Qp, D, Rp, R, scale, St);
}
inline void pv_bf16_pairs(const uint16_t* Pp, int nkp, int Rp, int R, const uint16_t* Vp, int D, float* acc,
                          const float* alpha) {
  avx512_bf16::pv(Pp, nkp, Rp, R, StridedRows<uint16_t>{Vp, 2 * static_cast<int64_t>(D)}, D, acc, alpha);
}
#endif  // EAGLE_X86_SIMD
}  // namespace tree_attention_loops
}  // namespace eagle
