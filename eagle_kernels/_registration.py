"""Registration of ``torch.ops.eagle_kernels``: schemas, routing kernels and fakes.

The C++ extension defines the schemas and registers its native kernels for the CPU/CUDA keys.
Every key it leaves free gets a Python kernel that routes through ``backend_of``; without the
extension the schemas are defined here from ``_schemas.SCHEMAS``.
"""

from __future__ import annotations

import torch

from . import _checks, _dispatch, _layer_checks
from ._schemas import LAYER_SCHEMAS, OPS, SCHEMAS

_DEVICE_KEYS = (("cpu", "CPU"), ("cuda", "CUDA"))
_libraries: list[torch.library.Library] = []  # registrations live as long as these objects


def _routing_kernel(op: str, device_type: str):
    def kernel(*args, **kwargs):
        out = _dispatch.run(op, device_type, *args, **kwargs)
        return tuple(out) if isinstance(out, tuple) else out

    kernel.__name__ = f"{op}_{device_type}_router"
    return kernel


def _fake_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask=None, *, block_table=None,
                         sm_scale=None):
    _checks.check_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask,
                                 block_table=block_table, sm_scale=sm_scale, values=False)
    return q.new_empty(_checks.tree_attention_shape(q))


def _fake_draft_expand(logits, frontier_scores, top_k, *, d2t=None, temperature=None, seed=None, offset=None,
                       depth=0):
    _checks.check_draft_expand(logits, frontier_scores, top_k, d2t=d2t, temperature=temperature, seed=seed,
                               offset=offset, depth=depth, values=False)
    tokens, scores, frontier, logprobs = _checks.draft_expand_shapes(logits, frontier_scores, top_k)
    return (logits.new_empty(tokens, dtype=torch.int64), logits.new_empty(scores, dtype=torch.float32),
            logits.new_empty(frontier, dtype=torch.int32), logits.new_empty(logprobs, dtype=torch.float32))


def _fake_build_tree(root_tokens, cand_tokens, cand_scores, cand_parents, num_nodes):
    _checks.check_build_tree(root_tokens, cand_tokens, cand_scores, cand_parents, num_nodes,
                             values=False)
    shapes = _checks.build_tree_shapes(root_tokens, cand_tokens, cand_scores, cand_parents, num_nodes)
    dtypes = (torch.int64, torch.int32, torch.int32, torch.int64)
    return tuple(cand_tokens.new_empty(s, dtype=d) for s, d in zip(shapes, dtypes))


def _fake_verify(tokens, parents, target_logits, *, max_depth, temperature=None, top_k=None,
                 top_p=None, seed=None, offset=None, draft_probs=None, draft_sampled=None, d2t=None,
                 positions=None):
    _checks.check_verify(tokens, parents, target_logits, max_depth=max_depth, temperature=temperature,
                         top_k=top_k, top_p=top_p, seed=seed, offset=offset, draft_probs=draft_probs,
                         draft_sampled=draft_sampled, d2t=d2t, positions=positions, values=False)
    shapes = _checks.verify_shapes(tokens, parents, target_logits, max_depth=max_depth)
    dtypes = (torch.int32, torch.int32, torch.int64, torch.int32)
    return tuple(target_logits.new_empty(s, dtype=d) for s, d in zip(shapes, dtypes))


def _fake_block_verify(tokens, target_logits, draft_probs=None, *, num_drafts=None, temperature=None, top_k=None,
                       top_p=None, seed=None, offset=None, d2t=None):
    _checks.check_block_verify(tokens, target_logits, draft_probs, num_drafts=num_drafts, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed, offset=offset, d2t=d2t, values=False)
    shapes = _checks.block_verify_shapes(tokens, target_logits)
    dtypes = (torch.int32, torch.int32, torch.int64, torch.int32)
    return tuple(target_logits.new_empty(s, dtype=d) for s, d in zip(shapes, dtypes))


def _fake_coupled_noise(seed, positions, num_tokens, *, d2t=None):
    _checks.check_coupled_noise(seed, positions, num_tokens, d2t=d2t, values=False)
    return seed.new_empty(_checks.coupled_noise_shape(seed, positions, num_tokens), dtype=torch.float32)


def _fake_coupled_draft_logits(logits, temperature, seed, positions, *, d2t=None):
    _checks.check_coupled_draft_logits(logits, temperature, seed, positions, d2t=d2t, values=False)
    return logits.new_empty(logits.shape, dtype=torch.float32)


