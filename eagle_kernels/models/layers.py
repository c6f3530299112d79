"""The decoder layer shared by the Llama target and the EAGLE draft heads, and the paths that run it.

A layer is pre-norm attention then a pre-norm SwiGLU MLP, each added to the residual stream.
Its tensors travel as one :class:`LayerWeights`; a :class:`LayerPath` runs it:

- :class:`TorchLayerPath`: op by op (``rms_norm``, one fused q/k/v linear call, RoPE,
  ``write_kv`` + ``tree_attention``, o, SwiGLU); any device, dtype and autograd;
- :class:`CpuFusedLayerPath`: the whole layer as one ``cpu_decoder_layer`` call (the same
  kernels without a Python round trip per operator), and a target's whole stack as one
  ``cpu_decoder_layers`` call, for fp32 CPU passes in ``cpu_linear``'s regime;
- :class:`GpuLayerPath`: nine kernel launches per layer on a GPU (fused RMSNorm, one q/k/v
  GEMM, RoPE + KV write, tree attention, o GEMM with the residual added in place, fused
  RMSNorm, one gate/up GEMM, SiLU*up, down GEMM with the residual added in place).

:class:`LayerPaths` (one per model) picks the path once per forward pass, from the pass's
device, dtype and size and the CPU policy (:mod:`.cpu_weights`).

New K/V are written at slots ``cache.seqlens + slot_offset + i`` (slot order = node order, as
the ops' contract requires); the caller advances ``cache.seqlens``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import bookkeeping, ops
from .._inference import kept_tensors
from ..norm import rms_norm
from .cpu_weights import CPU_LINEAR_MAX_ROWS, CpuPolicy, PackedWeights, cpu_policy, linear

QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
# Cache dtypes an fp32 model attends with on the CPU: its own, or 16-bit K/V (half the bytes attention reads).
KV_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The GPU layer path folds a norm into the GEMM after it (``rmsnorm_linear``) for matrices up to this size and passes
# up to this many rows: there a step is bound by launches (a replayed graph node cost about 3.4 us on an H200, more
# than reading a 0.5-3.5 MB SmolLM2 matrix); larger matrices (Llama-3-8B's: 50-235 MB) and long prefills keep cuBLAS.
FUSED_NORM_MAX_MATRIX_BYTES = 32 << 20
# The o and down GEMMs of such a matrix run as rmsnorm_linear launches (no norm, the residual added in the
# epilogue) rather than cuBLAS addmm_, so that every launch of the layer is a Triton kernel, which starts while
# the one before it runs (programmatic dependent launch); False keeps cuBLAS (bench/gpu_e2e.py --cublas-residual).
RESIDUAL_GEMMS_IN_TRITON = True
# Where the o, gate/up and down matrices all fold, the layer after its attention is one ``o_proj_mlp`` launch (its
# programs hand the three GEMM phases to each other) instead of three rmsnorm_linear launches; False: three
# (bench/gpu_e2e.py --mlp-apart).
O_PROJ_MLP_IN_ONE_LAUNCH = True
FUSED_NORM_MAX_ROWS = 1024
Q8_0_DTYPE = torch.int8  # a matrix held as Q8_0 block rows (reference.cpu_linear.quantize): q8_0_linear on the GPU path


# ------------------------------------------------------------------ RoPE, norm, attention
def rope_inverse_frequencies(config) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] in float64, with linear or Llama-3 scaling
    (``config``: ``head_dim``, ``rope_theta``, ``rope_scaling`` as in ``LlamaConfig``)."""
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1 long-context scaling: long wavelengths divided by `factor`, short ones kept,
        # a smooth blend in between.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, blended, scaled)
    raise NotImplementedError(f"rope_scaling type {kind!r}")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE in the half-split layout. x [B, N, H, D]; cos, sin [B, N, 1, D]."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, N, 1, D] for integer positions [B, N] (angles in float64)."""
    angles = positions.to(torch.float64)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_cos_sin_rows(inv_freq: torch.Tensor, positions: torch.Tensor, B: int, N: int, dtype):
    """cos, sin [B, N, D], one row per token, as ``cpu_decoder_layer`` takes them; ``positions``
    [B, N] or broadcastable to it (drafting passes one position per request for a depth)."""
    cos, sin = rope_cos_sin(inv_freq, positions.expand(B, N), dtype)
    return cos.reshape(B, N, -1), sin.reshape(B, N, -1)


