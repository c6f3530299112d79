// Unit tests of the torch-free verify core: Philox4x32-10 known answers (Random123), the
// uniform's bit layout, order keys, the radix-select thresholds of the top-k / top-p filters
// against brute force, and the inverse-CDF draw.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/philox.h"
#include "core/verify.h"
#include "tests/check.h"

namespace ph = eagle::philox;
namespace vf = eagle::verify;

namespace {

void test_philox_known_answers() {
  const ph::Words zeros = ph::philox4x32_10(0, 0, 0, 0, 0, 0);
  const uint32_t want0[4] = {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u};
  const uint32_t m = 0xffffffffu;
  const ph::Words ones = ph::philox4x32_10(m, m, m, m, m, m);
  const uint32_t want1[4] = {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu};
  const ph::Words pi = ph::philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  const uint32_t want2[4] = {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(zeros.w[i], want0[i]);
    EXPECT_EQ(ones.w[i], want1[i]);
    EXPECT_EQ(pi.w[i], want2[i]);
  }
}

void test_uniform_layout() {
  const int64_t seeds[] = {0, -1, 7, INT64_MIN, 123456789012};
  const int64_t offsets[] = {0, 1LL << 32, 3, -7, INT64_MAX};
  for (int i = 0; i < 5; ++i) {
    const uint64_t s = static_cast<uint64_t>(seeds[i]), o = static_cast<uint64_t>(offsets[i]);
    const ph::Words r = ph::philox4x32_10(uint32_t(o), uint32_t(o >> 32), 5, 1, uint32_t(s), uint32_t(s >> 32));
    const double want = (double(r.w[0] >> 5) * 67108864.0 + double(r.w[1] >> 6)) / 9007199254740992.0;
    const double u = ph::uniform(seeds[i], offsets[i], 5, 1);
    EXPECT(u == want);
    EXPECT(u >= 0.0 && u < 1.0);
  }
  EXPECT(ph::uniform(-1, 0, 3, 0) != ph::uniform(1, 0, 3, 0));
}

void test_order_keys() {
  const float v[] = {-INFINITY, -3.5f, -1e-40f, -0.0f, 0.0f, 1e-40f, 2.0f, INFINITY};
  for (int i = 0; i + 1 < 8; ++i) {
    if (v[i] == v[i + 1]) {
      EXPECT(vf::order_key<float>(v[i]) == vf::order_key<float>(v[i + 1]));  // -0 == +0
    } else {
      EXPECT(vf::order_key<float>(v[i]) < vf::order_key<float>(v[i + 1]));
    }
    EXPECT(vf::key_value<float>(vf::order_key<float>(v[i])) == v[i]);
  }
  EXPECT(vf::order_key<double>(-2.0) < vf::order_key<double>(1e-300));
}

// keep x iff fewer than k values are strictly larger / iff the mass strictly above is < top_p
template <typename C>
void check_thresholds(const std::vector<C>& x, std::mt19937& rng) {
  using K = typename vf::KeyOf<C>::type;
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<K> keys(n), scratch(n);
  for (int64_t i = 0; i < n; ++i) keys[i] = vf::order_key<C>(x[i]);
  for (int64_t k = 1; k <= n; k += 1 + static_cast<int64_t>(rng() % 5)) {
    const K t = vf::kth_largest_key<K>(keys.data(), n, k, scratch.data());
    for (int64_t i = 0; i < n; ++i) {
      int64_t larger = 0;
      for (int64_t j = 0; j < n; ++j) larger += x[j] > x[i];
      EXPECT((larger < k) == (keys[i] >= t));
    }
  }
  // probabilities: |x| normalised
  std::vector<C> p(n);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += std::fabs(static_cast<double>(x[i]));
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<C>(std::fabs(static_cast<double>(x[i])) / sum);
  for (int64_t i = 0; i < n; ++i) keys[i] = vf::order_key<C>(p[i]);
  const double top_ps[] = {1e-6, 0.1, 0.35, 0.5, 0.9, 0.999999};
  for (double top_p : top_ps) {
    const K t = vf::top_p_threshold_key<C>(keys.data(), n, top_p, scratch.data());
    for (int64_t i = 0; i < n; ++i) {
      double above = 0.0;
      for (int64_t j = 0; j < n; ++j) above += p[j] > p[i] ? static_cast<double>(p[j]) : 0.0;
      if (std::fabs(above - top_p) > 1e-9) EXPECT((above < top_p) == (keys[i] >= t));
    }
  }
}

void test_thresholds_brute_force() {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t n = 1 + rng() % 300;
    std::vector<float> xf(n);
    std::vector<double> xd(n);
    for (int64_t i = 0; i < n; ++i) {
      // few distinct values (many ties), mixed signs, some zeros
      const int level = static_cast<int>(rng() % (trial % 3 == 0 ? 4 : 1000)) - 2;
      xf[i] = static_cast<float>(level) * 0.37f;
      xd[i] = static_cast<double>(level) * 0.37 + (trial % 2 ? 1e-300 : 0.0);
    }
    if (trial % 5 == 0) xf[0] = xd[0] = 1.0;  // never all zeros for the probabilities
    xf[n - 1] = 3.0f;
    xd[n - 1] = 3.0;
    check_thresholds<float>(xf, rng);
    check_thresholds<double>(xd, rng);
  }
}

