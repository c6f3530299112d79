"""Speculative decoding loop: EAGLE-2 draft trees, prompt-lookup chains, batches, CUDA graphs.

Each step runs one core, the same on every device (:meth:`SpeculativeDecoder._speculative_step`):
expand the head's draft tree (:func:`eagle_kernels.expansion.expand_tree`) → graft the lookup
chain below its root (:mod:`eagle_kernels.lookup`) → one target pass over the tree → verify →
compact_kv → commit the accepted path to the head → emit. Every host read and every shape that
depends on computed values is decided by the decoder's step policy (:mod:`eagle_kernels.policy`):
static shapes on a GPU, shapes fitted to the step on a CPU.

A step reads and writes only the preallocated tensors of :class:`_State`, in place, so under
the static policy it can be captured once into a CUDA graph and replayed for every later step
(``cuda_graph``). With graphs on, the decoder keeps each shape's state, caches and graph across
``generate`` calls (:class:`_Slot`, keyed by batch-size bucket, tree and cache capacity), so a
shape is captured once per decoder, or ahead of time by :meth:`SpeculativeDecoder.warmup`.
The host looks at the ``done`` flags only every ``sync_every`` steps.

Plain decoding (``speculative=False``) is the same loop with a one-node tree: the target runs
the root, and ``verify`` samples the next token from the same filtered distribution and random
stream, so both modes are comparable token for token.

The loop, the policies, the tree shapes and the measurements behind the defaults:
docs/decoding.md.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import _dispatch, bookkeeping, ops
from ._checks import mask_words, values_checked
from ._inputs import (
    check_capacity,
    check_context,
    check_count,
    check_prompts,
    check_same_device,
    check_sampling,
    check_token,
)
from ._types import Tree
from .expansion import ExpansionStart, SampledExpansion, expand_sampled_tree, expand_tree, expansion_start
from .lookup import chain_tokens, graft_chain, graft_chain_host, lookup_search, lookup_search_host, pad_chains
from .models.eagle_head import EagleHead
from .models.llama import KVCache, LlamaModel
from .policy import ChainPlan, DraftStats, StepPolicy, match_context, policy_for
from .trees import (  # noqa: F401 -- the tree shapes are the decoder's public names too
    CPU_BATCH_ALL_SAMPLED_TREE,
    CPU_BATCH_SAMPLED_TREE,
    CPU_BATCH_SAMPLING_TREE,
    CPU_BATCH_TREE,
    CPU_INT8_SAMPLED_TREE,
    CPU_SAMPLED_TREE,
    CPU_TREE,
    SAMPLED_TREE,
    TreeConfig,
    default_tree,
    sampled_tree,
)


@dataclass
class GenerationResult:
    """What :meth:`SpeculativeDecoder.generate` returns.

    Attributes
    ----------
    sequences : list of list of int
        Generated token ids per request (prompt excluded), at most ``max_new_tokens`` each.
    tau : list of float
        Tokens per decoding step per request, bonus token included (the prefill's first token
        is not counted).
    steps : list of int
        Decoding steps per request.
    timings : dict
        ``prefill_s``, ``decode_s``, ``total_s`` (seconds), ``tokens``, ``tokens_per_s``; with
        CUDA graphs also ``capture_s`` (warm-up step and capture, 0 for a shape captured
        before), ``replay_steps``, ``replay_s`` (device time of the replayed steps, CUDA events)
        and ``graph`` ("captured", "replayed" or "eager").
    tree : TreeConfig or None
        The tree shape of the call (None for plain decoding).
    """

    sequences: list
    tau: list
    steps: list
    timings: dict = field(default_factory=dict)
    tree: TreeConfig | None = None


def _per_request(value, batch: int, dtype, device) -> torch.Tensor:
    """A sampling argument as a tensor [batch] on ``device``: generate's, checked by ``_inputs.check_sampling``
    (tensors [batch]), or a constant of the decoder's own (warm-up, tree choice)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).expand(batch).contiguous()
    if isinstance(value, (list, tuple)):
        return torch.tensor(value, dtype=dtype, device=device)
    return torch.full((batch,), value, dtype=dtype, device=device)


@dataclass
class _State:
    """One shape's decoding state: its tree shape and every tensor a step reads and writes, all
    on the device. Steps update these tensors in place and never rebind them: a captured CUDA
    graph replays against their addresses. Without graphs each call allocates its own, sized to
    the call; with graphs a :class:`_Slot` keeps one per shape and each call refills it."""

    tree: TreeConfig
    max_depth: int  # deepest verify-tree node (0: plain decoding)
    target_cache: KVCache
    head_cache: KVCache | None
    root: torch.Tensor  # int64 [B] last committed token (KV not cached yet)
    root_hidden: torch.Tensor | None  # [B, H] head output drafting the root's children
    out: torch.Tensor  # int64 [B, W] generated tokens (W >= max_new + depth + 1)
    out_len: torch.Tensor  # int64 [B]
    steps: torch.Tensor  # int64 [B] steps taken while active
    done: torch.Tensor  # bool [B]
    offset: torch.Tensor  # int64 [B] random-stream offset, advanced every step
    sampling: dict  # temperature, top_k, top_p, seed tensors [B]
    max_new: int  # this call's max_new_tokens
    # A request stops at ``limit`` tokens: the int max_new, or int64 [B] in a slot (a graph
    # replays against it, and padding requests of a batch bucket have 0).
    limit: int | torch.Tensor
    # None (no EOS), an int, or int64 [B, 1] in a slot (-1: none; token ids are >= 0).
    eos: int | torch.Tensor | None
    history: torch.Tensor | None = None  # int64 [B, C] prompt + generated tokens (lookup drafts)
    prompt_len: torch.Tensor | None = None  # int64 [B]
    expansion_start: ExpansionStart | None = None  # the head's expansion's first inputs (constant)
    root_normed: torch.Tensor | None = None  # [B, H] EAGLE-3: root_hidden through the head's final norm
    draft: dict[int, DraftStats] | None = None  # the draft-shape statistics (an adaptive policy's), else None
    # The head's commit of no-draft steps, deferred (see _speculative_step): their (emitted token, target feature
    # rows) pairs int64 [B, k] and [B, k, F], and how many of the k each request emitted, int32 [B]; None: none.
    pending_tokens: torch.Tensor | None = None
    pending_rows: torch.Tensor | None = None
    pending_count: torch.Tensor | None = None
    # The target's pass over a step's tree prepared for this call (LlamaModel.cpu_tree_pass; CPU eager steps), else
    # None: the model's forward.
    tree_pass: Callable | None = None


@dataclass
class _Slot:
    """What the decoder keeps for one shape across calls: the state (caches included) and the
    captured step (``replay``), or ``eager`` after a failed capture."""

    state: _State
    speculative: bool
    replay: Callable[[], None] | None = None
    eager: bool = False


class StepGraphs:
    """How a decoder captures and replays one decoding step; the decoder's slots decide when.

    ``warm(step, state)`` runs one real step eagerly where captures happen (first use of a
    shape); ``capture(step, state)`` records ``step(state)`` without running it and returns the
    replay (a callable), or raises, in which case the decoder runs that shape's steps eagerly.
    :class:`CudaStepGraphs` is the CUDA implementation; tests substitute a CPU stand-in that
    records captures and replays the eager step."""

    def warm(self, step, state: _State) -> None:
        raise NotImplementedError

    def capture(self, step, state: _State) -> Callable[[], None]:
        raise NotImplementedError


