// Torch-free pieces of verify (docs/ops.md §4, docs/design.md "verify details") shared by the CPU
// kernel and a future CUDA kernel: order-preserving keys of floating-point values, the
// sorting-free threshold searches behind the top-k and top-p filters, and the inverse-CDF
// bonus draw. The random stream itself is in philox.h.
//
// Both filters keep whole ties (top-k keeps x iff fewer than k values are strictly larger;
// top-p keeps x iff the mass strictly more probable than x is below top_p), so each is a
// threshold on the value: keep x iff key(x) >= t. The threshold is found by an MSB-first radix
// select over the keys (11-bit digits), compacting the candidates after each digit, so the cost
// is O(V) plus the size of the boundary bins; no sort.
#pragma once

#include <cstdint>
#include <cstring>
#include <math.h>

#include "common.h"

namespace eagle {
namespace verify {

template <typename C>
struct KeyOf;
template <>
struct KeyOf<float> {
  using type = uint32_t;
};
template <>
struct KeyOf<double> {
  using type = uint64_t;
};

// Unsigned key with key(a) < key(b) iff a < b for non-NaN a, b. -0.0 is mapped like +0.0
// (x + 0 turns -0 into +0) because the filters compare values, and -0.0 == +0.0.
template <typename C>
HOST_DEVICE inline typename KeyOf<C>::type order_key(C x) {
  using K = typename KeyOf<C>::type;
  constexpr K kSign = K(1) << (8 * sizeof(K) - 1);
  const C canonical = x + C(0);
  K u;
  std::memcpy(&u, &canonical, sizeof(K));
  return (u & kSign) ? ~u : (u | kSign);
}

template <typename C>
HOST_DEVICE inline C key_value(typename KeyOf<C>::type key) {
  using K = typename KeyOf<C>::type;
  constexpr K kSign = K(1) << (8 * sizeof(K) - 1);
  const K u = (key & kSign) ? (key & ~kSign) : ~key;
  C x;
  std::memcpy(&x, &u, sizeof(K));
  return x;
}

// Radix digits of 11 bits, most significant first (32-bit keys: 11 + 11 + 10; the first digit
// holds sign, exponent and two mantissa bits, which spreads logits and probabilities well).
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;

// Mask of the key bits from `shift` up (the part decided once this digit is chosen).
template <typename K>
HOST_DEVICE inline K mask_from(int shift) {
  return ~K(0) << shift;
}

// Keep the candidates whose bits from `shift` up equal `prefix`. In place: dst may be src.
template <typename K>
HOST_DEVICE inline int64_t compact(const K* src, int64_t m, K prefix, int shift, K* dst) {
  const K mask = mask_from<K>(shift);
  int64_t kept = 0;
  for (int64_t i = 0; i < m; ++i) {
    if ((src[i] & mask) == prefix) dst[kept++] = src[i];
  }
  return kept;
}

// The k-th largest key counted with multiplicity (1 <= k <= n): "fewer than k keys strictly
// larger than key(x)" iff key(x) >= the result. `scratch` holds n keys.
template <typename K>
HOST_DEVICE inline K kth_largest_key(const K* keys, int64_t n, int64_t k, K* scratch) {
  const K* src = keys;
  int64_t m = n;
  K prefix = 0;
  int64_t above = 0;  // keys known to be larger than every key with the current prefix
  for (int shift = 8 * static_cast<int>(sizeof(K)); shift > 0;) {
    const int bits = shift < kDigitBits ? shift : kDigitBits;
    shift -= bits;
    const K digit_mask = (K(1) << bits) - 1;
    int32_t hist[kBins] = {0};
    for (int64_t i = 0; i < m; ++i) ++hist[(src[i] >> shift) & digit_mask];  // src all share prefix
    int d = static_cast<int>(digit_mask);
    for (; d > 0; --d) {
      if (above + hist[d] >= k) break;
      above += hist[d];
    }
    prefix |= K(d) << shift;
    if (shift > 0) {
      m = compact(src, m, prefix, shift, scratch);
      src = scratch;
    }
  }
  return prefix;
}

// The smallest key t (among the keys present) whose value v has mass strictly above it
// (sum of the values > v) below top_p; keep x iff key(x) >= t. Values are non-negative
// probabilities; masses are summed in float64. `scratch` holds n keys.
template <typename C>
HOST_DEVICE inline typename KeyOf<C>::type top_p_threshold_key(const typename KeyOf<C>::type* keys, int64_t n,
                                                               double top_p, typename KeyOf<C>::type* scratch) {
  using K = typename KeyOf<C>::type;
  const K* src = keys;
  int64_t m = n;
  K prefix = 0;
  double above = 0.0;  // mass of the values larger than every value with the current prefix
  for (int shift = 8 * static_cast<int>(sizeof(K)); shift > 0;) {
    const int bits = shift < kDigitBits ? shift : kDigitBits;
    shift -= bits;
    const K digit_mask = (K(1) << bits) - 1;
    double mass[kBins] = {0.0};
    int32_t count[kBins] = {0};
    for (int64_t i = 0; i < m; ++i) {
      const int d = static_cast<int>((src[i] >> shift) & digit_mask);
      mass[d] += static_cast<double>(key_value<C>(src[i]));
      ++count[d];
    }
    // The largest value of a bin has exactly the higher bins' mass above it; that mass grows
    // as the bin index falls, so the kept bins are the non-empty ones down to the last that
    // still passes. The first non-empty bin always passes (its mass above passed one level up).
    int chosen = static_cast<int>(digit_mask);
    double chosen_above = above, acc = above;
    for (int d = static_cast<int>(digit_mask); d >= 0; --d) {
      if (count[d] == 0) continue;
      if (!(acc < top_p)) break;
      chosen = d;
      chosen_above = acc;
      acc += mass[d];
    }
    above = chosen_above;
    prefix |= K(chosen) << shift;
    if (shift > 0) {
      m = compact(src, m, prefix, shift, scratch);
      src = scratch;
    }
  }
  return prefix;
}

// Bonus draw: the smallest x with cumsum64(w)[x] > u * sum(w), the sums sequential in token
// order in float64 (as the reference's torch.cumsum); the largest x with w[x] > 0 if rounding
// leaves none; 0 for an all-zero w (unreachable: the last child holding all the residual mass
// is accepted with probability 1).
template <typename C>
HOST_DEVICE inline int64_t sample_inverse_cdf(const C* w, int64_t n, double u) {
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += static_cast<double>(w[i]);
  const double target = u * total;
  double cum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    cum += static_cast<double>(w[i]);
    if (cum > target) return i;
  }
  for (int64_t i = n - 1; i >= 0; --i) {
    if (w[i] > C(0)) return i;
  }
  return 0;
}

// |sum(q_u) - 1| above this makes a draft row invalid (docs/ops.md §4, "Invalid draft rows").
constexpr double kDraftSumTolerance = 1e-3;

// The draft row of a node over the target vocabulary: r[t] = q[x] / S (float64) for t = x +
// d2t[x] (t = x without d2t; r is V long, zero where no draft id maps). Returns false when q is
// not a distribution: an entry NaN, infinite or negative, |S - 1| > kDraftSumTolerance (S the
// float64 sum), or a d2t target outside [0, V) (the int64 sum wraps as torch's does).
HOST_DEVICE inline bool draft_row(const float* q, int64_t Vd, const int64_t* d2t, int64_t V, double* r) {
  double total = 0.0;
  for (int64_t i = 0; i < Vd; ++i) {
    const float v = q[i];
    if (!(v >= 0.0f) || v == __builtin_huge_valf()) return false;  // NaN, negative or +inf
    total += static_cast<double>(v);
  }
  if (fabs(total - 1.0) > kDraftSumTolerance) return false;
  if (d2t == nullptr) {
    for (int64_t i = 0; i < Vd; ++i) r[i] = static_cast<double>(q[i]) / total;
    return true;
  }
  for (int64_t t = 0; t < V; ++t) r[t] = 0.0;
  for (int64_t i = 0; i < Vd; ++i) {
    const int64_t t = static_cast<int64_t>(static_cast<uint64_t>(i) + static_cast<uint64_t>(d2t[i]));
    if (t < 0 || t >= V) return false;
    r[t] = static_cast<double>(q[i]) / total;
  }
  return true;
}

}  // namespace verify
}  // namespace eagle
