"""Reference ``cpu_linear``: a linear layer without bias, fp32, bf16 or fp16 weights, fp32 output;
and the packed weight layout (``cpu_linear_pack`` / ``cpu_linear_unpack``)."""

from __future__ import annotations

import math

import torch

from .. import _checks

PACK_WIDTH = 32  # output columns per group of a packed weight


def cpu_linear_pack(weight: torch.Tensor, activations: str = "fp32") -> torch.Tensor:
    """A weight [N, K] (N a multiple of 32) in the packed layout of ``cpu_linear``: groups of 32
    output columns, each as two halves of 16 columns stored one after the other, K-major inside a
    half, ``packed[g, h, k, j] = weight[32 g + 16 h + j, k]``. Same dtype, same values; a new
    contiguous tensor [N / 32, 2, K, 16].

    With it ``cpu_linear`` runs one FMA chain per output along K, 16 output columns per vector,
    x broadcast from memory (a GEMM micro-kernel rather than dot products), and each group is two
    weight streams: at 8-12 rows of x a pass costs little more than at one row. Its results agree
    with the row-major layout's to fp32 rounding (another summation order), and are bit for bit
    the same on every ISA.

    A bf16 weight with an even K is packed in pairs of k steps instead, 5-D [N / 32, 2, K / 2, 16, 2],
    ``packed[g, h, p, j, i] = weight[32 g + 16 h + j, 2 p + i]``: a 32-bit lane holds one column's two
    weights, which the kernel widens with a shift and a mask (cheaper than widening 16 bits at a time); the
    results are the same bits as the 4-D layout's.

    ``activations="int8"`` (quantized block rows only) packs them for 8-bit activations instead: the same
    bytes reordered so that 4 consecutive k of a column are adjacent, a 5-D [N / 32, 2, K / 32, lines, 32]
    (:func:`pack_int8_activations`), with which ``cpu_linear`` runs GGML's arithmetic.
    """
    _checks.check_cpu_linear_pack(weight, activations)
    if activations == "int8":
        return pack_int8_activations(weight)
    if weight.dtype in ROW_BLOCK_BYTES:
        return _pack_quant(weight)
    N, K = weight.shape
    half = PACK_WIDTH // 2
    if weight.dtype == torch.bfloat16 and K % 2 == 0:
        return weight.reshape(N // PACK_WIDTH, 2, half, K // 2, 2).transpose(2, 3).contiguous()
    return weight.reshape(N // PACK_WIDTH, 2, half, K).transpose(2, 3).contiguous()


def cpu_linear_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] of a packed weight [N / 32, 2, K, 16] (or bf16 pairs [N / 32, 2, K / 2, 16, 2]), or the
    block rows of a quantized packed weight (the inverse of :func:`cpu_linear_pack`)."""
    if packed.dtype in ROW_BLOCK_BYTES:
        return _unpack_quant(packed)
    if packed.dim() == 5:  # bf16 pairs
        groups, halves, pairs, half, two = packed.shape
        return packed.transpose(2, 3).reshape(groups * halves * half, pairs * two)
    groups, halves, K, half = packed.shape
    return packed.transpose(2, 3).reshape(groups * halves * half, K)


def cpu_linear(x, weight):
    """``out[..., n] = sum_k x[..., k] * weight[n, k]`` (``F.linear`` without bias), computed in
    float64 and rounded once to float32. A bf16 or fp16 weight is read as the float32 it widens
    to exactly (the kernel's zero-extend and shift by 16, or its F16C conversion).

    Shapes
    ------
    x: float32 [..., K]; weight: float32, bfloat16 or float16, [N, K] with a dense last dim or
    packed [N / 32, 2, K, 16] (bf16 with K even: [N / 32, 2, K / 2, 16, 2]; :func:`cpu_linear_pack`); or
    int8 / uint8 packed Q8_0 / Q4_1 blocks [N / 32, 2, K / 32, 544 / 320] (or [N / 32, 2, K / 32, 17 / 10, 32]
    packed for 8-bit activations);
    returns float32 [..., N].

    A quantized weight is read as its exact dequantization (:func:`dequantize` before Q4_1's rounding), and x as
    the form its kernel multiplies, dequantized exactly: 4-D weights (fp32 activations) x's integer form
    (:func:`fixed_point_activations`, each element within 2^(E - 23), E the exponent of its block's largest
    |x|), 5-D weights (8-bit activations) x's 8-bit form (:func:`quantize_activations`: GGML's arithmetic). The
    kernels compute those products' integer block sums exactly and round them once or twice per block, then sum the
    blocks in fp32: they agree with this to fp32 rounding, not bit for bit.
    """
    _checks.check_cpu_linear(x, weight)
    if weight.dtype in ROW_BLOCK_BYTES:
        if weight.dim() == 5:
            q, d = quantize_activations(x)
        else:
            q, d = fixed_point_activations(x)
        x_q = (q.double() * d.double()[..., None]).reshape(x.shape)
        d, m, qw = _split_rows(_unpack_quant(weight))
        w = d.double()[..., None] * qw.double() + (0.0 if m is None else m.double()[..., None])  # exact
        return torch.nn.functional.linear(x_q, _flat_rows(w)).to(torch.float32)
    if weight.dim() in (4, 5):  # packed (bf16 pairs: 5-D)
        weight = cpu_linear_unpack(weight)
    return torch.nn.functional.linear(x.double(), weight.double()).to(torch.float32)


# ------------------------------------------------------------------------- quantized weights
# Weight-only quantization in GGML's block formats, 32 consecutive k of one row per block:
#   Q8_0: fp16 scale d, 32 int8 quants q;             w = d * q          (34 bytes per block)
#   Q4_1: fp16 scale d, fp16 minimum m, 16 bytes of 4-bit quants, byte i holding element i in its low
#         nibble and element i + 16 in its high nibble (GGML's order); w = d * q + m   (20 bytes per block)
# A matrix [N, K] of blocks is stored as GGML stores it, row by row: int8 [N, K / 32 * 34] for Q8_0, uint8
# [N, K / 32 * 20] for Q4_1 (the dtype names the format). ``cpu_linear_pack`` turns those block rows into the
# kernels' packed layout, int8 [N / 32, 2, K / 32, 544] / uint8 [N / 32, 2, K / 32, 320] (see
# csrc/cpu/cpu_linear_blocks.h); ``cpu_linear`` takes the packed form.
QUANT_BLOCK = 32
QUANT_FORMATS = {"q8_0": torch.int8, "q4_1": torch.uint8}
ROW_BLOCK_BYTES = {torch.int8: 34, torch.uint8: 20}  # GGML block bytes (row-major block rows)
PACKED_BLOCK_BYTES = {torch.int8: 32 + 32 * 16, torch.uint8: 64 + 16 * 16}  # per block of a half of a group


def quant_format(weight: torch.Tensor) -> str | None:
    """``"q8_0"`` (int8) or ``"q4_1"`` (uint8) for quantized weights (block rows or packed), else None."""
    return {torch.int8: "q8_0", torch.uint8: "q4_1"}.get(weight.dtype)


def quant_in_features(blocks: torch.Tensor) -> int:
    """K of a block-row matrix (int8 [N, K / 32 * 34] or uint8 [N, K / 32 * 20])."""
    return blocks.shape[-1] // ROW_BLOCK_BYTES[blocks.dtype] * QUANT_BLOCK


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """[..., 1] fp32 -> [..., 2] uint8: the fp16 bits, little-endian (as GGML's files)."""
    return values.to(torch.float16).contiguous().view(torch.uint8)


def quantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """``weight`` [N, K] (K a multiple of 32, any floating dtype) in GGML's ``fmt`` blocks ("q8_0" or "q4_1")
    as block rows (see above), computed in fp32 as GGML's reference quantizers: Q8_0 ``d = amax / 127``,
    ``q = round(w / d)``; Q4_1 ``d = (max - min) / 15``, ``m = min``, ``q = min(15, trunc((w - min) / d + 0.5))``.

    Raises ``ValueError`` naming ``weight`` for a shape that does not fit the blocks, a non-finite weight, or a
    scale beyond fp16's range; ``fmt`` for an unknown format."""
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"fmt: expected one of {sorted(QUANT_FORMATS)}, got {fmt!r}")
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D floating tensor [N, K], got {_describe(weight)}")
    N, K = weight.shape
    if K % QUANT_BLOCK:
        raise ValueError(f"weight: {fmt} blocks need K (the last dim) to be a multiple of {QUANT_BLOCK}, "
                         f"got shape {tuple(weight.shape)}")
    w = weight.detach().float().reshape(N, K // QUANT_BLOCK, QUANT_BLOCK)
    if not torch.isfinite(w).all():
        raise ValueError("weight: expected finite values, got inf or nan")
    if fmt == "q8_0":
        d = w.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        v = w * inv
        tie = (v - torch.trunc(v)).abs() == 0.5  # roundf: halves away from zero (torch.round: to even)
        q = torch.where(tie, torch.trunc(v) + torch.sign(v), torch.round(v))
        d16 = d.to(torch.float16)
        if not torch.isfinite(d16).all():
            raise ValueError("weight: a Q8_0 block's scale overflows fp16 (|w| above 65504 * 127)")
        rows = torch.cat([_fp16_bytes(d), q.to(torch.int8).view(torch.uint8)], dim=-1)
        return _flat_rows(rows).view(torch.int8)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc((w - lo) * inv + 0.5), 0, 15).to(torch.uint8)
    if not (torch.isfinite(d.to(torch.float16)).all() and torch.isfinite(lo.to(torch.float16)).all()):
        raise ValueError("weight: a Q4_1 block's scale or minimum overflows fp16 (|w| above 65504)")
    qs = q[..., :16] | (q[..., 16:] << 4)
    return _flat_rows(torch.cat([_fp16_bytes(d), _fp16_bytes(lo), qs], dim=-1))


def _flat_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N, prod(...)], with the width spelled out: ``reshape(N, -1)`` fails for N = 0."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} shape {tuple(t.shape)}"


def _split_rows(blocks: torch.Tensor):
    """Block rows -> (d [N, nb] fp32, m [N, nb] fp32 or None, q [N, nb, 32] int64 in element order)."""
    N, size = blocks.shape[0], ROW_BLOCK_BYTES[blocks.dtype]
    r = blocks.contiguous().view(torch.uint8).reshape(N, blocks.shape[1] // size, size)
    d = r[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    if blocks.dtype == torch.int8:
        return d, None, r[..., 2:].contiguous().view(torch.int8).long()
    m = r[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    qs = r[..., 4:].long()
    return d, m, torch.cat([qs & 0xF, qs >> 4], dim=-1)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """The fp32 matrix [N, K] of block rows (Q8_0: ``d * q``, exact in fp32; Q4_1: ``d * q + m`` rounded once
    to fp32, as the kernel's FMA). Packed weights: unpack them first (:func:`cpu_linear_unpack`)."""
    _checks.check_quant_rows("blocks", blocks)
    d, m, q = _split_rows(blocks)
    if m is None:
        w = d[..., None] * q.float()
    else:
        w = (d[..., None].double() * q.double() + m[..., None].double()).float()  # exact in fp64, one rounding
    return _flat_rows(w)


def _pack_quant(blocks: torch.Tensor) -> torch.Tensor:
    """Block rows [N, K / 32 * bytes] -> [N / 32, 2, K / 32, bytes] in the kernels' block layout: per group of 32
    columns, half (16 columns) and block of 32 k, the 16 columns' fp16 scales (and Q4_1's fp16 minimums), then the
    quants in chunks of 64 bytes, byte ``4 j + r`` of chunk ``t`` holding column j's quant of k = 4 t + r (Q8_0: 8
    chunks of int8; Q4_1: 4 chunks, the low nibble for k = 4 t + r and the high nibble for k = 16 + 4 t + r, GGML's
    own pairing)."""
    N = blocks.shape[0]
    G, half, size = N // PACK_WIDTH, PACK_WIDTH // 2, ROW_BLOCK_BYTES[blocks.dtype]
    r = blocks.contiguous().view(torch.uint8).reshape(N, blocks.shape[1] // size, size)
    nb = r.shape[1]

    def by_column(part):  # [N, nb, P] -> [G, 2, nb, 16 * P]: column j's P bytes at j * P
        P = part.shape[-1]
        return part.reshape(G, 2, half, nb, P).permute(0, 1, 3, 2, 4).reshape(G, 2, nb, half * P)

    def chunks(part):  # [N, nb, 4 T] -> [G, 2, nb, T * 64]: byte 4 j + r of chunk t = column j's byte 4 t + r
        T = part.shape[-1] // 4
        return part.reshape(G, 2, half, nb, T, 4).permute(0, 1, 3, 4, 2, 5).reshape(G, 2, nb, T * 4 * half)

    if blocks.dtype == torch.int8:
        packed = torch.cat([by_column(r[..., 0:2]), chunks(r[..., 2:])], dim=-1)
    else:  # GGML's byte i holds element i (low nibble) and i + 16 (high): byte 4 t + r is the chunk's byte
        packed = torch.cat([by_column(r[..., 0:2]), by_column(r[..., 2:4]), chunks(r[..., 4:])], dim=-1)
    return packed.contiguous().view(blocks.dtype)


def _unpack_quant(packed: torch.Tensor) -> torch.Tensor:
    """The block rows of a packed quantized weight, 4-D or 5-D (the inverse of :func:`_pack_quant`)."""
    G, _, nb = packed.shape[:3]
    half, N = PACK_WIDTH // 2, G * PACK_WIDTH
    p = packed.contiguous().view(torch.uint8).reshape(G, 2, nb, math.prod(packed.shape[3:]))

    def from_column(part, P):
        return part.reshape(G, 2, nb, half, P).permute(0, 1, 3, 2, 4).reshape(N, nb, P)

    def from_chunks(part):
        T = part.shape[-1] // (4 * half)
        return part.reshape(G, 2, nb, T, half, 4).permute(0, 1, 4, 2, 3, 5).reshape(N, nb, T * 4)

    if packed.dtype == torch.int8:
        rows = torch.cat([from_column(p[..., :32], 2), from_chunks(p[..., 32:])], dim=-1)
    else:
        rows = torch.cat([from_column(p[..., :32], 2), from_column(p[..., 32:64], 2), from_chunks(p[..., 64:])],
                         dim=-1)
    return _flat_rows(rows).view(packed.dtype)


# ------------------------------------------------------------------------- fp32 activations
FIXED_POINT_BITS = 22  # |X| <= 2^22 in fixed_point_activations


def fixed_point_activations(x: torch.Tensor):
    """x [..., K] fp32 (K a multiple of 32) in the integer form the fp32-activation kernel for quantized weights
    multiplies (csrc/cpu/cpu_linear_quant.cpp): per block of 32, with E the exponent of the largest |x|
    (``amax = f * 2**E``, f in [0.5, 1); E = 0 for an all-zero block), ``s = 2**(E - 22)`` and
    ``X = round-half-to-even(x / s)``, so ``|X| <= 2**22`` and ``|x - s X| <= s / 2``. Returns (``X`` int64
    [..., K / 32, 32], ``s`` float32 [..., K / 32], 0 or subnormal for tiny blocks as fp32 has it); a block holding
    inf or nan gets ``s`` nan (its outputs are nan, as the fp32 kernels' are not finite)."""
    if x.shape[-1] % QUANT_BLOCK:
        raise ValueError(f"x: quantized weights need K (the last dim) to be a multiple of {QUANT_BLOCK}, "
                         f"got shape {tuple(x.shape)}")
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // QUANT_BLOCK, QUANT_BLOCK)
    finite = torch.isfinite(xb).all(-1)
    xb = torch.where(finite[..., None], xb, torch.zeros_like(xb)).double()
    _, E = torch.frexp(xb.abs().amax(-1))
    X = torch.round(torch.ldexp(xb, (FIXED_POINT_BITS - E)[..., None].double())).long()  # exact, then to even
    s = torch.ldexp(torch.ones_like(xb[..., 0]), (E - FIXED_POINT_BITS).double()).float()
    return X, torch.where(finite, s, torch.full_like(s, float("nan")))


# ------------------------------------------------------------------------- 8-bit activations
# GGML's arithmetic for quantized weights: each block of 32 elements of a row of x is quantized to int8 with
# one fp32 scale, and the kernel computes exact integer dot products per block (csrc/cpu/cpu_linear_dot.cpp).
# Each row is quantized alone, so a row's output does not depend on the other rows (batch-invariant).
DOT_LINE_BYTES = 32  # the packed layout for 8-bit activations: per block of a half, lines of 32 bytes


def quantize_activations(x: torch.Tensor):
    """x [..., K] fp32 (K a multiple of 32) as GGML's Q8 blocks, computed in fp32 as the kernel does: per block
    ``dx = amax / 127``, ``qx = round-half-to-even(x * (1 / dx))`` (0 where ``dx`` is 0). Returns (``qx`` int8
    [..., K / 32, 32], ``dx`` float32 [..., K / 32]); a block holding inf or nan gets ``dx`` nan (its outputs
    are nan, as the fp32 kernels' are not finite)."""
    if x.shape[-1] % QUANT_BLOCK:
        raise ValueError(f"x: 8-bit activations need K (the last dim) to be a multiple of {QUANT_BLOCK}, "
                         f"got shape {tuple(x.shape)}")
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // QUANT_BLOCK, QUANT_BLOCK)
    finite = torch.isfinite(xb).all(-1)
    xb = torch.where(finite[..., None], xb, torch.zeros_like(xb))
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).to(torch.int8)  # torch.round: halves to even, as the kernel's
    return q, torch.where(finite, d, torch.full_like(d, float("nan")))


def pack_int8_activations(blocks: torch.Tensor) -> torch.Tensor:
    """Block rows [N, K / 32 * bytes] (N a multiple of 32) packed for 8-bit activations: the bytes of the
    fp32-activation packing (:func:`_pack_quant`) in lines of 32, so that the 5-D shape selects GGML's arithmetic.
    Returns int8 [N / 32, 2, K / 32, 17, 32] (Q8_0) or uint8 [N / 32, 2, K / 32, 10, 32] (Q4_1)."""
    _checks.check_cpu_linear_pack(blocks, "int8")
    packed = _pack_quant(blocks)
    return packed.reshape(*packed.shape[:3], packed.shape[3] // DOT_LINE_BYTES, DOT_LINE_BYTES)


