// csrc/cpu/simd.h: the exp / exp2 accuracy and range documented in simd_exp.inc, bit-identical
// lanes across vector widths, and the EAGLE_KERNELS_CPU_ISA vocabulary. Vector checks run for
// the widths this CPU has.
#include "cpu/simd.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "check.h"

namespace {

using eagle::isa::Level;

uint32_t bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

// Distance in representable floats between two non-negative floats.
int64_t ulps(float a, float b) { return std::llabs(static_cast<int64_t>(bits(a)) - static_cast<int64_t>(bits(b))); }

// Arguments from 0 down to -130: a dense sweep, the clamp edges, -inf and NaN.
std::vector<float> arguments() {
  std::vector<float> xs;
  for (float x = 0.0f; x > -130.0f; x -= 0.00731f) xs.push_back(x);
  for (float x : {-0.0f, -1e-30f, -87.3f, -87.33f, -87.7f, -88.0f, -103.9f, -104.0f, -126.0f, -126.6f, -127.0f})
    xs.push_back(x);
  xs.push_back(-std::numeric_limits<float>::infinity());
  xs.push_back(std::numeric_limits<float>::quiet_NaN());
  while (xs.size() % 16 != 0) xs.push_back(-1.0f);
  return xs;
}

void test_exp_accuracy_and_range() {
  int bad = 0;
  for (float x : arguments()) {
    const float got = eagle::simd::scalar::exp_nonpositive<false>(x);
    if (std::isnan(x) || x < -87.7f) {
      bad += got != 0.0f;  // -inf, NaN and the clamp give +0
    } else if (x >= -87.3f) {
      bad += ulps(got, static_cast<float>(std::exp(static_cast<double>(x)))) > 2;
    }
  }
  EXPECT_EQ(bad, 0);
}

using VecFn = void (*)(const float*, float*, size_t);

// out = f(in) through one vector width, 16 floats at a time.
#if EAGLE_X86_SIMD
EAGLE_TARGET_AVX2 void exp_avx2_unfused(const float* in, float* out, size_t n) {
  for (size_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(out + i, eagle::simd::avx2::exp_nonpositive<false>(_mm256_loadu_ps(in + i)));
}
EAGLE_TARGET_AVX2 void exp_avx2_fused(const float* in, float* out, size_t n) {
  for (size_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(out + i, eagle::simd::avx2::exp_nonpositive<true>(_mm256_loadu_ps(in + i)));
}
EAGLE_TARGET_AVX2 void exp2_avx2(const float* in, float* out, size_t n) {
  for (size_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(out + i, eagle::simd::avx2::exp2_nonpositive<true>(_mm256_loadu_ps(in + i)));
}
EAGLE_TARGET_AVX512 void exp_avx512_unfused(const float* in, float* out, size_t n) {
  for (size_t i = 0; i < n; i += 16)
    _mm512_storeu_ps(out + i, eagle::simd::avx512::exp_nonpositive<false>(_mm512_loadu_ps(in + i)));
}
EAGLE_TARGET_AVX512 void exp_avx512_fused(const float* in, float* out, size_t n) {
  for (size_t i = 0; i < n; i += 16)
    _mm512_storeu_ps(out + i, eagle::simd::avx512::exp_nonpositive<true>(_mm512_loadu_ps(in + i)));
}
EAGLE_TARGET_AVX512 void exp2_avx512(const float* in, float* out, size_t n) {
  for (size_t i = 0; i < n; i += 16)
    _mm512_storeu_ps(out + i, eagle::simd::avx512::exp2_nonpositive<true>(_mm512_loadu_ps(in + i)));
}
#endif

std::vector<float> apply(VecFn f, const std::vector<float>& xs) {
  std::vector<float> out(xs.size());
  f(xs.data(), out.data(), xs.size());
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void test_vector_lanes() {
#if EAGLE_X86_SIMD
  const Level cpu = eagle::isa::cpu_level();
  if (cpu < Level::kAvx2) return;
  const std::vector<float> xs = arguments();
  std::vector<float> scalar(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) scalar[i] = eagle::simd::scalar::exp_nonpositive<false>(xs[i]);
  // Unfused: every width gives the portable lanes' bits (verify's variants rely on it).
  EXPECT(same_bits(apply(exp_avx2_unfused, xs), scalar));
  // Fused: within the documented accuracy, +0 past the clamp.
  const std::vector<float> fused = apply(exp_avx2_fused, xs), two = apply(exp2_avx2, xs);
  int bad = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const double x = xs[i];
    if (std::isnan(x) || x < -87.7) {
      bad += fused[i] != 0.0f;
    } else if (x >= -87.3) {
      bad += ulps(fused[i], static_cast<float>(std::exp(x))) > 2;
    }
    if (std::isnan(x) || x < -126.5) {
      bad += two[i] != 0.0f;
    } else if (x >= -125.5) {
      bad += ulps(two[i], static_cast<float>(std::exp2(x))) > 2;
    }
  }
  EXPECT_EQ(bad, 0);
  if (cpu < Level::kAvx512) return;
  EXPECT(same_bits(apply(exp_avx512_unfused, xs), scalar));
  EXPECT(same_bits(apply(exp_avx512_fused, xs), fused));
  EXPECT(same_bits(apply(exp2_avx512, xs), two));
#endif
}

void set_env(const char* value) {
  if (value == nullptr) {
    unsetenv("EAGLE_KERNELS_CPU_ISA");
  } else {
    setenv("EAGLE_KERNELS_CPU_ISA", value, 1);
  }
}

void test_vocabulary() {
  const Level cpu = eagle::isa::cpu_level();
  EXPECT(cpu != Level::kAvx512Ymm);  // a cap, not a CPU
  const char* names[] = {"scalar", "avx2", "avx512-ymm", "avx512", "avx512-bf16"};
  for (int i = 0; i < 5; ++i) {
    set_env(names[i]);
    const Level cap = static_cast<Level>(i);
    EXPECT(eagle::isa::env_cap() == cap);
    EXPECT(eagle::isa::current() == (cap < cpu ? cap : cpu));
    EXPECT(std::strcmp(eagle::isa::level_name(cap), names[i]) == 0);
  }
  set_env("portable");
  EXPECT(eagle::isa::current() == Level::kScalar);
  for (const char* none : {"", "native"}) {
    set_env(none);
    EXPECT(eagle::isa::current() == cpu);
  }
  set_env(nullptr);
  EXPECT(eagle::isa::current() == cpu);
  set_env("avx512f");
  bool raised = false;
  try {
    eagle::isa::current();
  } catch (const c10::ValueError& e) {
    raised = std::strstr(e.what(), "EAGLE_KERNELS_CPU_ISA") != nullptr && std::strstr(e.what(), "'avx512f'") != nullptr;
  }
  EXPECT(raised);
  set_env(nullptr);
}

}  // namespace

int main() {
  RUN(test_exp_accuracy_and_range);
  RUN(test_vector_lanes);
  RUN(test_vocabulary);
  TEST_MAIN_END();
}
