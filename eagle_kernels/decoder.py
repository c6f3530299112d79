"""Speculative decoding loop: expand (EAGLE-2 dynamic tree) → build_tree → target verify pass →
verify → compact_kv → commit, batched, with static shapes and no host synchronisation inside a
step. The host looks at the ``done`` flags only every ``sync_every`` steps.

A step reads and writes only the preallocated tensors of :class:`_State`, in place, so on CUDA
it can be captured once into a CUDA graph and replayed for every later step (``cuda_graph``).

Plain decoding (``speculative=False``) is the same loop with a one-node tree: the target runs
the root, and ``verify`` samples the next token from the same filtered distribution and random
stream, so both modes are comparable token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import ops
from ._checks import mask_words, values_checked
from ._types import Tree
from .models.eagle_head import EagleHead
from .models.llama import KVCache, LlamaModel


@dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2 tree shape: ``depth`` expansion steps keeping ``top_k`` beams, ``num_nodes``
    verified nodes (root included).

    ``lookup`` > 0 adds a prompt-lookup chain of that many tokens to every tree: the tokens that
    followed the most recent earlier occurrence of the context's last ``lookup_ngram`` tokens
    (or fewer, down to 1), grafted onto the EAGLE tree where they agree with it (see
    :func:`lookup_chain` and :func:`graft_chain`). The verify pass then has
    ``num_nodes + lookup`` rows. Text that repeats itself (code identifiers, a model's own
    loops) is drafted there even where the head is wrong.

    ``lookup_trim`` (CPU only) sizes the chain each step by how long a suffix matched (``n``,
    from :func:`lookup_search`): no chain when even the last token never occurred before,
    ``lookup // 4`` tokens after a 1-token match, ``lookup // 2`` for ``1 < n < lookup_ngram``,
    all ``lookup`` for ``n = lookup_ngram`` (the largest over the batch). On a CPU each verify
    row costs compute and a step may change shape, and on held-out text the chain after a
    1-token match is rarely accepted beyond its first token while one after a long match is
    often accepted whole. On other devices the chain keeps its full length (static shapes, one
    CUDA graph). It reads the match lengths on the host, which is free on a CPU.

    ``lookup_alone`` (CPU only, with ``lookup_trim``): a step in which every request matched a
    full ``lookup_ngram``-token suffix verifies the root and the chain alone, without the EAGLE
    tree: the head's expansion passes are skipped and the verify pass is ``1 + lookup`` rows
    instead of ``num_nodes + lookup``. After a full match the chain is usually accepted and
    the tree rarely adds to it (held-out code: 9 of 37 such steps accepted tree nodes, most of
    them one or two), while those rows and passes cost about a fifth of the step."""

    depth: int = 6
    top_k: int = 8
    num_nodes: int = 60
    lookup: int = 0
    lookup_ngram: int = 3
    lookup_trim: bool = False
    lookup_alone: bool = False

    @property
    def num_candidates(self) -> int:
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


CPU_TREE = TreeConfig(3, 2, 4, lookup=8, lookup_ngram=4, lookup_trim=True, lookup_alone=True)
CPU_BATCH_TREE = TreeConfig(1, 1, 2, lookup=4, lookup_ngram=4, lookup_trim=True)
CPU_BATCH_SAMPLING_TREE = TreeConfig(1, 1, 2)


