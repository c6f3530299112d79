"""Speculative decoding loop: EAGLE-2 draft trees, prompt-lookup chains, batches, CUDA graphs.

Each step runs one core, the same on every device (:meth:`SpeculativeDecoder._speculative_step`):
expand the head's draft tree (:func:`eagle_kernels.expansion.expand_tree`) → graft the lookup
chain below its root (:mod:`eagle_kernels.lookup`) → one target pass over the tree → verify →
compact_kv → commit the accepted path to the head → emit. Every host read and every shape that
depends on computed values is decided by the decoder's step policy (:mod:`eagle_kernels.policy`):
static shapes on a GPU, shapes fitted to the step on a CPU.

A step reads and writes only the preallocated tensors of :class:`_State`, in place, so under
the static policy it can be captured once into a CUDA graph and replayed for every later step
(``cuda_graph``). The host looks at the ``done`` flags only every ``sync_every`` steps.

Plain decoding (``speculative=False``) is the same loop with a one-node tree: the target runs
the root, and ``verify`` samples the next token from the same filtered distribution and random
stream, so both modes are comparable token for token.

The loop, the policies, the tree shapes and the measurements behind the defaults:
docs/decoding.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import ops
from ._checks import mask_words, values_checked
from ._inputs import check_context, check_count, check_prompts, check_token
from ._types import Tree
from .expansion import expand_tree
from .lookup import chain_tokens, graft_chain, lookup_search, pad_chains
from .models.eagle_head import EagleHead
from .models.llama import KVCache, LlamaModel
from .policy import ChainPlan, StepPolicy, policy_for


@dataclass(frozen=True)
class TreeConfig:
    """The draft of a speculative step: an EAGLE-2 tree and an optional prompt-lookup chain.

    Parameters
    ----------
    depth, top_k, num_nodes
        EAGLE-2 tree: ``depth`` expansion steps, each expanding the ``top_k`` best candidates
        so far (the frontier) into ``top_k`` children each; ``num_nodes`` verified nodes, root
        included (at most ``1 + num_candidates``).
    lookup
        Tokens of a prompt-lookup chain grafted below the root of every tree (0: none): what
        followed the most recent earlier occurrence of the context's last ``lookup_ngram``
        tokens (or fewer, down to 1), continuing the tree's branch where they agree with it
        (:mod:`eagle_kernels.lookup`). The verify pass then has ``num_nodes + lookup`` rows.
    lookup_ngram
        Longest context suffix the lookup searches for.
    lookup_trim
        Needs ``lookup > 0``. Under the fitted (CPU) policy, size each request's chain by how
        long its suffix matched (:func:`eagle_kernels.lookup.trimmed_chain_lengths`); the
        static (GPU) policy keeps the full chain.
    lookup_alone
        Needs ``lookup_trim``. Under the fitted policy, a step in which every request matched
        a full ``lookup_ngram``-token suffix verifies the root and the chain alone: no head
        expansion, ``1 + lookup`` verify rows. The static policy never does.

    Raises
    ------
    ValueError
        A size below its minimum, more nodes than candidates, or a flag without what it needs
        (``lookup_trim`` without a chain, ``lookup_alone`` without ``lookup_trim``); the
        message names the fields.

    Why these knobs pay where they do: docs/decoding.md ("Tree shapes").
    """

    depth: int = 6
    top_k: int = 8
    num_nodes: int = 60
    lookup: int = 0
    lookup_ngram: int = 3
    lookup_trim: bool = False
    lookup_alone: bool = False

    @property
    def num_candidates(self) -> int:
        """Size of the expansion history the verify tree is chosen from."""
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    @property
    def verify_nodes(self) -> int:
        """Rows of the verify pass: the EAGLE tree plus the lookup chain."""
        return self.num_nodes + self.lookup

    @property
    def max_depth(self) -> int:
        """Deepest node of a verify tree (a lookup chain can reach below the EAGLE tree)."""
        return max(self.depth, self.lookup)

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.num_nodes < 1:
            raise ValueError(f"tree: expected depth, top_k, num_nodes >= 1, got {self}")
        if self.lookup < 0 or self.lookup_ngram < 1:
            raise ValueError(f"tree: expected lookup >= 0 and lookup_ngram >= 1, got {self}")
        if self.num_nodes - 1 > self.num_candidates:
            raise ValueError(f"tree: num_nodes - 1 = {self.num_nodes - 1} exceeds the {self.num_candidates} "
                             f"candidates of depth {self.depth} x top_k {self.top_k}")
        if self.lookup_trim and not self.lookup:
            raise ValueError(f"tree: lookup_trim=True needs a lookup chain (lookup > 0), got {self}")
        if self.lookup_alone and not self.lookup_trim:
            raise ValueError("tree: lookup_alone=True needs lookup_trim=True (chain-alone steps are part of the "
                             f"trimmed-chain rule), got {self}")


CPU_TREE = TreeConfig(3, 2, 4, lookup=8, lookup_ngram=4, lookup_trim=True, lookup_alone=True)
CPU_BATCH_TREE = TreeConfig(1, 1, 2, lookup=4, lookup_ngram=4, lookup_trim=True)
CPU_BATCH_SAMPLING_TREE = TreeConfig(1, 1, 2)


def default_tree(device, batch_size: int = 1, sampling: bool = False) -> TreeConfig:
    """The tree shape the decoder, CLI and benchmarks use when none is given.

    A GPU verifies the 60 nodes of the EAGLE-2 default (``TreeConfig()``) in about the time of
    one token. On a CPU every further verify row costs compute, so the trees are small and a
    lookup chain trimmed by its match length adds tokens on text that repeats itself: at
    batch 1 ``CPU_TREE``; from 2 requests on, when every request pays for its own rows, one
    head draft and a shorter chain (``CPU_BATCH_TREE``), and no chain when every request
    samples (``CPU_BATCH_SAMPLING_TREE``: a sampled chain is rarely accepted). The measurements
    behind each choice: docs/decoding.md ("Default trees").

    Parameters
    ----------
    device : torch.device or str
        The target's device; only its type counts.
    batch_size : int
        Requests decoded together (CPU only).
    sampling : bool
        Whether every request samples (temperature > 0; CPU batches only).

    Returns
    -------
    TreeConfig
    """
    if torch.device(device).type == "cpu":
        if batch_size <= 1:
            return CPU_TREE
        return CPU_BATCH_SAMPLING_TREE if sampling else CPU_BATCH_TREE
    return TreeConfig()


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
        ``prefill_s``, ``decode_s``, ``total_s`` (seconds), ``tokens``, ``tokens_per_s``.
    tree : TreeConfig or None
        The tree shape of the call (None for plain decoding).
    """

    sequences: list
    tau: list
    steps: list
    timings: dict = field(default_factory=dict)
    tree: TreeConfig | None = None


