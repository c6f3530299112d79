// CPU launcher of build_tree: validate -> make contiguous -> allocate -> three parallel phases
// of the shared core (csrc/core/build_tree.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#include "checks.h"
#include "core/build_tree.h"
#include "ops.h"

namespace eagle {
namespace {

namespace core = build_tree;

// Target work per parallel_for chunk, in inner-loop iterations.
constexpr int64_t kWorkPerChunk = 1 << 15;

int64_t grain_for(int64_t cost_per_item) {
  return std::max<int64_t>(1, kWorkPerChunk / std::max<int64_t>(1, cost_per_item));
}

// The contract's own preconditions, read on the host: parents precede children, and no
// candidate outscores its parent (so the top N-1 always contain their ancestors).
void check_build_tree_values(const at::Tensor& scores, const at::Tensor& parents, int64_t B, int64_t C) {
  const float* s = scores.data_ptr<float>();
  const int32_t* par = parents.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t c = 0; c < C; ++c) {
      const int64_t p = par[b * C + c];
      TORCH_CHECK_VALUE(p >= -1 && p < c,
                        "build_tree: cand_parents: expected -1 <= cand_parents[b, c] < c "
                        "(a parent precedes its child), got cand_parents[",
                        b, ", ", c, "] = ", p);
      if (p >= 0) {
        const float sc = s[b * C + c];
        const float sp = s[b * C + p];
        TORCH_CHECK_VALUE(!core::ranks_before(sc, c, sp, p),
                          "build_tree: cand_scores: expected no candidate to outscore its "
                          "parent (NaN ranks as -inf), got cand_scores[",
                          b, ", ", c, "] = ", sc, " > cand_scores[", b, ", ", p, "] = ", sp, " with cand_parents[", b,
                          ", ", c, "] = ", p);
      }
    }
  }
}

}  // namespace

TreeTensors build_tree_cpu(const at::Tensor& root_tokens, const at::Tensor& cand_tokens, const at::Tensor& cand_scores,
                           const at::Tensor& cand_parents, int64_t num_nodes) {
  const BuildTreeDims d = check_build_tree_args(root_tokens, cand_tokens, cand_scores, cand_parents, num_nodes);
  TORCH_CHECK_VALUE(cand_tokens.device().is_cpu(), "build_tree: cand_tokens: expected device ", "cpu, got ",
                    cand_tokens.device());
  const int64_t B = d.B, C = d.C, N = d.N, W = mask_words(N);

  const at::Tensor root = root_tokens.contiguous();
  const at::Tensor ctok = cand_tokens.contiguous();
  const at::Tensor cscore = cand_scores.contiguous();
  const at::Tensor cpar = cand_parents.contiguous();
  check_build_tree_values(cscore, cpar, B, C);

  const auto opts = root.options();
  at::Tensor tokens = at::empty({B, N}, opts.dtype(at::kLong));
  at::Tensor parents = at::empty({B, N}, opts.dtype(at::kInt));
  at::Tensor depths = at::empty({B, N}, opts.dtype(at::kInt));
  at::Tensor mask = at::empty({B, N, W}, opts.dtype(at::kLong));
  at::Tensor selected = at::empty({B, C}, opts.dtype(at::kByte));
  at::Tensor keys = at::empty({B, C}, opts.dtype(at::kFloat));

  const int64_t* root_p = root.data_ptr<int64_t>();
  const int64_t* ctok_p = ctok.data_ptr<int64_t>();
  const float* score_p = cscore.data_ptr<float>();
  const int32_t* cpar_p = cpar.data_ptr<int32_t>();
  int64_t* tok_p = tokens.data_ptr<int64_t>();
  int32_t* par_p = parents.data_ptr<int32_t>();
  int32_t* dep_p = depths.data_ptr<int32_t>();
  int64_t* mask_p = mask.data_ptr<int64_t>();
  uint8_t* sel_p = selected.data_ptr<uint8_t>();
  float* key_p = keys.data_ptr<float>();

  // Phase 0: ranking keys.
  for (int64_t k = 0; k < B * C; ++k) key_p[k] = core::rank_key(score_p[k]);
  // Phase 1: selection, O(C) per candidate.
  at::parallel_for(0, B * C, grain_for(C), [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t b = k / C, c = k % C;
      sel_p[k] = core::select_candidate(key_p + b * C, C, c, N - 1) ? 1 : 0;
    }
  });
  // Phase 2: node placement, O(C) per candidate.
  at::parallel_for(0, B * C, grain_for(C), [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t b = k / C, c = k % C;
      core::place_candidate(sel_p + b * C, ctok_p + b * C, cpar_p + b * C, c, tok_p + b * N, par_p + b * N);
    }
  });
  for (int64_t b = 0; b < B; ++b) core::place_root(root_p[b], tok_p + b * N, par_p + b * N);
  // Phase 3: depth and mask, O(depth + W) per node.
  at::parallel_for(0, B * N, grain_for(W + 8), [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t b = k / N, i = k % N;
      core::fill_depth_mask(par_p + b * N, N, i, dep_p + b * N, mask_p + k * W);
    }
  });
  return {tokens, parents, depths, mask};
}

}  // namespace eagle
