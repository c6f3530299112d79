// CPU launcher and kernel of tree_attention (contract §1): attention of the N tree nodes over
// the committed prefix (no mask) and over their own ancestors' tree slots (int64 bitmask rows,
// or causal j <= i when tree_mask is None).
//
// Work item = (request b, KV head h, block of nodes). Its rows are (node, query head of the
// group) pairs, so one load (and dtype conversion) of each K/V tile serves every query head
// that shares the KV head (GQA packing). Flash-attention style online softmax (Dao et al.
// 2022, Alg. 1) in float32 over key tiles of TK positions; scores use base 2 (q is pre-scaled
// by sm_scale * log2 e) so that one exp2 per score suffices.
//
// Data layout inside a work item, chosen so that every hot loop is vertical SIMD:
//   Qt [D][Rp]   the rows' queries, transposed once per item (Rp = rows rounded up to 16)
//   St [TK][Rp]  scores, then probabilities, of one key tile
//   acc [R][D]   un-normalised outputs
// so QK^T broadcasts one key element against 16 rows, the softmax statistics are per-lane,
// and PV broadcasts one probability against a V row.
//
// The hot loops exist three times: AVX-512 and AVX2+FMA intrinsics (function multiversioning,
// chosen at run time with __builtin_cpu_supports; the wheel itself is built for plain x86-64)
// and a portable scalar version, which also serves float64 and head dims not divisible by 16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* helpers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "checks.h"
#include "ops.h"

namespace eagle {
namespace {

constexpr int TK = 32;        // key positions per tile
constexpr int ROW_PAD = 16;   // rows are padded to a multiple of one AVX-512 float vector
constexpr int MAX_ROWS = 128; // rows per work item (bounds the per-thread scratch)
constexpr double LOG2E = 1.4426950408889634;

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
void pv_scalar(const Acc* P, int nk, int Rp, int R, const Acc* const* vrows, int D, Acc* acc,
               const Acc* alpha) {
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
#if defined(__x86_64__)
#define EAGLE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

// 2^x for x <= 0 or -inf (scores minus the running max), max rel. error ~2e-7: 2^x =
// 2^n * 2^f with n = round(x), f in [-0.5, 0.5], 2^f by a degree-6 polynomial (Taylor of
// e^(f ln2), truncation < 1e-8). Inputs below -126 (incl. -inf) give exactly 0.
EAGLE_AVX512 inline __m512 exp2_avx512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);  // ln2^6 / 720
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));  // ln2^5 / 120
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

EAGLE_AVX512 void qk_avx512(const float* const* krows, int nk, const float* Qt, int D, int Rp,
                            float* St) {
  int k = 0;
  for (; k + 4 <= nk; k += 4) {
    const float* k0 = krows[k];
    const float* k1 = krows[k + 1];
    const float* k2 = krows[k + 2];
    const float* k3 = krows[k + 3];
    int r = 0;
    for (; r + 32 <= Rp; r += 32) {
      __m512 a00 = _mm512_setzero_ps(), a01 = _mm512_setzero_ps();
      __m512 a10 = _mm512_setzero_ps(), a11 = _mm512_setzero_ps();
      __m512 a20 = _mm512_setzero_ps(), a21 = _mm512_setzero_ps();
      __m512 a30 = _mm512_setzero_ps(), a31 = _mm512_setzero_ps();
      for (int d = 0; d < D; ++d) {
        const float* qd = Qt + static_cast<int64_t>(d) * Rp + r;
        const __m512 q0 = _mm512_loadu_ps(qd);
        const __m512 q1 = _mm512_loadu_ps(qd + 16);
        __m512 b = _mm512_set1_ps(k0[d]);
        a00 = _mm512_fmadd_ps(b, q0, a00);
        a01 = _mm512_fmadd_ps(b, q1, a01);
        b = _mm512_set1_ps(k1[d]);
        a10 = _mm512_fmadd_ps(b, q0, a10);
        a11 = _mm512_fmadd_ps(b, q1, a11);
        b = _mm512_set1_ps(k2[d]);
        a20 = _mm512_fmadd_ps(b, q0, a20);
        a21 = _mm512_fmadd_ps(b, q1, a21);
        b = _mm512_set1_ps(k3[d]);
        a30 = _mm512_fmadd_ps(b, q0, a30);
        a31 = _mm512_fmadd_ps(b, q1, a31);
      }
      float* s = St + static_cast<int64_t>(k) * Rp + r;
      _mm512_storeu_ps(s, a00);
      _mm512_storeu_ps(s + 16, a01);
      _mm512_storeu_ps(s + Rp, a10);
      _mm512_storeu_ps(s + Rp + 16, a11);
      _mm512_storeu_ps(s + 2 * Rp, a20);
      _mm512_storeu_ps(s + 2 * Rp + 16, a21);
      _mm512_storeu_ps(s + 3 * Rp, a30);
      _mm512_storeu_ps(s + 3 * Rp + 16, a31);
    }
    for (; r < Rp; r += 16) {
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
      for (int d = 0; d < D; ++d) {
        const __m512 q0 = _mm512_loadu_ps(Qt + static_cast<int64_t>(d) * Rp + r);
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(k0[d]), q0, a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(k1[d]), q0, a1);
        a2 = _mm512_fmadd_ps(_mm512_set1_ps(k2[d]), q0, a2);
        a3 = _mm512_fmadd_ps(_mm512_set1_ps(k3[d]), q0, a3);
      }
      float* s = St + static_cast<int64_t>(k) * Rp + r;
      _mm512_storeu_ps(s, a0);
      _mm512_storeu_ps(s + Rp, a1);
      _mm512_storeu_ps(s + 2 * Rp, a2);
      _mm512_storeu_ps(s + 3 * Rp, a3);
    }
  }
  for (; k < nk; ++k) {
    const float* kr = krows[k];
    for (int r = 0; r < Rp; r += 16) {
      __m512 a = _mm512_setzero_ps();
      for (int d = 0; d < D; ++d)
        a = _mm512_fmadd_ps(_mm512_set1_ps(kr[d]),
                            _mm512_loadu_ps(Qt + static_cast<int64_t>(d) * Rp + r), a);
      _mm512_storeu_ps(St + static_cast<int64_t>(k) * Rp + r, a);
    }
  }
}

