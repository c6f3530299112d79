"""Count the kernels a decoding step launches on a GPU, by running it on CPU tensors.

A step on a GPU is launch-bound: each kernel costs a few microseconds to launch whatever it
computes, and a CUDA graph replays them with less host cost but the same number of kernels. This
module runs a step of the GPU code path on the CPU (static shapes, the GPU layer path, Triton
kernels under ``TRITON_INTERPRET=1``) and counts what a GPU would launch:

- PyTorch ops through a dispatch-level counter (``TorchDispatchMode``): one launch per aten op
  that computes, none for views and other metadata ops, allocations (``empty``) or ops with
  an empty output. (A few aten ops launch more than one kernel on a GPU, e.g. a cuBLAS GEMM
  with a split-K reduction, or sorts; those are counted as one.)
- Triton kernels through their launchers: one launch per ``kernel[grid](...)`` call. (The
  tree_attention launcher adds a merge kernel on a GPU when it splits a long prefix over
  programs, flash-decoding style, and the split blocks' partials are too many to merge in
  their last programs (``folds_merge``); on CPU tensors it never splits, so that kernel is not
  seen here.)
- The C++/CUDA ops by their known launches (``NATIVE_CUDA_LAUNCHES``: the ops a CUDA build
  registers natively, csrc/torch_bindings.cpp).

Every eagle_kernels op takes the implementation it takes on CUDA (``backend_of(op, "cuda")``:
Triton, or the native kernel), and value checks are off, as on a GPU. Use :func:`counting`
around any code, or :func:`count_steps` for decoding steps. docs/decoding.md ("Launches per
step") has the figures; ``bench/launch_count.py`` prints them.

Each launch is also recorded (:class:`Launch`, ``LaunchCount.launches``, in order): its kernel,
the layer call it belongs to, the shapes and element sizes of the tensors it is given (and, for
aten ops, returns), and for the GEMMs their FLOPs. ``bench/gpu_step_model.py`` turns these into
bytes, FLOPs and a modeled device time per launch.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _dispatch, bookkeeping

# Kernels per call of the ops a CUDA build runs natively (csrc/cuda: one kernel each).
NATIVE_CUDA_LAUNCHES = {"build_tree": 1, "compact_kv": 1}

# As on a GPU: no value checks (they read values on the host), linear layers in torch (F.linear,
# not the CPU kernel).
_ENVIRONMENT = {"EAGLE_KERNELS_CHECK_VALUES": "0", "EAGLE_KERNELS_CPU_LINEAR": "torch"}

# aten ops that launch nothing: allocation, metadata and host reads (views are found by their
# schema's ``is_view``).
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view", "alias",
              "detach", "lift_fresh", "resize_", "set_", "_local_scalar_dense", "sym_size", "sym_stride",
              "sym_numel", "is_same_size", "_reshape_alias", "expand", "as_strided", "clone_view"}


def _launches_of(func, out) -> int:
    """Kernels an aten op launches on a GPU (0 or 1, see the module docstring)."""
    name = func.__name__.split(".")[0]
    if func.is_view or name in _NO_KERNEL or torch.Tag.inplace_view in func.tags:
        return 0
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
    if tensors and all(t.numel() == 0 for t in tensors):
        return 0
    return 1


# aten GEMMs: FLOPs = 2 M N K from the operands (``mm(a, b)``, ``addmm(self, a, b)``, ``linear(x, w)``).
_GEMMS = {"mm": (0, 1, False), "addmm": (1, 2, False), "addmm_": (1, 2, False), "linear": (0, 1, True)}


@dataclass(frozen=True)
class Tensor:
    """A tensor a launch is given (``out`` False) or returns (aten ops, ``out`` True)."""

    shape: tuple
    itemsize: int
    out: bool = False

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class Launch:
    """One launch: ``name`` (as in ``LaunchCount.by_kernel``), ``kind`` ("aten", "triton" or
    "native"), ``owner`` ("target", "head" or None outside the layers) and ``layer`` (index of
    the layer call in ``LaunchCount.layers``, or -1), its ``tensors`` (:class:`Tensor`, in
    argument order, aten outputs last), ``flops`` (the GEMMs' 2 M N K, 0 otherwise) and ``pdl``
    (a Triton launch with programmatic dependent launch)."""

    name: str
    kind: str
    owner: str | None
    layer: int
    tensors: tuple
    flops: int = 0
    pdl: bool = False  # launched with programmatic dependent launch (eagle_kernels/triton/_pdl.py)


def _tensors_of(values, out: bool = False) -> list:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(Tensor(tuple(v.shape), v.element_size(), out))
        elif isinstance(v, (tuple, list)):
            found.extend(_tensors_of(v, out))
    return found


def _gemm_flops(name: str, args) -> int:
    if name not in _GEMMS:
        return 0
    a_at, b_at, transposed = _GEMMS[name]
    a, b = args[a_at], args[b_at]
    k = a.shape[-1]
    m = a.numel() // k if k else 0  # rows of the (flattened) left operand
    n = b.shape[0] if transposed else b.shape[-1]
    return 2 * m * n * k


@dataclass
class LaunchCount:
    """What :func:`counting` saw: ``total`` launches, ``by_kernel`` (name -> launches: aten op
    names, Triton kernel names, ``eagle_kernels::<op>`` for native ones), the launches of each
    decoder-layer call in order, ``layers`` (list of (owner, launches), owner "target" or
    "head"), the launches outside the layers by the source line that made them, ``by_line``,
    and the ops that would wait for the device on a GPU (a value read on the host, an output
    whose shape depends on values), ``host_reads``, by source line; ``launches``: one
    :class:`Launch` per launch, in order."""

    total: int = 0
    by_kernel: Counter = field(default_factory=Counter)
    layers: list = field(default_factory=list)
    by_line: Counter = field(default_factory=Counter)  # "file:line" of the calling code -> launches
    host_reads: Counter = field(default_factory=Counter)  # "file:line" -> ops that wait for the device
    launches: list = field(default_factory=list)  # one Launch per launch, in order
    _layer_depth: int = 0
    _layer_owner: str | None = None

    def add(self, name: str, n: int = 1, kind: str = "aten", tensors=(), flops: int = 0, pdl: bool = False) -> None:
        if n:
            self.total += n
            self.by_kernel[name] += n
            if not self._layer_depth:
                self.by_line[_caller()] += n
            layer = len(self.layers) if self._layer_depth else -1  # the layer call in progress
            owner = self._layer_owner if self._layer_depth else None
            for _ in range(n):
                self.launches.append(Launch(name, kind, owner, layer, tuple(tensors), flops, pdl))

    @property
    def pdl_edge_flags(self) -> list[bool]:
        """Per launch, whether it may start while the launch before it runs: a PDL launch after a
        Triton launch (every Triton kernel signals its dependents as it starts; a cuBLAS or
        torch kernel before a PDL launch does not, so that launch waits as without PDL)."""
        return [launch.pdl and before is not None and before.kind == "triton"
                for before, launch in zip([None] + self.launches[:-1], self.launches)]

    @property
    def pdl_edges(self) -> int:
        """How many launches are PDL edges (:attr:`pdl_edge_flags`)."""
        return sum(self.pdl_edge_flags)

    @property
    def in_layers(self) -> int:
        return sum(n for _, n in self.layers)

    @property
    def outside_layers(self) -> int:
        return self.total - self.in_layers

    def per_layer(self, owner: str) -> list[int]:
        return [n for who, n in self.layers if who == owner]


_SKIPPED_FILES = ("launch_count.py", "_dispatch.py", "ops.py", "bookkeeping.py", "_python_dispatch.py", "functional.py",
                  "_ops.py", "_tensor.py", "overrides.py", "contextlib.py")


def _caller() -> str:
    """The innermost eagle_kernels source line (outside the op plumbing and the Triton
    launchers) that led to a launch, as "package/path.py:line"."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if ("eagle_kernels" in path and not path.endswith(_SKIPPED_FILES) and "/triton/" not in path
                and "/reference/" not in path):
            return f"{path[path.rindex('eagle_kernels'):]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _reads_on_host(func, args) -> bool:
    """Whether an aten op waits for the device on a GPU: a value read on the host, or an output
    shaped by values (``nonzero``, boolean-mask indexing); integer-index ``index`` and
    ``index_put_`` (tagged as possibly value-shaped, for boolean masks) do not."""
    name = func.__name__.split(".")[0]
    if name == "_local_scalar_dense":
        return True
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices)
    return True


