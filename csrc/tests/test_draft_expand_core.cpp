// Unit tests of the torch-free draft_expand core (csrc/core/draft_expand.h).
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/draft_expand.h"
#include "tests/check.h"

namespace de = eagle::draft_expand;

namespace {

const float kInf = std::numeric_limits<float>::infinity();

// Buffer of k after pushing values in id order.
std::vector<int64_t> top_ids(const std::vector<float>& values, int64_t k) {
  std::vector<float> v(k);
  std::vector<int64_t> ids(k, -1);
  int64_t count = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(values.size()); ++i)
    de::push_top_k(v.data(), ids.data(), count, k, values[i], i);
  ids.resize(count);
  return ids;
}

void test_push_ties_by_smaller_id() {
  const auto ids = top_ids({1, 3, 3, 0, 3, 2}, 4);
  EXPECT(ids == (std::vector<int64_t>{1, 2, 4, 5}));
  // -inf entries fill the buffer in id order behind the finite ones.
  const auto tail = top_ids({-kInf, 5, -kInf, -kInf}, 3);
  EXPECT(tail == (std::vector<int64_t>{1, 0, 2}));
  // Ascending input: every entry enters, the buffer keeps the last k.
  const auto asc = top_ids({0, 1, 2, 3, 4, 5, 6}, 3);
  EXPECT(asc == (std::vector<int64_t>{6, 5, 4}));
}

void test_finish_row() {
  // Row {0, ln 3}: sum of exp(x - max) = 1/3 + 1, logp(max) = -ln(4/3).
  de::RowStats<float> s{std::log(3.0f), 1.0f / 3.0f + 1.0f, false};
  const float vals[2] = {std::log(3.0f), 0.0f};
  const int64_t ids[2] = {1, 0};
  const int64_t d2t[2] = {10, 20};
  int64_t tokens[2];
  float scores[2], logprobs[2];
  de::finish_row<float>(s, vals, ids, 2, 2, -1.0f, d2t, tokens, scores, logprobs);
  EXPECT_EQ(tokens[0], 1 + 20);
  EXPECT_EQ(tokens[1], 0 + 10);
  EXPECT(std::fabs(scores[0] - (-1.0f - std::log(4.0f / 3.0f))) < 1e-6f);
  EXPECT(std::fabs(scores[1] - (-1.0f - std::log(4.0f))) < 1e-6f);
  EXPECT(std::fabs(logprobs[0] - (-std::log(4.0f / 3.0f))) < 1e-6f);
  EXPECT(std::fabs(logprobs[1] - (-std::log(4.0f))) < 1e-6f);
}

void test_bad_rows_give_ids_in_order_and_nan() {
  const float vals[2] = {5.0f, 4.0f};
  const int64_t ids[2] = {7, 3};
  int64_t tokens[2];
  float scores[2], logprobs[2];
  for (const de::RowStats<float>& s : {de::RowStats<float>{1.0f, 1.0f, true}, de::RowStats<float>{kInf, 1.0f, false},
                                       de::RowStats<float>{-kInf, 0.0f, false}}) {
    EXPECT(de::row_is_bad(s));
    de::finish_row<float>(s, vals, ids, 2, 2, 0.0f, nullptr, tokens, scores, logprobs);
    EXPECT_EQ(tokens[0], 0);
    EXPECT_EQ(tokens[1], 1);
    EXPECT(std::isnan(scores[0]) && std::isnan(scores[1]));
    EXPECT(std::isnan(logprobs[0]) && std::isnan(logprobs[1]));
  }
}

void test_frontier_nan_as_neg_inf_ties_by_index() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> scores = {-1.0f, nan, -0.5f, -1.0f, -kInf, nan};
  std::vector<float> keys(4);
  std::vector<int64_t> picked(4);
  std::vector<int32_t> frontier(4, -1);
  de::select_frontier(scores.data(), 6, 4, keys.data(), picked.data(), frontier.data());
  EXPECT(frontier == (std::vector<int32_t>{2, 0, 3, 1}));  // NaN (-inf) ties -inf by index
}

}  // namespace

int main() {
  RUN(test_push_ties_by_smaller_id);
  RUN(test_finish_row);
  RUN(test_bad_rows_give_ids_in_order_and_nan);
  RUN(test_frontier_nan_as_neg_inf_ties_by_index);
  TEST_MAIN_END();
}