EAGLE_AVX512 void softmax_avx512(float* St, int nk, int Rp, float* m, float* l, float* alpha) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < Rp; r += 16) {
    const __m512 m_old = _mm512_loadu_ps(m + r);
    __m512 mx = m_old;
    for (int k = 0; k < nk; ++k)
      mx = _mm512_max_ps(mx, _mm512_loadu_ps(St + static_cast<int64_t>(k) * Rp + r));
    const __mmask16 dead = _mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ);
    const __m512 shift = _mm512_mask_mov_ps(mx, dead, _mm512_setzero_ps());
    const __m512 a = exp2_avx512(_mm512_sub_ps(m_old, shift));
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < nk; ++k) {
      float* s = St + static_cast<int64_t>(k) * Rp + r;
      const __m512 p = exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(s), shift));
      _mm512_storeu_ps(s, p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_storeu_ps(alpha + r, a);
    _mm512_storeu_ps(l + r, _mm512_fmadd_ps(_mm512_loadu_ps(l + r), a, sum));
    _mm512_storeu_ps(m + r, mx);
  }
}

// D % 16 == 0. Rows in pairs, D in chunks of 64 floats: 8 accumulators, each V load serves
// two rows.
EAGLE_AVX512 void pv_avx512(const float* P, int nk, int Rp, int R, const float* const* vrows,
                            int D, float* acc, const float* alpha) {
  int r = 0;
  for (; r + 2 <= R; r += 2) {
    float* a0p = acc + static_cast<int64_t>(r) * D;
    float* a1p = a0p + D;
    const __m512 s0 = _mm512_set1_ps(alpha[r]);
    const __m512 s1 = _mm512_set1_ps(alpha[r + 1]);
    for (int c = 0; c < D; c += 64) {
      const int nv = std::min(4, (D - c) / 16);
      __m512 x0[4], x1[4];
      for (int v = 0; v < 4; ++v) {
        if (v < nv) {
          x0[v] = _mm512_mul_ps(_mm512_loadu_ps(a0p + c + 16 * v), s0);
          x1[v] = _mm512_mul_ps(_mm512_loadu_ps(a1p + c + 16 * v), s1);
        }
      }
      if (nv == 4) {
        for (int k = 0; k < nk; ++k) {
          const float* vr = vrows[k] + c;
          const __m512 p0 = _mm512_set1_ps(P[static_cast<int64_t>(k) * Rp + r]);
          const __m512 p1 = _mm512_set1_ps(P[static_cast<int64_t>(k) * Rp + r + 1]);
          const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
          const __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
          x0[0] = _mm512_fmadd_ps(p0, v0, x0[0]);
          x0[1] = _mm512_fmadd_ps(p0, v1, x0[1]);
          x0[2] = _mm512_fmadd_ps(p0, v2, x0[2]);
          x0[3] = _mm512_fmadd_ps(p0, v3, x0[3]);
          x1[0] = _mm512_fmadd_ps(p1, v0, x1[0]);
          x1[1] = _mm512_fmadd_ps(p1, v1, x1[1]);
          x1[2] = _mm512_fmadd_ps(p1, v2, x1[2]);
          x1[3] = _mm512_fmadd_ps(p1, v3, x1[3]);
        }
      } else {
        for (int k = 0; k < nk; ++k) {
          const float* vr = vrows[k] + c;
          const __m512 p0 = _mm512_set1_ps(P[static_cast<int64_t>(k) * Rp + r]);
          const __m512 p1 = _mm512_set1_ps(P[static_cast<int64_t>(k) * Rp + r + 1]);
          for (int v = 0; v < nv; ++v) {
            const __m512 vv = _mm512_loadu_ps(vr + 16 * v);
            x0[v] = _mm512_fmadd_ps(p0, vv, x0[v]);
            x1[v] = _mm512_fmadd_ps(p1, vv, x1[v]);
          }
        }
      }
      for (int v = 0; v < nv; ++v) {
        _mm512_storeu_ps(a0p + c + 16 * v, x0[v]);
        _mm512_storeu_ps(a1p + c + 16 * v, x1[v]);
      }
    }
  }
  for (; r < R; ++r) {
    float* ap = acc + static_cast<int64_t>(r) * D;
    const __m512 s = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < D; c += 16) {
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(ap + c), s);
      for (int k = 0; k < nk; ++k)
        x = _mm512_fmadd_ps(_mm512_set1_ps(P[static_cast<int64_t>(k) * Rp + r]),
                            _mm512_loadu_ps(vrows[k] + c), x);
      _mm512_storeu_ps(ap + c, x);
    }
  }
}