class _Counter(TorchDispatchMode):
    def __init__(self, count: LaunchCount):
        super().__init__()
        self.count = count
        self.silent = 0  # > 0 inside a Triton launch or a native op (their own tensor traffic)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # Under torch.inference_mode() (generate's) composite ops such as aten::linear reach this mode whole;
            # their decomposition (what runs, e.g. aten::mm) is counted instead, as it is outside inference mode.
            with self:  # the decomposition's ops come back here
                out = func.decompose(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        name = func.__name__.split(".")[0]
        if func.namespace == "eagle_kernels" and not self.silent:
            op = name
            if op not in NATIVE_CUDA_LAUNCHES:
                raise RuntimeError(f"eagle_kernels::{op} ran its native CPU kernel: on a GPU it has none")
            self.silent += 1
            try:
                out = func(*args, **(kwargs or {}))
            finally:
                self.silent -= 1
            inputs = _tensors_of(list(args) + list((kwargs or {}).values()))
            self.count.add(f"eagle_kernels::{op}", NATIVE_CUDA_LAUNCHES[op], "native",
                           inputs + _tensors_of([out], out=True))
            return out
        out = func(*args, **(kwargs or {}))
        if not self.silent:
            inputs = _tensors_of(list(args) + list((kwargs or {}).values()))
            self.count.add(name, _launches_of(func, out), "aten", inputs + _tensors_of([out], out=True),
                           _gemm_flops(name, args))
            if _reads_on_host(func, args):
                self.count.host_reads[_caller()] += 1
        return out


def _cuda_implementation(op: str):
    """What ``eagle_kernels.<op>`` runs for CUDA tensors, made to run on CPU tensors: the
    native op (counted by NATIVE_CUDA_LAUNCHES) or the Triton launcher (interpreted)."""
    if op in NATIVE_CUDA_LAUNCHES:
        return _dispatch._cpp_callable(op)
    fn, _ = _dispatch.implementation(op, "triton", "cpu")
    if fn is None:
        fn, _ = _dispatch.implementation(op, "reference", "cpu")
    return fn


@contextlib.contextmanager
def counting(*models, pdl: bool | None = None):
    """Count launches inside the block (a :class:`LaunchCount` is yielded). ``models``
    (targets and heads) take the GPU layer path on CPU tensors meanwhile. The Triton launches use
    programmatic dependent launch as on an sm_90 GPU (``pdl`` None: unless EAGLE_KERNELS_PDL=0;
    True / False: on / off). Needs
    ``TRITON_INTERPRET=1`` set before triton is first imported, and the C++ extension (the
    native ops run its CPU kernels)."""
    from triton.runtime.interpreter import InterpretedFunction

    from .models.layers import LayerPath
    from .triton import _pdl

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("launch counting runs the Triton kernels interpreted: set TRITON_INTERPRET=1 "
                           "before importing triton")
    if not _dispatch.HAS_CPP:
        raise RuntimeError(f"launch counting needs the C++ extension ({_dispatch.CPP_IMPORT_ERROR})")
    count = LaunchCount()
    mode = _Counter(count)
    saved_run, saved_interpreted = _dispatch.run, InterpretedFunction.run
    saved_env = {name: os.environ.get(name) for name in _ENVIRONMENT}
    paths = [cls for cls in _subclasses(LayerPath) if "__call__" in vars(cls)]
    saved_calls = {cls: vars(cls)["__call__"] for cls in paths}

    def run(op, device, *args, **kwargs):
        return _cuda_implementation(op)(*args, **kwargs)

    def launch(self, *args, grid, warmup, **kwargs):
        if not warmup and not mode.silent:
            count.add(self.fn.__name__, 1, "triton", _tensors_of(list(args) + list(kwargs.values())),
                      pdl=bool(kwargs.get("launch_pdl")))
        mode.silent += 1
        try:
            return saved_interpreted(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            mode.silent -= 1

    def layer_call(original):
        def call(self, *args, **kwargs):
            before = count.total
            owner = "target" if type(self.config).__name__ == "LlamaConfig" else "head"
            count._layer_depth += 1
            count._layer_owner = owner
            try:
                return original(self, *args, **kwargs)
            finally:
                count._layer_depth -= 1
                count.layers.append((owner, count.total - before))
        return call

    flags = [(m.layer_paths, m.layer_paths._gpu_path_on_cpu) for m in models]
    try:
        os.environ.update(_ENVIRONMENT)
        _dispatch.run = run
        InterpretedFunction.run = launch
        for cls, original in saved_calls.items():
            cls.__call__ = layer_call(original)
        for paths_of_model, _ in flags:
            paths_of_model._gpu_path_on_cpu = True
        with mode, bookkeeping.gpu_path_on_cpu(), _pdl.forced(_pdl.enabled() if pdl is None else pdl):
            yield count
    finally:
        for paths_of_model, flag in flags:
            paths_of_model._gpu_path_on_cpu = flag
        for cls, original in saved_calls.items():
            cls.__call__ = original
        InterpretedFunction.run = saved_interpreted
        _dispatch.run = saved_run
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _subclasses(cls):
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_subclasses(sub))
    return found


def count_steps(decoder, prompts, steps: int = 2, speculative: bool = True,
                gpu_layer_path: bool = True, **sampling) -> list[LaunchCount]:
    """Launch counts of the first ``steps`` decoding steps of ``decoder.generate(prompts, ...,
    **sampling)`` (greedy unless ``sampling`` says otherwise: temperature, top_k, top_p, seed), one
    :class:`LaunchCount` per step; the prefill is not counted. The first step also
    pays the one-time fills of the ops' cached workspaces (verify's control words, draft_expand's
    request counters), which the kernels leave ready for the next call: the second step is the
    steady state that a replayed CUDA graph repeats. The decoder's
    target and head take the GPU layer path (``gpu_layer_path`` False: the op-by-op
    TorchLayerPath, for comparison), and the decoder should have a static policy (as on a GPU:
    ``SpeculativeDecoder(..., policy=StaticPolicy())``)."""
    models = [m for m in (decoder.target, decoder.head) if m is not None and gpu_layer_path]
    counts = []
    name = "_speculative_step" if speculative else "_plain_step"
    step = getattr(decoder, name)

    def counted(state):
        if len(counts) == steps:
            return  # the loop's remaining steps: not needed
        with counting(*models) as count:
            step(state)
        counts.append(count)

    flags = [(m.layer_paths, m.layer_paths._gpu_path_on_cpu) for m in models]
    setattr(decoder, name, counted)
    try:
        for paths_of_model, _ in flags:
            paths_of_model._gpu_path_on_cpu = True  # the prefill too: the same caches and tables
        with _backend_for_prefill():
            decoder.generate(prompts, max_new_tokens=8 * steps + 1, speculative=speculative, **sampling)
    finally:
        for paths_of_model, flag in flags:
            paths_of_model._gpu_path_on_cpu = flag
        delattr(decoder, name)
    return counts


@contextlib.contextmanager
def _backend_for_prefill():
    """The prefill outside the counted steps runs the GPU layer path too, so its ops take the
    CUDA choice of implementation as well (uncounted)."""
    saved = _dispatch.run

    def run(op, device, *args, **kwargs):
        return _cuda_implementation(op)(*args, **kwargs)

    _dispatch.run = run
    try:
        yield
    finally:
        _dispatch.run = saved
