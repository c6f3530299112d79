// Internal to cpu_linear: the packed Q8_0 / Q4_1 block layout that both quantized kernels read (cpu_linear_quant.cpp:
// fp32 activations; cpu_linear_dot.cpp: GGML's 8-bit activations), and the helpers that read it. Per group of 32
// output columns, half (16 columns) and block of 32 k steps, in 32-byte lines:
//
//   Q8_0 (17 lines, 544 bytes): 16 fp16 scales d[j]; then 8 chunks of 64 bytes, byte 4 j + r of chunk t holding
//        column j's int8 quant of k = 4 t + r.                                     w[k, j] = d[j] * q[k, j]
//   Q4_1 (10 lines, 320 bytes): 16 fp16 scales d[j], 16 fp16 minimums m[j]; then 4 chunks of 64 bytes, byte
//        4 j + r of chunk t holding column j's 4-bit quant of k = 4 t + r in its low nibble and of
//        k = 16 + 4 t + r in its high nibble.                                      w[k, j] = d[j] * q[k, j] + m[j]
//
// A 32-bit lane holds 4 consecutive k of one column, so one VPDPBUSD multiplies 16 columns by 4 steps of an 8-bit
// form of x and adds the four products. The fp32-activation weight is this as 4-D [N / 32, 2, K / 32, bytes], the
// 8-bit-activation weight as 5-D [N / 32, 2, K / 32, lines, 32]: the same bytes.
#pragma once

#include "simd.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_linear_groups.h"
#include "cpu_linear_impl.h"

#if EAGLE_X86_SIMD
#define EAGLE_ISA_AVX512_VNNI    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"
#define EAGLE_TARGET_AVX512_VNNI __attribute__((target(EAGLE_ISA_AVX512_VNNI)))
#endif