EAGLE_AVX512 void bf16_to_float_avx512(const c10::BFloat16* src, float* dst, int D) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + d));
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(w));
  }
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

EAGLE_AVX512 void half_to_float_avx512(const c10::Half* src, float* dst, int D) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + d));
    _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(h));
  }
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

// ------------------------------------------------------------------------------ AVX2 hot loops
// Same algorithms at 8 lanes (AVX2 + FMA + F16C), for x86-64 CPUs without AVX-512.
#define EAGLE_AVX2 __attribute__((target("avx2,fma,f16c")))

// 2^x as in exp2_avx512; 2^n is built from the exponent bits (n >= -126 keeps it normal).
EAGLE_AVX2 inline __m256 exp2_avx2(__m256 x) {
  const __m256 floor_v = _mm256_set1_ps(-126.0f);
  const __m256 live = _mm256_cmp_ps(x, floor_v, _CMP_GE_OQ);
  x = _mm256_max_ps(x, floor_v);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), live);
}

// Rp % 16 == 0: 4 keys x 16 rows per step, 8 accumulators.
EAGLE_AVX2 void qk_avx2(const float* const* krows, int nk, const float* Qt, int D, int Rp,
                        float* St) {
  int k = 0;
  for (; k + 4 <= nk; k += 4) {
    const float* k0 = krows[k];
    const float* k1 = krows[k + 1];
    const float* k2 = krows[k + 2];
    const float* k3 = krows[k + 3];
    for (int r = 0; r < Rp; r += 16) {
      __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps();
      __m256 a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps();
      __m256 a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps();
      __m256 a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
      for (int d = 0; d < D; ++d) {
        const float* qd = Qt + static_cast<int64_t>(d) * Rp + r;
        const __m256 q0 = _mm256_loadu_ps(qd);
        const __m256 q1 = _mm256_loadu_ps(qd + 8);
        __m256 b = _mm256_broadcast_ss(k0 + d);
        a00 = _mm256_fmadd_ps(b, q0, a00);
        a01 = _mm256_fmadd_ps(b, q1, a01);
        b = _mm256_broadcast_ss(k1 + d);
        a10 = _mm256_fmadd_ps(b, q0, a10);
        a11 = _mm256_fmadd_ps(b, q1, a11);
        b = _mm256_broadcast_ss(k2 + d);
        a20 = _mm256_fmadd_ps(b, q0, a20);
        a21 = _mm256_fmadd_ps(b, q1, a21);
        b = _mm256_broadcast_ss(k3 + d);
        a30 = _mm256_fmadd_ps(b, q0, a30);
        a31 = _mm256_fmadd_ps(b, q1, a31);
      }
      float* s = St + static_cast<int64_t>(k) * Rp + r;
      _mm256_storeu_ps(s, a00);
      _mm256_storeu_ps(s + 8, a01);
      _mm256_storeu_ps(s + Rp, a10);
      _mm256_storeu_ps(s + Rp + 8, a11);
      _mm256_storeu_ps(s + 2 * Rp, a20);
      _mm256_storeu_ps(s + 2 * Rp + 8, a21);
      _mm256_storeu_ps(s + 3 * Rp, a30);
      _mm256_storeu_ps(s + 3 * Rp + 8, a31);
    }
  }
  for (; k < nk; ++k) {
    const float* kr = krows[k];
    for (int r = 0; r < Rp; r += 8) {
      __m256 a = _mm256_setzero_ps();
      for (int d = 0; d < D; ++d)
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(kr + d),
                            _mm256_loadu_ps(Qt + static_cast<int64_t>(d) * Rp + r), a);
      _mm256_storeu_ps(St + static_cast<int64_t>(k) * Rp + r, a);
    }
  }
}

