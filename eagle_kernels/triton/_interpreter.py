"""Speed for kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), opt in: the tests and
the cost model call :func:`skip_repeated_lang_patching` before they interpret anything.

The interpreter swaps ``triton.language``'s builtins for interpreted ones when a launch starts and
swaps them back when it ends. It also repeats the whole swap (``inspect.getmembers`` over the
language, its tensor class and ``tl.math``) every time a kernel calls a ``@triton.jit`` helper,
although the launch's swap is still in place: about 1.6 ms a call. The kernels here are written
as small helpers (``_max1``, ``_sum1``, a pass over a tile) called in loops, so that repeated swap
took about 40% of an interpreted test's time (profiled on test_verify_topk_rows.py)."""

from __future__ import annotations

import triton.language as tl


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
