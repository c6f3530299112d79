"""verify of greedy calls (``temperature`` None) through the all-rows kernel (verify_greedy.py):
every row's argmax in parallel chunks, then the walk in the request's last program. Checked
against the reference and the one-launch walk (``helpers.check_all_rows``: the same call with the
all-rows kernels' byte limits at 0) on trees whose argmaxes the drafts often carry (walks go deep),
with exact ties inside a thread's entries, across tiles and across chunks, NaN / +inf / all -inf
rows on and off the walk, and in the interpreter and the GPU configurations.
"""

import dataclasses

import pytest
import torch

from helpers import check_all_rows, triton_verify


def greedy_batch(seed, B, N, V, dtype, ties=False):
    """Random trees of long branches whose drafts carry their parent row's argmax 60% of the time; with ``ties``
    logits on a coarse grid (many equal maxima: the first index must win)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, N, V, generator=gen, dtype=torch.float64)
    if ties:
        logits = torch.round(logits * 2)
    logits = logits.to(dtype)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    tokens = torch.randint(0, V, (B, N), generator=gen)
    top = logits.double().argmax(-1)
    for b in range(B):
        for i in range(1, N):
            parents[b, i] = int(torch.randint(max(0, i - 2), i, (), generator=gen))  # long branches
            if torch.rand((), generator=gen) < 0.6:
                tokens[b, i] = top[b, parents[b, i]]
    return tokens, parents, logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["fp32", "bf16", "fp16", "fp64"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_matches_reference(dtype, ties):
    deepest = 0
    for seed, (B, N, V, max_depth) in enumerate([(3, 9, 131, 4), (2, 12, 200, 8), (4, 5, 64, 0), (1, 1, 7, 3),
                                                 (2, 16, 257, 15)]):
        tokens, parents, logits = greedy_batch(seed, B, N, V, dtype, ties)
        out = check_all_rows(tokens, parents, logits, max_depth, what=(seed, B, N, V))
        deepest = max(deepest, int(out.accept_len.max()))
    assert deepest >= 3  # some walks went deep


def test_ties_inside_a_thread_and_across_tiles_and_chunks():
    """The interpreter's tiles hold 4 entries a thread, 64 a tile, and a row up to 3 chunks:
    equal maxima in one thread's entries, in two tiles of one thread, and in two chunks."""
    tv = triton_verify()
    V = 3 * 64 * 2  # 3 chunks of 2 tiles
    assert tv._greedy_chunking(1, 1, V, 64, None) == (3, 128)
    for spots in [(9, 10), (5, 69), (3, 131), (200, 130), (383, 0), (127, 128)]:
        logits = torch.zeros(1, 2, V)
        logits[0, :, list(spots)] = 5.0
        tokens = torch.tensor([[0, min(spots)]])
        parents = torch.tensor([[-1, 0]], dtype=torch.int32)
        out = check_all_rows(tokens, parents, logits, 1, what=spots)
        assert out.accept_len.tolist() == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
def test_bad_rows(dtype):
    """NaN, +inf and all -inf rows: status 1 and the root's finite argmax when the walk reaches
    them, nothing when it does not; a NaN or +inf in any chunk of a row, next to a larger
    finite entry or not."""
    B, N, V = 8, 6, 300
    tokens, parents, logits = greedy_batch(7, B, N, V, dtype)
    parents[:] = torch.tensor([-1, 0, 1, 2, 0, 4], dtype=torch.int32)  # a chain 0-1-2-3 and a branch 0-4-5
    top = logits.double().argmax(-1)
    for b in range(B):
        tokens[b, 1], tokens[b, 2], tokens[b, 3] = top[b, 0], top[b, 1], top[b, 2]
    logits[0, 0, 250] = float("nan")  # root, last chunk
    logits[1, 2, 3] = float("inf")  # on the walk
    logits[2, 5, 17] = float("nan")  # off the walk: no effect
    logits[3, 0, :] = float("-inf")  # no finite entry: fallback 0
    logits[4, 0, 100] = float("inf")  # root: the fallback is the finite argmax
    logits[5, 1, :] = float("-inf")
    logits[5, 1, 200] = float("nan")
    logits[6, 3, 299] = float("nan")  # the walk's last row, last entry
    logits[7, 0, 0] = float("nan")
    logits[7, 0, 1] = 1e30 if dtype != torch.bfloat16 else 1e30  # a larger finite entry beside the NaN
    out = check_all_rows(tokens, parents, logits, 5)
    assert out.status.tolist() == [1, 1, 0, 1, 1, 1, 1, 1]
    assert out.out_tokens[3, 0].item() == 0


