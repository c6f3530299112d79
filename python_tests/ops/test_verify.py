"""verify (contract §4, docs/design.md "Counter-based random stream" and "verify details").

Tiers: golden hand-built trees (greedy, and sampling with near-one-hot logits whose outcome is
certain or predictable from the random stream), invariants on random trees, the random stream
itself, a χ² exactness test of sampling mode driven through repeated draft/verify steps (with
a deliberately wrong verifier to show the test's power), and bad input. Every test body that
exercises the op goes through ``op_impl("verify")``, so it covers every backend; the Triton
interpreter runs a representative subset of the larger grids (``interpreted_subset``).
"""

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from eagle_kernels import reference
from eagle_kernels._types import VerifyOutput
from eagle_kernels.reference.random import ACCEPT_DRAW, BONUS_DRAW
from helpers import assert_same, filtered_probs, philox_py, softmax_np, uniform_py

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
LOW = -1e4  # exp(LOW - 0) underflows to 0 in float32: a "near-one-hot" row is exactly one-hot in p


# ------------------------------------------------------------------------------------ helpers
def run(fn, tokens, parents, logits, max_depth, **sampling):
    """Call ``fn`` with list/array inputs turned into tensors of the contract dtypes."""
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    parents = torch.as_tensor(parents, dtype=torch.int32)
    if tokens.dim() == 1:
        tokens, parents, logits = tokens[None], parents[None], logits[None]
    B = tokens.shape[0]
    kinds = {"temperature": torch.float32, "top_k": torch.int32, "top_p": torch.float32,
             "seed": torch.int64, "offset": torch.int64}
    kwargs = {}
    for name, value in sampling.items():
        if value is None:
            continue
        t = torch.as_tensor(value, dtype=kinds[name])
        kwargs[name] = t.expand(B).contiguous() if t.dim() == 0 else t
    return fn(tokens, parents, logits, max_depth=max_depth, **kwargs)


def spiky_logits(argmaxes, V, dtype=torch.float32, peak=2.0):
    """[N, V] logits whose row ``u`` peaks at ``argmaxes[u]`` (an int, or a tuple of tied ids)
    over a background of 0, .25, .5, .75 (exact in every dtype)."""
    rows = []
    for node, best in enumerate(argmaxes):
        row = 0.25 * ((3 * torch.arange(V) + node) % 4).to(torch.float64)
        for x in best if isinstance(best, tuple) else (best,):
            row[x] = peak
        rows.append(row)
    return torch.stack(rows).to(dtype)


def one_hot_logits(argmaxes, V, dtype=torch.float32):
    """[N, V] logits 0 at ``argmaxes[u]`` and LOW elsewhere: p_u is exactly one-hot."""
    rows = torch.full((len(argmaxes), V), LOW, dtype=torch.float64)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.0
    return rows.to(dtype)


def assert_output(out, accept_nodes, out_tokens, status=0, row=0):
    accept_len = sum(1 for n in accept_nodes if n >= 0) - 1
    assert int(out.accept_len[row]) == accept_len, out
    assert out.accept_nodes[row].tolist() == list(accept_nodes), out
    assert out.out_tokens[row].tolist() == list(out_tokens), out
    assert int(out.status[row]) == status, out


def coin(seed, offset, node, draw):
    return float(reference.uniform(seed, offset, node, draw))


def interpreted_subset(backend, representative):
    """The Triton interpreter runs the kernels program by program in Python (about 20 ms per
    greedy logit row and 0.1-0.2 s per sampling row with top-k / top-p, plus the walk): it runs
    a representative subset of the larger grids below (every shape, dtype and sampling mode
    still appears), while the C++ kernel and the reference run all of it.
    test_verify_backends checks Triton bit for bit against the reference on tricky trees."""
    if backend == "triton" and not representative:
        pytest.skip("Triton interpreter: representative subset only")


# ------------------------------------------------------------------- tier 2: golden greedy
V_GOLD = 8
# EAGLE-2 shaped tree, depth 3, 3 children of the root, then up to 3 per node (BFS order).
EAGLE_PARENTS = [-1, 0, 0, 0, 1, 1, 1, 2, 2, 3, 4, 4, 4, 7, 8, 8]
EAGLE_TOKENS = [0, 4, 2, 7, 1, 3, 5, 6, 1, 2, 0, 3, 6, 4, 5, 3]
#                 nodes: 0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
EAGLE_G_PATH_A = [2, 1, 1, 2, 3, 0, 0, 4, 3, 5, 0, 0, 0, 0, 0, 6]   # 0 -> 2 -> 8 -> 15
EAGLE_G_PATH_B = [7, 1, 1, 2, 3, 0, 0, 4, 3, 5, 0, 0, 0, 0, 0, 6]   # 0 -> 3 -> 9 (leaf)
CHAIN_PARENTS, CHAIN_TOKENS = [-1, 0, 1, 2], [7, 1, 2, 3]

