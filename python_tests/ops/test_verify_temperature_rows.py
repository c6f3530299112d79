"""verify of calls with a temperature through the all-rows kernel (verify_temperature.py): every
row's softmax statistics in parallel chunks, then the walk and the bonus draw in the request's last
program; with filter tensors the walk after it for the requests that filter. Checked token for
token against the reference and the one-launch walk (``helpers.check_all_rows``: the same call
with the all-rows kernels' byte limits at 0) on trees whose drafts often carry likely tokens
(walks go deep, children are rejected, bonus draws land in every chunk), with greedy and sampling
requests in one batch, duplicate drafts, NaN / +inf / all -inf rows, tiny temperatures, filters
mixed in a batch, and in the interpreter and the GPU configurations.
"""

import dataclasses

import pytest
import torch

from eagle_kernels import reference
from eagle_kernels._types import VerifyOutput
from helpers import assert_same, check_all_rows, triton_verify


def sampling_batch(seed, B, N, V, dtype, scale=6.0, logits=None):
    """Random trees of long branches; a node's token is its parent row's most likely token half the
    time, one of the next two 40% of the time (siblings may repeat one), so children are accepted
    and rejected. The rows are random unless ``logits`` [B, N, V] are given."""
    gen = torch.Generator().manual_seed(seed)
    if logits is None:
        logits = (torch.randn(B, N, V, generator=gen, dtype=torch.float64) * scale).to(dtype)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    tokens = torch.randint(0, V, (B, N), generator=gen)
    top3 = logits.double().topk(3, dim=-1).indices
    for b in range(B):
        for i in range(1, N):
            parents[b, i] = int(torch.randint(max(0, i - 3), i, (), generator=gen))
            draw = float(torch.rand((), generator=gen))
            if draw < 0.9:
                tokens[b, i] = top3[b, parents[b, i], 0 if draw < 0.5 else 1 if draw < 0.7 else 2]
    return tokens, parents, logits


def chain_batch(B, V, dtype):
    """Trees of a root, its chain of two (the row's most likely tokens: the walk goes deep) and a
    second child, on spiked logits: the rows a bad-row test plants NaN / inf / -inf in."""
    tokens, parents, logits = sampling_batch(7, B, 4, V, dtype, scale=8.0)
    parents[:] = torch.tensor([-1, 0, 1, 0], dtype=torch.int32)
    top = logits.double().argmax(-1)
    for b in range(B):
        tokens[b, 1], tokens[b, 2] = top[b, 0], top[b, 1]
    return tokens, parents, logits


