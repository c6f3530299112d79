"""Speed for kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), opt in: the tests and
the cost model call :func:`speed_up_interpreter` before they interpret anything.

The interpreter swaps ``triton.language``'s builtins for interpreted ones when a launch starts and
swaps them back when it ends. It also repeats the whole swap (``inspect.getmembers`` over the
language, its tensor class and ``tl.math``) every time a kernel calls a ``@triton.jit`` helper,
although the launch's swap is still in place: about 1.6 ms a call. The kernels here are written
as small helpers (``_max1``, ``_sum1``, a pass over a tile) called in loops, so that repeated swap
took about 40% of an interpreted test's time (profiled on test_verify_topk_rows.py)."""

from __future__ import annotations

import triton.language as tl


def speed_up_interpreter(vectorise_reductions: bool) -> None:
    """Every speed-up below that leaves results unchanged; ``vectorise_reductions`` adds
    :func:`vectorise_generic_reductions`, which the cost model leaves out (it counts the builder
    operations a combine function makes per element)."""
    skip_repeated_lang_patching()
    cache_numpy_dtypes()
    skip_unasserted_overflow_checks()
    convert_bfloat16_by_shifts()
    reuse_block_shapes()
    if vectorise_reductions:
        vectorise_generic_reductions()


def skip_repeated_lang_patching() -> bool:
    """Make a helper call inside an interpreted launch skip the swap when every language module the
    helper sees (``tl``, ``tl.core``) is already swapped; a launch still swaps and restores as
    before. Returns whether the interpreter is one this applies to (it is left as it is if not)."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or not hasattr(tl.core, "is_builtin"):
        return False
    if getattr(original, "skips_repeats", False):
        return True

    langs_of: dict = {}  # a function's language modules (its module's globals do not change them)

    def patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        # A swapped module's ``load`` is the interpreter's wrapper, no longer a Triton builtin.
        if langs and not any(tl.core.is_builtin(getattr(lang, "load", None)) for lang in langs):
            return scope_type()  # nothing to restore: the launch's own scope restores it all
        return original(fn)

    patch_lang.skips_repeats = True
    interpreter._patch_lang = patch_lang
    return True


def cache_numpy_dtypes() -> bool:
    """Make the interpreter's map from a Triton dtype to the numpy dtype that holds its values a
    table lookup. Triton 3.9 builds a dict of all 19 dtypes at every call, and it is called for
    nearly every value an interpreted kernel makes: about a tenth of an interpreted launch's time
    (profiled on test_layer_ops.py's q8_0_linear case over 61 rows). The answers are the original
    function's, remembered per element dtype (a block holds what its element type is held in;
    every pointer is a uint64). Returns whether the interpreter is one this applies to."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or not hasattr(tl, "block_type") or not hasattr(tl, "pointer_type"):
        return False
    if getattr(original, "remembered", False):
        return True
    table: dict = {}

    def get_np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        key = None if isinstance(element, tl.pointer_type) else element.name
        found = table.get(key)
        if found is None:
            found = table[key] = original(element)  # an unknown dtype raises as before
        return found

    get_np_dtype.remembered = True
    get_np_dtype.original = original  # (tests compare them)
    interpreter._get_np_dtype = get_np_dtype
    return True


def skip_unasserted_overflow_checks() -> bool:
    """Stop the interpreter from computing integer overflow checks whose assertion it never makes.
    Triton's front end follows every 32-bit integer add, subtract and multiply with the same
    operation in int64, two comparisons and a ``device_assert``; the assertion is only emitted with
    ``debug`` on, which the interpreter's options leave off, so the checks' values are computed and
    dropped: about half of an interpreted launch's time in kernels with much index arithmetic
    (profiled on test_triton_gpu_configs.py's folded-merge tree_attention cases). With ``debug`` on
    they are kept. Returns whether the checks are now skipped."""
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or not hasattr(options, "sanitize_overflow") \
            or getattr(options, "debug", True):
        return False
    if options.sanitize_overflow:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