# (id, tokens, parents, per-node argmax, max_depth, expected accept_nodes, expected out_tokens)
GREEDY_GOLDEN = [
    ("chain-all-accepted", CHAIN_TOKENS, CHAIN_PARENTS, [1, 2, 3, 4], 3, [0, 1, 2, 3], [1, 2, 3, 4]),
    ("chain-reject-first", CHAIN_TOKENS, CHAIN_PARENTS, [6, 2, 3, 4], 3, [0, -1, -1, -1], [6, -1, -1, -1]),
    ("chain-reject-middle", CHAIN_TOKENS, CHAIN_PARENTS, [1, 5, 3, 4], 3, [0, 1, -1, -1], [1, 5, -1, -1]),
    ("chain-max-depth-1", CHAIN_TOKENS, CHAIN_PARENTS, [1, 2, 3, 4], 1, [0, 1], [1, 2]),
    ("chain-max-depth-0", CHAIN_TOKENS, CHAIN_PARENTS, [1, 2, 3, 4], 0, [0], [1]),
    ("chain-max-depth-above-tree", [7, 1, 2], [-1, 0, 1], [1, 2, 3], 4, [0, 1, 2, -1, -1], [1, 2, 3, -1, -1]),
    ("root-only", [4], [-1], [6], 2, [0, -1, -1], [6, -1, -1]),
    ("star-match-not-first", [0, 3, 4, 5, 6], [-1, 0, 0, 0, 0], [5, 7, 7, 2, 7], 2, [0, 3, -1], [5, 2, -1]),
    ("depth-1-last-child", [0, 2, 6], [-1, 0, 0], [6, 1, 3], 1, [0, 2], [6, 3]),
    ("depth-1-no-match", [0, 2, 6], [-1, 0, 0], [5, 1, 3], 1, [0, -1], [5, -1]),
    # Two children with token 3: the first (node 1, a leaf) wins although node 2 would go deeper.
    ("duplicate-siblings", [0, 3, 3, 4, 5], [-1, 0, 0, 0, 2], [3, 1, 5, 0, 0], 2, [0, 1, -1], [3, 1, -1]),
    # Ties: root max shared by 5 and 2 (argmax 2 -> node 2), node 2 max shared by 4 and 6.
    ("ties-smaller-id", [0, 5, 2], [-1, 0, 0], [(2, 5), 0, (4, 6)], 1, [0, 2], [2, 4]),
    ("eagle2-depth3-top3", EAGLE_TOKENS, EAGLE_PARENTS, EAGLE_G_PATH_A, 3, [0, 2, 8, 15], [2, 1, 3, 6]),
    ("eagle2-other-branch", EAGLE_TOKENS, EAGLE_PARENTS, EAGLE_G_PATH_B, 3, [0, 3, 9, -1], [7, 2, 5, -1]),
    # max_depth 2 < depth 3: node 8 is a leaf although its child 15 carries g(8) = 3.
    ("eagle2-max-depth-leaf-rule", EAGLE_TOKENS, EAGLE_PARENTS, EAGLE_G_PATH_A, 2, [0, 2, 8], [2, 1, 3]),
]
GREEDY_IDS = [case[0] for case in GREEDY_GOLDEN]
SAMPLING_GOLDEN = [case for case in GREEDY_GOLDEN if "ties" not in case[0]]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", GREEDY_GOLDEN, ids=GREEDY_IDS)
def test_greedy_golden(backend, op_impl, case, dtype):
    # Triton: every case in one dtype, cycling through the four down the list.
    interpreted_subset(backend, dtype == list(DTYPES.values())[GREEDY_GOLDEN.index(case) % 4])
    _, tokens, parents, g, max_depth, nodes, out_tokens = case
    logits = spiky_logits(g, V_GOLD, dtype)
    verify = op_impl("verify")
    assert_output(run(verify, tokens, parents, logits, max_depth), nodes, out_tokens)
    # temperature 0 everywhere is the same as no sampling tensors at all
    out = run(verify, tokens, parents, logits, max_depth, temperature=0.0, top_k=2, top_p=0.5, seed=3, offset=9)
    assert_output(out, nodes, out_tokens)


def test_greedy_golden_batched(op_impl):
    """The EAGLE-2 cases side by side in one batch (same N), each row as when alone."""
    cases = [c for c in GREEDY_GOLDEN if c[0].startswith("eagle2") and c[4] == 3]
    tokens = [c[1] for c in cases]
    parents = [c[2] for c in cases]
    logits = torch.stack([spiky_logits(c[3], V_GOLD) for c in cases])
    out = run(op_impl("verify"), tokens, parents, logits, 3)
    for row, case in enumerate(cases):
        assert_output(out, case[5], case[6], row=row)


# ----------------------------------------------------------------- tier 2: golden sampling
# Per-row filters under which a one-hot p stays one-hot: every row must give the greedy answer.
SAMPLING_ROWS = dict(temperature=[1.0, 0.5, 1.5, 1.0], top_k=[0, 2, 0, 1], top_p=[1.0, 1.0, 0.3, 0.9],
                     seed=[0, -5, 2**40 + 3, 77], offset=[0, 1, 2**33, 12345])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", SAMPLING_GOLDEN, ids=[c[0] for c in SAMPLING_GOLDEN])
