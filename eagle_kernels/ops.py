"""The public ops. Each runs the backend ``backend_of(op, device)`` names for its inputs."""

from __future__ import annotations

from . import _dispatch
from ._types import DraftCandidates, Tree, VerifyOutput
from .reference.cpu_linear import PACK_WIDTH  # noqa: F401  (public: the packed layout's row group)
from .reference.cpu_linear import cpu_linear_pack as _reference_pack


def _device(name: str, tensor):
    """The device of the argument that picks the backend; a ValueError naming it when it is not a tensor (as the
    checks of every backend raise for the other arguments)."""
    try:
        return tensor.device
    except AttributeError:
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}") from None


def tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask=None, *, block_table=None, sm_scale=None):
    """Attention of N tree nodes over the committed prefix and their ancestors (docs/ops.md §1).
    See :func:`eagle_kernels.reference.tree_attention` for shapes and semantics."""
    return _dispatch.run("tree_attention", _device("q", q), q, k_cache, v_cache, cache_seqlens, tree_mask,
                         block_table=block_table, sm_scale=sm_scale)


def draft_expand(logits, frontier_scores, top_k, *, d2t=None, temperature=None, seed=None, offset=None,
                 depth=0) -> DraftCandidates:
    """One depth of EAGLE-2 expansion, children sampled without replacement for requests with
    ``temperature[b] > 0`` (docs/ops.md §2); see :func:`eagle_kernels.reference.draft_expand`."""
    sampling = {} if temperature is None else dict(temperature=temperature, seed=seed, offset=offset)
    return _dispatch.run("draft_expand", _device("logits", logits), logits, frontier_scores, top_k, d2t=d2t,
                         depth=depth, **sampling)


def build_tree(root_tokens, cand_tokens, cand_scores, cand_parents, num_nodes) -> Tree:
    """EAGLE-2 re-ranking into a verify tree (docs/ops.md §3); see :func:`eagle_kernels.reference.build_tree`."""
    return _dispatch.run("build_tree", _device("cand_tokens", cand_tokens), root_tokens, cand_tokens, cand_scores,
                         cand_parents, num_nodes)


def verify(tokens, parents, target_logits, *, max_depth, temperature=None, top_k=None, top_p=None,
           seed=None, offset=None, draft_probs=None, draft_sampled=None, d2t=None, positions=None) -> VerifyOutput:
    """Greedy and lossless sampling verification of a tree, with the draft distributions of
    sampled children when given, or coupled sampling with ``positions`` (docs/ops.md §4); see
    :func:`eagle_kernels.reference.verify`."""
    drafts = {} if draft_probs is None and draft_sampled is None and d2t is None else dict(
        draft_probs=draft_probs, draft_sampled=draft_sampled, d2t=d2t)
    if positions is not None:
        drafts["positions"] = positions
    return _dispatch.run("verify", _device("target_logits", target_logits),
                         tokens, parents, target_logits, max_depth=max_depth,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset, **drafts)


def block_verify(tokens, target_logits, draft_probs=None, *, num_drafts=None, temperature=None, top_k=None,
                 top_p=None, seed=None, offset=None, d2t=None) -> VerifyOutput:
    """A chain of drafts verified as one block (docs/ops.md §21): exact, and on average at least as
    many drafts kept as :func:`verify` keeps of a chain sampled from the draft; see
    :func:`eagle_kernels.reference.block_verify`."""
    return _dispatch.run("block_verify", _device("target_logits", target_logits), tokens, target_logits, draft_probs,
                         num_drafts=num_drafts, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         offset=offset, d2t=d2t)


def coupled_noise(seed, positions, num_tokens, *, d2t=None):
    """The Gumbel noise of coupled sampling at each (request, position, token) (docs/ops.md §15),
    for drafts that share the target's race; see :func:`eagle_kernels.reference.coupled_noise`."""
    return _dispatch.run("coupled_noise", _device("seed", seed), seed, positions, num_tokens, d2t=d2t)


