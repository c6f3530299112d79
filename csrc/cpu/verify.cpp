// CPU launcher of verify: validate -> contiguous views -> allocate -> one task per request
// (at::parallel_for), each walking its tree straight from the logits.
//
// A visited row costs one vectorised pass (max, NaN/+inf/finite flags) in greedy mode; in
// sampling mode the row's filtered probabilities p_u are built in a per-thread scratch row
// (never a [B, N, V] tensor): scale -> top-k by radix select -> exp/sum -> top-p by radix
// select on the probabilities -> renormalise. Children are then tried in node order against
// the residual, and the bonus is an inverse-CDF draw (core/verify.h). The hot loops are
// compiled three times, for AVX-512, AVX2 and baseline x86-64 (simd.h's target strings), and
// picked per call from isa::current() (the AVX-512 variant from avx512-ymm up). Every variant
// gives the same bits: the exp is simd.h's in its unfused form, and the sums run in a fixed
// lane order.
//
// Sampled drafts (draft_probs, docs/ops.md §4 "Draft-aware rule"): at a node with sampled
// children the draft row is checked in one pass (core/verify.h's draft_row_sum: entries, S);
// r(x) = q / S is read where needed, through the target -> draft id map that d2t gives (built
// once per call, with the check of its range); the children are tried against the residual, and
// a rejected sampled child replaces the residual with max(w / mass - r', 0) in a second scratch
// row (r' without the earlier sampled siblings, over 1 - removed), so the rounding rule can fall
// back to the previous residual without a copy.
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gt.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/where.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "checks.h"
#include "core/philox.h"
#include "core/verify.h"
#include "ops.h"

#define EAGLE_INLINE inline __attribute__((always_inline))

