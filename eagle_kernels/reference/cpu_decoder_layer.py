"""Reference ``cpu_decoder_layer``: one Llama decoder layer (pre-norm attention and SwiGLU MLP,
each with a residual) over N new tokens per request, its K/V written into the layer's cache; and
``cpu_decoder_layers``, a stack of them in one call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _checks
from .._types import DecoderForwardOutput, DecoderLayersOutput, HeadForwardOutput
from .cpu_linear import cpu_linear
from .tree_attention import tree_attention
from .write_kv import write_kv


def _rms_norm(x, weight, eps):
    wide = x.double()
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).float()


def _rope(x, cos, sin):
    """Half-split rotation: x * cos + [-x2, x1] * sin. x [B, N, heads, D]; cos, sin [B, N, D]."""
    first, second = x.double().chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.double() * cos[:, :, None].double() + rotated * sin[:, :, None].double()).float()


def cpu_decoder_layer(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin,
                      k_cache, v_cache, cache_seqlens, tree_mask=None, *, num_heads, eps, embed=None,
                      embed_norm=None, slot_offset=0, row_counts=None):
    """``x + attn(h) + mlp(...)`` for one layer, as LlamaModel's layer computes it::

        h = rms_norm(x, input_norm)
        q, k, v = split(h @ qkv_weight.T)            # heads: num_heads, Hkv, Hkv
        q, k = rope(q), rope(k)                      # cos, sin of each token's position
        write_kv(k_cache, v_cache, k, v, cache_seqlens)  # token i at cache_seqlens + i
        x = x + tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask) @ o_weight.T
        gate, up = split(rms_norm(x, post_norm) @ gate_up_weight.T)
        return x + (silu(gate) * up) @ down_weight.T

    Each step is computed in float64 and rounded to float32 (the K/V stored are float32 too);
    the linear layers are :func:`cpu_linear`. A bfloat16 or float16 cache stores k and v rounded to its
    dtype, and attention runs in that dtype (q rounded to it, its output widened to float32), as
    LlamaModel's op-by-op path attends with such a cache. ``tree_mask=None`` is causal attention over the
    new tokens, as for tree_attention.

    EAGLE-3's draft layer: with ``embed`` (and ``embed_norm``), attention reads
    ``[rms_norm(embed, embed_norm), rms_norm(x, input_norm)]`` (2H wide) and ``x`` stays the
    residual. With ``slot_offset`` > 0 the new tokens follow that many tree slots written by
    earlier calls: their K/V go to ``cache_seqlens + slot_offset + i``, and the attention runs
    over ``slot_offset + N`` tree rows (``tree_mask`` covers them all) whose first
    ``slot_offset`` queries are zeros and dropped.

    ``row_counts`` int64 [B]: rows ``i >= row_counts[b]`` of request ``b`` are padding (a batch
    whose requests verify trees of different sizes, or a finished request): they are not
    computed, their output rows are ``x``'s and the K/V written at their slots are zeros (the
    q/k/v of a zero input). The other rows get what they would without padding as long as no
    padding slot is among their tree-mask ancestors (causal: padding at the end of a row).

    Shapes
    ------
    x float32 [B, N, H]; input_norm, post_norm float32 [H]; qkv_weight [(num_heads + 2 Hkv) D, H],
    o_weight [H, num_heads D], gate_up_weight [2 I, H] (gate rows, then up rows), down_weight
    [H, I], each float32, bfloat16 or float16; cos, sin float32 [B, N, D]; k_cache, v_cache
    float32, bfloat16 or float16 [B, S, Hkv, D] (contiguous layout, one dtype); cache_seqlens int32 [B]; tree_mask int64
    [B, N, ceil(N / 64)] or None; returns float32 [B, N, H]. With ``embed``: embed float32
    [B, N, H], embed_norm float32 [H], qkv_weight [(num_heads + 2 Hkv) D, 2H]; with
    ``slot_offset`` S: tree_mask [B, S + N, ceil((S + N) / 64)]; row_counts int64 [B] in [0, N].
    """
    _checks.check_cpu_decoder_layer(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight,
                                    cos, sin, k_cache, v_cache, cache_seqlens, tree_mask, num_heads=num_heads,
                                    eps=eps, embed=embed, embed_norm=embed_norm, slot_offset=slot_offset,
                                    row_counts=row_counts)
    B, N, _ = x.shape
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    attn_in = _rms_norm(x, input_norm, eps)
    if embed is not None:
        attn_in = torch.cat([_rms_norm(embed, embed_norm, eps), attn_in], dim=-1)
    computed = torch.ones(B, N, 1, dtype=torch.bool, device=x.device)
    if row_counts is not None:
        computed = (torch.arange(N, device=x.device)[None] < row_counts[:, None])[..., None]
        attn_in = torch.where(computed, attn_in, 0.0)  # zero q/k/v (no biases; RoPE keeps zeros)
    qkv = cpu_linear(attn_in, qkv_weight).view(B, N, num_heads + 2 * Hkv, D)
    q, k, v = qkv.split([num_heads, Hkv, Hkv], dim=2)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    cache_dtype = k_cache.dtype  # a 16-bit cache: k, v and q rounded to it, attention in it, widened back
    write_kv(k_cache, v_cache, k.to(cache_dtype), v.to(cache_dtype).contiguous(), cache_seqlens + slot_offset)
    q = torch.cat([q.new_zeros(B, slot_offset, num_heads, D), q], dim=1).to(cache_dtype)
    attn = tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask)[:, slot_offset:].float()
    x1 = (x.double() + cpu_linear(attn.reshape(B, N, num_heads * D), o_weight).double()).float()  # B, N may be 0
    gate, up = cpu_linear(_rms_norm(x1, post_norm, eps), gate_up_weight).double().chunk(2, dim=-1)
    act = (F.silu(gate) * up).float()
    out = (x1.double() + cpu_linear(act, down_weight).double()).float()
    return torch.where(computed, out, x)


def cpu_decoder_layers(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin,
                       k_cache, v_cache, cache_seqlens, tree_mask=None, *, num_heads, eps, state_layers=(),
                       row_counts=None):
    """:func:`cpu_decoder_layer` over the L layers of a model in one call: layer ``l`` takes entry ``l`` of each
    weight list and the cache ``k_cache[l]``, ``v_cache[l]``, and feeds its output to layer ``l + 1``::

        for l in range(L):
            x = cpu_decoder_layer(x, input_norm[l], qkv_weight[l], ..., k_cache[l], v_cache[l], cache_seqlens,
                                  tree_mask, num_heads=num_heads, eps=eps, row_counts=row_counts)

    Returns ``(out, states)``: the last layer's output and the outputs of the layers listed in ``state_layers``
    (EAGLE-3 reads a few of them), in that order, stacked. Every layer has an input norm, no ``embed`` and no
    ``slot_offset`` (a target model's stack; drafting layers take :func:`cpu_decoder_layer`).

    Shapes
    ------
    x float32 [B, N, H]; input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight: lists of L
    tensors, each as in :func:`cpu_decoder_layer`; k_cache, v_cache [L, B, S, Hkv, D]; cos, sin, cache_seqlens,
    tree_mask, row_counts as in :func:`cpu_decoder_layer`; state_layers: ints in [0, L). Returns float32
    [B, N, H] and float32 [len(state_layers), B, N, H].
    """
    _checks.check_cpu_decoder_layers(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight,
                                     cos, sin, k_cache, v_cache, cache_seqlens, tree_mask, num_heads=num_heads,
                                     eps=eps, state_layers=state_layers, row_counts=row_counts)
    outputs = []
    for layer in range(k_cache.shape[0]):
        x = cpu_decoder_layer(x, input_norm[layer], qkv_weight[layer], o_weight[layer], post_norm[layer],
                              gate_up_weight[layer], down_weight[layer], cos, sin, k_cache[layer], v_cache[layer],
                              cache_seqlens, tree_mask, num_heads=num_heads, eps=eps, row_counts=row_counts)
        outputs.append(x)
    states = torch.stack([outputs[layer] for layer in state_layers]) if state_layers else x.new_empty(0, *x.shape)
    return DecoderLayersOutput(x if outputs else x.clone(), states)


def cpu_decoder_forward(tokens, embed_table, rope_cos, rope_sin, positions, input_norm, qkv_weight, o_weight,
                        post_norm, gate_up_weight, down_weight, final_norm, lm_head, k_cache, v_cache, cache_seqlens,
                        tree_mask=None, *, num_heads, eps, state_layers=(), row_counts=None, logit_rows=None):
    """A Llama target's forward pass in one call, token ids to logits::

        x = embed_table[tokens]                       # widened to float32
        cos = [rope_cos[p], rope_cos[p]] for p in positions (default cache_seqlens[b] + i), sin likewise
        out, states = cpu_decoder_layers(x, ..., cos, sin, ...)
        hidden = rms_norm(out, final_norm)
        logits = cpu_linear(hidden rows, lm_head)     # the rows in logit_rows, else every row

    With ``row_counts`` (and no ``logit_rows``) the padding rows' logits are 0.

    Shapes
    ------
    tokens int64 [B, N]; embed_table float32/bfloat16/float16 [V_e, H]; rope_cos, rope_sin float32 [P, D / 2]
    (row p: cos / sin of p * inv_freq); positions int64 [B, N] or None; the six weight lists, k_cache, v_cache,
    cache_seqlens, tree_mask, state_layers and row_counts as in :func:`cpu_decoder_layers`; final_norm float32 [H];
    lm_head as :func:`eagle_kernels.reference.cpu_linear` takes it; logit_rows int64 [B, R] or None. Returns logits
    float32 [B, R or N, V], hidden float32 [B, N, H], states float32 [len(state_layers), B, N, H].
    """
    _checks.check_cpu_decoder_forward(tokens, embed_table, rope_cos, rope_sin, positions, input_norm, qkv_weight,
                                      o_weight, post_norm, gate_up_weight, down_weight, final_norm, lm_head, k_cache,
                                      v_cache, cache_seqlens, tree_mask, num_heads=num_heads, eps=eps,
                                      state_layers=state_layers, row_counts=row_counts, logit_rows=logit_rows)
    N = tokens.shape[1]
    x = embed_table[tokens].float()
    if positions is None:
        positions = cache_seqlens.long()[:, None] + torch.arange(N, device=tokens.device)
    cos = torch.cat([rope_cos[positions], rope_cos[positions]], dim=-1)
    sin = torch.cat([rope_sin[positions], rope_sin[positions]], dim=-1)
    out, states = cpu_decoder_layers(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos,
                                     sin, k_cache, v_cache, cache_seqlens, tree_mask, num_heads=num_heads, eps=eps,
                                     state_layers=state_layers, row_counts=row_counts)
    hidden = _rms_norm(out, final_norm, eps)
    if logit_rows is not None:
        rows = torch.gather(hidden, 1, logit_rows[..., None].expand(-1, -1, hidden.shape[-1]))
        return DecoderForwardOutput(cpu_linear(rows, lm_head), hidden, states)
    logits = cpu_linear(hidden, lm_head)
    if row_counts is not None:
        padding = torch.arange(N, device=tokens.device)[None] >= row_counts[:, None]
        logits = logits.masked_fill(padding[..., None], 0.0)
    return DecoderForwardOutput(logits, hidden, states)


def cpu_head_forward(tokens, embed_table, features, fc_weight, rope_cos, rope_sin, positions, input_norm, embed_norm,
                     qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, final_norm, lm_head, k_cache,
                     v_cache, cache_seqlens, tree_mask=None, *, num_heads, eps, slot_offset=0):
    """An EAGLE-3 draft head's pass in one call (a commit pass over the accepted path, or a draft pass over a
    frontier)::

        embed = embed_table[tokens]                   # widened to float32
        x = cpu_linear(features, fc_weight)           # features as they are without fc_weight
        cos = [rope_cos[p], rope_cos[p]] for p in positions, sin likewise
        hidden = cpu_decoder_layer(x, input_norm, ..., embed=embed, embed_norm=embed_norm, slot_offset=...)
        logits = cpu_linear(rms_norm(hidden, final_norm), lm_head)   # with final_norm and lm_head

    Shapes
    ------
    tokens int64 [B, N]; embed_table float32/bfloat16/float16 [V_e, H]; features float32 [B, N, F] (F = H without
    fc_weight); fc_weight [H, F] as :func:`eagle_kernels.reference.cpu_linear` takes it, or None; rope_cos,
    rope_sin float32 [P, D / 2]; positions int64 [B, N]; the layer's tensors, k_cache, v_cache [B, S, Hkv, D],
    cache_seqlens, tree_mask and slot_offset as in :func:`cpu_decoder_layer` (qkv_weight over 2 H inputs);
    final_norm float32 [H] and lm_head [Vd, H], both or neither. Returns logits float32 [B, N, Vd] ([B, N, 0]
    without them) and hidden float32 [B, N, H].
    """
    _checks.check_cpu_head_forward(tokens, embed_table, features, fc_weight, rope_cos, rope_sin, positions,
                                   input_norm, embed_norm, qkv_weight, o_weight, post_norm, gate_up_weight,
                                   down_weight, final_norm, lm_head, k_cache, v_cache, cache_seqlens, tree_mask,
                                   num_heads=num_heads, eps=eps, slot_offset=slot_offset)
    embed = embed_table[tokens].float()
    x = features if fc_weight is None else cpu_linear(features, fc_weight)
    cos = torch.cat([rope_cos[positions], rope_cos[positions]], dim=-1)
    sin = torch.cat([rope_sin[positions], rope_sin[positions]], dim=-1)
    hidden = cpu_decoder_layer(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin,
                               k_cache, v_cache, cache_seqlens, tree_mask, num_heads=num_heads, eps=eps, embed=embed,
                               embed_norm=embed_norm, slot_offset=slot_offset)
    if lm_head is None:
        return HeadForwardOutput(hidden.new_zeros(*hidden.shape[:2], 0), hidden)
    return HeadForwardOutput(cpu_linear(_rms_norm(hidden, final_norm, eps), lm_head), hidden)
