"""CPU weight policy: which kernel a CPU linear layer runs, in which weight layout, and the packed
copies of the weight matrices.

On CPU the linear layers of decoding and verification (at most ``CPU_LINEAR_MAX_ROWS`` rows) run
the ``cpu_linear`` kernel, which reads fp32, bf16 or fp16 weights as they are stored; where its
AVX-512 path runs, it reads ``cpu_linear_pack`` copies of the matrices (see
:class:`PackedWeights`). The environment chooses among these paths:

- ``EAGLE_KERNELS_CPU_LINEAR``: ``auto`` (default: packed copies where packing pays), ``rows``
  (the kernel on the row-major matrices, no copies) or ``torch`` (``F.linear`` everywhere);
- ``EAGLE_KERNELS_CPU_LAYER``: ``auto`` (default: a pass in the kernel's regime runs each decoder
  layer as one ``cpu_decoder_layer`` call, and a model's whole stack as one ``cpu_decoder_layers``
  call), ``layer`` (one ``cpu_decoder_layer`` call per layer) or ``ops`` (op by op);
- ``EAGLE_KERNELS_CPU_HUGE_PAGES``: ``auto`` (default: the packed copies made at load time live in one
  mapping advised to use 2 MiB pages, see :func:`huge_page_arena`) or ``off``;
- ``EAGLE_KERNELS_CPU_ISA`` below ``avx512`` keeps the row-major layout, and
  ``EAGLE_KERNELS_BACKEND`` other than ``auto``/``cpp`` sends every linear layer to torch.

:func:`cpu_policy` reads them when asked (a model asks once per forward pass), so they can be
changed between passes; the parsing is cached per set of values.

Lifetime of the packed copies: each model (and each draft head) owns one :class:`PackedWeights`,
so the copies go with the model that made them, even where the caller keeps the row-major
matrices; within that life a copy also goes as soon as its matrix does (a weight replaced under
its name). A process-wide cache would keep copies for as long as anyone holds the matrices and
would share state between unrelated models; the price of owning them is that two models built
on the same tensors pack them twice, and that a draft head reads its target's matrices (EAGLE-1's
LM head) through the target's store.
"""

from __future__ import annotations

import functools
import mmap
import os
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import _dispatch, ops
from .._inference import kept_tensors
from .._inference import version as tensor_version
from ..reference.cpu_linear import ROW_BLOCK_BYTES, dequantize, quant_in_features, quantize
from ..reference.fp8_linear import quantize_fp8
from ..reference.q8_0_linear import split_q8_0

# cpu_linear streams each weight row once for all rows of x, which pays while x stays in cache;
# larger calls (long prefills, batched prefills) go to torch's GEMM. With the AVX-512VL build
# (x tiles of 6 rows) the kernel ran 1.1-1.8x torch's GEMM at 16-256 rows on SmolLM2's shapes
# and a prefill as one call per layer took 121 against 171 ms at 96 tokens, 362 against 446 ms
# at 250 (2 threads, AMD EPYC Zen 4); at 512 rows they were even.
CPU_LINEAR_MAX_ROWS = 256
CPU_LINEAR_ENV = "EAGLE_KERNELS_CPU_LINEAR"  # auto (default: packed weights), rows or torch
# auto (default: a target pass as one cpu_decoder_forward call), stack (cpu_decoder_layers, the embedding, norm and
# LM head as torch ops), layer (cpu_decoder_layer) or ops
CPU_LAYER_ENV = "EAGLE_KERNELS_CPU_LAYER"
CPU_ISA_ENV = "EAGLE_KERNELS_CPU_ISA"
CPU_HUGE_PAGES_ENV = "EAGLE_KERNELS_CPU_HUGE_PAGES"  # auto (default: packed copies on 2 MiB pages) or off
HUGE_PAGE_BYTES = 2 << 20
KERNEL_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what cpu_linear reads as stored
QUANT_DTYPES = tuple(ROW_BLOCK_BYTES)  # int8: Q8_0 block rows, uint8: Q4_1 block rows (packed for cpu_linear)
# How quantized matrices multiply: "fp32" activations (x held per block of 32 as integers to 2^-22 of the block's
# largest element, exact integer dot products: the dequantized product to fp32 rounding) or "int8" (GGML's
# arithmetic: each row of x quantized to 8 bits per block, with that rounding; faster at 4 rows and more).
ACTIVATIONS = ("fp32", "int8")


def is_quantized(weight: torch.Tensor) -> bool:
    """Whether ``weight`` holds GGML block rows (int8 Q8_0, uint8 Q4_1; see ``reference.cpu_linear.quantize``)."""
    return weight.dtype in QUANT_DTYPES


