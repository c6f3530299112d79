"""Which implementation of an op runs for a device, and the callables for each backend.

Backends (docs/design.md): ``reference`` (plain PyTorch), ``cpp`` (csrc/: C++ on CPU, CUDA on
GPU, reached through the registered ``torch.ops.eagle_kernels`` operator) and ``triton``
(eagle_kernels/triton/, on CPU tensors only under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

from . import _checks, _layer_checks, _types, reference
from ._schemas import ALL_OPS, LAYER_OPS, OPS

BACKENDS = ("reference", "cpp", "triton")
BACKEND_ENV = "EAGLE_KERNELS_BACKEND"

RESULT_TYPES = {
    "draft_expand": _types.DraftCandidates,
    "build_tree": _types.Tree,
    "verify": _types.VerifyOutput,
    "block_verify": _types.VerifyOutput,
    "cpu_decoder_layers": _types.DecoderLayersOutput,
    "cpu_decoder_forward": _types.DecoderForwardOutput,
    "cpu_head_forward": _types.HeadForwardOutput,
}

CHECKS = {op: getattr(_checks, f"check_{op}") for op in OPS}
CHECKS.update({op: getattr(_layer_checks, f"check_{op}") for op in LAYER_OPS})

try:
    importlib.import_module("eagle_kernels._C")  # registers the native operators

    HAS_CPP = True
    CPP_IMPORT_ERROR = None
except ImportError as error:  # no compiler at install time, or a broken build
    HAS_CPP = False
    CPP_IMPORT_ERROR = error

CPU_ISA_ENV = "EAGLE_KERNELS_CPU_ISA"
CPU_ISA_LEVELS = ("scalar", "avx2", "avx512-ymm", "avx512", "avx512-bf16")


def cpu_isa() -> str | None:
    """The instruction-set level the C++ CPU kernels run at now (docs/cpu_kernels.md): the best
    of ``CPU_ISA_LEVELS`` the CPU has, capped by ``EAGLE_KERNELS_CPU_ISA`` (read on every call, as
    the kernels read it); ``None`` without the C++ extension. Raises ``ValueError`` for a value
    of the variable outside its vocabulary, as the kernels do."""
    if not HAS_CPP:
        return None
    return importlib.import_module("eagle_kernels._C").cpu_isa()


# (op, device type) pairs served by a native kernel; filled by _registration before it adds
# the Python routing kernels to the free dispatch keys.
NATIVE_KERNELS: set[tuple[str, str]] = set()


def _device_type(device) -> str:
    return torch.device(device).type if not isinstance(device, str) or ":" in device else device


@functools.cache
def _triton_function(op: str):
    try:
        module = importlib.import_module(f"eagle_kernels.triton.{op}")
    except ImportError:  # no such kernel yet, or triton missing
        return None
    return getattr(module, op, None)


# Ops whose native CPU kernels repeat every check of _checks (metadata and values, with the same
# ValueError naming the same tensor), so the Python pass is skipped for CPU tensors: it costs
# tens of microseconds, a large share of a small tree_attention call. Their Python scalars' types
# are still tested before the call (_checks.NATIVE_SCALAR_TYPES, below).
NATIVE_VALIDATION = frozenset({"tree_attention", "write_kv", "verify", "build_tree", "compact_kv",
                               "draft_expand", "coupled_draft_logits", "cpu_linear", "cpu_decoder_layer",
                               "cpu_decoder_layers",
                               "cpu_decoder_forward", "cpu_head_forward"})


@functools.cache
def _cpp_callable(op: str):
    native = getattr(torch.ops.eagle_kernels, op)
    result_type = RESULT_TYPES.get(op)
    check = CHECKS[op]
    # Skipping the Python checks leaves the scalar arguments to the operator schema, which raises a
    # RuntimeError for a float where it takes an int and accepts numpy scalars and tensors the
    # checks reject: their types are tested here (no tensor read), and any but a plain int / float
    # runs the full check, so the native path raises the other backends' ValueError.
    scalar_types = _checks.NATIVE_SCALAR_TYPES.get(op)

    def run(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()), None)
        if op not in NATIVE_VALIDATION or not isinstance(first, torch.Tensor) or first.device.type != "cpu":
            check(*args, **kwargs)
        elif scalar_types is not None:
            try:
                plain = scalar_types(*args, **kwargs)
            except TypeError:  # an argument missing, state_layers not a list: the check raises as the reference
                plain = False
            if not plain:
                check(*args, **kwargs)
        try:
            out = native(*args, **kwargs)
        except RuntimeError as error:
            # The schema refused an argument before any kernel ran (a float where it takes a Tensor, a list
            # holding None): the op's check names it with the ValueError of the other backends.
            if _SCHEMA_MISMATCH in str(error):
                check(*args, **kwargs)
            raise
        return result_type(*out) if result_type is not None else out

    run.__name__ = f"{op}_cpp"
    return run


# What the operator schema's argument parser says when a value is not of the declared type.
_SCHEMA_MISMATCH = "Expected a value of type"


@functools.cache
def _meta_callable(op: str):
    """Meta tensors (shapes without data) go to the registered op, whose fake kernel checks the
    metadata and returns outputs of the right shapes: the reference and the native kernels read data."""
    registered = getattr(torch.ops.eagle_kernels, op)
    result_type = RESULT_TYPES.get(op)

    def run(*args, **kwargs):
        out = registered(*args, **kwargs)
        return result_type(*out) if result_type is not None else out

    run.__name__ = f"{op}_meta"
    return run


def implementation(op: str, backend: str, device) -> tuple[object, str]:
    """``(callable, "")`` for ``backend``'s implementation of ``op`` on ``device``, or
    ``(None, reason)`` when there is none."""
    if op not in ALL_OPS:
        raise ValueError(f"op: expected one of {ALL_OPS}, got {op!r}")
    device_type = _device_type(device)
    if backend == "reference":
        return getattr(reference, op), ""
    if backend == "cpp":
        if not HAS_CPP:
            return None, f"the C++ extension is not built ({CPP_IMPORT_ERROR})"
        if (op, device_type) not in NATIVE_KERNELS:
            return None, f"no native {op} kernel for {device_type} tensors yet"
        return _cpp_callable(op), ""
    if backend == "triton":
        if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return None, "triton runs CPU tensors only under TRITON_INTERPRET=1"
        fn = _triton_function(op)
        if fn is None:
            return None, f"no triton {op} kernel yet"
        return fn, ""
    raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


@functools.cache
def _warn_forced_fallback(op: str, forced: str, device_type: str, reason: str) -> None:
    warnings.warn(f"{BACKEND_ENV}={forced}: {reason}; {op} on {device_type} runs the reference",
                  stacklevel=3)


def backend_of(op: str, device) -> str:
    """Name of the backend ``eagle_kernels.<op>`` uses for tensors on ``device``."""
    device_type = _device_type(device)
    forced = os.environ.get(BACKEND_ENV, "auto")
    if forced != "auto":
        if forced not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}: expected auto or one of {BACKENDS}, got {forced!r}")
        fn, reason = implementation(op, forced, device_type)
        if fn is None:
            _warn_forced_fallback(op, forced, device_type, reason)
            return "reference"
        return forced
    preference = ("cpp", "triton") if device_type == "cuda" else ("cpp",)
    for backend in preference:
        if implementation(op, backend, device_type)[0] is not None:
            return backend
    return "reference"


# (op, device type, EAGLE_KERNELS_BACKEND, TRITON_INTERPRET) -> callable. The choice depends on
# nothing else, and resolving it costs tens of microseconds per call: as much as a small
# tree_attention kernel, and a forward pass makes dozens of such calls.
_RESOLVED: dict[tuple, object] = {}


def run(op: str, device, *args, **kwargs):
    """Run ``op`` on the backend chosen for ``device``."""
    device_type = device.type if isinstance(device, torch.device) else _device_type(device)
    key = (op, device_type, os.environ.get(BACKEND_ENV), os.environ.get("TRITON_INTERPRET"))
    fn = _RESOLVED.get(key)
    if fn is None:
        if device_type == "meta":
            fn = _meta_callable(op)
        else:
            fn, _ = implementation(op, backend_of(op, device_type), device_type)
        _RESOLVED[key] = fn
    return fn(*args, **kwargs)