void test_inverse_cdf() {
  const float w[] = {0.0f, 0.25f, 0.0f, 0.5f, 0.25f};
  EXPECT_EQ(vf::sample_inverse_cdf<float>(w, 5, 0.0), 1);
  EXPECT_EQ(vf::sample_inverse_cdf<float>(w, 5, 0.2499), 1);
  EXPECT_EQ(vf::sample_inverse_cdf<float>(w, 5, 0.25), 3);
  EXPECT_EQ(vf::sample_inverse_cdf<float>(w, 5, 0.75), 4);
  EXPECT_EQ(vf::sample_inverse_cdf<float>(w, 5, 0.9999999999), 4);
  const double zeros[] = {0.0, 0.0};
  EXPECT_EQ(vf::sample_inverse_cdf<double>(zeros, 2, 0.5), 0);
}

void test_draft_rows() {
  double S = 0.0;
  const float good[3] = {0.25f, 0.5f, 0.25f};
  EXPECT(vf::draft_row_sum(good, 3, S) && S == 1.0);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const float bad : {nan, inf, -0.125f}) {
    const float row[3] = {0.25f, bad, 0.75f};
    EXPECT(!vf::draft_row_sum(row, 3, S));
  }
  std::vector<float> wide(40, 1.0f / 40);  // 16-lane body and a tail
  EXPECT(vf::draft_row_sum(wide.data(), 40, S) && std::fabs(S - 1.0) < 1e-6);
  wide[37] += 2e-3f;  // |S - 1| > 1e-3
  EXPECT(!vf::draft_row_sum(wide.data(), 40, S));
  // d2t: draft ids 0, 1, 2 -> targets 1, 4, 2 of V = 5; out of range -> false.
  const int64_t d2t[3] = {1, 3, 0};
  int64_t inv[5];
  EXPECT(vf::invert_d2t(d2t, 3, 5, inv));
  EXPECT(inv[0] == -1 && inv[1] == 0 && inv[2] == 2 && inv[3] == -1 && inv[4] == 1);
  EXPECT(vf::draft_prob(good, 1.0, inv, 4) == 0.5 && vf::draft_prob(good, 1.0, inv, 3) == 0.0);
  EXPECT(vf::draft_prob(good, 0.5, nullptr, 1) == 1.0);
  const int64_t out_of_range[3] = {1, 3, -3};
  EXPECT(!vf::invert_d2t(out_of_range, 3, 5, inv));
}

}  // namespace

int main() {
  RUN(test_philox_known_answers);
  RUN(test_uniform_layout);
  RUN(test_order_keys);
  RUN(test_thresholds_brute_force);
  RUN(test_inverse_cdf);
  RUN(test_draft_rows);
  TEST_MAIN_END();
}