def sampling_args(seed, B, temperatures=(0.0, 0.6, 1.0, 1.7)):
    gen = torch.Generator().manual_seed(1000 + seed)
    temperature = torch.tensor([temperatures[i % len(temperatures)] for i in range(B)], dtype=torch.float32)
    return dict(temperature=temperature, seed=torch.randint(0, 2**40, (B,), generator=gen),
                offset=torch.randint(0, 2**20, (B,), generator=gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["fp32", "bf16", "fp16", "fp64"])
def test_matches_reference(dtype):
    """Every shape in fp32 and bf16 (the decoder's dtypes); fp16 and fp64 take the wide shallow tree
    and the deep chain-like one (their own tiles and compute dtype, not new shapes)."""
    accepted, bonus_rows = 0, 0
    shapes = [(8, 9, 131, 4), (4, 12, 200, 8), (4, 1, 64, 0), (4, 16, 257, 15)]
    for seed, (B, N, V, max_depth) in enumerate(shapes):
        if dtype in (torch.float16, torch.float64) and seed in (1, 2):
            continue
        tokens, parents, logits = sampling_batch(seed, B, N, V, dtype)
        args = sampling_args(seed, B)
        out = check_all_rows(tokens, parents, logits, max_depth, args, what=(seed, B, N, V))
        sampled = args["temperature"] > 0
        accepted += int(out.accept_len[sampled].sum())
        bonus_rows += int(sampled.sum())
    assert accepted >= 4 and bonus_rows >= 8  # sampling walks accepted drafts


def test_bonus_draws_in_every_chunk():
    """Flat rows of 6 chunks of one tile (the interpreter's), the children rejected or absent:
    bonus draws spread over the whole row, each checked against the reference's inverse CDF."""
    tv = triton_verify()
    B, N, V = 24, 3, 6 * 64
    assert tv._temperature_chunking(B, N, V, 64, None) == (6, 64)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(B, N, V, generator=gen) * 0.3
    parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32).expand(B, N).contiguous()
    tokens = torch.randint(0, V, (B, N), generator=gen)
    args = sampling_args(0, B, temperatures=(1.0, 2.5))
    out = check_all_rows(tokens, parents, logits, 1, args)
    bonus = out.out_tokens[out.accept_len == 0, 0]
    assert len({int(x) // 64 for x in bonus}) == 6  # draws in every chunk


def test_rejected_children_leave_the_draw():
    """A node whose children carry its two most likely tokens (one repeated): at a low
    temperature they are accepted or rejected in turn, and the bonus after two rejections is
    drawn from the rest of the row, in whichever chunk the rejected tokens were."""
    B, N, V = 20, 4, 384
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(B, N, V, generator=gen)
    top2 = logits.topk(2, dim=-1).indices
    parents = torch.tensor([[-1, 0, 0, 0]], dtype=torch.int32).expand(B, N).contiguous()
    tokens = torch.stack([top2[:, 0, 0], top2[:, 0, 0], top2[:, 0, 1], top2[:, 0, 0]], dim=1)
    for b in range(B):
        logits[b, 0, top2[b, 0]] += 2.0 + b % 3
    args = sampling_args(3, B, temperatures=(0.8, 1.5))
    out = check_all_rows(tokens, parents, logits, 1, args)
    rejected_both = out.accept_len == 0
    assert 0 < int(rejected_both.sum()) < B
    assert not bool((out.out_tokens[rejected_both, 0][:, None] == top2[rejected_both, 0]).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
def test_bad_rows(dtype):
    """NaN, +inf and all -inf rows of sampling requests: status 1 and the root's finite argmax
    when the walk reaches them, nothing when it does not."""
    B = 6
    tokens, parents, logits = chain_batch(B, 300, dtype)
    logits[0, 0, 250] = float("nan")  # root, last chunk
    logits[1, 0, 3] = float("inf")  # root: the fallback is the finite argmax
    logits[2, 3, 17] = float("nan")  # off the walk (node 3 is never reached from a leaf's sibling)
    logits[3, 0, :] = float("-inf")  # no finite entry: fallback 0
    logits[4, 0, 5] = float("nan")
    logits[4, 0, 6] = 1e30  # a larger finite entry beside the NaN
    args = sampling_args(1, B, temperatures=(0.5,))
    out = check_all_rows(tokens, parents, logits, 2, args)
    assert out.status.tolist() == [1, 1, 0, 1, 1, 0]
    assert out.out_tokens[3, 0].item() == 0


def test_tiny_and_huge_temperatures():
    """A subnormal and a tiny temperature (the max takes all the mass: ties share it) and a
    huge one (nearly uniform), beside greedy requests."""
    B, N, V = 8, 6, 200
    tokens, parents, logits = sampling_batch(2, B, N, V, torch.float32)
    logits = torch.round(logits)  # ties at the max
    args = sampling_args(2, B, temperatures=(1e-40, 1e-20, 0.0, 1e6))
    check_all_rows(tokens, parents, logits, 5, args)


def test_defaults_and_repeats():
    """seed and offset left out are zeros; repeated calls give the same tokens."""
    tv = triton_verify()
    tokens, parents, logits = sampling_batch(4, 4, 6, 100, torch.float32)
    temperature = torch.full((4,), 0.9)
    got = tv.verify(tokens, parents, logits, max_depth=4, temperature=temperature)
    zeros = torch.zeros(4, dtype=torch.int64)
    assert_same(got, reference.verify(tokens, parents, logits, max_depth=4, temperature=temperature, seed=zeros,
                                      offset=zeros))
    assert_same(got, tv.verify(tokens, parents, logits, max_depth=4, temperature=temperature))


def test_gpu_config_interpreted():
    """GPU_CONFIG's tiles (8192 entries, 32 a thread; greedy requests' 2048, 8 a thread; the bonus
    scan 1024 a step) on rows of one and two chunks, the last one partial, bf16 and fp32."""
    tv = triton_verify()
    config = tv.GPU_CONFIG
    for dtype in (torch.bfloat16, torch.float32):
        for seed, (B, N, V) in enumerate([(4, 4, 5000), (2, 3, 8193)]):
            tokens, parents, logits = sampling_batch(seed, B, N, V, dtype, scale=1.0)
            check_all_rows(tokens, parents, logits, 3, sampling_args(seed, B), config=config, what=(dtype, V))


def test_chunking():
    """On an H200 (132 SMs) one tile a program while the rows fit one wave of three programs an
    SM, else two; at most MAX_TEMPERATURE_CHUNKS chunks a row; 16-byte lanes."""
    tv = triton_verify()
    assert [tv._temperature_vec(8192, size) for size in (2, 4, 8)] == [8, 4, 2]
    assert tv._temperature_chunking(1, 61, 49152, 8192, 132) == (6, 8192)  # 366 programs
    assert tv._temperature_chunking(8, 64, 128256, 8192, 132) == (8, 16384)
    assert tv._temperature_chunking(1, 61, 128256, 8192, 132) == (8, 16384)
    assert tv._temperature_chunking(1, 1, 600000, 8192, 132) == (25, 24576)  # 74 tiles: 3 a chunk
    assert tv._temperature_chunking(4, 1, 1000, 1024, 132) == (1, 1024)
    assert tv._temperature_chunking(2, 3, 1000, 64, None) == (16, 64)


def test_which_kernel():
    """A temperature takes the all-rows kernel; with top_k or top_p tensors the walk follows it
    (for the requests that filter); draft rows, positions, more than MAX_GREEDY_ROWS rows or more
    bytes than temperature_max_bytes take the walk alone."""
    tv = triton_verify()
    calls = []
    launch, launch_rows = tv._launch, tv._launch_rows
    B, N, V = 2, 5, 100
    tokens, parents, logits = sampling_batch(0, B, N, V, torch.float32)
    args = sampling_args(0, B)
    try:
        tv._launch = lambda *a, **k: (calls.append("walk"), launch(*a, **k))[1]
        tv._launch_rows = lambda *a, **k: (calls.append("rows"), launch_rows(*a, **k))[1]
        tv.verify(tokens, parents, logits, max_depth=3, **args)
        tv.verify(tokens, parents, logits, max_depth=3, **args, top_k=torch.zeros(B, dtype=torch.int32))
        tv.verify(tokens, parents, logits, max_depth=3, **args, top_p=torch.ones(B))
        tv.verify(tokens, parents, logits, max_depth=3, **args, draft_probs=torch.full((B, N, V), 1.0 / V))
        tv.verify(tokens, parents, logits, max_depth=3, **args, positions=torch.zeros(B, dtype=torch.int64))
        small = dataclasses.replace(tv.launch_config(), temperature_max_bytes=B * N * V * 4 - 1)
        tv.verify(tokens, parents, logits, max_depth=3, **args, _config=small)
        tv.verify(tokens, parents, logits, max_depth=3, _config=small)  # greedy: its own limit
    finally:
        tv._launch, tv._launch_rows = launch, launch_rows
    assert calls == ["rows", "rows", "walk", "rows", "walk", "walk", "walk", "walk", "rows"]


def test_filters_mixed_in_a_batch(dtype=torch.bfloat16):
    """top_k / top_p tensors with some requests filtering, some not, some greedy (whose filters
    do not apply): the all-rows kernel serves the unfiltered and greedy requests and those whose
    top-k it lists (test_verify_topk_rows.py), the walk after it the other filtered ones (its
    ``pending`` flags), into one output; the filter values are read on the device only."""
    B, N, V = 12, 9, 257
    tokens, parents, logits = sampling_batch(9, B, N, V, dtype)
    args = sampling_args(9, B, temperatures=(0.0, 0.7, 1.2))
    top_k = torch.tensor([0, 0, 5, 40, 0, 0, 3, 0, V, 0, 0, 1], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.8, 0.95, 0.9, 1.0, 1.0, 1.0, 0.5, 1.0])
    full = dict(args, top_k=top_k, top_p=top_p)
    want = check_all_rows(tokens, parents, logits, 6, full)
    check_all_rows(tokens, parents, logits, 6, dict(args, top_p=top_p))  # top_k None
    # Each launch writes its own requests' outputs and no others (sentinels elsewhere stay).
    tv = triton_verify()
    config = tv.launch_config()
    filtered = (args["temperature"] != 0) & (((top_k > 0) & (top_k < V)) | (top_p < 1))
    assert 0 < int(filtered.sum()) < B

    def sentinels():
        return VerifyOutput(*(torch.full_like(x, -7) for x in want))

    pending = torch.full((B,), -3, dtype=torch.int32)
    got = tv._launch_rows(tokens, parents, logits, 6, config, args["temperature"], args["seed"], args["offset"],
                          top_k, top_p, outputs=sentinels(), pending=pending)
    listed = filtered & (top_k > 0) & (top_k <= config.list_topk)
    # Top-p alone is listed too, and left to the walk where a visited nucleus outgrows its list.
    alone = filtered & ~((top_k > 0) & (top_k < V))
    left = pending.bool()
    assert int(listed.sum()) == 1 and torch.equal(left & ~alone, filtered & ~listed & ~alone) and bool(left.any())
    walk = tv._launch(tokens, parents, logits, 6, args["temperature"], top_k, top_p, args["seed"], args["offset"],
                      config, record=False, outputs=sentinels(), pending=pending).output
    for x, y, z in zip(got, walk, want):
        x, y = x.view(B, -1), y.view(B, -1)
        z = z.view(B, -1)
        assert torch.equal(x[~left], z[~left]) and bool((x[left] == -7).all())
        assert torch.equal(y[left], z[left]) and bool((y[~left] == -7).all())


def test_tickets_left_zero():
    """The request counters are back to zero after greedy and sampling launches of several shapes."""
    from eagle_kernels.triton._launch_config import tickets

    for seed, (B, N, V) in enumerate([(3, 4, 100), (5, 2, 300), (3, 4, 100)]):
        tokens, parents, logits = sampling_batch(seed, B, N, V, torch.float32)
        check_all_rows(tokens, parents, logits, 3, sampling_args(seed, B))
        assert int(tickets(logits.device, B)[:8].abs().sum()) == 0