EAGLE_AVX2 void softmax_avx2(float* St, int nk, int Rp, float* m, float* l, float* alpha) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < Rp; r += 8) {
    const __m256 m_old = _mm256_loadu_ps(m + r);
    __m256 mx = m_old;
    for (int k = 0; k < nk; ++k)
      mx = _mm256_max_ps(mx, _mm256_loadu_ps(St + static_cast<int64_t>(k) * Rp + r));
    const __m256 dead = _mm256_cmp_ps(mx, ninf, _CMP_EQ_OQ);
    const __m256 shift = _mm256_andnot_ps(dead, mx);  // 0 where the row saw no key yet
    const __m256 a = exp2_avx2(_mm256_sub_ps(m_old, shift));
    __m256 sum = _mm256_setzero_ps();
    for (int k = 0; k < nk; ++k) {
      float* s = St + static_cast<int64_t>(k) * Rp + r;
      const __m256 p = exp2_avx2(_mm256_sub_ps(_mm256_loadu_ps(s), shift));
      _mm256_storeu_ps(s, p);
      sum = _mm256_add_ps(sum, p);
    }
    _mm256_storeu_ps(alpha + r, a);
    _mm256_storeu_ps(l + r, _mm256_fmadd_ps(_mm256_loadu_ps(l + r), a, sum));
    _mm256_storeu_ps(m + r, mx);
  }
}

// D % 16 == 0 (so D % 32 is 0 or 16). Rows in pairs, D in chunks of 32 floats.
EAGLE_AVX2 void pv_avx2(const float* P, int nk, int Rp, int R, const float* const* vrows, int D,
                        float* acc, const float* alpha) {
  int r = 0;
  for (; r + 2 <= R; r += 2) {
    float* a0p = acc + static_cast<int64_t>(r) * D;
    float* a1p = a0p + D;
    const __m256 s0 = _mm256_set1_ps(alpha[r]);
    const __m256 s1 = _mm256_set1_ps(alpha[r + 1]);
    int c = 0;
    for (; c + 32 <= D; c += 32) {
      __m256 x00 = _mm256_mul_ps(_mm256_loadu_ps(a0p + c), s0);
      __m256 x01 = _mm256_mul_ps(_mm256_loadu_ps(a0p + c + 8), s0);
      __m256 x02 = _mm256_mul_ps(_mm256_loadu_ps(a0p + c + 16), s0);
      __m256 x03 = _mm256_mul_ps(_mm256_loadu_ps(a0p + c + 24), s0);
      __m256 x10 = _mm256_mul_ps(_mm256_loadu_ps(a1p + c), s1);
      __m256 x11 = _mm256_mul_ps(_mm256_loadu_ps(a1p + c + 8), s1);
      __m256 x12 = _mm256_mul_ps(_mm256_loadu_ps(a1p + c + 16), s1);
      __m256 x13 = _mm256_mul_ps(_mm256_loadu_ps(a1p + c + 24), s1);
      for (int k = 0; k < nk; ++k) {
        const float* vr = vrows[k] + c;
        const __m256 p0 = _mm256_broadcast_ss(P + static_cast<int64_t>(k) * Rp + r);
        const __m256 p1 = _mm256_broadcast_ss(P + static_cast<int64_t>(k) * Rp + r + 1);
        const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
        const __m256 v2 = _mm256_loadu_ps(vr + 16), v3 = _mm256_loadu_ps(vr + 24);
        x00 = _mm256_fmadd_ps(p0, v0, x00);
        x01 = _mm256_fmadd_ps(p0, v1, x01);
        x02 = _mm256_fmadd_ps(p0, v2, x02);
        x03 = _mm256_fmadd_ps(p0, v3, x03);
        x10 = _mm256_fmadd_ps(p1, v0, x10);
        x11 = _mm256_fmadd_ps(p1, v1, x11);
        x12 = _mm256_fmadd_ps(p1, v2, x12);
        x13 = _mm256_fmadd_ps(p1, v3, x13);
      }
      _mm256_storeu_ps(a0p + c, x00);
      _mm256_storeu_ps(a0p + c + 8, x01);
      _mm256_storeu_ps(a0p + c + 16, x02);
      _mm256_storeu_ps(a0p + c + 24, x03);
      _mm256_storeu_ps(a1p + c, x10);
      _mm256_storeu_ps(a1p + c + 8, x11);
      _mm256_storeu_ps(a1p + c + 16, x12);
      _mm256_storeu_ps(a1p + c + 24, x13);
    }
    for (; c < D; c += 8) {
      __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(a0p + c), s0);
      __m256 x1 = _mm256_mul_ps(_mm256_loadu_ps(a1p + c), s1);
      for (int k = 0; k < nk; ++k) {
        const __m256 vv = _mm256_loadu_ps(vrows[k] + c);
        x0 = _mm256_fmadd_ps(_mm256_broadcast_ss(P + static_cast<int64_t>(k) * Rp + r), vv, x0);
        x1 = _mm256_fmadd_ps(_mm256_broadcast_ss(P + static_cast<int64_t>(k) * Rp + r + 1), vv, x1);
      }
      _mm256_storeu_ps(a0p + c, x0);
      _mm256_storeu_ps(a1p + c, x1);
    }
  }
  for (; r < R; ++r) {
    float* ap = acc + static_cast<int64_t>(r) * D;
    const __m256 s = _mm256_set1_ps(alpha[r]);
    for (int c = 0; c < D; c += 8) {
      __m256 x = _mm256_mul_ps(_mm256_loadu_ps(ap + c), s);
      for (int k = 0; k < nk; ++k)
        x = _mm256_fmadd_ps(_mm256_broadcast_ss(P + static_cast<int64_t>(k) * Rp + r),
                            _mm256_loadu_ps(vrows[k] + c), x);
      _mm256_storeu_ps(ap + c, x);
    }
  }
}

