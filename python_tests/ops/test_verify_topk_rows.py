"""verify of top-k requests in the all-rows kernel (verify_topk.py): each chunk lists its entries at
or above the k-th largest of its sub-block maxima, the request's last program joins a visited row's
lists and walks with the walk kernel's thresholds, acceptance and bonus draw. Checked token for
token against the reference and the one-launch walk (``helpers.check_all_rows``), and through the
``pending`` flags: which requests the all-rows kernel served (top-k up to ``list_topk``, with or
without top-p) and which it left to the walk's launch (top-p alone, a larger k, a chunk whose list
overflowed, a row whose lists exceed the candidate slots), in the interpreter and GPU
configurations.
"""

import dataclasses

import pytest
import torch
from test_verify_temperature_rows import chain_batch, sampling_args, sampling_batch

from eagle_kernels import reference
from eagle_kernels._types import VerifyOutput
from helpers import assert_same, check_all_rows, triton_verify


def served(tokens, parents, logits, max_depth, args, config=None):
    """The all-rows launch alone (sentinel outputs): its pending flags, and the requests it served
    equal to the reference's, the others' outputs untouched."""
    tv = triton_verify()
    config = config or tv.launch_config()
    B = logits.shape[0]
    want = reference.verify(tokens, parents, logits, max_depth=max_depth, **args)
    pending = torch.full((B,), -3, dtype=torch.int32)
    got = tv._launch_rows(tokens, parents, logits, max_depth, config, args["temperature"], args["seed"],
                          args["offset"], args.get("top_k"), args.get("top_p"),
                          outputs=VerifyOutput(*(torch.full_like(x, -7) for x in want)), pending=pending)
    assert set(pending.tolist()) <= {0, 1}
    done = pending == 0
    for x, z in zip(got, want):
        x, z = x.view(B, -1), z.view(B, -1)
        assert torch.equal(x[done], z[done]) and bool((x[~done] == -7).all())
    return pending


def listable(args, V, limit):
    return (args["temperature"] != 0) & (args["top_k"] > 0) & (args["top_k"] <= limit) & (args["top_k"] < V)


def test_lists_match_reference(dtype=torch.bfloat16):
    """Top-k 1 .. list_topk with and without top-p, beside greedy, temperature-only, top-p-only and
    larger-k requests: every output equals the reference's and the walk's, every listed top-k request
    is served by the all-rows launch, and the top-p-only ones it serves equal the reference's."""
    limit = triton_verify().launch_config().list_topk
    accepted, alone_served = 0, 0
    for seed, (B, N, V, max_depth) in enumerate([(12, 10, 257, 8), (5, 1, 64, 0)]):
        tokens, parents, logits = sampling_batch(seed, B, N, V, dtype)
        args = sampling_args(seed, B, temperatures=(0.7, 1.3, 0.0, 0.4))
        gen = torch.Generator().manual_seed(seed)
        args["top_k"] = torch.tensor([1 + i % (limit + 1) if i % 5 else 0 for i in range(B)], dtype=torch.int32)
        args["top_p"] = torch.tensor([(1.0, 0.9, 0.5)[i % 3] for i in range(B)]) \
            .where(torch.rand(B, generator=gen) < 0.7, torch.tensor(1.0))
        out = check_all_rows(tokens, parents, logits, max_depth, args, what=(seed, dtype))
        pending = served(tokens, parents, logits, max_depth, args)
        lists = listable(args, V, limit)
        top_k_on = (args["top_k"] > 0) & (args["top_k"] < V)
        filtering = (args["temperature"] != 0) & (top_k_on | (args["top_p"] < 1))
        # Top-p alone is listed too: served where every visited nucleus ends inside its list.
        alone = filtering & ~top_k_on
        assert bool(lists.any()) and torch.equal(pending.bool() & ~alone, filtering & ~lists & ~alone)
        accepted += int(out.accept_len[lists].sum())
        alone_served += int((alone & (pending == 0)).sum())
    assert accepted >= 4 and alone_served >= 1  # listed walks accept drafts


def test_overflows_left_to_the_walk():
    """A chunk whose entries at or above its threshold exceed its slots (a flat row: every entry
    ties) and a row whose chunks' lists together exceed the candidate slots (the same 64 entries in
    every chunk) are left to the walk's launch, which serves them; the other listed requests are
    served by the all-rows launch."""
    tv = triton_verify()
    config = tv.launch_config()
    B, N, V = 6, 4, 512
    tokens, parents, logits = sampling_batch(3, B, N, V, torch.float32)
    logits[0, 0] = 2.0  # flat root row: a chunk of 64 ties over 16 slots
    chunks, chunk = tv._temperature_chunking(B, N, V, config.greedy_block, None)
    same = torch.randn(chunk, generator=torch.Generator().manual_seed(4)) * 3
    same[:2] = 10.0  # two of a sub-block's entries above every other sub-block's max: 5 or more a list
    logits[1] = same.repeat(chunks)  # every chunk alike: lists of equal thresholds, together over 32 slots
    args = sampling_args(3, B, temperatures=(0.9,))
    args["top_k"] = torch.tensor([3, 4, 2, 4, 1, 3], dtype=torch.int32)
    args["top_p"] = torch.tensor([1.0, 0.8, 1.0, 0.9, 1.0, 1.0])
    check_all_rows(tokens, parents, logits, 3, args)
    assert served(tokens, parents, logits, 3, args).tolist() == [1, 1, 0, 0, 0, 0]


