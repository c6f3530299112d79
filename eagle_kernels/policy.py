"""Step policies: every host read and every data-dependent shape of a speculative step.

The step core of :class:`~eagle_kernels.decoder.SpeculativeDecoder` is the same on every
device; what differs is whether a step may look at values it computed to size its work.

- :class:`StaticPolicy` (GPUs): fixed shapes and no host reads, so a step can be captured once
  as a CUDA graph and replayed; the lookup chain always has its full length and every request
  verifies every row. ``TreeConfig.lookup_trim`` and ``lookup_alone`` have no effect.
- :class:`FittedPolicy` (CPUs): a host read is free there (tensors live in host memory) and each
  verify row costs arithmetic, so the step fits its work to the values: lookup chains trimmed
  by their match length, chain-alone steps after full matches, per-request row counts in a
  batch, and a head commit only as wide as the longest accepted path.

Both give the same tokens (see docs/decoding.md, "Policies").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from .lookup import trimmed_chain_lengths

if TYPE_CHECKING:
    from .decoder import TreeConfig


class ChainPlan(NamedTuple):
    """One step's lookup chain: ``length`` chain nodes are grafted onto the verify tree (0:
    none); ``own`` int64 [B] is each request's own chain length where some are shorter than
    ``length`` (their extra chain nodes are padding, see :func:`eagle_kernels.lookup.pad_chains`),
    else None."""

    length: int
    own: torch.Tensor | None = None


class StepPolicy:
    """What a device lets a step decide from its own values. The step core asks its policy at
    each decision; a policy answers from the arguments only (it keeps no state)."""

    capturable: bool  # a step may be captured as a CUDA graph (no host read, fixed shapes)
    sync_every: int  # default steps between host reads of the done flags

    def chain_alone(self, tree: TreeConfig, matched: torch.Tensor) -> bool:
        """Whether this step verifies the root and the lookup chain without the head's tree,
        given each request's suffix match length ``matched`` int64 [B]."""
        raise NotImplementedError

    def chain_plan(self, tree: TreeConfig, matched: torch.Tensor, nodes: int) -> ChainPlan:
        """The lookup chain grafted below this step's verify tree of ``nodes`` nodes."""
        raise NotImplementedError

    def row_counts(self, total: int, done: torch.Tensor, chains: ChainPlan) -> torch.Tensor | None:
        """Verify rows the target computes per request (int64 [B]) out of the tree's
        ``total``, or None for all of them; ``done`` bool [B] marks finished requests."""
        raise NotImplementedError

    def commit_width(self, accept_len: torch.Tensor) -> int | None:
        """Accepted-path slots the head commits, given ``accept_len`` int32 [B] (None: all
        ``max_depth + 1``)."""
        raise NotImplementedError


class StaticPolicy(StepPolicy):
    """Fixed shapes, no host reads: the policy of GPU steps (one CUDA graph per shape, replayed across calls)."""

    capturable = True
    sync_every = 4  # each read waits for the device: up to 3 steps past the end are dropped

    def chain_alone(self, tree: TreeConfig, matched: torch.Tensor) -> bool:
        return False

    def chain_plan(self, tree: TreeConfig, matched: torch.Tensor, nodes: int) -> ChainPlan:
        return ChainPlan(tree.lookup)

    def row_counts(self, total: int, done: torch.Tensor, chains: ChainPlan) -> torch.Tensor | None:
        return None

    def commit_width(self, accept_len: torch.Tensor) -> int | None:
        return None


class FittedPolicy(StepPolicy):
    """Shapes fitted to the step's values, read on the host: the policy of CPU steps."""

    capturable = False
    sync_every = 1  # the done flags are host memory: a batch stops at the step that finishes it

    def chain_alone(self, tree: TreeConfig, matched: torch.Tensor) -> bool:
        # After a full-length match the chain is usually accepted and the tree rarely adds to
        # it, while the tree's rows and the head's passes cost about a fifth of a step.
        return tree.lookup_alone and bool((matched >= tree.lookup_ngram).all())

    def chain_plan(self, tree: TreeConfig, matched: torch.Tensor, nodes: int) -> ChainPlan:
        if not tree.lookup_trim:
            return ChainPlan(tree.lookup)
        own = trimmed_chain_lengths(tree, matched)
        length = int(own.max())
        if length and nodes == 1:
            own = own.clamp(min=1)  # node 1 is the chain's first: a real row (see pad_chains)
        return ChainPlan(length, own if length and bool((own < length).any()) else None)

    def row_counts(self, total: int, done: torch.Tensor, chains: ChainPlan) -> torch.Tensor | None:
        # A batch computes each request's own rows only: its tree and own chain, and just the
        # root for a finished request (whose results are dropped).
        if done.shape[0] == 1:
            return None
        counts = torch.full(done.shape, total, dtype=torch.int64, device=done.device)
        if chains.own is not None:
            counts = counts - (chains.length - chains.own)
        counts = torch.where(done, 1, counts)
        return counts if bool((counts < total).any()) else None

    def commit_width(self, accept_len: torch.Tensor) -> int | None:
        # The batch's longest accepted path: slots past a request's own end are overwritten by
        # its next commit, as in the full width.
        return int(accept_len.max()) + 1


def policy_for(device: torch.device | str) -> StepPolicy:
    """The step policy of a device: fitted shapes on a CPU, static shapes elsewhere."""
    return FittedPolicy() if torch.device(device).type == "cpu" else StaticPolicy()
