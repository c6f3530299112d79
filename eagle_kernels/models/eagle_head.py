"""EAGLE draft heads: EAGLE-1 (Li et al. 2024, "EAGLE", §3) and EAGLE-3 (Li et al. 2025,
"EAGLE-3", §3), with the EAGLE reference checkpoint layout (docs/eagle_heads.md).

A head maps (token, feature) pairs to the next feature. Pair ``i`` is the embedding of token
``i + 1`` with the feature at token ``i``, so the head's output at the last committed pair
drafts the token after the root. During expansion the feature fed to a draft node is its
parent's output hidden state.
"""

from __future__ import annotations

import json
import operator
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from .. import ops
from .._inference import versions
from ..bookkeeping import gather_rows
from ..reference.cpu_linear import QUANT_FORMATS, dequantize, quant_format, quant_in_features, quantize
from .cpu_weights import CPU_LINEAR_MAX_ROWS, PackedWeights, cpu_policy, is_quantized, linear
from .layers import (
    KV_CACHE_DTYPES,
    Q8_0_DTYPE,
    FusedProjections,
    GpuLayerPath,
    LayerPaths,
    LayerWeights,
    default_positions,
    rope_inverse_frequencies,
)
from .llama import KVCache, LlamaConfig, LlamaModel, is_matrix_weight, logits_for_ops

EAGLE1, EAGLE3 = "eagle1", "eagle3"
STORED = "stored"  # EagleHead(weight_dtype=): the matrices as _stored keeps them, never quantized
FP8 = "fp8"  # EagleHead(weight_dtype=): stored as they are, the GPU passes multiply fp8 copies (fp8_linear)