def default_tree(device, batch_size: int = 1, sampling: bool = False) -> TreeConfig:
    """The tree shape the decoder, CLI and benchmarks use when none is given, by device type
    and (CPU) batch size, and for a CPU batch whether every request samples (``sampling``, the
    decoder passes it when it has a head).

    A GPU verifies 60 tree nodes of a small target in about the time of one token, so the
    EAGLE-2 default shape applies. A CPU does not: at a handful of rows a linear layer is a
    stream over the weights, but each further row costs compute, so the verify pass grows with
    the tree and small trees win. A lookup chain trimmed by its match length (``lookup_trim``)
    adds accepted tokens on text that repeats itself and costs little where nothing matched.
    Measured on a 2-core AVX-512 CPU with SmolLM2-135M and the shipped EAGLE-3 head, decode time
    per token against plain decoding at T = 0, code / prose, 6 held-out prompts x 48 tokens, 2
    threads, one process: (3, 2, 4) + lookup 4 1.93x / 2.12x; (3, 2, 4) + trimmed lookup 8
    (ngram 4) 2.01-2.03x / 2.22-2.23x; (2, 2, 3) + the same chain 2.09x / 2.20x; trimmed lookup
    16 (ngram 6) 2.04x / 2.08x (differences under about 10% are within this VM's run-to-run
    noise). On chat prompts the trimmed chain ran at 1.55x / 1.14x against 1.27x / 0.89x for the
    untrimmed 4-token chain (README).

    A CPU batch pays for every request's rows, and a plain step of B requests is already B
    rows: from 2 requests on, one head draft and a trimmed lookup chain of up to 4
    (``CPU_BATCH_TREE``). Same setup, 8 held-out prompts x 48 tokens, 3 rounds, decode time per
    token against plain decoding of the same batch: batch 2 1.38x / 1.36x (the batch-1 tree
    1.33x / 1.24x), batch 4 1.15x / 1.26x (the batch-1 tree 0.92x / 0.97x).

    A sampled lookup chain is accepted token by token with the target's probability of it, so
    at T > 0 it rarely pays for its rows, and a CPU batch pays for every row: a batch whose
    requests all sample gets the head draft alone (``CPU_BATCH_SAMPLING_TREE``). Batch 4, T = 1,
    8 prompts x 48 tokens, 2 rounds: 0.97x / 1.03x plain against 0.88x / 0.85x with the chain.
    At batch 1 the chain still pays at T = 1 on code (1.31x against 1.15x without it; prose 1.10x
    against 1.16x, within noise), so the batch-1 tree keeps it.
    """
    if torch.device(device).type == "cpu":
        if batch_size <= 1:
            return CPU_TREE
        return CPU_BATCH_SAMPLING_TREE if sampling else CPU_BATCH_TREE
    return TreeConfig()