def coupled_draft_logits(logits, temperature, seed, positions, *, d2t=None):
    """A drafting step's rows under coupled sampling (docs/ops.md §16): log-probabilities at each
    request's temperature plus the race noise at ``positions``, greedy requests' rows unchanged;
    see :func:`eagle_kernels.reference.coupled_draft_logits`."""
    return _dispatch.run("coupled_draft_logits", _device("logits", logits),
                         logits, temperature, seed, positions, d2t=d2t)


def compact_kv(k_cache, v_cache, cache_seqlens, accept_nodes, accept_len, *, block_table=None) -> None:
    """Commit the accepted path's K/V in place, all layers at once (docs/ops.md §5); see
    :func:`eagle_kernels.reference.compact_kv`."""
    _dispatch.run("compact_kv", _device("k_cache", k_cache), k_cache, v_cache, cache_seqlens, accept_nodes, accept_len,
                  block_table=block_table)


def write_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, *, block_table=None) -> None:
    """Store the K/V of N new tokens at positions ``cache_seqlens[b] + i``, in place (before a
    verify pass: tree node i goes to slot i). See :func:`eagle_kernels.reference.write_kv`."""
    _dispatch.run("write_kv", _device("k_cache", k_cache), k_cache, v_cache, k_new, v_new, cache_seqlens,
                  block_table=block_table)


def cpu_linear(x, weight):
    """``x @ weight.T`` with fp32 (or bf16/fp16, widened exactly; or packed Q8_0 / Q4_1 blocks, dequantized
    exactly in registers) weights and fp32 accumulation: the CPU kernel for the few-row linear layers of
    decoding and verification. Other devices run the reference. See
    :func:`eagle_kernels.reference.cpu_linear`."""
    return _dispatch.run("cpu_linear", _device("x", x), x, weight)


def cpu_linear_pack(weight, activations="fp32"):
    """``weight`` [N, K] (N a multiple of 32) as the packed [N / 32, 2, K, 16] that ``cpu_linear``
    and ``cpu_decoder_layer`` also take: groups of 32 output columns in two K-major halves, for which the CPU
    kernel is a GEMM micro-kernel (verify passes of 8-12 rows cost little more than one row); bf16 with K even
    as [N / 32, 2, K / 2, 16, 2], pairs of k per 32-bit lane (cheaper to widen, the same results).
    Pure layout (any device, same dtype and values); GGML Q8_0 / Q4_1 block rows (int8 / uint8, see
    :func:`eagle_kernels.reference.cpu_linear.quantize`) are packed into the quantized kernel's layout, or with
    ``activations="int8"`` into the layout of its 8-bit-activation arithmetic (GGML's). See
    :func:`eagle_kernels.reference.cpu_linear_pack`."""
    return _reference_pack(weight, activations)


def cpu_decoder_layer(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin,
                      k_cache, v_cache, cache_seqlens, tree_mask=None, *, num_heads, eps, embed=None,
                      embed_norm=None, slot_offset=0, row_counts=None):
    """One Llama decoder layer in one call, writing the new tokens' K/V into the layer's cache:
    the CPU kernel for the few-row layers of decoding, verification and EAGLE-3 drafting. Other
    devices run the reference. See :func:`eagle_kernels.reference.cpu_decoder_layer`."""
    return _dispatch.run("cpu_decoder_layer", _device("x", x), x, input_norm, qkv_weight, o_weight, post_norm,
                         gate_up_weight, down_weight, cos, sin, k_cache, v_cache, cache_seqlens, tree_mask,
                         num_heads=num_heads, eps=eps, embed=embed, embed_norm=embed_norm, slot_offset=slot_offset,
                         row_counts=row_counts)


