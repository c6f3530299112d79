"""A Llama-family decoder whose attention runs on eagle_kernels' cache-aware ops.

One forward pass serves prefill (ragged prompts, causal), plain decoding (N = 1) and the
verify pass of speculative decoding (N tree nodes, positions ``cache_seqlens + depths``, the
tree's ancestor bit-mask). New K/V are written at slots ``cache_seqlens + i`` (slot order =
node order, as the ops' contract requires); the caller advances ``cache_seqlens`` (and, after a
verify, compacts the accepted path with ``compact_kv``).

On CPU the linear layers of decoding and verification (at most ``CPU_LINEAR_MAX_ROWS`` rows)
run the ``cpu_linear`` kernel, and the weight matrices may be stored in bf16 while everything
is computed in fp32 (``weight_dtype=torch.bfloat16``): the model then reads half the bytes per
token. Such passes run each decoder layer as one ``cpu_decoder_layer`` call (the same kernels
without a Python round trip per operator; ``EAGLE_KERNELS_CPU_LAYER=ops`` runs the layer op by
op instead).
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import _dispatch, ops

# cpu_linear streams each weight row once for all rows of x, which pays while x stays in cache;
# larger calls (long prefills, batched prefills) go to torch's GEMM. With the AVX-512VL build
# (x tiles of 6 rows) the kernel ran 1.1-1.8x torch's GEMM at 16-256 rows on SmolLM2's shapes
# and a prefill as one call per layer took 121 against 171 ms at 96 tokens, 362 against 446 ms
# at 250 (2 threads, AMD EPYC Zen 4); at 512 rows they were even.
CPU_LINEAR_MAX_ROWS = 256
CPU_LINEAR_ENV = "EAGLE_KERNELS_CPU_LINEAR"  # auto (default: packed weights), rows or torch
CPU_LAYER_ENV = "EAGLE_KERNELS_CPU_LAYER"  # auto (default: cpu_decoder_layer) or ops


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf) -> "LlamaConfig":
        """From a transformers ``LlamaConfig`` (v4 ``rope_scaling`` or v5 ``rope_parameters``)."""
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        theta = rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0))
        scaling = rope or getattr(hf, "rope_scaling", None)
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        eos = hf.eos_token_id[0] if isinstance(hf.eos_token_id, (list, tuple)) else hf.eos_token_id
        return cls(
            vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            rms_norm_eps=hf.rms_norm_eps, rope_theta=float(theta), rope_scaling=scaling,
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            max_position_embeddings=hf.max_position_embeddings, bos_token_id=hf.bos_token_id,
            eos_token_id=eos)


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] in float64, with linear or Llama-3 scaling."""
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


def cached_attention(q, k, v, cache: "KVCache", layer: int, tree_mask, slot_offset: int = 0):
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


def _cpu_linear_mode() -> str:
    mode = os.environ.get(CPU_LINEAR_ENV, "auto")
    if mode not in ("auto", "rows", "torch"):
        raise ValueError(f"{CPU_LINEAR_ENV}: expected auto, rows or torch, got {mode!r}")
    return mode


def _cpu_linear_enabled() -> bool:
    return (_cpu_linear_mode() != "torch" and ("cpu_linear", "cpu") in _dispatch.NATIVE_KERNELS
            and os.environ.get(_dispatch.BACKEND_ENV, "auto") in ("auto", "cpp"))


def _packed_kernel_pays() -> bool:
    """Whether cpu_linear runs its AVX-512 path (the CPU has it, EAGLE_KERNELS_CPU_ISA does not
    cap it): there the packed layout is the faster one. The AVX2 path of the packed kernel (tiles
    of one half of a group x up to 6 rows in 16 registers) measured 1.3-1.5x slower than the
    row-major AVX2 kernel at 8-12 rows, so an AVX2 CPU keeps the row-major weights."""
    return (torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")
            and os.environ.get("EAGLE_KERNELS_CPU_ISA", "avx512") in ("avx512", "avx512-ymm", ""))


