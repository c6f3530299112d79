"""vLLM plugin: our ``verify`` as the chain rejection sampler of vLLM's V1 runner (docs/serving.md).

Entry point ``eagle_kernels = eagle_kernels.integrations.vllm:register`` in the group
``vllm.general_plugins`` (vLLM runs it in every process); enabled by
``VLLM_PLUGINS=eagle_kernels`` (or ``EAGLE_KERNELS_ENGINE_PLUGINS=1``).

vLLM's EAGLE is chain-only. ``vllm.v1.sample.rejection_sampler.rejection_sample`` verifies the
ragged draft chains of a batch against the target's (already temperature-scaled and top-k/top-p
filtered) logits at the draft positions, with the bonus token sampled beforehand from the last
position. The plugin replaces it in the lossless cases (EAGLE's one-hot drafts, and the draft
probabilities of a drafter that samples; no synthetic acceptance, no FLy relaxation) with
:func:`eagle_kernels.verify` on chains (with draft probabilities, its draft-aware rule on the
gathered chains below): full chains (every request with ``max_spec_len`` drafts)
read the logits rows in place (:func:`full_chains`); on CPU the native op
``torch.ops.eagle_kernels.vllm_chains`` does the same per request for ragged batches; elsewhere a
ragged batch's chains are padded to ``max_spec_len`` drafts whose outcome is discarded (the walk is
cut at the chain's end, where vLLM's bonus token is emitted). Model Runner V2's
``rejection_sample`` (``vllm.v1.worker.gpu.spec_decode``) gets the same treatment, its draft
logits included (:func:`chain_verify_v2`, tensor code). Every other call runs vLLM's own function, with one log
line per reason.
"""

from __future__ import annotations

import functools
import inspect
from importlib import metadata

import torch

from .. import ops
from . import enabled, logger

V1_MODULE = "vllm.v1.sample.rejection_sampler"
V2_UTILS = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"
V2_SAMPLER = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
TESTED_VERSIONS = ("0.33.0",)


class OutsideContract(Exception):
    """A call our adapter does not take; vLLM's own function runs it."""


@functools.cache
def _log_fallback(reason: str) -> None:
    logger.warning("eagle_kernels: vLLM rejection_sample falls back to vLLM's own sampler: %s", reason)


def _need(cond: bool, reason: str) -> None:
    if not cond:
        raise OutsideContract(reason)


def _stream(uniform: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor):
    """``(seed, offset)`` of our counter-based stream from vLLM's uniforms for this step (its own
    ``generate_uniform_probs``, which honours per-request seeded generators): the float64 bits of
    each request's first and last draws."""
    bits = uniform.double().contiguous().view(torch.int64)
    last = bits.numel() - 1
    return bits[starts.clamp(0, last)], bits[(ends - 1).clamp(0, last)]


