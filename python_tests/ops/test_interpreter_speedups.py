"""The interpreter speed-ups of eagle_kernels/triton/_interpreter.py change no result: reductions
and scans with user combine functions (NaN-keeping max, xor, an (value, index) pair, a branchy
combine left to the element loop) and ``tl.sort`` give the same bits vectorised as element by
element, and helper calls inside a launch still see the interpreted language."""

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