def default_positions(cache, num_tokens: int) -> torch.Tensor:
    return cache.seqlens[:, None].long() + torch.arange(num_tokens, device=cache.seqlens.device)


def swiglu(h: torch.Tensor, w: dict, prefix: str, packed: PackedWeights | None = None) -> torch.Tensor:
    """The MLP from the three separate matrices under ``prefix`` (see :meth:`TorchLayerPath.gated_mlp`
    for the fused one)."""
    gate = F.silu(linear(h, w[prefix + "mlp.gate_proj.weight"], packed))
    return linear(gate * linear(h, w[prefix + "mlp.up_proj.weight"], packed), w[prefix + "mlp.down_proj.weight"],
                  packed)


def cached_attention(q, k, v, cache, layer: int, tree_mask, slot_offset: int = 0):
    """Store the new tokens' K/V at slots ``cache.seqlens + slot_offset + i`` of ``layer`` and
    attend. With ``slot_offset`` > 0 the tree already holds that many slots from earlier calls
    (draft expansion, depth by depth) and ``tree_mask`` covers all ``slot_offset + N`` slots;
    the queries of the earlier slots are zero padding whose output is dropped.
    q [B, N, Hq, D]; k, v [B, N, Hkv, D]; returns [B, N, Hq * D] in q.dtype."""
    B, N = q.shape[:2]
    k_layer, v_layer = cache.layer(layer)
    starts = cache.seqlens + slot_offset if slot_offset else cache.seqlens
    ops.write_kv(k_layer, v_layer, k.to(k_layer.dtype), v.to(v_layer.dtype), starts)
    if slot_offset:
        q = torch.cat([q.new_zeros(B, slot_offset, *q.shape[2:]), q], dim=1)
    out = ops.tree_attention(q.to(k_layer.dtype), k_layer, v_layer, cache.seqlens, tree_mask)
    if slot_offset:
        out = out[:, slot_offset:]
    return out.to(q.dtype).reshape(B, N, -1)