def test_top_p_alone():
    """Top-p without top-k (top_k 0 or >= V, or no top_k tensor) is listed by its list_topk largest
    entries and the rows' softmax sums: rows with one dominant entry (a nucleus of one, far above the
    list's floor) are served by the all-rows launch, flat rows (a nucleus of most of the row) are
    left to the walk, and a NaN row gives status 1; every output equals the reference's and the
    walk's. Removing the nucleus check (serving flat rows from their lists) fails the flags."""
    B, N, V = 8, 5, 256
    gen = torch.Generator().manual_seed(31)
    logits = torch.randn(B, N, V, generator=gen)
    top = torch.randint(0, V, (B, N), generator=gen)
    spiked = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1], dtype=torch.bool)
    logits[spiked] += 12.0 * torch.nn.functional.one_hot(top[spiked], V)
    logits[~spiked] *= 0.3
    logits[6, 0, 5] = float("nan")
    # float64 rows: the sums' loop in the float64 compute dtype (bf16 in the other tests).
    tokens, parents, logits = sampling_batch(31, B, N, V, torch.float64, logits=logits.double())
    args = sampling_args(31, B, temperatures=(0.8, 1.2))
    args["top_k"] = torch.tensor([0, V, 0, 0, 0, 3, 0, V + 5], dtype=torch.int32)
    args["top_p"] = torch.tensor([0.9, 0.8, 0.9, 0.95, 0.5, 0.9, 0.9, 0.7])
    out = check_all_rows(tokens, parents, logits, 3, args)
    assert out.status.tolist() == [0, 0, 0, 0, 0, 0, 1, 0]
    assert served(tokens, parents, logits, 3, args).tolist() == [0, 0, 1, 0, 1, 0, 0, 0]
    assert int(out.accept_len[spiked].sum()) >= 2
    alone = {key: value for key, value in args.items() if key != "top_k"}  # no top_k tensor
    assert served(tokens, parents, logits, 3, alone).tolist() == [0, 0, 1, 0, 1, 0, 0, 0]


def joined_lists(row, chunk, sub, k):
    """Entries of a row in its chunks' joined lists: those at or above the largest chunk threshold
    (the k-th largest of a chunk's sub-block maxima)."""
    level = max(float(x.view(-1, sub).amax(1).sort(descending=True).values[k - 1]) for x in row.split(chunk))
    return int((row >= level).sum())


def test_long_lists_take_the_top_set():
    """Rows whose joined lists exceed the top-set slots (``TOP_CAND``: 16 interpreted) but not the
    candidate slots (32): a chunk's four moderately large sub-blocks set its threshold, and one
    sub-block of five much larger entries lands in its list whole, so a visited row lists about 22
    entries and the k-th largest is selected among them (``_kth_largest``). Every output equals the
    reference's and the walk's, served by the all-rows launch; a row with 20 entries tied at the top
    (5 a chunk, k 2) overflows the top set and is left to the walk."""
    tv = triton_verify()
    config = tv.launch_config()
    B, N, chunks, chunk, sub = 6, 5, 4, 64, 8
    V = chunks * chunk
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(B, N, chunks, chunk, generator=gen, dtype=torch.float64)
    logits[..., 0:5] = 10 + torch.rand(B, N, chunks, 5, generator=gen, dtype=torch.float64) * 2
    for i in range(1, 5):  # sub-blocks 1-4: one entry each near 5
        logits[..., i * sub] = 5 + torch.rand(B, N, chunks, generator=gen, dtype=torch.float64)
    logits = logits.view(B, N, V).float()
    logits[5, 0] = torch.randn(V, generator=gen)
    logits[5, 0].view(chunks, chunk)[:, 0:5 * sub:sub] = 10.0  # ties in five sub-blocks of every chunk
    tokens, parents, logits = sampling_batch(21, B, N, V, torch.float32, logits=logits)
    args = sampling_args(21, B, temperatures=(0.8, 1.2))
    args["top_k"] = torch.tensor([4, 3, 2, 4, 3, 2], dtype=torch.int32)
    args["top_p"] = torch.tensor([1.0, 1.0, 0.7, 0.9, 1.0, 1.0])
    lists = tv._topk_lists(B, N, V, chunks, chunk, config.temperature_block, torch.float32, "cpu", config)
    assert lists["constexprs"]["SUB"] == sub and (chunks, chunk) == tv._temperature_chunking(
        B, N, V, config.greedy_block, None)
    top, cand = lists["constexprs"]["TOP_CAND"], lists["constexprs"]["NUM_CAND"]
    joined = [joined_lists(logits[b, j], chunk, sub, int(args["top_k"][b])) for b in range(B) for j in range(N)]
    assert all(top < n <= cand for n in joined), joined
    out = check_all_rows(tokens, parents, logits, 3, args)
    assert served(tokens, parents, logits, 3, args).tolist() == [0, 0, 0, 0, 0, 1]
    assert int(out.accept_len[:5].sum()) >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_bad_rows(dtype):
    """NaN, +inf and all -inf rows of top-k requests: status 1 and the root's finite argmax when
    the walk reaches them (served by the all-rows launch), nothing when it does not."""
    B = 5
    tokens, parents, logits = chain_batch(B, 300, dtype)
    logits[0, 0, 250] = float("nan")
    logits[1, 0, 3] = float("inf")
    logits[2, 3, 17] = float("nan")  # off the walk
    logits[3, 0, 64:] = float("-inf")  # chunks without a finite entry beside one with
    logits[4, 1, :] = float("-inf")  # a visited row with none
    args = sampling_args(1, B, temperatures=(0.5,))
    args["top_k"] = torch.tensor([2, 4, 3, 1, 2], dtype=torch.int32)
    out = check_all_rows(tokens, parents, logits, 2, args)
    assert out.status.tolist() == [1, 1, 0, 0, 1]
    assert served(tokens, parents, logits, 2, args).tolist() == [0] * B


