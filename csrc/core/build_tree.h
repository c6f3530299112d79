// build_tree core: EAGLE-2 re-ranking of the candidate history into a verify tree.
//
// Torch-free and HOST_DEVICE so the CPU launcher (csrc/cpu/build_tree.cpp) and the CUDA
// kernel (csrc/cuda/build_tree.cu) run the same code. All functions work on one request:
// pointers are already offset to request b. Three phases, each parallel over its index and
// separated by a barrier:
//   0. rank_key          (over c in [0, C)): key = score, NaN -> -inf.
//   1. select_candidate  (over c in [0, C)): rank < N - 1, rank by counting keys, O(C).
//   2. place_candidate   (over c in [0, C)): node = 1 + #selected d < c, write token/parent.
//   3. fill_depth_mask   (over i in [0, N)): walk the ancestors, O(depth + W).
// No phase needs a sort or a serial scan, so the CUDA kernel keeps every thread busy.
#pragma once

#include "core/common.h"

namespace eagle {
namespace build_tree {

// Ranking key of the contract: score descending with NaN as -inf, then index ascending.
HOST_DEVICE inline bool ranks_before(float score_a, int64_t a, float score_b, int64_t b) {
  const float sa = nan_as_neg_inf(score_a);
  const float sb = nan_as_neg_inf(score_b);
  return sa > sb || (sa == sb && a < b);
}

// Ranking key of a score: NaN becomes -inf. Phase 1 works on keys, so its comparisons are
// plain float compares that vectorise (and agree with ranks_before).
HOST_DEVICE inline float rank_key(float score) { return nan_as_neg_inf(score); }

// Number of candidates ranked before c, counting from d = begin to end (exclusive). Ties rank
// by index: an equal key counts when d < c. Two branch-free loops so compilers vectorise them.
HOST_DEVICE inline int64_t count_better(const float* keys, int64_t begin, int64_t end, int64_t c) {
  const float kc = keys[c];
  int64_t better = 0;
  const int64_t split = c < begin ? begin : (c > end ? end : c);
  for (int64_t d = begin; d < split; ++d) better += keys[d] >= kc ? 1 : 0;
  for (int64_t d = split; d < end; ++d) better += keys[d] > kc ? 1 : 0;
  return better;
}

// Rank of candidate c among all C candidates (0 = best).
HOST_DEVICE inline int64_t candidate_rank(const float* keys, int64_t C, int64_t c) {
  return count_better(keys, 0, C, c);
}

// Phase 1: candidate c is a draft node iff its rank is < num_select (= N - 1). Counts in
// chunks and stops once num_select better candidates are seen, so low-ranked candidates cost
// O(num_select * C / rank) instead of O(C).
HOST_DEVICE inline bool select_candidate(const float* keys, int64_t C, int64_t c, int64_t num_select) {
  constexpr int64_t kChunk = 256;
  int64_t better = 0;
  for (int64_t begin = 0; begin < C; begin += kChunk) {
    better += count_better(keys, begin, begin + kChunk < C ? begin + kChunk : C, c);
    if (better >= num_select) return false;
  }
  return true;
}

// Node index of a selected candidate c: root is node 0, then selected candidates in
// increasing candidate index.
HOST_DEVICE inline int64_t node_of(const uint8_t* selected, int64_t c) {
  int64_t node = 1;
  for (int64_t d = 0; d < c; ++d) node += selected[d];
  return node;
}

// Node index of the parent of selected candidate c (node `node`). Validated inputs always
// have a selected parent p < c; the clamps only keep unvalidated input (CUDA path, which
// does not read values on the host) memory-safe and parents[i] < i, so phase 3 terminates.
HOST_DEVICE inline int32_t parent_node(const uint8_t* selected, const int32_t* cand_parents, int64_t c, int64_t node) {
  const int64_t p = cand_parents[c];
  if (p < 0 || p >= c) return 0;
  int64_t pn = node_of(selected, p);
  if (pn >= node) pn = node - 1;
  return static_cast<int32_t>(pn);
}

// Phase 2 for candidate c (no-op when not selected). Node 0 is written by place_root.
HOST_DEVICE inline void place_candidate(const uint8_t* selected, const int64_t* cand_tokens,
                                        const int32_t* cand_parents, int64_t c, int64_t* tokens, int32_t* parents) {
  if (!selected[c]) return;
  const int64_t node = node_of(selected, c);
  tokens[node] = cand_tokens[c];
  parents[node] = parent_node(selected, cand_parents, c, node);
}

HOST_DEVICE inline void place_root(int64_t root_token, int64_t* tokens, int32_t* parents) {
  tokens[0] = root_token;
  parents[0] = -1;
}

// Phase 3 for node i: depth and mask row (W = mask_words(N) words). Needs parents[j] < j for
// every j >= 1 on the path, which phase 2 guarantees.
HOST_DEVICE inline void fill_depth_mask(const int32_t* parents, int64_t N, int64_t i, int32_t* depths,
                                        int64_t* mask_row) {
  const int64_t W = mask_words(N);
  for (int64_t w = 0; w < W; ++w) mask_row[w] = 0;
  int32_t depth = 0;
  int64_t j = i;
  for (;;) {
    // Build the bit in unsigned arithmetic: 1 << 63 is undefined for signed int64.
    mask_row[j >> 6] = static_cast<int64_t>(static_cast<uint64_t>(mask_row[j >> 6]) | (uint64_t{1} << (j & 63)));
    if (j == 0) break;
    j = parents[j];
    ++depth;
  }
  depths[i] = depth;
}

}  // namespace build_tree
}  // namespace eagle
