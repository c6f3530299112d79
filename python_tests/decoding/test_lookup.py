"""eagle_kernels.lookup: the prompt-lookup search against naive searches, the trimming rule,
chain grafting onto random and EAGLE-2 trees, and padded chain nodes that verify never accepts.
The chains inside the decoding loop: test_decoder.py."""

import pytest
import torch

from eagle_kernels import reference
from eagle_kernels._types import Tree
from eagle_kernels.decoder import TreeConfig
from eagle_kernels.lookup import (
    graft_chain,
    graft_chain_host,
    lookup_chain,
    lookup_search,
    lookup_search_host,
    pad_chains,
    trimmed_chain_lengths,
)
from helpers import mask_of, simulate_history


def lookup_naive(context, ngram, chain):
    """What followed the latest earlier occurrence of the longest suffix of at most ``ngram``
    tokens; [] when even the last token never occurred before."""
    for n in range(ngram, 0, -1):
        if len(context) <= n:
            continue
        for j in range(len(context) - n - 1, -1, -1):
            if context[j:j + n] == context[-n:]:
                return context[j + n: j + n + chain]
    return []


@pytest.mark.parametrize("ngram,chain", [(1, 3), (3, 4), (2, 1)])
def test_lookup_chain_matches_naive_search(ngram, chain):
    g = torch.Generator().manual_seed(ngram * 10 + chain)
    B, C = 64, 24
    history = torch.randint(0, 4, (B, C), generator=g)  # 4 symbols: repeats of every length
    length = torch.randint(1, C + 1, (B,), generator=g)
    length[:3] = torch.tensor([1, 2, C])
    history[3, :5] = torch.tensor([0, 1, 2, 3, 3])  # no earlier occurrence of a suffix
    length[3] = 4
    got = lookup_chain(history, length, ngram, chain)
    assert got.shape == (B, chain) and got.dtype == torch.int64
    for b in range(B):
        context = history[b, : length[b]].tolist()
        expected = lookup_naive(context, ngram, chain)
        assert got[b, : len(expected)].tolist() == expected, (b, context)
        assert all(t in context for t in got[b].tolist())  # filler comes from the context


def search_naive(context, ngram):
    """(start, n): the longest suffix of at most ``ngram`` tokens with an earlier occurrence
    followed by a token, and where that token sits in its latest occurrence; (-1, 0) if none."""
    for n in range(ngram, 0, -1):
        for j in range(len(context) - n - 1, -1, -1):
            if len(context) > n and context[j:j + n] == context[-n:]:
                return j + n, n
    return -1, 0


@pytest.mark.parametrize("search", [lookup_search, lookup_search_host], ids=["static", "host"])
@pytest.mark.parametrize("ngram", [1, 2, 4, 9])
def test_lookup_search_matches_naive_search(ngram, search):
    g = torch.Generator().manual_seed(ngram)
    B, C = 96, 30
    history = torch.randint(0, 3, (B, C), generator=g)  # 3 symbols: matches of every length
    length = torch.randint(1, C + 1, (B,), generator=g)
    length[:3] = torch.tensor([1, 2, C])
    history[3, :8] = torch.tensor([2, 0, 1, 2, 0, 1, 2, 0])  # a period-3 context: the longest match
    length[3] = 8
    start, matched = search(history, length, ngram)
    assert start.dtype == matched.dtype == torch.int64 and start.shape == matched.shape == (B,)
    for b in range(B):
        context = history[b, : length[b]].tolist()
        assert (int(start[b]), int(matched[b])) == search_naive(context, ngram), (b, context)
    assert int(matched[3]) == min(ngram, 5)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_host_search_equals_the_static_search(dtype):
    """The host search gives the static search's results, where token ids have equal bytes across a
    token boundary (ids 0 and 256: a byte match at a misaligned offset must not count), at every
    context length up to the full width, and for a history wider than ngram + 1 only."""
    g = torch.Generator().manual_seed(7)
    for B, C, symbols, ngram in ((64, 40, (0, 256, 1), 4), (32, 7, (0, 1), 8), (16, 300, (5, 9, 5 << 32), 3)):
        table = torch.tensor(symbols, dtype=torch.int64)
        history = table[torch.randint(0, len(symbols), (B, C), generator=g)]
        if dtype == torch.int32:
            history = history.clamp(max=2**31 - 1)
        history = history.to(dtype)
        length = torch.randint(0, C + 1, (B,), generator=g)
        want = lookup_search(history.long(), length, ngram)
        got = lookup_search_host(history, length, ngram)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (B, C, ngram)


