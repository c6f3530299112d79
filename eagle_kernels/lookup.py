"""Prompt-lookup chains: drafts copied from the context, grafted onto a verify tree.

Text that repeats itself (code identifiers, a model's own loops) is drafted here even where
the head is wrong. Each step searches the context for its longest recent suffix
(:func:`lookup_search`), takes the tokens that followed it (:func:`chain_tokens`) and hangs them
below the root of the step's verify tree (:func:`graft_chain`). A CPU step may give requests
chains of different lengths (:func:`trimmed_chain_lengths`, :func:`pad_chains`). Every function
here but :func:`lookup_search_host` and :func:`graft_chain_host` (the CPU steps' search and graft)
has static shapes and reads no tensor value on the host. See docs/decoding.md.
"""

from __future__ import annotations

import torch

from ._checks import mask_words
from ._types import Tree
from .trees import TreeConfig


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


def lookup_search_host(history: torch.Tensor, length: torch.Tensor, ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lookup_search` for tensors in host memory, by reading them: the same results, for
    steps whose policy may read values (CPU steps; a CUDA graph could not capture this).

    The static-shape search runs a dozen tensor ops over ``[B, ngram, C]`` whatever the context
    holds: 130-340 us a step at C = 256-4,096 on one core of a 2-core VM, a few percent of a
    decoding step of SmolLM2-135M. Here each request's suffix is searched for as bytes
    (``bytes.rfind``, newest occurrence first), longest suffix first, which stops at the first hit.

    Shapes: as :func:`lookup_search`.
    """
    B, C = history.shape
    longest = max(1, min(ngram, C - 1))
    rows = history.detach().cpu().numpy()
    lengths = length.tolist()
    starts, matches = [-1] * B, [0] * B
    width = rows.itemsize
    for b in range(B):
        last = min(lengths[b], C) - 1  # index of the context's last token
        if last < 1:  # an occurrence must end before the last token
            continue
        row = rows[b]
        earlier = row[:last].tobytes()  # tokens [0, last): every occurrence ends before the last token
        for n in range(min(longest, last + 1), 0, -1):
            suffix = row[last - n + 1:last + 1].tobytes()
            end = len(earlier)
            pos = earlier.rfind(suffix, 0, end)
            while pos >= 0 and pos % width:  # a match across token boundaries: look further back
                end = pos + len(suffix) - 1
                pos = earlier.rfind(suffix, 0, end)
            if pos >= 0:
                starts[b], matches[b] = pos // width + n, n
                break
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=history.device)  # noqa: E731
    return as_tensor(starts), as_tensor(matches)


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


def trimmed_chain_lengths(tree: TreeConfig, matched: torch.Tensor) -> torch.Tensor:
    """Chain tokens worth verifying after a suffix match of ``matched`` tokens, per request (the
    ``lookup_trim`` rule of :class:`~eagle_kernels.trees.TreeConfig`): none when nothing
    matched, ``lookup // 4`` after a 1-token match, ``lookup // 2`` for
    ``1 < matched < lookup_ngram``, all ``lookup`` after a full match (each at least 1). Why
    it pays: docs/decoding.md.

    Shapes
    ------
    matched int64 [B] -> int64 [B].
    """
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


def graft_chain_host(tree: Tree, chain: torch.Tensor) -> Tree:
    """:func:`graft_chain` for tensors in host memory, by reading them: the same tree, for steps
    whose policy may read values (CPU steps). The static-shape graft compares every pair of
    nodes in some thirty tensor ops (about 0.4 ms a step on one core of a 2-core VM, for a tree of
    a few nodes); here each request walks its chain down the tree (the first child, in node order,
    that carries the chain's next token) and builds the chain's mask rows from its anchor's.

    Shapes: as :func:`graft_chain`.
    """
    B, N = tree.tokens.shape
    L = chain.shape[1]
    total, words = N + L, mask_words(N + L)
    tokens, parents, chains, masks = tree.tokens.tolist(), tree.parents.tolist(), chain.tolist(), tree.mask.tolist()
    old_words = tree.mask.shape[2]
    chain_parents, chain_rows = [], []
    for b in range(B):
        first_child: dict[tuple[int, int], int] = {}
        for node in range(1, N):
            first_child.setdefault((parents[b][node], tokens[b][node]), node)
        node, own_parents, anchors = 0, [], []  # node: the tree node spelling chain[:i], or -1
        for i, token in enumerate(chains[b]):
            own_parents.append(node if node >= 0 else N + i - 1)
            anchors.append(node)
            node = first_child.get((node, token), -1) if node >= 0 else -1
        chain_parents.append(own_parents)
        rows, above = [], 0
        for i, anchor in enumerate(anchors):  # a chain node's ancestors: its tree anchor's, then the chain's own
            if anchor >= 0:
                above = _row_bits(masks[b][anchor])
            above |= 1 << (N + i)
            rows.append(_bits_row(above, words))
        chain_rows.append(rows)
    mask = torch.zeros(B, total, words, dtype=torch.int64, device=chain.device)
    mask[:, :N, :old_words] = tree.mask
    if B and L:
        mask[:, N:] = torch.tensor(chain_rows, dtype=torch.int64, device=chain.device)
    chain_depths = torch.arange(1, L + 1, dtype=torch.int32, device=chain.device).expand(B, L)
    return Tree(torch.cat([tree.tokens, chain], 1),
                torch.cat([tree.parents, torch.tensor(chain_parents, dtype=torch.int32, device=chain.device)], 1),
                torch.cat([tree.depths, chain_depths], 1), mask)


def _row_bits(row: list[int]) -> int:
    """A mask row's int64 words as one non-negative int (bit j % 64 of word j // 64 is bit j)."""
    return sum((word & 0xFFFF_FFFF_FFFF_FFFF) << (64 * w) for w, word in enumerate(row))


def _bits_row(bits: int, words: int) -> list[int]:
    """:func:`_row_bits` back into ``words`` int64 words (bit 63 as the sign bit)."""
    row = [(bits >> (64 * w)) & 0xFFFF_FFFF_FFFF_FFFF for w in range(words)]
    return [word - (1 << 64) if word >> 63 else word for word in row]


def _pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """bool [..., n] -> int64 [..., ceil(n / 64)]: bit j % 64 of word j // 64 set for flags[j]
    (a sum of distinct powers of two is their OR; bit 63 wraps to the sign bit)."""
    n = flags.shape[-1]
    padded = torch.nn.functional.pad(flags, (0, mask_words(n) * 64 - n)).to(torch.int64)
    shifts = torch.arange(64, device=flags.device)
    return (padded.view(*flags.shape[:-1], -1, 64) << shifts).sum(-1)