namespace eagle {
namespace {

struct Args {
  const void* logits;  // [B, N, V] rows with unit stride
  int64_t stride_b, stride_n;
  int64_t B, N, V, max_depth;
  const int64_t* tokens;     // [B, N]
  const int32_t* parents;    // [B, N]
  const float* temperature;  // [B] or null
  const int32_t* top_k;      // [B] or null
  const float* top_p;        // [B] or null
  const int64_t* seed;       // [B] or null
  const int64_t* offset;     // [B] or null
  const int64_t* positions;  // [B] or null: coupled sampling, the position the root row predicts
  const float* draft_probs;  // [B, N, Vd] or null
  int64_t Vd;
  const bool* draft_sampled;  // [B, N] or null (every non-root node sampled)
  const int64_t* d2t_inv;     // [V]: the draft id of each target id (-1: none), or null without d2t
  bool d2t_ok;                // every d2t target in [0, V)
  int32_t* accept_len;        // [B]
  int32_t* accept_nodes;      // [B, max_depth + 1]
  int64_t* out_tokens;        // [B, max_depth + 1]
  int32_t* status;            // [B]
};

// ------------------------------------------------------------------------ element helpers
template <typename C>
EAGLE_INLINE C load_as(float x) {
  return static_cast<C>(x);
}
template <typename C>
EAGLE_INLINE C load_as(double x) {
  return static_cast<C>(x);
}
template <typename C>
EAGLE_INLINE C load_as(c10::Half x) {
  return static_cast<C>(static_cast<float>(x));
}
template <typename C>
EAGLE_INLINE C load_as(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // bf16 is the top half of a float
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return static_cast<C>(f);
}

// exp(x) for x <= 0 (and -inf): simd.h's, with separate multiplies and adds so that the baseline
// variant (no FMA) gives the bits of the vector ones. torch's softmax uses its own vectorised
// exp (Sleef, 1 ulp), so p may differ from the reference's in the last bit; a decision can flip
// only when a coin falls within that of a threshold.
EAGLE_INLINE float exp_nonpositive(float x) { return simd::scalar::exp_nonpositive<false>(x); }
EAGLE_INLINE double exp_nonpositive(double x) { return std::exp(x); }

// Lane-parallel float64 sum: kLanes independent accumulators that the compiler turns into
// vector registers under every target without reassociating (no -ffast-math, no `omp simd`,
// whose lowering happens before the per-ISA variants are inlined and left them scalar).
constexpr int kLanes = 16;
template <typename C>
EAGLE_INLINE double sum64(const C* w, int64_t V) {
  double acc[kLanes] = {0.0};
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += static_cast<double>(w[i + j]);
  }
  for (; i < V; ++i) acc[0] += static_cast<double>(w[i]);
  double total = 0.0;
  for (int j = 0; j < kLanes; ++j) total += acc[j];
  return total;
}

// w <- exp(w) in place, returning the float64 sum.
template <typename C>
EAGLE_INLINE double exp_in_place_loop(C* w, int64_t V) {
  for (int64_t i = 0; i < V; ++i) w[i] = exp_nonpositive(w[i]);
  return sum64(w, V);
}
// Instruction sets of the compiled variants (picked per call, see pick_kernel).
constexpr int kBase = 0, kAvx2 = 1, kAvx512 = 2;
__attribute__((noinline)) double exp_in_place_base(float* w, int64_t V) { return exp_in_place_loop(w, V); }
#if EAGLE_X86_SIMD
// Eight lanes at a time (GCC does not vectorise the scalar clamp); the AVX2 and AVX-512 variants
// both use it.
__attribute__((noinline)) EAGLE_TARGET_AVX2 double exp_in_place_avx2(float* w, int64_t V) {
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) _mm256_storeu_ps(w + i, simd::avx2::exp_nonpositive<false>(_mm256_loadu_ps(w + i)));
  for (; i < V; ++i) w[i] = exp_nonpositive(w[i]);
  return sum64(w, V);
}
#else
double exp_in_place_avx2(float* w, int64_t V) { return exp_in_place_loop(w, V); }
#endif
// core/verify.h's draft_row_sum (same lanes, same bits) for the AVX-512 variant: 16 floats per
// step widened into two 8-lane float64 accumulators (lanes 0-7 and 8-15).
#if EAGLE_X86_SIMD
__attribute__((noinline)) EAGLE_TARGET_AVX512 bool draft_row_sum_avx512(const float* q, int64_t Vd, double& S) {
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  const __m512 zero = _mm512_setzero_ps(), inf = _mm512_set1_ps(INFINITY);
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= Vd; i += 16) {
    const __m512 v = _mm512_loadu_ps(q + i);
    bad |= _mm512_cmp_ps_mask(v, zero, _CMP_NGE_UQ) | _mm512_cmp_ps_mask(v, inf, _CMP_EQ_OQ);
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
  alignas(64) double acc[16];
  _mm512_store_pd(acc, lo);
  _mm512_store_pd(acc + 8, hi);
  for (; i < Vd; ++i) {
    const float v = q[i];
    bad |= static_cast<__mmask16>(!(v >= 0.0f) || v == INFINITY);
    acc[0] += static_cast<double>(v);
  }
  S = 0.0;
  for (int j = 0; j < 16; ++j) S += acc[j];
  return bad == 0 && std::fabs(S - 1.0) <= verify::kDraftSumTolerance;
}
// The same for the AVX2 variant: four 4-lane float64 accumulators.
__attribute__((noinline)) EAGLE_TARGET_AVX2 bool draft_row_sum_avx2(const float* q, int64_t Vd, double& S) {
  __m256d acc4[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  const __m256 zero = _mm256_setzero_ps(), inf = _mm256_set1_ps(INFINITY);
  int bad = 0;
  int64_t i = 0;
  for (; i + 16 <= Vd; i += 16) {
    for (int h = 0; h < 2; ++h) {
      const __m256 v = _mm256_loadu_ps(q + i + 8 * h);
      bad |= _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v, zero, _CMP_NGE_UQ), _mm256_cmp_ps(v, inf, _CMP_EQ_OQ)));
      acc4[2 * h] = _mm256_add_pd(acc4[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
      acc4[2 * h + 1] = _mm256_add_pd(acc4[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
  }
  alignas(32) double acc[16];
  for (int j = 0; j < 4; ++j) _mm256_store_pd(acc + 4 * j, acc4[j]);
  for (; i < Vd; ++i) {
    const float v = q[i];
    bad |= static_cast<int>(!(v >= 0.0f) || v == INFINITY);
    acc[0] += static_cast<double>(v);
  }
  S = 0.0;
  for (int j = 0; j < 16; ++j) S += acc[j];
  return bad == 0 && std::fabs(S - 1.0) <= verify::kDraftSumTolerance;
}
#endif
template <int kIsa>
EAGLE_INLINE bool draft_row_sum(const float* q, int64_t Vd, double& S) {
#if EAGLE_X86_SIMD
  if (kIsa == kAvx512) return draft_row_sum_avx512(q, Vd, S);
  if (kIsa == kAvx2) return draft_row_sum_avx2(q, Vd, S);
#endif
  return verify::draft_row_sum(q, Vd, S);
}

template <int kIsa>
EAGLE_INLINE double exp_in_place(float* w, int64_t V) {
  return kIsa >= kAvx2 ? exp_in_place_avx2(w, V) : exp_in_place_base(w, V);
}
template <int kIsa>
EAGLE_INLINE double exp_in_place(double* w, int64_t V) {
  return exp_in_place_loop(w, V);
}

template <typename C>
struct Scratch {
  using K = typename verify::KeyOf<C>::type;
  std::vector<C> w;                        // the residual weights of the current node
  std::vector<K> keys;                     // order keys of w
  std::vector<K> cand;                     // radix-select candidates
  std::vector<C> w_next;                   // the residual after a sampled rejection
  std::vector<int64_t> children, sampled;  // the children of the node; its sampled children
};

// One scratch row per thread, kept across calls: rows of V >= 32k entries are mmap-sized, and
// allocating them per call cost a page fault per 4 KiB touched (~0.3 ms at V = 49152).
template <typename C>
Scratch<C>& thread_scratch(int64_t V) {
  thread_local Scratch<C> s;
  if (static_cast<int64_t>(s.w.size()) < V) {
    s.w.resize(V);
    s.keys.resize(V);
    s.cand.resize(V);
    s.w_next.resize(V);
  }
  return s;
}

template <typename C>
struct RowStats {
  C max;
  bool bad;  // NaN or +inf anywhere, or no finite entry
};

// ------------------------------------------------------------------------------ row passes
template <typename In, typename C>
EAGLE_INLINE RowStats<C> row_stats(const In* row, int64_t V) {
  const C inf = std::numeric_limits<C>::infinity();
  C m[kLanes];
  int bad[kLanes], finite[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    m[j] = -inf;
    bad[j] = 0;
    finite[j] = 0;
  }
  auto visit = [&](int j, C v) {
    m[j] = v > m[j] ? v : m[j];
    bad[j] |= (v != v) | (v == inf);
    finite[j] |= (v > -inf) & (v < inf);
  };
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) visit(j, load_as<C>(row[i + j]));
  }
  for (; i < V; ++i) visit(0, load_as<C>(row[i]));
  C row_max = -inf;
  int any_bad = 0, any_finite = 0;
  for (int j = 0; j < kLanes; ++j) {
    row_max = m[j] > row_max ? m[j] : row_max;
    any_bad |= bad[j];
    any_finite |= finite[j];
  }
  return {row_max, any_bad != 0 || any_finite == 0};
}

// First index holding the row max (argmax with ties to the smaller id).
template <typename In, typename C>
EAGLE_INLINE int64_t first_index_of(const In* row, int64_t V, C value) {
  for (int64_t i = 0; i < V; ++i) {
    if (load_as<C>(row[i]) == value) return i;
  }
  return 0;
}

// Bonus token of a request with a bad row: argmax over the finite root logits, 0 if none.
template <typename In, typename C>
int64_t fallback_token(const In* root, int64_t V) {
  int64_t best = -1;
  C best_value = C(0);
  for (int64_t i = 0; i < V; ++i) {
    const C v = load_as<C>(root[i]);
    if (std::isfinite(v) && (best < 0 || v > best_value)) {
      best = i;
      best_value = v;
    }
  }
  return best < 0 ? 0 : best;
}

// p_u of the contract into s.w: (logits - max) / T -> top-k -> softmax -> top-p -> renormalise.
template <int kIsa, typename In, typename C>
EAGLE_INLINE void build_weights(const In* row, int64_t V, C row_max, float temperature, int64_t top_k, float top_p,
                                Scratch<C>& s) {
  using K = typename verify::KeyOf<C>::type;
  C* w = s.w.data();
  K* keys = s.keys.data();
  const C t = static_cast<C>(temperature);
  // Shift before dividing: a tiny T sends the other logits to -inf, never the max to +inf.
  for (int64_t i = 0; i < V; ++i) w[i] = (load_as<C>(row[i]) - row_max) / t + C(0);
  if (top_k > 0 && top_k < V) {
    for (int64_t i = 0; i < V; ++i) keys[i] = verify::order_key<C>(w[i]);
    const K kth = verify::kth_largest_key<K>(keys, V, top_k, s.cand.data());
    const C ninf = -std::numeric_limits<C>::infinity();
    for (int64_t i = 0; i < V; ++i) w[i] = keys[i] >= kth ? w[i] : ninf;
  }
  // The scaled max is exactly 0 and survives top-k, so softmax needs no second shift.
  const double total = exp_in_place<kIsa>(w, V);
  const C denom = static_cast<C>(total);
  for (int64_t i = 0; i < V; ++i) w[i] = w[i] / denom;
  if (top_p < 1.0f) {
    // Only positive probabilities take part: a zero adds no mass above anything and stays zero
    // whether kept or not (after top-k most of the row is zero).
    int64_t positive = 0;
    for (int64_t i = 0; i < V; ++i) {
      keys[positive] = verify::order_key<C>(w[i]);
      positive += w[i] > C(0);
    }
    const K cut = verify::top_p_threshold_key<C>(keys, positive, static_cast<double>(top_p), s.cand.data());
    const C cut_value = verify::key_value<C>(cut);  // keep x iff p(x) >= cut_value
    for (int64_t i = 0; i < V; ++i) w[i] = w[i] >= cut_value ? w[i] : C(0);
    const C norm = static_cast<C>(sum64(w, V));
    for (int64_t i = 0; i < V; ++i) w[i] = w[i] / norm;
  }
}

// Whether the sampled children's tokens could have been drawn without replacement from r: all
// distinct, each with r(x) > 0, and the mass of the earlier ones below 1 before each.
inline bool sampled_children_valid(const float* q, double S, const int64_t* inv, const int64_t* tok,
                                   const std::vector<int64_t>& sampled) {
  double removed = 0.0;
  for (size_t i = 0; i < sampled.size(); ++i) {
    const int64_t x = tok[sampled[i]];
    for (size_t j = 0; j < i; ++j) {
      if (tok[sampled[j]] == x) return false;
    }
    const double rx = verify::draft_prob(q, S, inv, x);
    if (!(rx > 0.0) || removed >= 1.0) return false;
    removed += rx;
  }
  return true;
}

// Coupled sampling (docs/ops.md §4): the token of the exponential race argmax_x w(x) / E(x) over the
// filtered weights' support, E(x) = -log U(seed, position, x, kCoupledDraw), ties to the smaller id.
// Every support entry needs its U (one Philox call each): the AVX-512 variant draws 16 consecutive
// tokens' U per block (integer arithmetic: the scalar function's bits). -log U >= 1 - U, so a token
// whose w(x) / (1 - U) cannot beat the best ratio skips its log (with a margin far above rounding:
// only clearly dominated tokens skip).
constexpr int kCoupledBlock = 16;

EAGLE_INLINE void coupled_uniforms_scalar(int64_t seed, int64_t position, const uint32_t* ids, double* u) {
  for (int j = 0; j < kCoupledBlock; ++j) u[j] = philox::uniform(seed, position, ids[j], philox::kCoupledDraw);
}

#if EAGLE_X86_SIMD
// (hi, lo) words of the 16 lane products m * c (even and odd lanes through two 32x32->64 multiplies).
EAGLE_TARGET_AVX512 EAGLE_INLINE void mulhilo16(__m512i c, __m512i m, __m512i& hi, __m512i& lo) {
  const __m512i even = _mm512_mul_epu32(c, m);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(c, 32), m);
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

__attribute__((noinline)) EAGLE_TARGET_AVX512 void coupled_uniforms_avx512(int64_t seed, int64_t position,
                                                                           const uint32_t* ids, double* u) {
  const uint64_t s = static_cast<uint64_t>(seed), o = static_cast<uint64_t>(position);
  uint32_t k0 = static_cast<uint32_t>(s), k1 = static_cast<uint32_t>(s >> 32);
  __m512i c0 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(o)));
  __m512i c1 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(o >> 32)));
  __m512i c2 = _mm512_loadu_si512(ids);
  __m512i c3 = _mm512_set1_epi32(static_cast<int>(philox::kCoupledDraw));
  const __m512i m0 = _mm512_set1_epi64(philox::kM0), m1 = _mm512_set1_epi64(philox::kM1);
  for (int round = 0; round < philox::kRounds; ++round) {
    if (round > 0) {
      k0 += philox::kW0;
      k1 += philox::kW1;
    }
    __m512i hi0, lo0, hi1, lo1;
    mulhilo16(c0, m0, hi0, lo0);
    mulhilo16(c2, m1, hi1, lo1);
    const __m512i n0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32(static_cast<int>(k0)));
    const __m512i n2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32(static_cast<int>(k1)));
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  // bits53 = (w0 >> 5) << 26 | (w1 >> 6) per lane, in two halves of eight 64-bit lanes.
  const __m512i a = _mm512_srli_epi32(c0, 5), b = _mm512_srli_epi32(c1, 6);
  const __m512d scale = _mm512_set1_pd(0x1p-53);
  for (int half = 0; half < 2; ++half) {
    const __m512i ah = _mm512_cvtepu32_epi64(half ? _mm512_extracti64x4_epi64(a, 1) : _mm512_castsi512_si256(a));
    const __m512i bh = _mm512_cvtepu32_epi64(half ? _mm512_extracti64x4_epi64(b, 1) : _mm512_castsi512_si256(b));
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi64(ah, 26), bh);
    _mm512_storeu_pd(u + 8 * half, _mm512_mul_pd(_mm512_cvtepi64_pd(bits), scale));
  }
}
#endif