EAGLE_AVX2 void bf16_to_float_avx2(const c10::BFloat16* src, float* dst, int D) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + d));
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(w));
  }
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

EAGLE_AVX2 void half_to_float_avx2(const c10::Half* src, float* dst, int D) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + d));
    _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(h));
  }
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}
bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}
#else
bool cpu_has_avx512() { return false; }
bool cpu_has_avx2() { return false; }
#endif

// ------------------------------------------------------------------------------ kernel ops
template <typename T, typename Acc>
struct Ops {
  void (*qk)(const Acc* const*, int, const Acc*, int, int, Acc*) = qk_scalar<Acc>;
  void (*softmax)(Acc*, int, int, Acc*, Acc*, Acc*) = softmax_scalar<Acc>;
  void (*pv)(const Acc*, int, int, int, const Acc* const*, int, Acc*, const Acc*) = pv_scalar<Acc>;
  void (*to_acc)(const T*, Acc*, int) = to_acc_scalar<T, Acc>;
};

// EAGLE_KERNELS_CPU_ISA = scalar | avx2 | avx512 (default) caps the instruction set, so that
// tests reach every variant on one machine.
int isa_cap() {
  const char* env = std::getenv("EAGLE_KERNELS_CPU_ISA");
  if (env == nullptr) return 2;
  if (std::strcmp(env, "scalar") == 0) return 0;
  if (std::strcmp(env, "avx2") == 0) return 1;
  return 2;
}

template <typename T, typename Acc>
Ops<T, Acc> pick_ops(int64_t D) {
  Ops<T, Acc> ops;
#if defined(__x86_64__)
  const int cap = isa_cap();
  if constexpr (std::is_same_v<Acc, float>) {
    if (cap >= 2 && cpu_has_avx512() && D % 16 == 0) {
      ops.qk = qk_avx512;
      ops.softmax = softmax_avx512;
      ops.pv = pv_avx512;
      if constexpr (std::is_same_v<T, c10::BFloat16>) ops.to_acc = bf16_to_float_avx512;
      if constexpr (std::is_same_v<T, c10::Half>) ops.to_acc = half_to_float_avx512;
    } else if (cap >= 1 && cpu_has_avx2() && D % 16 == 0) {
      ops.qk = qk_avx2;
      ops.softmax = softmax_avx2;
      ops.pv = pv_avx2;
      if constexpr (std::is_same_v<T, c10::BFloat16>) ops.to_acc = bf16_to_float_avx2;
      if constexpr (std::is_same_v<T, c10::Half>) ops.to_acc = half_to_float_avx2;
    }
  }
#endif
  return ops;
}

// ---------------------------------------------------------------------------------- launcher
struct Cache {
  const char* base;
  int64_t s_outer, s_pos, s_head;  // bytes
};

struct Problem {
  int64_t B, N, Hq, Hkv, G, D;
  int64_t W;           // mask words per row
  int64_t page_size;   // paged only
  int64_t max_pages;
  bool paged, causal;
  double scale_log2;   // sm_scale * log2(e)
  const char* q;       // [B, N, Hq, D] contiguous
  Cache k, v;
  const int32_t* seqlens;
  const int32_t* block_table;  // [B, max_pages] or null
  const int64_t* mask;         // [B, N, W] or null
  char* out;                   // [B, N, Hq, D] contiguous
  int64_t node_block;          // nodes per work item
};