def test_trimmed_chain_length_follows_the_match():
    tree = TreeConfig(3, 2, 4, lookup=8, lookup_ngram=4, lookup_trim=True)
    assert trimmed_chain_lengths(tree, torch.arange(6)).tolist() == [0, 2, 4, 4, 8, 8]
    short = TreeConfig(3, 2, 4, lookup=1, lookup_ngram=2, lookup_trim=True)
    assert trimmed_chain_lengths(short, torch.arange(4)).tolist() == [0, 1, 1, 1]


@pytest.mark.parametrize("first_chain_node", [1, 4, 9])
def test_padded_chain_nodes_are_never_accepted(first_chain_node):
    """pad_chains: verify gives a padded tree the results of the same tree cut to each
    request's own chain (greedy and sampling, same random stream), whatever the padding rows'
    logits are."""

    B, chain_len, V = 32, 6, 3
    g = torch.Generator().manual_seed(first_chain_node)
    tree = Tree(*[torch.zeros(B, 1, dtype=t) for t in (torch.int64, torch.int32, torch.int32)],
                torch.ones(B, 1, 1, dtype=torch.int64))
    tree = tree._replace(parents=tree.parents - 1)
    if first_chain_node > 1:  # a random tree below the root, over few tokens: frequent matches
        parents = [[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, first_chain_node)]
                   for _ in range(B)]
        depths = torch.zeros(B, first_chain_node, dtype=torch.int32)
        for b in range(B):
            for i in range(1, first_chain_node):
                depths[b, i] = depths[b, parents[b][i]] + 1
        tree = Tree(torch.randint(0, V, (B, first_chain_node), generator=g), torch.tensor(parents, dtype=torch.int32),
                    depths, torch.tensor([mask_of(p) for p in parents], dtype=torch.int64).view(B, first_chain_node, 1))
    grafted = graft_chain(tree, torch.randint(0, V, (B, chain_len), generator=g))
    own = torch.randint(1 if first_chain_node == 1 else 0, chain_len + 1, (B,), generator=g)
    padded = pad_chains(grafted, first_chain_node, own)
    logits = torch.randn(B, first_chain_node + chain_len, V, generator=g) * 2
    for b in range(B):
        rows = first_chain_node + int(own[b])
        assert padded.mask[b].tolist() == mask_of(padded.parents[b].tolist())
        assert torch.equal(padded.tokens[b, :rows], grafted.tokens[b, :rows])
    for temperature in (0.0, 1.0):
        sampling = dict(temperature=torch.full((B,), temperature), seed=torch.arange(B),
                        offset=torch.zeros(B, dtype=torch.long))
        got = reference.verify(padded.tokens, padded.parents, logits, max_depth=chain_len, **sampling)
        for b in range(B):
            rows = first_chain_node + int(own[b])
            one = {k: v[b:b + 1] for k, v in sampling.items()}
            want = reference.verify(grafted.tokens[b:b + 1, :rows], grafted.parents[b:b + 1, :rows],
                                    logits[b:b + 1, :rows], max_depth=chain_len, **one)
            assert int(got.accept_len[b]) == int(want.accept_len[0]), (temperature, b)
            assert torch.equal(got.out_tokens[b], want.out_tokens[0]), (temperature, b)


