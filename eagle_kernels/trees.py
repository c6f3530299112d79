"""Draft shapes of a speculative step: :class:`TreeConfig` (an EAGLE-2 tree, optionally sampled,
and a prompt-lookup chain), :func:`sampled_tree`, and the defaults of :func:`default_tree`.

The decoder (:mod:`eagle_kernels.decoder`), its step policies (:mod:`eagle_kernels.policy`) and
the lookup chain (:mod:`eagle_kernels.lookup`) all read these shapes; they live apart so that
none of those imports another to know them. The measurements behind the defaults:
docs/decoding.md ("Default trees").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    sampled
        A tree for sampled drafts (:func:`eagle_kernels.expansion.expand_sampled_tree`): requests
        with temperature > 0 draw each expanded node's ``top_k`` children without replacement
        from the head's distribution at their temperature, and verify accepts them with the
        draft's probabilities (docs/ops.md §4, draft-aware rule); greedy requests take the
        ``top_k`` most likely children. Each depth after the root expands ``frontier`` nodes, and
        the tree keeps every candidate (``num_nodes = 1 + num_candidates``, which
        :func:`sampled_tree` fills in): EAGLE-2's re-ranking would keep a sampled child depending
        on its own draw, which is not exact.
    frontier
        Nodes expanded per depth after the root (0: ``top_k``); in ``[1, top_k]``, sampled trees only.
    block
        Verify the sampled chain as one block (``block_verify``, docs/ops.md §21) instead of draft by
        draft: needs ``sampled=True``, ``top_k = 1`` and no lookup chain. Exact like the default rule,
        and a chain keeps more of its drafts on average (docs/decoding.md, "Block verification"). Not
        with coupled sampling, whose rule is its own (the decoder refuses the pair).

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
    sampled: bool = False
    frontier: int = 0
    block: bool = False

    @property
    def frontier_width(self) -> int:
        """Nodes expanded per depth after the root."""
        return self.frontier or self.top_k

    @property
    def num_candidates(self) -> int:
        """Size of the expansion history the verify tree is chosen from."""
        return self.top_k + (self.depth - 1) * self.frontier_width * self.top_k

    @property
    def verify_nodes(self) -> int:
        """Rows of the verify pass: the EAGLE tree plus the lookup chain."""
        return self.num_nodes + self.lookup

    @property
    def max_depth(self) -> int:
        """Deepest node of a verify tree (a lookup chain can reach below the EAGLE tree)."""
        return max(self.depth, self.lookup)

    def __post_init__(self):
        for name in ("depth", "top_k", "num_nodes", "lookup", "lookup_ngram", "frontier"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"tree: {name}: expected an int, got {value!r}")
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
        if self.frontier and not (self.sampled and 1 <= self.frontier <= self.top_k):
            raise ValueError(f"tree: frontier must be in [1, top_k] and needs sampled=True, got {self}")
        if self.block and not (self.sampled and self.top_k == 1 and not self.lookup):
            raise ValueError(f"tree: block=True verifies a sampled chain: it needs sampled=True, top_k=1 and "
                             f"lookup=0, got {self}")
        if self.sampled and self.num_nodes != self.num_candidates + 1:
            raise ValueError(f"tree: a sampled tree keeps every candidate: num_nodes = {self.num_candidates + 1}, "
                             f"got {self} (sampled_tree() fills it in)")


def sampled_tree(depth: int, top_k: int, frontier: int = 0, **lookup) -> TreeConfig:
    """The sampled-draft tree (``TreeConfig.sampled``) of ``depth`` steps, ``top_k`` children per
    expanded node and ``frontier`` expanded nodes per depth (0: ``top_k``), with every candidate
    verified; ``lookup`` takes the chain fields of :class:`TreeConfig`."""
    width = frontier or top_k
    return TreeConfig(depth, top_k, 1 + top_k + (depth - 1) * width * top_k, sampled=True, frontier=frontier,
                      **lookup)


CPU_TREE = TreeConfig(3, 2, 4, lookup=8, lookup_ngram=4, lookup_trim=True, lookup_alone=True)
CPU_BATCH_TREE = TreeConfig(1, 1, 2, lookup=4, lookup_ngram=4, lookup_trim=True)
CPU_BATCH_SAMPLING_TREE = TreeConfig(1, 1, 2)
# Sampled-draft trees (TreeConfig.sampled) of the same verify rows as the trees above: the CPU
# default's 4 tree rows (and its chain), one draft per request in a batch, and the 61 rows of the
# GPU default. The measurements behind each: docs/benchmarks.md ("Sampled drafts").
CPU_SAMPLED_TREE = sampled_tree(3, 1, lookup=8, lookup_ngram=4, lookup_trim=True, lookup_alone=True)
CPU_BATCH_SAMPLED_TREE = sampled_tree(1, 1, lookup=4, lookup_ngram=4, lookup_trim=True)
CPU_BATCH_ALL_SAMPLED_TREE = sampled_tree(1, 1)
# One sampled draft and no chain, for a target with int8 activations at batch 1: each further verify row costs
# it about a row's integer arithmetic (its one-row pass streams 4-bit blocks, rows beyond two are compute-bound).
CPU_INT8_SAMPLED_TREE = sampled_tree(1, 1)
SAMPLED_TREE = sampled_tree(4, 6, 3)


def default_tree(device, batch_size: int = 1, sampling: bool = False, sampled_drafts: bool = False,
                 int8_activations: bool = False) -> TreeConfig:
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
    sampled_drafts : bool
        Whether some request samples and drafts by sampling: the sampled-draft tree
        (``TreeConfig.sampled``) of the same verify rows as the tree above; at batch 1 with
        ``int8_activations``, one sampled draft (``CPU_INT8_SAMPLED_TREE``).
    int8_activations : bool
        Whether the target multiplies with int8 activations (``LlamaModel.activations``; CPU
        only). Its verify rows cost arithmetic from the third on (a 4-row pass of the GGUF
        SmolLM2 about 1.3x a one-row pass, 8 rows 2x), and at T > 0 the deeper sampled tree
        ran at 0.60-0.82x plain decoding where one sampled draft ran at 0.98-1.09x
        (docs/benchmarks.md, "Sampled drafts with int8 activations"). Depends on the weights
        only, never on the machine, so a seed gives the same tokens everywhere.

    Returns
    -------
    TreeConfig

    Raises
    ------
    ValueError
        A device torch does not know, a batch size that is not an int >= 1, or a flag that is not a bool.
    """
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device: expected a torch.device or a device string, got {device!r} ({error})") from None
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    for name, flag in (("sampling", sampling), ("sampled_drafts", sampled_drafts),
                       ("int8_activations", int8_activations)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected a bool, got {flag!r}")
    if device_type == "cpu":
        if batch_size <= 1:
            if sampled_drafts:
                return CPU_INT8_SAMPLED_TREE if int8_activations else CPU_SAMPLED_TREE
            return CPU_TREE
        if sampled_drafts:
            return CPU_BATCH_ALL_SAMPLED_TREE if sampling else CPU_BATCH_SAMPLED_TREE
        return CPU_BATCH_SAMPLING_TREE if sampling else CPU_BATCH_TREE
    return SAMPLED_TREE if sampled_drafts else TreeConfig()
