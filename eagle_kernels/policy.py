"""Step policies: every host read and every data-dependent shape of a speculative step.

The step core of :class:`~eagle_kernels.decoder.SpeculativeDecoder` is the same on every
device; what differs is whether a step may look at values it computed to size its work.

- :class:`StaticPolicy` (GPUs): fixed shapes and no host reads, so a step can be captured once
  as a CUDA graph and replayed; the lookup chain always has its full length and every request
  verifies every row. ``TreeConfig.lookup_trim`` and ``lookup_alone`` have no effect.
- :class:`FittedPolicy` (CPUs): a host read is free there (tensors live in host memory) and each
  verify row costs arithmetic, so the step fits its work to the values: lookup chains trimmed
  by their match length, chain-alone steps after full matches, per-request row counts in a
  batch, and a head commit only as wide as the longest accepted path. Adaptive (the CPU
  default, :func:`policy_for`), it also picks each greedy step's draft among smaller shapes of the
  tree (:func:`draft_ladder`) by what each shape recently emitted per second of step
  (:class:`DraftStats`), so a step never costs more than the tokens it is likely to bring.

Both give the same tokens (see docs/decoding.md, "Policies").
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .lookup import trimmed_chain_lengths
from .trees import TreeConfig


class ChainPlan(NamedTuple):
    """One step's lookup chain: ``length`` chain nodes are grafted onto the verify tree (0:
    none); ``own`` int64 [B] is each request's own chain length where some are shorter than
    ``length`` (their extra chain nodes are padding, see :func:`eagle_kernels.lookup.pad_chains`),
    else None."""

    length: int
    own: torch.Tensor | None = None


NO_MATCH, PARTIAL_MATCH, FULL_MATCH = 0, 1, 2  # lookup contexts of a step (see StepPolicy.draft_stats)


def match_context(tree: TreeConfig, matched: torch.Tensor | None) -> int:
    """A step's lookup context from each request's suffix match length ``matched`` int64 [B]
    (None: no chain): ``FULL_MATCH`` where every request matched ``tree.lookup_ngram`` tokens,
    ``NO_MATCH`` where none matched any (or there is no chain), else ``PARTIAL_MATCH``."""
    if matched is None:
        return NO_MATCH
    lengths = matched.tolist()  # one read, where four tensor ops took about 30 us of a CPU step
    if all(length >= tree.lookup_ngram for length in lengths):
        return FULL_MATCH
    return PARTIAL_MATCH if any(length > 0 for length in lengths) else NO_MATCH


def draft_ladder(tree: TreeConfig, match: int = PARTIAL_MATCH, head: bool = True) -> tuple[TreeConfig | None, ...]:
    """The draft shapes an adaptive policy chooses among for a decoder's ``tree``, cheapest
    first: None (no draft: the target verifies the root alone, one row, and the head commits
    the token), one head draft without a chain (``depth = top_k = 1``), that draft with
    ``tree``'s lookup chain (where it has one; not in the ``match`` context ``NO_MATCH`` of a
    ``lookup_trim`` tree, where the chain is trimmed away, nor ``FULL_MATCH`` of a
    ``lookup_alone`` tree, where it would verify the same chain alone as ``tree``), and ``tree`` itself;
    duplicates dropped; without a ``head``, None and ``tree`` (its chain). Each fits every
    buffer sized for ``tree`` (depth, nodes, chain and draft slots at most ``tree``'s), and a
    sampled tree's shapes are sampled trees."""
    if not head:
        return None, tree
    one = dataclasses.replace(tree, depth=1, top_k=1, num_nodes=2, lookup=0, lookup_trim=False,
                              lookup_alone=False, frontier=0)
    chained = dataclasses.replace(one, lookup=tree.lookup, lookup_ngram=tree.lookup_ngram,
                                  lookup_trim=tree.lookup_trim, lookup_alone=tree.lookup_alone)
    same = (match == NO_MATCH and tree.lookup_trim) or (match == FULL_MATCH and tree.lookup_alone)
    shapes = [None, one] + ([] if same else [chained]) + [tree]
    return tuple(dict.fromkeys(shapes))


class DraftStats:
    """What an adaptive fitted policy learned about one decoder's draft shapes (one per batch
    size, tree and lookup-match context, kept across calls): per shape of ``shapes``
    (:func:`draft_ladder`) the median wall time of its last ``TIME_WINDOW`` steps (robust to
    the single slow steps of a busy machine) and an exponential moving average of the tokens a
    step of it emitted (all requests), weight ``alpha`` on the newest step, more after a gap
    (``1 - (1 - alpha) ** (gap / 4)`` for a shape last run ``gap`` steps before), so a probe's
    step counts for what changed since, and ``1 / n`` on a shape's ``n``-th step while that is
    more (its first steps count alike). :meth:`choose` takes the shape of the most tokens per
    second; every ``probe_every``-th step it runs instead the one of its neighbours in
    ``shapes`` (the next cheaper and the next larger shape) measured least recently, once it has
    not run for ``probe_every`` steps times the ratio of the best rate to its own (at most 4), so
    a shape whose acceptance or cost changed (code after chat, a busier machine) is found again
    and a far worse one costs few probes. A shape
    run fewer than ``first_runs`` times runs first, the largest first (one step's tokens vary
    much: one unlucky step would hide a shape until its next probe).

    Every choice is made from finished steps only, so verification stays exact: greedy tokens
    are plain decoding's whatever the shapes, and sampled tokens keep their distribution."""

    TIME_WINDOW = 5  # steps of a shape whose median is its time

    def __init__(self, shapes, alpha: float = 0.15, probe_every: int = 8, first_runs: int = 2):
        if not shapes:
            raise ValueError("shapes: expected at least one draft shape, got none")
        if not 0.0 < alpha <= 1.0 or probe_every < 2:
            raise ValueError(f"alpha: expected (0, 1], probe_every >= 2; got {alpha}, {probe_every}")
        self.shapes = tuple(shapes)
        self.alpha, self.probe_every, self.first_runs = alpha, probe_every, first_runs
        n = len(self.shapes)
        self.tokens: list[float | None] = [None] * n  # EMA of tokens per step
        self.seconds: list[float | None] = [None] * n  # median of the last TIME_WINDOW steps' seconds
        self._times: list[list[float]] = [[] for _ in range(n)]
        self.last_run = [-1] * n  # step count at each shape's latest step
        self.runs = [0] * n
        self.steps = 0

    def rate(self, index: int) -> float | None:
        """Tokens per second of shape ``index`` (None: not measured yet)."""
        tokens, seconds = self.tokens[index], self.seconds[index]
        return None if tokens is None else tokens / max(seconds, 1e-9)

    def best(self) -> int:
        """The measured shape of the highest rate (ties: the cheaper shape)."""
        measured = [i for i in range(len(self.shapes)) if self.tokens[i] is not None]
        return max(measured, key=lambda i: (self.rate(i), -i)) if measured else len(self.shapes) - 1

    def choose(self) -> int:
        """The index of the next step's shape."""
        unmeasured = [i for i in range(len(self.shapes)) if self.runs[i] < self.first_runs]
        if unmeasured:
            return unmeasured[-1]
        best = self.best()
        if len(self.shapes) > 1 and self.steps % self.probe_every == self.probe_every - 1:
            # The neighbours of the best shape, the one measured least recently: the best rarely
            # moves further than one, and a probe of a distant (far worse) shape costs the most.
            # A neighbour rated far below the best waits longer (its probe costs more): up to 4
            # intervals, at its rate's ratio to the best's.
            neighbours = [i for i in (best - 1, best + 1) if 0 <= i < len(self.shapes)]
            probe = min(neighbours, key=lambda i: self.last_run[i])
            behind = min(4.0, self.rate(best) / max(self.rate(probe), 1e-9))
            if self.steps - self.last_run[probe] >= self.probe_every * behind:
                return probe
        return best

    def record(self, index: int, tokens: float, seconds: float) -> None:
        """A finished step of shape ``index`` that emitted ``tokens`` in ``seconds``."""
        # A shape not run for a while (a probe) trusts its old averages less: one step's weight grows with the
        # gap, as if the steps in between had decayed them.
        # Its first steps are averaged alike (a running mean until 1 / alpha of them), so that one
        # unlucky first step does not hide a shape for long.
        a = max(1.0 - (1.0 - self.alpha) ** max(1.0, (self.steps - self.last_run[index]) / 4),
                1.0 / (self.runs[index] + 1))
        old_tokens = self.tokens[index]
        self.tokens[index] = tokens if old_tokens is None else (1 - a) * old_tokens + a * tokens
        # Time: the median of the shape's last steps, so that a step slowed by another process (a
        # busy machine stalls single steps by several times) does not price a shape out.
        times = self._times[index]
        times.append(seconds)
        del times[:-self.TIME_WINDOW]
        self.seconds[index] = sorted(times)[len(times) // 2]
        self.last_run[index] = self.steps
        self.runs[index] += 1
        self.steps += 1


class StepPolicy:
    """What a device lets a step decide from its own values. The step core asks its policy at
    each decision; a policy answers from the arguments only (it keeps no state: what an
    adaptive policy learns lives in the :class:`DraftStats` it makes, which the decoder keeps)."""

    capturable: bool  # a step may be captured as a CUDA graph (no host read, fixed shapes)
    sync_every: int  # default steps between host reads of the done flags
    adaptive_sampling: bool = False  # calls that sample may adapt their draft shape too (see FittedPolicy)
    defer_head: bool = False  # a no-draft step leaves the head's commit to the next drafting step (see FittedPolicy)
    coupled_sampling: bool = False  # sampled tokens by coupled sampling, drafts sharing its noise (see FittedPolicy)

    def draft_stats(self, tree: TreeConfig, head: bool = True) -> dict[int, DraftStats] | None:
        """The statistics a decoder keeps to choose the draft shape of greedy steps with
        ``tree`` (and a draft ``head``, or the lookup chain alone), one :class:`DraftStats` per
        lookup context of a step (:func:`match_context`: how far the requests' suffixes
        matched, which decides how likely the chain is to be accepted; ``NO_MATCH`` only,
        without a chain). None: every step drafts ``tree``."""
        return None

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
    """Fixed shapes, no host reads: the policy of GPU steps (one CUDA graph per shape, replayed across calls).
    ``coupled_sampling`` as in :class:`FittedPolicy` (without adaptive shapes): every drafting step then
    draws the drafts' noise, whatever the requests' temperatures (no host read decides)."""

    capturable = True
    sync_every = 4  # each read waits for the device: up to 3 steps past the end are dropped

    def __init__(self, coupled_sampling: bool = False):
        self.coupled_sampling = coupled_sampling

    def chain_alone(self, tree: TreeConfig, matched: torch.Tensor) -> bool:
        return False

    def chain_plan(self, tree: TreeConfig, matched: torch.Tensor, nodes: int) -> ChainPlan:
        return ChainPlan(tree.lookup)

    def row_counts(self, total: int, done: torch.Tensor, chains: ChainPlan) -> torch.Tensor | None:
        return None

    def commit_width(self, accept_len: torch.Tensor) -> int | None:
        return None


class FittedPolicy(StepPolicy):
    """Shapes fitted to the step's values, read on the host: the policy of CPU steps.

    ``adaptive``: each step of a call whose requests are all greedy drafts the shape of
    :func:`draft_ladder` that :class:`DraftStats` rates best (measured tokens per second of
    step: the choice follows the weights, the thread count and the machine's load). Calls
    that sample keep the tree's shape at every step, so a seed gives the same tokens on every
    run (a shape chosen by wall time would make the draws, not their distribution, vary);
    ``adaptive_sampling`` (with ``adaptive``) lets them adapt too, for speed over repeatable
    draws: the output distribution stays exact (every shape is verified by the same rule and
    chosen from finished steps), and where no draft pays (fast weights at T = 1) the ladder's
    cheapest shape is a plain step.

    ``defer_head`` (default on): a step that drafts nothing (the ladder's cheapest shape) does not run
    the head's commit pass; its (token, feature) pair waits, and the next step that drafts commits all
    waiting pairs in one head pass first (at most ``max_depth + 1`` wait), so a no-draft step costs a
    plain step. The head's outputs are those of the per-step commits (the same rows through the same
    layer).

    ``coupled_sampling``: requests at a temperature > 0 sample by coupled sampling (docs/decoding.md):
    each token is the exponential race of the target's filtered distribution under noise drawn per
    (seed, position, token) (``verify``'s ``positions``), so a seed's tokens are a function of the
    prompt alone, whatever the drafts, shapes or batch; the head drafts the most likely tokens of its
    distribution perturbed by the same noise (``coupled_noise``), as a greedy call drafts, and such calls
    adapt their shape as greedy ones do (``adaptive``). Exact: each token has the target's filtered
    distribution; not the draws of the default rule for the same seed."""

    capturable = False
    sync_every = 1  # the done flags are host memory: a batch stops at the step that finishes it

    def __init__(self, adaptive: bool = False, probe_every: int = 8, adaptive_sampling: bool = False,
                 defer_head: bool = True, coupled_sampling: bool = False):
        self.adaptive, self.probe_every, self.adaptive_sampling = adaptive, probe_every, adaptive_sampling
        self.defer_head, self.coupled_sampling = defer_head, coupled_sampling

    def draft_stats(self, tree: TreeConfig, head: bool = True) -> dict[int, DraftStats] | None:
        if not self.adaptive:
            return None
        contexts = (NO_MATCH, PARTIAL_MATCH, FULL_MATCH) if tree.lookup else (NO_MATCH,)
        return {match: DraftStats(draft_ladder(tree, match, head), probe_every=self.probe_every)
                for match in contexts}

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
    """The step policy of a device: fitted shapes on a CPU (adaptive draft shapes), static shapes elsewhere."""
    return FittedPolicy(adaptive=True) if torch.device(device).type == "cpu" else StaticPolicy()
