"""The counter-based random stream of docs/design.md ("Counter-based random stream") in Triton:
Philox4x32-10 on uint32 words, shared by ``verify`` (acceptance coins and bonus draws) and
``draft_expand`` (the Gumbel draws of sampled children). Bit for bit the function of
``eagle_kernels/reference/random.py``."""

from __future__ import annotations

import triton
import triton.language as tl

PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)


@triton.jit
def _uniform(seed, offset, nodes, draw):
    """U in [0, 1) (float64, 53 bits) of the stream at (seed, offset, node, draw) for every
    entry of the int32 tensor ``nodes``; seed and offset are int64 scalars, ``draw`` a constexpr
    or a uint32 scalar (below 2**32)."""
    c2 = nodes.to(tl.uint32)
    zero = c2 * 0
    k0 = zero + (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = zero + ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = zero + (offset & 0xFFFFFFFF).to(tl.uint32)
    c1 = zero + ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c3 = zero + draw
    for round_index in tl.static_range(10):
        if round_index > 0:
            k0 = tl.add(k0, PHILOX_W0, sanitize_overflow=False)
            k1 = tl.add(k1, PHILOX_W1, sanitize_overflow=False)
        hi0 = tl.umulhi(c0, PHILOX_M0)
        lo0 = tl.mul(c0, PHILOX_M0, sanitize_overflow=False)
        hi1 = tl.umulhi(c2, PHILOX_M1)
        lo1 = tl.mul(c2, PHILOX_M1, sanitize_overflow=False)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    bits53 = ((c0 >> 5).to(tl.uint64) << 26) | (c1 >> 6).to(tl.uint64)
    return bits53.to(tl.float64) * 1.1102230246251565e-16  # 2**-53
