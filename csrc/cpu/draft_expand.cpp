// CPU launcher of draft_expand: validate -> make contiguous -> allocate -> one scan per frontier
// row (parallel over B * M rows) -> frontier selection per request. Core: csrc/core/draft_expand.h.
//
// Inner loops: AVX-512 (fp32/bf16/fp16, 16 lanes) or AVX2+FMA+F16C (8 lanes) at the level
// isa::current() picks (simd.h: EAGLE_KERNELS_CPU_ISA caps it; the AVX-512 scan from avx512-ymm
// up), else a portable scalar loop (also the float64 path).
//
// Each row is read once. The scan keeps an online log-sum-exp (max and sum of exp(x - max),
// rescaled when the max grows) and a sorted top-k buffer that only entries above its k-th
// value enter, so no vocabulary-sized sort or temporary is needed. The SIMD variants work on
// blocks of 4 vectors: a block whose max does not exceed the running max and whose entries all
// sit below the k-th value (the common case after the first few blocks) costs one exp per
// entry (simd.h's, FMA form) and two vector compares.
//
// Sampled rows (requests with temperature[b] > 0, docs/ops.md §2) take three passes: max, sum of
// exp((x - max) / T), then each id's tempered log-prob and its Gumbel key on the counter-based
// stream (a Philox-4x32-10 block per id, 16 at a time under AVX-512, 8 under AVX2: the pass's
// main cost), the k largest keys kept in a sorted buffer, and ids that provably cannot enter it
// skipping the float64 logs of their key (see sample_row).
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "core/draft_expand.h"
#include "core/philox.h"
#include "ops.h"