template <typename T>
inline const T* cache_row(const Cache& c, const Problem& p, int64_t b, int64_t h, int64_t t) {
  int64_t outer = b, pos = t;
  if (p.paged) {
    outer = p.block_table[b * p.max_pages + t / p.page_size];
    pos = t % p.page_size;
  }
  return reinterpret_cast<const T*>(c.base + outer * c.s_outer + pos * c.s_pos + h * c.s_head);
}

template <typename T, typename Acc>
struct Scratch {
  std::vector<Acc> Qt, St, acc, m, l, alpha, kbuf, vbuf;
  std::vector<const Acc*> krows, vrows;
  Scratch(int64_t Rp, int64_t D) {
    Qt.resize(Rp * D);
    St.resize(TK * Rp);
    acc.resize(Rp * D);
    m.resize(Rp);
    l.resize(Rp);
    alpha.resize(Rp);
    if (!std::is_same_v<T, Acc>) {
      kbuf.resize(TK * D);
      vbuf.resize(TK * D);
    }
    krows.resize(TK);
    vrows.resize(TK);
  }
};

template <typename T, typename Acc>
void run_item(const Problem& p, const Ops<T, Acc>& ops, Scratch<T, Acc>& s, int64_t item) {
  const int64_t blocks = (p.N + p.node_block - 1) / p.node_block;
  const int64_t nb_idx = item % blocks;
  const int64_t h = (item / blocks) % p.Hkv;
  const int64_t b = item / (blocks * p.Hkv);
  const int64_t n0 = nb_idx * p.node_block;
  const int64_t n1 = std::min(p.N, n0 + p.node_block);
  const int R = static_cast<int>((n1 - n0) * p.G);
  const int Rp = (R + ROW_PAD - 1) / ROW_PAD * ROW_PAD;
  const int D = static_cast<int>(p.D);
  const int64_t prefix = p.seqlens[b];
  const Acc ninf = -std::numeric_limits<Acc>::infinity();

  // Qt[d][r], r = (node - n0) * G + g, pre-scaled; padding rows are zero.
  const T* q = reinterpret_cast<const T*>(p.q);
  std::fill(s.Qt.begin(), s.Qt.begin() + static_cast<int64_t>(Rp) * D, Acc(0));
  for (int r = 0; r < R; ++r) {
    const int64_t i = n0 + r / p.G;
    const int64_t head = h * p.G + r % p.G;
    const T* qr = q + ((b * p.N + i) * p.Hq + head) * p.D;
    for (int d = 0; d < D; ++d)
      s.Qt[static_cast<int64_t>(d) * Rp + r] = static_cast<Acc>(qr[d]) * static_cast<Acc>(p.scale_log2);
  }
  std::fill(s.acc.begin(), s.acc.begin() + static_cast<int64_t>(R) * D, Acc(0));
  std::fill(s.m.begin(), s.m.begin() + Rp, ninf);
  std::fill(s.l.begin(), s.l.begin() + Rp, Acc(0));

  // Tree slots j <= i only (ancestors precede their descendants), so no row of this block
  // sees a slot past n1 - 1.
  const int64_t end = prefix + n1;
  for (int64_t t0 = 0; t0 < end; t0 += TK) {
    const int nk = static_cast<int>(std::min<int64_t>(TK, end - t0));
    for (int k = 0; k < nk; ++k) {
      const T* kr = cache_row<T>(p.k, p, b, h, t0 + k);
      const T* vr = cache_row<T>(p.v, p, b, h, t0 + k);
      if constexpr (std::is_same_v<T, Acc>) {
        s.krows[k] = kr;
        s.vrows[k] = vr;
      } else {
        Acc* kd = s.kbuf.data() + static_cast<int64_t>(k) * D;
        Acc* vd = s.vbuf.data() + static_cast<int64_t>(k) * D;
        ops.to_acc(kr, kd, D);
        ops.to_acc(vr, vd, D);
        s.krows[k] = kd;
        s.vrows[k] = vd;
      }
    }
    ops.qk(s.krows.data(), nk, s.Qt.data(), D, Rp, s.St.data());
    if (t0 + nk > prefix) {  // the tile reaches tree slots: apply the mask
      for (int k = std::max<int64_t>(0, prefix - t0); k < nk; ++k) {
        const int64_t j = t0 + k - prefix;
        Acc* srow = s.St.data() + static_cast<int64_t>(k) * Rp;
        for (int r = 0; r < R; ++r) {
          const int64_t i = n0 + r / p.G;
          bool visible;
          if (p.causal) {
            visible = j <= i;
          } else {
            const int64_t word = p.mask[(b * p.N + i) * p.W + (j >> 6)];
            visible = (static_cast<uint64_t>(word) >> (j & 63)) & 1u;
          }
          if (!visible) srow[r] = ninf;
        }
      }
    }
    ops.softmax(s.St.data(), nk, Rp, s.m.data(), s.l.data(), s.alpha.data());
    ops.pv(s.St.data(), nk, Rp, R, s.vrows.data(), D, s.acc.data(), s.alpha.data());
  }

  T* out = reinterpret_cast<T*>(p.out);
  for (int r = 0; r < R; ++r) {
    const int64_t i = n0 + r / p.G;
    const int64_t head = h * p.G + r % p.G;
    T* orow = out + ((b * p.N + i) * p.Hq + head) * p.D;
    // A row with no visible key (only possible with a mask lacking the node's own bit and an
    // empty prefix) outputs zeros rather than NaN.
    const Acc inv = s.l[r] > Acc(0) ? Acc(1) / s.l[r] : Acc(0);
    const Acc* a = s.acc.data() + static_cast<int64_t>(r) * D;
    for (int d = 0; d < D; ++d) orow[d] = static_cast<T>(a[d] * inv);
  }
}