def _per_request(value, batch: int, dtype, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).expand(batch).contiguous()
    if isinstance(value, (list, tuple)):
        return torch.tensor(value, dtype=dtype, device=device)
    return torch.full((batch,), value, dtype=dtype, device=device)


@dataclass
class _State:
    """One call's decoding state: its tree shape and every tensor a step reads and writes, all
    on the device. Steps update these tensors in place and never rebind them: a captured CUDA
    graph replays against their addresses."""

    tree: TreeConfig
    max_depth: int  # deepest verify-tree node (0: plain decoding)
    target_cache: KVCache
    head_cache: KVCache | None
    root: torch.Tensor  # int64 [B] last committed token (KV not cached yet)
    root_hidden: torch.Tensor | None  # [B, H] head output drafting the root's children
    out: torch.Tensor  # int64 [B, max_new + depth + 1] generated tokens
    out_len: torch.Tensor  # int64 [B]
    steps: torch.Tensor  # int64 [B] steps taken while active
    done: torch.Tensor  # bool [B]
    offset: torch.Tensor  # int64 [B] random-stream offset, advanced every step
    sampling: dict  # temperature, top_k, top_p, seed tensors [B]
    max_new: int
    eos: int | None
    history: torch.Tensor | None = None  # int64 [B, C] prompt + generated tokens (lookup drafts)
    prompt_len: torch.Tensor | None = None  # int64 [B]


class _Lookup(NamedTuple):
    """One step's suffix search (:func:`eagle_kernels.lookup.lookup_search`), int64 [B] each."""

    context: torch.Tensor  # context length
    start: torch.Tensor  # where the chain starts in the history (-1: no match)
    matched: torch.Tensor  # suffix length matched