def test_sampling_golden_one_hot(backend, op_impl, case, dtype):
    # Triton: every case in one dtype, fp32 and bf16 alternating down the list.
    interpreted_subset(backend, dtype == (torch.float32, torch.bfloat16)[SAMPLING_GOLDEN.index(case) % 2])
    _, tokens, parents, g, max_depth, nodes, out_tokens = case
    B = len(SAMPLING_ROWS["seed"])
    logits = one_hot_logits(g, V_GOLD, dtype).expand(B, -1, -1).contiguous()
    out = run(op_impl("verify"), [tokens] * B, [parents] * B, logits, max_depth, **SAMPLING_ROWS)
    for row in range(B):
        assert_output(out, nodes, out_tokens, row=row)


SEEDS = [0, 1, -1, 7, 2**63 - 1, -2**63, 123456789012, -987654321]
OFFSETS = [0, 1, 2**32, 2**40 + 5, 3, 2**63 - 1, 99, -7]
STREAM_IDS = [f"seed{s}-off{o}" for s, o in zip(SEEDS, OFFSETS)]


def test_bonus_follows_random_stream(op_impl):
    """Root only, uniform p over V = 1024 (each 2^-10 exactly): the bonus is floor(U * 1024)
    with U the stream's (seed, offset, node 0, BONUS_DRAW) coin."""
    V, B = 1024, len(SEEDS)
    out = run(op_impl("verify"), [[0]] * B, [[-1]] * B, torch.zeros(B, 1, V), 0,
              temperature=1.0, seed=SEEDS, offset=OFFSETS)
    for row, (s, o) in enumerate(zip(SEEDS, OFFSETS)):
        assert int(out.out_tokens[row, 0]) == int(coin(s, o, 0, BONUS_DRAW) * V), (s, o)
        assert int(out.accept_len[row]) == 0 and int(out.status[row]) == 0


def test_accept_and_residual_follow_random_stream(op_impl):
    """p_root = (1/2, 1/2) and one child with token 0: accepted iff U(node 1, ACCEPT_DRAW) < 1/2.
    On acceptance the leaf's bonus is 0 iff U(node 1, BONUS_DRAW) < 1/2; on rejection the
    residual is one-hot at token 1, so the bonus is 1."""
    B = len(SEEDS)
    out = run(op_impl("verify"), [[0, 0]] * B, [[-1, 0]] * B, torch.zeros(B, 2, 2), 1,
              temperature=1.0, seed=SEEDS, offset=OFFSETS)
    for row, (s, o) in enumerate(zip(SEEDS, OFFSETS)):
        if coin(s, o, 1, ACCEPT_DRAW) < 0.5:
            assert_output(out, [0, 1], [0, int(coin(s, o, 1, BONUS_DRAW) >= 0.5)], row=row)
        else:
            assert_output(out, [0, -1], [1, -1], row=row)


# (id, root logits, temperature, top_k, top_p, p_root after the filters)
FILTER_CASES = [
    # top-k keeps ties: with k = 2, token 2 (tied with token 1) is kept; token 3 is not.
    ("top-k-keeps-ties", [3.0, 2.0, 2.0, 1.0, 0.0, 0.0], 1.0, 2, 1.0,
     np.r_[softmax_np([3.0, 2.0, 2.0]), 0, 0, 0]),
    # top-p keeps ties: mass strictly above tokens 1 and 2 is 0.4 < 0.5, both kept.
    ("top-p-keeps-ties", np.log([0.4, 0.3, 0.3, 1e-30, 1e-30, 1e-30]), 1.0, 0, 0.5,
     np.array([0.4, 0.3, 0.3, 0, 0, 0])),
    # temperature 0.5 then top-k 1: one-hot at 0 (ties impossible).
    ("temperature-top-k-1", [1.0, 0.9, 0.0, 0.0, 0.0, 0.0], 0.5, 1, 1.0, np.eye(6)[0]),
    # top-p 0.45 on (0.5, 0.25, 0.25): tokens 1, 2 have 0.5 strictly above and are dropped.
    ("top-p-drops", np.log([0.5, 0.25, 0.25, 1e-30, 1e-30, 1e-30]), 1.0, 0, 0.45, np.eye(6)[0]),
]


