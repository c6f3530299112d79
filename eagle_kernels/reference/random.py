"""The counter-based random stream of ``verify``, in plain torch integer ops.

Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
SC'11) with the Random123 constants. Every 32-bit word is held in an int64 tensor in
``[0, 2**32)``; products of two words are split into 16-bit halves so that no intermediate
leaves the int64 range. The C++ and Triton paths implement the same function with native
unsigned arithmetic and must agree bit for bit (docs/design.md, "Counter-based random stream").

Stream layout:
    key     = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
    counter = (offset & 0xFFFFFFFF, (offset >> 32) & 0xFFFFFFFF, node, draw)
    U       = ((w0 >> 5) * 2**26 + (w1 >> 6)) * 2**-53        (float64, in [0, 1))
with ``draw`` = ACCEPT_DRAW for the coin deciding whether node ``node`` is accepted,
BONUS_DRAW for the coin sampling the bonus token at node ``node``, and COUPLED_DRAW for coupled
sampling's exponential race (``offset`` = a sequence position, ``node`` = a token id).
"""

from __future__ import annotations

import torch

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

ACCEPT_DRAW = 0
BONUS_DRAW = 1
# Coupled sampling: U at (seed, offset = a token's sequence position, node = token id, this draw). Every tree
# node and step that predicts one position reads the same numbers (docs/design.md).
COUPLED_DRAW = 0xFFFFFFFF

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product ``a * b`` of two 32-bit words."""
    a_hi, a_lo = a >> 16, a & _MASK16
    low_part = b * a_lo  # < 2**48
    high_part = b * a_hi  # < 2**48, weighs 2**16
    # a * b = high_part * 2**16 + low_part; fold low_part's upper 32 bits into high_part.
    hi = (high_part + (low_part >> 16)) >> 16
    lo = (((high_part & _MASK16) << 16) + low_part) & _MASK32
    return hi, lo


def philox4x32(counter, key):
    """Philox4x32-10 of int64 tensors holding 32-bit words.

    counter: four broadcastable tensors (c0, c1, c2, c3); key: two tensors (k0, k1).
    Returns the four output words.
    """
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _MASK32 for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) & _MASK32 for k in key)
    for round_index in range(PHILOX_ROUNDS):
        if round_index > 0:
            k0 = (k0 + PHILOX_W0) & _MASK32
            k1 = (k1 + PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def uniform(seed, offset, node, draw) -> torch.Tensor:
    """Uniform float64 in [0, 1) for each broadcast (seed, offset, node, draw).

    seed, offset: int64 (any value, read as 64-bit two's complement); node, draw: non-negative
    ints below 2**32.
    """
    seed = torch.as_tensor(seed, dtype=torch.int64)
    offset = torch.as_tensor(offset, dtype=torch.int64)
    # Arithmetic shift then mask gives the two's-complement words of negative values too.
    key = (seed & _MASK32, (seed >> 32) & _MASK32)
    counter = (offset & _MASK32, (offset >> 32) & _MASK32, node, draw)
    w0, w1, _, _ = philox4x32(counter, key)
    bits53 = (w0 >> 5) * (1 << 26) + (w1 >> 6)
    return bits53.to(torch.float64) * (2.0 ** -53)