namespace eagle {
namespace {

namespace core = draft_expand;

// Row top-k through the insertion buffer up to this k; above it, a partial sort of the ids
// (insertion costs O(k) per accepted entry, which a large k turns quadratic).
constexpr int64_t kMaxBufferK = 64;
// Target entries scanned per parallel_for chunk: small problems run inline (waking the other
// thread costs far more than scanning a few rows).
constexpr int64_t kWorkPerChunk = 1 << 19;
// The Gumbel draws' counter word holds depth * 65536 + m (docs/ops.md §2; _checks.py's limits).
constexpr int64_t kDepthLimit = 65535;
constexpr int64_t kRowLimit = 65536;

// ------------------------------------------------------------------------- portable scan
// One pass: online max / sum-exp and the top-k buffer. A = accumulation type (float, or double
// for double logits).
template <typename T, typename A>
core::RowStats<A> scan_row_portable(const T* row, int64_t V, int64_t k, A* top_values, int64_t* top_ids,
                                    int64_t& count) {
  const A neg_inf = -std::numeric_limits<A>::infinity();
  core::RowStats<A> s{neg_inf, A(0), false};
  for (int64_t v = 0; v < V; ++v) {
    const A x = static_cast<A>(row[v]);
    if (std::isnan(x)) {
      s.bad = true;
      continue;
    }
    if (x > s.max) {
      // exp(-inf - x) = 0 also covers the first finite entry.
      s.sum = s.sum * std::exp(s.max - x) + A(1);
      s.max = x;
    } else if (x > neg_inf) {
      s.sum += std::exp(x - s.max);
    }
    if (k > 0) core::push_top_k(top_values, top_ids, count, k, x, v);
  }
  if (s.max == std::numeric_limits<A>::infinity()) s.bad = true;
  return s;
}

// ------------------------------------------------------------------------- AVX-512 scan
#if EAGLE_X86_SIMD
// The element type of a row as simd.h's loads take it.
template <typename T>
using Elem = std::conditional_t<std::is_same_v<T, c10::BFloat16>, Bf16Bits,
                                std::conditional_t<std::is_same_v<T, c10::Half>, Fp16Bits, float>>;

// Pushes the lanes of x set in `lanes` (entry ids v + lane, increasing) into the buffer.
EAGLE_TARGET_AVX512 inline void push_lanes(__m512 x, __mmask16 lanes, int64_t v, int64_t k, float* top_values,
                                           int64_t* top_ids, int64_t& count) {
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, x);
  uint32_t bits = lanes;
  while (bits) {
    const int lane = __builtin_ctz(bits);
    bits &= bits - 1;
    if (!std::isnan(tmp[lane])) core::push_top_k(top_values, top_ids, count, k, tmp[lane], v + lane);
  }
}

template <typename E>
EAGLE_TARGET_AVX512 core::RowStats<float> scan_row_avx512(const E* row, int64_t V, int64_t k, float* top_values,
                                                          int64_t* top_ids, int64_t& count) {
  using namespace simd::avx512;
  constexpr int64_t kBlock = 64;
  const __mmask16 all = 0xFFFF;
  float run_max = -INFINITY;
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  // Entries must beat the k-th buffered value; until the buffer is full every entry enters.
  __m512 thr = _mm512_set1_ps(-INFINITY);
  bool full = false;
  __mmask16 nan_seen = 0;
  for (int64_t v = 0; v < V; v += kBlock) {
    __m512 x[4];
    __mmask16 valid[4];
    EAGLE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const int64_t left = V - (v + 16 * j);
      valid[j] = left >= 16 ? all : (left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1));
      x[j] = load16_or_neg_inf(row + v + 16 * j, valid[j]);
    }
    nan_seen |= _mm512_cmp_ps_mask(x[0], x[1], _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x[2], x[3], _CMP_UNORD_Q);
    const __m512 bmax = _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]));
    if (_mm512_cmp_ps_mask(bmax, vmax, _CMP_GT_OQ)) {
      const float new_max = reduce_max(bmax);
      const __m512 scale = exp_nonpositive<true>(_mm512_set1_ps(run_max - new_max));
      sum0 = _mm512_mul_ps(sum0, scale);
      sum1 = _mm512_mul_ps(sum1, scale);
      run_max = new_max;
      vmax = _mm512_set1_ps(new_max);
    }
    sum0 = _mm512_add_ps(sum0, exp_nonpositive<true>(_mm512_sub_ps(x[0], vmax)));
    sum1 = _mm512_add_ps(sum1, exp_nonpositive<true>(_mm512_sub_ps(x[1], vmax)));
    sum0 = _mm512_add_ps(sum0, exp_nonpositive<true>(_mm512_sub_ps(x[2], vmax)));
    sum1 = _mm512_add_ps(sum1, exp_nonpositive<true>(_mm512_sub_ps(x[3], vmax)));
    if (k == 0) {
      // lse only (large k ranks the ids afterwards)
    } else if (!full) {
      EAGLE_UNROLL
      for (int j = 0; j < 4; ++j) push_lanes(x[j], valid[j], v + 16 * j, k, top_values, top_ids, count);
      full = count == k;
      if (full) thr = _mm512_set1_ps(top_values[k - 1]);
    } else if (_mm512_cmp_ps_mask(bmax, thr, _CMP_GT_OQ)) {
      EAGLE_UNROLL
      for (int j = 0; j < 4; ++j) {
        const __mmask16 above = _mm512_cmp_ps_mask(x[j], thr, _CMP_GT_OQ) & valid[j];
        if (above) push_lanes(x[j], above, v + 16 * j, k, top_values, top_ids, count);
      }
      thr = _mm512_set1_ps(top_values[k - 1]);
    }
  }
  core::RowStats<float> s;
  s.max = run_max;
  // exp(-inf - run_max) lanes (masked tails, -inf entries) added exact zeros.
  s.sum = reduce_add(_mm512_add_ps(sum0, sum1));
  s.bad = nan_seen != 0 || run_max == INFINITY;
  return s;
}

// ------------------------------------------------------------------------- AVX2 scan
// Same algorithm as the AVX-512 scan, 8 lanes, blocks of 32 entries; the row's last partial
// block goes through a small float buffer padded with -inf (AVX2 has no masked 16-bit loads).
EAGLE_TARGET_AVX2 inline unsigned gt_mask8(__m256 a, __m256 b) {
  return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)));
}

struct Avx2Scan {
  int64_t k;
  float* top_values;
  int64_t* top_ids;
  int64_t& count;
  float run_max = -INFINITY;
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
  __m256 thr = _mm256_set1_ps(-INFINITY);  // entries must beat the k-th buffered value
  bool full = false;                       // until the buffer is full every entry enters
  unsigned nan_seen = 0;

