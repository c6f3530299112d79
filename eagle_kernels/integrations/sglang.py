"""SGLang plugin: our ops under SGLang's EAGLE tree path (docs/serving.md).

Entry point ``eagle_kernels = eagle_kernels.integrations.sglang:register`` in the group
``sglang.srt.plugins``; enabled by ``SGLANG_PLUGINS=eagle_kernels`` (or
``EAGLE_KERNELS_ENGINE_PLUGINS=1``). It registers AROUND hooks with SGLang's
``HookRegistry`` (which also rebinds the ``from X import Y`` copies) on

- ``spec_tree.build_tree_kernel_efficient_func``: the tree links, positions and the three tree
  mask layouts from SGLang's selected candidates (:func:`._layout.tree_from_selection`);
- ``spec_tree.verify_tree_greedy_func``: the greedy walk through :func:`eagle_kernels.verify`;
- ``verify_sampling.tree_speculative_sampling_target_only``: lossless tree sampling through
  :func:`eagle_kernels.verify` (docs/ops.md §4);
- ``verify_sampling.chain_speculative_sampling_triton`` (SGLang's rejection-sampling option):
  chains with the drafter's probabilities through verify's draft-aware rule;
- ``spec_utils.move_accept_tokens_to_target_kvcache``: the KV commit through
  :func:`eagle_kernels.compact_kv` over SGLang's slot-addressed pool (plain MHA pools);
- ``eagle_utils._verify_uses_greedy``: on CPU, XPU (and HIP without rejection sampling) SGLang
  verifies sampling requests greedily, which changes their output distribution; with the plugin
  they take the sampling path, which then runs our verify;
- ``sglang.kernels.ops.sampling.softmax``: SGLang's own, recorded with its inputs so that the
  sampling verify can take the logits the probabilities were made of (:func:`_handed_logits`).

On CPU the verify hooks run native ops (csrc/cpu/engine_layout.cpp) that convert, call our
verify kernel and write SGLang's outputs in one call; elsewhere (and without the C++ extension)
the same conversion runs as tensor code without host reads (``*_tensors``, their reference).

Where SGLang has no kernel at all (``None`` on CPU/XPU: the tree sampling verify and the
top-k/top-p renormalisations), the attributes are set directly instead of hooked: a REPLACE hook
on a ``None`` attribute would rebind every ``None``-valued global of the process.

Cases outside our contract go to SGLang's own function, with one log line per reason: relaxed
acceptance thresholds (``speculative_accept_threshold_* != 1``), tensors of an unexpected dtype or
shape, an unknown tree-mask mode. (Block verification of rejection-sampled chains runs our
``block_verify``.)
"""

from __future__ import annotations

import functools
import inspect
import weakref
from importlib import metadata

import torch

from .. import ops
from . import _layout, enabled, logger

SPEC_TREE = "sglang.kernels.ops.speculative.spec_tree"
VERIFY_SAMPLING = "sglang.kernels.ops.speculative.verify_sampling"
EAGLE_UTILS = "sglang.srt.speculative.eagle_utils"
SPEC_UTILS = "sglang.srt.speculative.spec_utils"
SAMPLING = "sglang.kernels.ops.sampling"
TESTED_VERSIONS = ("0.5.23",)
FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2

_INT_DTYPES = (torch.int32, torch.int64)


class OutsideContract(Exception):
    """A call our adapter does not take; SGLang's own function runs it."""


@functools.cache
def _log_fallback(where: str, reason: str) -> None:
    logger.warning("eagle_kernels: %s falls back to SGLang's own kernel: %s", where, reason)


def _need(cond: bool, reason: str) -> None:
    if not cond:
        raise OutsideContract(reason)


