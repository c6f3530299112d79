// The CPU instruction-set layer of the kernels in csrc/cpu: which vector path a call takes, the
// target strings its variants are compiled with, and the vector helpers they share (widening
// loads of fp32 / bf16 / fp16, horizontal reductions, exp and exp2). docs/cpu_kernels.md
// describes the layer and each kernel's paths.
//
// The extension is built for plain x86-64 (no -march), so that it loads on any x86-64 CPU; each
// vector path is compiled for its instruction set with a target attribute or inside a target
// region, and picked per call:
//
//   isa::current() = min(the best level the CPU has, the cap EAGLE_KERNELS_CPU_ISA sets)
//
// over one ordered vocabulary, scalar < avx2 < avx512-ymm < avx512 < avx512-bf16 (isa::Level).
// The variable is read on every call (a getenv, tens of nanoseconds), so that tests reach every
// path on one machine.
//
// Include this header before any other (GCC 12's AVX-512 headers warn about their own code, and
// only a pragma ahead of their first inclusion silences it).
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers build vectors from _mm512_undefined_* pass-through operands (in
// _mm512_max_ps, _mm512_roundscale_ps, _mm512_scalef_ps, the casts) and report them as used
// uninitialised; the diagnostic points into the header.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <cstdint>
#include <cstring>

#include <c10/util/Half.h>

// Put before a loop over a tile's compile-time extent (rows of x, weight vectors, groups) so the
// compiler unrolls it completely before it decides where the tile's accumulator arrays live. GCC 12
// otherwise keeps such an array in memory when a loop over it (typically the final stores) is
// left rolled, and then stores every accumulator back to the stack at every k step: the AVX2
// packed tiles ran 12 dead 256-bit stores a step beside 12 FMAs, at about a third of the FMA rate
// (docs/cpu_kernels.md, "Accumulators kept in registers").
#if defined(__clang__)
#define EAGLE_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define EAGLE_UNROLL _Pragma("GCC unroll 64")
#else
#define EAGLE_UNROLL
#endif

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define EAGLE_X86_SIMD 1
#include <immintrin.h>
#else
#define EAGLE_X86_SIMD 0
#endif

namespace eagle {
namespace isa {

// Instruction-set levels, ordered: a kernel runs its best variant at or below isa::current().
//   kScalar      portable loops (the compiler's baseline x86-64 vectorisation)
//   kAvx2        AVX2 + FMA + F16C, 8 fp32 lanes
//   kAvx512Ymm   AVX-512 (F, BW, VL, DQ) kernels, except that cpu_linear's row-major tiles keep
//                8 lanes (its paired 16-lane tiles are off): a comparison and test setting
//   kAvx512      AVX-512 F + BW + VL + DQ, 16 fp32 lanes
//   kAvx512Bf16  AVX-512 with AVX512_BF16 (tree_attention's bf16 dot products)
enum class Level : int { kScalar = 0, kAvx2 = 1, kAvx512Ymm = 2, kAvx512 = 3, kAvx512Bf16 = 4 };

// The highest level this CPU supports (detected once).
Level cpu_level();

// The cap EAGLE_KERNELS_CPU_ISA sets, parsed on every call: one of the level names of
// level_name, or the aliases portable (= scalar) and native (no cap); unset or empty is no cap.
// Any other value raises ValueError naming the variable and the accepted values.
Level env_cap();

// The level this call runs: min(cpu_level(), env_cap()).
Level current();

// "scalar", "avx2", "avx512-ymm", "avx512" or "avx512-bf16".
const char* level_name(Level level);

}  // namespace isa

// The raw bits of a bf16 or an IEEE fp16 value: element types of weights and logits, told apart
// from each other (and from float) by type. Widening either to fp32 is exact.
enum class Bf16Bits : uint16_t {};
enum class Fp16Bits : uint16_t {};

inline float widen(float v) { return v; }
inline float widen(Bf16Bits v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;  // bf16 is the top half of a float
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float widen(Fp16Bits v) { return c10::detail::fp16_ieee_to_fp32_value(static_cast<uint16_t>(v)); }

namespace simd {
// ------------------------------------------------------------------------- portable lanes
// The vector helpers below at one float per lane, for the scalar paths that must give the
// vector paths' bits (verify's baseline variant): plain float arithmetic, which the build
// (ISO C++, no -ffast-math) neither contracts into FMAs nor reassociates.
namespace scalar {
using V = float;
inline V vset1(float x) { return x; }
inline V vadd(V a, V b) { return a + b; }
inline V vsub(V a, V b) { return a - b; }
inline V vmul(V a, V b) { return a * b; }
inline V vmax(V x, V floor) { return x > floor ? x : floor; }  // NaN -> floor, as maxps
// Round to nearest even: adding 1.5 * 2^23 leaves no fraction bits (|x| < 2^22).
inline V vround(V x) { return (x + 12582912.0f) - 12582912.0f; }
// p * 2^n for integer-valued n in [-127, 127]: the exponent field n + 127, so n = -127 gives +0.
inline V vscale_pow2(V p, V n) {
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float s;
  std::memcpy(&s, &bits, sizeof(s));
  return p * s;
}
template <bool kFused>
inline V vmadd(V a, V b, V c) {
  static_assert(!kFused, "the portable lanes have no FMA");
  return a * b + c;
}
template <bool kFused>
inline V vnmadd(V a, V b, V c) {
  static_assert(!kFused, "the portable lanes have no FMA");
  return c - a * b;
}
#include "simd_exp.inc"
}  // namespace scalar
}  // namespace simd
}  // namespace eagle

// --------------------------------------------------------------------------- target strings
// The instruction sets of each level's variants, spelled once: in target attributes
// (EAGLE_TARGET_AVX2 void f()) and in target regions (EAGLE_TARGET_PUSH(EAGLE_ISA_AVX2) ...
// EAGLE_TARGET_POP: every function defined between, templates included, is compiled for it,
// so one source included once per region yields one variant per instruction set).
// isa::cpu_level() checks exactly these features.
#if EAGLE_X86_SIMD
#define EAGLE_ISA_AVX2           "avx2,fma,f16c"
#define EAGLE_ISA_AVX512         "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"
#define EAGLE_ISA_AVX512_BF16    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"
#define EAGLE_TARGET_AVX2        __attribute__((target(EAGLE_ISA_AVX2)))
#define EAGLE_TARGET_AVX512      __attribute__((target(EAGLE_ISA_AVX512)))
#define EAGLE_TARGET_AVX512_BF16 __attribute__((target(EAGLE_ISA_AVX512_BF16)))

#define EAGLE_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define EAGLE_TARGET_PUSH(isa) EAGLE_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define EAGLE_TARGET_POP       EAGLE_PRAGMA(clang attribute pop)
#else
#define EAGLE_TARGET_PUSH(isa) EAGLE_PRAGMA(GCC push_options) EAGLE_PRAGMA(GCC target(isa))
#define EAGLE_TARGET_POP       EAGLE_PRAGMA(GCC pop_options)
#endif

namespace eagle {
namespace simd {
// ------------------------------------------------------------------------------ 8 lanes
EAGLE_TARGET_PUSH(EAGLE_ISA_AVX2)
namespace avx2 {
using V = __m256;
inline V vset1(float x) { return _mm256_set1_ps(x); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vmax(V x, V floor) { return _mm256_max_ps(x, floor); }  // NaN lanes of x -> floor
inline V vround(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integer-valued n in [-127, 127] (n = -127: +0), as the portable lanes.
inline V vscale_pow2(V p, V n) {
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
// c + a * b and c - a * b: one rounding (FMA), or two as the portable lanes.
template <bool kFused>
inline V vmadd(V a, V b, V c) {
  if constexpr (kFused) return _mm256_fmadd_ps(a, b, c);
  return _mm256_add_ps(_mm256_mul_ps(a, b), c);
}
template <bool kFused>
inline V vnmadd(V a, V b, V c) {
  if constexpr (kFused) return _mm256_fnmadd_ps(a, b, c);
  return _mm256_sub_ps(c, _mm256_mul_ps(a, b));
}
#include "simd_exp.inc"

// Eight elements widened to fp32 (exactly).
inline V load8(const float* p) { return _mm256_loadu_ps(p); }
inline V load8(const Bf16Bits* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V load8(const Fp16Bits* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// dst[0 .. n) = src[0 .. n) widened to fp32.
template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  for (; i < n; ++i) dst[i] = widen(src[i]);
}

inline float reduce_max(V x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline float reduce_add(V x) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
}  // namespace avx2
EAGLE_TARGET_POP

// ----------------------------------------------------------------------------- 16 lanes
EAGLE_TARGET_PUSH(EAGLE_ISA_AVX512)
namespace avx512 {
using V = __m512;
inline V vset1(float x) { return _mm512_set1_ps(x); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vmax(V x, V floor) { return _mm512_max_ps(x, floor); }  // NaN lanes of x -> floor
inline V vround(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integer-valued n in [-127, 127] (n = -127: +0): scalef, which rounds once as the
// 8-lane and portable multiplies by 2^n do, so the lanes agree bit for bit.
inline V vscale_pow2(V p, V n) {
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(n, _mm512_set1_ps(-127.0f), _CMP_GT_OQ), p, n);
}
template <bool kFused>
inline V vmadd(V a, V b, V c) {
  if constexpr (kFused) return _mm512_fmadd_ps(a, b, c);
  return _mm512_add_ps(_mm512_mul_ps(a, b), c);
}
template <bool kFused>
inline V vnmadd(V a, V b, V c) {
  if constexpr (kFused) return _mm512_fnmadd_ps(a, b, c);
  return _mm512_sub_ps(c, _mm512_mul_ps(a, b));
}
#include "simd_exp.inc"

// Sixteen elements widened to fp32 (exactly).
inline V load16(const float* p) { return _mm512_loadu_ps(p); }
inline V load16(const Bf16Bits* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline V load16(const Fp16Bits* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// The lanes of `valid` from p, the others -inf; memory past them is not touched.
inline V load16_or_neg_inf(const float* p, __mmask16 valid) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-__builtin_inff()), valid, p);
}
inline V load16_or_neg_inf(const Bf16Bits* p, __mmask16 valid) {
  const __m256i h = _mm256_mask_loadu_epi16(_mm256_set1_epi16(int16_t(0xFF80)), valid, p);  // bf16 -inf
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline V load16_or_neg_inf(const Fp16Bits* p, __mmask16 valid) {
  return _mm512_cvtph_ps(_mm256_mask_loadu_epi16(_mm256_set1_epi16(int16_t(0xFC00)), valid, p));  // fp16 -inf
}

template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
  for (; i < n; ++i) dst[i] = widen(src[i]);
}

// Through memory: they run once per row (or when a running max grows), and GCC 12's
// _mm512_reduce_* helpers raise -Wuninitialized inside its own header.
inline float reduce_max(V x) {
  alignas(64) float t[16];
  _mm512_store_ps(t, x);
  float m = t[0];
  for (int i = 1; i < 16; ++i) m = t[i] > m ? t[i] : m;
  return m;
}
inline float reduce_add(V x) {
  alignas(64) float t[16];
  _mm512_store_ps(t, x);
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += t[i];
  return s;
}
}  // namespace avx512
EAGLE_TARGET_POP
}  // namespace simd
}  // namespace eagle
#else
#define EAGLE_TARGET_AVX2
#define EAGLE_TARGET_AVX512
#define EAGLE_TARGET_AVX512_BF16
#endif  // EAGLE_X86_SIMD