class PackedWeights:
    """``cpu_linear_pack`` copies of weight matrices, made on first use and kept while the matrix
    lives. On CPU the model's linear layers (and ``cpu_decoder_layer``) read the packed copy: a
    GEMM micro-kernel with x broadcast from memory, where the row-major layout reloads x for
    every four outputs (one SmolLM2 forward's linear layers, 2 threads, AVX-512: 19.2 against
    20.6 ms at one row, 23.1 against 28.3 ms at 12). The row-major matrix stays for torch's
    paths (long prefills, autograd, other devices): packing costs one more copy of the matrices.

    A copy is keyed by the matrix's identity and checked against its version counter, so an
    in-place update (an optimizer step on a head being trained) repacks it on the next call.
    ``EAGLE_KERNELS_CPU_LINEAR=rows`` keeps the row-major kernel (no copies)."""

    def __init__(self):
        self._copies = {}  # id(matrix) -> (weakref to it, its version when packed, packed copy)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weight`` [N, K], or ``weight`` itself where packing does not
        apply (``rows`` mode, a CPU without AVX-512, N not a multiple of 32, not a 2-D CPU
        matrix)."""
        if _cpu_linear_mode() != "auto" or not _packed_kernel_pays():
            return weight
        key = id(weight)
        hit = self._copies.get(key)
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return hit[2]  # on every linear call: the shape checks below ran when it was packed
        if weight.dim() != 2 or weight.shape[0] % ops.PACK_WIDTH or weight.device.type != "cpu":
            return weight
        packed = ops.cpu_linear_pack(weight)
        copies = self._copies
        forget = weakref.ref(weight, lambda _, key=key: copies.pop(key, None))  # the copy goes with the matrix
        self._copies[key] = (forget, weight._version, packed)
        return packed


cpu_packed = PackedWeights()  # one for every model and head in the process: tied weights pack once


def pack_now(matrices, compute_dtype: torch.dtype) -> None:
    """Make the packed copies of a CPU model's matrices at load time (fp32 compute, the
    cpu_linear kernel on): loading then settles the memory, and the first forward pass does not
    pay for the packing."""
    if compute_dtype == torch.float32 and _cpu_linear_enabled():
        for matrix in matrices:
            if matrix.device.type == "cpu":
                cpu_packed(matrix)


def _cpu_layer_enabled() -> bool:
    mode = os.environ.get(CPU_LAYER_ENV, "auto")
    if mode not in ("auto", "ops"):
        raise ValueError(f"{CPU_LAYER_ENV}: expected auto or ops, got {mode!r}")
    return mode == "auto" and ("cpu_decoder_layer", "cpu") in _dispatch.NATIVE_KERNELS and _cpu_linear_enabled()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) in ``x.dtype``, for a weight stored in ``x.dtype`` or
    narrower (bf16 weights of an fp32 model). fp32 CPU calls of at most ``CPU_LINEAR_MAX_ROWS``
    rows run the ``cpu_linear`` kernel (fp32, bf16 or fp16 weight read as is); every other call runs
    torch, widening a narrower weight for that call only (prefill: no second fp32 copy of the
    weights is kept). ``EAGLE_KERNELS_CPU_LINEAR=torch`` sends every call to torch, and so does
    a call autograd records (the kernel has no backward; training shares this function).

    Shapes
    ------
    x [..., K]; weight [N, K]; returns [..., N].
    """
    if (x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.numel() <= CPU_LINEAR_MAX_ROWS * x.shape[-1] and _cpu_linear_enabled()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return torch.ops.eagle_kernels.cpu_linear(x, cpu_packed(weight))
    return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))


