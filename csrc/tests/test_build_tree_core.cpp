// Unit tests of the torch-free build_tree core (csrc/core/build_tree.h).
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/build_tree.h"
#include "tests/check.h"

namespace bt = eagle::build_tree;

namespace {

struct Tree {
  std::vector<int64_t> tokens;
  std::vector<int32_t> parents, depths;
  std::vector<int64_t> mask;  // [N, W]
};

// One request, the three phases run serially (each phase is order-independent).
Tree run(int64_t root, const std::vector<int64_t>& tok, const std::vector<float>& score,
         const std::vector<int32_t>& par, int64_t N) {
  const int64_t C = static_cast<int64_t>(tok.size());
  const int64_t W = eagle::mask_words(N);
  std::vector<uint8_t> sel(C);
  std::vector<float> keys(C);
  for (int64_t c = 0; c < C; ++c) keys[c] = bt::rank_key(score[c]);
  Tree t{std::vector<int64_t>(N, -7), std::vector<int32_t>(N, -7), std::vector<int32_t>(N, -7),
         std::vector<int64_t>(N * W, -7)};
  for (int64_t c = 0; c < C; ++c) sel[c] = bt::select_candidate(keys.data(), C, c, N - 1);
  // Reverse order: placement must not depend on the order candidates are visited.
  for (int64_t c = C - 1; c >= 0; --c)
    bt::place_candidate(sel.data(), tok.data(), par.data(), c, t.tokens.data(), t.parents.data());
  bt::place_root(root, t.tokens.data(), t.parents.data());
  for (int64_t i = N - 1; i >= 0; --i)
    bt::fill_depth_mask(t.parents.data(), N, i, t.depths.data(), t.mask.data() + i * W);
  return t;
}

bool bit(const Tree& t, int64_t N, int64_t i, int64_t j) {
  const int64_t W = eagle::mask_words(N);
  return (static_cast<uint64_t>(t.mask[i * W + j / 64]) >> (j % 64)) & 1;
}

void test_ranking_ties_and_nan() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float ninf = -std::numeric_limits<float>::infinity();
  EXPECT(bt::ranks_before(1.f, 5, 0.f, 0));
  EXPECT(bt::ranks_before(1.f, 0, 1.f, 1));  // tie: smaller index first
  EXPECT(!bt::ranks_before(1.f, 1, 1.f, 0));
  EXPECT(!bt::ranks_before(1.f, 1, 1.f, 1));    // irreflexive
  EXPECT(bt::ranks_before(-1e30f, 9, nan, 0));  // NaN ranks as -inf
  EXPECT(bt::ranks_before(nan, 0, ninf, 1));    // NaN == -inf, then by index
  EXPECT(!bt::ranks_before(nan, 1, ninf, 0));
  EXPECT(bt::ranks_before(nan, 0, nan, 1));
  std::vector<float> s = {0.f, nan, 2.f, 2.f, ninf, -1.f};
  for (float& x : s) x = bt::rank_key(x);
  // Expected order: 2 (2.f), 3 (2.f), 0, 5, 1 (NaN), 4 (-inf, larger index than 1).
  const int64_t expect_rank[] = {2, 4, 0, 1, 5, 3};
  for (int64_t c = 0; c < 6; ++c) {
    EXPECT_EQ(bt::candidate_rank(s.data(), 6, c), expect_rank[c]);
    for (int64_t n = 0; n <= 6; ++n) EXPECT_EQ(bt::select_candidate(s.data(), 6, c, n), expect_rank[c] < n);
  }
  // Ranks across several 256-candidate chunks of the early-exit count agree with ranks_before.
  const int64_t C = 1000;
  std::vector<float> raw(C), keys(C);
  for (int64_t c = 0; c < C; ++c) {
    raw[c] = c % 7 == 0 ? nan : static_cast<float>((c * 37) % 101) - 50.f;  // many ties
    keys[c] = bt::rank_key(raw[c]);
  }
  bool ok = true;
  for (int64_t c = 0; c < C; ++c) {
    int64_t slow = 0;
    for (int64_t d = 0; d < C; ++d) slow += bt::ranks_before(raw[d], d, raw[c], c) ? 1 : 0;
    ok &= bt::candidate_rank(keys.data(), C, c) == slow;
    for (int64_t n : {0, 1, 255, 256, 257, 600, 999, 1000})
      ok &= bt::select_candidate(keys.data(), C, c, n) == (slow < n);
  }
  EXPECT(ok);
}

