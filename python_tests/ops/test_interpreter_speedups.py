"""The interpreter speed-ups of eagle_kernels/triton/_interpreter.py change no result: reductions
and scans with user combine functions (NaN-keeping max, xor, an (value, index) pair, a branchy
combine left to the element loop) and ``tl.sort`` give the same bits vectorised as element by
element, helper calls inside a launch still see the interpreted language, bf16 <-> fp32 shifts give
the interpreter's conversion bits, and reused block shapes are the objects Triton builds."""

import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from eagle_kernels.triton.verify_greedy import _max_nan

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="checks Triton's interpreter (TRITON_INTERPRET=1)")


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _max_with_index(a, i, b, j):
    take = (b > a) | ((b == a) & (j < i))
    return tl.where(take, b, a), tl.where(take, j, i)


@triton.jit
def _branchy_add(a, b):
    if a.dtype == tl.float32:  # a branch: the element loop keeps it
        return a + b
    return a - b


@triton.jit
def _reductions_kernel(x_ptr, bits_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr):
    rows = tl.arange(0, R)[:, None]
    cols = tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + rows * C + cols)  # [R, C] fp32 with NaNs and ties
    bits = tl.load(bits_ptr + rows * C + cols)  # [R, C] int32
    tl.store(out_ptr + tl.arange(0, R), tl.reduce(x, 1, _max_nan))
    tl.store(out_ptr + R + tl.arange(0, C), tl.reduce(x, 0, _max_nan))
    tl.store(out_ptr + R + C + tl.arange(0, R), tl.reduce(bits, 1, _xor).to(tl.float32))
    value, index = tl.reduce((x, cols + rows * 0), 1, _max_with_index)
    tl.store(out_ptr + 2 * R + C + tl.arange(0, R), value)
    tl.store(out_ptr + 3 * R + C + tl.arange(0, R), index.to(tl.float32))
    tl.store(out_ptr + 4 * R + C + tl.arange(0, R), tl.reduce(tl.where(x == x, x, 0.0), 1, _branchy_add))
    scanned = tl.associative_scan(tl.where(x == x, x, 1.0), 1, _max_nan)
    tl.store(out_ptr + 5 * R + C + rows * C + cols, scanned)
    tl.store(out_ptr + 5 * R + C + R * C + rows * C + cols, tl.sort(tl.where(x == x, x, -1.0), descending=True))
    tl.store(out_ptr + 5 * R + C + 2 * R * C, tl.reduce(tl.reshape(x, [R * C]), 0, _max_nan))


def run(vectorised: bool, x, bits):
    from triton.runtime import interpreter

    R, C = x.shape
    out = torch.full((5 * R + C + 2 * R * C + 1,), -7.0)
    reduce_, scan = interpreter.ReduceOps.generic_reduce, interpreter.ScanOps.generic_scan
    assert getattr(reduce_, "vectorised", False), "the vectorised reductions are not installed"
    if not vectorised:  # the interpreter's own element loops
        interpreter.ReduceOps.generic_reduce, interpreter.ScanOps.generic_scan = reduce_.element, scan.element
    try:
        _reductions_kernel[(1,)](x, bits, out, R, C)
    finally:
        interpreter.ReduceOps.generic_reduce, interpreter.ScanOps.generic_scan = reduce_, scan
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_vectorised_reductions_give_the_same_bits(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (8, 16), generator=gen).float() / 4  # ties
    x[1, 3] = float("nan")
    x[5, :] = float("nan")
    x[6, 7] = float("inf")
    bits = torch.randint(-2**30, 2**30, (8, 16), generator=gen, dtype=torch.int32)
    fast, slow = run(True, x, bits), run(False, x, bits)
    assert np.array_equal(fast.numpy(), slow.numpy(), equal_nan=True)
    assert bool((fast != -7).all())
    assert torch.equal(fast[8:24].isnan(), x.isnan().any(0))  # the NaN-keeping max kept them


def test_helper_calls_skip_the_repeated_swap_and_a_launch_restores_it():
    """The kernel above calls helpers (``tl.sort``'s network, the combine functions) inside a
    launch without the repeated swap; after the launch ``triton.language`` is Triton's own again."""
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "skips_repeats", False)
    x = torch.zeros(2, 4)
    run(True, x, torch.zeros(2, 4, dtype=torch.int32))
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.tensor.__add__)