def swiglu(h: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    gate = F.silu(linear(h, w[prefix + "mlp.gate_proj.weight"]))
    return linear(gate * linear(h, w[prefix + "mlp.up_proj.weight"]), w[prefix + "mlp.down_proj.weight"])


QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")


class FusedProjections:
    """Projections of one input served as one matrix (q/k/v, gate/up): one linear call reads
    them in one weight stream, with fewer calls and parallel regions per layer. A cpu_linear
    output column does not depend on the other weight rows, so on CPU the results are bit for
    bit those of separate calls.

    The fused matrix is built on first use and the weights dict's entries are re-pointed at
    views of its rows (no second copy). Entries replaced later (a new tensor under a name) are
    noticed by identity and fused again."""

    def __init__(self):
        self._built = {}  # (prefix, names) -> (the views handed out, the fused matrix)

    def __call__(self, weights: dict, prefix: str, names: tuple) -> torch.Tensor:
        parts = [weights[prefix + name] for name in names]
        built = self._built.get((prefix, names))
        if built is not None and all(a is b for a, b in zip(built[0], parts)):
            return built[1]
        fused = torch.cat(parts)
        views, start = [], 0
        for name, part in zip(names, parts):
            views.append(fused[start:start + part.shape[0]])
            weights[prefix + name] = views[-1]
            start += part.shape[0]
        self._built[(prefix, names)] = (views, fused)
        return fused


def attention_projections(h, w: dict, prefix: str, fused: FusedProjections, num_heads: int, num_kv_heads: int,
                          head_dim: int, cos, sin):
    """q, k (RoPE applied, one pass over both) and v from one fused q/k/v linear call.
    h [B, N, K]; returns q [B, N, Hq, D], k and v [B, N, Hkv, D] (views of one buffer)."""
    B, N = h.shape[:2]
    qkv = linear(h, fused(w, prefix, QKV)).view(B, N, num_heads + 2 * num_kv_heads, head_dim)
    q, k = rotate(qkv[:, :, :num_heads + num_kv_heads], cos, sin).split([num_heads, num_kv_heads], dim=2)
    return q, k, qkv[:, :, num_heads + num_kv_heads:]


def gated_mlp(h: torch.Tensor, w: dict, prefix: str, fused: FusedProjections) -> torch.Tensor:
    """SwiGLU with gate and up in one linear call (the same as :func:`swiglu`)."""
    gate, up = linear(h, fused(w, prefix, GATE_UP)).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w[prefix + "mlp.down_proj.weight"])


def default_positions(cache: "KVCache", num_tokens: int) -> torch.Tensor:
    return cache.seqlens[:, None].long() + torch.arange(num_tokens, device=cache.seqlens.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32:
        # One op instead of seven; the same arithmetic in the same order (bit-identical).
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    wide = x.to(torch.promote_types(x.dtype, torch.float32))  # half inputs normalise in fp32
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)