# ------------------------------------------------------------------ one layer's tensors
class FusedProjections:
    """Projections of one input served as one matrix (q/k/v, gate/up): one linear call reads
    them in one weight stream, with fewer calls and parallel regions per layer. A cpu_linear
    output column does not depend on the other weight rows, so on CPU the results are bit for
    bit those of separate calls.

    The fused matrix is built on first use and the (model's own) weights dict's entries are
    re-pointed at views of its rows (no second copy). Entries replaced later (a new tensor
    under a name) are noticed by identity and fused again."""

    def __init__(self):
        self._built = {}  # (prefix, names) -> (the views handed out, the fused matrix)

    def __call__(self, weights: dict, prefix: str, names: tuple) -> torch.Tensor:
        parts = [weights[prefix + name] for name in names]
        built = self._built.get((prefix, names))
        if built is not None and all(a is b for a, b in zip(built[0], parts)):
            return built[1]
        with kept_tensors():  # the entries become views of it: normal tensors even under inference mode
            fused = torch.cat(parts)
            views, start = [], 0
            for name, part in zip(names, parts):
                views.append(fused[start:start + part.shape[0]])
                weights[prefix + name] = views[-1]
                start += part.shape[0]
        self._built[(prefix, names)] = (views, fused)
        return fused


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors as every path takes them. ``input_norm`` None: no norm
    before attention (EAGLE-1's head, whose fc output feeds attention directly);
    ``embed_norm``: EAGLE-3's head, whose attention input is [norm(embedding), norm(x)].

    Shapes
    ------
    input_norm, post_norm [H]; qkv [(Hq + 2 Hkv) D, K] (K = H, or 2H with ``embed_norm``);
    o [H, Hq D]; gate_up [2I, H]; down [H, I]; embed_norm [H].
    """

    input_norm: torch.Tensor | None
    qkv: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    embed_norm: torch.Tensor | None = None

    @classmethod
    def from_weights(cls, weights: dict, prefix: str, fused: FusedProjections,
                     input_norm: str | None = "input_layernorm.weight", embed_norm: str | None = None):
        """The layer under ``prefix`` in transformers' names, q/k/v and gate/up fused."""
        return cls(None if input_norm is None else weights[prefix + input_norm], fused(weights, prefix, QKV),
                   weights[prefix + "self_attn.o_proj.weight"], weights[prefix + "post_attention_layernorm.weight"],
                   fused(weights, prefix, GATE_UP), weights[prefix + "mlp.down_proj.weight"],
                   None if embed_norm is None else weights[prefix + embed_norm])

    @property
    def matrices(self) -> tuple[torch.Tensor, ...]:
        """The matrices the linear layers stream (what packing applies to)."""
        return self.qkv, self.o, self.gate_up, self.down


def stack_lists(layers: list[LayerWeights], packed: PackedWeights, policy: CpuPolicy) -> tuple[list, ...] | None:
    """The six per-layer lists ``cpu_decoder_layers`` and ``cpu_decoder_forward`` take (input norms, q/k/v, o, post
    norms, gate/up, down), the matrices as the kernels read them (packed copies where ``policy`` packs); None when a
    layer is not a target's (no input norm, or an embedding input)."""
    if any(layer.input_norm is None or layer.embed_norm is not None for layer in layers):
        return None
    columns = [[packed(m, policy) for m in layer.matrices] for layer in layers]  # qkv, o, gate_up, down
    qkv, o, gate_up, down = (list(column) for column in zip(*columns)) if layers else ([], [], [], [])
    return [layer.input_norm for layer in layers], qkv, o, [layer.post_norm for layer in layers], gate_up, down


# ------------------------------------------------------------------ layer paths
class LayerPath:
    """Runs one decoder layer of a forward pass. ``config`` gives ``num_heads``,
    ``num_kv_heads``, ``head_dim`` and ``rms_norm_eps`` (``LlamaConfig`` or ``HeadConfig``);
    ``packed`` holds the owner's packed copies; ``policy`` is the pass's CPU policy (None: read
    where needed)."""

    computes_padding_rows = True  # False: rows past ``row_counts`` are skipped (left unspecified)

    def __init__(self, config, packed: PackedWeights, policy: CpuPolicy | None = None):
        self.config, self.packed, self.policy = config, packed, policy

    def rope(self, inv_freq: torch.Tensor, positions: torch.Tensor, B: int, N: int, dtype, capacity=None):
        """The RoPE tables of a pass, in the layout this path's ``__call__`` takes; ``capacity``: the pass's
        cache capacity (every position is below it), or None."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, layer: LayerWeights, rope, cache, index: int, tree_mask=None, *,
                 row_counts=None, embed=None, slot_offset: int = 0) -> torch.Tensor:
        """x [B, N, H] -> the layer's output [B, N, H], writing the new K/V into layer ``index``
        of ``cache``. tree_mask int64 [B, slot_offset + N, ceil((slot_offset + N) / 64)] or None
        (causal); row_counts int64 [B]: rows past it are padding; embed [B, N, H] with
        ``layer.embed_norm`` (EAGLE-3)."""
        raise NotImplementedError

    def run_layers(self, x, layers: list[LayerWeights], rope, cache, tree_mask=None, *, row_counts=None,
                   state_layers=()) -> tuple[torch.Tensor, dict]:
        """A model's whole stack: layer ``i`` of ``layers`` with layer ``i`` of ``cache``, each output the next
        layer's input. Returns the last output and ``{i: output of layer i}`` for ``i`` in ``state_layers``."""
        states = {}
        for index, layer in enumerate(layers):
            x = self(x, layer, rope, cache, index, tree_mask, row_counts=row_counts)
            if index in state_layers:
                states[index] = x
        return x, states


class TorchLayerPath(LayerPath):
    """Op by op; the linear layers through :func:`linear` (``cpu_linear`` for small fp32 CPU
    calls, torch otherwise). Every row is computed, padding included."""

    def rope(self, inv_freq, positions, B, N, dtype, capacity=None):
        return rope_cos_sin(inv_freq, positions, dtype)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear(x, weight, self.packed, self.policy)

    def attention_projections(self, h: torch.Tensor, qkv: torch.Tensor, cos, sin):
        """q, k (RoPE applied, one pass over both) and v from one fused q/k/v linear call.
        h [B, N, K]; returns q [B, N, Hq, D], k and v [B, N, Hkv, D] (views of one buffer)."""
        B, N = h.shape[:2]
        c = self.config
        out = self.linear(h, qkv).view(B, N, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        q, k = rotate(out[:, :, :c.num_heads + c.num_kv_heads], cos, sin).split([c.num_heads, c.num_kv_heads], dim=2)
        return q, k, out[:, :, c.num_heads + c.num_kv_heads:]

    def gated_mlp(self, h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """SwiGLU with gate and up in one linear call (the same as :func:`swiglu`)."""
        gate, up = self.linear(h, gate_up).chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up, down)

    def __call__(self, x, layer, rope, cache, index, tree_mask=None, *, row_counts=None, embed=None, slot_offset=0):
        eps = self.config.rms_norm_eps
        h = x if layer.input_norm is None else rms_norm(x, layer.input_norm, eps)
        if embed is not None:
            h = torch.cat([rms_norm(embed, layer.embed_norm, eps), h], dim=-1)
        q, k, v = self.attention_projections(h, layer.qkv, *rope)
        x = x + self.linear(cached_attention(q, k, v, cache, index, tree_mask, slot_offset), layer.o)
        return x + self.gated_mlp(rms_norm(x, layer.post_norm, eps), layer.gate_up, layer.down)


class CpuFusedLayerPath(LayerPath):
    """The layer as one ``cpu_decoder_layer`` call (:meth:`run_layers`: the stack as one
    ``cpu_decoder_layers`` call), with the matrices' packed copies where the policy packs. Rows
    past ``row_counts`` are not computed."""

    computes_padding_rows = False

    @staticmethod
    def accepts(x: torch.Tensor, cache, weights: dict, policy: CpuPolicy) -> bool:
        """fp32 on CPU with an fp32, bf16 or fp16 cache, at most ``CPU_LINEAR_MAX_ROWS`` rows (the
        cpu_linear regime), the policy on, and nothing for autograd to record in ``weights``."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and cache.k.dtype in KV_CACHE_DTYPES
                and x.shape[0] * x.shape[1] <= CPU_LINEAR_MAX_ROWS and policy.layer_kernel
                and not (torch.is_grad_enabled() and any(t.requires_grad for t in weights.values())))

    def __init__(self, config, packed: PackedWeights, policy: CpuPolicy | None = None,
                 rope_tables: RopeTables | None = None):
        super().__init__(config, packed, policy)
        self.rope_tables = rope_tables

    def rope(self, inv_freq, positions, B, N, dtype, capacity=None):
        # Gathered from the model's tables where the cache capacity bounds the positions: two index ops instead of
        # the float64 formula's nine (a draft pass of the head runs three or four times a step). The same bits:
        # the tables are the formula's angles through the same vectorised cos and sin.
        if capacity is not None and self.rope_tables is not None and dtype == torch.float32:
            return self.rope_tables.rows(inv_freq, capacity, positions.expand(B, N))
        return rope_cos_sin_rows(inv_freq, positions, B, N, dtype)

    def __call__(self, x, layer, rope, cache, index, tree_mask=None, *, row_counts=None, embed=None, slot_offset=0):
        k_layer, v_layer = cache.layer(index)
        qkv, o, gate_up, down = (self.packed(m, self.policy) for m in layer.matrices)
        return torch.ops.eagle_kernels.cpu_decoder_layer(
            x, layer.input_norm, qkv, o, layer.post_norm, gate_up, down, *rope, k_layer, v_layer, cache.seqlens,
            tree_mask, num_heads=self.config.num_heads, eps=self.config.rms_norm_eps, embed=embed,
            embed_norm=layer.embed_norm, slot_offset=slot_offset, row_counts=row_counts)


    def run_layers(self, x, layers, rope, cache, tree_mask=None, *, row_counts=None, state_layers=()):
        """One ``cpu_decoder_layers`` call where the policy allows and every layer is a target's (an input
        norm, no embedding input): no Python between the layers, whose interpreter state the weight stream
        evicts from the caches between two calls (3-5% of a SmolLM2-135M decoding step); else a call per layer."""
        lists = (stack_lists(layers, self.packed, self.policy)
                 if self.policy.stack_kernel and layers and cache.k.dim() == 5 and len(layers) == cache.k.shape[0]
                 else None)
        if lists is None:
            return super().run_layers(x, layers, rope, cache, tree_mask, row_counts=row_counts,
                                      state_layers=state_layers)
        wanted = [index for index in dict.fromkeys(state_layers) if 0 <= index < len(layers)]
        out, states = torch.ops.eagle_kernels.cpu_decoder_layers(
            x, *lists, *rope, cache.k, cache.v, cache.seqlens, tree_mask, num_heads=self.config.num_heads,
            eps=self.config.rms_norm_eps, state_layers=wanted, row_counts=row_counts)
        return out, dict(zip(wanted, states.unbind(0)))


class RopeTables:
    """One model's RoPE tables for :class:`GpuLayerPath`: cos and sin fp32 [P, D / 2] of the
    angles ``p * inv_freq`` (computed in float64), P covering every position a pass can use.
    A pass's positions stay below its cache's capacity (a token at position p sits at a slot
    >= p), so the tables grow, by doubling, when a cache with a larger capacity arrives: a
    decision on shapes only. Outgrown tables are kept, as a captured CUDA graph may still read
    them."""

    def __init__(self):
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._outgrown: list = []
        self._full: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # rows' full-width tables

    def __call__(self, inv_freq: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (inv_freq.device, id(inv_freq))
        tables = self._tables.get(key)
        if tables is not None and tables[0].shape[0] >= capacity:
            return tables
        if tables is not None:
            self._outgrown.append(tables)
        rows = max(64, 1 << max(0, capacity - 1).bit_length(), 2 * tables[0].shape[0] if tables else 0)
        with kept_tensors():
            angles = torch.arange(rows, dtype=torch.float64, device=inv_freq.device)[:, None] * inv_freq.double()
            tables = (angles.cos().float().contiguous(), angles.sin().float().contiguous())
        self._tables[key] = tables
        return tables

    def rows(self, inv_freq: torch.Tensor, capacity: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin fp32 [B, N, D] of integer positions [B, N] below ``capacity``, one row per token as
        ``cpu_decoder_layer`` takes them (:func:`rope_cos_sin_rows`' values): rows of the tables with each half
        written twice, kept beside the tables they were made from."""
        half = self(inv_freq, capacity)
        key = (inv_freq.device, id(inv_freq))
        full = self._full.get(key)
        if full is None or full[0] is not half[0]:
            with kept_tensors():
                full = (half[0], torch.cat([half[0], half[0]], dim=-1), torch.cat([half[1], half[1]], dim=-1))
            self._full[key] = full
        return full[1][positions], full[2][positions]


class TokenRows(NamedTuple):
    """A pass's input as token ids, for :class:`GpuLayerPath`'s first layer to embed and norm
    in its first launch (``bookkeeping.token_rows``): ``tokens`` int64 [B, N], the embedding
    ``table`` [V, H] in the model's dtype, and for a tree pass its ``depths`` int32 [B, N] with
    the ``positions`` int32 [B, N] buffer that launch fills (``cache.seqlens + depths``, which
    every layer's RoPE then reads); both None when the positions are given."""

    tokens: torch.Tensor
    table: torch.Tensor
    depths: torch.Tensor | None
    positions: torch.Tensor | None


class GpuLayerPath(LayerPath):
    """The layer in three to nine kernel launches, for GPU passes (docs/decoding.md, "Launches per
    step"):

    1. ``rmsnorm`` (EAGLE-3: both input norms and the concatenation), also writing the copy of
       x that becomes the layer's output (the residual stream); EAGLE-1's head, without an
       input norm, copies x instead;
    2. one GEMM for q, k and v (the fused matrix);
    3. ``rope_write_kv``: RoPE on q and k, k and v into the cache;
    4. ``tree_attention``;
    5. o GEMM added into the residual in place (``addmm_``: the cuBLAS epilogue, no copy);
    6. ``rmsnorm``; 7. one GEMM for gate and up; 8. ``silu_mul``;
    9. down GEMM added into the residual in place.

    Where a matrix is small (``FUSED_NORM_MAX_MATRIX_BYTES``, ``FUSED_NORM_MAX_ROWS``), the
    layer takes three: ``rmsnorm_qkv_rope`` does 1-3 (the copy; RoPE and the KV write in its
    epilogue), ``tree_attention``, and ``o_proj_mlp`` 5-9 (the o GEMM into the residual, the
    norm, the gate/up GEMM with SwiGLU, the down GEMM into the residual: three GEMM phases of
    one launch; ``O_PROJ_MLP_IN_ONE_LAUNCH`` False makes them three ``rmsnorm_linear``
    launches, five a layer). Every launch of the layer is then a Triton kernel and each may
    start while the one before it runs (programmatic dependent launch,
    eagle_kernels/triton/_pdl.py). EAGLE-3's two-input norm and the first layer's
    (``token_rows``) stay apart: four; a drafting pass of an EAGLE-3 head gets its normed input
    from the expansion step's launch (``normed``): three.

    Weights in the activations' dtype (fp32, fp16 or bf16), as is the cache, or Q8_0 block rows
    (a draft head's ``weight_dtype="q8_0"``): their GEMMs run ``q8_0_linear`` at half the bytes,
    the residual add in its epilogue, norms apart (the fused ops take 16-bit weights). Every row is
    computed. ``rope`` returns the pass's positions with the model's RoPE tables; the Triton
    ops run on CUDA tensors (and on CPU tensors with the triton backend under
    TRITON_INTERPRET=1, as the tests and the launch count run them)."""

    def __init__(self, config, packed: PackedWeights, tables: RopeTables, fp8: bool = False):
        super().__init__(config, packed)
        self.tables = tables
        self.fp8 = fp8

    @staticmethod
    def accepts(x: torch.Tensor, cache, layer: LayerWeights, weights: dict) -> bool:
        """fp32/fp16/bf16 activations, a cache of the same dtype, weight matrices of that dtype or
        Q8_0 block rows (a draft head's, run by ``q8_0_linear``), and nothing for autograd to record."""
        return GpuLayerPath.accepts_dtype(x.dtype, cache, layer, weights)

    @staticmethod
    def accepts_dtype(dtype, cache, layer: LayerWeights, weights: dict) -> bool:
        """:meth:`accepts` for activations of ``dtype``."""
        return (dtype in (torch.float32, torch.float16, torch.bfloat16) and cache.k.dtype == dtype
                and all(m.dtype == dtype or m.dtype == Q8_0_DTYPE for m in layer.matrices)
                and not (torch.is_grad_enabled() and any(t.requires_grad for t in weights.values())))

    def rope(self, inv_freq, positions, B, N, dtype, capacity=None):
        return positions.expand(B, N), inv_freq

    def __call__(self, x, layer, rope, cache, index, tree_mask=None, *, row_counts=None, embed=None, slot_offset=0,
                 normed=None):
        """``normed``: the layer's normed input, made before the call (an EAGLE-3 head's two input
        norms, in its expansion step's launch), with ``x`` the residual stream's copy to add to."""
        c = self.config
        positions, inv_freq = rope
        k_layer, v_layer = cache.layer(index)
        cos, sin = self.tables(inv_freq, k_layer.shape[1])
        rope_args = (positions, cos, sin, k_layer, v_layer, cache.seqlens)
        rope_kwargs = dict(num_heads=c.num_heads, slot_offset=slot_offset)
        q = None
        if isinstance(x, TokenRows):  # the first layer: embedding, input norm and positions in one launch
            h, residual, _ = bookkeeping.token_rows(x.tokens, x.table, layer.input_norm, c.rms_norm_eps,
                                                    cache.seqlens, x.depths, x.positions)
        elif normed is not None:
            h, residual = normed, x
        elif embed is None and self.folds(layer.qkv, x):  # norm (if any), copy, q/k/v GEMM, RoPE, KV write
            q, residual = ops.rmsnorm_qkv_rope(x, layer.qkv, layer.input_norm, c.rms_norm_eps, *rope_args,
                                               **rope_kwargs)
        elif layer.input_norm is None:
            h, residual = x, x.clone(memory_format=torch.contiguous_format)
        else:
            h, residual = ops.rmsnorm(x, layer.input_norm, c.rms_norm_eps, embed=embed, embed_weight=layer.embed_norm)
        B, N, H = residual.shape
        if q is None and self.folds(layer.qkv, h):  # a normed input: the GEMM, RoPE and KV write (h's copy unused)
            q, _ = ops.rmsnorm_qkv_rope(h, layer.qkv, None, c.rms_norm_eps, *rope_args, **rope_kwargs)
        elif q is None:
            qkv = self.project(h.reshape(B * N, -1), layer.qkv).view(B, N, -1)
            q = ops.rope_write_kv(qkv, *rope_args, **rope_kwargs)
        attention = ops.tree_attention(q, k_layer, v_layer, cache.seqlens, tree_mask)
        if slot_offset:
            attention = attention[:, slot_offset:]
        if self.one_launch_after_attention(layer, residual):
            return ops.o_proj_mlp(attention.reshape(B * N, -1), residual.view(B * N, H), layer.o, layer.post_norm,
                                  layer.gate_up, layer.down, c.rms_norm_eps).view(B, N, H)
        rows = self.project(attention.reshape(B * N, -1), layer.o, residual.view(B * N, H))
        if self.folds(layer.gate_up, rows):
            activation, _ = ops.rmsnorm_linear(rows, layer.gate_up, layer.post_norm, c.rms_norm_eps, gated=True)
        else:
            h, _ = ops.rmsnorm(rows, layer.post_norm, c.rms_norm_eps)
            activation = ops.silu_mul(self.project(h, layer.gate_up))
        return self.project(activation, layer.down, rows).view(B, N, H)

    def one_launch_after_attention(self, layer: LayerWeights, residual: torch.Tensor) -> bool:
        """Whether the o, gate/up and down GEMMs run as one ``o_proj_mlp`` launch: each would be a
        Triton ``rmsnorm_linear`` launch (:meth:`folds`, the residual GEMMs in Triton) and the
        layer has a post-attention norm."""
        return (O_PROJ_MLP_IN_ONE_LAUNCH and RESIDUAL_GEMMS_IN_TRITON and layer.post_norm is not None
                and all(self.folds(m, residual) for m in (layer.o, layer.gate_up, layer.down)))

    def folds(self, matrix: torch.Tensor, x: torch.Tensor) -> bool:
        """:meth:`fuses`, and this path multiplies ``matrix`` as stored (not an fp8 copy)."""
        return not self.fp8 and self.fuses(matrix, x)

    def project(self, x: torch.Tensor, matrix: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``[residual +] x @ matrix.T`` for rows ``x`` [R, K]: cuBLAS, added into ``residual`` in place
        (``addmm_``: its epilogue, no copy) and returned; or for Q8_0 block rows ``q8_0_linear``, and
        on an fp8 path ``fp8_linear`` over the matrix's fp8 copy; or, with a residual and a matrix
        that :meth:`folds`, ``rmsnorm_linear`` without a norm (a Triton launch, chained
        to the layer's others by programmatic dependent launch). These add the residual into a
        new tensor in their epilogue."""
        if matrix.dtype == Q8_0_DTYPE:
            return ops.q8_0_linear(x, *self.packed.q8_0_split(matrix), residual=residual)
        if self.fp8:
            return ops.fp8_linear(x, *self.packed.fp8_copy(matrix), residual=residual)
        if residual is None:
            return torch.mm(x, matrix.t())
        if RESIDUAL_GEMMS_IN_TRITON and self.folds(matrix, x):
            return ops.rmsnorm_linear(x, matrix, None, self.config.rms_norm_eps, add=residual)[0]
        return residual.addmm_(x, matrix.t())

    @staticmethod
    def fuses(matrix: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether a norm and the GEMM by ``matrix`` over the rows of ``x`` run as one ``rmsnorm_linear``."""
        return (matrix.dtype != Q8_0_DTYPE and matrix.numel() * matrix.element_size() <= FUSED_NORM_MAX_MATRIX_BYTES
                and x.numel() // max(x.shape[-1], 1) <= FUSED_NORM_MAX_ROWS)


class LayerPaths:
    """The layer paths of one model; :meth:`pick` chooses one per forward pass."""

    def __init__(self, config, packed: PackedWeights):
        self.config, self.packed = config, packed
        self.rope_tables = RopeTables()
        self.fp8_matrices = False  # the GPU path multiplies fp8 copies of the matrices (an "fp8" draft head)
        # CPU tensors take the GPU layer path too (private: the launch count and the tests run
        # it there under TRITON_INTERPRET=1 with the triton backend).
        self._gpu_path_on_cpu = False

    def on_gpu_path(self, device) -> bool:
        """Whether passes over tensors on ``device`` may take the GPU path (its dtypes permitting)."""
        return device.type != "cpu" or self._gpu_path_on_cpu

    def _norm_op(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether a norm of ``x`` by ``weight`` outside the layers runs as an op (the GPU path's
        dtypes, no autograd)."""
        return (self.on_gpu_path(x.device) and weight.dtype == x.dtype
                and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm outside its layers (the final norm): the ``rmsnorm`` op (one
        launch) where the GPU path runs, else :func:`rms_norm`."""
        if self._norm_op(x, weight):
            return ops.rmsnorm(x, weight, self.config.rms_norm_eps)[0]
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def norm_linear(self, x: torch.Tensor, weight: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor | None:
        """``norm(x, weight) @ matrix.T`` as one ``rmsnorm_linear`` launch where the GPU path runs
        and the matrix is small enough (:meth:`GpuLayerPath.fuses`: an EAGLE-3 head's draft LM
        head, not a target's); None where the caller norms and multiplies apart, and where the GPU
        path multiplies fp8 copies of the matrices."""
        if (self._norm_op(x, weight) and not self.fp8_matrices and matrix.dtype == x.dtype
                and GpuLayerPath.fuses(matrix, x)):
            return ops.rmsnorm_linear(x, matrix, weight, self.config.rms_norm_eps)[0]
        return None

    def gpu_path(self, device, dtype, cache, weights: dict, layer: Callable[[], LayerWeights]) -> GpuLayerPath | None:
        """The GPU layer path for a pass of ``dtype`` activations on ``device``, where it runs
        (see :meth:`pick`); else None."""
        if self.on_gpu_path(device) and GpuLayerPath.accepts_dtype(dtype, cache, layer(), weights):
            return GpuLayerPath(self.config, self.packed, self.rope_tables, fp8=self.fp8_matrices)
        return None

    def pick(self, x: torch.Tensor, cache, weights: dict, normed_input: bool = True,
             layer: Callable[[], LayerWeights] | None = None) -> LayerPath:
        """The path for a pass over ``x`` [B, N, H] (the layer input) with ``cache``;
        ``normed_input`` False (a layer without input norm) rules out the fused CPU kernel;
        ``layer`` returns one of the pass's layers, for the GPU path to check its weights' dtype
        (called only off the CPU: a CPU pass does not pay for it)."""
        if layer is not None:
            gpu = self.gpu_path(x.device, x.dtype, cache, weights, layer)
            if gpu is not None:
                return gpu
        if x.device.type != "cpu":
            return TorchLayerPath(self.config, self.packed)
        policy = cpu_policy()
        if normed_input and CpuFusedLayerPath.accepts(x, cache, weights, policy):
            return CpuFusedLayerPath(self.config, self.packed, policy, self.rope_tables)
        return TorchLayerPath(self.config, self.packed, policy)