namespace eagle {
namespace linear_impl {
namespace blocks {

constexpr int64_t kHalf = kPackWidth / 2;
constexpr int64_t kBlock = kQuantBlock;

// A format's bytes. The AVX-512 tiles prefetch (into L2), per block and weight stream, the lines kAhead bytes ahead
// in the same stream, or with kAhead = 0 the lines at the same place in the next tile's stream (the next G groups).
struct Q8Layout {
  static constexpr int64_t kBytes = kQ8BlockBytes;  // per block of a half
  static constexpr int64_t kParams = 32;            // bytes of block parameters before the quants
  static constexpr int64_t kAhead = 512;
  static constexpr bool kSigned = true;
  static constexpr int kChunks = kBlock / 4;  // chunks of 64 bytes
  static constexpr int kParts = 1;            // reads of a chunk (Q4_1: low, then high nibbles)
};
struct Q41Layout {
  static constexpr int64_t kBytes = kQ41BlockBytes;
  static constexpr int64_t kParams = 64;
  static constexpr int64_t kAhead = 0;
  static constexpr bool kSigned = false;
  static constexpr int kChunks = kBlock / 8;
  static constexpr int kParts = 2;
};
// Weight bytes ahead of the current block that an AVX2 tile (one stream) prefetches (into L2).
constexpr int64_t kPrefetchAhead = 4096;

// The first k step that chunk t, part `part` multiplies.
constexpr int64_t x_step(int64_t t, int part) { return 16 * part + 4 * t; }

inline float half_at(const uint8_t* p, int64_t j) {
  uint16_t bits;
  std::memcpy(&bits, p + 2 * j, 2);
  return widen(static_cast<Fp16Bits>(bits));
}

// Column j's quant of step i of a block (base: the block's first byte, in a half).
template <typename F>
inline int32_t quant_at(const uint8_t* base, int64_t i, int64_t j) {
  if constexpr (F::kSigned) {
    return static_cast<int8_t>(base[F::kParams + (i / 4) * 64 + 4 * j + i % 4]);
  } else {
    const int64_t r = i % 16;
    const uint8_t byte = base[F::kParams + (r / 4) * 64 + 4 * j + r % 4];
    return i < 16 ? (byte & 0xF) : (byte >> 4);
  }
}

#if EAGLE_X86_SIMD
EAGLE_TARGET_AVX512_VNNI inline __m512 params16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
EAGLE_TARGET_AVX2 inline __m256 params8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// Four int8 values from p in every 32-bit lane.
EAGLE_TARGET_AVX512_VNNI inline __m512i bytes4_512(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// A chunk's weights as the unsigned operand of VPDPBUSD (part: 0, or Q4_1's high nibbles 1). Q8_0: q + 128
// (q ^ 0x80), so a product sum over an 8-bit x is 128 sum(x) too large; Q4_1: q.
template <typename F>
EAGLE_TARGET_AVX512_VNNI inline __m512i chunk512(const uint8_t* base, int64_t t, int part) {
  const __m512i raw = _mm512_loadu_si512(base + F::kParams + t * 64);
  if constexpr (F::kSigned) return _mm512_xor_si512(raw, _mm512_set1_epi8(static_cast<char>(0x80)));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  return _mm512_and_si512(part == 0 ? raw : _mm512_srli_epi16(raw, 4), low4);
}

// A block of 32 elements of x: its two halves in a, b and its largest |x| in amax; false (the rest unset) where it
// holds inf or nan (|x| compares unordered or equal to inf).
EAGLE_TARGET_AVX512 inline bool load_block512(const float* x, __m512& a, __m512& b, float& amax) {
  a = _mm512_loadu_ps(x);
  b = _mm512_loadu_ps(x + 16);
  const __m512 abs_a = _mm512_abs_ps(a), abs_b = _mm512_abs_ps(b);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  if (_mm512_cmp_ps_mask(abs_a, inf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(abs_b, inf, _CMP_NLT_UQ)) return false;
  amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_a, abs_b));
  return true;
}

// The same in four 8-lane vectors.
EAGLE_TARGET_AVX2 inline bool load_block256(const float* x, __m256 (&v)[4], float& amax) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 largest = _mm256_setzero_ps();
  int bad = 0;
  EAGLE_UNROLL
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    const __m256 magnitude = _mm256_andnot_ps(sign, v[i]);
    bad |= _mm256_movemask_ps(_mm256_cmp_ps(magnitude, inf, _CMP_NLT_UQ));
    largest = _mm256_max_ps(largest, magnitude);
  }
  if (bad) return false;
  amax = simd::avx2::reduce_max(largest);
  return true;
}

// Prefetches (into L2) the block at `base` + `ahead`.
template <typename F>
inline void prefetch_block(const uint8_t* base, int64_t ahead) {
  for (int64_t off = 0; off < F::kBytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(base + ahead + off), _MM_HINT_T1);
}
#endif  // EAGLE_X86_SIMD

// Whether the CPU has AVX512_VNNI (Ice Lake, Sapphire Rapids, Zen 4): the AVX-512 tiles of both kernels need it; an
// AVX-512 CPU without it runs their AVX2 tiles.
inline bool has_vnni() {
#if EAGLE_X86_SIMD && (defined(__GNUC__) || defined(__clang__))
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  return vnni;
#else
  return false;
#endif
}

// A quantized kernel's call: x [M, K] (row stride ldx) in the kernel's activation form XB, one block of 32
// elements at a time (`block512` at AVX-512 levels, `block256` at AVX2, either null where there is none;
// `block_scalar` below them or in place of a null one), once per call before the weights stream; then the groups of the
// packed weight over the threads, by the tiles of Q8T (q8) or Q41T: out[m * ldo + n]. Their AVX-512 tiles need VNNI
// (has_vnni); without it a call runs their AVX2 tiles.
template <typename Q8T, typename Q41T, typename XB>
void block_linear(const uint8_t* packed, bool q8, int64_t groups, const float* x, int64_t ldx, int64_t M, int64_t K,
                  float* out, int64_t ldo, isa::Level level, void (*block512)(const float*, XB*),
                  void (*block_scalar)(const float*, XB*), void (*block256)(const float*, XB*)) {
  const int64_t nb = K / kBlock;
  std::vector<XB> xb(static_cast<size_t>(M * nb));
  auto to_block = block_scalar;
  if (block512 != nullptr && level >= isa::Level::kAvx512Ymm)
    to_block = block512;
  else if (block256 != nullptr && level >= isa::Level::kAvx2)
    to_block = block256;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) to_block(x + m * ldx + b * kBlock, xb.data() + m * nb + b);
  const isa::Level tiles = level >= isa::Level::kAvx512Ymm && !has_vnni() ? isa::Level::kAvx2 : level;
  parallel_groups(groups, K, M, [&](int64_t begin, int64_t end) {
    if (q8)
      run_groups<BlockTiles<Q8T, XB>>(packed, begin, end, nb, xb.data(), nb, M, out, ldo, tiles);
    else
      run_groups<BlockTiles<Q41T, XB>>(packed, begin, end, nb, xb.data(), nb, M, out, ldo, tiles);
  });
}

}  // namespace blocks
}  // namespace linear_impl
}  // namespace eagle