@pytest.mark.parametrize("case", FILTER_CASES, ids=[c[0] for c in FILTER_CASES])
def test_sampling_filters_follow_random_stream(op_impl, case):
    """Root with one child (token 2) over a one-hot leaf at token 5: the outcome of every seed
    is predicted from the filtered p_root and the stream's coins."""
    _, root, temperature, top_k, top_p, p = case
    B = len(SEEDS)
    logits = torch.cat([torch.tensor(root, dtype=torch.float32)[None], one_hot_logits([5], 6)])
    logits = logits.expand(B, -1, -1).contiguous()
    out = run(op_impl("verify"), [[0, 2]] * B, [[-1, 0]] * B, logits, 1,
              temperature=temperature, top_k=top_k, top_p=top_p, seed=SEEDS, offset=OFFSETS)
    for row, (s, o) in enumerate(zip(SEEDS, OFFSETS)):
        if coin(s, o, 1, ACCEPT_DRAW) < p[2]:
            assert_output(out, [0, 1], [2, 5], row=row)
        else:
            residual = p.copy()
            residual[2] = 0
            cdf = np.cumsum(residual)
            bonus = int(np.argmax(cdf > coin(s, o, 0, BONUS_DRAW) * cdf[-1]))
            assert_output(out, [0, -1], [bonus, -1], row=row)


def test_sampling_residual_after_rejection(op_impl):
    """p_root = (1/2, 1/2) over tokens 3, 4 and children with tokens 3 then 4: whichever way the
    first coin falls, exactly one child is accepted (the residual after rejecting 3 is one-hot)."""
    B = len(SEEDS)
    root = torch.full((8,), LOW)
    root[[3, 4]] = 0.0
    logits = torch.cat([root[None], one_hot_logits([6, 1], 8)]).expand(B, -1, -1).contiguous()
    out = run(op_impl("verify"), [[0, 3, 4]] * B, [[-1, 0, 0]] * B, logits, 2,
              temperature=1.0, seed=SEEDS, offset=OFFSETS)
    for row, (s, o) in enumerate(zip(SEEDS, OFFSETS)):
        if coin(s, o, 1, ACCEPT_DRAW) < 0.5:
            assert_output(out, [0, 1, -1], [3, 6, -1], row=row)
        else:
            assert_output(out, [0, 2, -1], [4, 1, -1], row=row)


def test_mixed_greedy_and_sampling_batch(op_impl):
    """temperature-0 rows follow the argmax of soft logits (which sampling would rarely
    reproduce) while sampling rows of the same batch follow their one-hot p."""
    soft_a = spiky_logits(EAGLE_G_PATH_A, V_GOLD, peak=1.0)
    soft_b = spiky_logits(EAGLE_G_PATH_B, V_GOLD, peak=1.0)
    hard_a = one_hot_logits(EAGLE_G_PATH_A, V_GOLD)
    hard_b = one_hot_logits(EAGLE_G_PATH_B, V_GOLD)
    logits = torch.stack([soft_a, hard_b, soft_b, hard_a])
    out = run(op_impl("verify"), [EAGLE_TOKENS] * 4, [EAGLE_PARENTS] * 4, logits, 3,
              temperature=[0.0, 1.0, 0.0, 0.7], top_k=[3, 0, 1, 4], top_p=[0.5, 1.0, 0.2, 0.9],
              seed=[1, 2, 3, 4], offset=[5, 6, 7, 8])
    path_a, path_b = ([0, 2, 8, 15], [2, 1, 3, 6]), ([0, 3, 9, -1], [7, 2, 5, -1])
    for row, expected in enumerate([path_a, path_b, path_b, path_a]):
        assert_output(out, *expected, row=row)