def _need_tensor(name, t, dtypes, shape=None, ndim=None):
    # The messages are formatted only on failure: this runs on every call.
    if not isinstance(t, torch.Tensor):
        raise OutsideContract(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise OutsideContract(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise OutsideContract(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise OutsideContract(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


@functools.cache
def _native_op(name: str):
    """``torch.ops.eagle_kernels.<name>`` when the C++ extension has it (CPU), else ``None``."""
    from .. import _dispatch

    if not _dispatch.HAS_CPP or not torch._C._dispatch_has_kernel_for_dispatch_key(f"eagle_kernels::{name}", "CPU"):
        return None
    return getattr(torch.ops.eagle_kernels, name)


def _run_native(name: str, args) -> bool:
    """Run the native CPU conversion + verify ``name`` (csrc/cpu/engine_layout.cpp) on SGLang's
    arguments when they are CPU tensors and the extension has it; returns whether it ran. Its
    argument checks (ValueError naming the tensor) become :class:`OutsideContract`."""
    native = _native_op(name)
    if native is None:
        return False
    try:
        if not args[3].is_cpu:
            return False
        native(*args)
    except ValueError as error:
        raise OutsideContract(str(error)) from None
    except (AttributeError, TypeError, RuntimeError):
        if all(isinstance(t, torch.Tensor) for t in args):
            raise
        return False  # not all tensors: the tensor path names the argument
    return True


# ------------------------------------------------------------------------------ build tree
def build_tree(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve_index, retrieve_next_token,
               retrieve_next_sibling, topk, spec_steps, num_verify_tokens, tree_mask_mode):
    """SGLang's ``build_tree_kernel_efficient_func`` (outputs written in place): on CPU the native
    op ``torch.ops.eagle_kernels.sglang_build_tree`` (csrc/cpu/engine_layout.cpp), elsewhere
    :func:`build_tree_tensors`. Raises :class:`OutsideContract` for inputs it does not take."""
    _build_tree(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve_index, retrieve_next_token,
                retrieve_next_sibling, topk, spec_steps, num_verify_tokens, tree_mask_mode, native=True)


def build_tree_tensors(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve_index,
                       retrieve_next_token, retrieve_next_sibling, topk, spec_steps, num_verify_tokens, tree_mask_mode):
    """:func:`build_tree` as tensor code (:func:`._layout.tree_from_selection`, capturable; any
    device): the reference of the native CPU op ``torch.ops.eagle_kernels.sglang_build_tree``."""
    _build_tree(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve_index, retrieve_next_token,
                retrieve_next_sibling, topk, spec_steps, num_verify_tokens, tree_mask_mode, native=False)


def _build_tree(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve_index, retrieve_next_token,
                retrieve_next_sibling, topk, spec_steps, num_verify_tokens, tree_mask_mode, native):
    N = int(num_verify_tokens)
    mode = int(tree_mask_mode)
    _need(mode in (FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING), f"tree_mask_mode: unknown mode {tree_mask_mode!r}")
    _need(int(topk) > 0 and int(spec_steps) > 0 and N > 0, f"topk, spec_steps, num_verify_tokens: "
          f"expected > 0, got {topk}, {spec_steps}, {num_verify_tokens}")
    _need_tensor("seq_lens", seq_lens, _INT_DTYPES, ndim=1)
    B = seq_lens.shape[0]
    _need_tensor("top_scores_index", top_scores_index, _INT_DTYPES, shape=(B, N - 1))
    _need_tensor("parent_list", parent_list, _INT_DTYPES, ndim=2)
    _need(parent_list.shape[0] == B, f"parent_list: expected {B} rows, got shape {tuple(parent_list.shape)}")
    for name, t in (("retrieve_index", retrieve_index), ("retrieve_next_token", retrieve_next_token),
                    ("retrieve_next_sibling", retrieve_next_sibling)):
        _need_tensor(name, t, _INT_DTYPES, shape=(B, N))
    _need_tensor("positions", positions, _INT_DTYPES, shape=(B * N,))
    _need(isinstance(tree_mask, torch.Tensor) and tree_mask.dim() == 1 and tree_mask.is_contiguous(),
          "tree_mask: expected a contiguous 1-D tensor")
    if mode == QLEN_ONLY_BITPACKING:
        _need(N <= 32, f"tree_mask_mode QLEN_ONLY_BITPACKING: needs num_verify_tokens <= 32, got {N}")
    device = seq_lens.device
    outs = (parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve_index, retrieve_next_token,
            retrieve_next_sibling)
    if native and all(t.is_cpu for t in outs):
        args = (*outs, int(topk), int(spec_steps), N, mode)
        if _run_native("sglang_build_tree", args):
            return

    parents, linked, depths, ancestors = _layout.tree_from_selection(parent_list, top_scores_index, int(topk),
                                                                     int(spec_steps))
    next_token, next_sibling = _layout.first_child_next_sibling(parents, linked)
    ar = torch.arange(N, device=device)
    base = torch.arange(B, device=device)[:, None] * N
    retrieve_index.copy_(base + ar)
    retrieve_next_token.copy_(next_token)
    retrieve_next_sibling.copy_(next_sibling)
    seq = seq_lens.long()
    positions.copy_((seq[:, None] + depths).reshape(-1))

    if mode == QLEN_ONLY:
        _need(tree_mask.numel() >= B * N * N,
              f"tree_mask: expected at least {B * N * N} entries, got {tree_mask.numel()}")
        tree_mask[: B * N * N].copy_(ancestors.reshape(-1))
    elif mode == QLEN_ONLY_BITPACKING:
        width = 4 if N > 16 else (2 if N > 8 else 1)
        raw = tree_mask.view(torch.uint8)
        _need(raw.numel() >= B * N * width, f"tree_mask: expected at least {B * N * width} bytes, got {raw.numel()}")
        words = _layout.mask_words_from_ancestors(ancestors)[:, :, 0]
        shifts = torch.arange(width, device=device) * 8
        raw[: B * N * width].copy_(((words[:, :, None] >> shifts) & 0xFF).reshape(-1))
    else:
        # Request b's rows start after the rows of the requests before it: N * (seq_len + N) each.
        prefix = torch.cumsum(seq, 0) - seq
        row = (N * N * torch.arange(B, device=device) + prefix * N)[:, None] + ar * (seq[:, None] + N) + seq[:, None]
        index = (row[:, :, None] + ar).reshape(-1)
        tree_mask.index_put_((index,), ancestors.reshape(-1).to(tree_mask.dtype))


# ------------------------------------------------------------------------------ greedy verify
def _check_verify_tensors(predicts, accept_index, accept_token_num, candidates, retrieve_index,
                          retrieve_next_token, retrieve_next_sibling):
    _need_tensor("candidates", candidates, _INT_DTYPES, ndim=2)
    B, N = candidates.shape
    _need_tensor("predicts", predicts, _INT_DTYPES, ndim=1)
    _need(predicts.numel() >= B * N, f"predicts: expected at least {B * N} entries, got {predicts.numel()}")
    _need_tensor("accept_index", accept_index, _INT_DTYPES, ndim=2)
    _need(accept_index.shape[0] == B and accept_index.shape[1] >= 1,
          f"accept_index: expected shape ({B}, depth + 1), got {tuple(accept_index.shape)}")
    _need_tensor("accept_token_num", accept_token_num, _INT_DTYPES, shape=(B,))
    for name, t in (("retrieve_index", retrieve_index), ("retrieve_next_token", retrieve_next_token),
                    ("retrieve_next_sibling", retrieve_next_sibling)):
        _need_tensor(name, t, _INT_DTYPES, shape=(B, N))
    return B, N, accept_index.shape[1]


def _write_results(predicts, accept_index, accept_token_num, retrieve_index, order, result, emitted):
    """SGLang's outputs from ours: ``accept_index`` holds the flat row (``retrieve_index``) of
    each accepted node, ``predicts[row]`` the token that follows that node."""
    nodes = result.accept_nodes.long()
    valid = nodes >= 0
    original = order.gather(1, nodes.clamp(min=0))
    rows = retrieve_index.long().gather(1, original)
    accept_index.copy_(torch.where(valid, rows, -1))
    accept_token_num.copy_(result.accept_len)
    # Padding entries write the root's row with the root's value again (same index, same value).
    rows = torch.where(valid, rows, rows[:, :1])
    values = torch.where(valid, emitted, emitted[:, :1])
    predicts.scatter_(0, rows.reshape(-1), values.reshape(-1).to(predicts.dtype))


def verify_greedy(predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
                  retrieve_next_sibling, target_predict, topk=-1):
    """SGLang's ``verify_tree_greedy_func`` through :func:`eagle_kernels.verify`.

    SGLang passes the target's argmax ids, not its logits. The greedy walk needs, per node ``u``,
    only which child (if any) is the first in sibling order whose token is ``target_predict[u]``;
    so the tree goes to ``verify`` with each node's own index as its token and one-hot logits over
    ``N + 1`` classes (class ``N``: no child matches), which makes ``verify``'s walk exactly
    SGLang's for any sibling order. Nodes keep SGLang's order where parents precede children, else
    come in a topological order (:func:`._layout.verify_order`), as our contract needs. On CPU
    the native op does the same with each node's place among its siblings as its token (fewer
    classes)."""
    args = (predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
            retrieve_next_sibling, target_predict)
    if _run_native("sglang_verify_greedy", args):
        return predicts, accept_index, accept_token_num
    return verify_greedy_tensors(*args)


def verify_greedy_tensors(predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
                          retrieve_next_sibling, target_predict):
    """The tensor path of :func:`verify_greedy` (any device, capturable in a CUDA graph); the
    reference of the native CPU op ``torch.ops.eagle_kernels.sglang_verify_greedy``."""
    B, N, S = _check_verify_tensors(predicts, accept_index, accept_token_num, candidates, retrieve_index,
                                    retrieve_next_token, retrieve_next_sibling)
    _need_tensor("target_predict", target_predict, _INT_DTYPES, ndim=2)
    _need(target_predict.numel() == B * N, f"target_predict: expected {B * N} entries, got shape "
          f"{tuple(target_predict.shape)}")
    device = candidates.device
    target = target_predict.reshape(B, N).long()
    parent, rank = _layout.parents_from_links(retrieve_next_token, retrieve_next_sibling)
    ar = torch.arange(N, device=device)
    # match[b, u, c]: c is a child of u whose draft token is u's target token.
    match = (parent[:, None, :] == ar[None, :, None]) & (candidates.long()[:, None, :] == target[:, :, None])
    key = torch.where(match, rank[:, None, :], N)
    best, first = key.min(-1)
    choice = torch.where(best < N, first, N)
    order, new_parents = _layout.verify_order(parent)
    logits = torch.zeros(B, N, N + 1, dtype=torch.float32, device=device)
    logits.scatter_(2, choice.gather(1, order)[:, :, None], 1.0)
    result = ops.verify(order, new_parents, logits, max_depth=S - 1)
    emitted = target.gather(1, order.gather(1, result.accept_nodes.long().clamp(min=0)))
    _write_results(predicts, accept_index, accept_token_num, retrieve_index, order, result, emitted)
    return predicts, accept_index, accept_token_num


# ------------------------------------------------------------------------------ sampling verify
def _stream_from_coins(coins: torch.Tensor, final_coins: torch.Tensor):
    """Our counter-based stream's ``(seed, offset)`` from SGLang's coins for this step: the bits
    of two of them. SGLang draws the coins fresh each step (``torch.rand``, or a hash of the
    request's seed and length when it has one), so each step gets its own stream, the same on
    every rank that holds the same coins."""
    bits = coins.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    final = final_coins.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    seed = (bits[:, 0] << 32) | final
    offset = bits[:, -1]
    return seed, offset


def tree_sampling(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                  retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                  draft_probs=None, threshold_single=1.0, threshold_acc=1.0, deterministic=True):
    """SGLang's ``tree_speculative_sampling_target_only`` through :func:`eagle_kernels.verify`:
    tokens are drawn from ``target_probs`` exactly: from the logits, temperature, top-k and top-p
    SGLang made them of when the softmax hook saw them made (:func:`_handed_logits`), else with
    temperature 1 on their logarithms (docs/ops.md §4). ``draft_probs`` is not read: SGLang passes
    zeros on this path (target-only sampling); thresholds other than 1 are outside the contract."""
    if float(threshold_single) != 1.0 or float(threshold_acc) != 1.0:
        raise OutsideContract(f"relaxed acceptance (threshold_single={threshold_single}, "
                              f"threshold_acc={threshold_acc})")
    args = (predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
            retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs)
    handed = _handed_logits(target_probs)
    if handed is not None:
        try:
            if not _run_native("sglang_tree_sampling_logits", args[:-1] + handed):
                tree_sampling_tensors(*args[:-1], None, handed)
            return
        except (OutsideContract, ValueError) as reason:  # e.g. a top_p outside (0, 1]
            _log_fallback("tree_speculative_sampling_target_only", f"from SGLang's logits: {reason}; verifying "
                          "from the probabilities instead")
    if not _run_native("sglang_tree_sampling", args):
        tree_sampling_tensors(*args)


def _handed_parameters(handed, B: int, N: int, V: int, temperature: torch.Tensor):
    """verify's per-request (temperature, top_k, top_p) from the handed logits' per-row tensors:
    row ``b * N`` of each is request ``b``'s first (``temperature`` stays where none was handed)."""
    temperatures, top_ks, top_ps = handed[1:]
    top_k = top_p = None
    if temperatures is not None:
        temperature = temperatures.reshape(B, N)[:, 0].float()
    if top_ks is not None:
        k = top_ks.reshape(B, N)[:, 0]
        top_k = torch.where((k <= 0) | (k >= V), 0, k).int()  # no filter: 0
    if top_ps is not None:
        top_p = top_ps.reshape(B, N)[:, 0].float()
    return temperature, top_k, top_p


def tree_sampling_tensors(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                          retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                          handed=None, compact=False, draft_probs=None):
    """The tensor path of :func:`tree_sampling` (any device, capturable in a CUDA graph); the
    reference of the native CPU ops ``torch.ops.eagle_kernels.sglang_tree_sampling`` (from
    ``target_probs``) and ``sglang_tree_sampling_logits`` (``handed``: the logits, temperatures,
    top-k and top-p SGLang computed the probabilities from, :func:`_handed_logits`).

    The logits get a column of probability 0 for the nodes no link reaches (token ``V``). The
    native ops leave it out when every node is reached and SGLang's node order is kept, which
    changes the float summation order inside verify; ``compact=True`` (for the tests' bit-exact
    comparison, where the caller knows that) leaves it out here too.

    ``draft_probs`` float ``[B, M, V]`` (:func:`chain_sampling`): row ``u`` the distribution node
    ``u``'s children were drawn from, for the nodes ``u < M`` (those past ``M`` have no sampled
    children: their rows are never read); every reached node but the root is then a sampled draft
    of verify's draft-aware rule."""
    B, N, S = _check_verify_tensors(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                    retrive_next_token, retrive_next_sibling)
    if handed is None:
        if not (isinstance(target_probs, torch.Tensor) and target_probs.is_floating_point()
                and target_probs.dim() == 3 and tuple(target_probs.shape[:2]) == (B, N)):
            raise OutsideContract(f"target_probs: expected a float tensor of shape ({B}, {N}, V), got "
                                  f"{getattr(target_probs, 'dtype', None)} "
                                  f"{tuple(getattr(target_probs, 'shape', ()))}")
        source = target_probs.reshape(B * N, -1)
    else:
        source = handed[0]
        if source.dim() != 2 or source.shape[0] != B * N:
            raise OutsideContract(f"logits: expected shape ({B * N}, V), got {tuple(source.shape)}")
    _need_tensor("uniform_samples", uniform_samples, (torch.float32, torch.float64), ndim=2)
    _need(uniform_samples.shape[0] == B, f"uniform_samples: expected {B} rows, got {tuple(uniform_samples.shape)}")
    _need_tensor("uniform_samples_for_final_sampling", uniform_samples_for_final_sampling,
                 (torch.float32, torch.float64), shape=(B,))
    device = source.device
    V = source.shape[1]
    parent, _ = _layout.parents_from_links(retrive_next_token, retrive_next_sibling)
    order, new_parents = _layout.verify_order(parent)
    reached = parent >= 0
    reached[:, 0] = True
    # A node no link reaches gets token V, a column of probability 0: it is never accepted.
    tokens = torch.where(reached, candidates.long(), V).gather(1, order)
    rows = (torch.arange(B, device=device)[:, None] * N + order).reshape(-1)
    seed, offset = _stream_from_coins(uniform_samples, uniform_samples_for_final_sampling)
    temperature = torch.ones(B, dtype=torch.float32, device=device)
    top_k = top_p = None
    width = V if compact else V + 1
    logits = torch.empty(B * N, width, dtype=torch.float32 if handed is None else source.dtype, device=device)
    if not compact:
        logits[:, V] = float("-inf")
    if handed is None:
        torch.log(source.index_select(0, rows).float(), out=logits[:, :V])
    elif compact:
        torch.index_select(source, 0, rows, out=logits)
    else:
        logits[:, :V] = source.index_select(0, rows)
    if handed is not None:
        temperature, top_k, top_p = _handed_parameters(handed, B, N, V, temperature)
    drafts = {}
    if draft_probs is not None:
        # One row gather in verify's node order; the extra logits column (token V, never a draft)
        # is left out of the draft rows by d2t: draft id x stands for token x.
        M = draft_probs.shape[1]
        rows_q = (torch.arange(B, device=device)[:, None] * M + order.clamp(max=M - 1)).reshape(-1)
        drafts = dict(draft_probs=draft_probs.float().reshape(B * M, V).index_select(0, rows_q).view(B, N, V),
                      draft_sampled=reached.gather(1, order) & (order > 0))
        if width != V:
            drafts["d2t"] = torch.zeros(V, dtype=torch.int64, device=device)
    result = ops.verify(tokens, new_parents, logits.view(B, N, width), max_depth=S - 1, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed, offset=offset, **drafts)
    emitted = result.out_tokens.clamp(min=0)
    _write_results(predicts, accept_index, accept_token_num, retrive_index, order, result, emitted)


def chain_sampling(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                   retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                   draft_probs, threshold_single, threshold_acc, deterministic, *, block_verification=False):
    """SGLang's ``chain_speculative_sampling_triton`` (its rejection-sampling option: chains whose
    drafts were drawn from the drafter's distributions) through verify's draft-aware rule: draft
    ``s`` (candidate ``s``, drawn from ``draft_probs[:, s - 1]``) is accepted with probability
    ``min(1, p(x) / q(x))``, a rejection draws from ``max(p - q, 0)`` renormalised, and after the
    last draft the token comes from the target's last row: SGLang's law. The chain is the
    candidates in order (SGLang's kernel reads no links). With ``block_verification`` the chain is
    verified as one block by :func:`eagle_kernels.block_verify` (docs/ops.md §21: SGLang's option
    of the same name, the rule of Sun et al.). Relaxed thresholds are outside the contract."""
    if float(threshold_single) != 1.0 or float(threshold_acc) != 1.0:
        raise OutsideContract(f"relaxed acceptance (threshold_single={threshold_single}, "
                              f"threshold_acc={threshold_acc})")
    _need_tensor("candidates", candidates, _INT_DTYPES, ndim=2)
    B, N = candidates.shape
    _need(isinstance(target_probs, torch.Tensor) and target_probs.dim() == 3
          and tuple(target_probs.shape[:2]) == (B, N),
          f"target_probs: expected shape ({B}, {N}, V), got {tuple(getattr(target_probs, 'shape', ()))}")
    V = target_probs.shape[2]
    _need(isinstance(draft_probs, torch.Tensor) and draft_probs.is_floating_point() and draft_probs.dim() == 3
          and draft_probs.shape[0] == B and draft_probs.shape[1] in (N - 1, N) and draft_probs.shape[2] == V,
          f"draft_probs: expected a float tensor of shape ({B}, {N - 1}, {V}), got "
          f"{tuple(getattr(draft_probs, 'shape', ()))}")
    device = candidates.device
    if block_verification:
        _chain_block(predicts, accept_index, accept_token_num, candidates, retrive_index, uniform_samples,
                     uniform_samples_for_final_sampling, target_probs, draft_probs)
        return
    steps = torch.arange(N, device=device)
    next_token = torch.where(steps < N - 1, steps + 1, -1).expand(B, N).to(retrive_next_token.dtype)
    no_sibling = torch.full((B, N), -1, dtype=retrive_next_sibling.dtype, device=device)
    # Node u's row is the distribution of its child u + 1 (u < N - 1); the last node has no child.
    args = (predicts, accept_index, accept_token_num, candidates, retrive_index, next_token, no_sibling,
            uniform_samples, uniform_samples_for_final_sampling)
    # Every node of the chain is reached: no never-selected logits column (compact).
    rows = draft_probs[:, : N - 1]
    handed = _handed_logits(target_probs)
    if handed is not None:
        try:
            tree_sampling_tensors(*args, None, handed, compact=True, draft_probs=rows)
            return
        except (OutsideContract, ValueError) as reason:
            _log_fallback("chain_speculative_sampling_triton", f"from SGLang's logits: {reason}; verifying from "
                          "the probabilities instead")
    tree_sampling_tensors(*args, target_probs, compact=True, draft_probs=rows)


def _chain_block(predicts, accept_index, accept_token_num, candidates, retrive_index, uniform_samples,
                 uniform_samples_for_final_sampling, target_probs, draft_probs):
    """:func:`chain_sampling`'s block verification: the chain (node 0 the root, node ``s`` draft
    ``s``) through :func:`eagle_kernels.block_verify`, from SGLang's logits when its softmax made
    the probabilities, else from their logarithms at temperature 1."""
    B, N, V = target_probs.shape
    device = candidates.device
    _need_tensor("uniform_samples", uniform_samples, (torch.float32, torch.float64), ndim=2)
    _need_tensor("uniform_samples_for_final_sampling", uniform_samples_for_final_sampling,
                 (torch.float32, torch.float64), shape=(B,))
    temperature = torch.ones(B, dtype=torch.float32, device=device)
    top_k = top_p = None
    handed = _handed_logits(target_probs)
    if handed is not None and handed[0].dim() == 2 and handed[0].shape[0] == B * N:
        logits = handed[0].view(B, N, V)
        temperature, top_k, top_p = _handed_parameters(handed, B, N, V, temperature)
    else:
        logits = torch.log(target_probs.float())
    rows = torch.zeros(B, N, V, dtype=torch.float32, device=device)
    rows[:, : N - 1] = draft_probs[:, : N - 1]
    seed, offset = _stream_from_coins(uniform_samples, uniform_samples_for_final_sampling)
    result = ops.block_verify(candidates.long(), logits, rows, temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=seed, offset=offset)
    order = torch.arange(N, device=device).expand(B, N)
    _write_results(predicts, accept_index, accept_token_num, retrive_index, order, result,
                   result.out_tokens.clamp(min=0))


# ------------------------------------------------------------------------------ logits handoff
# SGLang's sampling verify (eagle_utils.eagle_sample) computes target_probs = softmax(logits /
# temperature), then on CPU our top_k_renorm_prob / top_p_renorm_prob, and hands the
# probabilities to the tree sampling verify, whose own input is logits: taking their logarithm is
# a pass over [B * N, V] that verify (which reads only the rows on the walked path) does not need.
# The softmax hook records what the probabilities were made of; the sampling verify takes the
# logits and the per-row parameters instead when it gets exactly those probabilities (same
# storage, shape and version counter: not modified in place since), which is the same law
# (docs/ops.md §4: temperature, top-k, softmax, top-p, renormalise). Anything else (other
# filters, another order, a modified tensor) goes through the probabilities as before.
class _Handoff:
    __slots__ = ("probs", "version", "logits", "temperatures", "top_ks", "top_ps")

    def __init__(self, probs, logits, temperatures, top_ks=None, top_ps=None):
        self.probs = weakref.ref(probs)
        # An inference tensor (SGLang under SGLANG_ENABLE_TORCH_INFERENCE_MODE) keeps no version counter, so a
        # change in place could not be seen: no handoff for it (None), the probabilities go through as they are.
        self.version = None if probs.is_inference() else probs._version
        self.logits = weakref.ref(logits)
        self.temperatures, self.top_ks, self.top_ps = temperatures, top_ks, top_ps

    def made(self, probs) -> bool:
        """Whether ``probs`` (or a view of the same size) is the recorded tensor, unmodified."""
        recorded = self.probs()
        return (recorded is not None and self.version is not None and isinstance(probs, torch.Tensor)
                and not probs.is_inference() and probs.data_ptr() == recorded.data_ptr()
                and probs.numel() == recorded.numel() and probs._version == self.version)


_handoff: _Handoff | None = None


def softmax_hook(original, logits, temperatures=None):
    """AROUND ``sglang.kernels.ops.sampling.softmax``: SGLang's result, recorded with its inputs."""
    global _handoff
    probs = original(logits, temperatures)
    ok = (isinstance(logits, torch.Tensor) and logits.dim() == 2 and isinstance(probs, torch.Tensor)
          and probs.shape == logits.shape
          and (temperatures is None or (isinstance(temperatures, torch.Tensor)
                                        and temperatures.numel() == logits.shape[0])))
    _handoff = _Handoff(probs, logits, temperatures) if ok else None
    return probs


def _handed_logits(target_probs):
    """``(logits, temperatures, top_ks, top_ps)`` SGLang computed ``target_probs`` from, or
    ``None`` (see above)."""
    h = _handoff
    if h is None or not h.made(target_probs):
        return None
    logits = h.logits()
    if logits is None:
        return None
    return logits, h.temperatures, h.top_ks, h.top_ps


def _record_renorm(probs, out, top_ks=None, top_ps=None) -> None:
    """Carry the record through our renormalisations: top-k then top-p, as verify applies them."""
    global _handoff
    h = _handoff
    if h is None or not h.made(probs) or h.top_ps is not None or (top_ks is not None and h.top_ks is not None):
        return
    logits = h.logits()
    if logits is None or not isinstance(out, torch.Tensor):
        return
    _handoff = _Handoff(out, logits, h.temperatures, h.top_ks if top_ks is None else top_ks,
                        h.top_ps if top_ps is None else top_ps)


def top_k_renorm_prob(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``k`` most probable tokens (ties kept together: ``x`` stays when fewer
    than ``k`` are strictly more probable), renormalise. ``k <= 0`` or ``k >= V``: no filter."""
    V = probs.shape[-1]
    k = top_ks.reshape(-1).long()
    descending = torch.sort(probs, dim=-1, descending=True).values
    kth = descending.gather(-1, (k.clamp(1, V) - 1)[:, None])
    keep = (probs >= kth) | ((k <= 0) | (k >= V))[:, None]
    kept = torch.where(keep, probs, 0)
    out = kept / kept.sum(-1, keepdim=True)
    _record_renorm(probs, out, top_ks=top_ks)
    return out


def top_p_renorm_prob(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep ``x`` when the probability of the tokens strictly more probable than ``x`` sums to
    less than ``top_p`` (docs/ops.md §4), renormalise."""
    ascending = torch.sort(probs.double(), dim=-1).values
    suffix = torch.cat([ascending.flip(-1).cumsum(-1).flip(-1), ascending.new_zeros(ascending.shape[0], 1)], dim=-1)
    above = suffix.gather(-1, torch.searchsorted(ascending, probs.double(), right=True))
    keep = above < top_ps.reshape(-1, 1).double()
    kept = torch.where(keep, probs, 0)
    out = kept / kept.sum(-1, keepdim=True)
    _record_renorm(probs, out, top_ps=top_ps)
    return out


# ------------------------------------------------------------------------------ KV commit
def commit_kv(batch, accept_index, num_correct_drafts, token_to_kv_pool_allocator):
    """SGLang's ``spec_utils.move_accept_tokens_to_target_kvcache`` through
    :func:`eagle_kernels.compact_kv`: request ``b``'s verify window is slots
    ``out_cache_loc[b * N : (b + 1) * N]``, a paged view of each layer's ``[slots, H, D]`` buffer
    with page size 1 (``block_table = out_cache_loc.view(B, N)``, ``cache_seqlens = 0``); the
    accepted nodes move to the front of the window, as SGLang's move does. Plain
    ``MHATokenToKVPool`` only (other pools: SGLang's own move)."""
    pool = token_to_kv_pool_allocator.get_kvcache()
    name = type(pool).__name__
    _need(name == "MHATokenToKVPool", f"KV pool {name}: only MHATokenToKVPool is taken")
    _need(not getattr(pool, "use_hnd", False), "KV pool with the HND layout")
    _need(getattr(pool, "k_scale_buffer", None) is None and getattr(pool, "native_k_scale_buffer", None) is None,
          "KV pool with scale buffers")
    _need_tensor("accept_index", accept_index, _INT_DTYPES, ndim=2)
    B, S = accept_index.shape
    _need_tensor("num_correct_drafts", num_correct_drafts, _INT_DTYPES, shape=(B,))
    out = batch.out_cache_loc
    _need_tensor("out_cache_loc", out, _INT_DTYPES, ndim=1)
    _need(B > 0 and out.numel() % B == 0 and out.numel() // B >= S,
          f"out_cache_loc: expected {B} windows of at least {S} slots, got {out.numel()} slots")
    N = out.numel() // B
    buffers = list(zip(pool.k_buffer, pool.v_buffer))
    for k, v in buffers:
        _need(k.dim() == 3 and v.dim() == 3 and k.dtype == v.dtype, "KV pool buffers: expected [slots, H, D] pairs")
    device = accept_index.device
    table = out.view(B, N).int()
    base = torch.arange(B, device=device)[:, None] * N
    nodes = torch.where(accept_index >= 0, accept_index.long() - base, -1).int()
    accept_len = num_correct_drafts.int()
    seqlens = torch.zeros(B, dtype=torch.int32, device=device)
    for k, v in buffers:
        ops.compact_kv(k.unsqueeze(1), v.unsqueeze(1), seqlens, nodes, accept_len, block_table=table)


# ------------------------------------------------------------------------------ hooks
def _around(name: str, ours, signature_of):
    """An AROUND hook running ``ours`` with the call's arguments, or SGLang's function when
    ``ours`` raises :class:`OutsideContract` (logged once per reason)."""
    signature = inspect.signature(signature_of)

    def hook(original, *args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        try:
            result = ours(*bound.args, **bound.kwargs)
        except OutsideContract as reason:
            _log_fallback(name, str(reason))
            if original is None:
                raise NotImplementedError(f"{name}: {reason}, and SGLang has no kernel for it on this "
                                          "platform") from None
            return original(*args, **kwargs)
        return result

    hook.__name__ = f"eagle_kernels_{name}"
    return hook


build_tree_hook = _around("build_tree_kernel_efficient_func", build_tree, build_tree)
verify_greedy_hook = _around("verify_tree_greedy_func", verify_greedy, verify_greedy)
tree_sampling_hook = _around("tree_speculative_sampling_target_only", tree_sampling, tree_sampling)
chain_sampling_hook = _around("chain_speculative_sampling_triton", chain_sampling, chain_sampling)
commit_kv_hook = _around("move_accept_tokens_to_target_kvcache", commit_kv, commit_kv)


def uses_greedy_hook(original, *args, **kwargs):
    """``_verify_uses_greedy``: SGLang's answer, except that sampling batches on CPU, XPU and HIP
    take the sampling path (our exact verify: tree sampling, or with rejection sampling the chain
    sampler, :func:`chain_sampling`, with or without block verification) instead of greedy, when
    the acceptance thresholds are 1."""
    greedy = original(*args, **kwargs)
    if not greedy or kwargs.get("is_all_greedy", args[0] if args else True):
        return greedy
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    single = float(getattr(spec, "speculative_accept_threshold_single", 1.0))
    acc = float(getattr(spec, "speculative_accept_threshold_acc", 1.0))
    if single != 1.0 or acc != 1.0:
        _log_fallback("_verify_uses_greedy", f"relaxed acceptance thresholds ({single}, {acc}) keep SGLang's "
                      "greedy verify on this platform")
        return greedy
    return False


def _set_missing(module, name: str, value) -> bool:
    """Set ``module.name`` to ``value`` where SGLang has ``None`` there (no kernel)."""
    if getattr(module, name, None) is None:
        setattr(module, name, value)
        return True
    return False


def _version_ok() -> bool:
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        logger.error("eagle_kernels: the SGLang plugin is enabled but sglang is not installed")
        return False
    if version in TESTED_VERSIONS:
        return True
    if version.split(".")[:2] == TESTED_VERSIONS[0].split(".")[:2]:
        logger.warning("eagle_kernels: sglang %s is untested (tested: %s); the plugin is active", version,
                       ", ".join(TESTED_VERSIONS))
        return True
    logger.error("eagle_kernels: sglang %s is not supported (tested: %s); SGLang keeps its own kernels",
                 version, ", ".join(TESTED_VERSIONS))
    return False


def register() -> bool:
    """The ``sglang.srt.plugins`` entry point. Registers the hooks when the plugin is enabled;
    returns whether it did."""
    if not enabled("SGLANG_PLUGINS"):
        logger.info("eagle_kernels: SGLang plugin installed but not enabled (SGLANG_PLUGINS=eagle_kernels)")
        return False
    if not _version_ok():
        return False
    import importlib

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{SPEC_TREE}.build_tree_kernel_efficient_func", build_tree_hook, HookType.AROUND)
    HookRegistry.register(f"{SPEC_TREE}.verify_tree_greedy_func", verify_greedy_hook, HookType.AROUND)
    HookRegistry.register(f"{EAGLE_UTILS}._verify_uses_greedy", uses_greedy_hook, HookType.AROUND)
    HookRegistry.register(f"{SPEC_UTILS}.move_accept_tokens_to_target_kvcache", commit_kv_hook, HookType.AROUND)
    HookRegistry.register(f"{SAMPLING}.softmax", softmax_hook, HookType.AROUND)

    verify_sampling = importlib.import_module(VERIFY_SAMPLING)
    eagle_utils = importlib.import_module(EAGLE_UTILS)
    if verify_sampling.tree_speculative_sampling_target_only is None:
        fn = functools.partial(tree_sampling_hook, None)
        functools.update_wrapper(fn, tree_sampling)
        verify_sampling.tree_speculative_sampling_target_only = fn
        eagle_utils.tree_speculative_sampling_target_only = fn
    else:
        HookRegistry.register(f"{VERIFY_SAMPLING}.tree_speculative_sampling_target_only", tree_sampling_hook,
                              HookType.AROUND)
    if verify_sampling.chain_speculative_sampling_triton is not None:
        HookRegistry.register(f"{VERIFY_SAMPLING}.chain_speculative_sampling_triton", chain_sampling_hook,
                              HookType.AROUND)
    _set_missing(eagle_utils, "top_k_renorm_prob", top_k_renorm_prob)
    _set_missing(eagle_utils, "top_p_renorm_prob", top_p_renorm_prob)
    logger.info("eagle_kernels: SGLang EAGLE tree build and verify hooks registered")
    return True