def convert_bfloat16_by_shifts() -> bool:
    """Make the interpreter's bfloat16 <-> float32 casts (``x.to(tl.float32)`` of a bf16 load, a
    bf16 store's ``.to(tl.bfloat16)``) bit shifts. Triton 3.9 converts them field by field (sign,
    exponent, significand; about fifteen numpy passes) for every rounding mode, truncating where no
    mode is given: a third of an interpreted bf16 GEMM's time (profiled on test_layer_ops.py's
    o_proj_mlp case over 61 rows). :func:`bfloat16_shift` gives its answer where that is a shift;
    every other conversion, and inputs with a subnormal, go to the original function. Returns
    whether the interpreter is one this applies to."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_convert_float", None)
    if original is None:
        return False
    if getattr(original, "shifts_bfloat16", False):
        return True

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        shifted = bfloat16_shift(input, input_dtype, output_dtype, rounding_mode)
        return original(input, input_dtype, output_dtype, rounding_mode) if shifted is None else shifted

    convert_float.shifts_bfloat16 = True
    convert_float.original = original  # (tests compare them)
    interpreter._convert_float = convert_float
    return True


def bfloat16_shift(input, input_dtype, output_dtype, rounding_mode):
    """The interpreter's conversion of ``input`` (numpy bits) as a shift, or None where it is not one.
    For inputs without a subnormal: bf16 -> fp32 is ``bits << 16`` whatever the rounding mode (an
    upcast has no rounding), and fp32 -> bf16 without a rounding mode is ``bits >> 16`` (truncation;
    inf and NaN included, a NaN whose payload sits in the low 16 bits becoming inf as it did). On
    subnormal inputs the interpreter's field arithmetic gives other bits, so those are left to it."""
    import numpy as np

    data = np.asarray(input)
    if input_dtype == tl.bfloat16 and output_dtype == tl.float32 and data.dtype.itemsize == 2:
        bits = data.view(np.uint16)
        if not np.any(((bits & 0x7F80) == 0) & ((bits & 0x007F) != 0)):
            return bits.astype(np.uint32) << np.uint32(16)
    elif input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode is None \
            and data.dtype.itemsize == 4:
        bits = data.view(np.uint32)
        if not np.any(((bits & 0x7F800000) == 0) & ((bits & 0x007FFFFF) != 0)):
            return (bits >> np.uint32(16)).astype(np.uint16)
    return None


# sha256 prefixes of the sources of the two constructors :func:`reuse_block_shapes` stands in for
# (triton 3.9's ``block_type.__init__`` and ``tensor.__init__``); with others it does nothing.
_BLOCK_TYPE_INIT, _TENSOR_INIT = "403f4b016ec5c2c3", "d9b043b5c9897657"


def _source_digest(fn) -> str | None:
    import hashlib
    import inspect

    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


def reuse_block_shapes() -> bool:
    """Build each block shape's Triton objects once. Every value an interpreted kernel makes is a
    ``tl.tensor`` of a ``tl.block_type``, and their constructors rebuild the shape as Triton tuples
    (one ``tl.tuple`` of ints with its type for the block type, one of ``tl.constexpr`` for the
    tensor), check it and format the type's name: about a quarter of an interpreted launch's time
    in kernels of many small operations (profiled on test_verify_topk_rows.py: 12.9 of 80 s in
    ``block_type`` alone). Now the first block type of an element type and shape is built by
    Triton's constructor and the next ones take its shape, element count and name; tensors of a
    shape share one constexpr tuple and element count. The objects are the same values as before,
    shared (Triton reads shapes; nothing in the interpreter writes to one). Installed only where
    Triton's two constructors are the ones this stands in for (their source digests above). Returns
    whether they are installed."""
    import builtins
    import math

    core = tl.core
    block_type, tensor, constexpr = core.block_type, core.tensor, core.constexpr
    if getattr(block_type.__init__, "reuses_shapes", False):
        return True
    if _source_digest(block_type.__init__) != _BLOCK_TYPE_INIT or _source_digest(tensor.__init__) != _TENSOR_INIT:
        return False
    build_block_type, build_tensor = block_type.__init__, tensor.__init__
    block_types: dict = {}  # (element type's name, dims) -> (shape, numel, name) of the first one built
    tensor_shapes: dict = {}  # dims -> (numel, shape) of a tensor

    def block_type_init(self, element_ty, shape):
        if type(shape) is list:
            dims = builtins.tuple(d.value if isinstance(d, constexpr) else d for d in shape)
            # ints only: a float 2.0 is the key 2 to a dict, and Triton refuses it
            if all(type(d) is int for d in dims):
                key = (str(element_ty), dims)
                known = block_types.get(key)
                if known is None:
                    build_block_type(self, element_ty, shape)  # checks the shape, raises as before
                    block_types[key] = (self.shape, self.numel, self.name)
                else:
                    self.element_ty = element_ty
                    self.shape, self.numel, self.name = known
                return
        build_block_type(self, element_ty, shape)

    def tensor_init(self, handle, type):
        dims = builtins.tuple(type.shape.values) if type.is_block() else ()
        known = tensor_shapes.get(dims)
        if known is None:
            known = tensor_shapes[dims] = (constexpr(math.prod(dims)), core.tuple([constexpr(d) for d in dims]))
        self.handle = handle
        self.numel, self.shape = known
        self.type = type
        self.dtype = type.scalar

    block_type_init.reuses_shapes = True
    block_type_init.original, tensor_init.original = build_block_type, build_tensor  # (tests compare them)
    block_type.__init__, tensor.__init__ = block_type_init, tensor_init
    return True