def chain_verify(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
                 bonus_token_ids, sampling_metadata, synthetic_mode=False, synthetic_conditional_rates=None,
                 use_fp64_gumbel=False, fly_window_size=None, fly_entropy_threshold=None, fly_entropy_top_k=3):
    """vLLM's ``rejection_sample`` (V1) through :func:`eagle_kernels.verify`; returns the output
    token ids int32 ``[batch, max_spec_len + 1]`` padded with -1, as vLLM's does.

    With ``draft_probs`` (a drafter that samples: row ``i`` the distribution draft ``i`` was drawn
    from) a sampling request's drafts are verified by verify's draft-aware rule: draft ``x``
    accepted with probability ``min(1, p(x) / q(x))``, a rejection drawing from the residual
    ``max(p - q, 0)`` renormalised (vLLM's "recovered" token), as vLLM's kernels do; greedy
    requests ignore them, as vLLM's do."""
    _need(not synthetic_mode, "synthetic acceptance mode")
    _need(fly_window_size is None, "FLy relaxed acceptance")
    _need(isinstance(target_logits, torch.Tensor) and target_logits.dim() == 2 and target_logits.is_floating_point(),
          "target_logits: expected a float [num_tokens, vocab] tensor")
    # The messages are formatted only on failure: this runs on every step.
    if draft_token_ids.dim() != 1 or draft_token_ids.shape[0] != target_logits.shape[0]:
        raise OutsideContract(f"draft_token_ids: expected shape ({target_logits.shape[0]},), got "
                              f"{tuple(draft_token_ids.shape)}")
    B = len(num_draft_tokens)
    if cu_num_draft_tokens.shape != (B,):
        raise OutsideContract(f"cu_num_draft_tokens: expected shape ({B},), got {tuple(cu_num_draft_tokens.shape)}")
    if bonus_token_ids.numel() != B:
        raise OutsideContract(f"bonus_token_ids: expected {B} entries, got {bonus_token_ids.numel()}")
    L = int(max_spec_len)
    T, V = target_logits.shape
    if sampling_metadata.all_greedy:
        draft_probs = None  # greedy requests accept the argmax whatever drew the drafts
    if draft_probs is not None and (not isinstance(draft_probs, torch.Tensor) or draft_probs.shape != (T, V)
                                    or not draft_probs.is_floating_point()):
        got = tuple(draft_probs.shape) if isinstance(draft_probs, torch.Tensor) else type(draft_probs).__name__
        raise OutsideContract(f"draft_probs: expected a float [{T}, {V}] tensor, got {got}")
    native = _native_chains() if target_logits.device.type == "cpu" and draft_probs is None else None
    if native is not None or (draft_probs is None and L >= 1 and T == B * L and target_logits.stride(1) == 1
                              and all(n == L for n in num_draft_tokens)):
        uniform = None
        if not sampling_metadata.all_greedy:
            from vllm.v1.sample.rejection_sampler import generate_uniform_probs

            uniform = generate_uniform_probs(T, num_draft_tokens, sampling_metadata.generators, target_logits.device)
        temperature = None if uniform is None else sampling_metadata.temperature
        if native is not None:
            try:
                return native(draft_token_ids, cu_num_draft_tokens, target_logits, bonus_token_ids, L, temperature,
                              uniform)
            except ValueError as error:
                raise OutsideContract(str(error)) from None
        return full_chains(draft_token_ids, target_logits, bonus_token_ids, temperature, uniform)
    device = target_logits.device
    bonus = bonus_token_ids.reshape(B).long()
    ends = cu_num_draft_tokens.long()
    counts = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    starts = ends - counts
    steps = torch.arange(L, device=device)
    real = steps < counts[:, None]  # [B, L]: draft j of request b exists

    # Nodes: 0 the root, j + 1 draft j; request b's chain is padded to L drafts with nodes after
    # its last draft. Node j's row is target_logits[starts + j] for j < counts[b] and any valid row
    # beyond (one gather, no other pass over the vocabulary): what the walk does past node
    # counts[b] is discarded below, where the bonus token takes its place. With draft_probs, node
    # j's draft row is draft_probs[starts + j], the distribution its child (draft j) was drawn
    # from; the padded nodes are deterministic drafts (their parents' rows are never read).
    node_rows = (starts[:, None] + torch.arange(L + 1, device=device)).clamp(max=max(T - 1, 0))
    if T > 0:  # draft j sits at node j's row (past a request's chain: another valid row, masked below)
        drafts = draft_token_ids.long()[node_rows[:, :L]]
    else:
        drafts = torch.zeros(B, L, dtype=torch.long, device=device)
    tokens = torch.cat([bonus[:, None], torch.where(real, drafts, 0)], dim=1)
    parents = torch.cat([torch.full((B, 1), -1, device=device, dtype=torch.long), steps[None, :].expand(B, L)],
                        dim=1).int()
    nodes = torch.arange(L + 1, device=device)
    if T > 0:
        logits = target_logits.index_select(0, node_rows.reshape(-1)).view(B, L + 1, V)
    else:
        logits = torch.zeros(B, L + 1, V, dtype=target_logits.dtype, device=device)

    if sampling_metadata.all_greedy:
        temperature = seed = offset = None
    else:
        from vllm.v1.sample.rejection_sampler import generate_uniform_probs

        uniform = generate_uniform_probs(T, num_draft_tokens, sampling_metadata.generators, device)
        if T > 0:
            seed, offset = _stream(uniform, starts, ends)
        else:
            seed = torch.zeros(B, dtype=torch.int64, device=device)
            offset = seed
        # The logits are already divided by the temperature (1 for greedy rows).
        temperature = (sampling_metadata.temperature.reshape(B) != 0).float()
    drafts_given = {}
    if draft_probs is not None:
        # Node j's draft row is read only where its child is a real draft (j < counts[b]): the rows
        # gathered as the logits are (one pass), whatever they hold elsewhere.
        if T > 0:
            node_probs = draft_probs.float().index_select(0, node_rows.reshape(-1)).view(B, L + 1, V)
        else:
            node_probs = torch.zeros(B, L + 1, V, device=device)
        sampled = torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=device), real], dim=1)
        drafts_given = dict(draft_probs=node_probs, draft_sampled=sampled)
    result = ops.verify(tokens, parents, logits, max_depth=L, temperature=temperature, seed=seed, offset=offset,
                        **drafts_given)
    # Accepted drafts up to the chain's end, then the token drawn at the first rejection
    # (vLLM's "recovered" token) or, after the last draft, the bonus token.
    accepted = torch.minimum(result.accept_len.long(), counts)
    at_end = (accepted == counts)[:, None]
    out = torch.where(nodes < accepted[:, None], result.out_tokens,
                      torch.where(nodes == accepted[:, None], torch.where(at_end, bonus[:, None], result.out_tokens),
                                  -1))
    return out.int()