  EAGLE_TARGET_AVX2 void push(__m256 x, unsigned lanes, int64_t v) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, x);
    while (lanes) {
      const int lane = __builtin_ctz(lanes);
      lanes &= lanes - 1;
      if (!std::isnan(tmp[lane])) core::push_top_k(top_values, top_ids, count, k, tmp[lane], v + lane);
    }
  }

  // Entries v .. v + 31; lanes past `valid` entries hold -inf.
  EAGLE_TARGET_AVX2 void block(const __m256* x, int64_t v, int valid) {
    using namespace simd::avx2;
    nan_seen |= static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x[0], x[1], _CMP_UNORD_Q)) |
                                      _mm256_movemask_ps(_mm256_cmp_ps(x[2], x[3], _CMP_UNORD_Q)));
    const __m256 bmax = _mm256_max_ps(_mm256_max_ps(x[0], x[1]), _mm256_max_ps(x[2], x[3]));
    if (gt_mask8(bmax, vmax)) {
      const float new_max = reduce_max(bmax);
      const __m256 scale = exp_nonpositive<true>(_mm256_set1_ps(run_max - new_max));
      sum0 = _mm256_mul_ps(sum0, scale);
      sum1 = _mm256_mul_ps(sum1, scale);
      run_max = new_max;
      vmax = _mm256_set1_ps(new_max);
    }
    sum0 = _mm256_add_ps(sum0, exp_nonpositive<true>(_mm256_sub_ps(x[0], vmax)));
    sum1 = _mm256_add_ps(sum1, exp_nonpositive<true>(_mm256_sub_ps(x[1], vmax)));
    sum0 = _mm256_add_ps(sum0, exp_nonpositive<true>(_mm256_sub_ps(x[2], vmax)));
    sum1 = _mm256_add_ps(sum1, exp_nonpositive<true>(_mm256_sub_ps(x[3], vmax)));
    if (k == 0) return;  // lse only (large k ranks the ids afterwards)
    if (!full) {
      for (int j = 0; j < 4; ++j) {
        const int left = valid - 8 * j;
        const unsigned lanes = left >= 8 ? 0xFFu : (left <= 0 ? 0u : (1u << left) - 1);
        push(x[j], lanes, v + 8 * j);
      }
      full = count == k;
      if (full) thr = _mm256_set1_ps(top_values[k - 1]);
    } else if (gt_mask8(bmax, thr)) {
      // Tail lanes are -inf and never beat a threshold.
      for (int j = 0; j < 4; ++j) {
        const unsigned above = gt_mask8(x[j], thr);
        if (above) push(x[j], above, v + 8 * j);
      }
      thr = _mm256_set1_ps(top_values[k - 1]);
    }
  }
};

template <typename E>
EAGLE_TARGET_AVX2 core::RowStats<float> scan_row_avx2(const E* row, int64_t V, int64_t k, float* top_values,
                                                      int64_t* top_ids, int64_t& count) {
  constexpr int64_t kBlock = 32;
  Avx2Scan st{k, top_values, top_ids, count};
  __m256 x[4];
  int64_t v = 0;
  for (; v + kBlock <= V; v += kBlock) {
    for (int j = 0; j < 4; ++j) x[j] = simd::avx2::load8(row + v + 8 * j);
    st.block(x, v, kBlock);
  }
  if (v < V) {
    alignas(32) float buf[kBlock];
    const int valid = static_cast<int>(V - v);
    for (int i = 0; i < kBlock; ++i) buf[i] = i < valid ? widen(row[v + i]) : -INFINITY;
    for (int j = 0; j < 4; ++j) x[j] = _mm256_load_ps(buf + 8 * j);
    st.block(x, v, valid);
  }
  core::RowStats<float> s;
  s.max = st.run_max;
  s.sum = simd::avx2::reduce_add(_mm256_add_ps(st.sum0, st.sum1));
  s.bad = st.nan_seen != 0 || st.run_max == INFINITY;
  return s;
}

#endif  // EAGLE_X86_SIMD

// ------------------------------------------------------------------------- per-row driver
// Scans row (b, m) and writes its k candidates. Scratch: top_values/top_ids of kMaxBufferK.
template <typename T>
void expand_row(const T* row, int64_t V, int64_t k, float frontier_score, const int64_t* d2t, int64_t* tokens,
                float* scores, float* logprobs, isa::Level level) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t kb = k <= kMaxBufferK ? k : 0;  // 0: lse only, top-k below
  A top_values[kMaxBufferK];
  int64_t top_ids[kMaxBufferK];
  int64_t count = 0;
  core::RowStats<A> s;
  bool done = false;