def test_gpu_config_interpreted():
    """GPU_CONFIG's lists (64- and 128-entry sub-blocks, 128 slots a chunk, 8 sub-blocks a step,
    k up to 64, top-p alone with list_topp on) on rows of two chunks, the last one partial, bf16 and
    fp32 (its batch floor of 4 lowered: below it the walk serves them); the sub-blocks the launcher picks at real
    vocabularies."""
    tv = triton_verify()
    assert not tv._lists_topk(3, torch.ones(3), None, tv.GPU_CONFIG)
    assert tv._lists_topk(4, torch.ones(4), None, tv.GPU_CONFIG)
    # Top-p alone: listed where list_topp is on (off in GPU_CONFIG, on here).
    config = dataclasses.replace(tv.GPU_CONFIG, list_min_batch=1, list_topp=True)
    assert not tv._lists_topk(4, None, torch.ones(4), tv.GPU_CONFIG) and tv._lists_topk(4, None, torch.ones(4), config)
    subs = [tv._topk_lists(1, 1, V, *tv._temperature_chunking(B, N, V, 8192, 132), 8192, torch.float32, "cpu",
                           config)["constexprs"]["SUB"]
            for B, N, V in [(8, 64, 49152), (1, 61, 49152), (8, 64, 128256), (8, 64, 151936), (1, 1, 5000)]]
    assert subs == [128, 64, 128, 64, 64]  # 16384 / 8192-entry chunks; Qwen's last chunk holds 4480 entries
    # bf16: a full chunk of 128 sub-blocks and a one-entry chunk; fp32: one chunk of 4096 and a partial one.
    # Top-p alone (top_k 0): rows with one dominant entry, served from the sums' loop and the lists.
    for seed, (dtype, B, N, V, ks) in enumerate([(torch.bfloat16, 3, 2, 8193, (64, 1, 0)),
                                                 (torch.float32, 2, 2, 5000, (40, 20))]):
        tokens, parents, logits = sampling_batch(seed, B, N, V, dtype, scale=1.0)
        logits[ks.index(0) if 0 in ks else B:, :, 7] = 15.0
        args = sampling_args(seed, B, temperatures=(0.8, 1.1))
        args["top_k"] = torch.tensor(ks, dtype=torch.int32)
        args["top_p"] = torch.tensor([1.0, 0.9, 0.95][:B])
        # The all-rows launch alone against the reference (the walk under GPU_CONFIG is slow interpreted);
        # the fp32 rows (no top-p alone) with list_topp off, GPU_CONFIG's own.
        on = config if 0 in ks else dataclasses.replace(config, list_topp=False)
        assert served(tokens, parents, logits, 2, args, on).tolist() == [0] * B


def test_lists_off():
    """list_topk 0: every filtering request is left to the walk's launch, the outputs the same."""
    tv = triton_verify()
    config = dataclasses.replace(tv.launch_config(), list_topk=0)
    B, N, V = 4, 5, 200
    tokens, parents, logits = sampling_batch(11, B, N, V, torch.float32)
    args = dict(sampling_args(11, B, temperatures=(0.9,)), top_k=torch.tensor([2, 3, 0, 4], dtype=torch.int32))
    check_all_rows(tokens, parents, logits, 3, args, config=config)
    assert served(tokens, parents, logits, 3, args, config).tolist() == [1, 1, 0, 1]
    assert_same(tv.verify(tokens, parents, logits, max_depth=3, **args, _config=config),
                tv.verify(tokens, parents, logits, max_depth=3, **args))