# ------------------------------------------------------------------------ tier 3: invariants
def random_batch(seed, B, N, V, dtype=torch.float32, greedy_fraction=0.3):
    """Random trees (parents[i] < i), tokens often planted at the parent row's argmax so that
    paths get accepted, logits with some -inf masks, and per-row sampling parameters."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    for i in range(1, N):
        parents[:, i] = torch.randint(0, i, (B,), generator=gen, dtype=torch.int32)
    logits = torch.randn(B, N, V, generator=gen, dtype=torch.float64) * 2.0
    mask = torch.rand(B, N, V, generator=gen) < 0.2
    mask[..., 0] &= ~mask[..., 1:].all(-1)  # never mask a whole row
    logits = logits.masked_fill(mask, float("-inf")).to(dtype)
    tokens = torch.randint(0, V, (B, N), generator=gen)
    planted = torch.rand(B, N, generator=gen) < 0.6
    parent_argmax = torch.gather(logits.float().argmax(-1), 1, parents.clamp(min=0).long())
    tokens = torch.where(planted, parent_argmax, tokens)
    tokens[:, 0] = torch.randint(0, V, (B,), generator=gen)
    greedy = torch.rand(B, generator=gen) < greedy_fraction
    sampling = dict(
        temperature=torch.where(greedy, 0.0, 0.3 + 1.7 * torch.rand(B, generator=gen)).float(),
        top_k=torch.where(torch.rand(B, generator=gen) < 0.5, 0, torch.randint(1, V + 1, (B,), generator=gen)).int(),
        top_p=torch.where(torch.rand(B, generator=gen) < 0.5, 1.0, 0.2 + 0.8 * torch.rand(B, generator=gen)).float(),
        seed=torch.randint(-2**62, 2**62, (B,), generator=gen),
        offset=torch.randint(0, 2**40, (B,), generator=gen),
    )
    return tokens, parents, logits, sampling


def greedy_walk(tokens, parents, logits, max_depth):
    """Independent greedy verify of one request: (accepted nodes, emitted tokens)."""
    path, node = [0], 0
    while True:
        g = int(np.argmax(logits[node]))
        children = [c for c in range(1, len(parents)) if parents[c] == node] if len(path) <= max_depth else []
        child = next((c for c in children if tokens[c] == g), None)
        if child is None:
            return path, [int(tokens[c]) for c in path[1:]] + [g]
        path.append(child)
        node = child


def check_invariants(out, tokens, parents, logits, max_depth, sampling):
    B, N, V = logits.shape
    A = max_depth + 1
    assert out.accept_len.dtype == torch.int32 and out.accept_len.shape == (B,)
    assert out.accept_nodes.dtype == torch.int32 and out.accept_nodes.shape == (B, A)
    assert out.out_tokens.dtype == torch.int64 and out.out_tokens.shape == (B, A)
    assert out.status.dtype == torch.int32 and torch.all(out.status == 0)
    x = logits.double().numpy()
    for b in range(B):
        L = int(out.accept_len[b])
        nodes = out.accept_nodes[b].tolist()
        emitted = out.out_tokens[b].tolist()
        assert 0 <= L <= max_depth
        assert nodes[0] == 0 and nodes[L + 1:] == [-1] * (A - L - 1)
        assert emitted[L + 1:] == [-1] * (A - L - 1)
        for j in range(1, L + 1):
            assert int(parents[b, nodes[j]]) == nodes[j - 1], (b, nodes)
            assert emitted[j - 1] == int(tokens[b, nodes[j]])
        assert all(0 <= t < V for t in emitted[:L + 1])
        last = nodes[L]
        if L < max_depth:
            # the bonus is never the token of a visited (hence rejected) child
            rejected = [int(tokens[b, c]) for c in range(1, N) if int(parents[b, c]) == last]
            assert emitted[L] not in rejected, (b, emitted, rejected)
        t = float(sampling["temperature"][b])
        if t == 0.0:
            walk = greedy_walk(tokens[b].tolist(), parents[b].tolist(), x[b], max_depth)
            assert (nodes[:L + 1], emitted[:L + 1]) == walk
        else:
            k, p = int(sampling["top_k"][b]), float(sampling["top_p"][b])
            for j in range(L + 1):  # every emitted token has positive filtered probability
                probs = filtered_probs(x[b, nodes[j]], t, k, p)
                assert probs[emitted[j]] > 0, (b, j, probs, emitted)


RANDOM_SHAPES = [(6, 1, 5, 0), (8, 5, 8, 2), (8, 12, 6, 3), (5, 20, 8, 5), (4, 9, 33, 8)]
RANDOM_SHAPE_IDS = [f"B{b}-N{n}-V{v}-depth{d}" for b, n, v, d in RANDOM_SHAPES]


@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("shape", RANDOM_SHAPES, ids=RANDOM_SHAPE_IDS)
def test_invariants_random_trees(backend, op_impl, shape, seed):
    # Triton: one seed per shape, along the diagonal of the shape x seed grid.
    interpreted_subset(backend, seed == RANDOM_SHAPES.index(shape) % 3)
    B, N, V, max_depth = shape
    tokens, parents, logits, sampling = random_batch(seed * 31 + N, B, N, V)
    verify = op_impl("verify")
    out = verify(tokens, parents, logits, max_depth=max_depth, **sampling)
    check_invariants(out, tokens, parents, logits, max_depth, sampling)
    assert_same(out, verify(tokens, parents, logits, max_depth=max_depth, **sampling))  # determinism
    greedy = verify(tokens, parents, logits, max_depth=max_depth)
    check_invariants(greedy, tokens, parents, logits, max_depth, dict(temperature=torch.zeros(B)))


def _rows(tokens, parents, logits, sampling, index):
    return tokens[index], parents[index], logits[index], {k: v[index] for k, v in sampling.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batch_invariance(backend, op_impl, dtype):
    """A request's result does not depend on the other requests of the batch."""
    verify = op_impl("verify")
    tokens, parents, logits, sampling = random_batch(5, 6, 10, 8, dtype)
    others = random_batch(6, 3, 10, 8, dtype)
    full = verify(tokens, parents, logits, max_depth=4, **sampling)
    # Triton (interpreted) takes three of the six requests alone and mixed in: a
    # temperature-only row, a top-k + top-p row and the last, greedy, row.
    for b in (range(6) if backend != "triton" else (2, 4, 5)):
        alone = _rows(tokens, parents, logits, sampling, slice(b, b + 1))
        single = verify(*alone[:3], max_depth=4, **alone[3])
        mixed_in = [torch.cat([x, y]) for x, y in zip(alone[:3], others[:3])]
        mixed_sampling = {k: torch.cat([alone[3][k], others[3][k]]) for k in sampling}
        mixed = verify(*mixed_in, max_depth=4, **mixed_sampling)
        for field in range(4):
            assert torch.equal(single[field][0], full[field][b]), (b, VerifyOutput._fields[field])
            assert torch.equal(mixed[field][0], full[field][b]), (b, VerifyOutput._fields[field])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["fp32", "bf16", "fp16", "fp64"])