#if EAGLE_X86_SIMD
  if constexpr (!std::is_same_v<T, double>) {
    const Elem<T>* elems = reinterpret_cast<const Elem<T>*>(row);
    if (level >= isa::Level::kAvx512Ymm) {
      s = scan_row_avx512(elems, V, kb, top_values, top_ids, count);
      done = true;
    } else if (level >= isa::Level::kAvx2) {
      s = scan_row_avx2(elems, V, kb, top_values, top_ids, count);
      done = true;
    }
  }
#endif
  if (!done) s = scan_row_portable<T, A>(row, V, kb, top_values, top_ids, count);
  if (kb == 0 && !core::row_is_bad(s)) {
    // Large k: rank ids by (logit desc, id asc); NaN rows are bad and skip this.
    std::vector<int64_t> ids(V);
    std::iota(ids.begin(), ids.end(), int64_t(0));
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [row](int64_t a, int64_t b) {
      const A xa = static_cast<A>(row[a]), xb = static_cast<A>(row[b]);
      return xa > xb || (xa == xb && a < b);
    });
    std::vector<A> values(k);
    for (int64_t r = 0; r < k; ++r) values[r] = static_cast<A>(row[ids[r]]);
    core::finish_row<A>(s, values.data(), ids.data(), k, k, static_cast<A>(frontier_score), d2t, tokens, scores,
                        logprobs);
    return;
  }
  core::finish_row<A>(s, top_values, top_ids, kb == 0 ? 0 : count, k, static_cast<A>(frontier_score), d2t, tokens,
                      scores, logprobs);
}

// Sampled rows: sample_row and its passes.
#include "draft_expand_sampled.inc"

// Per-request sampling parameters (all null when no request samples).
struct Sampling {
  const float* temperature;  // [B] or null
  const int64_t* seed;       // [B] or null
  const int64_t* offset;     // [B] or null
  int64_t depth;
};

template <typename T>
void run_draft_expand(const at::Tensor& logits, const at::Tensor& fscores, const int64_t* d2t, int64_t k,
                      const Sampling& sp, at::Tensor& tokens, at::Tensor& scores, at::Tensor& frontier,
                      at::Tensor& logprobs) {
  const int64_t B = logits.size(0), M = logits.size(1), V = logits.size(2);
  const T* x = logits.data_ptr<T>();
  const float* fs = fscores.data_ptr<float>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* sc = scores.data_ptr<float>();
  int32_t* fr = frontier.data_ptr<int32_t>();
  float* lp = logprobs.data_ptr<float>();
  bool any_sampled = false;
  for (int64_t b = 0; sp.temperature != nullptr && b < B; ++b) any_sampled |= sp.temperature[b] > 0.0f;
  // A sampled entry costs two passes and a Philox block, a few times a deterministic one.
  const int64_t grain = std::max<int64_t>(1, kWorkPerChunk / (any_sampled ? 4 * V : V));
  const isa::Level level = isa::current();
  at::parallel_for(0, B * M, grain, [&](int64_t begin, int64_t end) {
    std::vector<double> keys;
    std::vector<int64_t> ids;
    for (int64_t row = begin; row < end; ++row) {
      // Candidate row * k + r: (b, m) rows are laid out as b * (M * k) + m * k.
      const int64_t b = row / M, m = row % M;
      const float temperature = sp.temperature != nullptr ? sp.temperature[b] : 0.0f;
      if (temperature > 0.0f) {
        keys.resize(k);
        ids.resize(k);
        sample_row<T>(x + row * V, V, k, temperature, sp.seed ? sp.seed[b] : 0, sp.offset ? sp.offset[b] : 0,
                      core::gumbel_draw(sp.depth, m), fs[row], d2t, tok + row * k, sc + row * k, lp + row * k,
                      keys.data(), ids.data(), level);
      } else {
        expand_row<T>(x + row * V, V, k, fs[row], d2t, tok + row * k, sc + row * k, lp + row * k, level);
      }
    }
  });
  const int64_t MK = M * k;
  std::vector<float> keys(k);
  std::vector<int64_t> picked(k);
  for (int64_t b = 0; b < B; ++b) core::select_frontier(sc + b * MK, MK, k, keys.data(), picked.data(), fr + b * k);
}

}  // namespace

