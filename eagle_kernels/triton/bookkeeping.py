"""Triton kernels for the bookkeeping of a speculative step (GPU path; CPU tensors under
TRITON_INTERPRET=1): one launch where the torch code of the same logic launches five to twenty
small kernels. :mod:`eagle_kernels.bookkeeping` chooses between them and holds the torch
versions, which are the CPU path and the tests' truth (python_tests/decoding/test_bookkeeping.py).

- ``expansion_step``: after one ``draft_expand`` of an EAGLE-2 expansion (Li et al. 2024,
  §4.1), write its candidates into the history and gather the next frontier, and (before the
  last depth) the inputs of the head's pass over it, which ``draft_inputs`` makes alone;
- ``draft_inputs``: the inputs of one head pass over a frontier: its parents' hidden states,
  the tree-attention mask rows of its draft slots (parent's row plus its own bit), positions,
  its tokens' embedding rows;
- ``token_rows``: the target's first layer input: its tokens' embedding rows, their RMSNorm
  (the rmsnorm kernel's row function) and a tree pass's positions;
- ``commit_inputs`` / ``gather_rows`` / ``commit``: after ``verify``, the accepted path as the
  head's commit input (tokens, positions, embedding and target feature rows), then emit the
  accepted tokens, advance the caches and the output, update the root and (EAGLE-3) its
  final norm.

The launchers take contiguous inputs (checked by :mod:`eagle_kernels.bookkeeping`; shapes per
kernel argument), allocate their outputs and update the state tensors they are given in place;
one program per request (per frontier node, token or path pair where rows of H are copied).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import launch_options, wait_for_prior_grids
from .rmsnorm import _normalise_row

BLOCK_H_MAX = 1024


@triton.jit
def _frontier_node_inputs(hidden_ptr, slot_masks_ptr, seqlens_ptr, feature_ptr, positions_ptr, table_ptr, embed_ptr,
                          normed_ptr, norm_weight_ptr, embed_norm_weight_ptr, eps, b, m, parent, token, step, F, H,
                          S, WORDS, stride_hb, stride_hm, stride_v, BLOCK_H: tl.constexpr, BLOCK_WORDS: tl.constexpr,
                          HAS_PARENT_SLOTS: tl.constexpr, HAS_EMBED: tl.constexpr, HAS_NORM: tl.constexpr):
    """What the head's pass over a frontier needs of frontier node m of request b: its parent's
    hidden row, its token's embedding row (HAS_EMBED), its draft-mask row (its parent's row and
    its own bit) and, once per request, the pass's position; with HAS_NORM (EAGLE-3, HAS_EMBED,
    one tile: BLOCK_H >= H) also the layer's normed input row ``[norm(embed) * embed_norm_weight,
    norm(feature) * norm_weight]`` (2H), with the rmsnorm op's row function, so its values. Shared
    by the expansion step (which makes the frontier) and draft_inputs (a frontier made
    elsewhere)."""
    source = hidden_ptr + b * stride_hb + parent * stride_hm
    target = feature_ptr + (b * F + m) * H
    if HAS_EMBED:
        row = table_ptr + token * stride_v
    if HAS_NORM:
        offs = tl.arange(0, BLOCK_H)
        valid = offs < H
        out = normed_ptr + (b * F + m) * 2 * H
        e = _normalise_row(row, embed_norm_weight_ptr, out, offs, valid, H, eps)
        tl.store(embed_ptr + (b * F + m) * H + offs, e.to(embed_ptr.dtype.element_ty), mask=valid)
        x = _normalise_row(source, norm_weight_ptr, out + H, offs, valid, H, eps)
        tl.store(target + offs, x, mask=valid)
    else:
        for start in range(0, H, BLOCK_H):
            h = start + tl.arange(0, BLOCK_H)
            tl.store(target + h, tl.load(source + h, mask=h < H, other=0.0), mask=h < H)
            if HAS_EMBED:
                tl.store(embed_ptr + (b * F + m) * H + h,
                         tl.load(row + h, mask=h < H, other=0.0).to(embed_ptr.dtype.element_ty), mask=h < H)
    own = (step - 1) * F + m
    words = tl.arange(0, BLOCK_WORDS)
    in_words = words < WORDS
    if HAS_PARENT_SLOTS:
        mask_row = tl.load(slot_masks_ptr + (b * S + (step - 2) * F + parent) * WORDS + words, mask=in_words,
                           other=0)
    else:
        mask_row = tl.zeros([BLOCK_WORDS], dtype=tl.int64)
    bit = tl.full([BLOCK_WORDS], 1, tl.int64) << (own % 64).to(tl.int64)
    mask_row = mask_row | tl.where(words == own // 64, bit, 0)
    tl.store(slot_masks_ptr + (b * S + own) * WORDS + words, mask_row, mask=in_words)
    if m == 0:
        tl.store(positions_ptr + b, tl.load(seqlens_ptr + b) + step - 1)


@triton.jit(do_not_specialize=["offset", "step"])
def _expansion_step_kernel(
    out_tokens_ptr,  # [B, W] int64, W = M * K: this depth's candidates (draft_expand's tokens)
    out_scores_ptr,  # [B, W] float32
    frontier_ptr,  # [B, F] int32: indices into the W candidates
    cand_index_ptr,  # [B, M] int64: history index of each expanded node (-1: the root)
    cand_tokens_ptr,  # [B, C] int64
    cand_scores_ptr,  # [B, C] float32
    cand_parents_ptr,  # [B, C] int32
    next_ptr,  # [3, B, F] int64: the frontier's tokens, parent rows, history indices
    next_scores_ptr,  # [B, F] float32
    hidden_ptr,  # [B, M, H] the head's outputs of this depth's pass (HAS_DRAFT; strided)
    slot_masks_ptr,  # [B, S, WORDS] int64: draft slots' mask rows (HAS_DRAFT)
    seqlens_ptr,  # [B] int32: the head cache's committed lengths (HAS_DRAFT)
    feature_ptr,  # [B, F, H] out (HAS_DRAFT)
    positions_ptr,  # [B] int32 out (HAS_DRAFT)
    table_ptr,  # [V, H] token embedding (HAS_EMBED; rows strided)
    embed_ptr,  # [B, F, H] out (HAS_EMBED)
    normed_ptr,  # [B, F, 2H] out (HAS_NORM): the head layer's normed input
    norm_weight_ptr,  # [H] (HAS_NORM): the feature's norm
    embed_norm_weight_ptr,  # [H] (HAS_NORM): the embedding's norm
    B, M, K, F, C, offset, chunk, step, H, S, WORDS,
    stride_hb, stride_hm, stride_v, eps,
    BLOCK_CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    HAS_DRAFT: tl.constexpr,  # also gather the inputs of the head's pass over the new frontier
    HAS_PARENT_SLOTS: tl.constexpr,  # step > 1: the frontier's parents sit in draft slots
    HAS_EMBED: tl.constexpr,
    HAS_NORM: tl.constexpr,  # also the head layer's normed input (EAGLE-3's two input norms)
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1)
    W = M * K
    # This program's share of the candidates: `chunk` of the W, into the history.
    c = tl.arange(0, BLOCK_CHUNK)
    j = m * chunk + c
    in_w = (c < chunk) & (j < W)
    tokens = tl.load(out_tokens_ptr + b * W + j, mask=in_w, other=0)
    scores = tl.load(out_scores_ptr + b * W + j, mask=in_w, other=0.0)
    parents = tl.load(cand_index_ptr + b * M + j // K, mask=in_w, other=-1)
    tl.store(cand_tokens_ptr + b * C + offset + j, tokens, mask=in_w)
    tl.store(cand_scores_ptr + b * C + offset + j, scores, mask=in_w)
    tl.store(cand_parents_ptr + b * C + offset + j, parents.to(tl.int32), mask=in_w)
    # Frontier node m.
    pick = tl.load(frontier_ptr + b * F + m).to(tl.int64)
    token = tl.load(out_tokens_ptr + b * W + pick)
    parent = pick // K
    tl.store(next_ptr + b * F + m, token)
    tl.store(next_ptr + (B + b) * F + m, parent)
    tl.store(next_ptr + (2 * B + b) * F + m, pick + offset)
    tl.store(next_scores_ptr + b * F + m, tl.load(out_scores_ptr + b * W + pick))
    if HAS_DRAFT:
        # The inputs of the head's pass over the frontier (draft_inputs of step `step`).
        _frontier_node_inputs(hidden_ptr, slot_masks_ptr, seqlens_ptr, feature_ptr, positions_ptr, table_ptr,
                              embed_ptr, normed_ptr, norm_weight_ptr, embed_norm_weight_ptr, eps, b, m, parent, token,
                              step, F, H, S, WORDS, stride_hb, stride_hm, stride_v, BLOCK_H, BLOCK_WORDS,
                              HAS_PARENT_SLOTS, HAS_EMBED, HAS_NORM)


def _norm_arguments(norm, B: int, F: int, H: int, hidden, placeholder):
    """``(normed, (weight, embed_weight), eps, BLOCK_H)`` of a launch that writes a head layer's
    normed input with ``norm`` (a new [B, F, 2H] tensor, the rows in one tile), or without it
    (None, placeholder pointers, tiles of at most BLOCK_H_MAX)."""
    if norm is None:
        return None, (placeholder, placeholder), 0.0, min(BLOCK_H_MAX, triton.next_power_of_2(H))
    normed = torch.empty(B, F, 2 * H, dtype=hidden.dtype, device=hidden.device)
    return normed, norm[:2], float(norm[2]), triton.next_power_of_2(H)


def expansion_step(tokens, scores, frontier, cand_index, cand_tokens, cand_scores, cand_parents, offset: int,
                   top_k: int, draft=None):
    """Launch :func:`_expansion_step_kernel`: see :func:`eagle_kernels.bookkeeping.expansion_step`
    (``draft``: a :class:`eagle_kernels.bookkeeping.DraftInputs` whose ``table`` is None or
    already in the hidden states' dtype)."""
    B, W = tokens.shape
    M, F, C = cand_index.shape[1], frontier.shape[1], cand_tokens.shape[1]
    device = tokens.device
    nxt = torch.empty(3, B, F, dtype=torch.int64, device=device)
    next_scores = torch.empty(B, F, dtype=torch.float32, device=device)
    chunk = triton.cdiv(W, F)
    norm = None if draft is None else draft.norm
    if draft is None:
        inputs = None
        hidden = slot_masks = seqlens = feature = positions = table = embed = nxt
        H, S, words, step, strides = 1, 1, 1, 1, (0, 0, 0)
    else:
        hidden, slot_masks, seqlens, table, step = draft[:5]
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        H = hidden.shape[-1]
        S, words = slot_masks.shape[1:]
        feature = torch.empty(B, F, H, dtype=hidden.dtype, device=device)
        positions = torch.empty(B, 1, dtype=torch.int32, device=device)
        embed = None if table is None else torch.empty(B, F, H, dtype=hidden.dtype, device=device)
        inputs = (feature, positions, embed)
        strides = (hidden.stride(0), hidden.stride(1), 0 if table is None else table.stride(0))
        if table is None:
            table = embed = feature
    normed, weights, eps, block_h = _norm_arguments(norm, B, F, H, hidden, nxt)
    if normed is not None:
        inputs = (*inputs, normed)
    _expansion_step_kernel[(B, F)](
        tokens, scores, frontier, cand_index, cand_tokens, cand_scores, cand_parents, nxt, next_scores,
        hidden, slot_masks, seqlens, feature, positions, table, embed, nxt if normed is None else normed, *weights,
        B, M, top_k, F, C, offset, chunk, step, H, S, words, *strides, eps,
        BLOCK_CHUNK=triton.next_power_of_2(chunk), BLOCK_H=block_h,
        BLOCK_WORDS=triton.next_power_of_2(words), HAS_DRAFT=draft is not None,
        HAS_PARENT_SLOTS=draft is not None and step > 1, HAS_EMBED=draft is not None and embed is not feature,
        HAS_NORM=norm is not None, **launch_options(tokens.device), num_warps=1 if draft is None else 4,
    )
    return nxt[0], next_scores, nxt[1], nxt[2], inputs


@triton.jit(do_not_specialize=["step"])
def _draft_inputs_kernel(
    hidden_ptr,  # [B, M, H] the head's outputs of the previous pass (strided)
    parent_row_ptr,  # [B, F] int64: row of hidden each frontier node continues from
    slot_masks_ptr,  # [B, S, WORDS] int64: mask row of each draft slot over the draft slots
    seqlens_ptr,  # [B] int32: the head cache's committed lengths
    feature_ptr,  # [B, F, H] out
    positions_ptr,  # [B] int32 out
    tokens_ptr,  # [B, F] int64: the frontier's tokens (HAS_EMBED)
    table_ptr,  # [V, H] token embedding (HAS_EMBED; rows strided)
    embed_ptr,  # [B, F, H] out (HAS_EMBED)
    normed_ptr,  # [B, F, 2H] out (HAS_NORM): the head layer's normed input
    norm_weight_ptr,  # [H] (HAS_NORM): the feature's norm
    embed_norm_weight_ptr,  # [H] (HAS_NORM): the embedding's norm
    step, F, H, S, WORDS,
    stride_hb, stride_hm, stride_v, eps,
    BLOCK_H: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    HAS_PARENT_SLOTS: tl.constexpr,  # step > 1: parents sit in draft slots
    HAS_EMBED: tl.constexpr,
    HAS_NORM: tl.constexpr,  # also the head layer's normed input (EAGLE-3's two input norms)
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1)
    parent = tl.load(parent_row_ptr + b * F + m)
    if HAS_EMBED:
        token = tl.load(tokens_ptr + b * F + m)
    else:
        token = 0
    _frontier_node_inputs(hidden_ptr, slot_masks_ptr, seqlens_ptr, feature_ptr, positions_ptr, table_ptr, embed_ptr,
                          normed_ptr, norm_weight_ptr, embed_norm_weight_ptr, eps, b, m, parent, token, step, F, H, S,
                          WORDS, stride_hb, stride_hm, stride_v, BLOCK_H, BLOCK_WORDS, HAS_PARENT_SLOTS, HAS_EMBED,
                          HAS_NORM)


def draft_inputs(hidden, parent_row, slot_masks, seqlens, step: int, tokens=None, table=None, norm=None):
    """Launch :func:`_draft_inputs_kernel`: see :func:`eagle_kernels.bookkeeping.draft_inputs`
    (``norm``: checked, and given only with ``table``)."""
    B, F = parent_row.shape
    H = hidden.shape[-1]
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    feature = torch.empty(B, F, H, dtype=hidden.dtype, device=hidden.device)
    positions = torch.empty(B, 1, dtype=torch.int32, device=hidden.device)
    embed = None if table is None else torch.empty(B, F, H, dtype=hidden.dtype, device=hidden.device)
    normed, weights, eps, block_h = _norm_arguments(norm, B, F, H, hidden, hidden)
    S, words = slot_masks.shape[1:]
    _draft_inputs_kernel[(B, F)](
        hidden, parent_row, slot_masks, seqlens, feature, positions,
        parent_row if table is None else tokens, hidden if table is None else table,
        feature if table is None else embed, feature if normed is None else normed, *weights,
        step, F, H, S, words, hidden.stride(0), hidden.stride(1), 0 if table is None else table.stride(0), eps,
        BLOCK_H=block_h, BLOCK_WORDS=triton.next_power_of_2(words), HAS_PARENT_SLOTS=step > 1,
        HAS_EMBED=table is not None, HAS_NORM=norm is not None, **launch_options(hidden.device), num_warps=4,
    )
    return (feature, positions, embed) if norm is None else (feature, positions, embed, normed)


@triton.jit
def _commit_inputs_kernel(
    accept_nodes_ptr,  # [B, D] int32 (-1 padded)
    out_tokens_ptr,  # [B, D] int64 (-1 padded)
    seqlens_ptr,  # [B] int32: the head cache's committed lengths
    inputs_ptr,  # [3, B, P] int64 out: path rows, emitted tokens (padding clamped to 0), positions
    table_ptr,  # [V, H] token embedding (HAS_EMBED; rows strided)
    embed_ptr,  # [B, P, H] out: the emitted tokens' embedding rows (HAS_EMBED)
    a_ptr, b_ptr, c_ptr,  # [B, N, FH] target features (NUM >= 1, 2, 3; strided rows)
    rows_ptr,  # [B, P, NUM * FH] out: the path rows of a, b, c side by side (NUM >= 1)
    B, D, P, H, FH, stride_v,
    stride_ab, stride_an, stride_bb, stride_bn, stride_cb, stride_cn,
    BLOCK_H: tl.constexpr,
    BLOCK_FH: tl.constexpr,
    HAS_EMBED: tl.constexpr,
    NUM: tl.constexpr,  # feature tensors to gather (0: none)
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    node = tl.maximum(tl.load(accept_nodes_ptr + b * D + p).to(tl.int64), 0)
    token = tl.maximum(tl.load(out_tokens_ptr + b * D + p), 0)
    tl.store(inputs_ptr + b * P + p, node)
    tl.store(inputs_ptr + (B + b) * P + p, token)
    tl.store(inputs_ptr + (2 * B + b) * P + p, tl.load(seqlens_ptr + b).to(tl.int64) + p)
    if HAS_EMBED:
        for start in range(0, H, BLOCK_H):
            h = start + tl.arange(0, BLOCK_H)
            tl.store(embed_ptr + (b * P + p) * H + h,
                     tl.load(table_ptr + token * stride_v + h, mask=h < H, other=0.0).to(embed_ptr.dtype.element_ty),
                     mask=h < H)
    if NUM >= 1:
        target = rows_ptr + (b * P + p) * NUM * FH
        for start in range(0, FH, BLOCK_FH):
            h = start + tl.arange(0, BLOCK_FH)
            inside = h < FH
            tl.store(target + h, tl.load(a_ptr + b * stride_ab + node * stride_an + h, mask=inside, other=0.0),
                     mask=inside)
            if NUM >= 2:
                tl.store(target + FH + h,
                         tl.load(b_ptr + b * stride_bb + node * stride_bn + h, mask=inside, other=0.0), mask=inside)
            if NUM >= 3:
                tl.store(target + 2 * FH + h,
                         tl.load(c_ptr + b * stride_cb + node * stride_cn + h, mask=inside, other=0.0), mask=inside)


def commit_inputs(accept_nodes, out_tokens, seqlens, width: int, table=None, dtype=None, features=None):
    """Launch :func:`_commit_inputs_kernel`: see :func:`eagle_kernels.bookkeeping.commit_inputs`."""
    B, D = accept_nodes.shape
    device = accept_nodes.device
    inputs = torch.empty(3, B, width, dtype=torch.int64, device=device)
    H = 1 if table is None else table.shape[1]
    embed = None if table is None else torch.empty(B, width, H, dtype=dtype, device=device)
    features = [] if features is None else [t if t.stride(-1) == 1 else t.contiguous() for t in features]
    FH = features[0].shape[-1] if features else 1
    rows = (torch.empty(B, width, len(features) * FH, dtype=features[0].dtype, device=device) if features
            else None)
    padded = features + [features[0] if features else inputs] * (3 - len(features))
    strides = [s for t in padded for s in ((t.stride(0), t.stride(1)) if t.dim() == 3 else (0, 0))]
    _commit_inputs_kernel[(B, width)](accept_nodes, out_tokens, seqlens, inputs,
                                      inputs if table is None else table, inputs if table is None else embed,
                                      *padded, inputs if rows is None else rows,
                                      B, D, width, H, FH, 0 if table is None else table.stride(0), *strides,
                                      BLOCK_H=min(BLOCK_H_MAX, triton.next_power_of_2(H)),
                                      BLOCK_FH=min(BLOCK_H_MAX, triton.next_power_of_2(FH)),
                                      HAS_EMBED=table is not None, NUM=len(features),
                                      **launch_options(inputs.device), num_warps=4)
    return inputs[0], inputs[1], inputs[2], embed, rows


@triton.jit
def _gather_rows_kernel(
    a_ptr, b_ptr, c_ptr,  # [B, N, H] each (strided rows; b, c only with NUM >= 2, 3)
    rows_ptr,  # [B, P] int64: the rows to take
    out_ptr,  # [B, P, NUM * H] out: the picked rows of a, b, c side by side
    P, H,
    stride_ab, stride_an, stride_bb, stride_bn, stride_cb, stride_cn,
    NUM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    row = tl.load(rows_ptr + b * P + p)
    target = out_ptr + (b * P + p) * NUM * H
    for start in range(0, H, BLOCK_H):
        h = start + tl.arange(0, BLOCK_H)
        inside = h < H
        tl.store(target + h, tl.load(a_ptr + b * stride_ab + row * stride_an + h, mask=inside, other=0.0),
                 mask=inside)
        if NUM >= 2:
            tl.store(target + H + h, tl.load(b_ptr + b * stride_bb + row * stride_bn + h, mask=inside, other=0.0),
                     mask=inside)
        if NUM >= 3:
            tl.store(target + 2 * H + h,
                     tl.load(c_ptr + b * stride_cb + row * stride_cn + h, mask=inside, other=0.0), mask=inside)


def gather_rows(tensors, rows):
    """Launch :func:`_gather_rows_kernel`: see :func:`eagle_kernels.bookkeeping.gather_rows`."""
    tensors = [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]
    B, P = rows.shape
    H = tensors[0].shape[-1]
    out = torch.empty(B, P, len(tensors) * H, dtype=tensors[0].dtype, device=rows.device)
    padded = tensors + [tensors[0]] * (3 - len(tensors))
    strides = [s for t in padded for s in (t.stride(0), t.stride(1))]
    _gather_rows_kernel[(B, P)](*padded, rows, out, P, H, *strides,
                                NUM=len(tensors), BLOCK_H=min(BLOCK_H_MAX, triton.next_power_of_2(H)),
                                **launch_options(out.device), num_warps=4)
    return out


@triton.jit
def _commit_kernel(
    tokens_ptr,  # [B, T] int64: tokens to emit (verify's out_tokens, -1 padded)
    accept_len_ptr,  # [B] int32: emit tokens[:accept_len + 1] (HAS_ACCEPT; else 1 token)
    done_ptr,  # [B] uint8 (a view of the bool flags), updated
    out_ptr,  # [B, OW] int64, appended to
    out_len_ptr,  # [B] int64, advanced
    steps_ptr,  # [B] int64, +1 while active
    root_ptr,  # [B] int64: the last emitted token
    offset_ptr,  # [B] int64 random-stream offset, +1
    limit_ptr,  # [B] int64 (LIMIT_IS_TENSOR) else the int `limit`
    eos_ptr,  # [B] int64, -1: none (EOS_MODE 2); EOS_MODE 1: the int `eos`
    history_ptr,  # [B, HW] int64 (HAS_HISTORY)
    prompt_len_ptr,  # [B] int64 (HAS_HISTORY)
    seqlens_ptr,  # [B] int32: the target cache's lengths, advanced by the accepted tokens
    head_seqlens_ptr,  # [B] int32 (HAS_HEAD_CACHE)
    hidden_ptr,  # [B, P, H] the head's commit pass (HAS_HIDDEN, strided)
    root_hidden_ptr,  # [B, H] out: hidden at the last accepted pair
    norm_weight_ptr,  # [H] the head's final norm (HAS_NORM)
    root_normed_ptr,  # [B, H] out: the final norm of root_hidden (HAS_NORM)
    T, OW, HW, H, limit, eos, norm_eps,
    stride_hb, stride_hp,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_NORM: tl.constexpr,  # >= H: the row as one tile, as the rmsnorm op reads it
    HAS_ACCEPT: tl.constexpr,
    LIMIT_IS_TENSOR: tl.constexpr,
    EOS_MODE: tl.constexpr,  # 0: no EOS, 1: one for all (`eos`), 2: per request (eos_ptr)
    HAS_HISTORY: tl.constexpr,
    HAS_HEAD_CACHE: tl.constexpr,
    HAS_HIDDEN: tl.constexpr,
    HAS_NORM: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    # Flags as integers (0 / 1): scalar arithmetic instead of boolean scalars, which the
    # interpreter does not broadcast into masks.
    was_done = (tl.load(done_ptr + b) != 0).to(tl.int64)
    active = 1 - was_done
    if HAS_ACCEPT:
        last = tl.load(accept_len_ptr + b).to(tl.int64)
    else:
        last = b * 0  # one token: tokens[:, 0]
    j = tl.arange(0, BLOCK_T)
    tokens = tl.load(tokens_ptr + b * T + j, mask=j < T, other=0)
    valid = (j <= (last + 1) * active - 1) & (j < T)  # nothing for a finished request
    if EOS_MODE == 1:
        stop = eos
    elif EOS_MODE == 2:
        stop = tl.load(eos_ptr + b)
    if EOS_MODE != 0:
        first_eos = tl.min(tl.where(valid & (tokens == stop), j, T), axis=0)
        valid = valid & (j <= first_eos)
    out_len = tl.load(out_len_ptr + b)
    index = tl.minimum(out_len + j, OW - 1)
    tl.store(out_ptr + b * OW + index, tokens, mask=valid)
    if HAS_HISTORY:
        tl.store(history_ptr + b * HW + index + tl.load(prompt_len_ptr + b), tokens, mask=valid)
    out_len += tl.sum(valid.to(tl.int64), axis=0)
    tl.store(out_len_ptr + b, out_len)
    tl.store(steps_ptr + b, tl.load(steps_ptr + b) + active)
    last_token = tl.sum(tl.where(j == last, tokens, 0), axis=0)
    root = tl.load(root_ptr + b)
    tl.store(root_ptr + b, root + (last_token - root) * active)
    if LIMIT_IS_TENSOR:
        finished = (out_len >= tl.load(limit_ptr + b)).to(tl.int64)
    else:
        finished = (out_len >= limit).to(tl.int64)
    if EOS_MODE != 0:
        finished = tl.maximum(finished, tl.max((valid & (tokens == stop)).to(tl.int64), axis=0))
    tl.store(done_ptr + b, tl.maximum(was_done, finished).to(tl.uint8))
    tl.store(offset_ptr + b, tl.load(offset_ptr + b) + 1)
    advance = ((last + 1) * active).to(tl.int32)
    tl.store(seqlens_ptr + b, tl.load(seqlens_ptr + b) + advance)
    if HAS_HEAD_CACHE:
        tl.store(head_seqlens_ptr + b, tl.load(head_seqlens_ptr + b) + advance)
    if HAS_HIDDEN:
        source = hidden_ptr + b * stride_hb + last * stride_hp
        if HAS_NORM:  # the row and its final norm (the rmsnorm op's arithmetic: docs/ops.md §9)
            offs = tl.arange(0, BLOCK_NORM)
            row = _normalise_row(source, norm_weight_ptr, root_normed_ptr + b * H, offs, offs < H, H, norm_eps)
            tl.store(root_hidden_ptr + b * H + offs, row, mask=offs < H)
        else:
            for start in range(0, H, BLOCK_H):
                h = start + tl.arange(0, BLOCK_H)
                tl.store(root_hidden_ptr + b * H + h, tl.load(source + h, mask=h < H, other=0.0), mask=h < H)


def commit(tokens, accept_len, done, out, out_len, steps, root, offset, limit, eos, history, prompt_len,
           seqlens, head_seqlens, hidden, root_hidden, norm=None, root_normed=None):
    """Launch :func:`_commit_kernel`: see :func:`eagle_kernels.bookkeeping.commit`."""
    B, T = tokens.shape
    limit_tensor = isinstance(limit, torch.Tensor)
    eos_mode = 0 if eos is None else (2 if isinstance(eos, torch.Tensor) else 1)
    H = 1 if hidden is None else hidden.shape[-1]
    if hidden is not None and hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    has_norm = hidden is not None and norm is not None
    dummy = out_len
    _commit_kernel[(B,)](
        tokens, dummy if accept_len is None else accept_len, done.view(torch.uint8), out, out_len, steps, root, offset,
        limit if limit_tensor else dummy, eos if eos_mode == 2 else dummy,
        dummy if history is None else history, dummy if prompt_len is None else prompt_len,
        seqlens, seqlens if head_seqlens is None else head_seqlens,
        out if hidden is None else hidden, out if root_hidden is None else root_hidden,
        out if not has_norm else norm[0], out if not has_norm else root_normed,
        T, out.shape[1], 0 if history is None else history.shape[1], H,
        0 if limit_tensor else int(limit), eos if eos_mode == 1 else 0, float(norm[1]) if has_norm else 0.0,
        0 if hidden is None else hidden.stride(0), 0 if hidden is None else hidden.stride(1),
        BLOCK_T=triton.next_power_of_2(T), BLOCK_H=min(BLOCK_H_MAX, triton.next_power_of_2(H)),
        BLOCK_NORM=triton.next_power_of_2(H) if has_norm else 1, HAS_NORM=has_norm,
        HAS_ACCEPT=accept_len is not None, LIMIT_IS_TENSOR=limit_tensor, EOS_MODE=eos_mode,
        HAS_HISTORY=history is not None, HAS_HEAD_CACHE=head_seqlens is not None, HAS_HIDDEN=hidden is not None,
        **launch_options(out.device), num_warps=4,
    )


@triton.jit
def _token_rows_kernel(
    tokens_ptr,  # [R] int64 (R = B * N)
    table_ptr,  # [V, H] token embedding (rows strided), in the model's dtype
    weight_ptr,  # [H] the first layer's input norm
    out_ptr,  # [R, H] out: the rows' norm
    residual_ptr,  # [R, H] out: the rows
    seqlens_ptr,  # [B] int32 (HAS_DEPTHS)
    depths_ptr,  # [R] int32 (HAS_DEPTHS)
    positions_ptr,  # [R] int32 out: seqlens + depths (HAS_DEPTHS)
    N, H, stride_v, eps,
    BLOCK_H: tl.constexpr,
    HAS_DEPTHS: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    token = tl.load(tokens_ptr + row)
    x = _normalise_row(table_ptr + token * stride_v, weight_ptr, out_ptr + row * H, offs, offs < H, H, eps)
    tl.store(residual_ptr + row * H + offs, x, mask=offs < H)
    if HAS_DEPTHS:
        tl.store(positions_ptr + row, tl.load(seqlens_ptr + row // N) + tl.load(depths_ptr + row))


def token_rows(tokens, table, weight, eps: float, seqlens=None, depths=None, positions=None):
    """Launch :func:`_token_rows_kernel`: see :func:`eagle_kernels.bookkeeping.token_rows`."""
    B, N = tokens.shape
    H = table.shape[1]
    out = torch.empty(B, N, H, dtype=table.dtype, device=tokens.device)
    residual = torch.empty(B, N, H, dtype=table.dtype, device=tokens.device)
    has_depths = depths is not None
    if has_depths and positions is None:
        positions = torch.empty(B, N, dtype=torch.int32, device=tokens.device)
    if B * N:
        _token_rows_kernel[(B * N,)](tokens, table, weight, out, residual,
                                     seqlens if has_depths else tokens, depths if has_depths else tokens,
                                     positions if has_depths else tokens, N, H, table.stride(0), float(eps),
                                     BLOCK_H=triton.next_power_of_2(H), HAS_DEPTHS=has_depths,
                                     **launch_options(out.device), num_warps=4)
    return out, residual, positions