def test_gpu_config_interpreted():
    """GPU_CONFIG's tile (2048 entries, 8 entries a thread at 8 warps) on rows of 2 and 3 tiles,
    the last one partial, several chunks a row, bf16 and fp32."""
    tv = triton_verify()
    config = tv.GPU_CONFIG
    assert tv._greedy_vec(config.greedy_block, config.num_warps) == 8
    for dtype in (torch.bfloat16, torch.float32):
        for seed, (B, N, V) in enumerate([(2, 4, 5000), (1, 3, 4097)]):
            tokens, parents, logits = greedy_batch(seed, B, N, V, dtype, ties=True)
            logits[0, 0, 4096] = logits[0, 0].max() + 1  # the max in the partial tile
            check_all_rows(tokens, parents, logits, 3, config=config, what=(dtype, V))


def test_chunking_on_an_h200():
    """About four programs an SM (132 SMs), whole tiles a chunk, one chunk a row at least."""
    tv = triton_verify()
    assert tv._greedy_chunking(1, 61, 49152, 2048, 132) == (8, 6144)  # 488 programs
    assert tv._greedy_chunking(8, 64, 128256, 2048, 132) == (2, 65536)  # 1024
    assert tv._greedy_chunking(64, 8, 128256, 2048, 132) == (2, 65536)
    assert tv._greedy_chunking(256, 64, 32000, 2048, 132) == (1, 32768)
    assert tv._greedy_chunking(1, 1, 1000, 1024, 132) == (1, 1024)


def test_which_kernel():
    """Greedy calls without a temperature take the all-rows kernel, filter tensors or not (they
    do not apply to greedy requests); draft rows, more than MAX_GREEDY_ROWS rows or more bytes than
    greedy_max_bytes take the walk (calls with a temperature: test_verify_temperature_rows.py)."""
    tv = triton_verify()
    calls = []
    launch, launch_rows = tv._launch, tv._launch_rows
    try:
        tv._launch = lambda *a, **k: (calls.append("walk"), launch(*a, **k))[1]
        tv._launch_rows = lambda *a, **k: (calls.append("rows"), launch_rows(*a, **k))[1]
        tokens, parents, logits = greedy_batch(0, 2, 5, 100, torch.float32)
        tv.verify(tokens, parents, logits, max_depth=3)
        tv.verify(tokens, parents, logits, max_depth=3, top_p=torch.ones(2))
        small = dataclasses.replace(tv.launch_config(), greedy_max_bytes=2 * 5 * 100 * 4 - 1)
        tv.verify(tokens, parents, logits, max_depth=3, _config=small)
        wide = greedy_batch(1, 1, tv.MAX_GREEDY_ROWS + 1, 8, torch.float32)
        tv.verify(*wide, max_depth=2)
    finally:
        tv._launch, tv._launch_rows = launch, launch_rows
    assert calls == ["rows", "rows", "walk", "walk"]


def test_tickets_left_zero():
    """The request counters are back to zero after a launch (the next launch, or a CUDA graph's
    replay, counts from there), over repeated calls of different shapes."""
    from eagle_kernels.triton._launch_config import tickets

    for seed, (B, N, V) in enumerate([(3, 4, 100), (5, 2, 300), (3, 4, 100)]):
        tokens, parents, logits = greedy_batch(seed, B, N, V, torch.float32)
        check_all_rows(tokens, parents, logits, 3)
        assert int(tickets(logits.device, B)[:8].abs().sum()) == 0