@dataclass(frozen=True)
class CpuPolicy:
    """What the environment allows CPU passes: ``linear_kernel``, small fp32 linear calls run
    ``cpu_linear``; ``packed``, it reads packed copies; ``layer_kernel``, a pass in that regime
    runs each decoder layer as one ``cpu_decoder_layer`` call; ``stack_kernel``, a model's whole
    stack of layers as one ``cpu_decoder_layers`` call; ``forward_kernel``, a target's whole pass (embedding to
    logits) as one ``cpu_decoder_forward`` call, and an EAGLE-3 head's pass as one ``cpu_head_forward`` call."""

    linear_kernel: bool
    packed: bool
    layer_kernel: bool
    stack_kernel: bool = False
    forward_kernel: bool = False


def cpu_policy() -> CpuPolicy:
    """The policy the environment sets now; raises ``ValueError`` naming a variable with an
    unknown value."""
    env = os.environ
    return _parse_policy(env.get(CPU_LINEAR_ENV, "auto"), env.get(CPU_LAYER_ENV, "auto"),
                         env.get(_dispatch.BACKEND_ENV, "auto"), env.get(CPU_ISA_ENV, ""))


@functools.lru_cache(maxsize=32)
def _parse_policy(linear_mode: str, layer_mode: str, backend: str, isa: str) -> CpuPolicy:
    if linear_mode not in ("auto", "rows", "torch"):
        raise ValueError(f"{CPU_LINEAR_ENV}: expected auto, rows or torch, got {linear_mode!r}")
    if layer_mode not in ("auto", "stack", "layer", "ops"):
        raise ValueError(f"{CPU_LAYER_ENV}: expected auto, stack, layer or ops, got {layer_mode!r}")
    linear_kernel = (linear_mode != "torch" and ("cpu_linear", "cpu") in _dispatch.NATIVE_KERNELS
                     and backend in ("auto", "cpp"))
    # The packed layout pays on cpu_linear's AVX-512 path only: the AVX2 path of the packed kernel
    # (tiles of one half of a group x up to 6 rows in 16 registers) measured about even with the
    # row-major AVX2 kernel over a whole forward's linear layers (1.3-1.5x slower before its tiles
    # kept their accumulators in registers), so an AVX2 CPU (or an ISA cap) keeps row-major weights.
    # ``isa`` (the variable's value) keys the cache; the level itself is the kernels' own.
    packed = (linear_kernel and linear_mode == "auto"
              and _dispatch.cpu_isa() in ("avx512-ymm", "avx512", "avx512-bf16"))
    layer_kernel = (linear_kernel and layer_mode in ("auto", "stack", "layer")
                    and ("cpu_decoder_layer", "cpu") in _dispatch.NATIVE_KERNELS)
    stack_kernel = (layer_kernel and layer_mode in ("auto", "stack")
                    and ("cpu_decoder_layers", "cpu") in _dispatch.NATIVE_KERNELS)
    forward_kernel = (stack_kernel and layer_mode == "auto"
                      and ("cpu_decoder_forward", "cpu") in _dispatch.NATIVE_KERNELS)
    return CpuPolicy(linear_kernel, packed, layer_kernel, stack_kernel, forward_kernel)