def _fake_compact_kv(k_cache, v_cache, cache_seqlens, accept_nodes, accept_len, *, block_table=None):
    _checks.check_compact_kv(k_cache, v_cache, cache_seqlens, accept_nodes, accept_len,
                             block_table=block_table, values=False)


def _fake_write_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, *, block_table=None):
    _checks.check_write_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table=block_table,
                           values=False)


def _fake_cpu_linear(x, weight):
    _checks.check_cpu_linear(x, weight, values=False)
    return x.new_empty(_checks.cpu_linear_shape(x, weight))


def _fake_cpu_decoder_layer(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin,
                            k_cache, v_cache, cache_seqlens, tree_mask=None, *, num_heads, eps, embed=None,
                            embed_norm=None, slot_offset=0, row_counts=None):
    _checks.check_cpu_decoder_layer(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight,
                                    cos, sin, k_cache, v_cache, cache_seqlens, tree_mask, num_heads=num_heads,
                                    eps=eps, embed=embed, embed_norm=embed_norm, slot_offset=slot_offset,
                                    row_counts=row_counts, values=False)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_cpu_decoder_layers(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin,
                             k_cache, v_cache, cache_seqlens, tree_mask=None, *, num_heads, eps, state_layers=(),
                             row_counts=None):
    _checks.check_cpu_decoder_layers(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight,
                                     cos, sin, k_cache, v_cache, cache_seqlens, tree_mask, num_heads=num_heads,
                                     eps=eps, state_layers=state_layers, row_counts=row_counts, values=False)
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(len(state_layers), *x.shape)


def _fake_cpu_decoder_forward(tokens, embed_table, rope_cos, rope_sin, positions, input_norm, qkv_weight, o_weight,
                              post_norm, gate_up_weight, down_weight, final_norm, lm_head, k_cache, v_cache,
                              cache_seqlens, tree_mask=None, *, num_heads, eps, state_layers=(), row_counts=None,
                              logit_rows=None):
    _checks.check_cpu_decoder_forward(tokens, embed_table, rope_cos, rope_sin, positions, input_norm, qkv_weight,
                                      o_weight, post_norm, gate_up_weight, down_weight, final_norm, lm_head, k_cache,
                                      v_cache, cache_seqlens, tree_mask, num_heads=num_heads, eps=eps,
                                      state_layers=state_layers, row_counts=row_counts, logit_rows=logit_rows,
                                      values=False)
    (B, N), H = tokens.shape, embed_table.shape[1]
    rows = N if logit_rows is None else logit_rows.shape[1]
    hidden = embed_table.new_empty((B, N, H), dtype=torch.float32)
    return (hidden.new_empty(B, rows, _checks.linear_out_features(lm_head)), hidden,
            hidden.new_empty(len(state_layers), B, N, H))


def _fake_cpu_head_forward(tokens, embed_table, features, fc_weight, rope_cos, rope_sin, positions, input_norm,
                           embed_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, final_norm,
                           lm_head, k_cache, v_cache, cache_seqlens, tree_mask=None, *, num_heads, eps, slot_offset=0):
    _checks.check_cpu_head_forward(tokens, embed_table, features, fc_weight, rope_cos, rope_sin, positions,
                                   input_norm, embed_norm, qkv_weight, o_weight, post_norm, gate_up_weight,
                                   down_weight, final_norm, lm_head, k_cache, v_cache, cache_seqlens, tree_mask,
                                   num_heads=num_heads, eps=eps, slot_offset=slot_offset, values=False)
    (B, N), H = tokens.shape, embed_table.shape[1]
    hidden = features.new_empty((B, N, H))
    return hidden.new_empty(B, N, 0 if lm_head is None else _checks.linear_out_features(lm_head)), hidden


def _fake_rmsnorm(x, weight, eps, *, embed=None, embed_weight=None):
    _layer_checks.check_rmsnorm(x, weight, eps, embed=embed, embed_weight=embed_weight, values=False)
    out, residual = _layer_checks.rmsnorm_shapes(x, weight, eps, embed=embed, embed_weight=embed_weight)
    return x.new_empty(out), x.new_empty(residual)


def _fake_rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, cache_seqlens, *, num_heads, slot_offset=0):
    _layer_checks.check_rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, cache_seqlens,
                                      num_heads=num_heads, slot_offset=slot_offset, values=False)
    return k_cache.new_empty(_layer_checks.rope_write_kv_shape(qkv, positions, cos, sin, k_cache, v_cache,
                                                               cache_seqlens, num_heads=num_heads,
                                                               slot_offset=slot_offset))