class CudaStepGraphs(StepGraphs):
    """``torch.cuda.CUDAGraph`` captures on one side stream per decoder. The warm-up step runs
    on that stream, so Triton compiles and loads its kernels and cuBLAS allocates that stream's
    workspace before the capture, not during it. Each graph has its own memory pool."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = None

    def _stream(self):
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        return self.stream

    def warm(self, step, state: _State) -> None:
        stream = self._stream()
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            step(state)
        current.wait_stream(stream)

    def capture(self, step, state: _State) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self._stream()):
            step(state)
        return graph.replay


class _Lookup(NamedTuple):
    """One step's suffix search (:func:`eagle_kernels.lookup.lookup_search`), int64 [B] each."""

    context: torch.Tensor  # context length
    start: torch.Tensor  # where the chain starts in the history (-1: no match)
    matched: torch.Tensor  # suffix length matched


class _HeadDraft:
    """The draft function of :func:`~eagle_kernels.expansion.expand_tree` for an EAGLE head.

    Step 0 drafts from the head's output at the root. Step ``s >= 1`` runs the head over the
    ``k = tree.frontier_width`` frontier nodes at depth ``s``, fed their parents' outputs, with tree attention over
    the head's cache and the frontier's ancestors: frontier node ``m`` of step ``s`` writes its
    K/V to draft slot ``(s - 1) * k + m`` of the cache, and its mask row is its parent's row
    plus its own bit.
    """

    def __init__(self, head: EagleHead, root_hidden: torch.Tensor, cache: KVCache, tree: TreeConfig,
                 root_normed: torch.Tensor | None = None, coupled: tuple | None = None):
        B, k, device = root_hidden.shape[0], tree.frontier_width, root_hidden.device
        self.head, self.cache, self.k = head, cache, k
        # Coupled sampling: (temperature float32 [B], seed int64 [B], positions int64 [B, >= depth]), step s's
        # children taking position positions[:, s]; None: the head's logits as they are.
        self.coupled = coupled
        self.hidden = root_hidden[:, None]  # [B, M, H]: the head's outputs of the previous step
        # EAGLE-3: the root's final norm, made by the previous commit (None: normed here).
        self.root_normed = None if root_normed is None else root_normed[:, None]
        # Each step writes its frontier's rows whole before a pass reads them.
        self.slot_masks = torch.empty(B, tree.depth * k, mask_words(tree.depth * k), dtype=torch.int64, device=device)
        # EAGLE-3 on the GPU layer path: the layer's input norms, for the expansion step to write its normed input.
        self.input_norms = head.fused_input_norms(root_hidden, cache)

    def next_inputs(self, step: int) -> bookkeeping.DraftInputs:
        """What the pass at ``step`` reads, for ``expand_tree`` to gather with the expansion
        step before it (one launch on the GPU path)."""
        return bookkeeping.DraftInputs(self.hidden, self.slot_masks, self.cache.seqlens, self.head.token_embedding,
                                       step, self.input_norms)

    def __call__(self, step: int, tokens: torch.Tensor, parent_row: torch.Tensor, cand_index: torch.Tensor,
                 inputs=None):
        if step > 0:
            # The frontier's parents' outputs, its mask rows, and its position: the root's pair
            # sits at position seqlens - 1, so a depth-d node sits at seqlens - 1 + d (the
            # position training-time test trains the head on). ``inputs``: gathered already.
            # With the layer's normed input too (a fourth entry) where the expansion step made it.
            feature, positions, embed, *normed = inputs if inputs is not None else bookkeeping.draft_inputs(
                self.hidden, parent_row, self.slot_masks, self.cache.seqlens, step, tokens, self.head.token_embedding,
                self.input_norms)
            # The pass attends over step * k slots: their rows, in as many 64-bit words as those slots need
            # (the layers take [B, slots, ceil(slots / 64)]; a tree of more than 64 draft slots has more).
            slots = step * self.k
            self.hidden, logits = self.head.run(tokens, feature, self.cache, positions=positions, embed=embed,
                                                tree_mask=self.slot_masks[:, :slots, : mask_words(slots)],
                                                slot_offset=(step - 1) * self.k, logits=True,
                                                normed=normed[0] if normed else None)
        else:
            logits = self.head.logits(self.hidden, normed=self.root_normed)
        if self.coupled is None:
            return logits
        # A sampling request's rows: log-probabilities at its temperature plus the target's race noise at
        # the children's position (one launch; greedy requests' rows kept).
        temperature, seed, positions = self.coupled
        if logits.dtype == torch.float64:  # the op takes 16- and 32-bit rows
            logits = logits.float()
        return ops.coupled_draft_logits(logits, temperature, seed, positions[:, step], d2t=self.head.d2t)