// U of the 16 ids at ids (the AVX-512 blocks from the avx512-ymm level up, as verify's variants).
template <int kIsa>
EAGLE_INLINE void coupled_uniforms(int64_t seed, int64_t position, const uint32_t* ids, double* u) {
#if EAGLE_X86_SIMD
  if (kIsa == kAvx512) {
    coupled_uniforms_avx512(seed, position, ids, u);
    return;
  }
#endif
  coupled_uniforms_scalar(seed, position, ids, u);
}

template <int kIsa, typename C>
EAGLE_INLINE int64_t coupled_token(const C* w, int64_t V, int64_t seed, int64_t position) {
  double best = -1.0;
  int64_t best_x = -1;
  alignas(64) double u[kCoupledBlock];
  alignas(64) uint32_t ids[kCoupledBlock];
  for (int64_t x0 = 0; x0 < V; x0 += kCoupledBlock) {
    const int64_t n = std::min<int64_t>(kCoupledBlock, V - x0);
    bool any = false;
    for (int64_t j = 0; j < n; ++j) any |= w[x0 + j] > C(0);
    if (!any) continue;
    for (int j = 0; j < kCoupledBlock; ++j) ids[j] = static_cast<uint32_t>(x0 + j);
    coupled_uniforms<kIsa>(seed, position, ids, u);
    for (int64_t j = 0; j < n; ++j) {
      const double wx = static_cast<double>(w[x0 + j]);
      if (!(wx > 0.0) || (1.0 - u[j]) * best > wx * (1.0 + 1e-9)) continue;
      const double ratio = wx / -std::log(u[j]);  // U = 0: E = inf, ratio 0
      if (ratio > best) {
        best = ratio;
        best_x = x0 + j;
      }
    }
  }
  return best_x;
}