def cpu_decoder_layers(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin,
                       k_cache, v_cache, cache_seqlens, tree_mask=None, *, num_heads, eps, state_layers=(),
                       row_counts=None):
    """A model's stack of L decoder layers in one call (``cpu_decoder_layer`` L times, lists of per-layer weights,
    a [L, B, S, Hkv, D] cache): no Python between the layers of a pass. Returns ``(out, states)``, ``states``
    the outputs of the layers in ``state_layers``. Other devices run the reference. See
    :func:`eagle_kernels.reference.cpu_decoder_layers`."""
    return _dispatch.run("cpu_decoder_layers", _device("x", x), x, list(input_norm), list(qkv_weight), list(o_weight),
                         list(post_norm), list(gate_up_weight), list(down_weight), cos, sin, k_cache, v_cache,
                         cache_seqlens, tree_mask, num_heads=num_heads, eps=eps, state_layers=list(state_layers),
                         row_counts=row_counts)


def cpu_decoder_forward(tokens, embed_table, rope_cos, rope_sin, positions, input_norm, qkv_weight, o_weight,
                        post_norm, gate_up_weight, down_weight, final_norm, lm_head, k_cache, v_cache, cache_seqlens,
                        tree_mask=None, *, num_heads, eps, state_layers=(), row_counts=None, logit_rows=None):
    """A Llama target's forward pass, token ids to logits, in one call (embedding, RoPE rows from [P, D / 2] tables,
    ``cpu_decoder_layers``, the final norm, the LM head): a CPU decoding step without a dozen small torch ops
    around the stack. Returns ``(logits, hidden, states)``. Other devices run the reference. See
    :func:`eagle_kernels.reference.cpu_decoder_forward`."""
    return _dispatch.run("cpu_decoder_forward", _device("tokens", tokens),
                         tokens, embed_table, rope_cos, rope_sin, positions,
                         list(input_norm), list(qkv_weight), list(o_weight), list(post_norm), list(gate_up_weight),
                         list(down_weight), final_norm, lm_head, k_cache, v_cache, cache_seqlens, tree_mask,
                         num_heads=num_heads, eps=eps, state_layers=list(state_layers), row_counts=row_counts,
                         logit_rows=logit_rows)


def cpu_head_forward(tokens, embed_table, features, fc_weight, rope_cos, rope_sin, positions, input_norm, embed_norm,
                     qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, final_norm, lm_head, k_cache,
                     v_cache, cache_seqlens, tree_mask=None, *, num_heads, eps, slot_offset=0):
    """An EAGLE-3 draft head's pass in one call (the embedding, fc over the features, RoPE rows from [P, D / 2]
    tables, the head's decoder layer and, with ``final_norm`` and ``lm_head``, its draft logits): a draft or commit
    pass of a CPU decoding step without the small torch ops around ``cpu_decoder_layer``. Returns
    ``(logits, hidden)``. Other devices run the reference. See :func:`eagle_kernels.reference.cpu_head_forward`."""
    return _dispatch.run("cpu_head_forward", _device("tokens", tokens),
                         tokens, embed_table, features, fc_weight, rope_cos,
                         rope_sin, positions, input_norm, embed_norm, qkv_weight, o_weight, post_norm, gate_up_weight,
                         down_weight, final_norm, lm_head, k_cache, v_cache, cache_seqlens, tree_mask,
                         num_heads=num_heads, eps=eps, slot_offset=slot_offset)


def rmsnorm(x, weight, eps, *, embed=None, embed_weight=None):
    """RMSNorm of rows and a copy of x (the residual stream a decoder layer then adds to in
    place), in one pass; with ``embed``, EAGLE-3's ``[norm(embed) * embed_weight, norm(x) *
    weight]`` (docs/ops.md §9). See :func:`eagle_kernels.reference.rmsnorm`."""
    return _dispatch.run("rmsnorm", _device("x", x), x, weight, eps, embed=embed, embed_weight=embed_weight)


def rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, cache_seqlens, *, num_heads, slot_offset=0):
    """RoPE on the q/k heads of a fused q/k/v projection and the rotated k and v written into
    the cache at ``cache_seqlens[b] + slot_offset + i``; returns q (docs/ops.md §10). See
    :func:`eagle_kernels.reference.rope_write_kv`."""
    return _dispatch.run("rope_write_kv", _device("qkv", qkv),
                         qkv, positions, cos, sin, k_cache, v_cache, cache_seqlens,
                         num_heads=num_heads, slot_offset=slot_offset)


def rmsnorm_linear(x, weight, norm_weight, eps, *, gated=False, add=None):
    """RMSNorm of rows (``norm_weight`` None: none) and the projection ``h @ weight.T`` in one
    launch, with SwiGLU over a fused gate/up ``weight`` when ``gated``, or ``add`` (a residual
    stream) added before the one rounding; returns ``(out, residual)``, residual a copy of x
    (docs/ops.md §17). See :func:`eagle_kernels.reference.rmsnorm_linear`."""
    return _dispatch.run("rmsnorm_linear", _device("x", x), x, weight, norm_weight, eps, gated=gated, add=add)


def rmsnorm_qkv_rope(x, weight, norm_weight, eps, positions, cos, sin, k_cache, v_cache, cache_seqlens, *,
                     num_heads, slot_offset=0):
    """A layer's input norm (``norm_weight`` None: none), q/k/v GEMM, RoPE and KV cache write in one
    launch: ``rmsnorm_linear`` then ``rope_write_kv`` without rounding the projection between
    them; returns ``(q, residual)``, residual a copy of x (docs/ops.md §18). See
    :func:`eagle_kernels.reference.rmsnorm_qkv_rope`."""
    return _dispatch.run("rmsnorm_qkv_rope", _device("x", x), x, weight, norm_weight, eps, positions, cos, sin, k_cache,
                         v_cache, cache_seqlens, num_heads=num_heads, slot_offset=slot_offset)


def o_proj_mlp(attention, residual, o_weight, norm_weight, gate_up_weight, down_weight, eps):
    """A decoder layer after its attention in one launch: the o projection added into the residual
    stream, the post-attention norm, the gate/up GEMM with SwiGLU and the down projection added
    back: three ``rmsnorm_linear`` calls' results, bit for bit, as a GPU kernel whose programs hand
    the phases to each other instead of three launches (docs/ops.md §22). See
    :func:`eagle_kernels.reference.o_proj_mlp`."""
    return _dispatch.run("o_proj_mlp", _device("attention", attention),
                         attention, residual, o_weight, norm_weight, gate_up_weight,
                         down_weight, eps)


def q8_0_linear(x, quants, scales, *, residual=None):
    """``[residual +] x @ w.T`` over Q8_0 weights held as int8 ``quants`` [N, K] and fp16 ``scales``
    [N, K / 32] (``reference.q8_0_linear.split_q8_0`` of GGML block rows): half the bytes of a 16-bit
    matrix, for the GPU passes of a draft head whose weights bound its time (docs/ops.md §19). See
    :func:`eagle_kernels.reference.q8_0_linear`."""
    return _dispatch.run("q8_0_linear", _device("x", x), x, quants, scales, residual=residual)


def fp8_linear(x, weight, weight_scale, *, residual=None):
    """``[residual +] x @ w.T`` over fp8 (e4m3) weights with one fp32 scale per output channel
    (``reference.fp8_linear.quantize_fp8``), x rounded to fp8 per row and block of 128 k in the kernel:
    one byte a weight and no per-weight conversion, for the GPU passes of a draft head whose weight
    reads bound its time (docs/ops.md §20). See :func:`eagle_kernels.reference.fp8_linear`."""
    return _dispatch.run("fp8_linear", _device("x", x), x, weight, weight_scale, residual=residual)


def silu_mul(gate_up):
    """``silu(gate) * up`` of a fused gate/up projection [..., 2I] -> [..., I] (docs/ops.md §11).
    See :func:`eagle_kernels.reference.silu_mul`."""
    return _dispatch.run("silu_mul", _device("gate_up", gate_up), gate_up)
