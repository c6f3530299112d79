"""The engine tests run SGLang's and vLLM's own modules on CPU, in the venv of
scripts/setup_engines_env.sh (the tests skip where the engines are not installed).

The engines import a few packages at module level that are native builds for other torch
versions or GPU-only (torchvision, tvm_ffi, sentencepiece, xgrammar, llguidance, IPython,
sgl_kernel). None of them is used by the code under test, so they are stubbed here, before the
engines are imported, and nowhere in the package. SGLang's CPU tree kernels come from
``sgl_kernel``, a source build that is not on the package index: the stub routes its tree and
cache-location functions to SGLang's own Triton kernels (its GPU/XPU paths), which run on CPU
tensors under ``TRITON_INTERPRET=1``, so "SGLang's own kernel" in these tests is SGLang's code.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types

os.environ.setdefault("TRITON_INTERPRET", "1")

STUBBED = ("IPython", "IPython.display", "tvm_ffi", "sentencepiece", "torchvision", "torchvision.io",
           "torchvision.transforms", "torchvision.transforms.functional", "torchvision.transforms.v2",
           "xgrammar", "xgrammar.structural_tag", "xgrammar.openai_tool_call_schema", "llguidance")


class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Any,), {})


class _Any(metaclass=_AnyMeta):
    """Stands for any class or value a stubbed module is asked for at import time."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Any()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):  # a field type of an engine's pydantic model
        from pydantic_core import core_schema

        return core_schema.any_schema()


def _stub(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)

    def module_getattr(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (_Any,), {})

    module.__getattr__ = module_getattr
    sys.modules[name] = module
    return module


def _sgl_kernel_stub() -> types.ModuleType:
    module = _stub("sgl_kernel")

    def build_tree_kernel_efficient_cpu(*args):
        from sglang.kernels.ops.speculative import spec_tree

        return spec_tree.sgl_build_tree_kernel_triton(*args)

    def verify_tree_greedy_cpu(*, retrive_index, retrive_next_token, retrive_next_sibling, **kwargs):
        from sglang.kernels.ops.speculative import spec_tree

        return spec_tree.verify_tree_greedy_triton(retrieve_index=retrive_index, retrieve_next_token=retrive_next_token,
                                                   retrieve_next_sibling=retrive_next_sibling, **kwargs)

    def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
        from sglang.kernels.ops.speculative import eagle
        from sglang.srt.utils import next_power_of_2

        size = accept_out_cache_loc.numel()
        eagle.fill_accept_out_cache_loc[(size,)](accept_index, out_cache_loc, accept_out_cache_loc,
                                                 next_power_of_2(size))

    def assign_extend_cache_locs_cpu(rows, window, starts, ends, out, pool_len):
        from sglang.kernels.ops.speculative import cache_locs
        from sglang.srt.utils import next_power_of_2

        bs = rows.numel()
        cache_locs.assign_extend_cache_locs[(bs,)](rows, window, starts, ends, out, pool_len, next_power_of_2(bs))

    module.fill_accept_out_cache_loc_cpu = fill_accept_out_cache_loc_cpu
    module.assign_extend_cache_locs_cpu = assign_extend_cache_locs_cpu
    module.build_tree_kernel_efficient_cpu = build_tree_kernel_efficient_cpu
    module.verify_tree_greedy_cpu = verify_tree_greedy_cpu
    return module


def _install_stubs() -> None:
    # transformers decides once, at its import, whether torchvision is there: import it before the
    # torchvision stub exists so that it keeps to its no-torchvision paths.
    import transformers  # noqa: F401
    import transformers.models.auto.image_processing_auto  # noqa: F401

    for name in STUBBED:
        if name not in sys.modules:
            _stub(name)
    if "sgl_kernel" not in sys.modules:
        _sgl_kernel_stub()
    if importlib.util.find_spec("vllm") is not None:
        # vLLM turns triton.jit into a placeholder when no GPU driver is active; its kernels are
        # real Triton code that the interpreter runs on CPU tensors, so say Triton is there
        # (before vllm.triton_utils reads the flag; SGLang imports parts of vLLM too).
        import triton
        import triton.language as tl
        import vllm.triton_utils
        import vllm.triton_utils.importing as triton_importing

        triton_importing.HAS_TRITON = vllm.triton_utils.HAS_TRITON = True
        vllm.triton_utils.triton, vllm.triton_utils.tl = triton, tl


if importlib.util.find_spec("sglang") is not None or importlib.util.find_spec("vllm") is not None:
    _install_stubs()
