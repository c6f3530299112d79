"""The bookkeeping of a speculative step between its kernels: torch on the CPU, one Triton launch
each on the GPU path.

A decoding step on a GPU is launch-bound (docs/decoding.md, "Launches per step"). Written in
torch, the bookkeeping around the step's kernels (the candidate history of an EAGLE-2
expansion, the head's draft mask rows, emitting the accepted tokens) is a chain of small ops,
each a launch: about 180 per step. Each function here does one such piece of bookkeeping in
one Triton launch (:mod:`eagle_kernels.triton.bookkeeping`) where the GPU path runs (tensors
off the CPU, or the launch count's forced GPU path), and in the torch ops of the same logic
on the CPU (faster there than the interpreter, and the truth the Triton kernels are tested
against: python_tests/decoding/test_bookkeeping.py). Both give identical results. Nothing here
reads tensor values on the host, so a step stays capturable in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

from .norm import rms_norm

_forced = False  # CPU tensors take the GPU path (the launch count, tests; needs TRITON_INTERPRET=1)


def gpu_path(t: torch.Tensor) -> bool:
    """Whether work on ``t`` takes the GPU path: ``t`` off the CPU, or forced by
    :func:`gpu_path_on_cpu`."""
    return t.device.type != "cpu" or _forced


@contextlib.contextmanager
def gpu_path_on_cpu(on: bool = True):
    """CPU tensors take the GPU path inside the block (Triton kernels run interpreted)."""
    global _forced
    saved, _forced = _forced, on
    try:
        yield
    finally:
        _forced = saved


def _triton():
    from .triton import bookkeeping

    return bookkeeping


def _check(name: str, t: torch.Tensor, dtype, shape: tuple) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous {dtype} tensor of shape {list(shape)}, got "
                         f"{t.dtype} {list(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")


# ---------------------------------------------------------------------------- expansion
class DraftInputs(NamedTuple):
    """What an EAGLE head's pass over the next frontier reads (see :func:`draft_inputs`), for
    :func:`expansion_step` to gather in the same launch: the head's outputs ``hidden`` [B, M, H]
    of this depth's pass, the draft slots' mask rows ``slot_masks``, the head cache's
    ``seqlens``, the token embedding ``table`` [V, H] (or None) and the pass's ``step``; and
    ``norm``, an EAGLE-3 head layer's input norms ``(weight [H], embed_weight [H], eps)`` (the
    feature's and the embedding's) where its GPU layer path takes a normed input: the GPU path's
    expansion step then also writes that input (``normed``, below), so the layer skips its
    ``rmsnorm`` launch."""

    hidden: torch.Tensor
    slot_masks: torch.Tensor
    seqlens: torch.Tensor
    table: torch.Tensor | None
    step: int
    norm: tuple | None = None


def expansion_step(tokens, scores, frontier, cand_index, cand_tokens, cand_scores, cand_parents, offset: int,
                   top_k: int, draft: DraftInputs | None = None):
    """Record one depth of an EAGLE-2 expansion and gather the next frontier.

    ``tokens`` int64 / ``scores`` float32 [B, M * top_k] and ``frontier`` int32 [B, F] are one
    ``draft_expand``'s candidates (child ``r`` of node ``m`` at ``m * top_k + r``);
    ``cand_index`` int64 [B, M] the expanded nodes' history indices (-1: the root). Writes the
    candidates into ``cand_tokens`` / ``cand_scores`` / ``cand_parents`` [B, C] at
    ``offset .. offset + M * top_k`` (parent: the node's history index) and returns the
    frontier's ``(tokens int64, scores float32, parent_row int64, cand_index int64)``, [B, F]
    each (``parent_row``: the frontier node's parent among the M nodes), and ``inputs``: with
    ``draft``, :func:`draft_inputs` of the head's pass over that frontier, ``(feature,
    positions, embed)`` (its mask rows written into ``draft.slot_masks``), made in the same
    launch on the GPU path; else None. On the GPU path, with ``draft.norm`` and the embedding
    rows, ``inputs`` has a fourth entry ``normed`` [B, F, 2H]: the rmsnorm op's
    ``rmsnorm(feature, weight, eps, embed=embed, embed_weight=embed_weight)[0]``, bit for bit (the
    same row function).
    """
    B, W = tokens.shape
    M, F, C = cand_index.shape[1], frontier.shape[1], cand_tokens.shape[1]
    if gpu_path(tokens):
        for name, t, dtype, shape in (("tokens", tokens, torch.int64, (B, W)),
                                      ("scores", scores, torch.float32, (B, W)),
                                      ("frontier", frontier, torch.int32, (B, F)),
                                      ("cand_index", cand_index, torch.int64, (B, W // top_k)),
                                      ("cand_tokens", cand_tokens, torch.int64, (B, C)),
                                      ("cand_scores", cand_scores, torch.float32, (B, C)),
                                      ("cand_parents", cand_parents, torch.int32, (B, C))):
            _check(name, t, dtype, shape)
        if draft is not None:
            _check_draft(draft.hidden, draft.slot_masks, draft.seqlens, draft.step, F)
            table = _embedding_table(draft.table, tokens, draft.hidden.dtype)
            if table is not None and table.shape[1] != draft.hidden.shape[-1]:
                raise ValueError(f"table: expected [V, {draft.hidden.shape[-1]}], got {list(table.shape)}")
            draft = draft._replace(table=table, norm=_checked_norm(draft.norm, table, draft.hidden))
        return _triton().expansion_step(tokens, scores, frontier, cand_index, cand_tokens, cand_scores,
                                        cand_parents, offset, top_k, draft)
    cand_tokens[:, offset:offset + W] = tokens
    cand_scores[:, offset:offset + W] = scores
    cand_parents[:, offset:offset + W] = cand_index[:, :, None].expand(B, M, top_k).reshape(B, W)
    frontier = frontier.long()
    nxt = (torch.gather(tokens, 1, frontier), torch.gather(scores, 1, frontier),
           torch.div(frontier, top_k, rounding_mode="floor"), frontier + offset)
    inputs = None
    if draft is not None:
        inputs = draft_inputs(draft.hidden, nxt[2], draft.slot_masks, draft.seqlens, draft.step, nxt[0],
                              draft.table)
    return (*nxt, inputs)


# ---------------------------------------------------------------------------- head drafts
def _embedding_table(table, tokens, dtype):
    """``table`` if the GPU path's kernels gather its rows themselves: rows already in ``dtype``
    (the embedding is then a copy, no conversion), and tokens given; else None."""
    if table is None or tokens is None or table.dim() != 2 or table.dtype != dtype:
        return None
    if table.stride(1) != 1 or table.device != tokens.device:
        return None
    return table


def _checked_norm(norm, table, hidden):
    """``norm`` (a head layer's ``(weight, embed_weight, eps)``) where the GPU path can write the
    normed input: with the embedding rows (``table`` not None); weights checked to be [H] in
    ``hidden``'s dtype."""
    if norm is None or table is None:
        return None
    for name, weight in zip(("norm weight", "norm embed_weight"), norm[:2]):
        _check(name, weight, hidden.dtype, (hidden.shape[-1],))
    return norm


def _check_draft(hidden, slot_masks, seqlens, step: int, F: int) -> None:
    B = hidden.shape[0]
    if hidden.dim() != 3:
        raise ValueError(f"hidden: expected [B, M, H], got {list(hidden.shape)}")
    _check("slot_masks", slot_masks, torch.int64, (B, slot_masks.shape[1], slot_masks.shape[2]))
    _check("seqlens", seqlens, torch.int32, (B,))
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"step: expected an int >= 1, got {step!r}")
    if slot_masks.shape[1] < step * F:
        raise ValueError(f"slot_masks: {slot_masks.shape[1]} slots, step {step} needs {step * F}")


def draft_inputs(hidden, parent_row, slot_masks, seqlens, step: int, tokens=None, table=None, norm=None):
    """The inputs of an EAGLE head's pass over the frontier of expansion step ``step >= 1``.

    ``hidden`` [B, M, H]: the head's outputs of the previous pass; ``parent_row`` int64 [B, F]:
    the row each frontier node continues from; ``slot_masks`` int64 [B, S, words]: the mask
    rows of the draft slots (bit ``j``: slot ``j`` visible), frontier node ``m`` of step ``s``
    in slot ``(s - 1) * F + m``; ``seqlens`` int32 [B]: the head cache's committed lengths;
    ``tokens`` int64 [B, F] and ``table`` [V, H]: the frontier's tokens and the token embedding.
    Writes the frontier's rows of ``slot_masks`` (its parent's row, none at step 1, plus its
    own bit) and returns ``(feature [B, F, H], positions int32 [B, 1] = seqlens + step - 1,
    embed)``: ``embed`` [B, F, H] the tokens' embedding rows in ``hidden``'s dtype on the GPU
    path (with ``tokens`` and ``table`` in that dtype), else None (the head embeds them itself).
    With ``norm`` (:attr:`DraftInputs.norm`) and the embedding rows, the GPU path returns a fourth
    entry, the head layer's normed input [B, F, 2H] (as :func:`expansion_step`).
    """
    B, F = parent_row.shape
    if gpu_path(hidden):
        _check("parent_row", parent_row, torch.int64, (B, F))
        _check_draft(hidden, slot_masks, seqlens, step, F)
        table = _embedding_table(table, tokens, hidden.dtype)
        if table is not None:
            _check("tokens", tokens, torch.int64, (B, F))
            if table.shape[1] != hidden.shape[-1]:
                raise ValueError(f"table: expected [V, {hidden.shape[-1]}], got {list(table.shape)}")
        return _triton().draft_inputs(hidden, parent_row, slot_masks, seqlens, step, tokens, table,
                                      _checked_norm(norm, table, hidden))
    H, words = hidden.shape[-1], slot_masks.shape[-1]
    feature = torch.gather(hidden, 1, parent_row[..., None].expand(-1, -1, H))
    own = (step - 1) * F + torch.arange(F, device=hidden.device)  # this frontier's slots
    if step == 1:  # children of the root: no ancestor slots
        rows = torch.zeros(B, F, words, dtype=torch.int64, device=hidden.device)
    else:
        rows = torch.gather(slot_masks, 1, ((step - 2) * F + parent_row)[..., None].expand(-1, -1, words))
    rows[:, torch.arange(F, device=hidden.device), own // 64] |= torch.ones_like(own) << (own % 64)
    slot_masks[:, own] = rows
    return feature, seqlens[:, None] + (step - 1), None


# ---------------------------------------------------------------------------- target pass
def token_rows(tokens, table, weight, eps: float, seqlens=None, depths=None, positions=None):
    """A decoder's first layer input from its tokens: ``(out, residual, positions)``, where
    ``residual`` [B, N, H] are the rows of the token embedding ``table`` [V, H] (in the model's
    dtype) for ``tokens`` int64 [B, N], ``out`` their RMSNorm with ``weight`` [H] (the rmsnorm
    op's arithmetic on the GPU path, docs/ops.md §9) and, with ``seqlens`` int32 [B] and
    ``depths`` int32 [B, N], ``positions`` int32 [B, N] = ``seqlens + depths`` (written into
    ``positions`` when given; else None): the embedding, the first layer's input norm and a
    tree's positions in one launch on the GPU path (the GPU layer path's first launch)."""
    B, N = tokens.shape
    H = table.shape[-1] if table.dim() == 2 else -1
    if gpu_path(tokens):
        _check("tokens", tokens, torch.int64, (B, N))
        if table.dim() != 2 or table.stride(1) != 1 or table.device != tokens.device:
            raise ValueError(f"table: expected [V, H] with contiguous rows on {tokens.device}, got "
                             f"{list(table.shape)} strides {table.stride()} on {table.device}")
        _check("weight", weight, table.dtype, (H,))
        if depths is not None:
            _check("seqlens", seqlens, torch.int32, (B,))
            _check("depths", depths, torch.int32, (B, N))
            if positions is not None:
                _check("positions", positions, torch.int32, (B, N))
        return _triton().token_rows(tokens, table, weight, eps, seqlens, depths, positions)
    residual = torch.nn.functional.embedding(tokens, table)
    if depths is not None:
        if positions is None:
            positions = tree_positions(seqlens, depths)
        else:
            torch.add(depths, seqlens[:, None], out=positions)
    return rms_norm(residual, weight, eps), residual, positions if depths is not None else None


# ---------------------------------------------------------------------------- commit
def tree_positions(seqlens, depths=None):
    """Positions of a target pass over a tree, int32 [B, N]: ``seqlens`` [B] plus the nodes'
    ``depths`` int32 [B, N] (None: one token per request, at ``seqlens``: a view). One launch,
    where int64 positions took three; every consumer takes int32 (RoPE converts to float64 or
    reads them in its kernel)."""
    return seqlens[:, None] if depths is None else depths + seqlens[:, None]


def commit_inputs(accept_nodes, out_tokens, seqlens, width: int | None, table=None, dtype=None, features=None):
    """The head's commit input from ``verify``'s accepted path: ``(path int64, emitted int64,
    positions, embed, rows)`` [B, width] (None: all of ``accept_nodes``' columns), -1 padding
    clamped to 0. On the GPU path ``positions`` int64 ``seqlens + j`` (the head cache's ``seqlens``
    int32 [B]), with a token embedding ``table`` [V, H] in ``dtype`` ``embed`` [B, width, H]
    the emitted tokens' rows, and with ``features`` (up to three [B, N, FH] tensors of one
    dtype, no autograd graph: EAGLE-3's low, mid and high target features) ``rows`` [B, width,
    len(features) * FH] their ``path`` rows side by side (:func:`gather_rows`), all in one
    launch; on the CPU all three None (the head's defaults, the same values)."""
    if gpu_path(accept_nodes):
        B, D = accept_nodes.shape
        _check("accept_nodes", accept_nodes, torch.int32, (B, D))
        _check("out_tokens", out_tokens, torch.int64, (B, D))
        _check("seqlens", seqlens, torch.int32, (B,))
        table = None if dtype is None else _embedding_table(table, out_tokens, dtype)
        if features is not None and not _gathers(features):
            features = None
        if features is not None:
            _check_features(features, B)
        return _triton().commit_inputs(accept_nodes, out_tokens, seqlens, D if width is None else min(width, D),
                                       table, dtype, features)
    return accept_nodes.clamp(min=0).long()[:, :width], out_tokens.clamp(min=0)[:, :width], None, None, None


def _gathers(tensors) -> bool:
    """Whether the GPU path's kernels gather rows of ``tensors``: one to three, no autograd graph."""
    return 1 <= len(tensors) <= 3 and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _check_features(tensors, B: int) -> None:
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dim() != 3 or t.shape[0] != B or t.shape[2] != first.shape[2] or t.dtype != first.dtype:
            raise ValueError(f"tensors[{i}]: expected [B = {B}, N, {first.shape[2]}] {first.dtype}, got "
                             f"{list(t.shape)} {t.dtype}")


def gather_rows(tensors, rows):
    """``rows`` int64 [B, P] of each of ``tensors`` ([B, N, H] each, one dtype), side by side:
    [B, P, len(tensors) * H] (EAGLE-3's low, mid and high features of the accepted path). The
    GPU path's kernel takes up to three tensors and no autograd graph; torch the rest."""
    if gpu_path(rows) and _gathers(tensors):
        B, P = rows.shape
        _check("rows", rows, torch.int64, (B, P))
        _check_features(tensors, B)
        return _triton().gather_rows(list(tensors), rows)
    picked = [torch.gather(t, 1, rows[..., None].expand(-1, -1, t.shape[-1])) for t in tensors]
    return picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)


def commit(state, tokens, accept_len, hidden, head_cache, norm=None) -> None:
    """Commit a step of the decoder's ``state`` (:class:`eagle_kernels.decoder._State`): for each
    active request (not ``done``), append ``tokens[:accept_len + 1]`` (``accept_len`` int32
    [B]; None: one token) to ``state.out`` (and its lookup history), up to and including an EOS;
    count the step, make the last token the next root and the head's output ``hidden`` [B, P, H]
    at that pair the next ``root_hidden`` (``hidden`` None: no head); advance the target cache
    and ``head_cache`` by the accepted tokens; set ``done`` at the token limit or an EOS; advance
    the random-stream offset. ``norm`` ``(weight [H], eps)``: the head's final norm (EAGLE-3),
    also applied to the new ``root_hidden`` into ``state.root_normed`` [B, H] (the first draft
    logits' input: in the same launch on the GPU path)."""
    has_norm = hidden is not None and norm is not None
    if gpu_path(tokens):
        B = tokens.shape[0]
        _check("tokens", tokens, torch.int64, (B, tokens.shape[1]))
        if accept_len is not None:
            _check("accept_len", accept_len, torch.int32, (B,))
        if hidden is not None and hidden.shape[0] != B:
            raise ValueError(f"hidden: expected {B} rows, got shape {list(hidden.shape)}")
        if has_norm:
            H = hidden.shape[-1]
            _check("state.root_normed", state.root_normed, hidden.dtype, (B, H))
            _check("norm weight", norm[0], hidden.dtype, (H,))
        _triton().commit(tokens, accept_len, state.done, state.out, state.out_len, state.steps, state.root,
                         state.offset, state.limit, state.eos, state.history, state.prompt_len,
                         state.target_cache.seqlens, None if head_cache is None else head_cache.seqlens,
                         hidden, state.root_hidden if hidden is not None else None,
                         norm if has_norm else None, state.root_normed if has_norm else None)
        return
    if accept_len is not None and hidden is not None:
        last = accept_len.long()
        set_root_hidden(state, torch.gather(hidden, 1, last[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0],
                        norm)
    native = _native_commit()
    if (native is not None and tokens.device.type == "cpu" and isinstance(state.limit, int)
            and (state.eos is None or isinstance(state.eos, int))):
        head_seqlens = None if head_cache is None or accept_len is None else head_cache.seqlens
        native(tokens, accept_len, state.done, state.out, state.out_len, state.steps, state.root, state.offset,
               state.limit, -1 if state.eos is None else state.eos, state.history,
               state.prompt_len if state.history is not None else None, state.target_cache.seqlens, head_seqlens)
        return
    commit_tokens(state, tokens, accept_len, head_cache)


def set_root_hidden(state, root_hidden, norm=None) -> None:
    """The head's output at each request's last committed pair ([B, H]) as the next ``state.root_hidden``, and
    with ``norm`` ``(weight, eps)`` (EAGLE-3's final norm) its normed rows as ``state.root_normed`` (CPU path)."""
    state.root_hidden.copy_(root_hidden)
    if norm is not None and state.root_normed is not None:
        state.root_normed.copy_(rms_norm(state.root_hidden, *norm))


@functools.cache
def _native_commit():
    """``torch.ops.eagle_kernels.decoder_commit`` (csrc/cpu/decoder_commit.cpp: :func:`commit_tokens` in one call)
    where the C++ extension has it, else None."""
    from . import _dispatch

    if not _dispatch.HAS_CPP or not torch._C._dispatch_has_kernel_for_dispatch_key("eagle_kernels::decoder_commit",
                                                                                  "CPU"):
        return None
    return torch.ops.eagle_kernels.decoder_commit


def commit_tokens(state, tokens, accept_len, head_cache) -> None:
    """The token part of :func:`commit` in torch ops (the CPU kernel ``decoder_commit`` computes the same)."""
    active = ~state.done
    if accept_len is None:  # one token each
        state.target_cache.seqlens += active.to(torch.int32)
        _emit(state, tokens, torch.zeros_like(state.out_len), active)
        return
    last = accept_len.long()
    advance = (accept_len + 1) * active.to(torch.int32)
    state.target_cache.seqlens += advance
    if head_cache is not None:
        head_cache.seqlens += advance
    _emit(state, tokens, last, active)


def _emit(state, tokens: torch.Tensor, last: torch.Tensor, active: torch.Tensor) -> None:
    """Append ``tokens[:, :last + 1]`` of the active requests; stop at EOS / max tokens."""
    width = tokens.shape[1]
    j = torch.arange(width, device=tokens.device)
    valid = (j[None] <= last[:, None]) & active[:, None]
    if state.eos is not None:
        is_eos = valid & (tokens == state.eos)
        first_eos = torch.where(is_eos, j[None], width).min(dim=1).values
        valid &= j[None] <= first_eos[:, None]
    index = (state.out_len[:, None] + j[None]).clamp(max=state.out.shape[1] - 1)
    buffers = [(state.out, index)]
    if state.history is not None:
        buffers.append((state.history, index + state.prompt_len[:, None]))
    for buffer, at in buffers:
        buffer.scatter_(1, at, torch.where(valid, tokens, torch.gather(buffer, 1, at)))
    count = valid.sum(1)
    state.out_len += count
    state.steps += active.long()
    state.root.copy_(torch.where(active, torch.gather(tokens, 1, last[:, None])[:, 0], state.root))
    finished = state.out_len >= state.limit
    if state.eos is not None:
        finished |= (valid & (tokens == state.eos)).any(1)
    state.done |= finished
    state.offset += 1