void test_small_tree() {
  // Candidates (index: token score parent): 0: 10 -0.5 -1; 1: 11 -1.0 -1; 2: 12 -0.7 0;
  // 3: 13 -2.0 1; 4: 14 -0.9 2. Top 3: 0, 2, 4 -> a chain root -> 0 -> 2 -> 4.
  const Tree t = run(7, {10, 11, 12, 13, 14}, {-0.5f, -1.0f, -0.7f, -2.0f, -0.9f}, {-1, -1, 0, 1, 2}, 4);
  const std::vector<int64_t> tokens = {7, 10, 12, 14};
  const std::vector<int32_t> parents = {-1, 0, 1, 2}, depths = {0, 1, 2, 3};
  const std::vector<int64_t> mask = {1, 3, 7, 15};
  EXPECT(t.tokens == tokens);
  EXPECT(t.parents == parents);
  EXPECT(t.depths == depths);
  EXPECT(t.mask == mask);
  // N = 5: candidate 1 joins; node order follows candidate index: 0, 1, 2, 4.
  const Tree u = run(7, {10, 11, 12, 13, 14}, {-0.5f, -1.0f, -0.7f, -2.0f, -0.9f}, {-1, -1, 0, 1, 2}, 5);
  EXPECT((u.tokens == std::vector<int64_t>{7, 10, 11, 12, 14}));
  EXPECT((u.parents == std::vector<int32_t>{-1, 0, 0, 1, 3}));
  EXPECT((u.depths == std::vector<int32_t>{0, 1, 1, 2, 3}));
  EXPECT((u.mask == std::vector<int64_t>{1, 3, 5, 11, 27}));
}

void test_root_only() {
  const Tree t = run(3, {}, {}, {}, 1);
  EXPECT_EQ(t.tokens[0], 3);
  EXPECT_EQ(t.parents[0], -1);
  EXPECT_EQ(t.depths[0], 0);
  EXPECT_EQ(t.mask[0], 1);
}

// Chain of 300 candidates, N = 256: mask rows span 4 words, bit 63 is the sign bit.
void test_chain_256() {
  const int64_t C = 300, N = 256;
  std::vector<int64_t> tok(C);
  std::vector<float> score(C);
  std::vector<int32_t> par(C);
  for (int64_t c = 0; c < C; ++c) {
    tok[c] = 1000 + c;
    score[c] = -0.01f * static_cast<float>(c);
    par[c] = static_cast<int32_t>(c - 1);
  }
  const Tree t = run(1, tok, score, par, N);
  bool ok = true;
  for (int64_t i = 0; i < N; ++i) {
    ok &= t.parents[i] == i - 1 && t.depths[i] == i && t.tokens[i] == (i ? 999 + i : 1);
    for (int64_t j = 0; j < N; ++j) ok &= bit(t, N, i, j) == (j <= i);
  }
  EXPECT(ok);
  EXPECT_EQ(t.mask[255 * 4 + 3], -1);  // all 64 bits of the last word of the last row
  EXPECT_EQ(t.mask[63 * 4 + 0], -1);
  EXPECT_EQ(t.mask[64 * 4 + 1], 1);
}

// Star of 1024 children of the root with equal scores: ties pick the lowest indices.
void test_star_ties_1024() {
  const int64_t C = 1024, N = 256;
  std::vector<int64_t> tok(C);
  std::vector<float> score(C, -1.f);
  std::vector<int32_t> par(C, -1);
  for (int64_t c = 0; c < C; ++c) tok[c] = c;
  const Tree t = run(5, tok, score, par, N);
  bool ok = true;
  for (int64_t i = 1; i < N; ++i) {
    ok &= t.tokens[i] == i - 1 && t.parents[i] == 0 && t.depths[i] == 1;
    for (int64_t j = 0; j < N; ++j) ok &= bit(t, N, i, j) == (j == 0 || j == i);
  }
  EXPECT(ok);
}

// NaN scores rank last, so with N - 1 finite candidates none of the NaN ones is picked.
void test_nan_candidates_dropped() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Tree t = run(0, {1, 2, 3, 4}, {nan, -1.f, nan, -2.f}, {-1, -1, 0, 1}, 3);
  EXPECT((t.tokens == std::vector<int64_t>{0, 2, 4}));
  EXPECT((t.parents == std::vector<int32_t>{-1, 0, 1}));
  // With room for one more, the NaN candidate with the smaller index (0) comes in.
  const Tree u = run(0, {1, 2, 3, 4}, {nan, -1.f, nan, -2.f}, {-1, -1, 0, 1}, 4);
  EXPECT((u.tokens == std::vector<int64_t>{0, 1, 2, 4}));
  EXPECT((u.parents == std::vector<int32_t>{-1, 0, 0, 2}));
}

// Malformed history (parent not selected / out of range) must still give parents[i] < i.
void test_malformed_input_is_safe() {
  const Tree t = run(0, {1, 2, 3}, {-5.f, -1.f, -0.5f}, {-1, 99, 0}, 3);
  for (int64_t i = 1; i < 3; ++i) EXPECT(t.parents[i] >= 0 && t.parents[i] < i);
}

}  // namespace

int main() {
  RUN(test_ranking_ties_and_nan);
  RUN(test_small_tree);
  RUN(test_root_only);
  RUN(test_chain_256);
  RUN(test_star_ties_1024);
  RUN(test_nan_candidates_dropped);
  RUN(test_malformed_input_is_safe);
  TEST_MAIN_END();
}