// --------------------------------------------------------------------------------- the walk
template <int kIsa, typename In, typename C>
EAGLE_INLINE void verify_request(const Args& a, int64_t b, Scratch<C>* scratch) {
  const int64_t N = a.N, V = a.V, A = a.max_depth + 1;
  const In* logits = static_cast<const In*>(a.logits) + b * a.stride_b;
  const int64_t* tok = a.tokens + b * N;
  const int32_t* par = a.parents + b * N;
  const float temperature = a.temperature ? a.temperature[b] : 0.0f;
  const int64_t top_k = a.top_k ? a.top_k[b] : 0;
  const float top_p = a.top_p ? a.top_p[b] : 1.0f;
  const int64_t seed = a.seed ? a.seed[b] : 0;
  const int64_t offset = a.offset ? a.offset[b] : 0;
  const bool greedy = temperature == 0.0f;
  const bool coupled = !greedy && a.positions != nullptr;
  int32_t* nodes_out = a.accept_nodes + b * A;
  int64_t* tokens_out = a.out_tokens + b * A;
  std::fill(nodes_out, nodes_out + A, -1);
  std::fill(tokens_out, tokens_out + A, -1);
  nodes_out[0] = 0;

  int64_t node = 0, depth = 0;
  bool bad = false, draft_bad = false;
  while (true) {
    const In* row = logits + node * a.stride_n;
    const RowStats<C> st = row_stats<In, C>(row, V);
    if (st.bad) {
      bad = true;
      break;
    }
    const bool may_descend = depth < a.max_depth;  // a node at max_depth is a leaf
    int64_t child = -1;
    if (greedy || coupled) {
      // The target's token at this node, fixed before the children: the argmax, or the coupled race.
      int64_t g;
      if (greedy) {
        g = first_index_of<In, C>(row, V, st.max);
      } else {
        Scratch<C>& s = *scratch;
        build_weights<kIsa, In, C>(row, V, st.max, temperature, top_k, top_p, s);
        g = coupled_token<kIsa, C>(s.w.data(), V, seed, a.positions[b] + depth);
      }
      for (int64_t c = node + 1; may_descend && c < N; ++c) {
        if (par[c] == node && tok[c] == g) {
          child = c;
          break;
        }
      }
      if (child < 0) {
        tokens_out[depth] = g;
        break;
      }
    } else {
      Scratch<C>& s = *scratch;
      build_weights<kIsa, In, C>(row, V, st.max, temperature, top_k, top_p, s);
      C* w = s.w.data();
      if (may_descend) {
        std::vector<int64_t>& children = s.children;
        std::vector<int64_t>& sampled = s.sampled;
        children.clear();
        sampled.clear();
        for (int64_t c = node + 1; c < N; ++c) {
          if (par[c] != node) continue;
          children.push_back(c);
          if (a.draft_probs != nullptr && (a.draft_sampled == nullptr || a.draft_sampled[b * N + c])) {
            sampled.push_back(c);
          }
        }
        const float* q = sampled.empty() ? nullptr : a.draft_probs + (b * N + node) * a.Vd;
        double S = 1.0;
        if (!sampled.empty()) {
          if (!a.d2t_ok || !draft_row_sum<kIsa>(q, a.Vd, S) || !sampled_children_valid(q, S, a.d2t_inv, tok, sampled)) {
            draft_bad = true;  // no valid drafts here: the bonus comes from p_u (still exact)
            children.clear();
          }
        }
        double removed = 0.0;  // r's mass of the sampled children rejected so far
        size_t rejected_sampled = 0;
        double mass = sum64(w, V);  // recomputed whenever w changes
        for (const int64_t c : children) {
          const int64_t x = tok[c];
          const double u = philox::uniform(seed, offset, static_cast<uint32_t>(c), philox::kAcceptDraw);
          const bool is_sampled = rejected_sampled < sampled.size() && sampled[rejected_sampled] == c;
          const double rx = is_sampled ? verify::draft_prob(q, S, a.d2t_inv, x) : 0.0;
          const double d = is_sampled ? rx / (1.0 - removed) : 1.0;
          const C wx = w[x];
          // w[x] > 0 first: a coin of 0 never accepts a zero-probability token.
          if (wx > C(0) && u < (static_cast<double>(wx) / mass) / d) {
            child = c;
            break;
          }
          if (is_sampled) {
            // w <- max(w / mass - r', 0), r' = r without the earlier sampled siblings / (1 - removed).
            C* next = s.w_next.data();
            const C m = static_cast<C>(mass);
            const double keep = 1.0 - removed;
            if (a.d2t_inv == nullptr) {
              for (int64_t i = 0; i < V; ++i) {
                const C v = w[i] / m - static_cast<C>((static_cast<double>(q[i]) / S) / keep);
                next[i] = v > C(0) ? v : C(0);
              }
            } else {
              for (int64_t i = 0; i < V; ++i) {
                const C v = w[i] / m - static_cast<C>(verify::draft_prob(q, S, a.d2t_inv, i) / keep);
                next[i] = v > C(0) ? v : C(0);
              }
            }
            for (size_t j = 0; j < rejected_sampled; ++j) {
              const int64_t y = tok[sampled[j]];
              const C v = w[y] / m;
              next[y] = v > C(0) ? v : C(0);
            }
            removed += rx;
            ++rejected_sampled;
            const double next_mass = sum64(next, V);
            if (next_mass != 0.0) {
              std::swap(s.w, s.w_next);
              w = s.w.data();
              mass = next_mass;
              continue;
            }
            // Rounding only (p and r' agree to the last bit): zero w(x) instead, below.
          }
          const C previous = w[x];
          if (previous == C(0)) continue;  // zeroing changes nothing
          w[x] = C(0);
          const double zeroed_mass = sum64(w, V);
          if (zeroed_mass == 0.0) {
            w[x] = previous;  // that would empty w too: keep it as it was
          } else {
            mass = zeroed_mass;
          }
        }
      }
      if (child < 0) {
        const double u = philox::uniform(seed, offset, static_cast<uint32_t>(node), philox::kBonusDraw);
        tokens_out[depth] = verify::sample_inverse_cdf<C>(w, V, u);
        break;
      }
    }
    ++depth;
    nodes_out[depth] = static_cast<int32_t>(child);
    tokens_out[depth - 1] = tok[child];
    node = child;
  }
  if (bad) {
    std::fill(nodes_out + 1, nodes_out + A, -1);
    std::fill(tokens_out, tokens_out + A, -1);
    tokens_out[0] = fallback_token<In, C>(logits, V);
    depth = 0;
  }
  a.accept_len[b] = static_cast<int32_t>(depth);
  a.status[b] = bad ? 1 : draft_bad ? 2 : 0;
}