def _branch_free(combine_fn) -> bool:
    """Whether a combine function's body has no Python-level branch or loop (an ``if`` on a block
    is not elementwise in the interpreter), so applying it to whole slices is applying it to each
    element."""
    import ast
    import inspect
    import textwrap

    fn = getattr(combine_fn, "fn", combine_fn)
    cached = getattr(fn, "_eagle_branch_free", None)
    if cached is None:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            cached = not any(isinstance(node, (ast.If, ast.IfExp, ast.For, ast.While)) for node in ast.walk(tree))
        except (OSError, TypeError, SyntaxError):
            cached = False
        fn._eagle_branch_free = cached
    return cached


def vectorise_generic_reductions() -> bool:
    """Make the interpreter's reductions and scans with a user combine function (``tl.reduce`` with
    ``_max_nan``, the xor reductions of ``tl.sort``'s bitonic network, ...) call the combine
    function once per position along the reduced axis on whole slices, not once per element: the
    same left-to-right fold, element for element, with a Python call per slice instead of per
    element (``tl.sort`` of 128 entries: 7 x 7 / 2 reductions over the 2-wide axes of a hypercube
    of them). Combine functions with a Python branch or loop keep the element loop. Returns
    whether the interpreter is one this applies to."""
    import numpy as np
    from triton.runtime import interpreter

    reduce_ops = getattr(interpreter, "ReduceOps", None)
    scan_ops = getattr(interpreter, "ScanOps", None)
    if reduce_ops is None or scan_ops is None or not hasattr(reduce_ops, "generic_reduce") \
            or not hasattr(scan_ops, "generic_scan") or not hasattr(reduce_ops, "unravel"):
        return False
    if getattr(reduce_ops.generic_reduce, "vectorised", False):
        return True
    element_reduce, element_scan = reduce_ops.generic_reduce, scan_ops.generic_scan

    def combine(op, acc, values, dtypes, out_shape):
        """combine_fn(*acc, *values) on slices, each result cast back to its input's dtype (as the
        element loop stores it) and broadcast to ``out_shape``."""
        wrap = [op.to_tensor(a, d) for a, d in zip(acc, dtypes)] + [op.to_tensor(v, d) for v, d in zip(values, dtypes)]
        ret = op.combine_fn.fn(*wrap)
        ret = ret if isinstance(ret, tuple) else (ret,)
        out = []
        for r, a in zip(ret, acc):
            data = np.asarray(r.handle.data if isinstance(r, tl.core.tensor) else r)
            # A slice of a 1-D input is a scalar, which the interpreter holds as a [1] array.
            data = np.broadcast_to(data, out_shape) if out_shape else data.reshape(())
            out.append(np.array(data, dtype=a.dtype))
        return out

    def folds(op, input, axis):
        """(k, the fold of positions 0..k along ``axis``) for each k: the element loop's left fold,
        a slice at a time."""
        data = [arg.handle.data for arg in input]
        dtypes = [arg.dtype for arg in input]
        shape = data[0].shape
        out_shape = shape[:axis] + shape[axis + 1:]
        acc = [np.ascontiguousarray(np.take(d, 0, axis=axis)) for d in data]
        yield 0, acc
        for k in range(1, shape[axis]):
            values = [np.ascontiguousarray(np.take(d, k, axis=axis)) for d in data]
            acc = combine(op, acc, values, dtypes, out_shape)
            yield k, acc

    def generic_reduce(self, input):
        if not _branch_free(self.combine_fn):
            return element_reduce(self, input)
        original_axis = self.axis
        input, axis = self.unravel(input, self.axis)
        shape = input[0].handle.data.shape
        for _, acc in folds(self, input, axis):  # the last fold is the reduction
            pass
        ret = []
        for a, arg in zip(acc, input):
            if self.keep_dims:
                a = np.expand_dims(a, axis) if original_axis is not None else a.reshape((1,) * len(shape))
            elif original_axis is None:
                a = a.item()
            ret.append(self.to_tensor(a, arg.dtype))
        return ret

    def generic_scan(self, input):
        if not _branch_free(self.combine_fn):
            return element_scan(self, input)
        outs = [np.zeros_like(arg.handle.data) for arg in input]
        for k, acc in folds(self, input, self.axis):
            for o, a in zip(outs, acc):
                np.moveaxis(o, self.axis, 0)[k] = a
        return [self.to_tensor(o, arg.dtype) for o, arg in zip(outs, input)]

    generic_reduce.vectorised = True
    generic_reduce.element, generic_scan.element = element_reduce, element_scan  # (tests compare them)
    reduce_ops.generic_reduce = generic_reduce
    scan_ops.generic_scan = generic_scan
    return True