@functools.cache
def _native_chains():
    """``torch.ops.eagle_kernels.vllm_chains`` (csrc/cpu/engine_layout.cpp: full chains in one
    verify call, ragged ones one call per request, rows read in place) when the C++ extension has
    it, else ``None``."""
    from .. import _dispatch

    if not _dispatch.HAS_CPP or not torch._C._dispatch_has_kernel_for_dispatch_key("eagle_kernels::vllm_chains",
                                                                                   "CPU"):
        return None
    return torch.ops.eagle_kernels.vllm_chains


@functools.cache
def _chain_parents(B: int, L: int, device: torch.device) -> torch.Tensor:
    """Chain parents ``[-1, 0, ..., L - 2]`` int32 ``[B, L]`` (cached: the same every step)."""
    return (torch.arange(L, dtype=torch.int32, device=device) - 1).expand(B, L).contiguous()


def full_chains(draft_token_ids, target_logits, bonus_token_ids, temperature=None, uniform=None):
    """:func:`chain_verify` when every request has ``L = T / B`` drafts (``num_draft_tokens`` is
    a host list: no sync); the tensor path (any device) and the reference of the native CPU op
    ``torch.ops.eagle_kernels.vllm_chains`` (which applies it per request to ragged batches).
    ``temperature`` and ``uniform`` (vLLM's uniforms for this step) for sampling batches, both
    ``None`` for all-greedy ones.

    Request ``b``'s rows ``b * L .. b * L + L - 1`` of ``target_logits`` are read in place as
    verify's ``[B, L, V]`` logits, no copy. The chain is the root and the first ``L - 1`` drafts
    (node ``j``'s row predicts draft ``j``); the last draft is decided by the token verify draws
    at node ``L - 1`` when it gets there: the draft is accepted iff that token equals it (greedy:
    the argmax; sampling: a draw from ``p``, which accepts ``x`` with probability ``p(x)`` and
    otherwise yields a token distributed as ``p`` without ``x``, the one-hot residual: the law of
    rejection sampling with a one-hot draft); then vLLM's bonus token follows."""
    B = bonus_token_ids.numel()
    T, V = target_logits.shape
    L = T // B
    device = target_logits.device
    drafts = draft_token_ids.view(B, L).long()
    bonus = bonus_token_ids.reshape(B, 1).long()
    tokens = torch.cat([bonus, drafts[:, : L - 1]], dim=1)
    if uniform is None:
        seed = offset = None
    else:
        bits = uniform.double().view(torch.int64).view(B, L)
        seed, offset = bits[:, 0], bits[:, L - 1]
        # The logits are already divided by the temperature (1 for greedy rows).
        temperature = (temperature.reshape(B) != 0).float()
    result = ops.verify(tokens, _chain_parents(B, L, device), target_logits.view(B, L, V), max_depth=L - 1,
                        temperature=temperature, seed=seed, offset=offset)
    accepted = result.accept_len.long()[:, None]
    last = (accepted == L - 1) & (result.out_tokens[:, L - 1 :] == drafts[:, L - 1 :])
    emitted = torch.cat([result.out_tokens, bonus], dim=1)
    nodes = torch.arange(L + 1, device=device)
    return torch.where(nodes <= accepted + last.long(), emitted, -1).int()