template <int kIsa, typename In, typename C>
EAGLE_INLINE void verify_range(const Args& a, int64_t begin, int64_t end) {
  const bool sampling = a.temperature != nullptr;
  Scratch<C>* scratch = sampling ? &thread_scratch<C>(a.V) : nullptr;
  for (int64_t b = begin; b < end; ++b) verify_request<kIsa, In, C>(a, b, scratch);
}

using RangeFn = void (*)(const Args&, int64_t, int64_t);

// A range function compiled for AVX-512, AVX2 and baseline x86-64: NAME_avx512 / _avx2 / _base over
// RANGE<isa, IN, C>(const ARGS&, begin, end) (verify's and block_verify's).
#define EAGLE_VARIANTS(NAME, ARGS, RANGE, IN, C)                                      \
  EAGLE_TARGET_AVX512 void NAME##_avx512(const ARGS& a, int64_t begin, int64_t end) { \
    RANGE<kAvx512, IN, C>(a, begin, end);                                             \
  }                                                                                   \
  EAGLE_TARGET_AVX2 void NAME##_avx2(const ARGS& a, int64_t begin, int64_t end) {     \
    RANGE<kAvx2, IN, C>(a, begin, end);                                               \
  }                                                                                   \
  void NAME##_base(const ARGS& a, int64_t begin, int64_t end) { RANGE<kBase, IN, C>(a, begin, end); }