def test_matches_reference(backend, op_impl, dtype):
    """Same stream and same float32 (float64) arithmetic: bit-identical to the reference."""
    verify = op_impl("verify")
    # Triton (interpreted): one of the batches per dtype (fp32 and fp64 get batches holding
    # greedy, temperature-only, top-k, top-p and top-k + top-p rows; bf16 all but
    # temperature-only). Its threshold searches cover 16 key bits for bf16, 19 for fp16.
    order = [torch.float32, torch.bfloat16, torch.float64, torch.float16]
    seeds = range(3) if backend != "triton" else [order.index(dtype)]
    for seed in seeds:
        tokens, parents, logits, sampling = random_batch(100 + seed, 8, 14, 12, dtype, greedy_fraction=0.25)
        assert_same(verify(tokens, parents, logits, max_depth=4, **sampling),
                    reference.verify(tokens, parents, logits, max_depth=4, **sampling))


# ---------------------------------------------------------------------- tier 4: random stream
KAT = [  # Random123 known-answer vectors for philox4x32_10
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("impl", [reference.philox4x32, philox_py], ids=["reference", "python-ints"])
@pytest.mark.parametrize("counter,key,expected", KAT, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(counter, key, expected, impl):
    words = impl(counter, key)
    assert [int(w) for w in words] == list(expected)


def test_uniform_py_matches_reference():
    seeds = SEEDS + [5, -3, 2**32, -2**32 - 1]
    offsets = OFFSETS + [2**32 - 1, 1, 0, 2**62]
    for (s, o), node, draw in itertools.product(zip(seeds, offsets), [0, 1, 6, 2**31 + 5], [0, 1]):
        assert float(uniform_py(s, o, node, draw)) == float(reference.uniform(s, o, node, draw))


def test_philox_vectorised_matches_scalar():
    counters = [torch.tensor([0, 0xFFFFFFFF, 0x243F6A88, 17]), torch.tensor([0, 0xFFFFFFFF, 0x85A308D3, 5]),
                torch.tensor([0, 0xFFFFFFFF, 0x13198A2E, 3]), torch.tensor([0, 0xFFFFFFFF, 0x03707344, 1])]
    keys = [torch.tensor([0, 0xFFFFFFFF, 0xA4093822, 9]), torch.tensor([0, 0xFFFFFFFF, 0x299F31D0, 2])]
    batch = reference.philox4x32(counters, keys)
    for i in range(4):
        single = reference.philox4x32([int(c[i]) for c in counters], [int(k[i]) for k in keys])
        assert [int(w[i]) for w in batch] == [int(w) for w in single]


@pytest.mark.parametrize("seed,offset", list(zip(SEEDS, OFFSETS)), ids=STREAM_IDS)
def test_uniform_layout(seed, offset):
    """Key = two's-complement words of seed, counter = (offset words, node, draw), U from the
    top 27 + 26 bits of the first two output words."""
    for node, draw in [(0, 0), (5, 1), (2**32 - 1, 1)]:
        key = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)  # Python ints: infinite two's complement
        counter = (offset & 0xFFFFFFFF, (offset >> 32) & 0xFFFFFFFF, node, draw)
        w0, w1, _, _ = (int(w) for w in reference.philox4x32(counter, key))
        expected = ((w0 >> 5) * 2**26 + (w1 >> 6)) * 2.0**-53
        u = reference.uniform(seed, offset, node, draw)
        assert u.dtype == torch.float64 and float(u) == expected
        assert 0.0 <= float(u) < 1.0


def test_uniform_negative_seed_is_twos_complement():
    words = reference.philox4x32((0, 0, 3, 0), (0xFFFFFFFF, 0xFFFFFFFF))
    w0, w1 = int(words[0]), int(words[1])
    assert float(reference.uniform(-1, 0, 3, 0)) == ((w0 >> 5) * 2**26 + (w1 >> 6)) * 2.0**-53
    assert float(reference.uniform(-1, 0, 3, 0)) != float(reference.uniform(1, 0, 3, 0))
    seeds = torch.tensor(SEEDS)
    batch = reference.uniform(seeds, torch.tensor(OFFSETS), 2, 1)
    assert batch.tolist() == [float(reference.uniform(s, o, 2, 1)) for s, o in zip(SEEDS, OFFSETS)]


def test_uniform_distribution():
    """In [0, 1), roughly uniform (KS), and the accept/bonus coins of a node look independent."""
    seed = torch.arange(-200, 200)[:, None, None]
    offset = torch.tensor([0, 1, 2**32, 2**35 + 7])[None, :, None]
    node = torch.arange(0, 64)[None, None, :]
    u0 = reference.uniform(seed, offset, node, ACCEPT_DRAW).flatten().numpy()
    u1 = reference.uniform(seed, offset, node, BONUS_DRAW).flatten().numpy()
    for u in (u0, u1):
        assert u.min() >= 0.0 and u.max() < 1.0
        assert stats.kstest(u, "uniform").pvalue > 1e-3
    joint, _, _ = np.histogram2d(u0, u1, bins=10, range=[[0, 1], [0, 1]])
    assert stats.chisquare(joint.flatten()).pvalue > 1e-3
    assert len(np.unique(np.concatenate([u0, u1]))) == 2 * len(u0)


# ------------------------------------------------------------------------ tier 5: bad input
def _good_inputs():
    tokens = torch.tensor([[0, 1, 2], [0, 3, 1]], dtype=torch.int64)
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 0]], dtype=torch.int32)
    logits = torch.zeros(2, 3, 4)
    sampling = dict(temperature=torch.ones(2), top_k=torch.zeros(2, dtype=torch.int32), top_p=torch.ones(2),
                    seed=torch.zeros(2, dtype=torch.int64), offset=torch.zeros(2, dtype=torch.int64))
    return dict(tokens=tokens, parents=parents, target_logits=logits, max_depth=2, **sampling)