DraftCandidateTensors draft_expand_cpu(const at::Tensor& logits, const at::Tensor& frontier_scores, int64_t top_k,
                                       const std::optional<at::Tensor>& d2t,
                                       const std::optional<at::Tensor>& temperature,
                                       const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                                       int64_t depth) {
  const char* op = "draft_expand";
  TORCH_CHECK_VALUE(logits.device().is_cpu(), op, ": logits: expected device cpu, got ", logits.device());
  check_float_dtype(logits, op, "logits");
  const at::ScalarType dt = logits.scalar_type();
  check_dim(logits, op, "logits", 3, "[B, M, Vd]");
  const int64_t B = logits.size(0), M = logits.size(1), V = logits.size(2);
  check_dtype(frontier_scores, op, "frontier_scores", at::kFloat);
  check_shape(frontier_scores, op, "frontier_scores", {B, M}, "[B, M]");
  check_device(frontier_scores, op, "frontier_scores", logits.device());
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= V, op, ": top_k: expected an int in [1, V = ", V, "], got ", top_k);
  TORCH_CHECK_VALUE(M > 0 && V > 0, op, ": logits: expected at least one frontier node and one ",
                    "vocabulary entry, got shape ", shape_str(logits.sizes()));
  at::Tensor d2t_c;
  if (d2t.has_value()) {
    check_dtype(*d2t, op, "d2t", at::kLong);
    check_shape(*d2t, op, "d2t", {V}, "[Vd]");
    check_device(*d2t, op, "d2t", logits.device());
    d2t_c = d2t->contiguous();
  }
  // Sampling parameters, in the order of eagle_kernels/_checks.py.
  at::Tensor sampling_c[3];
  const std::optional<at::Tensor>* sampling_args[3] = {&temperature, &seed, &offset};
  const char* sampling_names[3] = {"temperature", "seed", "offset"};
  const at::ScalarType sampling_dtypes[3] = {at::kFloat, at::kLong, at::kLong};
  for (int i = 0; i < 3; ++i) {
    const std::optional<at::Tensor>& t = *sampling_args[i];
    if (!t.has_value()) continue;
    check_dtype(*t, op, sampling_names[i], sampling_dtypes[i]);
    check_shape(*t, op, sampling_names[i], {B}, "[B]");
    check_device(*t, op, sampling_names[i], logits.device());
    sampling_c[i] = t->contiguous();
  }
  TORCH_CHECK_VALUE(depth >= 0 && depth < kDepthLimit, op, ": depth: expected an int in [0, ", kDepthLimit, "), got ",
                    depth);
  TORCH_CHECK_VALUE(M <= kRowLimit, op, ": logits: expected at most ", kRowLimit, " frontier nodes (M), got shape ",
                    shape_str(logits.sizes()));
  Sampling sp{nullptr, nullptr, nullptr, depth};
  if (temperature.has_value()) {
    sp.temperature = sampling_c[0].data_ptr<float>();
    check_temperature_values(sp.temperature, B, op);
  }
  if (seed.has_value()) sp.seed = sampling_c[1].data_ptr<int64_t>();
  if (offset.has_value()) sp.offset = sampling_c[2].data_ptr<int64_t>();
  const at::Tensor x = logits.contiguous();
  const at::Tensor fs = frontier_scores.contiguous();
  const auto opts = x.options();
  at::Tensor tokens = at::empty({B, M * top_k}, opts.dtype(at::kLong));
  at::Tensor scores = at::empty({B, M * top_k}, opts.dtype(at::kFloat));
  at::Tensor frontier = at::empty({B, top_k}, opts.dtype(at::kInt));
  at::Tensor logprobs = at::empty({B, M * top_k}, opts.dtype(at::kFloat));
  if (B == 0) return {tokens, scores, frontier, logprobs};
  const int64_t* d2t_p = d2t.has_value() ? d2t_c.data_ptr<int64_t>() : nullptr;
  switch (dt) {
    case at::kFloat:
      run_draft_expand<float>(x, fs, d2t_p, top_k, sp, tokens, scores, frontier, logprobs);
      break;
    case at::kBFloat16:
      run_draft_expand<c10::BFloat16>(x, fs, d2t_p, top_k, sp, tokens, scores, frontier, logprobs);
      break;
    case at::kHalf:
      run_draft_expand<c10::Half>(x, fs, d2t_p, top_k, sp, tokens, scores, frontier, logprobs);
      break;
    default:
      run_draft_expand<double>(x, fs, d2t_p, top_k, sp, tokens, scores, frontier, logprobs);
      break;
  }
  return {tokens, scores, frontier, logprobs};
}

}  // namespace eagle