def test_remembered_numpy_dtypes_are_the_interpreters():
    """The remembered map gives the original's numpy dtype for every Triton dtype, as a scalar, a
    block, a pointer and a block of pointers, after other calls have filled its table; what the
    original refuses it still refuses."""
    from triton.runtime import interpreter

    remembered = interpreter._get_np_dtype
    assert getattr(remembered, "remembered", False)
    original = remembered.original
    dtypes = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
              tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    for dtype in dtypes * 2:  # the second round reads the table
        for tt in (dtype, tl.block_type(dtype, [4, 2]), tl.pointer_type(dtype),
                   tl.block_type(tl.pointer_type(dtype), [8])):
            assert remembered(tt) == original(tt), tt
    assert remembered(tl.block_type(tl.bfloat16, [2])) == np.dtype(np.uint16)  # bf16 held as its bits
    with pytest.raises(KeyError):
        remembered(tl.void)


@triton.jit
def _int_arithmetic_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    a = tl.load(a_ptr + offs)
    b = tl.load(b_ptr + offs)
    tl.store(out_ptr + offs, (a * b + a - b) * 3)


def test_skipped_overflow_checks_change_no_result():
    """The interpreter runs without the overflow checks whose assertion it never makes (its options
    have debug off); int32 arithmetic that overflows gives the same wrapped values with the checks
    computed as without them."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    assert not builder.options.debug and not builder.options.sanitize_overflow
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-2**31, 2**31 - 1, (64,), generator=gen, dtype=torch.int32)
    b = torch.randint(-2**31, 2**31 - 1, (64,), generator=gen, dtype=torch.int32)
    skipped = torch.empty_like(a)
    _int_arithmetic_kernel[(1,)](a, b, skipped, N=64)
    saved = builder.options
    builder.options = dataclasses.replace(saved, sanitize_overflow=True)
    try:
        checked = torch.empty_like(a)
        _int_arithmetic_kernel[(1,)](a, b, checked, N=64)
    finally:
        builder.options = saved
    want = ((a.long() * b.long() + a.long() - b.long()) * 3) & 0xFFFFFFFF
    want = torch.where(want >= 2**31, want - 2**32, want).to(torch.int32)
    assert torch.equal(skipped, checked) and torch.equal(skipped, want)


def _bf16_fp32_patterns(seed: int):
    """(every bf16 bit pattern, float32 patterns: each exponent with 4,096 random significands a sign,
    the significands' edges, and NaNs whose payload is only in the bits a truncation drops)."""
    gen = np.random.default_rng(seed)
    bf16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    exponents = np.arange(256, dtype=np.uint32)[:, None] << np.uint32(23)
    random = gen.integers(0, 1 << 23, size=(256, 4096), dtype=np.uint32)
    edges = np.array([0, 1, 0x7FFF, 0x8000, 0xFFFF, 0x10000, 0x7F0000, 0x7FFFFF], dtype=np.uint32)
    fields = np.concatenate([random, np.broadcast_to(edges, (256, edges.size))], axis=1)
    fp32 = (exponents | fields).ravel()
    fp32 = np.concatenate([fp32, fp32 | np.uint32(0x80000000), np.array([0x7F800001, 0xFF80FFFF], dtype=np.uint32)])
    return bf16, fp32.view(np.float32)


def test_bfloat16_shifts_give_the_interpreters_bits():
    """bf16 <-> fp32 casts as shifts: the original conversion's bits for every bf16 pattern and for
    float32 patterns of every exponent (subnormals included: they go to the original), with and
    without a rounding mode for the upcast, in the input's shape; the shift answers every input
    without a subnormal, and fp32 -> bf16 with a rounding mode is still the original's."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    from eagle_kernels.triton._interpreter import bfloat16_shift

    fast = interpreter._convert_float
    assert getattr(fast, "shifts_bfloat16", False), "the bfloat16 shifts are not installed"
    original = fast.original
    bf16, fp32 = _bf16_fp32_patterns(0)
    for mode in (None, ir.ROUNDING_MODE.RTNE, ir.ROUNDING_MODE.RTZ):
        want = original(bf16, tl.bfloat16, tl.float32, mode)
        assert np.array_equal(fast(bf16, tl.bfloat16, tl.float32, mode), want)
        assert np.array_equal(fast(bf16.reshape(256, 256), tl.bfloat16, tl.float32, mode), want.reshape(256, 256))
    assert np.array_equal(fast(fp32, tl.float32, tl.bfloat16, None), original(fp32, tl.float32, tl.bfloat16, None))
    rtne = ir.ROUNDING_MODE.RTNE
    assert np.array_equal(fast(fp32, tl.float32, tl.bfloat16, rtne), original(fp32, tl.float32, tl.bfloat16, rtne))
    assert bfloat16_shift(fp32, tl.float32, tl.bfloat16, rtne) is None
    # The shift itself answers every input without a subnormal, with the original's bits.
    bf16_normal = bf16[((bf16 & 0x7F80) != 0) | ((bf16 & 0x7F) == 0)]
    fp32_normal = fp32[((fp32.view(np.uint32) & 0x7F800000) != 0) | ((fp32.view(np.uint32) & 0x7FFFFF) == 0)]
    for data, src, dst in ((bf16_normal, tl.bfloat16, tl.float32), (fp32_normal, tl.float32, tl.bfloat16)):
        shifted = bfloat16_shift(data, src, dst, None)
        assert shifted is not None and np.array_equal(shifted, original(data, src, dst, None))
    assert bfloat16_shift(bf16, tl.bfloat16, tl.float32, None) is None  # bf16 holds subnormals: the original's


def test_reused_block_shapes_are_tritons():
    """Block types and tensors built with the reused shapes have the values Triton's constructors
    give (shape, element count, name; a second build of the same shape, other element types), bad
    shapes still raise Triton's errors, and an interpreted kernel gives the same bits with Triton's
    own constructors."""
    core = tl.core
    patched_block, patched_tensor = core.block_type.__init__, core.tensor.__init__
    assert getattr(patched_block, "reuses_shapes", False), "the reused block shapes are not installed"

    def built(init, cls, *args):
        obj = cls.__new__(cls)
        init(obj, *args)
        return obj

    for element in (tl.float32, tl.bfloat16, tl.int1, tl.pointer_type(tl.float16)):
        for shape in ([16], [4, 32], [tl.constexpr(8), 2], [1, 1, 64]):
            for _ in range(2):  # the second build reuses the first one's
                got = built(patched_block, core.block_type, element, shape)
                want = built(patched_block.original, core.block_type, element, shape)
                assert (got.element_ty, list(got.shape), got.numel, got.name) == \
                    (want.element_ty, list(want.shape), want.numel, want.name)
                assert type(got.shape) is type(want.shape) and got == want
                t = built(patched_tensor, core.tensor, None, got)
                u = built(patched_tensor.original, core.tensor, None, want)
                assert [s.value for s in t.shape] == [s.value for s in u.shape] and t.numel.value == u.numel.value
                assert (t.type, t.dtype) == (u.type, u.dtype) and type(t.shape) is type(u.shape)
    scalar = built(patched_tensor, core.tensor, None, tl.float32)
    assert list(scalar.shape) == [] and scalar.numel.value == 1 and scalar.dtype == tl.float32
    built(patched_block, core.block_type, tl.float32, [2])  # known shapes equal to bad ones as dict keys
    built(patched_block, core.block_type, tl.float32, [1])
    for bad, error in (([3], ValueError), ([], TypeError), ([2048, 1024], ValueError), ([2.0], TypeError)):
        for _ in range(2):
            with pytest.raises(error):
                built(patched_block, core.block_type, tl.float32, bad)
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(-4, 5, (8, 16), generator=gen).float() / 4
    bits = torch.randint(-2**30, 2**30, (8, 16), generator=gen, dtype=torch.int32)
    reused = run(True, x, bits)
    core.block_type.__init__, core.tensor.__init__ = patched_block.original, patched_tensor.original
    try:
        rebuilt = run(True, x, bits)
    finally:
        core.block_type.__init__, core.tensor.__init__ = patched_block, patched_tensor
    assert np.array_equal(reused.numpy(), rebuilt.numpy(), equal_nan=True)