def chain_verify_v2(target_logits, draft_logits, draft_sampled, cu_num_logits, pos, idx_mapping, expanded_idx_mapping,
                    expanded_local_pos, temperature, seed, num_speculative_steps, synthetic_conditional_rates=None,
                    use_fp64=False, use_block_verification=False, contexts=None, watermarking=None,
                    watermarking_skip_mask=None, watermark_key=None, fly_window_size=0, fly_entropy_threshold=0.3,
                    fly_entropy_top_k=3):
    """Model Runner V2's ``rejection_sample`` through :func:`eagle_kernels.verify`; returns
    ``(sampled int64 [num_reqs, steps + 1], num_sampled int32 [num_reqs])``.

    Request ``r`` owns logits rows ``cu_num_logits[r] .. cu_num_logits[r + 1] - 1`` (its drafts'
    positions and the bonus position, already temperature-scaled and filtered); the draft verified
    at row ``i`` is ``draft_sampled[i + 1]`` (-1: none, which ends the chain). The chain is padded
    to ``steps`` drafts with never-accepted siblings: token ``V``, a column of probability 0.

    With ``draft_logits`` ``[max_num_reqs, steps, V]`` (a drafter that samples; stored before the
    temperature, as vLLM keeps them) a sampling request's draft ``j`` is verified by verify's
    draft-aware rule against ``softmax(draft_logits[state, j] / temperature)``, vLLM's rule; greedy
    requests ignore them. A draft vocabulary other than the target's is outside the contract.

    With ``use_block_verification`` (vLLM's ``rejection_sample_method="block"``) each chain is
    verified as one block by :func:`eagle_kernels.block_verify` (docs/ops.md §21, the rule vLLM
    implements), its drafts drawn from those rows or, without ``draft_logits``, deterministic."""
    _need(synthetic_conditional_rates is None, "synthetic acceptance mode")
    _need(contexts is None and watermarking is None, "watermarking")
    _need(not fly_window_size, "FLy relaxed acceptance")
    _need(isinstance(target_logits, torch.Tensor) and target_logits.dim() == 2 and target_logits.is_floating_point(),
          "target_logits: expected a float [num_logits, vocab] tensor")
    R = cu_num_logits.shape[0] - 1
    S = int(num_speculative_steps)
    T, V = target_logits.shape
    device = target_logits.device
    if draft_logits is not None and not (isinstance(draft_logits, torch.Tensor) and draft_logits.dim() == 3
                                         and draft_logits.is_floating_point() and draft_logits.shape[1] >= S
                                         and draft_logits.shape[2] == V):
        got = tuple(draft_logits.shape) if isinstance(draft_logits, torch.Tensor) else type(draft_logits).__name__
        raise OutsideContract(f"draft_logits: expected a float [max_num_reqs, {S}, {V}] tensor, got {got}")
    start = cu_num_logits[:-1].long()
    end = cu_num_logits[1:].long()
    nodes = torch.arange(S + 1, device=device)
    rows = (start[:, None] + nodes).clamp(max=max(T - 1, 0))  # node j's row (clamped past the chain)
    num_drafts = end - start - 1
    draft_at = (start[:, None] + nodes[:-1] + 1).clamp(max=max(T - 1, 0))
    drafts = draft_sampled.long()[draft_at]
    valid = (nodes[None, :-1] < num_drafts[:, None]) & (drafts >= 0)
    valid = torch.cumprod(valid.int(), dim=1).bool()  # the chain ends at the first missing draft
    state = idx_mapping.long()
    temp = (temperature[state] != 0).float()
    q = None
    if draft_logits is not None:
        # Node j's draft row: the distribution draft j was drawn from (vLLM scales the stored logits by
        # the request's temperature); greedy requests never read it.
        # verify's rows carry the never-accepted token V's column (0 here); block_verify reads no padding.
        scale = torch.where(temperature[state] > 0, temperature[state], 1.0).float()
        q = torch.zeros(R, S + 1, V if use_block_verification else V + 1, dtype=torch.float32, device=device)
        q[:, :S, :V] = torch.softmax(draft_logits[state, :S].float() / scale[:, None, None], dim=-1)
    seeds, offsets = seed[state].long(), pos.long()[start.clamp(max=max(T - 1, 0))]
    if use_block_verification:
        tokens = torch.cat([torch.zeros(R, 1, dtype=torch.long, device=device), torch.where(valid, drafts, 0)], dim=1)
        logits = target_logits.index_select(0, rows.reshape(-1)).view(R, S + 1, V)
        result = ops.block_verify(tokens, logits, q, num_drafts=valid.sum(1).int(), temperature=temp, seed=seeds,
                                  offset=offsets)
        return result.out_tokens, (result.accept_len + 1).int()
    tokens = torch.cat([torch.zeros(R, 1, dtype=torch.long, device=device), torch.where(valid, drafts, V)], dim=1)
    parents = torch.cat([torch.full((R, 1), -1, dtype=torch.long, device=device), nodes[None, :-1].expand(R, S)],
                        dim=1).int()
    logits = torch.empty(R * (S + 1), V + 1, dtype=torch.float32, device=device)
    logits[:, V] = float("-inf")
    logits[:, :V] = target_logits.index_select(0, rows.reshape(-1))
    drafts_given = {}
    if q is not None:
        sampled = torch.cat([torch.zeros(R, 1, dtype=torch.bool, device=device), valid], dim=1)
        drafts_given = dict(draft_probs=q, draft_sampled=sampled)
    result = ops.verify(tokens, parents, logits.view(R, S + 1, V + 1), max_depth=S, temperature=temp,
                        seed=seeds, offset=offsets, **drafts_given)
    return result.out_tokens, (result.accept_len + 1).int()


