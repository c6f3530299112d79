// isa:: of simd.h: CPU detection and the one parser of EAGLE_KERNELS_CPU_ISA.
#include "simd.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace eagle {
namespace isa {
namespace {

constexpr const char* kEnv = "EAGLE_KERNELS_CPU_ISA";

struct Spelling {
  const char* name;
  Level level;
};
// The vocabulary, in order, then the aliases (portable: the name draft_expand used for scalar).
constexpr Spelling kSpellings[] = {
    {"scalar", Level::kScalar},          {"avx2", Level::kAvx2},
    {"avx512-ymm", Level::kAvx512Ymm},   {"avx512", Level::kAvx512},
    {"avx512-bf16", Level::kAvx512Bf16}, {"portable", Level::kScalar},
    {"native", Level::kAvx512Bf16},
};

Level detect() {
#if EAGLE_X86_SIMD
  // The features of the target strings EAGLE_ISA_AVX2 / _AVX512 / _AVX512_BF16 (simd.h).
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
    return Level::kScalar;
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq")))
    return Level::kAvx2;
  return __builtin_cpu_supports("avx512bf16") ? Level::kAvx512Bf16 : Level::kAvx512;
#else
  return Level::kScalar;
#endif
}

}  // namespace

Level cpu_level() {
  static const Level level = detect();
  return level;
}

Level env_cap() {
  const char* env = std::getenv(kEnv);
  if (env == nullptr || *env == '\0') return Level::kAvx512Bf16;
  for (const Spelling& s : kSpellings)
    if (std::strcmp(env, s.name) == 0) return s.level;
  TORCH_CHECK_VALUE(false, kEnv, ": expected scalar, avx2, avx512-ymm, avx512 or avx512-bf16 (a cap on the ",
                    "instruction set; portable = scalar, native or unset = no cap), got '", env, "'");
  return Level::kScalar;  // not reached
}

Level current() { return std::min(cpu_level(), env_cap()); }

const char* level_name(Level level) {
  for (const Spelling& s : kSpellings)
    if (s.level == level) return s.name;
  return "unknown";
}

}  // namespace isa
}  // namespace eagle