def _with(**changes):
    def make():
        kwargs = _good_inputs()
        for name, change in changes.items():
            kwargs[name] = change(kwargs[name])
        return kwargs
    return make


def _set(index, value):
    def change(t):
        t = t.clone()
        t[index] = value
        return t
    return change


BAD_INPUTS = [
    ("parents-int64", "parents", _with(parents=lambda t: t.long())),
    ("tokens-int32", "tokens", _with(tokens=lambda t: t.int())),
    ("temperature-float64", "temperature", _with(temperature=lambda t: t.double())),
    ("logits-int", "target_logits", _with(target_logits=lambda t: t.long())),
    ("seed-int32", "seed", _with(seed=lambda t: t.int())),
    ("offset-float", "offset", _with(offset=lambda t: t.float())),
    ("top-k-int64", "top_k", _with(top_k=lambda t: t.long())),
    ("tokens-rank-1", "tokens", _with(tokens=lambda t: t[0])),
    ("parents-rank-3", "parents", _with(parents=lambda t: t[..., None])),
    ("logits-rank-2", "target_logits", _with(target_logits=lambda t: t[0])),
    ("tokens-vs-logits-N", "tokens", _with(tokens=lambda t: torch.cat([t, t[:, :1]], 1))),
    ("tokens-vs-logits-B", "tokens", _with(tokens=lambda t: t[:1])),
    ("parents-vs-logits-N", "parents", _with(parents=lambda t: t[:, :2])),
    ("top-p-wrong-B", "top_p", _with(top_p=lambda t: t[:1])),
    ("parent-not-before-child", "parents", _with(parents=_set((1, 2), 2))),
    ("parent-after-child", "parents", _with(parents=_set((0, 1), 2))),
    ("root-parent-not-minus-1", "parents", _with(parents=_set((1, 0), 0))),
    ("child-parent-minus-1", "parents", _with(parents=_set((0, 2), -1))),
    ("draft-token-eq-V", "tokens", _with(tokens=_set((1, 2), 4))),
    ("draft-token-negative", "tokens", _with(tokens=_set((0, 1), -1))),
    ("top-p-zero", "top_p", _with(top_p=_set(1, 0.0))),
    ("top-p-above-1", "top_p", _with(top_p=_set(0, 1.5))),
    ("top-p-nan", "top_p", _with(top_p=_set(0, float("nan")))),
    ("temperature-negative", "temperature", _with(temperature=_set(1, -0.5))),
    ("temperature-nan", "temperature", _with(temperature=_set(0, float("nan")))),
    ("top-k-negative", "top_k", _with(top_k=_set(0, -1))),
    ("max-depth-negative", "max_depth", _with(max_depth=lambda d: -1)),
    ("max-depth-above-int32", "max_depth", _with(max_depth=lambda d: 2**31)),  # before any allocation
    ("max-depth-huge", "max_depth", _with(max_depth=lambda d: 2**40)),
    ("max-depth-float", "max_depth", _with(max_depth=lambda d: 2.0)),  # not the C++ op schema's RuntimeError
    ("max-depth-bool", "max_depth", _with(max_depth=lambda d: True)),  # was a depth of 1
    ("max-depth-tensor", "max_depth", _with(max_depth=lambda d: torch.tensor(2))),  # nor converted by it
]