template <typename T, typename Acc>
void run(const Problem& p) {
  const Ops<T, Acc> ops = pick_ops<T, Acc>(p.D);
  const int64_t blocks = (p.N + p.node_block - 1) / p.node_block;
  const int64_t items = p.B * p.Hkv * blocks;
  // Work of one item ~ rows * keys * D multiply-adds (x2 for QK and PV); run small problems
  // inline (waking a second thread costs more than they take).
  int64_t max_prefix = 0;
  for (int64_t b = 0; b < p.B; ++b) max_prefix = std::max<int64_t>(max_prefix, p.seqlens[b]);
  const int64_t item_work = std::max<int64_t>(1, p.node_block * p.G * (max_prefix + p.N) * p.D);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 21) / item_work);
  const int64_t Rp = (p.node_block * p.G + ROW_PAD - 1) / ROW_PAD * ROW_PAD;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    Scratch<T, Acc> scratch(Rp, p.D);
    for (int64_t item = begin; item < end; ++item) run_item<T, Acc>(p, ops, scratch, item);
  });
}

// Nodes per work item: at most MAX_ROWS rows, and small enough that the items keep every
// thread busy (each item re-reads the request's K/V for its KV head).
int64_t choose_node_block(int64_t B, int64_t N, int64_t Hkv, int64_t G) {
  int64_t nb = std::max<int64_t>(1, std::min<int64_t>(N, MAX_ROWS / std::max<int64_t>(G, 1)));
  const int64_t threads = at::get_num_threads();
  while (nb > 1 && nb * G > ROW_PAD &&
         B * Hkv * ((N + nb - 1) / nb) < 2 * threads) {
    nb = (nb + 1) / 2;
  }
  return nb;
}

void check_values(const Problem& p, int64_t capacity, int64_t num_pages) {
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t len = p.seqlens[b];
    TORCH_CHECK_VALUE(len >= 0, "tree_attention: cache_seqlens: expected non-negative lengths, got ",
                      "cache_seqlens[", b, "] = ", len);
    TORCH_CHECK_VALUE(len + p.N <= capacity, "tree_attention: cache_seqlens: expected cache_seqlens + N ",
                      "<= cache capacity ", capacity, ", got ", len + p.N, " for request ", b);
    if (!p.paged) continue;
    for (int64_t slot = 0; slot * p.page_size < len + p.N; ++slot) {
      const int64_t page = p.block_table[b * p.max_pages + slot];
      TORCH_CHECK_VALUE(page >= 0 && page < num_pages,
                        "tree_attention: block_table: expected page ids in [0, ", num_pages,
                        ") for the pages in use, got block_table[", b, ", ", slot, "] = ", page);
    }
  }
}

}  // namespace