_SIGNATURE = inspect.signature(chain_verify)
_SIGNATURE_V2 = inspect.signature(chain_verify_v2)


def rejection_sample_hook(original, *args, **kwargs):
    """Our :func:`chain_verify`, or vLLM's ``original`` for calls outside the contract."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    try:
        return chain_verify(*bound.args, **bound.kwargs)
    except OutsideContract as reason:
        _log_fallback(str(reason))
        return original(*args, **kwargs)


def rejection_sample_v2_hook(original, *args, **kwargs):
    """Our :func:`chain_verify_v2`, or vLLM's ``original`` for calls outside the contract."""
    bound = _SIGNATURE_V2.bind(*args, **kwargs)
    try:
        return chain_verify_v2(*bound.args, **bound.kwargs)
    except OutsideContract as reason:
        _log_fallback(str(reason))
        return original(*args, **kwargs)


def _patch(module, name, hook):
    current = getattr(module, name)
    if getattr(current, "__eagle_kernels__", False):
        return current
    original = current

    @functools.wraps(original)
    def patched(*args, **kwargs):
        return hook(original, *args, **kwargs)

    patched.__eagle_kernels__ = True
    setattr(module, name, patched)
    return patched


def _version_ok() -> bool:
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        logger.error("eagle_kernels: the vLLM plugin is enabled but vllm is not installed")
        return False
    if version in TESTED_VERSIONS:
        return True
    if version.split(".")[:2] == TESTED_VERSIONS[0].split(".")[:2]:
        logger.warning("eagle_kernels: vllm %s is untested (tested: %s); the plugin is active", version,
                       ", ".join(TESTED_VERSIONS))
        return True
    logger.error("eagle_kernels: vllm %s is not supported (tested: %s); vLLM keeps its own rejection sampler",
                 version, ", ".join(TESTED_VERSIONS))
    return False


def register() -> bool:
    """The ``vllm.general_plugins`` entry point (idempotent). Returns whether the sampler was
    replaced."""
    if not enabled("VLLM_PLUGINS"):
        logger.info("eagle_kernels: vLLM plugin installed but not enabled (VLLM_PLUGINS=eagle_kernels)")
        return False
    if not _version_ok():
        return False
    import importlib

    _patch(importlib.import_module(V1_MODULE), "rejection_sample", rejection_sample_hook)
    # Model Runner V2: the function and the copy its sampler module imported.
    try:
        utils = importlib.import_module(V2_UTILS)
        sampler = importlib.import_module(V2_SAMPLER)
    except ImportError as error:
        logger.warning("eagle_kernels: Model Runner V2 keeps vLLM's rejection sampler (%s)", error)
    else:
        patched = _patch(utils, "rejection_sample", rejection_sample_v2_hook)
        if getattr(sampler, "rejection_sample", None) is patched.__wrapped__:
            sampler.rejection_sample = patched
    logger.info("eagle_kernels: vLLM rejection samplers (V1, Model Runner V2) replaced by eagle_kernels.verify "
                "on chains")
    return True