class PackedWeights:
    """One owner's ``cpu_linear_pack`` copies of its weight matrices, made on first use (or by
    :meth:`pack_all` at load time) and kept while both the owner and the matrix live. The kernels
    read the packed copy: a GEMM micro-kernel with x broadcast from memory, where the row-major
    layout reloads x for every four outputs (one SmolLM2 forward's linear layers, 2 threads,
    AVX-512: 19.2 against 20.6 ms at one row, 23.1 against 28.3 ms at 12). The row-major matrix
    stays for torch's paths (long prefills, autograd, other devices): packing costs one more
    copy of the matrices.

    A copy is found by the matrix's ``id()`` and counts only while its weak reference still
    resolves to that very tensor, at the version counter it was packed at: a freed matrix's id
    taken by a new tensor never finds the old copy, and an in-place update (an optimizer step
    on a head being trained) repacks on the next call. The weak reference's callback drops the
    copy with its matrix. (``torch.utils.weak.WeakIdKeyDictionary`` does the same at about ten
    times the lookup cost; a pass looks up four matrices per layer.)"""

    def __init__(self, activations: str = "fp32"):
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations: expected one of {ACTIVATIONS}, got {activations!r}")
        self.activations = activations  # quantized matrices: packed for fp32 or 8-bit activations
        self._copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
        self._splits: dict[int, tuple[weakref.ref, int, tuple]] = {}  # Q8_0 block rows split for the GPU kernel
        self._fp8: dict[int, tuple[weakref.ref, int, tuple]] = {}  # fp8 copies of float matrices (fp8_linear)
        self.generation = 0  # changes whenever a copy is made, dropped or moved (a cache of lookups checks it)

    def __call__(self, weight: torch.Tensor, policy: CpuPolicy | None = None) -> torch.Tensor:
        """The packed copy of ``weight`` [N, K], or ``weight`` itself where packing does not
        apply (``policy``, default :func:`cpu_policy`, says no; N not a multiple of
        ``ops.PACK_WIDTH``; not a 2-D CPU matrix). Quantized block rows are packed whenever asked: the packed
        layout is the only one the kernel reads them in (every ISA)."""
        if not (policy or cpu_policy()).packed and not is_quantized(weight):
            return weight
        hit = self._held(weight, self._copies)
        if hit is not None:
            return hit  # on every linear call: the shape checks below ran when it was packed
        if weight.dim() != 2 or weight.shape[0] % ops.PACK_WIDTH or weight.device.type != "cpu":
            return weight
        with kept_tensors():
            packed = (ops.cpu_linear_pack(weight, self.activations) if is_quantized(weight)
                      else ops.cpu_linear_pack(weight))
        return self._remember(weight, packed)

    def q8_0_split(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Q8_0 block rows as the GPU kernel reads them, ``(quants, scales)``
        (``reference.q8_0_linear.split_q8_0``, on the weight's device), made on first use and kept
        as a packed copy is. Raises ``ValueError`` naming ``blocks`` for anything but Q8_0 block rows."""
        hit = self._held(weight, self._splits)
        if hit is not None:
            return hit
        with kept_tensors():
            return self._remember(weight, split_q8_0(weight), self._splits)

    def fp8_copy(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A float matrix as ``fp8_linear`` reads it, ``(weight_fp8, weight_scale)``
        (``reference.fp8_linear.quantize_fp8``, on the weight's device), made on first use and kept
        as a packed copy is."""
        hit = self._held(weight, self._fp8)
        if hit is not None:
            return hit
        with kept_tensors():
            return self._remember(weight, quantize_fp8(weight), self._fp8)

    @staticmethod
    def _held(weight: torch.Tensor, copies: dict):
        """The copy ``copies`` holds for this very tensor at its current version, else None."""
        hit = copies.get(id(weight))
        return hit[2] if hit is not None and hit[0]() is weight and hit[1] == tensor_version(weight) else None

    def _remember(self, weight: torch.Tensor, copy, copies: dict | None = None):
        """Keep ``copy`` for ``weight`` in ``copies`` (default: the packed copies) while it lives at this version."""
        key, copies = id(weight), (self._copies if copies is None else copies)

        def forget(ref, key=key):  # the copy goes with the matrix (unless a new one took its id)
            if copies.get(key, (None,))[0] is ref:
                del copies[key]
                self.generation += 1

        copies[key] = (weakref.ref(weight, forget), tensor_version(weight), copy)
        self.generation += 1
        return copy

    def __contains__(self, weight: torch.Tensor) -> bool:
        """Whether a current packed copy of this very tensor is held."""
        return self._held(weight, self._copies) is not None

    def __len__(self) -> int:
        return len(self._copies)

    def pack_all(self, matrices, compute_dtype: torch.dtype) -> None:
        """Pack a CPU model's matrices at load time (fp32 compute, packing on): loading then
        settles the memory, and the first forward pass does not pay for the packing. The copies
        then move into one :func:`huge_page_arena` (unless ``EAGLE_KERNELS_CPU_HUGE_PAGES=off``)."""
        policy = cpu_policy()
        if compute_dtype == torch.float32 and policy.linear_kernel:
            for matrix in matrices:
                if policy.packed or is_quantized(matrix):
                    self(matrix, policy)
            with kept_tensors():
                self._move_to_huge_pages()

    def _move_to_huge_pages(self) -> None:
        mode = os.environ.get(CPU_HUGE_PAGES_ENV, "auto")
        if mode not in ("auto", "off"):
            raise ValueError(f"{CPU_HUGE_PAGES_ENV}: expected auto or off, got {mode!r}")
        entries = [(key, entry) for key, entry in self._copies.items()
                   if entry[2].device.type == "cpu" and entry[2].is_contiguous()]
        sizes = [-(-entry[2].numel() * entry[2].element_size() // 4096) * 4096 for _, entry in entries]
        arena = huge_page_arena(sum(sizes)) if mode == "auto" and entries else None
        if arena is None:
            return
        offset = 0
        for (key, (ref, version, packed)), size in zip(entries, sizes):
            moved = arena[offset:offset + packed.numel() * packed.element_size()].view(packed.dtype)
            moved = moved.view(packed.shape).copy_(packed)
            self._copies[key] = (ref, version, moved)
            offset += size
        self.generation += 1


def huge_page_arena(nbytes: int) -> torch.Tensor | None:
    """uint8 [nbytes], 2 MiB aligned, in an anonymous mapping advised ``MADV_HUGEPAGE`` (where the kernel's
    transparent huge pages are set to ``madvise``, the usual default, only such mappings get them), or None
    where the platform has no such advice. A decoding step streams every packed matrix once (269 MB of bf16 for
    SmolLM2-135M); on 4 KiB pages that is a TLB miss, and a page walk, every 4 KiB. Measured on the 2-core Zen 4
    VM, whole SmolLM2 decoding steps in one process, 4 KiB / 2 MiB pages: bf16 1.025x (1 thread), 1.015x
    (2 threads); GGUF blocks with int8 activations 1.044x (1 thread). The mapping lives as long as a tensor
    made from it (``torch.frombuffer`` holds it)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes <= 0:
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # no transparent huge pages in this kernel
        region.close()
        return None
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start:start + nbytes]


def linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeights | None = None,
           policy: CpuPolicy | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) in ``x.dtype``, for a weight stored in ``x.dtype`` or
    narrower (bf16 weights of an fp32 model). fp32 CPU calls of at most ``CPU_LINEAR_MAX_ROWS``
    rows run the ``cpu_linear`` kernel (fp32, bf16 or fp16 weight read as is; the copy in
    ``packed`` where there is one); every other call runs torch, widening a narrower weight for
    that call only (prefill: no second fp32 copy of the weights is kept); quantized block rows (int8 Q8_0,
    uint8 Q4_1) likewise run the kernel on their packed copy, and torch on their exact dequantization (made for
    that call). ``policy`` (default
    :func:`cpu_policy`) can turn the kernel off, and so does a call autograd records (the kernel
    has no backward; training shares this function).

    Shapes
    ------
    x [..., K]; weight [N, K]; returns [..., N].
    """
    quantized = is_quantized(weight)
    if (x.device.type == "cpu" and x.dtype == torch.float32 and (quantized or weight.dtype in KERNEL_WEIGHT_DTYPES)
            and x.numel() <= CPU_LINEAR_MAX_ROWS * x.shape[-1]
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        policy = policy or cpu_policy()
        if policy.linear_kernel:
            if not quantized:
                return torch.ops.eagle_kernels.cpu_linear(x, weight if packed is None else packed(weight, policy))
            blocks = (packed if packed is not None else PackedWeights())(weight, policy)
            if blocks.dim() in (4, 5):  # else N is not a multiple of 32: torch below
                return torch.ops.eagle_kernels.cpu_linear(x, blocks)
    if quantized:
        return F.linear(x, dequantize(weight).to(device=x.device, dtype=x.dtype))
    return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))


def quantize_matrices(weights: dict, fmt: str) -> dict:
    """The projections and the LM head (the embedding where tied) of ``weights`` as ``fmt`` block rows (GGML's
    quantizer; ``fmt`` "q8_0" or "q4_1"), for :func:`with_matrices`. Raises ``ValueError`` naming a matrix
    whose K is not a multiple of 32 (or with non-finite values)."""
    names = [n for n in weights if n.endswith("_proj.weight")] + ["lm_head.weight"]
    out = {}
    for name in names:
        matrix = weights.get(name, weights["model.embed_tokens.weight"])  # a tied head: the embedding
        try:
            out[name] = quantize(matrix, fmt)
        except ValueError as e:  # the shape does not fit the blocks: say which matrix (never another dtype)
            raise ValueError(f"weights: {name!r}: {e}") from None
    return out


def with_matrices(weights: dict, matrices: dict, dtype, device) -> dict:
    """``weights`` (transformers' names; no ``lm_head.weight``: tied to the embedding) with ``matrices`` (block
    rows, or plain matrices) in place of theirs. The embedding is read by row, never streamed: it stays in
    ``dtype``, as the exact dequantization of its blocks where ``matrices`` has them, or of the tied LM head's.

    Raises ``ValueError`` naming a matrix whose shape does not fit the model."""
    out = dict(weights)
    embed_name, head_name = "model.embed_tokens.weight", "lm_head.weight"
    tied = head_name not in weights
    for name, t in matrices.items():
        ref = weights.get(embed_name if name == head_name and tied else name)
        K = quant_in_features(t) if is_quantized(t) else t.shape[-1]
        if ref is None or t.dim() != 2 or (t.shape[0], K) != tuple(ref.shape):
            want = "no such matrix" if ref is None else f"[{ref.shape[0]}, {ref.shape[1]}]"
            raise ValueError(f"matrices: {name!r}: {tuple(t.shape)} ({t.dtype}) does not fit the model: {want}")
        out[name] = t.to(device)
    embed = matrices.get(embed_name, matrices.get(head_name) if tied else None)
    if embed is not None:
        out[embed_name] = (dequantize(embed) if is_quantized(embed) else embed).to(device=device, dtype=dtype)
    return out