class _HeadDraft:
    """The draft function of :func:`~eagle_kernels.expansion.expand_tree` for an EAGLE head.

    Step 0 drafts from the head's output at the root. Step ``s >= 1`` runs the head over the
    ``k`` frontier nodes at depth ``s``, fed their parents' outputs, with tree attention over
    the head's cache and the frontier's ancestors: frontier node ``m`` of step ``s`` writes its
    K/V to draft slot ``(s - 1) * k + m`` of the cache, and its mask row is its parent's row
    plus its own bit.
    """

    def __init__(self, head: EagleHead, root_hidden: torch.Tensor, cache: KVCache, tree: TreeConfig):
        B, k, device = root_hidden.shape[0], tree.top_k, root_hidden.device
        self.head, self.cache, self.k = head, cache, k
        self.hidden = root_hidden[:, None]  # [B, M, H]: the head's outputs of the previous step
        self.slot_masks = torch.zeros(B, tree.depth * k, mask_words(tree.depth * k), dtype=torch.int64, device=device)
        # The root's pair sits at position seqlens - 1, so a depth-d node sits at seqlens - 1 + d
        # (the position training-time test trains the head on).
        self.base_positions = cache.seqlens[:, None].long()

    def __call__(self, step: int, tokens: torch.Tensor, parent_row: torch.Tensor, cand_index: torch.Tensor):
        if step > 0:
            k, H, words = self.k, self.hidden.shape[-1], self.slot_masks.shape[-1]
            feature = torch.gather(self.hidden, 1, parent_row[..., None].expand(-1, -1, H))
            own = (step - 1) * k + torch.arange(k, device=tokens.device)  # this frontier's slots
            if step == 1:  # children of the root: no ancestor slots
                rows = torch.zeros(tokens.shape[0], k, words, dtype=torch.int64, device=tokens.device)
            else:
                parent_slots = (step - 2) * k + parent_row
                rows = torch.gather(self.slot_masks, 1, parent_slots[..., None].expand(-1, -1, words))
            rows[:, torch.arange(k, device=tokens.device), own // 64] |= torch.ones_like(own) << (own % 64)
            self.slot_masks[:, own] = rows
            self.hidden = self.head(tokens, feature, self.cache, positions=self.base_positions + (step - 1),
                                    tree_mask=self.slot_masks[:, : step * k], slot_offset=(step - 1) * k)
        return self.head.logits(self.hidden)


def _root_tree(root: torch.Tensor) -> Tree:
    """The one-node tree of the roots ``root`` int64 [B], which a step without the head's
    expansion grafts its lookup chain onto."""
    B, device = root.shape[0], root.device
    return Tree(root[:, None], torch.full((B, 1), -1, dtype=torch.int32, device=device),
                torch.zeros(B, 1, dtype=torch.int32, device=device),
                torch.ones(B, 1, 1, dtype=torch.int64, device=device))


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
        samples (the call's :attr:`GenerationResult.tree` says which).
    sync_every : int or None
        The host reads the ``done`` flags (and calls ``on_sync``) every ``sync_every`` steps.
        None (default): the policy's cadence, every step under the fitted (CPU) policy, where
        the flags are host memory and a batch then stops at the step that finishes it; every 4
        steps under the static (GPU) policy, where each read waits for the device (up to 3
        steps past the end are then computed and dropped).
    cuda_graph : bool
        On CUDA, under the static policy, each :meth:`generate` call runs its first decoding
        step eagerly on a side stream (a real step, which also compiles the Triton kernels and
        sets up cuBLAS for that stream), captures the second step once into one
        ``torch.cuda.CUDAGraph`` on that stream and replays the graph for the second and every
        later step: one graph launch per step instead of one launch per kernel. Outputs are
        identical to eager steps. Ignored on CPU, and when ``EAGLE_KERNELS_CHECK_VALUES=1``
        makes the ops read values on the host (those checks cannot be captured; the steps then
        run eagerly).
    policy : StepPolicy or None
        Who decides host reads and data-dependent shapes (:mod:`eagle_kernels.policy`). None
        (default): :func:`~eagle_kernels.policy.policy_for` the target's device, fitted on a
        CPU and static elsewhere. Both give the same tokens; a fitted policy on a GPU runs
        without CUDA graphs.
    """

    def __init__(self, target: LlamaModel, head: EagleHead | None = None, tree: TreeConfig | None = None,
                 sync_every: int | None = None, cuda_graph: bool = True, policy: StepPolicy | None = None):
        if head is not None:
            head.config.check_fits(target.config)
        self.target = target
        self.head = head
        self.tree = tree
        self.policy = policy or policy_for(target.device)
        self.sync_every = None if sync_every is None else max(1, sync_every)
        self.cuda_graph = cuda_graph

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                 eos_token_id=None, speculative: bool = True, on_sync=None,
                 allow_beyond_context: bool = False) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens for each prompt, all prompts as one batch.

        Greedy requests (temperature 0) get token for token the output of plain greedy
        decoding; sampled requests get exactly the distribution of plain sampling from the
        target's filtered distribution (the guarantee of ``eagle_kernels.verify``).

        Parameters
        ----------
        prompts : list of list of int
            Token ids in ``[0, vocab)``, one list, tuple or 1-D integer tensor per request (``B``
            requests; lengths may differ, each >= 1).
        max_new_tokens : int
            Tokens to generate per request (>= 0), the prefill's first token included.
        temperature : float, sequence of float or tensor, default 0.0
            Per request, or one value for all (likewise ``top_k``, ``top_p``, ``seed``): 0 is
            greedy, > 0 samples from ``softmax(logits / temperature)``.
        top_k : int, sequence of int or tensor, default 0
            Sample only among the ``top_k`` most likely tokens (0: off).
        top_p : float, sequence of float or tensor, default 1.0
            Sample only among the most likely tokens holding ``top_p`` of the mass (1.0: off).
        seed : int, sequence of int or tensor, default 0
            Key of the request's counter-based random stream: the same seed gives the same
            tokens in any batch.
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
            ``max_new_tokens`` past the context (see ``allow_beyond_context``); sampling
            parameters the ops reject (their message names the tensor). Messages name the
            argument, the request index and the value.
        TypeError
            ``prompts`` not a sequence of token-id sequences (e.g. one flat list of ints), or a
            non-int ``max_new_tokens`` / ``eos_token_id``.
        """
        vocab = self.target.config.vocab_size
        prompts = check_prompts(prompts, vocab)
        max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        eos_token_id = check_token("eos_token_id", eos_token_id, vocab)
        check_context(prompts, max_new_tokens, self.target.config.max_position_embeddings, allow_beyond_context)
        tree = self._call_tree(len(prompts), temperature)
        if speculative and self.head is None and not tree.lookup:
            raise ValueError("head: speculative decoding needs a draft head or a lookup chain "
                             "(TreeConfig.lookup > 0), or speculative=False")
        start = time.perf_counter()
        state = self._prefill(prompts, tree, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id,
                              speculative)
        prefill_done = time.perf_counter()
        step = self._speculative_step if speculative else self._plain_step
        graph = self._run_steps(state, step, max_new_tokens, on_sync)
        lengths = state.out_len.clamp(max=max_new_tokens).tolist()
        out = state.out.tolist()
        steps = state.steps.tolist()
        del graph  # only now: the readback has waited for its last replay
        end = time.perf_counter()
        sequences = [row[:n] for row, n in zip(out, lengths)]
        # The first token comes from the prefill; tau counts the tokens of decoding steps.
        tau = [(n - 1) / s if s else 0.0 for n, s in zip(lengths, steps)]
        generated = sum(lengths)
        return GenerationResult(sequences, tau, steps, {
            "prefill_s": prefill_done - start, "decode_s": end - prefill_done, "total_s": end - start,
            "tokens": generated, "tokens_per_s": generated / (end - start)}, tree if speculative else None)


    def _call_tree(self, batch: int, temperature) -> TreeConfig:
        """The tree of a call: the decoder's, else the device's default for this call."""
        if self.tree is not None:
            return self.tree
        all_sample = self.head is not None and bool((_per_request(temperature, batch, torch.float32, "cpu") > 0).all())
        return default_tree(self.target.device, batch, sampling=all_sample)

    def _run_steps(self, state: _State, step, max_steps: int, on_sync):
        """Up to ``max_steps`` decoding steps; the host reads ``state.done`` (and calls
        ``on_sync``) only every ``sync_every`` steps. With CUDA graphs on (see the class
        docstring) step 1 runs eagerly on a side stream, step 2 is captured on that stream, and
        steps 2, 3, ... are replays. Returns the graph (None when every step ran eagerly)."""
        device = state.out.device
        graphed = self._graphs_enabled(device)
        sync_every = self.sync_every or self.policy.sync_every
        stream = torch.cuda.Stream(device) if graphed else None
        graph = None
        for index in range(max_steps):
            if not graphed:
                step(state)
            elif index == 0:
                # Warm-up on the stream the capture will use: Triton compiles and loads its
                # kernels and cuBLAS allocates this stream's workspace here, not during the
                # capture. It is a real step, so nothing is undone afterwards.
                current = torch.cuda.current_stream(device)
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    step(state)
                current.wait_stream(stream)
            else:
                if graph is None:
                    # Capture records the step's kernels without running them; the state still
                    # holds step 1's result, and the replay right after runs step 2.
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=stream):
                        step(state)
                graph.replay()
            if (index + 1) % sync_every == 0:
                if on_sync is not None:
                    on_sync(state.out, state.out_len.clamp(max=state.max_new))
                if bool(state.done.all()):
                    break
        return graph

    def _graphs_enabled(self, device: torch.device) -> bool:
        return self.cuda_graph and self.policy.capturable and device.type == "cuda" and not values_checked(device)

    # ------------------------------------------------------------------ prefill
    def _prefill(self, prompts, tree, max_new, temperature, top_k, top_p, seed, eos, speculative) -> _State:
        device = self.target.device
        B = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=device)  # checked by generate: each >= 1
        width = int(lengths.max())
        tokens = torch.zeros(B, width, dtype=torch.int64, device=device)
        for b, prompt in enumerate(prompts):
            tokens[b, : len(prompt)] = torch.tensor(prompt, dtype=torch.int64)
        # Deepest verify-tree node: the EAGLE tree's with a head, the lookup chain's without.
        depth = (tree.max_depth if self.head is not None else tree.lookup) if speculative else 0
        capacity = width + max_new + tree.verify_nodes + depth + 2
        target_cache = self.target.new_cache(B, capacity)
        layers = self.head.config.feature_layers if (speculative and self.head) else ()
        last = (lengths - 1)[:, None]
        out = self.target(tokens, target_cache, feature_layers=layers, logit_rows=last)
        sampling = {"temperature": _per_request(temperature, B, torch.float32, device),
                    "top_k": _per_request(top_k, B, torch.int32, device),
                    "top_p": _per_request(top_p, B, torch.float32, device),
                    "seed": _per_request(seed, B, torch.int64, device)}
        offset = torch.zeros(B, dtype=torch.int64, device=device)
        first = self._sample_root(out.logits, sampling, offset)
        target_cache.seqlens.copy_(lengths.to(torch.int32))

        head_cache, root_hidden = None, None
        if speculative and self.head is not None:
            # Pair i = (token i + 1, feature i); the last pair carries the first generated token.
            next_tokens = torch.cat([tokens[:, 1:], tokens.new_zeros(B, 1)], dim=1)
            next_tokens.scatter_(1, last, first[:, None])
            head_cache = self.head.new_cache(B, capacity + tree.depth * tree.top_k)
            hidden = self.head(next_tokens, self.head.target_features(out), head_cache)
            root_hidden = torch.gather(hidden, 1, last[..., None].expand(-1, -1, hidden.shape[-1]))[:, 0]
            head_cache.seqlens.copy_(lengths.to(torch.int32))

        out_buf = torch.full((B, max_new + depth + 1), -1, dtype=torch.int64, device=device)
        out_buf[:, 0] = first
        done = torch.full((B,), max_new <= 1, device=device)
        if eos is not None:
            done |= first == eos
        history = None
        if speculative and tree.lookup:
            history = torch.zeros(B, width + out_buf.shape[1], dtype=torch.int64, device=device)
            history[:, :width] = tokens
            history.scatter_(1, lengths[:, None], first[:, None])
        return _State(tree, depth, target_cache, head_cache, first, root_hidden, out_buf,
                      torch.ones(B, dtype=torch.int64, device=device), torch.zeros(B, dtype=torch.int64, device=device),
                      done, offset + 1, sampling, max_new, eos, history, lengths)

    def _sample_root(self, logits, sampling, offset) -> torch.Tensor:
        """Next token from one row of logits [B, 1, V], through verify on a one-node tree."""
        B = logits.shape[0]
        tokens = torch.zeros(B, 1, dtype=torch.int64, device=logits.device)
        parents = torch.full((B, 1), -1, dtype=torch.int32, device=logits.device)
        result = ops.verify(tokens, parents, logits, max_depth=0, offset=offset, **sampling)
        return result.out_tokens[:, 0]

    # ------------------------------------------------------------------ steps
    def _plain_step(self, state: _State) -> None:
        cache = state.target_cache
        logits = self.target(state.root[:, None], cache).logits
        token = self._sample_root(logits, state.sampling, state.offset)
        active = ~state.done
        cache.seqlens += active.to(torch.int32)
        self._emit(state, token[:, None], torch.zeros_like(state.out_len), active)

    def _speculative_step(self, state: _State) -> None:
        """One step: expand → graft → target pass → verify → compact → commit → emit. The policy
        makes every host read and data-dependent shape decision (docs/decoding.md)."""
        policy, head, cache = self.policy, self.head, state.target_cache
        lookup = self._lookup(state)
        alone = lookup is not None and policy.chain_alone(state.tree, lookup.matched)
        tree = self._expand(state) if head is not None and not alone else _root_tree(state.root)
        tree, chains = self._graft(state, tree, lookup)
        rows = policy.row_counts(tree.tokens.shape[1], state.done, chains)
        positions = cache.seqlens[:, None].long() + tree.depths.long()
        out = self.target(tree.tokens, cache, positions=positions, tree_mask=tree.mask, row_counts=rows,
                          feature_layers=head.config.feature_layers if head is not None else ())
        result = ops.verify(tree.tokens, tree.parents, out.logits, max_depth=state.max_depth, offset=state.offset,
                            **state.sampling)
        ops.compact_kv(cache.k, cache.v, cache.seqlens, result.accept_nodes, result.accept_len)
        if head is not None:
            self._commit_head(state, out, result, policy.commit_width(result.accept_len))
        active = ~state.done
        advance = (result.accept_len + 1) * active.to(torch.int32)
        cache.seqlens += advance
        if head is not None:
            state.head_cache.seqlens += advance
        self._emit(state, result.out_tokens, result.accept_len.long(), active)

    def _lookup(self, state: _State) -> _Lookup | None:
        """Where each request's lookup chain starts this step (None without a chain)."""
        if not state.tree.lookup:
            return None
        context = state.prompt_len + state.out_len
        return _Lookup(context, *lookup_search(state.history, context, state.tree.lookup_ngram))

    def _expand(self, state: _State) -> Tree:
        """The head's EAGLE-2 draft tree for this step's roots."""
        tree = state.tree
        draft = _HeadDraft(self.head, state.root_hidden, state.head_cache, tree)
        return expand_tree(draft, state.root, depth=tree.depth, top_k=tree.top_k, num_nodes=tree.num_nodes,
                           d2t=self.head.d2t).tree

    def _graft(self, state: _State, tree: Tree, lookup: _Lookup | None) -> tuple[Tree, ChainPlan]:
        """``tree`` with this step's lookup chain below its root, as long as the policy plans
        (chain nodes past a request's own length padded), and that plan."""
        if lookup is None:
            return tree, ChainPlan(0)
        nodes = tree.tokens.shape[1]
        chains = self.policy.chain_plan(state.tree, lookup.matched, nodes)
        if chains.length:
            tree = graft_chain(tree, chain_tokens(state.history, lookup.context, lookup.start, chains.length))
            if chains.own is not None:
                tree = pad_chains(tree, nodes, chains.own)
        return tree, chains

    def _commit_head(self, state: _State, out, result, width: int | None) -> None:
        """Feed the accepted path to the head: pair j = (emitted token j, target feature at path
        node j), recomputed with the target's true features, over the first ``width`` path
        slots (None: all); the output at the last accepted pair drafts the next step."""
        head = self.head
        path, emitted = result.accept_nodes.clamp(min=0).long()[:, :width], result.out_tokens.clamp(min=0)[:, :width]
        hidden = head(emitted, head.target_features(out, rows=path), state.head_cache)
        last = result.accept_len.long()[:, None, None].expand(-1, 1, hidden.shape[-1])
        state.root_hidden.copy_(torch.gather(hidden, 1, last)[:, 0])

    # ------------------------------------------------------------------ output
    def _emit(self, state: _State, tokens: torch.Tensor, last: torch.Tensor, active: torch.Tensor) -> None:
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
        finished = state.out_len >= state.max_new
        if state.eos is not None:
            finished |= (valid & (tokens == state.eos)).any(1)
        state.done |= finished
        state.offset += 1