@dataclass
class HeadConfig:
    kind: str  # "eagle1" or "eagle3"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int  # EAGLE-3's reduced vocabulary (= vocab_size for EAGLE-1)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    feature_layers: tuple = field(default_factory=tuple)  # EAGLE-3: target layers (low, mid, high)

    @classmethod
    def for_target(cls, target: LlamaConfig, kind: str, draft_vocab_size: int | None = None) -> HeadConfig:
        """A head shaped like one decoder layer of ``target``. EAGLE-3 reads the outputs of
        target layers 1, L/2 - 1 and L - 4 (the inputs of layers 2, L/2 and L - 3)."""
        if kind not in (EAGLE1, EAGLE3):
            raise ValueError(f"kind: expected 'eagle1' or 'eagle3', got {kind!r}")
        L = target.num_layers
        layers = tuple(min(max(i, 0), L - 1) for i in (1, L // 2 - 1, L - 4)) if kind == EAGLE3 else ()
        return cls(kind, target.hidden_size, target.intermediate_size, target.num_heads, target.num_kv_heads,
                   target.head_dim, target.vocab_size,
                   draft_vocab_size or target.vocab_size if kind == EAGLE3 else target.vocab_size,
                   target.rms_norm_eps, target.rope_theta, target.rope_scaling, layers)

    def check_fits(self, target: LlamaConfig) -> None:
        """Raise ValueError naming the first dimension in which this head does not fit ``target``."""
        for name, mine, theirs in (("hidden_size", self.hidden_size, target.hidden_size),
                                   ("vocab_size", self.vocab_size, target.vocab_size)):
            if mine != theirs:
                raise ValueError(f"head: {name} {mine} does not fit the target's {name} {theirs}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size or (self.kind == EAGLE1
                                                                  and self.draft_vocab_size != self.vocab_size):
            raise ValueError(f"head: draft_vocab_size {self.draft_vocab_size} does not fit the target's vocab_size "
                             f"{target.vocab_size} ({self.kind})")
        bad = [layer for layer in self.feature_layers if not 0 <= layer < target.num_layers]
        if bad:
            raise ValueError(f"head: feature_layers {bad} outside the target's {target.num_layers} layers")

    def as_llama(self) -> LlamaConfig:
        return LlamaConfig(self.vocab_size, self.hidden_size, self.intermediate_size, 1, self.num_heads,
                           self.num_kv_heads, self.head_dim, self.rms_norm_eps, self.rope_theta, self.rope_scaling)


def head_weight_shapes(config: HeadConfig) -> dict[str, tuple]:
    """Every tensor of the head in the EAGLE reference layout, with its shape."""
    H, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * D, config.num_kv_heads * D
    if config.kind == EAGLE1:
        p, attn_in = "layers.0.", H
        shapes = {"fc.weight": (H, 2 * H), "fc.bias": (H,)}
    else:
        p, attn_in = "midlayer.", 2 * H
        shapes = {"fc.weight": (H, 3 * H), p + "hidden_norm.weight": (H,), p + "input_layernorm.weight": (H,),
                  "norm.weight": (H,), "lm_head.weight": (config.draft_vocab_size, H),
                  "d2t": (config.draft_vocab_size,)}
    shapes.update({
        p + "self_attn.q_proj.weight": (q, attn_in), p + "self_attn.k_proj.weight": (kv, attn_in),
        p + "self_attn.v_proj.weight": (kv, attn_in), p + "self_attn.o_proj.weight": (H, q),
        p + "post_attention_layernorm.weight": (H,), p + "mlp.gate_proj.weight": (I, H),
        p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)})
    return shapes


class EagleHead(torch.nn.Module):
    """Draft head bound to its target (it shares the target's embeddings, and for EAGLE-1
    its LM head).

    ``weight_dtype``: how the matrices that drafting streams are stored (the projections, and
    EAGLE-3's fc and LM head; see :meth:`_stored`): ``"q8_0"`` / ``"q4_1"`` GGML block rows
    (``cpu_linear``'s exact integer block sums, fp32 activations), ``"stored"`` as :meth:`_stored`
    keeps them (fp16 / the target's dtype), None (default) Q8_0 where the target's own matrices are
    quantized (a head pass then streams about half the bytes of its fp16 matrices), else as stored.
    Block rows given in ``weights`` are kept as they are. ``"fp8"`` (a 16-bit head, GPU path): the
    matrices stay as stored and the GPU passes multiply fp8 copies of them (``fp8_linear``: one byte
    a weight, the activations rounded to fp8 per 128 k); every K must be a multiple of 128."""

    def __init__(self, config: HeadConfig, weights: dict[str, torch.Tensor], target: LlamaModel,
                 weight_dtype: str | None = None):
        super().__init__()
        if weight_dtype is not None and weight_dtype not in QUANT_FORMATS and weight_dtype not in (STORED, FP8):
            raise ValueError(f"weight_dtype: expected None, {STORED!r}, {FP8!r} or one of {sorted(QUANT_FORMATS)}, "
                             f"got {weight_dtype!r}")
        config.check_fits(target.config)
        expected = head_weight_shapes(config)
        missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
        if missing or unexpected:
            raise ValueError(f"weights: an {config.kind} head" + (f" misses {missing}" if missing else "")
                             + (" and" if missing and unexpected else "")
                             + (f" has unexpected {unexpected}" if unexpected else ""))
        for name, shape in expected.items():
            t = weights[name]
            got = (t.shape[0], quant_in_features(t)) if is_quantized(t) and t.dim() == 2 else tuple(t.shape)
            if got != shape:
                raise ValueError(f"weights: {name!r} expected shape {shape}, got {got}"
                                 + (f" ({tuple(t.shape)} {t.dtype} block rows)" if is_quantized(t) else ""))
        if "d2t" in weights:
            _check_d2t(weights["d2t"], config.vocab_size)
        self.config = config
        self.target = target
        self.weights = {name: self._stored(name, weights[name]) for name in expected}
        self.weight_format = self._quantize(weight_dtype)
        self.prefix = "layers.0." if config.kind == EAGLE1 else "midlayer."
        self.fused = FusedProjections()  # q/k/v and gate/up as one matrix each (views in weights)
        # This head's packed copies (the target's matrices: the target's), for the target's activations.
        self.packed = PackedWeights(getattr(target, "activations", "fp32"))
        self.layer_paths = LayerPaths(config, self.packed)
        self.layer_paths.fp8_matrices = self.weight_format == FP8
        own_linear = ["fc.weight", "lm_head.weight"] if config.kind == EAGLE3 else []  # EAGLE-1: F.linear fc
        self.packed.pack_all(list(self.layer_weights().matrices) + [self.weights[name] for name in own_linear],
                             self.dtype)
        self.register_buffer("inv_freq", rope_inverse_frequencies(config.as_llama()).to(target.device),
                             persistent=False)
        self._cpu_pass_cache = None  # (key, layer, the cpu_head_forward tensors): see _cpu_pass_tensors

    @classmethod
    def random(cls, target: LlamaModel, kind: str, draft_vocab_size: int | None = None, seed: int = 0,
               std: float = 0.02, weight_dtype: str | None = None) -> EagleHead:
        """An untrained head with small random weights (norms at 1; EAGLE-3 with the identity
        draft vocabulary: the first ``draft_vocab_size`` target ids)."""
        config = HeadConfig.for_target(target.config, kind, draft_vocab_size)
        g = torch.Generator().manual_seed(seed)
        weights = {}
        for name, shape in head_weight_shapes(config).items():
            if name == "d2t":
                weights[name] = torch.zeros(shape, dtype=torch.int64)
            elif name.endswith("norm.weight"):
                weights[name] = torch.ones(shape)
            else:
                weights[name] = torch.randn(shape, generator=g) * std
        weights = {n: t.to(target.device, target.dtype if t.is_floating_point() else t.dtype)
                   for n, t in weights.items()}
        return cls(config, weights, target, weight_dtype)

    def _stored(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Floats in the target's compute dtype, except the weight matrices that go through
        :func:`linear`, which drafting streams once per pass like the target's:
        - fp16 matrices (as checkpoints ship) of an fp32 CPU head stay fp16: ``cpu_linear``
          widens them exactly, so drafts are bit for bit those of the fp32 copy at half the
          bytes (and bf16 weights of the target would round them);
        - otherwise they follow the target's storage dtype (bf16 weights of an fp32 target).
        EAGLE-1's fc has a bias and runs ``F.linear`` in the compute dtype."""
        if not t.is_floating_point():
            return t.to(self.target.device)  # d2t, or block rows (kept as given)
        compute, narrow = self.target.dtype, self.target.weight_dtype
        through_linear = self._through_linear(name)
        if (through_linear and t.dtype == torch.float16 and compute == torch.float32
                and self.target.device.type == "cpu"):
            return t.to(self.target.device)
        t = t.to(self.target.device, compute)
        return t.to(narrow) if through_linear and narrow != compute else t

    def _through_linear(self, name: str) -> bool:
        """Whether ``name`` is a matrix that drafting streams through :func:`linear` (EAGLE-1's fc has a bias
        and runs ``F.linear``)."""
        return is_matrix_weight(name) or (name == "fc.weight" and self.config.kind == EAGLE3)

    def _quantize(self, weight_dtype: str | None) -> str | None:
        """Quantize the matrices :meth:`_through_linear` streams to ``weight_dtype`` blocks (see the class);
        returns the format they are in (None: floats). An fp32 CPU head's blocks run ``cpu_linear``; Q8_0
        blocks of a head on the GPU path run ``q8_0_linear`` (16-bit activations: half the bytes a pass
        streams; elsewhere the exact dequantization, made per call)."""
        target_format = next((quant_format(t) for t in self.target.weights.values() if is_quantized(t)), None)
        fmt = ("q8_0" if target_format else None) if weight_dtype is None else weight_dtype
        if fmt == STORED:
            fmt = None
        names = [name for name in self.weights if self._through_linear(name)]
        if fmt == FP8:
            if self.target.dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(f"weight_dtype: 'fp8' copies are for a 16-bit head's GPU passes, got a "
                                 f"{self.target.dtype} target")
            for name in names:
                t = self.weights[name]
                if is_quantized(t) or t.shape[-1] % 128:
                    raise ValueError(f"weights: {name!r}: 'fp8' needs a float matrix whose K is a multiple of 128, "
                                     f"got {tuple(t.shape)} {t.dtype}")
            return FP8
        if fmt is None:
            return next((quant_format(self.weights[n]) for n in names if is_quantized(self.weights[n])), None)
        cpu_fp32 = self.target.device.type == "cpu" and self.target.dtype == torch.float32
        if not cpu_fp32 and fmt != "q8_0":
            raise ValueError(f"weight_dtype: {fmt!r} blocks need an fp32 CPU target, got {self.target.dtype} on "
                             f"{self.target.device} (a GPU head takes 'q8_0')")
        for name in names:
            t = self.weights[name]
            if not is_quantized(t):
                try:
                    self.weights[name] = quantize(t.float(), fmt)
                except ValueError as e:  # the shape does not fit the blocks: say which matrix
                    raise ValueError(f"weights: {name!r}: {e}") from None
        return fmt

    @property
    def dtype(self):
        """Compute dtype (activations, norms, KV cache): the target's."""
        return self.weights[self.prefix + "post_attention_layernorm.weight"].dtype

    def layer_weights(self) -> LayerWeights:
        """The head's decoder layer. EAGLE-1's has no input norm (fc's output feeds attention);
        EAGLE-3's normalises the feature with ``hidden_norm`` and the embedding with
        ``input_layernorm``, and attends over both."""
        if self.config.kind == EAGLE1:
            return LayerWeights.from_weights(self.weights, self.prefix, self.fused, input_norm=None)
        return LayerWeights.from_weights(self.weights, self.prefix, self.fused, input_norm="hidden_norm.weight",
                                         embed_norm="input_layernorm.weight")

    @property
    def d2t(self):
        return self.weights.get("d2t")

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache.allocate(self.config.as_llama(), batch, capacity, self.dtype, self.target.device)

    def feature_states(self, out) -> list[torch.Tensor]:
        """The target states [B, N, H] each that :meth:`target_features` reads from a target
        ForwardOutput: EAGLE-1 the final normed hidden state, EAGLE-3 the low/mid/high layer
        states."""
        if self.config.kind == EAGLE1:
            return [out.hidden]
        return [out.layer_states[layer] for layer in self.config.feature_layers]

    def feature_rows(self, out, rows: torch.Tensor | None = None, gathered: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """The rows of :meth:`feature_states` side by side, [B, N or P, len(states) * H], that
        :meth:`target_features` feeds to fc (EAGLE-3) or passes on (EAGLE-1): ``rows`` int64 [B, P]
        picks token rows; ``gathered``: those rows picked already (the GPU path's
        ``bookkeeping.commit_inputs``), returned as they are."""
        if gathered is not None:
            return gathered
        states = self.feature_states(out)
        if rows is None:
            return states[0] if len(states) == 1 else torch.cat(states, dim=-1)
        return gather_rows(states, rows)

    def target_features(self, out, rows: torch.Tensor | None = None, gathered: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """The head's input feature [B, N, H] from a target ForwardOutput: EAGLE-1 the final
        normed hidden state, EAGLE-3 fc over the low/mid/high layer states. ``rows`` int64
        [B, P] picks token rows first (result [B, P, H]), so EAGLE-3's fc runs over those
        rows only (a row's feature does not depend on the other rows); ``gathered``: those
        rows of :meth:`feature_states` side by side, picked already (the GPU path's
        ``bookkeeping.commit_inputs``)."""
        return self._through_fc(self.feature_rows(out, rows, gathered))

    def _through_fc(self, rows: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's fc over :meth:`feature_rows` (EAGLE-1: the rows are the feature)."""
        return rows if self.config.kind == EAGLE1 else self._linear(rows, "fc.weight")

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x @ weights[name].T``: :func:`linear` (the CPU kernels, torch elsewhere), or on the GPU path
        ``q8_0_linear`` over Q8_0 block rows' split copy, or ``fp8_linear`` over the fp8 copy of an
        ``"fp8"`` head's matrix."""
        weight = self.weights[name]
        gpu_path = self.layer_paths.on_gpu_path(x.device)
        if weight.dtype == Q8_0_DTYPE and gpu_path:
            return ops.q8_0_linear(x, *self.packed.q8_0_split(weight))
        if self.weight_format == FP8 and gpu_path and x.dtype == weight.dtype:
            return ops.fp8_linear(x, *self.packed.fp8_copy(weight))
        return linear(x, weight, self.packed)

    def fused_input_norms(self, hidden: torch.Tensor, cache: KVCache) -> tuple | None:
        """``(weight, embed_weight, eps)``: an EAGLE-3 layer's two input norms where a pass over
        rows like ``hidden`` takes the GPU layer path, for the expansion step to write the layer's
        normed input (``bookkeeping.DraftInputs.norm``; the pass then takes it as ``normed``);
        else None."""
        if self.config.kind != EAGLE3 or not self.layer_paths.on_gpu_path(hidden.device):
            return None
        layer = self.layer_weights()
        if self.layer_paths.gpu_path(hidden.device, self.dtype, cache, self.weights, lambda: layer) is None:
            return None
        if layer.input_norm.dtype != self.dtype or layer.embed_norm.dtype != self.dtype:
            return None
        return layer.input_norm, layer.embed_norm, self.config.rms_norm_eps

    def forward(self, tokens, features, cache: KVCache, positions=None, tree_mask=None,
                slot_offset: int = 0, embed=None) -> torch.Tensor:
        """Next-feature prediction for N (token, feature) pairs; K/V go to ``cache`` slots
        ``cache.seqlens + slot_offset + i`` (see ``cached_attention``).
        tokens [B, N]; features [B, N, H]; ``embed`` [B, N, H] the tokens' rows of
        :attr:`token_embedding` in the head's dtype when the caller gathered them already (the
        GPU path's bookkeeping), else None; returns hidden [B, N, H]."""
        return self.run(tokens, features, cache, positions, tree_mask, slot_offset, embed)[0]

    def run(self, tokens, features, cache: KVCache, positions=None, tree_mask=None, slot_offset: int = 0,
            embed=None, *, fc: bool = False, logits: bool = False, normed=None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` (``fc``: over :meth:`feature_rows`, taken through :meth:`target_features`'
        fc first), and with ``logits`` the draft logits of every row (:meth:`logits`): ``(hidden, logits
        or None)``. On the CPU, in the kernels' regime, an EAGLE-3 pass is one ``cpu_head_forward``
        call (docs/ops.md §14) with the same results bit for bit; a draft pass around the layer
        call otherwise ran about a dozen small torch ops (~0.1 ms warm, several times that after the
        target pass has streamed its weights through the caches). ``normed`` [B, N, 2H]: the layer's
        normed input as the GPU path's expansion step wrote it (:meth:`fused_input_norms`), which the
        GPU layer path then takes instead of its own norm."""
        fused = self._cpu_pass(tokens, features, cache, positions, tree_mask, slot_offset, fc, logits)
        if fused is not None:
            return fused
        if fc:
            features = self._through_fc(features)
        hidden = self._layer_pass(tokens, features, cache, positions, tree_mask, slot_offset, embed, normed)
        return hidden, self.logits(hidden) if logits else None

    def _layer_pass(self, tokens, features, cache: KVCache, positions, tree_mask, slot_offset: int, embed,
                    normed=None) -> torch.Tensor:
        c, w = self.config, self.weights
        B, N = tokens.shape
        if positions is None:
            positions = default_positions(cache, N)
        if embed is None:
            embed = F.embedding(tokens, self.token_embedding).to(self.dtype)
        x = features.to(self.dtype)
        if c.kind == EAGLE1:  # fc(embedding, feature) feeds attention directly, with no input norm
            x, embed = F.linear(torch.cat([embed, x], dim=-1), w["fc.weight"], w["fc.bias"]), None
        layer = self.layer_weights()
        path = self.layer_paths.pick(x, cache, w, normed_input=c.kind == EAGLE3, layer=lambda: layer)
        rope = path.rope(self.inv_freq, positions, B, N, self.dtype, capacity=cache.k.shape[-3])
        extra = dict(normed=normed) if normed is not None and isinstance(path, GpuLayerPath) else {}
        return path(x, layer, rope, cache, 0, tree_mask,
                    embed=embed, slot_offset=slot_offset, **extra)

    def _cpu_pass(self, tokens, features, cache: KVCache, positions, tree_mask, slot_offset: int, fc: bool,
                  logits: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """:meth:`run` as one ``cpu_head_forward`` call where it applies (an EAGLE-3 fp32 head on the CPU, the
        policy's whole-pass kernels on, the cpu_linear regime, nothing for autograd to record); else None."""
        if (self.config.kind != EAGLE3 or tokens.device.type != "cpu" or self.dtype != torch.float32
                or features.dtype != torch.float32 or features.device.type != "cpu"):
            return None
        B, N = tokens.shape
        policy = cpu_policy()
        table = self.token_embedding
        if not (policy.forward_kernel and B * N <= CPU_LINEAR_MAX_ROWS and cache.k.dtype in KV_CACHE_DTYPES
                and cache.k.dim() == 5 and table.dtype in KV_CACHE_DTYPES and table.stride(1) == 1
                and not (torch.is_grad_enabled() and (features.requires_grad
                                                      or any(t.requires_grad for t in self.weights.values())))):
            return None
        tensors = self._cpu_pass_tensors(policy)
        if tensors is None:
            return None
        layer, fc_weight, final_norm, lm_head = tensors
        if positions is None:
            positions = default_positions(cache, N)
        cos, sin = self.layer_paths.rope_tables(self.inv_freq, cache.k.shape[-3])
        k, v = cache.layer(0)
        out_logits, hidden = torch.ops.eagle_kernels.cpu_head_forward(
            tokens, table, features, fc_weight if fc else None, cos, sin, positions.expand(B, N).long(), *layer,
            final_norm if logits else None, lm_head if logits else None, k, v, cache.seqlens, tree_mask,
            num_heads=self.config.num_heads, eps=self.config.rms_norm_eps, slot_offset=slot_offset)
        return hidden, out_logits if logits else None

    def _cpu_pass_tensors(self, policy) -> tuple | None:
        """What ``cpu_head_forward`` takes of this head, the matrices as the kernels read them (packed copies where
        ``policy`` packs): (the layer's seven tensors in the op's order, fc, the final norm, the LM head), or None
        where a matrix is one the kernels do not read (quantized rows not packed). Kept while the layer's tensors
        are the same objects, at the same versions, and the packed copies unchanged."""
        layer = self.layer_weights()
        fc, lm_head, final_norm = self.weights["fc.weight"], self.weights["lm_head.weight"], self.weights["norm.weight"]
        tensors = (layer.input_norm, layer.embed_norm, *layer.matrices, layer.post_norm, fc, lm_head, final_norm)
        key = (policy, self.packed.generation, versions(tensors))
        hit = self._cpu_pass_cache
        if hit is not None and hit[0] == key and all(map(operator.is_, hit[1], tensors)):
            return hit[2]
        qkv, o, gate_up, down, fc, lm_head = (self.packed(m, policy) for m in (*layer.matrices, fc, lm_head))
        if any(is_quantized(m) and m.dim() not in (4, 5) for m in (qkv, o, gate_up, down, fc, lm_head)):
            return None
        if final_norm.dtype != torch.float32:
            return None
        result = ((layer.input_norm, layer.embed_norm, qkv, o, layer.post_norm, gate_up, down), fc, final_norm, lm_head)
        # Read after packing: a copy made just now moved the generation on.
        self._cpu_pass_cache = ((policy, self.packed.generation, key[2]), tensors, result)
        return result

    @property
    def token_embedding(self) -> torch.Tensor:
        """The token embedding [V, H] (the target's)."""
        return self.target.weights["model.embed_tokens.weight"]

    def logits(self, hidden: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        """Draft logits [B, N, Vd], float32 on the CPU and the head's dtype elsewhere (EAGLE-1:
        the target's LM head on the predicted feature; EAGLE-3: own norm and LM head over the
        draft vocabulary). ``normed`` [B, N, H]: EAGLE-3's norm of ``hidden``, made already
        (with :meth:`final_norm`, as the decoder's commit does for the next root)."""
        if self.config.kind == EAGLE1:
            lm_head = self.target.weights["lm_head.weight"]
            return logits_for_ops(self.target.linear(hidden.to(self.target.dtype), lm_head))
        if normed is None:
            fused = self.layer_paths.norm_linear(hidden, self.weights["norm.weight"], self.weights["lm_head.weight"])
            if fused is not None:
                return logits_for_ops(fused)
            normed = self.layer_paths.norm(hidden, self.weights["norm.weight"])
        return logits_for_ops(self._linear(normed, "lm_head.weight"))

    def final_norm(self) -> tuple[torch.Tensor, float] | None:
        """EAGLE-3's norm before its LM head, ``(weight [H], eps)``, where its weight is in the
        head's dtype (the rmsnorm op's case): a caller may norm rows ahead and pass them to
        :meth:`logits` as ``normed``. None for EAGLE-1 (no such norm)."""
        if self.config.kind == EAGLE1:
            return None
        weight = self.weights["norm.weight"]
        return (weight, self.config.rms_norm_eps) if weight.dtype == self.dtype else None

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder: str) -> None:
        """Write ``model.safetensors`` (EAGLE reference key names, fp16 floats) and
        ``config.json`` (Llama-style fields plus ``eagle_kind``, ``draft_vocab_size`` and
        ``eagle_feature_layers``)."""
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        tensors = {n: (dequantize(t) if is_quantized(t) else t) for n, t in self.weights.items()}
        tensors = {n: (t.half() if t.is_floating_point() else t).contiguous().cpu() for n, t in tensors.items()}
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        c = self.config
        meta = {"architectures": ["LlamaForCausalLMEagle3" if c.kind == EAGLE3 else "LlamaForCausalLM"],
                "eagle_kind": c.kind, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
                "head_dim": c.head_dim, "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
                "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
                "num_hidden_layers": 1, "eagle_feature_layers": list(c.feature_layers)}
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(meta, f, indent=2)

    @classmethod
    def load(cls, folder: str, target: LlamaModel, weight_dtype: str | None = None) -> EagleHead:
        """Load a head saved by :meth:`save` or an EAGLE reference checkpoint folder
        (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``); ``weight_dtype`` as in the class
        (default: Q8_0 blocks for a quantized target).

        Raises
        ------
        FileNotFoundError
            A missing folder or file (named).
        ValueError
            A head that does not fit ``target`` (naming the dimension: ``hidden_size``,
            ``vocab_size``, ``draft_vocab_size``, ``d2t``), or missing / unexpected / misshapen
            tensors (named)."""
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"head folder {folder!r}: no such folder")
        config_path = os.path.join(folder, "config.json")
        if not os.path.exists(config_path):
            raise FileNotFoundError(f"head folder {folder!r}: missing config.json")
        with open(config_path) as f:
            meta = json.load(f)
        for name in ("hidden_size", "vocab_size"):
            if name in meta and meta[name] != getattr(target.config, name):
                raise ValueError(f"head: {name} {meta[name]} (config.json) does not fit the target's {name} "
                                 f"{getattr(target.config, name)}")
        kind = meta.get("eagle_kind") or (EAGLE3 if "draft_vocab_size" in meta else EAGLE1)
        config = HeadConfig.for_target(target.config, kind, meta.get("draft_vocab_size"))
        if meta.get("eagle_feature_layers"):
            config.feature_layers = tuple(meta["eagle_feature_layers"])
        weights = _read_tensors(folder)
        weights.pop("t2d", None)  # EAGLE-3's target-to-draft mask is implied by d2t
        weights.pop("embed_tokens.weight", None)  # shared with the target
        weights = {n: t if t.is_floating_point() else t.to(torch.int64) for n, t in weights.items()}
        return cls(config, weights, target, weight_dtype)  # floats take their dtype in _stored

    def describe(self) -> dict:
        return asdict(self.config)


def _check_d2t(d2t: torch.Tensor, vocab: int) -> None:
    """Draft id ``d`` maps to target id ``d + d2t[d]``, which must lie in ``[0, vocab)``."""
    if d2t.dtype.is_floating_point or d2t.dim() != 1:
        raise ValueError(f"head: d2t expected a 1-D integer tensor, got {d2t.dim()}-D {d2t.dtype}")
    targets = torch.arange(d2t.shape[0], device=d2t.device) + d2t
    bad = ((targets < 0) | (targets >= vocab)).nonzero()
    if bad.numel():
        d = int(bad[0, 0])
        raise ValueError(f"head: d2t maps draft id {d} to {int(targets[d])}, outside the target's vocabulary "
                         f"[0, {vocab}) ({bad.numel()} such ids)")


def _read_tensors(folder: str) -> dict[str, torch.Tensor]:
    path = os.path.join(folder, "model.safetensors")
    if os.path.exists(path):
        from safetensors.torch import load_file

        return load_file(path)
    path = os.path.join(folder, "pytorch_model.bin")
    if not os.path.exists(path):
        raise FileNotFoundError(f"head folder {folder!r}: missing model.safetensors (or pytorch_model.bin)")
    return torch.load(path, map_location="cpu", weights_only=True)