// The body of a pick function: PREFIX_{f32, f16, bf16, f64}'s variant for the logits' dtype at the
// CPU's instruction-set level (the AVX-512 one from avx512-ymm up).
#define EAGLE_PICK_BY_DTYPE(PREFIX, OP)                                                                          \
  const isa::Level level = isa::current();                                                                       \
  const int variant = level >= isa::Level::kAvx512Ymm ? kAvx512 : level >= isa::Level::kAvx2 ? kAvx2 : kBase;    \
  switch (dtype) {                                                                                               \
    case at::kFloat:                                                                                             \
      return EAGLE_PICK(PREFIX##_f32);                                                                           \
    case at::kHalf:                                                                                              \
      return EAGLE_PICK(PREFIX##_f16);                                                                           \
    case at::kBFloat16:                                                                                          \
      return EAGLE_PICK(PREFIX##_bf16);                                                                          \
    case at::kDouble:                                                                                            \
      return EAGLE_PICK(PREFIX##_f64);                                                                           \
    default:                                                                                                     \
      TORCH_CHECK_VALUE(false, OP ": target_logits: expected dtype float32, float16, bfloat16 or float64, got ", \
                        dtype);                                                                                  \
  }                                                                                                              \
  return nullptr
#define EAGLE_PICK(NAME) (variant == kAvx512 ? NAME##_avx512 : variant == kAvx2 ? NAME##_avx2 : NAME##_base)

EAGLE_VARIANTS(verify_f32, Args, verify_range, float, float)
EAGLE_VARIANTS(verify_f16, Args, verify_range, c10::Half, float)
EAGLE_VARIANTS(verify_bf16, Args, verify_range, c10::BFloat16, float)
EAGLE_VARIANTS(verify_f64, Args, verify_range, double, double)

RangeFn pick_kernel(at::ScalarType dtype) { EAGLE_PICK_BY_DTYPE(verify, "verify"); }

// ------------------------------------------------------------------------------- checking
void check_optional(const std::optional<at::Tensor>& t, const char* op, const char* name, at::ScalarType dtype,
                    int64_t B, const at::Device& dev) {
  if (!t) return;
  check_dtype(*t, op, name, dtype);
  check_shape(*t, op, name, {B}, "[B]");
  check_device(*t, op, name, dev);
}

// The per-request sampling parameters of verify and block_verify (_checks._check_sampling_values):
// temperatures finite and >= 0, top_k >= 0, top_p in (0, 1]; undefined tensors are not given.
void check_sampling_values(const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p, int64_t B,
                           const char* op) {
  if (temperature.defined()) check_temperature_values(temperature.data_ptr<float>(), B, op);
  if (top_k.defined()) {
    const int32_t* k = top_k.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK_VALUE(k[b] >= 0, op, ": top_k: expected values >= 0, got ", k[b], " at ", b);
  }
  if (top_p.defined()) {
    const float* p = top_p.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK_VALUE(p[b] > 0.0f && p[b] <= 1.0f, op, ": top_p: expected values in (0, 1], got ", p[b], " at ", b);
  }
}

// Value checks of eagle_kernels/_checks.py (CPU tensors: reading them is free of syncs).
void check_values(const at::Tensor& tokens, const at::Tensor& parents, int64_t B, int64_t N, int64_t V,
                  const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p) {
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int32_t* par = parents.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(par[b * N] == -1,
                      "verify: parents: expected parents[:, 0] == -1 (node 0 is the root), got parents[", b,
                      ", 0] = ", par[b * N]);
    for (int64_t i = 1; i < N; ++i) {
      const int64_t p = par[b * N + i];
      TORCH_CHECK_VALUE(p >= 0 && p < i, "verify: parents: expected 0 <= parents[b, i] < i for i >= 1, got parents[", b,
                        ", ", i, "] = ", p);
      const int64_t x = tok[b * N + i];
      TORCH_CHECK_VALUE(x >= 0 && x < V, "verify: tokens: expected draft tokens in [0, V = ", V, "), got tokens[", b,
                        ", ", i, "] = ", x);
    }
  }
  check_sampling_values(temperature, top_k, top_p, B, "verify");
}

at::Tensor dense(const std::optional<at::Tensor>& t) { return t ? t->contiguous() : at::Tensor(); }

}  // namespace

VerifyTensors verify_cpu(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& target_logits,
                         int64_t max_depth, const std::optional<at::Tensor>& temperature,
                         const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                         const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                         const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& draft_sampled,
                         const std::optional<at::Tensor>& d2t, const std::optional<at::Tensor>& positions) {
  const char* op = "verify";
  check_float_dtype(target_logits, op, "target_logits");
  check_dim(target_logits, op, "target_logits", 3, "[B, N, V]");
  const at::Device dev = target_logits.device();
  TORCH_CHECK_VALUE(dev.is_cpu(), "verify: target_logits: expected a CPU tensor, got one on ", dev);
  const int64_t B = target_logits.size(0), N = target_logits.size(1), V = target_logits.size(2);
  check_dtype(tokens, op, "tokens", at::kLong);
  check_shape(tokens, op, "tokens", {B, N}, "[B, N]");
  check_device(tokens, op, "tokens", dev);
  check_dtype(parents, op, "parents", at::kInt);
  check_shape(parents, op, "parents", {B, N}, "[B, N]");
  check_device(parents, op, "parents", dev);
  // accept_len (int32) holds up to max_depth accepted nodes
  TORCH_CHECK_VALUE(max_depth >= 0 && max_depth <= std::numeric_limits<int32_t>::max(),
                    "verify: max_depth: expected an int in [0, 2**31 - 1], got ", max_depth);
  TORCH_CHECK_VALUE(N > 0 && V > 0,
                    "verify: target_logits: expected at least one node and one vocabulary entry, got shape ",
                    shape_str(target_logits.sizes()));
  check_optional(temperature, op, "temperature", at::kFloat, B, dev);
  check_optional(top_k, op, "top_k", at::kInt, B, dev);
  check_optional(top_p, op, "top_p", at::kFloat, B, dev);
  check_optional(seed, op, "seed", at::kLong, B, dev);
  check_optional(offset, op, "offset", at::kLong, B, dev);
  check_optional(positions, op, "positions", at::kLong, B, dev);
  int64_t Vd = 0;
  if (!draft_probs) {
    TORCH_CHECK_VALUE(!draft_sampled, "verify: draft_sampled: expected None when draft_probs is None ",
                      "(it qualifies the draft distributions), got a Tensor");
    TORCH_CHECK_VALUE(!d2t, "verify: d2t: expected None when draft_probs is None ",
                      "(it qualifies the draft distributions), got a Tensor");
  } else {
    check_dtype(*draft_probs, op, "draft_probs", at::kFloat);
    check_dim(*draft_probs, op, "draft_probs", 3, "[B, N, Vd]");
    check_device(*draft_probs, op, "draft_probs", dev);
    TORCH_CHECK_VALUE(draft_probs->size(0) == B && draft_probs->size(1) == N, "verify: draft_probs: expected shape ",
                      "[B = ", B, ", N = ", N, ", Vd], got shape ", shape_str(draft_probs->sizes()));
    Vd = draft_probs->size(2);
    TORCH_CHECK_VALUE(d2t || Vd == V, "verify: draft_probs: expected Vd = V = ", V,
                      " (the target vocabulary) without d2t, got shape ", shape_str(draft_probs->sizes()));
    TORCH_CHECK_VALUE(Vd > 0, "verify: draft_probs: expected at least one draft vocabulary entry, got shape ",
                      shape_str(draft_probs->sizes()));
    if (d2t) {
      check_dtype(*d2t, op, "d2t", at::kLong);
      check_shape(*d2t, op, "d2t", {Vd}, "[Vd]");
      check_device(*d2t, op, "d2t", dev);
    }
    if (draft_sampled) {
      check_dtype(*draft_sampled, op, "draft_sampled", at::kBool);
      check_shape(*draft_sampled, op, "draft_sampled", {B, N}, "[B, N]");
      check_device(*draft_sampled, op, "draft_sampled", dev);
    }
  }

  const at::Tensor tok = tokens.contiguous();
  const at::Tensor par = parents.contiguous();
  const at::Tensor temp_c = dense(temperature), topk_c = dense(top_k), topp_c = dense(top_p);
  const at::Tensor seed_c = dense(seed), offset_c = dense(offset), positions_c = dense(positions);
  const at::Tensor draft_c = dense(draft_probs), sampled_c = dense(draft_sampled), d2t_c = dense(d2t);
  check_values(tok, par, B, N, V, temp_c, topk_c, topp_c);
  // Rows are read in place when their entries are contiguous; otherwise one dense copy.
  const at::Tensor logits = target_logits.stride(2) == 1 || V == 1 ? target_logits : target_logits.contiguous();

  const int64_t A = max_depth + 1;
  const auto opts = tok.options();
  at::Tensor accept_len = at::empty({B}, opts.dtype(at::kInt));
  at::Tensor accept_nodes = at::empty({B, A}, opts.dtype(at::kInt));
  at::Tensor out_tokens = at::empty({B, A}, opts.dtype(at::kLong));
  at::Tensor status = at::empty({B}, opts.dtype(at::kInt));

  Args a;
  a.logits = logits.data_ptr();
  a.stride_b = logits.stride(0);
  a.stride_n = logits.stride(1);
  a.B = B;
  a.N = N;
  a.V = V;
  a.max_depth = max_depth;
  a.tokens = tok.data_ptr<int64_t>();
  a.parents = par.data_ptr<int32_t>();
  a.temperature = temperature ? temp_c.data_ptr<float>() : nullptr;
  a.top_k = top_k ? topk_c.data_ptr<int32_t>() : nullptr;
  a.top_p = top_p ? topp_c.data_ptr<float>() : nullptr;
  a.seed = seed ? seed_c.data_ptr<int64_t>() : nullptr;
  a.offset = offset ? offset_c.data_ptr<int64_t>() : nullptr;
  a.positions = positions ? positions_c.data_ptr<int64_t>() : nullptr;
  a.draft_probs = draft_probs ? draft_c.data_ptr<float>() : nullptr;
  a.Vd = Vd;
  a.draft_sampled = draft_sampled ? sampled_c.data_ptr<bool>() : nullptr;
  // The target -> draft id map of d2t, once per call (every row shares it).
  std::vector<int64_t> d2t_inv;
  a.d2t_inv = nullptr;
  a.d2t_ok = true;
  if (draft_probs && d2t) {
    d2t_inv.resize(V);
    a.d2t_ok = verify::invert_d2t(d2t_c.data_ptr<int64_t>(), Vd, V, d2t_inv.data());
    a.d2t_inv = d2t_inv.data();
  }
  a.accept_len = accept_len.data_ptr<int32_t>();
  a.accept_nodes = accept_nodes.data_ptr<int32_t>();
  a.out_tokens = out_tokens.data_ptr<int64_t>();
  a.status = status.data_ptr<int32_t>();

  const RangeFn fn = pick_kernel(target_logits.scalar_type());
  // A request touches at most max_depth + 1 rows of V entries, with ~10 passes when sampling.
  // A chunk gets at least ~2M element-passes (about a millisecond): waking the second thread
  // costs ~10 ms on a loaded 2-core host, so greedy batches of a few requests run inline.
  const int64_t cost = std::max<int64_t>(1, (std::min(max_depth, N - 1) + 1) * V * (temperature ? 10 : 1));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 21) / cost);
  at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) { fn(a, begin, end); });
  return {accept_len, accept_nodes, out_tokens, status};
}

}  // namespace eagle