def graft_naive(tokens, parents, chain):
    """Parents of the chain nodes by the rule of graft_chain, one request, plain lists."""
    N = len(tokens)
    matched, chain_parents = 0, []
    for i, token in enumerate(chain):
        chain_parents.append(matched if matched is not None else N + i - 1)
        children = [c for c in range(N) if matched is not None and parents[c] == matched and tokens[c] == token]
        matched = children[0] if children else None
    return chain_parents


GRAFTS = pytest.mark.parametrize("graft", [graft_chain, graft_chain_host], ids=["static", "host"])


@GRAFTS
@pytest.mark.parametrize("num_nodes,chain_len", [(4, 3), (8, 5), (62, 4)])
def test_graft_chain_follows_the_tree_then_branches(num_nodes, chain_len, graft):

    B = 16
    tree = reference.build_tree(*simulate_history(B, 5, 4, seed=num_nodes), num_nodes)
    g = torch.Generator().manual_seed(chain_len)
    chain = torch.randint(0, 1000, (B, chain_len), generator=g)
    for b in range(B):  # request b copies the tree's deepest path for its first b % 4 tokens
        node, path = num_nodes - 1, []
        while node > 0:
            path.append(int(tree.tokens[b, node]))
            node = int(tree.parents[b, node])
        for i, token in enumerate(reversed(path[-(b % 4):] if b % 4 else [])):
            chain[b, i] = token
    grafted = graft(tree, chain)
    total = num_nodes + chain_len
    assert grafted.tokens.shape == (B, total) and grafted.mask.shape == (B, total, (total + 63) // 64)
    for b in range(B):
        parents = tree.parents[b].tolist() + graft_naive(tree.tokens[b].tolist(), tree.parents[b].tolist(),
                                                         chain[b].tolist())
        assert grafted.parents[b].tolist() == parents
        assert grafted.tokens[b].tolist() == tree.tokens[b].tolist() + chain[b].tolist()
        depths = grafted.depths[b].tolist()
        assert all(depths[i] == depths[parents[i]] + 1 for i in range(1, total))
        assert grafted.mask[b].tolist() == mask_of(parents)
    assert (grafted.parents[:, num_nodes] == 0).all()
    assert (grafted.parents[1:4, num_nodes + 1] < num_nodes).all()  # continued the copied branch


@GRAFTS
@pytest.mark.parametrize("num_nodes,chain_len", [(1, 1), (5, 8), (30, 6), (66, 9)])
def test_graft_chain_on_random_trees_with_repeated_tokens(num_nodes, chain_len, graft):
    """Random tree shapes over 3 token values: sibling repeats (the chain follows the first of
    them), deep matches, and masks that cross a 64-bit word."""

    B = 24
    g = torch.Generator().manual_seed(num_nodes * 10 + chain_len)
    parents = [[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, num_nodes)] for _ in range(B)]
    depths = torch.zeros(B, num_nodes, dtype=torch.int32)
    for b in range(B):
        for i in range(1, num_nodes):
            depths[b, i] = depths[b, parents[b][i]] + 1
    words = (num_nodes + 63) // 64
    tree = Tree(torch.randint(0, 3, (B, num_nodes), generator=g), torch.tensor(parents, dtype=torch.int32), depths,
                torch.tensor([mask_of(p) for p in parents], dtype=torch.int64).view(B, num_nodes, words))
    chain = torch.randint(0, 3, (B, chain_len), generator=g)
    grafted = graft(tree, chain)
    want_tree = graft_chain(tree, chain)  # the host graft builds the static graft's tensors
    assert all(torch.equal(a, w) and a.dtype == w.dtype for a, w in zip(grafted, want_tree))
    for b in range(B):
        want = parents[b] + graft_naive(tree.tokens[b].tolist(), parents[b], chain[b].tolist())
        assert grafted.parents[b].tolist() == want
        assert grafted.mask[b].tolist() == mask_of(want)
        assert grafted.depths[b].tolist() == [0] + [int(grafted.depths[b, p]) + 1 for p in want[1:]]