@dataclass
class KVCache:
    """Preallocated contiguous cache: k, v [L, B, S, Hkv, D]; seqlens int32 [B] committed tokens."""

    k: torch.Tensor
    v: torch.Tensor
    seqlens: torch.Tensor
    _layers: tuple = field(default=(None, None, ()), init=False, repr=False, compare=False)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k[index], v[index] [B, S, Hkv, D]: views made once per cache (indexing makes a new
        view per call, a few microseconds each, four times per layer and pass), remade if
        ``k`` or ``v`` is replaced."""
        k, v, views = self._layers
        if k is not self.k or v is not self.v:
            views = tuple(zip(self.k.unbind(0), self.v.unbind(0)))
            self._layers = (self.k, self.v, views)
        return views[index]

    @classmethod
    def allocate(cls, config: LlamaConfig, batch: int, capacity: int, dtype, device) -> "KVCache":
        shape = (config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(batch, dtype=torch.int32, device=device))


@dataclass
class ForwardOutput:
    """logits [B, N, V] float32 ([B, P, V] with P ``logit_rows``); hidden [B, N, H]: the final
    normed hidden state (EAGLE-1's feature); layer_states: {layer index: [B, N, H] output of
    that layer} (EAGLE-3's features)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    layer_states: dict = field(default_factory=dict)


def is_matrix_weight(name: str) -> bool:
    """The weights ``weight_dtype`` applies to: projections, embedding and LM head (not norms)."""
    return name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight"))


class LlamaModel(torch.nn.Module):
    """Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU, tied or untied LM head).

    ``weights`` hold the compute dtype (``model.dtype``: activations, norms, KV cache).
    ``weight_dtype`` (e.g. ``torch.bfloat16`` for an fp32 model on CPU) stores the weight
    matrices narrower: they are converted once here (tied embedding and LM head stay one
    tensor) and widened exactly inside the ``cpu_linear`` kernel; see :func:`linear`.
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], weight_dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        if "lm_head.weight" not in weights:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        self._dtype = weights["model.embed_tokens.weight"].dtype
        if weight_dtype is not None and weight_dtype != self._dtype:
            if not weight_dtype.is_floating_point:
                raise ValueError(f"weight_dtype: expected a floating dtype, got {weight_dtype}")
            narrowed = {}  # by memory, so tied weights (one tensor or two views of it) stay one tensor
            for name, t in weights.items():
                if is_matrix_weight(name):
                    key = (t.data_ptr(), tuple(t.shape), t.stride())
                    if key not in narrowed:
                        narrowed[key] = t.to(weight_dtype)
            weights = {name: narrowed[(t.data_ptr(), tuple(t.shape), t.stride())] if is_matrix_weight(name) else t
                       for name, t in weights.items()}
        self.weights = weights  # names as in transformers' LlamaForCausalLM state dict
        self.fused = FusedProjections()
        matrices = [weights["lm_head.weight"]]  # what the CPU kernels read, packed below
        for layer in range(config.num_layers):  # fuse (and pack) now, so that loading settles the memory
            p = f"model.layers.{layer}."
            matrices += [self.fused(weights, p, names) for names in (QKV, GATE_UP)]
            matrices += [weights[p + "self_attn.o_proj.weight"], weights[p + "mlp.down_proj.weight"]]
        pack_now(matrices, self.dtype)
        # On the weights' device: a CPU inv_freq would not broadcast against CUDA positions.
        self.register_buffer("inv_freq", rope_inverse_frequencies(config).to(self.device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype (activations, norms, KV cache)."""
        return self._dtype

    @property
    def weight_dtype(self) -> torch.dtype:
        """Storage dtype of the weight matrices."""
        return self.weights["model.embed_tokens.weight"].dtype

    @property
    def device(self) -> torch.device:
        return self.weights["model.embed_tokens.weight"].device

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_transformers(cls, model, dtype=None, device=None, weight_dtype=None) -> "LlamaModel":
        """From a transformers ``LlamaForCausalLM`` (weights are copied to ``dtype``/``device``;
        ``weight_dtype`` as in the constructor)."""
        config = LlamaConfig.from_hf(model.config)
        weights = {name: t.detach().to(device=device, dtype=dtype or t.dtype).contiguous()
                   for name, t in model.state_dict().items() if not name.endswith("rotary_emb.inv_freq")}
        return cls(config, weights, weight_dtype=weight_dtype)

    @classmethod
    def from_pretrained(cls, path: str, gguf_file: str | None = None, dtype=None, device=None,
                        weight_dtype=None) -> "LlamaModel":
        """From a folder with config.json + safetensors, or (``gguf_file``) a GGUF file read
        through transformers."""
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
        return cls.from_transformers(hf, dtype=dtype, device=device, weight_dtype=weight_dtype)

    def new_cache(self, batch: int, capacity: int, dtype=None) -> KVCache:
        return KVCache.allocate(self.config, batch, capacity, dtype or self.dtype, self.device)

    # ------------------------------------------------------------------ forward
    def forward(self, tokens, cache: KVCache, positions=None, tree_mask=None, feature_layers=(), logit_rows=None,
                row_counts=None):
        """Run N new tokens per request against the cache.

        Shapes
        ------
        tokens int64 [B, N]; positions int64/int32 [B, N] (default ``cache.seqlens + arange(N)``,
        for a tree ``cache.seqlens + depths``); tree_mask int64 [B, N, ceil(N / 64)] or None
        (causal). K/V of token i are written at ``cache.seqlens[b] + i``; ``cache.seqlens`` is
        not changed. logit_rows int64 [B, P] (default: all N): the token indices whose logits
        are computed, so ``logits`` is [B, P, V]; a prefill needs only each prompt's last one,
        and the LM head over every prompt token is a sixth of a prefill's arithmetic.
        row_counts int64 [B] (with ``logit_rows`` None): token rows ``i >= row_counts[b]`` are
        padding, whose hidden states, layer states, logits and K/V are unspecified (finite), and
        which the cpu_decoder_layer path does not compute (a batch verifying trees of different
        sizes); the other rows must not have padding among their ancestors.
        """
        c, w = self.config, self.weights
        B, N = tokens.shape
        if positions is None:
            positions = default_positions(cache, N)
        x = F.embedding(tokens, w["model.embed_tokens.weight"]).to(self.dtype)
        states = {}
        fused_layer = layer_kernel(x, cache, w)
        if fused_layer is not None:
            cos, sin = rope_cos_sin_rows(self.inv_freq, positions, B, N, self.dtype)
        else:
            cos, sin = rope_cos_sin(self.inv_freq, positions, self.dtype)
        for layer in range(c.num_layers):
            p = f"model.layers.{layer}."
            if fused_layer is not None:
                k_layer, v_layer = cache.layer(layer)
                x = fused_layer(x, w[p + "input_layernorm.weight"], cpu_packed(self.fused(w, p, QKV)),
                                cpu_packed(w[p + "self_attn.o_proj.weight"]), w[p + "post_attention_layernorm.weight"],
                                cpu_packed(self.fused(w, p, GATE_UP)), cpu_packed(w[p + "mlp.down_proj.weight"]),
                                cos, sin, k_layer, v_layer,
                                cache.seqlens, tree_mask, num_heads=c.num_heads, eps=c.rms_norm_eps,
                                row_counts=row_counts)
                if layer in feature_layers:
                    states[layer] = x
                continue
            h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q, k, v = attention_projections(h, w, p, self.fused, c.num_heads, c.num_kv_heads, c.head_dim, cos, sin)
            attn = cached_attention(q, k, v, cache, layer, tree_mask)
            x = x + linear(attn, w[p + "self_attn.o_proj.weight"])
            x = x + gated_mlp(rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps), w, p, self.fused)
            if layer in feature_layers:
                states[layer] = x
        hidden = rms_norm(x, w["model.norm.weight"], c.rms_norm_eps)
        if fused_layer is not None and row_counts is not None and logit_rows is None:
            # The LM head over the computed rows only; padding rows get zero logits.
            computed = (torch.arange(N, device=x.device)[None] < row_counts[:, None]).view(-1)
            logits = torch.empty(B * N, c.vocab_size, dtype=torch.float32, device=x.device)
            logits[computed] = linear(hidden.view(B * N, -1)[computed], w["lm_head.weight"]).float()
            logits[~computed] = 0.0
            return ForwardOutput(logits.view(B, N, -1), hidden, states)
        rows = hidden if logit_rows is None else torch.gather(
            hidden, 1, logit_rows[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = linear(rows, w["lm_head.weight"]).float()
        return ForwardOutput(logits, hidden, states)


def layer_kernel(x: torch.Tensor, cache: KVCache, weights: dict):
    """The ``cpu_decoder_layer`` kernel when a pass over ``x`` [B, N, H] can run each layer as
    one call: fp32 on CPU with a fp32 cache, at most ``CPU_LINEAR_MAX_ROWS`` rows (the cpu_linear
    regime), nothing for autograd to record in ``weights``; else None (the layer runs op by op)."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and cache.k.dtype == torch.float32
            and x.shape[0] * x.shape[1] <= CPU_LINEAR_MAX_ROWS and _cpu_layer_enabled()):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in weights.values()):
        return None
    return torch.ops.eagle_kernels.cpu_decoder_layer