@pytest.mark.parametrize("make,name", [(c[2], c[1]) for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises(op_impl, make, name):
    kwargs = make()
    verify = op_impl("verify")
    args = [kwargs.pop(k) for k in ("tokens", "parents", "target_logits")]
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        verify(*args, **kwargs)


# Base request: N = 5, root -> 1 -> 2 -> 3 is accepted (g = 3, 5, 1, then bonus 6); node 4 is a
# root child after node 1, never visited. Each case corrupts rows of request 1 of a 3-request
# batch whose requests 0 and 2 stay clean.
BAD_TOKENS, BAD_PARENTS, BAD_G = [0, 3, 5, 1, 4], [-1, 0, 1, 2, 0], [3, 5, 1, 6, 2]
CLEAN = ([0, 1, 2, 3], [3, 5, 1, 6])
FALLBACK_3 = ([0, -1, -1, -1], [3, -1, -1, -1])
FALLBACK_0 = ([0, -1, -1, -1], [0, -1, -1, -1])
NAN, INF = float("nan"), float("inf")


def _row_all(value):
    return lambda row: torch.full_like(row, value)


def _row_set(index, value):
    def change(row):
        row = row.clone()
        row[index] = value
        return row
    return change


def _row_nan_else_ninf(row):
    row = torch.full_like(row, -INF)
    row[3] = NAN
    return row


def _row_only_finite(index):
    def change(row):
        out = torch.full_like(row, -INF)
        out[index] = row[index]
        return out
    return change


# (id, {node: row change}, max_depth, expected (accept_nodes, out_tokens), status)
BAD_ROWS = [
    ("root-nan", {0: _row_set(7, NAN)}, 3, FALLBACK_3, 1),
    ("root-posinf", {0: _row_set(2, INF)}, 3, FALLBACK_3, 1),
    ("root-all-ninf", {0: _row_all(-INF)}, 3, FALLBACK_0, 1),
    ("root-all-nan", {0: _row_all(NAN)}, 3, FALLBACK_0, 1),
    ("root-nan-rest-ninf", {0: _row_nan_else_ninf}, 3, FALLBACK_0, 1),
    ("deeper-posinf", {2: _row_set(4, INF)}, 3, FALLBACK_3, 1),
    ("deeper-nan", {1: _row_set(0, NAN)}, 3, FALLBACK_3, 1),
    ("leaf-all-ninf", {3: _row_all(-INF)}, 3, FALLBACK_3, 1),
    # -inf alone is an ordinary mask
    ("root-ninf-mask", {0: _row_only_finite(3)}, 3, CLEAN, 0),
    ("deeper-ninf-mask", {2: _row_only_finite(1), 3: _row_only_finite(6)}, 3, CLEAN, 0),
    # rows the walk never visits do not matter
    ("unvisited-sibling-nan", {4: _row_all(NAN)}, 3, CLEAN, 0),
    ("beyond-max-depth-posinf", {3: _row_set(0, INF)}, 2, ([0, 1, 2], [3, 5, 1]), 0),
]


@pytest.mark.parametrize("mode", ["greedy", "sampling"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", BAD_ROWS, ids=[c[0] for c in BAD_ROWS])
def test_nonfinite_rows(backend, op_impl, case, dtype, mode):
    # Triton: every case in both modes, in one dtype, fp32 and fp16 alternating down the list.
    interpreted_subset(backend, dtype == (torch.float32, torch.float16)[BAD_ROWS.index(case) % 2])
    _, changes, max_depth, (nodes, out_tokens), status = case
    clean = one_hot_logits(BAD_G, 8) if mode == "sampling" else spiky_logits(BAD_G, 8)
    bad = clean.clone()
    for node, change in changes.items():
        bad[node] = change(bad[node])
    logits = torch.stack([clean, bad, clean]).to(dtype)
    sampling = {} if mode == "greedy" else dict(temperature=[1.0, 0.8, 1.0], top_k=[0, 3, 0],
                                                 top_p=[1.0, 0.9, 1.0], seed=[1, -2, 3], offset=[4, 5, 6])
    out = run(op_impl("verify"), [BAD_TOKENS] * 3, [BAD_PARENTS] * 3, logits, max_depth, **sampling)
    A = max_depth + 1
    assert_output(out, nodes[:A] + [-1] * (A - len(nodes)), out_tokens[:A] + [-1] * (A - len(out_tokens)),
                  status=status, row=1)
    clean_nodes, clean_tokens = ([0, 1, 2], [3, 5, 1]) if max_depth == 2 else CLEAN
    for row in (0, 2):
        assert_output(out, clean_nodes, clean_tokens, row=row)


@pytest.mark.parametrize("temperature", [1e-40, 1e-37, 1e-20], ids=["1e-40", "1e-37", "1e-20"])
def test_tiny_temperature_is_near_greedy(op_impl, temperature):
    """(logits - max) / T: a tiny temperature sends non-max logits to -inf, never NaN."""
    verify = op_impl("verify")
    logits = torch.tensor([[[0.0, 1.0, 0.5, 100.0], [0.0, 0.0, 0.0, 1.0]]])
    out = verify(torch.tensor([[0, 2]]), torch.tensor([[-1, 0]], dtype=torch.int32), logits, max_depth=1,
                 temperature=torch.tensor([temperature]), seed=torch.tensor([0]), offset=torch.tensor([0]))
    assert out.status.tolist() == [0]
    assert out.accept_len.tolist() == [0]
    assert out.out_tokens.tolist() == [[3, -1]]