def _fake_silu_mul(gate_up):
    _layer_checks.check_silu_mul(gate_up, values=False)
    return gate_up.new_empty(_layer_checks.silu_mul_shape(gate_up))


def _fake_rmsnorm_linear(x, weight, norm_weight, eps, *, gated=False, add=None):
    _layer_checks.check_rmsnorm_linear(x, weight, norm_weight, eps, gated=gated, add=add, values=False)
    out, residual = _layer_checks.rmsnorm_linear_shapes(x, weight, norm_weight, eps, gated=gated)
    return x.new_empty(out), x.new_empty(residual)


def _fake_rmsnorm_qkv_rope(x, weight, norm_weight, eps, positions, cos, sin, k_cache, v_cache, cache_seqlens, *,
                           num_heads, slot_offset=0):
    _layer_checks.check_rmsnorm_qkv_rope(x, weight, norm_weight, eps, positions, cos, sin, k_cache, v_cache,
                                         cache_seqlens, num_heads=num_heads, slot_offset=slot_offset, values=False)
    q, residual = _layer_checks.rmsnorm_qkv_rope_shapes(x, k_cache, num_heads=num_heads, slot_offset=slot_offset)
    return k_cache.new_empty(q), x.new_empty(residual)


def _fake_o_proj_mlp(attention, residual, o_weight, norm_weight, gate_up_weight, down_weight, eps):
    _layer_checks.check_o_proj_mlp(attention, residual, o_weight, norm_weight, gate_up_weight, down_weight, eps,
                                   values=False)
    return residual.new_empty(residual.shape)


def _fake_q8_0_linear(x, quants, scales, *, residual=None):
    _layer_checks.check_q8_0_linear(x, quants, scales, residual=residual, values=False)
    return x.new_empty(_layer_checks.q8_0_linear_shape(x, quants, scales))


def _fake_fp8_linear(x, weight, weight_scale, *, residual=None):
    _layer_checks.check_fp8_linear(x, weight, weight_scale, residual=residual, values=False)
    return x.new_empty(_layer_checks.fp8_linear_shape(x, weight, weight_scale))


FAKES = {
    "tree_attention": _fake_tree_attention,
    "draft_expand": _fake_draft_expand,
    "build_tree": _fake_build_tree,
    "verify": _fake_verify,
    "block_verify": _fake_block_verify,
    "coupled_noise": _fake_coupled_noise,
    "coupled_draft_logits": _fake_coupled_draft_logits,
    "compact_kv": _fake_compact_kv,
    "write_kv": _fake_write_kv,
    "cpu_linear": _fake_cpu_linear,
    "cpu_decoder_layer": _fake_cpu_decoder_layer,
    "cpu_decoder_layers": _fake_cpu_decoder_layers,
    "cpu_decoder_forward": _fake_cpu_decoder_forward,
    "cpu_head_forward": _fake_cpu_head_forward,
    "rmsnorm": _fake_rmsnorm,
    "rope_write_kv": _fake_rope_write_kv,
    "silu_mul": _fake_silu_mul,
    "rmsnorm_linear": _fake_rmsnorm_linear,
    "rmsnorm_qkv_rope": _fake_rmsnorm_qkv_rope,
    "o_proj_mlp": _fake_o_proj_mlp,
    "q8_0_linear": _fake_q8_0_linear,
    "fp8_linear": _fake_fp8_linear,
}


def register() -> None:
    if not _dispatch.HAS_CPP:
        definitions = torch.library.Library("eagle_kernels", "DEF")
        for schema in SCHEMAS.values():
            definitions.define(schema)
        _libraries.append(definitions)
    layer_definitions = torch.library.Library("eagle_kernels", "FRAGMENT")
    for schema in LAYER_SCHEMAS.values():
        layer_definitions.define(schema)
    _libraries.append(layer_definitions)
    ops = OPS + tuple(LAYER_SCHEMAS)
    for op in ops:
        for device_type, key in _DEVICE_KEYS:
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"eagle_kernels::{op}", key):
                _dispatch.NATIVE_KERNELS.add((op, device_type))
    kernels = torch.library.Library("eagle_kernels", "IMPL")
    for op in ops:
        for device_type, key in _DEVICE_KEYS:
            if (op, device_type) not in _dispatch.NATIVE_KERNELS:
                kernels.impl(op, _routing_kernel(op, device_type), key)
        torch.library.register_fake(f"eagle_kernels::{op}", FAKES[op], lib=kernels)
    _libraries.append(kernels)