at::Tensor tree_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                              const std::optional<at::Tensor>& tree_mask,
                              const std::optional<at::Tensor>& block_table,
                              std::optional<double> sm_scale) {
  const char* op = "tree_attention";
  // Same order and wording as eagle_kernels/_checks.py::check_tree_attention.
  TORCH_CHECK_VALUE(q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kHalf ||
                        q_in.scalar_type() == at::kBFloat16 || q_in.scalar_type() == at::kDouble,
                    op, ": q: expected dtype float32, float16, bfloat16 or float64, got ",
                    q_in.scalar_type());
  check_dim(q_in, op, "q", 4, "[B, N, Hq, D]");
  const at::Device dev = q_in.device();
  TORCH_CHECK_VALUE(dev.is_cpu(), op, ": q: expected device cpu, got ", dev);
  const int64_t B = q_in.size(0), N = q_in.size(1), Hq = q_in.size(2), D = q_in.size(3);
  const bool paged = block_table.has_value();
  const char* layout = paged ? "[P, page_size, Hkv, D]" : "[B, S, Hkv, D]";
  check_dtype(k_cache, op, "k_cache", q_in.scalar_type());
  check_dim(k_cache, op, "k_cache", 4, layout);
  check_device(k_cache, op, "k_cache", dev);
  check_dtype(v_cache, op, "v_cache", q_in.scalar_type());
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), op, ": v_cache: expected the shape of k_cache ",
                    shape_str(k_cache.sizes()), ", got ", shape_str(v_cache.sizes()));
  check_device(v_cache, op, "v_cache", dev);
  check_dtype(cache_seqlens, op, "cache_seqlens", at::kInt);
  check_shape(cache_seqlens, op, "cache_seqlens", {B}, "[B]");
  check_device(cache_seqlens, op, "cache_seqlens", dev);
  int64_t max_pages = 0;
  at::Tensor table;
  if (paged) {
    check_dtype(*block_table, op, "block_table", at::kInt);
    check_dim(*block_table, op, "block_table", 2, "[B, max_pages]");
    check_device(*block_table, op, "block_table", dev);
    max_pages = block_table->size(1);
    check_shape(*block_table, op, "block_table", {B, max_pages}, "[B, max_pages]");
    table = block_table->contiguous();
  } else {
    TORCH_CHECK_VALUE(k_cache.size(0) == B, op, ": k_cache: expected batch dim ", B, " in ",
                      layout, ", got shape ", shape_str(k_cache.sizes()));
  }
  const int64_t Hkv = k_cache.size(2);
  TORCH_CHECK_VALUE(Hkv > 0 && Hq % Hkv == 0, op, ": k_cache: expected a KV head count dividing Hq = ",
                    Hq, ", got ", Hkv);
  TORCH_CHECK_VALUE(k_cache.size(3) == D, op, ": k_cache: expected head dim ", D, " as in q, got ",
                    k_cache.size(3));
  at::Tensor mask;
  if (tree_mask.has_value()) {
    check_dtype(*tree_mask, op, "tree_mask", at::kLong);
    check_shape(*tree_mask, op, "tree_mask", {B, N, (N + 63) / 64}, "[B, N, ceil(N / 64)]");
    check_device(*tree_mask, op, "tree_mask", dev);
    mask = tree_mask->contiguous();
  }
  TORCH_CHECK_VALUE(k_cache.stride(3) == 1 || D <= 1, op,
                    ": k_cache: expected a dense last (head) dim, got strides ",
                    shape_str(k_cache.strides()));
  TORCH_CHECK_VALUE(v_cache.stride(3) == 1 || D <= 1, op,
                    ": v_cache: expected a dense last (head) dim, got strides ",
                    shape_str(v_cache.strides()));

  const at::Tensor q = q_in.contiguous();
  const at::Tensor seqlens = cache_seqlens.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());

  Problem p;
  p.B = B;
  p.N = N;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.G = Hq / Hkv;
  p.D = D;
  p.W = (N + 63) / 64;
  p.paged = paged;
  p.page_size = paged ? k_cache.size(1) : 0;
  p.max_pages = max_pages;
  p.causal = !tree_mask.has_value();
  p.scale_log2 = (sm_scale.has_value() ? *sm_scale : 1.0 / std::sqrt(static_cast<double>(D))) * LOG2E;
  p.q = static_cast<const char*>(q.data_ptr());
  const int64_t es = static_cast<int64_t>(k_cache.element_size());
  p.k = {static_cast<const char*>(k_cache.data_ptr()), k_cache.stride(0) * es,
         k_cache.stride(1) * es, k_cache.stride(2) * es};
  p.v = {static_cast<const char*>(v_cache.data_ptr()), v_cache.stride(0) * es,
         v_cache.stride(1) * es, v_cache.stride(2) * es};
  p.seqlens = seqlens.data_ptr<int32_t>();
  p.block_table = paged ? table.data_ptr<int32_t>() : nullptr;
  p.mask = tree_mask.has_value() ? mask.data_ptr<int64_t>() : nullptr;
  p.out = static_cast<char*>(out.data_ptr());
  const int64_t capacity = paged ? max_pages * k_cache.size(1) : k_cache.size(1);
  check_values(p, capacity, paged ? k_cache.size(0) : 0);
  if (out.numel() == 0) return out;
  p.node_block = choose_node_block(B, N, Hkv, p.G);

  switch (q.scalar_type()) {
    case at::kFloat: run<float, float>(p); break;
    case at::kHalf: run<c10::Half, float>(p); break;
    case at::kBFloat16: run<c10::BFloat16, float>(p); break;
    case at::kDouble: run<double, double>(p); break;
    default: TORCH_CHECK_VALUE(false, op, ": q: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace eagle
