// Philox4x32-10 and the uniform draw of verify's counter-based random stream
// (docs/design.md, "Counter-based random stream"). Torch-free and HOST_DEVICE, so the CPU
// kernel, a CUDA kernel and the unit tests share one definition; the reference
// (eagle_kernels/reference/random.py) and the Triton kernel implement the same function.
#pragma once

#include <cstdint>

#include "common.h"

namespace eagle {
namespace philox {

// Random123 constants (Salmon et al., SC'11).
constexpr uint32_t kM0 = 0xD2511F53u;
constexpr uint32_t kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u;
constexpr uint32_t kW1 = 0xBB67AE85u;
constexpr int kRounds = 10;

// Draw indices of the (node, draw) counter words.
constexpr uint32_t kAcceptDraw = 0;  // coin deciding whether child `node` is accepted
constexpr uint32_t kBonusDraw = 1;   // coin sampling the bonus token at `node`
// Coupled sampling: U at (seed, offset = the token's sequence position, node = token id, this draw), the
// same for every tree node and step that predicts that position (docs/design.md).
constexpr uint32_t kCoupledDraw = 0xFFFFFFFFu;

struct Words {
  uint32_t w[4];
};

HOST_DEVICE inline Words philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < kRounds; ++round) {
    if (round > 0) {
      k0 += kW0;  // unsigned arithmetic wraps mod 2^32 as the generator requires
      k1 += kW1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  return Words{{c0, c1, c2, c3}};
}

// U in [0, 1) with 53 random bits: key = two's-complement words of seed, counter = (offset
// words, node, draw). Exactly representable, never rounds up to 1.
HOST_DEVICE inline double uniform(int64_t seed, int64_t offset, uint32_t node, uint32_t draw) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint64_t o = static_cast<uint64_t>(offset);
  const Words r = philox4x32_10(static_cast<uint32_t>(o), static_cast<uint32_t>(o >> 32), node, draw,
                                static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
  const uint64_t bits53 = (static_cast<uint64_t>(r.w[0] >> 5) << 26) | (r.w[1] >> 6);
  return static_cast<double>(bits53) * 0x1p-53;
}

}  // namespace philox
}  // namespace eagle
