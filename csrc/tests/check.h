// Minimal in-house test macros for the C++ unit tests (no external framework, no network).
#pragma once

#include <cstdio>

namespace eagle_test {
inline int& failures() {
  static int n = 0;
  return n;
}
}  // namespace eagle_test

#define EXPECT(cond)                                                                 \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "%s:%d: EXPECT failed: %s\n", __FILE__, __LINE__, #cond); \
      ++eagle_test::failures();                                                      \
    }                                                                                \
  } while (0)

#define EXPECT_EQ(a, b)                                                                                      \
  do {                                                                                                       \
    const auto va_ = (a);                                                                                    \
    const auto vb_ = (b);                                                                                    \
    if (!(va_ == vb_)) {                                                                                     \
      std::fprintf(stderr, "%s:%d: EXPECT_EQ failed: %s == %s (%lld vs %lld)\n", __FILE__, __LINE__, #a, #b, \
                   static_cast<long long>(va_), static_cast<long long>(vb_));                                \
      ++eagle_test::failures();                                                                              \
    }                                                                                                        \
  } while (0)

#define RUN(test)                                                                       \
  do {                                                                                  \
    const int before_ = eagle_test::failures();                                         \
    test();                                                                             \
    std::printf("%s %s\n", eagle_test::failures() == before_ ? "PASS" : "FAIL", #test); \
  } while (0)

#define TEST_MAIN_END()                                   \
  std::printf("%d failure(s)\n", eagle_test::failures()); \
  return eagle_test::failures() == 0 ? 0 : 1