namespace eagle {

// The target ids the race draws for a vocabulary of n entries: x, or x + d2t[x] (checked in [0, 2^32)),
// padded with zeros to whole AVX-512 blocks.
static std::vector<uint32_t> coupled_ids(const char* op, const std::optional<at::Tensor>& d2t, int64_t n,
                                         const at::Device dev, const char* d2t_shape) {
  std::vector<uint32_t> ids(static_cast<size_t>(n + kCoupledBlock), 0u);
  if (d2t) {
    check_dtype(*d2t, op, "d2t", at::kLong);
    check_shape(*d2t, op, "d2t", {n}, d2t_shape);
    check_device(*d2t, op, "d2t", dev);
    const at::Tensor d = d2t->contiguous();
    const int64_t* off = d.data_ptr<int64_t>();
    for (int64_t x = 0; x < n; ++x) {
      const int64_t id = x + off[x];
      TORCH_CHECK_VALUE(id >= 0 && id < (int64_t{1} << 32), op, ": d2t: expected token ids x + d2t[x] in ",
                        "[0, 2^32), got ", id, " at ", x);
      ids[x] = static_cast<uint32_t>(id);
    }
  } else {
    TORCH_CHECK_VALUE(n <= (int64_t{1} << 32), op, ": expected a vocabulary of at most 2^32, got ", n);
    for (int64_t x = 0; x < n; ++x) ids[x] = static_cast<uint32_t>(x);
  }
  return ids;
}

// The Gumbel noise -log(-log U) [R, n] of rows r = (seed[r / W], positions[r]) (positions: R = B * W
// entries, dense): the uniforms in the AVX-512 blocks of verify's race, then two vectorised logs over
// the whole tensor, rounded once to float32.
static at::Tensor coupled_gumbel_rows(const int64_t* seeds, const int64_t* positions, int64_t R, int64_t W,
                                      const std::vector<uint32_t>& ids, int64_t n, const at::TensorOptions& opts) {
  at::Tensor u = at::empty({R, n}, opts.dtype(at::kDouble));
  double* out = u.data_ptr<double>();
  const bool avx512 = isa::current() >= isa::Level::kAvx512Ymm;
  // Rows of fewer than ~64k entries run inline: waking the second thread costs more on a loaded host
  // (as in verify above), and ATen's logs stay on one thread below 32k entries too.
  at::parallel_for(0, R, std::max<int64_t>(1, (int64_t{1} << 16) / n), [&](int64_t begin, int64_t end) {
    alignas(64) double block[kCoupledBlock];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t seed_r = seeds[r / W], position = positions[r];
      double* row = out + r * n;
      for (int64_t x0 = 0; x0 < n; x0 += kCoupledBlock) {
        if (avx512) {
          coupled_uniforms<kAvx512>(seed_r, position, ids.data() + x0, block);
        } else {
          coupled_uniforms<kBase>(seed_r, position, ids.data() + x0, block);
        }
        std::memcpy(row + x0, block, sizeof(double) * std::min<int64_t>(kCoupledBlock, n - x0));
      }
    }
  });
  // U = 0 gives -log U = inf and a noise of -inf: never first in a race.
  return u.log_().neg_().log_().neg_().to(at::kFloat);
}

