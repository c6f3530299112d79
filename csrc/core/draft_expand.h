// draft_expand core: one depth of EAGLE-2 dynamic tree expansion (Li et al. 2024, §4.1).
//
// Torch-free and HOST_DEVICE. The CPU launcher (csrc/cpu/draft_expand.cpp) scans each frontier
// row once, keeping an online log-sum-exp and a sorted top-k buffer (push_top_k below), then
// finishes the row (finish_row) and, per request, selects the frontier (push_top_k on the
// scores' ranking keys).
//
// Ranking inside a row: by logit descending, ties by smaller id. log_softmax is x - lse with
// one lse per row, so this is the log-prob order; ranking the logits themselves keeps distinct
// logits distinct even where float32 rounding of x - lse would merge them.
//
// Bad rows: a row holding NaN or +inf, or no entry above -inf, has an lse that is not finite,
// so every log-prob is NaN (as torch.log_softmax gives). All log-probs then tie and rank by id:
// the row's candidates are ids 0..k-1 with NaN scores, exactly as the reference computes.
//
// Sampled rows (docs/ops.md §2, requests at a temperature): the children are the k largest
// Gumbel keys logp(x) - log(-log U_x), U_x the counter-based uniform of philox.h at (seed,
// offset, node = x, draw = gumbel_draw(depth, m)); k draws without replacement from
// exp(logp). The keys are float64 and ranked like the logits (descending, ties to the smaller
// id); a bad row's keys are all NaN and rank as +inf, so it too yields ids 0..k-1.
#pragma once

#include <math.h>

#include "core/common.h"
#include "core/philox.h"

namespace eagle {
namespace draft_expand {

// Push (value, id) into a buffer of at most k entries sorted by value descending. Callers push
// ids in increasing order, so an entry equal to a held value goes after it (ties: smaller id
// first), and once the buffer is full only a strictly larger value gets in. NaN must not be
// pushed (it compares false with everything); callers map it first (rank keys) or skip it.
template <typename T, typename I>
HOST_DEVICE inline void push_top_k(T* values, I* ids, int64_t& count, int64_t k, T value, I id) {
  if (count == k) {
    if (!(value > values[k - 1])) return;
    --count;  // the last entry drops out
  }
  int64_t pos = count;
  while (pos > 0 && values[pos - 1] < value) {
    values[pos] = values[pos - 1];
    ids[pos] = ids[pos - 1];
    --pos;
  }
  values[pos] = value;
  ids[pos] = id;
  ++count;
}

// Online log-sum-exp state of one row: sum of exp(x - max) over the entries seen.
template <typename A>
struct RowStats {
  A max;     // largest entry seen (-inf when none)
  A sum;     // sum of exp(x - max)
  bool bad;  // a NaN or +inf was seen
};

// Whether the row's log-probs are all NaN (see the header comment).
template <typename A>
HOST_DEVICE inline bool row_is_bad(const RowStats<A>& s) {
  const A inf = static_cast<A>(INFINITY);
  return s.bad || s.max == inf || s.max == -inf;
}

HOST_DEVICE inline float log_of(float x) { return logf(x); }
HOST_DEVICE inline double log_of(double x) { return log(x); }

// Writes the k candidates of one frontier row: tokens[r], scores[r] and logprobs[r] for rank r < k.
// top_values/top_ids: the row's top-k logits (as A) from push_top_k, `count` of them (count
// == k unless the row is bad). logp = (x - max) - log(sum), the same association as
// torch.log_softmax; score = frontier_score + logp in A, rounded once to float32.
template <typename A>
HOST_DEVICE inline void finish_row(const RowStats<A>& s, const A* top_values, const int64_t* top_ids, int64_t count,
                                   int64_t k, A frontier_score, const int64_t* d2t, int64_t* tokens, float* scores,
                                   float* logprobs) {
  const bool bad = row_is_bad(s) || count < k;
  const A log_sum = bad ? A(0) : log_of(s.sum);
  const A nan = static_cast<A>(NAN);
  for (int64_t r = 0; r < k; ++r) {
    const int64_t id = bad ? r : top_ids[r];
    const A logp = bad ? nan : (top_values[r] - s.max) - log_sum;
    tokens[r] = d2t != nullptr ? id + d2t[id] : id;
    scores[r] = static_cast<float>(frontier_score + logp);
    logprobs[r] = static_cast<float>(logp);
  }
}

// ---------------------------------------------------------------------------- sampled rows
constexpr uint32_t kDraftDraw = 2;         // first draw index of the Gumbel draws (docs/design.md)
constexpr uint32_t kDepthStride = 65536;   // draw = kDraftDraw + depth * kDepthStride + m
HOST_DEVICE inline uint32_t gumbel_draw(int64_t depth, int64_t m) {
  return kDraftDraw + static_cast<uint32_t>(depth) * kDepthStride + static_cast<uint32_t>(m);
}

// The exponential-race key of draft id x: logp - log(-log U) in float64 (U = 0 gives -inf).
HOST_DEVICE inline double gumbel_key(double logp, int64_t seed, int64_t offset, uint32_t x, uint32_t draw) {
  const double u = philox::uniform(seed, offset, x, draw);
  return logp - log(-log(u));
}

// NaN keys (bad rows only) rank first, as torch.sort(descending=True) puts them; the keys of a
// good row are below log(-log(1 - 2^-53)) + 0 < 37, never +inf.
HOST_DEVICE inline double rank_key(double key) { return key != key ? INFINITY : key; }

// Frontier of one request: the k best of the M*k candidate scores by score descending (NaN
// ranked as -inf), ties by smaller index. keys/picked: scratch of k entries.
HOST_DEVICE inline void select_frontier(const float* scores, int64_t num_candidates, int64_t k, float* keys,
                                        int64_t* picked, int32_t* frontier) {
  int64_t count = 0;
  for (int64_t c = 0; c < num_candidates; ++c) push_top_k(keys, picked, count, k, nan_as_neg_inf(scores[c]), c);
  for (int64_t r = 0; r < k; ++r) frontier[r] = static_cast<int32_t>(picked[r]);
}

}  // namespace draft_expand
}  // namespace eagle