def _make_one_node_tree(batch: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree of the root alone: verify's ``tokens`` int64 [B, 1] (plain decoding's next token: the root's own
    token is not read) and ``parents`` int32 [B, 1], and the ``depths`` int32 [B, 1] and tree ``mask`` int64
    [B, 1, 1] of a target pass over the roots, which a step without the head's expansion grafts its lookup chain
    onto."""
    return (torch.zeros(batch, 1, dtype=torch.int64, device=device),
            torch.full((batch, 1), -1, dtype=torch.int32, device=device),
            torch.zeros(batch, 1, dtype=torch.int32, device=device),
            torch.ones(batch, 1, 1, dtype=torch.int64, device=device))


class SpeculativeDecoder:
    """EAGLE-style speculative decoder over a :class:`LlamaModel` target and an
    :class:`EagleHead` draft head. The loop is described in docs/decoding.md.

    Parameters
    ----------
    target : LlamaModel
        The model whose output is reproduced (greedy) or sampled from (T > 0).
    head : EagleHead or None
        The draft head. None: the draft is the lookup chain alone (prompt-lookup decoding), or
        plain decoding only.
    tree : TreeConfig or None
        The draft shape of every call. None (default): each call's :func:`default_tree` for
        the target's device, the call's batch size and, with a head, whether every request
        samples and whether some request drafts by sampling (``sampled_drafts``; the call's
        :attr:`GenerationResult.tree` says which). A sampled tree (``TreeConfig.sampled``)
        draws the drafts of requests at a temperature > 0; any other tree drafts the most
        likely tokens, which verify accepts by the deterministic rule.
    sync_every : int or None
        The host reads the ``done`` flags (and calls ``on_sync``) every ``sync_every`` steps.
        None (default): the policy's cadence, every step under the fitted (CPU) policy, where
        the flags are host memory and a batch then stops at the step that finishes it; every 4
        steps under the static (GPU) policy, where each read waits for the device (up to 3
        steps past the end are then computed and dropped).
    cuda_graph : bool
        On CUDA, under the static policy, the first :meth:`generate` call of a shape runs its
        first decoding step eagerly on a side stream (a real step, which also compiles the
        Triton kernels and sets up cuBLAS for that stream), captures the second step once into
        a ``torch.cuda.CUDAGraph`` and replays it for every later step; later calls of the same
        shape replay it from their first step: one graph launch per step instead of one launch
        per kernel, no capture. A shape is (batch-size bucket, tree, cache-capacity bucket):
        batches are padded to the next power of two (or to the next size given to
        :meth:`warmup`) with finished dummy requests, caches to a power-of-two capacity
        (>= 256 tokens) or the capacity :meth:`warmup` set. Outputs are identical to eager
        steps. A failed capture warns once and runs that shape's steps eagerly. Ignored on CPU,
        and when ``EAGLE_KERNELS_CHECK_VALUES=1`` makes the ops read values on the host (those
        checks cannot be captured; the steps then run eagerly).
    policy : StepPolicy or None
        Who decides host reads and data-dependent shapes (:mod:`eagle_kernels.policy`). None
        (default): :func:`~eagle_kernels.policy.policy_for` the target's device, fitted on a
        CPU and static elsewhere. Both give the same tokens; a fitted policy on a GPU runs
        without CUDA graphs.
    graphs : StepGraphs or None
        The capture mechanism. None (default): :class:`CudaStepGraphs` where graphs apply (see
        ``cuda_graph``). Given, it is used on any device and policy (with ``cuda_graph``), e.g.
        a CPU stand-in that tests the per-shape cache.
    sampled_drafts : bool
        With ``tree=None`` and a head, a call in which some request samples (temperature > 0)
        runs the sampled-draft default tree (``default_tree(..., sampled_drafts=True)``): its
        sampling requests draw their drafts from the head at their own temperature, and verify
        accepts them with the draft's probabilities (docs/ops.md §4). Measured with the shipped
        head it gains on code and loses a little on chat against the deterministic trees of the
        same rows (docs/benchmarks.md, "Sampled drafts"). False: the deterministic trees.
    disable_by_batch_size : int or None
        A call of more requests than this decodes with plain steps even when it asks for
        speculation (vLLM's ``disable_by_batch_size``): where a batch's own rows already fill
        the machine, a speculative step's extra rows cost more than its drafts bring. None
        (default): never. Measured where it pays: docs/decoding.md ("Batches that decode plain").

    Raises
    ------
    ValueError
        A head on another device or with another compute dtype than the target; a
        ``disable_by_batch_size`` that is not None or an int >= 1.
    """

    MIN_CAPACITY = 256

    def __init__(self, target: LlamaModel, head: EagleHead | None = None, tree: TreeConfig | None = None,
                 sync_every: int | None = None, cuda_graph: bool = True, policy: StepPolicy | None = None,
                 graphs: StepGraphs | None = None, sampled_drafts: bool = True,
                 disable_by_batch_size: int | None = None):
        if not isinstance(target, LlamaModel):
            raise ValueError(f"target: expected a LlamaModel, got {type(target).__name__}")
        if head is not None and not isinstance(head, EagleHead):
            raise ValueError(f"head: expected an EagleHead or None, got {type(head).__name__}")
        if tree is not None and not isinstance(tree, TreeConfig):
            raise ValueError(f"tree: expected a TreeConfig or None, got {type(tree).__name__}")
        if sync_every is not None and (not isinstance(sync_every, int) or isinstance(sync_every, bool)):
            raise ValueError(f"sync_every: expected an int or None, got {sync_every!r}")
        if disable_by_batch_size is not None and (
                not isinstance(disable_by_batch_size, int) or isinstance(disable_by_batch_size, bool)
                or disable_by_batch_size < 1):
            raise ValueError(f"disable_by_batch_size: expected None or an int >= 1, got {disable_by_batch_size!r}")
        self.disable_by_batch_size = disable_by_batch_size
        if head is not None:
            head.config.check_fits(target.config)
            if tree is not None and tree.top_k > head.config.draft_vocab_size:
                raise ValueError(f"tree: top_k {tree.top_k} exceeds the head's draft vocabulary of "
                                 f"{head.config.draft_vocab_size} tokens (the children drafted per node)")
        self.target = target
        self.head = head
        self._check_head()
        self.tree = tree
        self.sampled_drafts = sampled_drafts
        self.policy = policy or policy_for(target.device)
        if tree is not None and tree.block and self.policy.coupled_sampling:
            raise ValueError("tree: block=True (block verification) and the policy's coupled_sampling=True are two "
                             "acceptance rules; choose one")
        self.sync_every = None if sync_every is None else max(1, sync_every)
        self.cuda_graph = cuda_graph
        self._graphs_given = graphs is not None
        self.graphs = graphs
        self.captures = 0  # steps captured by this decoder (one per shape, unless a capture failed)
        self._slots: dict[tuple, _Slot] = {}
        self._caches: dict[tuple, KVCache] = {}  # target caches of the slots, by (batch, capacity)
        self._batch_sizes: tuple[int, ...] | None = None  # set by warmup
        self._max_len: int | None = None  # set by warmup
        self._capture_warned = False
        self._position_offsets: dict = {}  # (device, depth) -> int64 [depth], 1 .. depth (coupled sampling)
        self._root_trees: dict = {}  # (batch, device) -> _make_one_node_tree's tensors (read only)
        self._draft_stats: dict[tuple, dict | None] = {}  # by (batch, tree, greedy): the policy's, kept across calls

    def _check_head(self) -> None:
        """The head on the target's device and in its compute dtype (mixed ones fail in the
        first kernel, or silently convert on every step)."""
        head, target = self.head, self.target
        if head is None:
            return
        device = next(iter(head.weights.values())).device
        if device != target.device:
            raise ValueError(f"head: on {device}, the target on {target.device}; move both to one device")
        if head.dtype != target.dtype:
            raise ValueError(f"head: compute dtype {head.dtype}, the target's {target.dtype}; load both in one dtype")

    # ------------------------------------------------------------------ public
    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens: int, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                 eos_token_id=None, speculative: bool = True, on_sync=None,
                 allow_beyond_context: bool = False) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens for each prompt, all prompts as one batch.

        Greedy requests (temperature 0) get token for token the output of plain greedy
        decoding; sampled requests get exactly the distribution of plain sampling from the
        target's filtered distribution (the guarantee of ``eagle_kernels.verify``).

        Runs under ``torch.inference_mode()`` (docs/decoding.md, "One call").

        Parameters
        ----------
        prompts : list of list of int
            Token ids in ``[0, vocab)``, one list, tuple or 1-D integer tensor per request (``B``
            requests; lengths may differ, each >= 1).
        max_new_tokens : int
            Tokens to generate per request (>= 0), the prefill's first token included.
        temperature : float, sequence of float or tensor, default 0.0
            One value for all requests (a number or a 0-D tensor), or one per prompt (a sequence
            or 1-D tensor of ``B`` values; likewise ``top_k``, ``top_p``, ``seed``): 0 is
            greedy, > 0 samples from ``softmax(logits / temperature)``.
        top_k : int, sequence of int or tensor, default 0
            Sample only among the ``top_k`` most likely tokens (0: off); ints that fit int32.
        top_p : float, sequence of float or tensor, default 1.0
            Sample only among the most likely tokens holding ``top_p`` of the mass (1.0: off).
        seed : int, sequence of int or tensor, default 0
            Key of the request's counter-based random stream: the same seed gives the same
            tokens in any batch; ints that fit int64.
        eos_token_id : int or None, default None
            A request stops after emitting this token (which ends its sequence).
        speculative : bool, default True
            False: plain decoding, one token per step through the same loop, filters and
            random stream.
        on_sync : callable or None, default None
            ``on_sync(tokens, lengths)`` at each host synchronisation (every ``sync_every``
            steps), with the int64 [B, W] output buffer and the int64 [B] valid lengths, e.g.
            to stream text. Both are the decoder's live buffers: read them, do not keep them.
        allow_beyond_context : bool, default False
            Let a prompt plus ``max_new_tokens`` run past the target's context
            (``LlamaConfig.max_position_embeddings``) with a ``RuntimeWarning`` instead of an error.

        Returns
        -------
        GenerationResult
            ``sequences`` (prompt excluded), ``tau``, ``steps``, ``timings`` and the call's
            ``tree``.

        Raises
        ------
        ValueError
            ``speculative=True`` with neither a draft head nor a lookup chain
            (``tree.lookup == 0``); no prompt, a prompt without tokens, a token id or
            ``eos_token_id`` outside ``[0, vocab)``, a negative ``max_new_tokens``, a prompt plus
            ``max_new_tokens`` past the context (see ``allow_beyond_context``); after
            :meth:`warmup`, more requests than its largest batch size or a prompt plus
            ``max_new_tokens`` past its ``max_len``; a tensor argument or the head on another
            device than the target; a sampling argument that is neither a scalar nor one value
            per prompt (a sequence or 1-D tensor of another length, a tensor of more dimensions),
            a ``temperature`` or ``top_p`` that is not a real number, a ``top_k`` or ``seed``
            that is not an int (bools included) or does not fit verify's int32 / int64, and
            sampling values verify rejects (temperature finite and >= 0, top_k >= 0, top_p in
            (0, 1]; verify's messages). Messages name the argument, the request index and the
            value. Every check runs before any kernel.
        TypeError
            ``prompts`` not a sequence of token-id sequences (e.g. one flat list of ints), or a
            non-int ``max_new_tokens`` / ``eos_token_id``.
        """
        vocab = self.target.config.vocab_size
        device = self.target.device
        check_same_device(device, prompts=prompts, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        prompts = check_prompts(prompts, vocab)
        max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        eos_token_id = check_token("eos_token_id", eos_token_id, vocab)
        check_context(prompts, max_new_tokens, self.target.config.max_position_embeddings, allow_beyond_context)
        temperature, top_k, top_p, seed = check_sampling(len(prompts), temperature, top_k, top_p, seed)
        if on_sync is not None and not callable(on_sync):
            raise ValueError(f"on_sync: expected a callable or None, got {type(on_sync).__name__}")
        self._check_head()
        tree = self._call_tree(len(prompts), temperature)
        if speculative and self.head is None and not tree.lookup:
            raise ValueError("head: speculative decoding needs a draft head or a lookup chain "
                             "(TreeConfig.lookup > 0), or speculative=False")
        B = len(prompts)
        speculative = speculative and not self._decodes_plain(B)
        bucket = self._batch_bucket(B)
        if self._max_len is not None:
            check_capacity(prompts, max_new_tokens, self._max_len)
        slot = None
        if self._graphs_enabled(device):
            slot = self._slot(bucket, max(len(p) for p in prompts) + max_new_tokens, tree, speculative)
        start = time.perf_counter()
        if slot is None:
            state = self._prefill(prompts, tree, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id,
                                  speculative)
        else:
            state = slot.state
            self._fill(state, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, speculative)
        prefill_done = time.perf_counter()
        state.draft = None
        greedy = not bool((temperature > 0).any())
        coupled = self.policy.coupled_sampling and not greedy
        if speculative and slot is None and (greedy or coupled or self.policy.adaptive_sampling):
            # A sampled call's acceptance is not a greedy call's, nor a coupled call's.
            key = (B, tree, "greedy" if greedy else "coupled" if coupled else "sampled")
            if key not in self._draft_stats:
                self._draft_stats[key] = self.policy.draft_stats(tree, self.head is not None)
            state.draft = self._draft_stats[key]
        step = self._speculative_step if speculative else self._plain_step
        if speculative and slot is None and not self.policy.capturable:
            state.tree_pass = self.target.cpu_tree_pass(state.target_cache, self._feature_layers())
        if slot is None:
            self._run_steps(state, step, max_new_tokens, on_sync)
            clock = {}
        else:
            clock = self._run_slot(slot, step, B, max_new_tokens, on_sync)
        lengths = state.out_len[:B].clamp(max=max_new_tokens).tolist()
        out = state.out[:B].tolist()
        steps = state.steps[:B].tolist()
        end = time.perf_counter()
        if "events" in clock:
            first, last = clock.pop("events")
            clock["timings"]["replay_s"] = first.elapsed_time(last) * 1e-3
        sequences = [row[:n] for row, n in zip(out, lengths)]
        # The first token comes from the prefill; tau counts the tokens of decoding steps.
        tau = [(n - 1) / s if s else 0.0 for n, s in zip(lengths, steps)]
        generated = sum(lengths)
        timings = {"prefill_s": prefill_done - start, "decode_s": end - prefill_done, "total_s": end - start,
                   "tokens": generated, "tokens_per_s": generated / (end - start)}
        timings.update(clock.pop("timings", {}))
        return GenerationResult(sequences, tau, steps, timings, tree if speculative else None)

    @torch.inference_mode()
    def warmup(self, batch_sizes=(1,), max_len: int = 2048, speculative=None, temperature=0.0) -> int:
        """Capture ahead of time the steps of every batch size in ``batch_sizes`` for prompts
        plus ``max_new_tokens`` up to ``max_len`` tokens, as serving engines do; later
        :meth:`generate` calls within those limits capture nothing.

        After a warm-up, the batch sizes are the decoder's batch buckets (a call is padded to
        the smallest one that holds it) and ``max_len`` its cache capacity: a larger batch or a
        longer request is a ``ValueError`` before any kernel runs. Without graphs (CPU, or
        ``cuda_graph=False``) nothing is captured, and the limits are checked all the same.

        Parameters
        ----------
        batch_sizes : sequence of int
            Batch sizes to capture (each >= 1).
        max_len : int
            Longest prompt plus ``max_new_tokens`` of a request.
        speculative : bool or None
            Capture speculative steps (True), plain steps (False) or both (None: plain, and
            speculative where the decoder has a head or a lookup chain).
        temperature : float
            Passed to the tree choice when the decoder has no tree (CPU default trees only);
            checked as :meth:`generate` checks its own (a ``ValueError`` naming it).

        Returns
        -------
        int
            Steps captured by this call.
        """
        if not isinstance(batch_sizes, (list, tuple, range)):
            raise ValueError(f"batch_sizes: expected a sequence of ints, got {batch_sizes!r}")
        sizes = sorted({check_count("batch_sizes", b, minimum=1) for b in batch_sizes})
        if not sizes:
            raise ValueError("batch_sizes: expected at least one batch size, got none")
        max_len = check_count("max_len", max_len, minimum=2)
        temperature = float(check_sampling(1, temperature, 0, 1.0, 0)[0])  # generate's rules for one value
        if max_len > self.target.config.max_position_embeddings:
            raise ValueError(f"max_len: {max_len} exceeds the model's context of "
                             f"{self.target.config.max_position_embeddings} positions")
        if speculative and self.head is None and not self._call_tree(sizes[0], temperature).lookup:
            raise ValueError("speculative: warm-up of speculative steps needs a draft head or a lookup chain "
                             "(TreeConfig.lookup > 0)")
        self._batch_sizes = tuple(sorted(set(sizes) | set(self._batch_sizes or ())))
        self._max_len = max(max_len, self._max_len or 0)
        modes = [False, True] if speculative is None else [bool(speculative)]
        before = self.captures
        if not self._graphs_enabled(self.target.device):
            return 0
        for mode in modes:
            for size in sizes:
                tree = self._call_tree(size, temperature)
                if mode and ((self.head is None and not tree.lookup) or self._decodes_plain(size)):
                    continue  # nothing drafts, or calls of this size decode plain: plain steps only
                slot = self._slot(size, self._max_len, tree, mode)
                if slot.replay is not None or slot.eager:
                    continue
                # Dummy one-token prompts; the warm step and the capture run on them and the
                # next generate call refills the state.
                self._fill(slot.state, [[0]] * size, 3, 0.0, 0, 1.0, 0, None, mode)
                step = self._speculative_step if mode else self._plain_step
                self._graph_mechanism().warm(step, slot.state)
                self._capture(slot, step)
        return self.captures - before

    def release(self) -> None:
        """Drop every slot (states, KV caches, captured graphs) and the limits of :meth:`warmup`;
        the next call of each shape captures again."""
        self._slots.clear()
        self._caches.clear()
        self._draft_stats.clear()
        self._batch_sizes = self._max_len = None

    def _decodes_plain(self, batch: int) -> bool:
        """Whether a call of ``batch`` requests runs plain steps although it asks for speculation."""
        return self.disable_by_batch_size is not None and batch > self.disable_by_batch_size

    def _call_tree(self, batch: int, temperature) -> TreeConfig:
        """The tree of a call: the decoder's, else the device's default for this call."""
        if self.tree is not None:
            return self.tree
        if self.policy.coupled_sampling:  # drafts as greedy calls draft them, at every temperature
            return default_tree(self.target.device, batch)
        samples = _per_request(temperature, batch, torch.float32, "cpu") > 0
        all_sample = self.head is not None and bool(samples.all())
        sampled = self.head is not None and self.sampled_drafts and bool(samples.any())
        return default_tree(self.target.device, batch, sampling=all_sample, sampled_drafts=sampled,
                            int8_activations=self.target.activations == "int8")

    # ------------------------------------------------------------------ step loops
    def _run_steps(self, state: _State, step, max_steps: int, on_sync) -> None:
        """Up to ``max_steps`` eager decoding steps; the host reads ``state.done`` (and calls
        ``on_sync``) only every ``sync_every`` steps."""
        sync_every = self.sync_every or self.policy.sync_every
        if step == self._plain_step:
            step = self._native_plain_step(state) or step
        for index in range(max_steps):
            step(state)
            if (index + 1) % sync_every == 0:
                if on_sync is not None:
                    on_sync(state.out, state.out_len.clamp(max=state.max_new))
                if bool(state.done.all()):
                    break

    def _native_plain_step(self, state: _State) -> Callable[[_State], None] | None:
        """:meth:`_plain_step` for this call's ``state`` as three native calls (the target's pass prepared once by
        ``LlamaModel.cpu_token_pass``, ``verify`` on the root, ``decoder_commit`` through ``bookkeeping.commit``):
        the same tokens bit for bit, without its per-step Python (about 0.3 ms of a plain step of SmolLM2-135M on
        one core, where each step's weight stream has evicted the interpreter's data). None where a step needs
        more than those calls (coupled sampling, no native kernels) or where the policy is a GPU's (capturable:
        its steps are the ones a graph captures)."""
        if (self.policy.capturable or self.policy.coupled_sampling
                or _dispatch.backend_of("verify", state.root.device) != "cpp"):
            return None
        target_pass = self.target.cpu_token_pass(state.root[:, None], state.target_cache)
        if target_pass is None:
            return None
        verify = torch.ops.eagle_kernels.verify
        tokens, parents, _, _ = self._one_node_tree(state.root.shape[0], state.root.device)

        def step(state: _State) -> None:
            out_tokens = verify(tokens, parents, target_pass(), max_depth=0, offset=state.offset,
                                **state.sampling)[2]
            bookkeeping.commit(state, out_tokens, None, None, None)

        return step

    def _run_slot(self, slot: _Slot, step, batch: int, max_steps: int, on_sync) -> dict:
        """The steps of a call on a slot: replays of its captured step; on the slot's first use
        step 1 runs eagerly (warm-up), step 2 is captured, then every step is a replay; eager
        steps after a failed capture. Returns ``{"timings": {...}}``: ``capture_s`` (host time
        of the warm-up step and the capture, 0 on a shape captured before), ``replay_steps`` and
        ``replay_s`` (device time from the first replay to the end of the loop: CUDA events on
        CUDA, read by the caller after its readback as ``"events"``, else the host clock),
        ``graph`` ("replayed", "captured" or "eager"). Nothing here waits for the device but
        the done-flag reads every ``sync_every`` steps."""
        state = slot.state
        sync_every = self.sync_every or self.policy.sync_every
        kind = "replayed" if slot.replay is not None else ("eager" if slot.eager else "captured")
        cuda = state.out.device.type == "cuda"
        capture_s, replays, start, host0, warmed = 0.0, 0, None, 0.0, False
        for index in range(max_steps):
            if slot.replay is None and not slot.eager:
                t0 = time.perf_counter()
                if not warmed:  # a real step where the capture will happen
                    self._graph_mechanism().warm(step, state)
                    warmed = True
                else:  # records this step without running it; the replay below runs it
                    self._capture(slot, step)
                    kind = "eager" if slot.eager else kind
                capture_s += time.perf_counter() - t0
            if slot.replay is not None:
                if start is None:
                    host0 = time.perf_counter()
                    start = torch.cuda.Event(enable_timing=True) if cuda else host0
                    if cuda:
                        start.record()
                slot.replay()
                replays += 1
            elif slot.eager:
                step(state)
            if (index + 1) % sync_every == 0:
                if on_sync is not None:
                    on_sync(state.out[:batch], state.out_len[:batch].clamp(max=state.max_new))
                if bool(state.done.all()):
                    break
        timings = {"capture_s": capture_s, "replay_steps": replays, "replay_s": 0.0, "graph": kind}
        if replays and cuda:  # read after the output's readback has waited for the device
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            return {"timings": timings, "events": (start, end)}
        if replays:
            timings["replay_s"] = time.perf_counter() - host0
        return {"timings": timings}

    def _capture(self, slot: _Slot, step) -> None:
        """Capture a slot's step, after a warm-up step on the same mechanism (see ``warm``). A
        failed capture warns once per decoder and leaves the slot to eager steps: a capture
        records and runs nothing, so the state still holds the previous step's result and the
        next eager step continues from it."""
        try:
            slot.replay = self._graph_mechanism().capture(step, slot.state)
        except Exception as error:  # noqa: BLE001 -- any capture failure: eager steps, same output
            slot.eager = True
            if not self._capture_warned:
                self._capture_warned = True
                warnings.warn(f"CUDA graph capture failed ({type(error).__name__}: {error}); this shape runs "
                              "eager steps (same output, one launch per kernel)", RuntimeWarning, stacklevel=4)
            return
        self.captures += 1

    def _graph_mechanism(self) -> StepGraphs:
        if self.graphs is None:
            self.graphs = CudaStepGraphs(self.target.device)
        return self.graphs

    def _graphs_enabled(self, device: torch.device) -> bool:
        """Whether calls run on slots with captured steps: ``cuda_graph`` and either a given
        capture mechanism or CUDA under a capturable policy without host-reading checks."""
        if not self.cuda_graph:
            return False
        if self._graphs_given:
            return True
        return self.policy.capturable and device.type == "cuda" and not values_checked(device)

    def _batch_bucket(self, batch: int) -> int:
        """The batch size of the slot a call of ``batch`` requests runs in: the smallest warmed
        size that holds it, else the next power of two."""
        if self._batch_sizes is not None:
            fits = [b for b in self._batch_sizes if b >= batch]
            if not fits:
                raise ValueError(f"prompts: {batch} requests exceed the largest batch size warmed up, "
                                 f"{self._batch_sizes[-1]} (warmup(batch_sizes=...) sets them)")
            return fits[0]
        return 1 << (batch - 1).bit_length()

    def _depth(self, tree: TreeConfig, speculative: bool) -> int:
        """Deepest verify-tree node: the EAGLE tree's with a head, the lookup chain's without."""
        if not speculative:
            return 0
        return tree.max_depth if self.head is not None else tree.lookup

    def _slot(self, batch: int, length: int, tree: TreeConfig, speculative: bool) -> _Slot:
        """The slot of a shape, made on first use: ``batch`` requests (a bucket) of up to
        ``length`` tokens of prompt plus output. An existing slot with a larger capacity serves
        shorter calls; after a warm-up every slot has the capacity of its ``max_len``."""
        key_tree = tree if speculative else None
        extra = (tree.verify_nodes if speculative else 1) + self._depth(tree, speculative) + 2
        need = (self._max_len if self._max_len is not None else length) + extra
        fits = [(cap, slot) for (b, t, cap), slot in self._slots.items()
                if b == batch and t == key_tree and cap >= need]
        if fits:
            return min(fits, key=lambda item: item[0])[1]
        if self._max_len is not None:  # a multiple of 128: plain and speculative slots share a cache
            capacity = -(-need // 128) * 128
        else:
            capacity = max(self.MIN_CAPACITY, 1 << (need - 1).bit_length())
        # Outputs and the lookup history sized by the capacity: any call the slot serves fits.
        state = self._allocate(batch, capacity, capacity, 2 * capacity, tree, speculative, slot=True)
        slot = self._slots[(batch, key_tree, capacity)] = _Slot(state, speculative)
        return slot

    # ------------------------------------------------------------------ prefill
    def _allocate(self, B: int, capacity: int, out_width: int, history_width: int, tree: TreeConfig,
                  speculative: bool, slot: bool = False) -> _State:
        """A state of ``B`` requests, caches of ``capacity`` tokens; ``slot``: the per-request
        limit and EOS as tensors (a graph replays against them), else filled in per call, and
        the target cache shared with the decoder's other slots of the same batch and capacity
        (only one call runs at a time, and each refills it)."""
        device = self.target.device
        depth = self._depth(tree, speculative)
        if slot:  # one target cache per (batch, capacity): a call refills it, whichever slot runs
            target_cache = self._caches.get((B, capacity))
            if target_cache is None:
                target_cache = self._caches[(B, capacity)] = self.target.new_cache(B, capacity)
        else:
            target_cache = self.target.new_cache(B, capacity)
        head_cache, root_hidden = None, None
        if speculative and self.head is not None:
            head_cache = self.head.new_cache(B, capacity + tree.depth * tree.top_k)
            root_hidden = torch.zeros(B, self.head.config.hidden_size, dtype=self.head.dtype, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        sampling = {"temperature": torch.zeros(B, dtype=torch.float32, device=device),
                    "top_k": torch.zeros(B, dtype=torch.int32, device=device),
                    "top_p": torch.ones(B, dtype=torch.float32, device=device),
                    "seed": torch.zeros(B, **i64)}
        history = torch.zeros(B, history_width, **i64) if speculative and tree.lookup else None
        return _State(tree, depth, target_cache, head_cache, torch.zeros(B, **i64), root_hidden,
                      torch.full((B, out_width), -1, **i64), torch.ones(B, **i64), torch.zeros(B, **i64),
                      torch.zeros(B, dtype=torch.bool, device=device), torch.zeros(B, **i64), sampling, 0,
                      torch.zeros(B, **i64) if slot else 0, torch.full((B, 1), -1, **i64) if slot else None,
                      history, torch.zeros(B, **i64) if history is not None else None,
                      expansion_start(B, device) if head_cache is not None else None,
                      torch.zeros_like(root_hidden) if head_cache is not None and self.head.final_norm() else None)

    def _prefill(self, prompts, tree, max_new, temperature, top_k, top_p, seed, eos, speculative) -> _State:
        """A state sized to this call (eager steps), prefilled."""
        width = max(len(p) for p in prompts)
        depth = self._depth(tree, speculative)
        capacity = width + max_new + tree.verify_nodes + depth + 2
        out_width = max_new + depth + 1
        state = self._allocate(len(prompts), capacity, out_width, width + out_width, tree, speculative)
        self._fill(state, prompts, max_new, temperature, top_k, top_p, seed, eos, speculative)
        return state

    def _fill(self, state: _State, prompts, max_new, temperature, top_k, top_p, seed, eos, speculative) -> None:
        """Start a call on ``state``: the prefill of ``prompts`` into its caches, the first token,
        and every other field reset in place. A state with more rows than prompts (a slot's
        batch bucket) gets finished one-token dummy requests in the rest."""
        device = self.target.device
        B, rows = len(prompts), state.root.shape[0]
        if rows > B:
            prompts = list(prompts) + [[0]] * (rows - B)
        lengths = torch.tensor([len(p) for p in prompts], device=device)  # checked by generate: each >= 1
        width = int(lengths.max())
        tokens = torch.zeros(rows, width, dtype=torch.int64, device=device)
        for b, prompt in enumerate(prompts):
            tokens[b, : len(prompt)] = torch.tensor(prompt, dtype=torch.int64)
        slot = isinstance(state.limit, torch.Tensor)
        target_cache = state.target_cache
        if slot:
            target_cache.seqlens.zero_()
        layers = self.head.config.feature_layers if (speculative and self.head) else ()
        last = (lengths - 1)[:, None]
        out = self.target(tokens, target_cache, feature_layers=layers, logit_rows=last)
        sampling = state.sampling
        for name, value, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                                   ("top_p", top_p, torch.float32), ("seed", seed, torch.int64)):
            sampling[name][:B] = _per_request(value, B, dtype, device)
        if rows > B:  # dummy requests: greedy defaults (their tokens are dropped)
            for name, fill in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0), ("seed", 0)):
                sampling[name][B:] = fill
        offset = state.offset
        offset.zero_()
        first = self._sample_root(out.logits, sampling, offset, lengths)
        target_cache.seqlens.copy_(lengths.to(torch.int32))

        if state.head_cache is not None:
            # Pair i = (token i + 1, feature i); the last pair carries the first generated token.
            next_tokens = torch.cat([tokens[:, 1:], tokens.new_zeros(rows, 1)], dim=1)
            next_tokens.scatter_(1, last, first[:, None])
            head_cache = state.head_cache
            if slot:
                head_cache.seqlens.zero_()
            hidden = self.head(next_tokens, self.head.target_features(out), head_cache)
            state.root_hidden.copy_(torch.gather(hidden, 1, last[..., None].expand(-1, -1, hidden.shape[-1]))[:, 0])
            if state.root_normed is not None:  # the steps' commits keep it
                state.root_normed.copy_(self.head.layer_paths.norm(state.root_hidden, self.head.final_norm()[0]))
            head_cache.seqlens.copy_(lengths.to(torch.int32))

        state.root.copy_(first)
        if slot:
            state.out.fill_(-1)
        state.out[:, 0] = first
        state.max_new = max_new
        if slot:
            state.limit.fill_(max_new)
            state.limit[B:] = 0
            state.eos.fill_(-1 if eos is None else eos)
            state.done.copy_(state.limit <= 1)
            if eos is not None:
                state.done |= first == eos
        else:
            state.limit, state.eos = max_new, eos
            state.done.fill_(max_new <= 1)
            if eos is not None:
                state.done |= first == eos
        if state.history is not None:
            if slot:
                state.history.zero_()
            state.history[:, :width] = tokens
            state.history.scatter_(1, lengths[:, None], first[:, None])
            state.prompt_len.copy_(lengths)
        state.out_len.fill_(1)
        state.steps.zero_()
        offset.fill_(1)

    def _sample_root(self, logits, sampling, offset, positions) -> torch.Tensor:
        """Next token from one row of logits [B, 1, V], through verify on a one-node tree; the token
        sits at sequence position ``positions`` int64 [B] (read by coupled sampling only; None without)."""
        tokens, parents, _, _ = self._one_node_tree(logits.shape[0], logits.device)
        result = ops.verify(tokens, parents, logits, max_depth=0, offset=offset, **sampling,
                            **self._coupled(positions))
        return result.out_tokens[:, 0]

    def _coupled(self, positions: torch.Tensor | None) -> dict:
        """verify's ``positions`` argument under coupled sampling, else none."""
        return {"positions": positions} if self.policy.coupled_sampling else {}

    def _next_positions(self, cache: KVCache, depth: int = 1) -> torch.Tensor | None:
        """Under coupled sampling, int64 [B, depth]: column d is the position a depth-d node's row predicts
        (the root sits at ``seqlens``, so column 0 is verify's ``positions``, column s the position of the
        draft step s's children); one launch. None without coupled sampling (no launches)."""
        if not self.policy.coupled_sampling:
            return None
        key = (cache.seqlens.device, depth)
        offsets = self._position_offsets.get(key)
        if offsets is None:  # made by a graph's eager warm-up step, before any capture
            offsets = self._position_offsets[key] = torch.arange(1, depth + 1, device=cache.seqlens.device)
        return cache.seqlens[:, None] + offsets

    # ------------------------------------------------------------------ steps
    def _plain_step(self, state: _State) -> None:
        cache = state.target_cache
        positions = self._next_positions(cache)
        logits = self.target(state.root[:, None], cache, positions=bookkeeping.tree_positions(cache.seqlens)).logits
        token = self._sample_root(logits, state.sampling, state.offset, None if positions is None else positions[:, 0])
        bookkeeping.commit(state, token[:, None], None, None, None)

    def _speculative_step(self, state: _State) -> None:
        """One step: expand → graft → target pass → verify → compact → commit → emit. The policy
        makes every host read and data-dependent shape decision (docs/decoding.md); with draft
        statistics (``state.draft``) the step drafts the shape those of its context choose (None:
        no draft, the root alone) and records its tokens and wall time there."""
        policy, head, cache = self.policy, self.head, state.target_cache
        start = time.perf_counter() if state.draft is not None else 0.0
        lookup = self._lookup(state, state.tree)
        draft, shape, index = None, state.tree, -1
        if state.draft is not None:  # the statistics of the step's lookup context
            draft = state.draft[match_context(state.tree, None if lookup is None else lookup.matched)]
            index = draft.choose()
            shape = draft.shapes[index]
            if shape is None or not shape.lookup:
                lookup = None
        alone = lookup is not None and policy.chain_alone(shape, lookup.matched)
        # A step without a draft defers the head's commit, so that it costs what a plain step costs; the next
        # step that drafts (or a full queue) commits the deferred pairs in one head pass first.
        defer = policy.defer_head and draft is not None and shape is None and head is not None
        if head is not None and state.pending_tokens is not None and not defer:
            self._flush_head(state)
        drafting = head is not None and shape is not None and not alone
        positions = self._next_positions(cache, shape.depth if drafting else 1)
        expansion = self._expand(state, shape, positions) if drafting else None
        tree = expansion.tree if expansion is not None else self._root_tree(state.root)
        tree, chains = self._graft(state, shape, tree, lookup)
        rows = policy.row_counts(tree.tokens.shape[1], state.done, chains)
        if state.tree_pass is not None:
            out = state.tree_pass(tree.tokens, tree.depths, tree.mask, rows)
        else:
            out = self.target(tree.tokens, cache, depths=tree.depths, tree_mask=tree.mask, row_counts=rows,
                              feature_layers=self._feature_layers())
        if shape is not None and shape.block and expansion is not None:
            # A sampled chain (no lookup graft): its node i is draft i, its row i the draft row of draft i + 1.
            result = ops.block_verify(tree.tokens, out.logits, expansion.draft_probs, offset=state.offset,
                                      d2t=self.head.d2t, **state.sampling)
        else:
            result = ops.verify(tree.tokens, tree.parents, out.logits, max_depth=state.max_depth,
                                offset=state.offset, **state.sampling, **self._draft_rows(expansion, tree),
                                **self._coupled(None if positions is None else positions[:, 0]))
        if tree.tokens.shape[1] > 1:  # the root alone accepts nothing to move
            ops.compact_kv(cache.k, cache.v, cache.seqlens, result.accept_nodes, result.accept_len)
        hidden = None
        if defer:
            self._defer_head(state, out, result)
        elif head is not None:
            hidden = self._commit_head(state, out, result, policy.commit_width(result.accept_len))
        finished = state.done.tolist() if draft is not None else None  # before this step's commit marks any
        # Emit the accepted tokens, advance both caches (the head's unless deferred), the next root (and its head
        # output).
        bookkeeping.commit(state, result.out_tokens, result.accept_len, hidden, None if defer else state.head_cache,
                           head.final_norm() if state.root_normed is not None and not defer else None)
        if defer and state.pending_tokens.shape[1] > state.max_depth:
            self._flush_head(state)  # at most max_depth + 1 deferred rows, as a commit's width
        if draft is not None:
            tokens = sum(length + 1 for length, done in zip(result.accept_len.tolist(), finished) if not done)
            draft.record(index, tokens, time.perf_counter() - start)

    def _one_node_tree(self, batch: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`_make_one_node_tree`'s tensors, made once per batch size and device (by the prefill or a warm-up step,
        before any capture) and read only: a step then launches no fills for them, nor runs their Python after
        the weight stream evicted its data."""
        key = (batch, device)
        tree = self._root_trees.get(key)
        if tree is None:
            tree = self._root_trees[key] = _make_one_node_tree(batch, device)
        return tree

    def _root_tree(self, root: torch.Tensor) -> Tree:
        """The one-node tree of the roots ``root`` int64 [B]: its tokens a view of them."""
        _, parents, depths, mask = self._one_node_tree(root.shape[0], root.device)
        return Tree(root[:, None], parents, depths, mask)

    def _feature_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the head reads (none without a head)."""
        return tuple(self.head.config.feature_layers) if self.head is not None else ()

    def _lookup(self, state: _State, tree: TreeConfig) -> _Lookup | None:
        """Where each request's lookup chain of this step's ``tree`` starts (None without a chain)."""
        if not tree.lookup:
            return None
        context = state.prompt_len + state.out_len
        # A policy that may read values searches on the host: the same results, without a CUDA graph's static shapes.
        search = lookup_search if self.policy.capturable else lookup_search_host
        return _Lookup(context, *search(state.history, context, tree.lookup_ngram))

    def _expand(self, state: _State, tree: TreeConfig, positions: torch.Tensor | None):
        """The head's draft ``tree`` for this step's roots: EAGLE-2's (an ``Expansion``), or with a
        sampled tree every candidate and the draft rows (a ``SampledExpansion``). Under coupled
        sampling (``positions`` int64 [B, tree.depth], ``_next_positions``) the sampling requests'
        draft logits race with the target's noise at their children's positions (the root's children:
        the position after the root's, ``seqlens + 1``)."""
        coupled = None
        if self.policy.coupled_sampling:
            temperature = state.sampling["temperature"]
            # A capturable step reads no value: it perturbs the rows whether or not a request samples.
            if self.policy.capturable or bool((temperature > 0).any()):
                coupled = (temperature, state.sampling["seed"], positions)
        draft = _HeadDraft(self.head, state.root_hidden, state.head_cache, tree, state.root_normed, coupled)
        if tree.sampled:
            # The draws use the step's offset, as verify's: draft_expand's draws are disjoint from
            # verify's by their draw index (docs/design.md).
            sampling = state.sampling
            return expand_sampled_tree(draft, state.root, depth=tree.depth, top_k=tree.top_k,
                                       frontier=tree.frontier_width, temperature=sampling["temperature"],
                                       seed=sampling["seed"], offset=state.offset, d2t=self.head.d2t)
        return expand_tree(draft, state.root, depth=tree.depth, top_k=tree.top_k, num_nodes=tree.num_nodes,
                           d2t=self.head.d2t, start=state.expansion_start)

    def _draft_rows(self, expansion, tree: Tree) -> dict:
        """verify's draft arguments for a sampled expansion (else none): its draft rows, padded
        with zero rows for the grafted lookup chain, whose nodes are deterministic drafts."""
        if not isinstance(expansion, SampledExpansion):
            return {}
        probs = expansion.draft_probs
        B, nodes, total = probs.shape[0], probs.shape[1], tree.tokens.shape[1]
        if total > nodes:
            probs = torch.cat([probs, probs.new_zeros(B, total - nodes, probs.shape[2])], 1)
        node = torch.arange(total, device=probs.device)
        sampled = ((node >= 1) & (node < nodes))[None].expand(B, total).contiguous()
        return {"draft_probs": probs, "draft_sampled": sampled, "d2t": self.head.d2t}

    def _graft(self, state: _State, shape: TreeConfig, tree: Tree, lookup: _Lookup | None) -> tuple[Tree, ChainPlan]:
        """``tree`` with this step's lookup chain (of the step's ``shape``) below its root, as long
        as the policy plans (chain nodes past a request's own length padded), and that plan."""
        if lookup is None:
            return tree, ChainPlan(0)
        nodes = tree.tokens.shape[1]
        chains = self.policy.chain_plan(shape, lookup.matched, nodes)
        if chains.length:
            graft = graft_chain if self.policy.capturable else graft_chain_host  # as in _lookup
            tree = graft(tree, chain_tokens(state.history, lookup.context, lookup.start, chains.length))
            if chains.own is not None:
                tree = pad_chains(tree, nodes, chains.own)
        return tree, chains

    def _defer_head(self, state: _State, out, result) -> None:
        """Queue a no-draft step's head commit: the pair (emitted token, target feature at the root) of each request,
        counted for the requests still active (before this step's commit marks any done)."""
        rows = self.head.feature_rows(out)  # the step verified the root alone: one row
        tokens = result.out_tokens[:, :1].clamp(min=0)
        active = (~state.done).to(torch.int32)
        if state.pending_tokens is None:
            state.pending_tokens, state.pending_rows, state.pending_count = tokens, rows, active
        else:
            state.pending_tokens = torch.cat([state.pending_tokens, tokens], 1)
            state.pending_rows = torch.cat([state.pending_rows, rows], 1)
            state.pending_count = state.pending_count + active

    def _flush_head(self, state: _State) -> None:
        """Commit the deferred pairs in one head pass: the head cache advances by each request's count, and the
        output at the last pair becomes ``root_hidden`` (and ``root_normed``), as the steps' own commits would
        have left them."""
        head, cache = self.head, state.head_cache
        tokens, rows, count = state.pending_tokens, state.pending_rows, state.pending_count
        state.pending_tokens = state.pending_rows = state.pending_count = None
        hidden, _ = head.run(tokens, rows, cache, fc=True)
        bookkeeping.set_root_hidden(state, hidden[:, -1], head.final_norm())
        cache.seqlens += count

    def _commit_head(self, state: _State, out, result, width: int | None) -> torch.Tensor:
        """Feed the accepted path to the head: pair j = (emitted token j, target feature at path
        node j), recomputed with the target's true features, over the first ``width`` path
        slots (None: all). Returns the head's outputs [B, width, H]; the one at the last
        accepted pair drafts the next step (``bookkeeping.commit`` keeps it)."""
        head = self.head
        path, emitted, positions, embed, rows = bookkeeping.commit_inputs(
            result.accept_nodes, result.out_tokens, state.head_cache.seqlens, width, head.token_embedding, head.dtype,
            head.feature_states(out))
        return head.run(emitted, head.feature_rows(out, rows=path, gathered=rows), state.head_cache,
                        positions=positions, embed=embed, fc=True)[0]
