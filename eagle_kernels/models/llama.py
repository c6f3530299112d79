"""A Llama-family decoder whose attention runs on eagle_kernels' cache-aware ops.

One forward pass serves prefill (ragged prompts, causal), plain decoding (N = 1) and the
verify pass of speculative decoding (N tree nodes, positions ``cache_seqlens + depths``, the
tree's ancestor bit-mask). New K/V are written at slots ``cache_seqlens + i`` (slot order =
node order, as the ops' contract requires); the caller advances ``cache_seqlens`` (and, after a
verify, compacts the accepted path with ``compact_kv``).

The layers run through :mod:`.layers` (one path per pass: op by op, five to nine launches a layer on a GPU,
or on CPU one ``cpu_decoder_layers`` call for the whole stack); the CPU weight policy (the
``cpu_linear`` kernel, bf16 weight storage, packed copies, the environment switches) lives in
:mod:`.cpu_weights`.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .._inference import versions
from .._inputs import check_device, check_dtype
from ..bookkeeping import gpu_path, tree_positions
from .cpu_weights import (
    CPU_LAYER_ENV,
    CPU_LINEAR_ENV,
    CPU_LINEAR_MAX_ROWS,
    PackedWeights,
    cpu_policy,
    is_quantized,
    linear,
)
from .layers import (
    GATE_UP,
    KV_CACHE_DTYPES,
    QKV,
    FusedProjections,
    LayerPaths,
    LayerWeights,
    TokenRows,
    default_positions,
    rms_norm,
    rope_cos_sin,
    rope_inverse_frequencies,
    rotate,
    stack_lists,
    swiglu,
)

# Imported from here by the training code, the tests and the benchmarks.
__all__ = ["LlamaConfig", "LlamaModel", "KVCache", "ForwardOutput", "CPU_LAYER_ENV", "CPU_LINEAR_ENV",
           "CPU_LINEAR_MAX_ROWS", "linear", "rms_norm", "rope_cos_sin", "rope_inverse_frequencies", "rotate",
           "swiglu", "default_positions"]


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
    def from_hf(cls, hf) -> LlamaConfig:
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
    def allocate(cls, config: LlamaConfig, batch: int, capacity: int, dtype, device) -> KVCache:
        shape = (config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(batch, dtype=torch.int32, device=device))


@dataclass
class ForwardOutput:
    """logits [B, N, V] ([B, P, V] with P ``logit_rows``); hidden [B, N, H]: the final
    normed hidden state (EAGLE-1's feature); layer_states: {layer index: [B, N, H] output of
    that layer} (EAGLE-3's features). The logits are float32 on the CPU and in the model's dtype
    elsewhere (see :func:`logits_for_ops`)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    layer_states: dict = field(default_factory=dict)


def logits_for_ops(logits: torch.Tensor) -> torch.Tensor:
    """The dtype logits take on their way to ``verify`` and ``draft_expand``: float32 on the CPU
    (the C++ kernels' fastest and bit-stable input), the model's own 16-bit dtype on a GPU, where a
    float32 copy of a [B, N, V] tensor would cost a launch and twice the bytes the ops then read
    (both ops take fp16/bf16 logits and compute in float32 internally), and on the launch
    count's forced GPU path (:func:`eagle_kernels.bookkeeping.gpu_path`)."""
    return logits if gpu_path(logits) else logits.float()


def _check_load_arguments(dtype, device, weight_dtype) -> None:
    check_dtype("dtype", dtype)
    check_dtype("weight_dtype", weight_dtype)
    check_device("device", device)


def is_matrix_weight(name: str) -> bool:
    """The weights ``weight_dtype`` applies to: projections, embedding and LM head (not norms)."""
    return name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight"))


class LlamaModel(torch.nn.Module):
    """Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU, tied or untied LM head).

    ``weights`` hold the compute dtype (``model.dtype``: activations, norms, KV cache).
    ``weight_dtype`` (e.g. ``torch.bfloat16`` for an fp32 model on CPU) stores the weight
    matrices narrower: they are converted once here (tied embedding and LM head stay one
    tensor) and widened exactly inside the ``cpu_linear`` kernel; see :func:`linear`.
    The model works on its own copy of the ``weights`` dict (it adds a tied LM head and
    re-points q/k/v and gate/up at views of their fused matrices), so the caller's dict is left
    as it was; tensors the caller keeps in it stay alive beside the fused ones.
    ``kv_cache_dtype`` (default: the compute dtype) is the dtype of the caches :meth:`new_cache`
    makes: ``torch.bfloat16`` or ``torch.float16`` for an fp32 model stores K/V in 16 bits (as
    llama.cpp's default F16 cache), which halves the bytes attention reads per token; k, v and q
    are rounded to it and attention runs in it (on the CPU, bf16 dot products where the CPU has
    them), so outputs differ from an fp32 cache by that rounding. Greedy speculative decoding still
    equals plain decoding with the same cache dtype (fp16: by construction; bf16 on CPUs with
    AVX512_BF16: measured, see docs/cpu_kernels.md).
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], weight_dtype: torch.dtype | None = None,
                 *, activations: str = "fp32", kv_cache_dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        weights = dict(weights)  # the model's own (see above)
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
        self._dtype = weights["model.embed_tokens.weight"].dtype
        if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {', '.join(map(str, KV_CACHE_DTYPES))} or None, "
                             f"got {kv_cache_dtype}")
        self._kv_cache_dtype = kv_cache_dtype
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
        if activations != "fp32" and not any(is_quantized(t) for t in weights.values()):
            raise ValueError(f"activations: {activations!r} needs quantized (Q8_0 / Q4_1) matrices; this model's "
                             f"are {weights['lm_head.weight'].dtype}")
        self.packed = PackedWeights(activations)  # this model's packed copies (see cpu_weights)
        self.layer_paths = LayerPaths(config, self.packed)
        self._prefixes = [f"model.layers.{layer}." for layer in range(config.num_layers)]
        # Per layer: the names LayerWeights.from_weights reads, and the last (entries read, LayerWeights).
        names = ("input_layernorm.weight",) + QKV + ("self_attn.o_proj.weight", "post_attention_layernorm.weight") \
            + GATE_UP + ("mlp.down_proj.weight",)
        self._layer_entries = [operator.itemgetter(*(prefix + n for n in names)) for prefix in self._prefixes]
        self._all_entries = operator.itemgetter(*(prefix + n for prefix in self._prefixes for n in names))
        self._layer_cache: list = [None] * config.num_layers
        self._stack_lists_cache = None  # (policy, generation, entries, matrices, versions, lists): _stack_lists
        # Fuse and pack now, so that loading settles the memory.
        matrices = [weights["lm_head.weight"]] + [m for layer in range(config.num_layers)
                                                  for m in self.layer_weights(layer).matrices]
        self.packed.pack_all(matrices, self.dtype)
        # On the weights' device: a CPU inv_freq would not broadcast against CUDA positions.
        self.register_buffer("inv_freq", rope_inverse_frequencies(config).to(self.device), persistent=False)

    def layer_weights(self, layer: int) -> LayerWeights:
        """Decoder layer ``layer``'s tensors (read from ``weights`` on every call, so that a
        weight replaced under its name is used from then on). The last result is kept while the
        entries it was made from are the very tensors under those names: building one (q/k/v and
        gate/up fused) cost about 15 us, 30 times per forward pass; this check is a tenth of it."""
        w = self.weights
        entries = self._layer_entries[layer](w)
        hit = self._layer_cache[layer]
        if hit is not None and all(map(operator.is_, hit[0], entries)):
            return hit[1]
        made = LayerWeights.from_weights(w, self._prefixes[layer], self.fused)
        # Read again: fusing re-points the q/k/v and gate/up entries at views of the fused matrices.
        self._layer_cache[layer] = (self._layer_entries[layer](w), made)
        return made

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype (activations, norms, KV cache)."""
        return self._dtype

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype of the caches :meth:`new_cache` makes (the compute dtype unless given)."""
        return self._kv_cache_dtype or self._dtype

    @property
    def activations(self) -> str:
        """How the quantized matrices multiply: ``"fp32"`` or ``"int8"`` activations (see ``cpu_weights``)."""
        return self.packed.activations

    @property
    def weight_dtype(self) -> torch.dtype:
        """Storage dtype of the weight matrices."""
        return self.weights["model.embed_tokens.weight"].dtype

    @property
    def device(self) -> torch.device:
        return self.weights["model.embed_tokens.weight"].device

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_transformers(cls, model, dtype=None, device=None, weight_dtype=None) -> LlamaModel:
        """From a transformers ``LlamaForCausalLM`` (weights are copied to ``dtype``/``device``;
        ``weight_dtype`` as in the constructor)."""
        _check_load_arguments(dtype, device, weight_dtype)
        config = LlamaConfig.from_hf(model.config)
        weights = {name: t.detach().to(device=device, dtype=dtype or t.dtype).contiguous()
                   for name, t in model.state_dict().items() if not name.endswith("rotary_emb.inv_freq")}
        return cls(config, weights, weight_dtype=weight_dtype)

    @classmethod
    def from_pretrained(cls, path: str, gguf_file: str | None = None, dtype=None, device=None,
                        weight_dtype=None) -> LlamaModel:
        """From a folder with config.json + safetensors, or (``gguf_file``) a GGUF file read
        through transformers.

        Raises
        ------
        FileNotFoundError
            ``path`` (or ``path/gguf_file``) does not exist.
        TypeError, ValueError
            ``dtype`` / ``weight_dtype`` not a floating ``torch.dtype``, ``device`` not a device."""
        from transformers import AutoModelForCausalLM

        _check_load_arguments(dtype, device, weight_dtype)
        source = path if gguf_file is None else os.path.join(path, gguf_file)
        if not os.path.exists(source):
            raise FileNotFoundError(f"path: {source!r} does not exist")
        hf = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
        return cls.from_transformers(hf, dtype=dtype, device=device, weight_dtype=weight_dtype)

    def new_cache(self, batch: int, capacity: int, dtype=None) -> KVCache:
        """A zeroed cache of ``capacity`` positions per request, in ``dtype`` (default :attr:`kv_cache_dtype`)."""
        return KVCache.allocate(self.config, batch, capacity, dtype or self.kv_cache_dtype, self.device)

    # ------------------------------------------------------------------ forward
    def forward(self, tokens, cache: KVCache, positions=None, tree_mask=None, feature_layers=(), logit_rows=None,
                row_counts=None, depths=None):
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
        depths int32 [B, N] (instead of ``positions``): a tree's node depths, positions
        ``cache.seqlens + depths`` (int32), which the GPU layer path makes in its first launch
        with the embedding and the first input norm.
        """
        c, w = self.config, self.weights
        B, N = tokens.shape
        if positions is not None and depths is not None:
            raise ValueError("positions, depths: give one of them")
        whole = self._cpu_forward(tokens, cache, positions, depths, tree_mask, feature_layers, logit_rows, row_counts)
        if whole is not None:
            return whole
        table = w["model.embed_tokens.weight"]
        path = None
        if (gpu_path(tokens) and table.dtype == self.dtype and table.stride(1) == 1 and table.device == tokens.device
                and self.layer_weights(0).input_norm is not None):
            path = self.layer_paths.gpu_path(tokens.device, self.dtype, cache, w, layer=lambda: self.layer_weights(0))
        if path is not None:
            # The GPU layer path's first launch embeds the tokens, norms them and (a tree) makes the positions.
            if positions is None and depths is None:
                positions = default_positions(cache, N)
            if depths is not None:
                positions = torch.empty(B, N, dtype=torch.int32, device=tokens.device)
            x = TokenRows(tokens, table, depths, positions if depths is not None else None)
        else:
            if positions is None:
                positions = default_positions(cache, N) if depths is None else tree_positions(cache.seqlens, depths)
            x = F.embedding(tokens, table).to(self.dtype)
            path = self.layer_paths.pick(x, cache, w, layer=lambda: self.layer_weights(0))
        rope = path.rope(self.inv_freq, positions, B, N, self.dtype, capacity=cache.k.shape[-3])
        layers = [self.layer_weights(layer) for layer in range(c.num_layers)]
        x, states = path.run_layers(x, layers, rope, cache, tree_mask, row_counts=row_counts,
                                    state_layers=feature_layers)
        hidden = self.layer_paths.norm(x, w["model.norm.weight"])
        if not path.computes_padding_rows and row_counts is not None and logit_rows is None:
            # The LM head over the computed rows only; padding rows get zero logits.
            computed = (torch.arange(N, device=x.device)[None] < row_counts[:, None]).view(-1)
            computed_logits = logits_for_ops(self.linear(hidden.view(B * N, -1)[computed], w["lm_head.weight"]))
            logits = torch.empty(B * N, c.vocab_size, dtype=computed_logits.dtype, device=x.device)
            logits[computed] = computed_logits
            logits[~computed] = 0.0
            return ForwardOutput(logits.view(B, N, -1), hidden, states)
        rows = hidden if logit_rows is None else torch.gather(
            hidden, 1, logit_rows[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = logits_for_ops(self.linear(rows, w["lm_head.weight"]))
        return ForwardOutput(logits, hidden, states)

    def _cpu_forward(self, tokens, cache: KVCache, positions, depths, tree_mask, feature_layers, logit_rows,
                     row_counts) -> ForwardOutput | None:
        """The pass as one ``cpu_decoder_forward`` call (embedding, RoPE rows, the layer stack, the final norm and
        the LM head), where the CPU kernels' regime holds (as the fused layer path and ``cpu_linear`` take it);
        else None. The results are those of the stack path's torch ops around ``cpu_decoder_layers`` bit for bit;
        what it saves is a dozen small torch ops per pass, each of which finds its code and data evicted by the
        pass's weight stream (about 1 ms of a 14 ms bf16 SmolLM2-135M decoding step on one core)."""
        args = self._cpu_forward_args(tokens, cache)
        if args is None:
            return None
        c = self.config
        B, N = tokens.shape
        if depths is not None:
            positions = tree_positions(cache.seqlens, depths)
        if positions is not None:
            positions = positions.expand(B, N).long()
        wanted = [index for index in dict.fromkeys(feature_layers) if 0 <= index < c.num_layers]
        table, cos, sin, lists, final_norm, head = args
        logits, hidden, states = torch.ops.eagle_kernels.cpu_decoder_forward(
            tokens, table, cos, sin, positions, *lists, final_norm, head,
            cache.k, cache.v, cache.seqlens, tree_mask, num_heads=c.num_heads, eps=c.rms_norm_eps,
            state_layers=wanted, row_counts=row_counts, logit_rows=logit_rows)
        return ForwardOutput(logits, hidden, dict(zip(wanted, states.unbind(0))))

    def _cpu_forward_args(self, tokens, cache: KVCache) -> tuple | None:
        """What ``cpu_decoder_forward`` takes of this model for a pass of ``tokens`` over ``cache``: (embedding
        table, RoPE cos and sin tables, the six per-layer lists, final norm, LM head as the kernels read it), or
        None outside the kernels' regime."""
        if tokens.device.type != "cpu" or self.dtype != torch.float32 or gpu_path(tokens):
            return None
        c, w = self.config, self.weights
        B, N = tokens.shape
        policy = cpu_policy()
        table, lm_head, final_norm = w["model.embed_tokens.weight"], w["lm_head.weight"], w["model.norm.weight"]
        if not (policy.forward_kernel and B * N <= CPU_LINEAR_MAX_ROWS and cache.k.dtype in KV_CACHE_DTYPES
                and cache.k.dim() == 5 and cache.k.shape[0] == c.num_layers and table.dtype in KV_CACHE_DTYPES
                and table.stride(1) == 1 and final_norm.dtype == torch.float32
                and not (torch.is_grad_enabled() and any(t.requires_grad for t in w.values()))):
            return None
        head = self.packed(lm_head, policy)
        if head.dim() not in (4, 5) if is_quantized(head) else head.dtype not in KV_CACHE_DTYPES:
            return None  # the LM head runs torch (quantized rows with N not a multiple of 32)
        lists = self._stack_lists(policy)
        if lists is None:
            return None
        cos, sin = self.layer_paths.rope_tables(self.inv_freq, cache.k.shape[-3])
        return table, cos, sin, lists, final_norm, head

    def cpu_token_pass(self, tokens: torch.Tensor, cache: KVCache):
        """A loop of one-token passes as prepared ``cpu_decoder_forward`` calls: ``call()`` runs ``tokens``
        int64 [B, 1] (read at each call: a buffer the caller updates in place) at positions ``cache.seqlens``
        and returns their logits [B, 1, V], bit for bit :meth:`forward`'s. The arguments are gathered once, so
        the weights must not change while the loop runs (one ``generate`` call's plain steps); None outside the
        kernels' regime (:meth:`forward` then)."""
        args = self._cpu_forward_args(tokens, cache)
        if args is None:
            return None
        table, cos, sin, lists, final_norm, head = args
        c, op = self.config, torch.ops.eagle_kernels.cpu_decoder_forward
        fixed = (table, cos, sin, None, *lists, final_norm, head, cache.k, cache.v, cache.seqlens, None)
        options = dict(num_heads=c.num_heads, eps=c.rms_norm_eps, state_layers=[], row_counts=None, logit_rows=None)
        return lambda: op(tokens, *fixed, **options)[0]

    def cpu_tree_pass(self, cache: KVCache, feature_layers=()):
        """:meth:`forward` over a tree, prepared for one ``generate`` call's speculative steps as
        :meth:`cpu_token_pass` is for its plain steps: ``call(tokens, depths, tree_mask, row_counts)`` returns
        ``forward(tokens, cache, depths=depths, tree_mask=tree_mask, row_counts=row_counts,
        feature_layers=feature_layers)`` bit for bit, with the kernels' arguments gathered once (the weights must
        not change while the call runs). A pass of more rows than the kernels take runs :meth:`forward`. What it
        saves is the argument gathering's Python, run after the previous pass's weight stream has evicted the
        interpreter's data: 0.15-0.19 ms of a 5.5-8 ms step of the GGUF SmolLM2-135M on two cores (medians of
        steps in one process; docs/decoding.md). None outside the kernels' regime."""
        args = self._cpu_forward_args(cache.seqlens.new_zeros(cache.seqlens.shape[0], 1, dtype=torch.int64), cache)
        if args is None:
            return None
        table, cos, sin, lists, final_norm, head = args
        c, op = self.config, torch.ops.eagle_kernels.cpu_decoder_forward
        wanted = [index for index in dict.fromkeys(feature_layers) if 0 <= index < c.num_layers]
        weights = (table, cos, sin)
        rest = (*lists, final_norm, head, cache.k, cache.v, cache.seqlens)
        options = dict(num_heads=c.num_heads, eps=c.rms_norm_eps, state_layers=wanted, logit_rows=None)

        def call(tokens, depths, tree_mask, row_counts):
            B, N = tokens.shape
            if B * N > CPU_LINEAR_MAX_ROWS:
                return self.forward(tokens, cache, depths=depths, tree_mask=tree_mask, row_counts=row_counts,
                                    feature_layers=feature_layers)
            positions = tree_positions(cache.seqlens, depths).expand(B, N).long()
            logits, hidden, states = op(tokens, *weights, positions, *rest, tree_mask, row_counts=row_counts,
                                        **options)
            return ForwardOutput(logits, hidden, dict(zip(wanted, states.unbind(0))))

        return call

    def _stack_lists(self, policy) -> tuple[list, ...] | None:
        """The six per-layer lists of ``cpu_decoder_forward`` (input norms, then q/k/v, o, post norms, gate/up and
        down as the kernels read them: packed copies where ``policy`` packs), or None when a layer is not a target
        layer. Kept while every layer's entries in ``weights`` are the same tensors (so ``layer_weights`` would
        return the same layers), their matrices at the same versions and the packed copies unchanged: the 121
        packed-copy lookups of SmolLM2-135M cost about 0.2 ms a pass, and this check, a pass's first Python
        after the previous pass's weight stream evicted the interpreter's data, about 0.1 ms (one lookup of all
        270 entries and one version read per matrix, both as C loops; 0.17 ms as a Python loop over the
        layers)."""
        entries = self._all_entries(self.weights)
        hit = self._stack_lists_cache
        if (hit is not None and hit[0] == policy and hit[1] == self.packed.generation
                and all(map(operator.is_, hit[2], entries)) and versions(hit[3]) == hit[4]):
            return hit[5]
        layers = [self.layer_weights(layer) for layer in range(self.config.num_layers)]
        matrices = tuple(m for layer in layers for m in layer.matrices)
        lists = stack_lists(layers, self.packed, policy)
        if lists is None:
            return None
        # Read after fusing and packing: fusing re-points entries at views, a copy made just now moved the
        # generation on.
        self._stack_lists_cache = (policy, self.packed.generation, self._all_entries(self.weights), matrices,
                                   versions(matrices), lists)
        return lists

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """:func:`linear` with this model's packed copies (``weight`` one of its matrices)."""
        return linear(x, weight, self.packed)