// coupled_noise (docs/ops.md §15): the Gumbel noise of coupled sampling at each (request, position,
// token id).
at::Tensor coupled_noise_cpu(const at::Tensor& seed, const at::Tensor& positions, int64_t num_tokens,
                             const std::optional<at::Tensor>& d2t) {
  const char* op = "coupled_noise";
  check_dtype(seed, op, "seed", at::kLong);
  check_dim(seed, op, "seed", 1, "[B]");
  const at::Device dev = seed.device();
  TORCH_CHECK_VALUE(dev.is_cpu(), "coupled_noise: seed: expected a CPU tensor, got one on ", dev);
  const int64_t B = seed.size(0);
  check_dtype(positions, op, "positions", at::kLong);
  check_dim(positions, op, "positions", 2, "[B, W]");
  check_device(positions, op, "positions", dev);
  TORCH_CHECK_VALUE(positions.size(0) == B, "coupled_noise: positions: expected shape [B = ", B, ", W], got shape ",
                    shape_str(positions.sizes()));
  TORCH_CHECK_VALUE(num_tokens >= 1, "coupled_noise: num_tokens: expected an int >= 1, got ", num_tokens);
  const int64_t W = positions.size(1), n = num_tokens;
  const std::vector<uint32_t> ids = coupled_ids(op, d2t, n, dev, "[num_tokens]");
  const at::Tensor seed_c = seed.contiguous(), pos_c = positions.contiguous();
  return coupled_gumbel_rows(seed_c.data_ptr<int64_t>(), pos_c.data_ptr<int64_t>(), B * W, W, ids, n, seed.options())
      .view({B, W, n});
}

// coupled_draft_logits (docs/ops.md §16): a drafting step's rows under coupled sampling, the
// log-probabilities at each sampling request's temperature plus its race noise (one noise row per
// request, shared by its M rows), the reference's ATen arithmetic; greedy requests' rows as float32.
at::Tensor coupled_draft_logits_cpu(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& seed,
                                    const at::Tensor& positions, const std::optional<at::Tensor>& d2t) {
  const char* op = "coupled_draft_logits";
  check_32_or_16_bit_float(logits, op, "logits");
  check_dim(logits, op, "logits", 3, "[B, M, n]");
  const at::Device dev = logits.device();
  TORCH_CHECK_VALUE(dev.is_cpu(), "coupled_draft_logits: logits: expected a CPU tensor, got one on ", dev);
  const int64_t B = logits.size(0), n = logits.size(2);
  TORCH_CHECK_VALUE(n >= 1, "coupled_draft_logits: logits: expected a vocabulary of at least one entry ",
                    "[B, M, n >= 1], got shape ", shape_str(logits.sizes()));
  check_dtype(temperature, op, "temperature", at::kFloat);
  check_shape(temperature, op, "temperature", {B}, "[B]");
  check_device(temperature, op, "temperature", dev);
  check_dtype(seed, op, "seed", at::kLong);
  check_shape(seed, op, "seed", {B}, "[B]");
  check_device(seed, op, "seed", dev);
  check_dtype(positions, op, "positions", at::kLong);
  check_shape(positions, op, "positions", {B}, "[B]");
  check_device(positions, op, "positions", dev);
  check_temperature_values(temperature.contiguous().data_ptr<float>(), B, op);
  const std::vector<uint32_t> ids = coupled_ids(op, d2t, n, dev, "[n]");
  const at::Tensor seed_c = seed.contiguous(), pos_c = positions.contiguous();
  const at::Tensor noise =
      coupled_gumbel_rows(seed_c.data_ptr<int64_t>(), pos_c.data_ptr<int64_t>(), B, 1, ids, n, seed.options())
          .view({B, 1, n});
  const at::Tensor rows = logits.to(at::kFloat);
  const at::Tensor sampling = at::gt(temperature, 0);
  const at::Tensor scale = at::where(sampling, temperature, at::ones_like(temperature)).view({B, 1, 1});
  // The max subtracted before the division, as the reference (a tiny temperature: -inf, never inf - inf).
  const at::Tensor shifted = at::div(at::sub(rows, at::amax(rows, {-1}, true)), scale);
  const at::Tensor perturbed = at::add(at::log_softmax(shifted, -1), noise);
  return at::where(sampling.view({B, 1, 1}), perturbed, rows);
}

#include "block_verify.inc"

}  // namespace eagle