def lookup_search(history: torch.Tensor, length: torch.Tensor, ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where prompt lookup continues each request's context: the longest suffix of at most
    ``ngram`` tokens that occurred earlier with at least one token after it, its most recent
    such occurrence, on the device with static shapes.

    One pass over every candidate end position: token ``i`` back from the end of the suffix is
    compared at every position at once, and a running product of the matches along ``i`` gives
    each position's match length.

    Shapes
    ------
    history int64 [B, C] (context ``history[b, :length[b]]``); length int64 [B];
    returns start int64 [B] (index in ``history`` of the token after the occurrence; -1 when even
    the context's last token never occurred before) and matched int64 [B] (the suffix length
    found, 0 ... ngram).
    """
    B, C = history.shape
    device = history.device
    last = length[:, None] - 1  # [B, 1] index of the context's last token
    back = torch.arange(max(1, min(ngram, C - 1)), device=device)  # [n]: i tokens back from an end
    ends = torch.arange(C, device=device)  # [C]: candidate end positions of an earlier occurrence
    earlier = history[:, (ends[None] - back[:, None]).clamp(min=0)]  # [B, n, C]
    suffix = torch.gather(history, 1, (last - back[None]).clamp(min=0))  # [B, n]
    exists = ((ends[None] >= back[:, None])[None] & (last >= back[None])[..., None])  # both indices >= 0
    runs = ((earlier == suffix[..., None]) & exists).to(torch.int64).cumprod(1)  # [B, n, C]
    # An occurrence must end before the last token, so that a continuation exists.
    matched = torch.where(ends[None] < last, runs.sum(1), 0)  # [B, C]
    best = (matched * C + ends[None]).argmax(1, keepdim=True)  # longest, then most recent
    found = torch.gather(matched, 1, best)[:, 0]
    return torch.where(found > 0, best[:, 0] + 1, -1), found


def chain_tokens(history: torch.Tensor, length: torch.Tensor, start: torch.Tensor, chain: int) -> torch.Tensor:
    """``chain`` tokens of ``history`` from ``start`` (see :func:`lookup_search`). Positions past
    the end of the context, and every position of a request without an occurrence (start -1),
    hold arbitrary tokens of the context (filler: verify accepts a draft token only where the
    target agrees, so filler costs a row, never exactness).

    Shapes
    ------
    history int64 [B, C]; length int64 [B]; start int64 [B]; returns int64 [B, chain].
    """
    index = start[:, None] + torch.arange(chain, device=history.device)
    index = torch.minimum(index, length[:, None] - 1).clamp(min=0)
    return torch.gather(history, 1, index)


def lookup_chain(history: torch.Tensor, length: torch.Tensor, ngram: int, chain: int) -> torch.Tensor:
    """Prompt-lookup drafts: for each request, the ``chain`` tokens that followed the most
    recent earlier occurrence of the last ``n`` tokens of its context, for the largest
    ``n <= ngram`` that occurred before (:func:`lookup_search`, then :func:`chain_tokens`).

    Shapes
    ------
    history int64 [B, C] (context ``history[b, :length[b]]``); length int64 [B];
    returns int64 [B, chain].
    """
    start, _ = lookup_search(history, length, ngram)
    return chain_tokens(history, length, start, chain)


def step_shapes_may_change(device: torch.device) -> bool:
    """Whether a decoding step may size its tensors from values it computed (a host read):
    on a CPU the read is free and fewer rows are less arithmetic; elsewhere steps keep static
    shapes and never synchronise (one CUDA graph replayed)."""
    return device.type == "cpu"


def trimmed_chain_lengths(tree: "TreeConfig", matched: torch.Tensor) -> torch.Tensor:
    """Chain tokens worth verifying after suffix matches of ``matched`` tokens (the
    ``lookup_trim`` rule of :class:`TreeConfig`), per request: int64 [B] -> int64 [B]."""
    quarter, half = max(1, tree.lookup // 4), max(1, tree.lookup // 2)
    by_match = torch.where(matched < tree.lookup_ngram, half, tree.lookup)
    return torch.where(matched <= 0, 0, torch.where(matched == 1, quarter, by_match))


def pad_chains(tree: Tree, first_chain_node: int, chain_lengths: torch.Tensor) -> Tree:
    """``tree`` whose chain nodes past each request's own chain length (``chain_lengths`` int64
    [B]; chain node ``i`` is node ``first_chain_node + i``) are made unreachable: each becomes a
    copy of node 1 (a child of the root, as node 1 always is) placed after it, which verify
    never accepts (greedy: it takes the first child with the token; sampling: the copy's token
    has probability 0 once node 1 is rejected). Their rows are then padding the target need not
    compute. Node 1 itself must not be such a node (``first_chain_node >= 2``, or a chain
    length of at least 1)."""
    B, total = tree.tokens.shape
    chain_ids = torch.arange(total - first_chain_node, device=tree.tokens.device)
    padding = torch.cat([torch.zeros(B, first_chain_node, dtype=torch.bool, device=chain_ids.device),
                         chain_ids[None] >= chain_lengths[:, None]], 1)  # [B, total]
    node_ids = torch.arange(total, device=chain_ids.device)
    own_bits = _pack_bits(node_ids[:, None] == node_ids[None])  # [total, W]: each node's own bit
    copy_mask = own_bits[None] | own_bits[0][None, None]  # the root's bit and the node's
    return Tree(torch.where(padding, tree.tokens[:, 1:2], tree.tokens),
                torch.where(padding, 0, tree.parents).to(torch.int32),
                torch.where(padding, 1, tree.depths).to(torch.int32),
                torch.where(padding[..., None], copy_mask, tree.mask))


def graft_chain(tree: Tree, chain: torch.Tensor) -> Tree:
    """The verify tree ``tree`` plus the draft chain ``chain`` below its root, as nodes
    ``N .. N + L - 1``. Chain token ``i`` hangs under the tree node that spells ``chain[:i]``
    when the tree has one (so the chain continues the tree's branch instead of competing with
    it), else under chain node ``i - 1``. A chain node that repeats an existing child of its
    parent comes after it in node order: verify reaches the tree's node first and never the
    copy (greedy), or rejects the copy after rejecting the original (sampling, p(x) = 0 then).

    Shapes
    ------
    tree: tokens int64 [B, N], parents int32 [B, N], depths int32 [B, N], mask int64 [B, N, W];
    chain int64 [B, L]; returns a Tree with N + L nodes and mask width ceil((N + L) / 64).
    """
    B, N = tree.tokens.shape
    L = chain.shape[1]
    device = chain.device
    total, words = N + L, mask_words(N + L)
    node_ids = torch.arange(N, device=device)
    chain_ids = torch.arange(L, device=device)
    depths, parents = tree.depths.long(), tree.parents.long()
    # Walking down from the root, the chain follows the first child (in node order) whose token
    # is its next token. A node is such a step when its token is the chain's token at its depth
    # and no earlier sibling carries the same token.
    shadowed = ((parents[:, :, None] == parents[:, None, :]) & (tree.tokens[:, :, None] == tree.tokens[:, None, :])
                & (node_ids[None, :] < node_ids[:, None])[None]).any(-1)  # [B, N]
    at_depth = torch.gather(chain, 1, (depths - 1).clamp(0, L - 1))
    steps = ((tree.tokens == at_depth) & (depths >= 1) & (depths < L) & ~shadowed) | (node_ids == 0)[None]
    # A node spells chain[:depth] when every node on its path is a step: none of its ancestor
    # bits belongs to a node that is not. matched[:, i]: the node spelling chain[:i], or -1; it
    # exists for i = 0 (the root), 1, ..., p and for no i after p.
    spells = ((tree.mask & _pack_bits(~steps)[:, None, :]) == 0).all(-1)  # [B, N]
    hit = spells[:, :, None] & (depths[:, :, None] == chain_ids[None, None, :])  # [B, N, L]
    matched = torch.where(hit, node_ids[None, :, None], N).amin(1)  # [B, L]
    matched = torch.where(matched < N, matched, -1)
    chain_parents = torch.where(matched >= 0, matched, N + chain_ids - 1)
    # Chain node i hangs below the tree path of node matched[m], m = min(i, p), through chain
    # nodes m ... i - 1: its mask row is that node's row plus the bits of chain nodes m ... i.
    m = torch.minimum(chain_ids[None], (matched >= 0).sum(1, keepdim=True) - 1)  # [B, L]
    anchor = torch.gather(matched, 1, m)
    rows = torch.gather(tree.mask, 1, anchor[..., None].expand(-1, -1, tree.mask.shape[2]))
    columns = torch.arange(total, device=device)
    own = (columns[None, None] >= (N + m)[..., None]) & (columns[None, None] <= (N + chain_ids)[None, :, None])
    mask = torch.zeros(B, total, words, dtype=torch.int64, device=device)
    mask[:, :N, : tree.mask.shape[2]] = tree.mask
    mask[:, N:, : tree.mask.shape[2]] = rows
    mask[:, N:] |= _pack_bits(own)
    chain_depths = (chain_ids + 1).to(torch.int32).expand(B, L)
    return Tree(torch.cat([tree.tokens, chain], 1), torch.cat([tree.parents, chain_parents.to(torch.int32)], 1),
                torch.cat([tree.depths, chain_depths], 1), mask)


def _pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """bool [..., n] -> int64 [..., ceil(n / 64)]: bit j % 64 of word j // 64 set for flags[j]
    (a sum of distinct powers of two is their OR; bit 63 wraps to the sign bit)."""
    n = flags.shape[-1]
    padded = torch.nn.functional.pad(flags, (0, mask_words(n) * 64 - n)).to(torch.int64)
    shifts = torch.arange(64, device=flags.device)
    return (padded.view(*flags.shape[:-1], -1, 64) << shifts).sum(-1)


@dataclass
class GenerationResult:
    """sequences: generated token ids per request (prompt excluded); tau: tokens per step per
    request (bonus token included); steps: decoding steps per request; timings: seconds and
    tokens per second."""

    sequences: list
    tau: list
    steps: list
    timings: dict = field(default_factory=dict)


def _per_request(value, batch: int, dtype, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).expand(batch).contiguous()
    if isinstance(value, (list, tuple)):
        return torch.tensor(value, dtype=dtype, device=device)
    return torch.full((batch,), value, dtype=dtype, device=device)


@dataclass
class _State:
    """Everything a step reads and writes, all on the device. Steps update these tensors in
    place and never rebind them: a captured CUDA graph replays against their addresses."""

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


class SpeculativeDecoder:
    """EAGLE-style speculative decoder over a :class:`LlamaModel` target and an
    :class:`EagleHead` draft head.

    Parameters
    ----------
    target, head, tree
        The target model, the draft head and the EAGLE-2 tree shape (None: each call's
        :func:`default_tree` for the target's device, the call's batch size and, with a head,
        whether every request samples). ``speculative=True``
        needs a head, a lookup chain (``tree.lookup > 0``) or both; without a head the tree is
        the root and the lookup chain (prompt-lookup decoding).
    sync_every
        The host reads the ``done`` flags (and calls ``on_sync``) every ``sync_every`` steps.
        None (default): every step on CPU, where the flags are host memory and reading them
        costs nothing, so a batch stops at the step that finishes it; every 4 steps on a GPU,
        where each read waits for the device (up to 3 steps past the end are then computed
        and dropped).
    cuda_graph
        On CUDA, each :meth:`generate` call runs its first decoding step eagerly on a side
        stream (a real step, which also compiles the Triton kernels and sets up cuBLAS for that
        stream), captures the second step once into one ``torch.cuda.CUDAGraph`` on that stream
        and replays the graph for the second and every later step: one graph launch per step
        instead of one launch per kernel. Outputs are identical to eager steps. Ignored on CPU, and when
        ``EAGLE_KERNELS_CHECK_VALUES=1`` makes the ops read values on the host (those checks
        cannot be captured; the steps then run eagerly).
    """

    def __init__(self, target: LlamaModel, head: EagleHead | None = None, tree: TreeConfig | None = None,
                 sync_every: int | None = None, cuda_graph: bool = True):
        self.target = target
        self.head = head
        self.fixed_tree = tree
        self.tree = tree or default_tree(target.device)  # the tree of the latest call
        self.sync_every = None if sync_every is None else max(1, sync_every)
        self.cuda_graph = cuda_graph

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                 eos_token_id=None, speculative: bool = True, on_sync=None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` per prompt (lists of token ids, ragged allowed).
        Sampling parameters are scalars or one value per request. ``on_sync(tokens, lengths)``
        is called at each host synchronisation point (every ``sync_every`` steps) with the
        int64 [B, W] token buffer and int64 [B] lengths, e.g. to stream text."""
        all_sample = self.head is not None and bool(
            (_per_request(temperature, len(prompts), torch.float32, "cpu") > 0).all())
        self.tree = self.fixed_tree or default_tree(self.target.device, len(prompts), sampling=all_sample)
        if speculative and self.head is None and not self.tree.lookup:
            raise ValueError("head: speculative decoding needs a draft head or a lookup chain "
                             "(TreeConfig.lookup > 0), or speculative=False")
        start = time.perf_counter()
        state = self._prefill(prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, speculative)
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
            "tokens": generated, "tokens_per_s": generated / (end - start)})

    def _run_steps(self, state: _State, step, max_steps: int, on_sync):
        """Up to ``max_steps`` decoding steps; the host reads ``state.done`` (and calls
        ``on_sync``) only every ``sync_every`` steps. With CUDA graphs on (see the class
        docstring) step 1 runs eagerly on a side stream, step 2 is captured on that stream, and
        steps 2, 3, ... are replays. Returns the graph (None when every step ran eagerly)."""
        device = state.out.device
        graphed = self._graphs_enabled(device)
        sync_every = self.sync_every or (1 if device.type == "cpu" else 4)
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
        return self.cuda_graph and device.type == "cuda" and not values_checked(device)

    # ------------------------------------------------------------------ prefill
    def _prefill(self, prompts, max_new, temperature, top_k, top_p, seed, eos, speculative) -> _State:
        device = self.target.device
        B = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        if bool((lengths < 1).any()):
            raise ValueError("prompts: every prompt needs at least one token")
        width = int(lengths.max())
        tokens = torch.zeros(B, width, dtype=torch.int64, device=device)
        for b, prompt in enumerate(prompts):
            tokens[b, : len(prompt)] = torch.as_tensor(prompt, dtype=torch.int64)
        depth = self._max_depth() if speculative else 0
        capacity = width + max_new + self.tree.verify_nodes + depth + 2
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
            head_cache = self.head.new_cache(B, capacity + self.tree.depth * self.tree.top_k)
            hidden = self.head(next_tokens, self.head.target_features(out), head_cache)
            root_hidden = torch.gather(hidden, 1, last[..., None].expand(-1, -1, hidden.shape[-1]))[:, 0]
            head_cache.seqlens.copy_(lengths.to(torch.int32))

        out_buf = torch.full((B, max_new + depth + 1), -1, dtype=torch.int64, device=device)
        out_buf[:, 0] = first
        done = torch.full((B,), max_new <= 1, device=device)
        if eos is not None:
            done |= first == eos
        history = None
        if speculative and self.tree.lookup:
            history = torch.zeros(B, width + out_buf.shape[1], dtype=torch.int64, device=device)
            history[:, :width] = tokens
            history.scatter_(1, lengths[:, None], first[:, None])
        return _State(target_cache, head_cache, first, root_hidden, out_buf,
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
        tree_cfg, head = self.tree, self.head
        fitted = step_shapes_may_change(state.root.device)
        own_chain = None  # per-request chain lengths, when they differ within the batch
        chain_alone = False
        if tree_cfg.lookup:
            context = state.prompt_len + state.out_len
            start, matched = lookup_search(state.history, context, tree_cfg.lookup_ngram)
            chain_alone = (tree_cfg.lookup_alone and tree_cfg.lookup_trim and fitted
                           and bool((matched >= tree_cfg.lookup_ngram).all()))
        tree = self._expand(state) if head is not None and not chain_alone else self._root_tree(state)
        if tree_cfg.lookup:
            chain = tree_cfg.lookup
            if tree_cfg.lookup_trim and fitted:
                own_chain = trimmed_chain_lengths(tree_cfg, matched)
                chain = int(own_chain.max())
            nodes = tree.tokens.shape[1]
            if own_chain is not None and chain and nodes == 1:
                own_chain = own_chain.clamp(min=1)  # node 1 is the chain's first: a row (see pad_chains)
            if chain:
                tree = graft_chain(tree, chain_tokens(state.history, context, start, chain))
                if own_chain is not None and bool((own_chain < chain).any()):
                    tree = pad_chains(tree, nodes, own_chain)
                else:
                    own_chain = None
        row_counts = None
        if fitted and tree.tokens.shape[0] > 1:
            # A batch computes each request's own rows only: its tree and own chain, and just the
            # root for a finished request (whose results are dropped).
            total = tree.tokens.shape[1]
            counts = torch.full_like(state.out_len, total)
            if own_chain is not None:
                counts = counts - (chain - own_chain)
            counts = torch.where(state.done, 1, counts)
            if bool((counts < total).any()):
                row_counts = counts
        cache = state.target_cache
        positions = cache.seqlens[:, None].long() + tree.depths.long()
        out = self.target(tree.tokens, cache, positions=positions, tree_mask=tree.mask, row_counts=row_counts,
                          feature_layers=head.config.feature_layers if head is not None else ())
        result = ops.verify(tree.tokens, tree.parents, out.logits, max_depth=self._max_depth(),
                            offset=state.offset, **state.sampling)
        ops.compact_kv(cache.k, cache.v, cache.seqlens, result.accept_nodes, result.accept_len)

        last = result.accept_len.long()
        if head is not None:
            # Commit the accepted path to the head: pair j = (emitted token j, target feature at
            # path node j), recomputed with the target's true features.
            path, emitted = result.accept_nodes.clamp(min=0).long(), result.out_tokens.clamp(min=0)
            if fitted:
                # Only the batch's longest accepted path (rows past a request's own end are
                # overwritten later, as in the full width), not all max_depth + 1 slots.
                width = int(result.accept_len.max()) + 1
                path, emitted = path[:, :width], emitted[:, :width]
            hidden = head(emitted, head.target_features(out, rows=path), state.head_cache)
            state.root_hidden.copy_(torch.gather(hidden, 1, last[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0])

        active = ~state.done
        advance = (result.accept_len + 1) * active.to(torch.int32)
        cache.seqlens += advance
        if head is not None:
            state.head_cache.seqlens += advance
        self._emit(state, result.out_tokens, last, active)

    def _max_depth(self) -> int:
        """Deepest verify-tree node: the EAGLE tree's with a head, the lookup chain's without."""
        return self.tree.max_depth if self.head is not None else self.tree.lookup

    @staticmethod
    def _root_tree(state: _State) -> Tree:
        """The one-node tree of the root, which a head-less decoder grafts its lookup chain onto."""
        B, device = state.root.shape[0], state.root.device
        return Tree(state.root[:, None], torch.full((B, 1), -1, dtype=torch.int32, device=device),
                    torch.zeros(B, 1, dtype=torch.int32, device=device),
                    torch.ones(B, 1, 1, dtype=torch.int64, device=device))

    def _expand(self, state: _State):
        """EAGLE-2 expansion from the root: ``depth`` draft_expand calls, ``depth - 1`` head
        passes over the frontier (tree attention over the head's cache plus the frontier's
        ancestors), then build_tree."""
        head, cfg = self.head, self.tree
        B, k = state.root.shape[0], cfg.top_k
        device = state.root.device
        slots_total = cfg.depth * k
        words = mask_words(slots_total)
        slot_masks = torch.zeros(B, slots_total, words, dtype=torch.int64, device=device)
        cache = state.head_cache
        base_positions = cache.seqlens[:, None].long()

        logits = head.logits(state.root_hidden[:, None])
        cand = ops.draft_expand(logits, torch.zeros(B, 1, device=device), k, d2t=head.d2t)
        hist_tokens, hist_scores = [cand.tokens], [cand.scores]
        hist_parents = [torch.full((B, k), -1, dtype=torch.int32, device=device)]
        chunk_start, parent_hidden = 0, state.root_hidden[:, None].expand(B, k, -1)
        parent_slots = None  # slot index of each frontier node's parent (None: the root)
        for depth in range(1, cfg.depth):
            frontier = cand.frontier.long()  # [B, k] indices into this depth's candidates
            tokens = torch.gather(cand.tokens, 1, frontier)
            feature = torch.gather(parent_hidden, 1, (frontier // k)[..., None].expand(-1, -1, parent_hidden.shape[-1])) \
                if depth > 1 else parent_hidden
            # Slots of this depth's frontier: (depth - 1) * k + m; rows = parent row | own bit.
            own = (depth - 1) * k + torch.arange(k, device=device)
            rows = torch.zeros(B, k, words, dtype=torch.int64, device=device)
            if parent_slots is not None:
                rows = torch.gather(slot_masks, 1, torch.gather(parent_slots, 1, frontier // k)[..., None].expand(-1, -1, words))
            bit = torch.ones_like(own).bitwise_left_shift(own % 64)
            rows[:, torch.arange(k, device=device), own // 64] |= bit
            slot_masks[:, own] = rows
            # The root's pair sits at position seqlens - 1, so a depth-d node sits at seqlens - 1 + d
            # (the position training-time test trains the head on).
            hidden = head(tokens, feature, cache, positions=base_positions + (depth - 1),
                          tree_mask=slot_masks[:, : depth * k], slot_offset=(depth - 1) * k)
            global_frontier = chunk_start + frontier
            chunk_start += cand.tokens.shape[1]
            scores = torch.gather(cand.scores, 1, frontier)
            cand = ops.draft_expand(head.logits(hidden), scores, k, d2t=head.d2t)
            hist_tokens.append(cand.tokens)
            hist_scores.append(cand.scores)
            # Each frontier node parents k candidates (an expand: older torch versions size an
            # int repeat_interleave's output on the host).
            hist_parents.append(global_frontier[..., None].expand(-1, -1, k).reshape(B, k * k).to(torch.int32))
            parent_hidden, parent_slots = hidden, own[None].expand(B, k)
        return ops.build_tree(state.root, torch.cat(hist_tokens, 1), torch.cat(hist_scores, 1),
                              torch.cat(hist_parents, 1), cfg.num_nodes)

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
