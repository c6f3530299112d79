"""The Triton launchers' GPU launch configurations, executed under the interpreter.

Without a GPU the launchers pick their interpreter configurations (small tiles, fast to
interpret); the other Triton tests run those. Here each launcher runs with the configuration it
uses on a GPU (``GPU_CONFIG`` and, for tree_attention, every entry ``gpu_config`` can return),
on small shapes that still reach the paths those constants select, against
``eagle_kernels.reference`` with the checks of the other tests: exact tokens and the same
random stream for verify and draft_expand, the same tolerances for tree_attention. It also
checks that every tree_attention GPU configuration fits an H200's shared memory by estimate
(python_tests/ops/test_triton_compile.py checks the compiled kernels).
"""

import dataclasses
import math

import pytest
import torch
import triton

from eagle_kernels import _dispatch, reference
from eagle_kernels._types import VerifyOutput
from helpers import attention_inputs, top_p_margin


@pytest.fixture(autouse=True)
def interpreted_triton():
    """The launchers themselves, on CPU tensors: only under TRITON_INTERPRET=1."""
    fn, reason = _dispatch.implementation("verify", "triton", "cpu")
    if fn is None:
        pytest.skip(reason)


# ---------------------------------------------------------------------------------- verify
def assert_same(a, b, what=""):
    for field, x, y in zip(VerifyOutput._fields, a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), (what, field, x, y)


def verify_batch(dtype):
    """Six requests over V = 4200: two chunks per row (4096 entries, the tile of the max pass,
    and 104), so every pass is split and merged as on a GPU; five 1024-entry row tiles.
    Requests: greedy; peaked rows with temperature only (whole-row bonus draw) and with
    top-k + top-p (short candidate lists, sorted in 128 slots); flat rows with top-k 1500 and
    with top-p 0.95, whose kept sets outgrow the 1024-entry list (whole-row threshold
    searches); top-k 300 at T 0.9 (a list of several hundred entries, sorted in 1024 slots:
    about 4 s in the interpreter). The trees hold a chain of each parent's most likely tokens
    (walks go deep) and a token with p = 0."""
    B, N, V = 6, 4, 4200
    gen = torch.Generator().manual_seed(V)
    parents = torch.tensor([[-1, 0, 0, 1]] * B, dtype=torch.int32)
    logits = torch.randn(B, N, V, generator=gen, dtype=torch.float64)
    logits[:3] *= 4.0  # peaked rows: short candidate lists
    logits[:, :, 7::97] = float("-inf")
    tokens = torch.gather(logits.argmax(-1), 1, parents.clamp(min=0).long())  # chain 0 - 1 - 3
    tokens[:, 2] = 7  # a -inf logit: p(x) = 0 at the root
    sampling = dict(
        temperature=torch.tensor([0.0, 1.0, 0.5, 2.0, 0.9, 0.9]),
        top_k=torch.tensor([0, 0, 50, 1500, 0, 300], dtype=torch.int32),
        top_p=torch.tensor([0.9, 1.0, 0.8, 1.0, 0.95, 1.0]),  # a greedy row ignores top-p
        seed=torch.randint(-2**62, 2**62, (B,), generator=gen),
        offset=torch.randint(0, 2**40, (B,), generator=gen),
    )
    return tokens, parents, logits.to(dtype), sampling


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16],
                         ids=["fp32", "bf16"])
def test_verify_gpu_config(dtype):
    """verify with GPU_CONFIG: 16-candidate radix passes, 1024-entry candidate lists, 4096-entry
    max-pass tiles, 8 warps. bf16 searches 16 key bits (4 passes); fp32 searches all 32 (8
    passes), which doubles the interpreted search time, so it is marked slow."""
    from eagle_kernels.triton import verify as triton_verify

    config = triton_verify.GPU_CONFIG
    tokens, parents, logits, sampling = verify_batch(dtype)
    if top_p_margin(logits, sampling) < 1e-6:
        pytest.skip("a top-p mass within rounding of its threshold")
    max_depth = 4
    args = (tokens, parents, logits, max_depth, sampling["temperature"], sampling["top_k"], sampling["top_p"],
            sampling["seed"], sampling["offset"])
    launch = triton_verify._launch(*args, config)
    want = reference.verify(tokens, parents, logits, max_depth=max_depth, **sampling)
    assert_same(launch.output, want, "gpu config")
    # The batch reaches both row paths: candidate lists (peaked filtered rows) and the
    # whole-row search (the flat top-p and top-k 1500 rows). Only visited rows are read (-2
    # marks the others and greedy rows).
    counts = launch.cand_count
    visited = torch.zeros_like(counts, dtype=torch.bool)
    for b in range(len(counts)):
        visited[b, want.accept_nodes[b][want.accept_nodes[b] >= 0].long()] = True
    visited[0] = False  # greedy
    assert torch.equal(counts > -2, visited), counts
    assert (counts[2][visited[2]] >= 0).all() and (counts[3:5][visited[3:5]] == -1).all(), counts
    assert (counts[5][visited[5]] > triton_verify.SHORT_LIST).all(), counts
    assert (counts[1][visited[1]] == -1).all()  # temperature only: no list
    assert want.accept_len[0] == 2 and int(want.accept_len[1:].max()) >= 1
    assert triton_verify._chunking(len(counts), logits.shape[-1], config, None) == (4096, 2, 4096)
    # The public launcher takes the configuration as a private keyword.
    assert_same(triton_verify.verify(tokens, parents, logits, max_depth=max_depth, _config=config, **sampling),
                want, "public launcher")


def test_verify_chunking_on_an_h200():
    """The max pass's tile and the chunks per row the launcher picks on a GPU of 132 SMs: smaller
    tiles where a batch leaves most SMs idle, the 4096-entry tile where it does not."""
    from eagle_kernels.triton import verify as triton_verify

    config = triton_verify.GPU_CONFIG
    assert triton_verify._chunking(1, 49152, config, 132) == (1024, 48, 1024)  # SmolLM2's vocabulary, B 1
    assert triton_verify._chunking(1, 128256, config, 132) == (1024, 63, 2048)  # chunks of two tiles
    assert triton_verify._chunking(8, 49152, config, 132) == (1024, 24, 2048)
    assert triton_verify._chunking(8, 128256, config, 132) == (4096, 32, 4096)  # 1024: no more chunks
    assert triton_verify._chunking(32, 128256, config, 132) == (4096, 8, 16384)  # 1024 gives 9: not enough more
    assert triton_verify._chunking(1, 4200, config, None) == (4096, 2, 4096)  # no GPU: the configured tile


def test_verify_gpu_config_small_tiles():
    """GPU_CONFIG with the max pass's 1024-entry tiles (``_chunking`` at batch 1 on an H200):
    chunks of two tiles give the reference's output."""
    from eagle_kernels.triton import verify as triton_verify

    max_block = triton_verify.GPU_CONFIG.block_v
    config = dataclasses.replace(triton_verify.GPU_CONFIG, max_block=max_block)
    tokens, parents, logits, sampling = verify_batch(torch.bfloat16)
    if top_p_margin(logits, sampling) < 1e-6:
        pytest.skip("a top-p mass within rounding of its threshold")
    max_depth = 4
    launch = triton_verify._launch(tokens, parents, logits, max_depth, sampling["temperature"], sampling["top_k"],
                                   sampling["top_p"], sampling["seed"], sampling["offset"], config)
    assert_same(launch.output, reference.verify(tokens, parents, logits, max_depth=max_depth, **sampling),
                f"max_block {max_block}")
    assert triton_verify._chunking(6, logits.shape[-1], config, None)[0] == max_block


@pytest.mark.parametrize("max_block", [1024, 4096], ids=["tiles1024", "tiles4096"])
def test_verify_gpu_config_sampled_drafts(max_block):
    """The draft-aware rule's phases with GPU_CONFIG: the draft row's check over chunks of the
    draft row, one residual phase per rejected sampled child, the bonus from the last residual
    phase's chunk sums or from a phase of its own (after a deterministic rejection, or an
    invalid draft row), in the GPU's 256-entry tiles, over 2 (4096-entry tiles) or 3 chunks of
    a 4200-entry row and a 1100-entry draft vocabulary (d2t). Trees of sampled and
    deterministic children, invalid draft rows, top-k / top-p: tokens, random stream and status
    as the reference's."""
    from test_verify_sampled import sampled_tree_batch

    from eagle_kernels.triton import verify as triton_verify

    config = dataclasses.replace(triton_verify.GPU_CONFIG, max_block=max_block)
    B, N, V, Vd = 6, 7, 4200, 1100
    tokens, parents, logits, sampling = sampled_tree_batch(3, B, N, V, Vd, dtype=torch.bfloat16)
    max_depth = 4
    assert triton_verify._chunking(B, V, config, None)[1] == (2 if max_block == 4096 else 3)
    out = triton_verify.verify(tokens, parents, logits, max_depth=max_depth, _config=config, **sampling)
    want = reference.verify(tokens, parents, logits, max_depth=max_depth, **sampling)
    assert_same(out, want, f"max_block {max_block}")
    assert set(want.status.tolist()) >= {0, 2}  # invalid draft rows among valid ones


# ---------------------------------------------------------------------------- draft_expand
def draft_logits(B, M, V, top_k, dtype, seed):
    """N(0, 1.5) logits (no clamp: few ties, so the GPU chunks take the threshold compaction)
    with each row's top ``top_k`` planted 0.5 apart from 10 (exact in every dtype) at random
    ids, some of them in the tail chunk."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, M, V, generator=gen, dtype=torch.float64) * 1.5
    for b in range(B):
        for m in range(M):
            ids = torch.randperm(V, generator=gen)[:top_k]
            logits[b, m, ids] = 10.0 + 0.5 * torch.arange(top_k - 1, -1, -1, dtype=torch.float64)
    logits[0, 0, V - 3:] = 20.0  # ties at the top, in the partial last chunk
    return logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["fp32", "bf16", "fp16", "fp64"])
def test_draft_expand_gpu_config(dtype):
    """V = 25000 spans two of the GPU's 16384-entry chunks (the last partial, masked loads), each
    seen as 64 registers x 256 threads (runs of 16 bytes) with 16 super-groups and 32 survivor
    slots; the merge takes all frontier rows in one block. Row (0, 1) is flat (plain rounds over
    the chunk, which read it again: unmasked in the first chunk, masked in the last; bf16 as
    int32 words, fp16 as 16-bit runs)."""
    from eagle_kernels.triton import draft_expand as triton_draft_expand

    config = triton_draft_expand.GPU_CONFIG
    B, M, V, top_k = 2, 3, 25000, 8
    assert math.ceil(V / config.block_v) >= 2
    assert triton_draft_expand.chunk_shape(config.block_v, top_k) == triton_draft_expand.ChunkShape(8, 256, 16, 32)
    logits = draft_logits(B, M, V, top_k, dtype, seed=V)
    logits[0, 1] = 0.25
    gen = torch.Generator().manual_seed(1)
    fs = -3.0 * torch.rand(B, M, generator=gen)
    d2t = torch.randint(0, 1000, (V,), generator=gen)
    out = triton_draft_expand.draft_expand(logits, fs, top_k, d2t=d2t, _config=config)
    ref = reference.draft_expand(logits, fs, top_k, d2t=d2t)
    assert out.tokens.tolist() == ref.tokens.tolist()
    assert out.frontier.tolist() == ref.frontier.tolist()
    tol = dict(atol=1e-5, rtol=1e-6) if dtype == torch.float64 else dict(atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.scores, ref.scores, **tol)
    # Three tied maxima in the partial last chunk, smaller id first.
    assert out.tokens[0, :3].tolist() == [i + int(d2t[i]) for i in (V - 3, V - 2, V - 1)]


def test_draft_expand_block_v_on_an_h200():
    """Entries per chunk program on a GPU of 132 SMs: the configured 16384 where the launch fills
    the SMs, smaller chunks (down to 2048) where few rows would leave them idle; sampled launches
    and the interpreter keep their configured sizes; never so small that the merge's candidates
    overflow."""
    from eagle_kernels.triton import draft_expand as de

    config = de.GPU_CONFIG

    def block_v(rows, V, top_k=8, sampled=False, sms=132):
        return de._block_v(rows, V, top_k, config, sampled, sms)

    assert block_v(8, 32000) == 2048  # batch 1, 8 frontier rows of the Llama-3-8B-shaped head: 128 programs
    assert block_v(1, 6144) == block_v(8, 6144) == 2048  # SmolLM2's draft vocabulary
    assert block_v(64, 32000) == 8192  # batch 8: 256 programs
    assert block_v(64, 128256) == 16384  # the goal shape: 512 programs
    assert block_v(8, 32000, sampled=True) == config.sampled_block_v
    assert block_v(8, 32000, sms=None) == 16384
    assert block_v(1, 128256, top_k=1100) == 4096  # 63 chunks x 1100 candidates would overflow the merge


def test_draft_expand_gpu_config_small_chunks():
    """The GPU configuration with 2048-entry chunks (``_block_v`` at batch 1 on an H200): 4 warps
    of 128 threads, three chunks a row of V = 5000 (the last partial), the reference's output."""
    from eagle_kernels.triton import draft_expand as triton_draft_expand

    config = dataclasses.replace(triton_draft_expand.GPU_CONFIG, block_v=triton_draft_expand.MIN_GPU_BLOCK_V)
    B, M, V, top_k = 1, 8, 5000, 8
    assert triton_draft_expand.chunk_shape(config.block_v, top_k) == triton_draft_expand.ChunkShape(4, 128, 16, 32)
    logits = draft_logits(B, M, V, top_k, torch.bfloat16, seed=V)
    gen = torch.Generator().manual_seed(2)
    fs = -3.0 * torch.rand(B, M, generator=gen)
    out = triton_draft_expand.draft_expand(logits, fs, top_k, _config=config)
    ref = reference.draft_expand(logits, fs, top_k)
    assert out.tokens.tolist() == ref.tokens.tolist() and out.frontier.tolist() == ref.frontier.tolist()
    torch.testing.assert_close(out.scores, ref.scores, atol=1e-4, rtol=1e-5)


# -------------------------------------------------------------------------- tree_attention
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def random_mask(B, N, seed):
    """int64 [B, N, W] tree mask of random parents: each node sees itself and its ancestors."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, N, (N + 63) // 64, dtype=torch.int64)
    for b in range(B):
        seen = []
        for i in range(N):
            parent = int(torch.randint(0, i, (1,), generator=gen)) if i else -1
            seen.append({i} | (seen[parent] if parent >= 0 else set()))
            for j in seen[i]:
                mask[b, i, j // 64] |= -(1 << 63) if j % 64 == 63 else 1 << (j % 64)
    return mask


def check_attention(config, B, N, prefix, heads, D, dtype, page, causal, seed, num_splits=None):
    from eagle_kernels.triton import tree_attention as triton_tree_attention

    q, k, v, seqlens, table = attention_inputs(B, N, prefix, heads, D, dtype, page, seed)
    mask = None if causal else random_mask(B, N, seed)
    out = triton_tree_attention._launch(q, k, v, seqlens, mask, block_table=table, num_splits=num_splits,
                                        config=config)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = reference.tree_attention(q.double(), k.double(), v.double(), seqlens, mask, block_table=table)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])


def layout_id(page):
    return "contiguous" if page is None else f"page{page}"


@pytest.mark.parametrize("causal", [False, True], ids=["tree", "causal"])
@pytest.mark.parametrize("page", [None, 16], ids=layout_id)
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tree_attention_gpu_config(dtype, D, page, causal):
    """The configuration the launcher picks on a GPU for these shapes (bf16 through the
    interpreter's upcast dot): 40 nodes of 4 query heads per KV head are 160 rows, two 128-row
    blocks of 16-bit inputs (the second partial; at D 128, contiguous, tree mask: the goal
    layout's configuration, GPU_CONFIG), 64-row blocks of fp32 (three per KV head, the last
    partial). The 150-entry prefix takes whole key tiles and a partial one."""
    from eagle_kernels.triton import tree_attention as tta

    B, N, prefix, heads = 2, 40, 150, (8, 2)
    config = tta.gpu_config(N, heads[0] // heads[1], D, dtype, causal, page is not None)
    assert (config.block_m, config.block_k) == ((128, 64) if dtype == torch.bfloat16 else (64, 16))
    if dtype == torch.bfloat16 and D == 128 and page is None and not causal:
        assert config == tta.GPU_CONFIG == tta.gpu_config(64, 4, 128, torch.float16, False, False)
    check_attention(config, B, N, prefix, heads, D, dtype, page, causal, seed=D + N)


@pytest.mark.parametrize("page,causal,splits", [(None, False, 1), (16, True, 2)],
                         ids=["contiguous-tree", "page16-causal-2splits"])
def test_tree_attention_wide_config(page, causal, splits):
    """The 256-row block the launcher picks with enough (request, KV head) pairs (B 8 and up at
    Llama-3-8B heads): 64 nodes of 4 query heads fill it (one node block a pair), against the
    reference with whole and partial prefix tiles; paged and split 2 ways as at B 8."""
    from eagle_kernels.triton import tree_attention as tta

    config = tta.GPU_CONFIG_WIDE
    assert config.block_m == 256
    if tta.WIDE_BLOCKS_SUPPORTED:
        assert config == tta.gpu_config(64, 4, 64, torch.bfloat16, causal, page is not None, heads=tta.H200_SMS)
    check_attention(config, 2, 64, 150, (8, 2), 64, torch.bfloat16, page, causal, seed=256 + splits,
                    num_splits=splits)


def test_tree_attention_wide_blocks_rule():
    """256-row blocks only where their programs need at most 2 prefix splits on the device: B 8 /
    B 32 at Llama-3-8B heads (64 / 256 pairs) but not B 1 (8 pairs), 16-bit and D <= 128 only;
    without ``heads`` (the tests' and the audit's default) at most 128 rows; none with triton
    before 3.9 (3.6 spills in their loop)."""
    from eagle_kernels.triton import tree_attention as tta

    wide = 256 if tta.WIDE_BLOCKS_SUPPORTED else 128
    rows = lambda heads, dtype=torch.bfloat16, D=128: tta.gpu_config(  # noqa: E731
        64, 4, D, dtype, False, True, heads=heads).block_m
    assert [rows(h) for h in (None, 8, 32, 44, 45, 64, 256)] == [128, 128, 128, 128, wide, wide, wide]
    assert rows(64, torch.float16) == wide and rows(64, torch.float32) == 64 and rows(64, D=256) == 64
    assert tta.gpu_config(16, 4, 128, torch.bfloat16, False, True, heads=256).block_m == 64  # N x group rows
    assert not tta.wide_blocks(8)
    assert tta.wide_blocks(64) == tta.wide_blocks(8, sms=16) == tta.WIDE_BLOCKS_SUPPORTED


def every_tile_shape():
    """One configuration per distinct (block_m, block_k, head dim class) that gpu_config can
    return: warps, stages and register caps mean nothing to the interpreter."""
    from eagle_kernels.triton import tree_attention as tta

    shapes = {}
    for config, layouts in tta.every_gpu_config().items():
        D = 256 if all(layout[0] == 256 for layout in layouts) else 64
        shapes.setdefault((config.block_m, config.block_k, D), config)
    return [(config, D) for (_, _, D), config in sorted(shapes.items())]


@pytest.mark.parametrize("gpu", [False, True], ids=["interpreter-config", "gpu-config"])
@pytest.mark.parametrize("splits", [3, 20], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tree_attention_folded_merge(dtype, splits, gpu):
    """Splits merged by each block's last program (a ticket counter) against the reference and
    against the merge launch: the same bits where the folding program reads every split in one
    round (the merge launch's arithmetic), within a few fp32 ulps (bf16: the output's rounding of
    them) where it reads them a few splits a round (the 128-row GPU block; 20 splits of 16
    rows). The tickets are zero again after each launch, so a second launch (as a graph replay)
    gives the same bits."""
    from eagle_kernels.triton import tree_attention as tta
    from eagle_kernels.triton._launch_config import tickets

    config = tta.GPU_CONFIG if gpu else tta.INTERPRETER_CONFIG
    B, N, prefix, heads, D = 2, 9, 1300, (6, 2), 64
    q, k, v, seqlens, table = attention_inputs(B, N, prefix, heads, D, dtype, 16, seed=splits)
    mask = random_mask(B, N, seed=splits)
    run = lambda fold: tta._launch(q, k, v, seqlens, mask, block_table=table, num_splits=splits,  # noqa: E731
                                   fold_merge=fold, config=config)
    folded = run(True)
    assert not tickets(q.device, 8)[:8].any()
    want = reference.tree_attention(q.double(), k.double(), v.double(), seqlens, mask, block_table=table)
    torch.testing.assert_close(folded.double(), want, **TOL[dtype])
    launched = run(False)
    if tta.fold_chunk(splits, config.block_m, 64, config.num_warps) >= triton.next_power_of_2(splits):
        assert torch.equal(folded, launched)
    else:
        # fp32: a few ulps; bf16: the output's rounding of those (one bf16 ulp).
        torch.testing.assert_close(folded, launched, **({"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32
                                                        else {"atol": 1e-3, "rtol": 2**-7}))
    assert torch.equal(run(True), folded)


def test_tree_attention_fill_rule():
    """gpu_config with the cache's capacity: few (request, KV head) pairs over a short cache take
    smaller row blocks until blocks x splits fill half the SMs (SmolLM2-135M's verify pass: 16
    rows at a 384-entry cache, 32 at 1,085; B 8: 64; a small head tree: 16), and further where
    that leaves partials for a merge launch while smaller blocks fold them (SmolLM2 at 4,157: 32
    rows, 12 splits, not 128 rows x 16 splits; at 8,253 their K/V reads are too many), whose
    programs, more than the SMs, then take 2 warps a block; the goal
    shapes (Llama-3-8B heads, N 64, B 1 / 8 / 32 at 4k) keep theirs; fp32 and head dim 256 never
    change."""
    from eagle_kernels.triton import tree_attention as tta

    def rows(B, N, heads, D, capacity, dtype=torch.bfloat16):
        group = heads[0] // heads[1]
        return tta.gpu_config(N, group, D, dtype, False, True, heads=B * heads[1], capacity=capacity).block_m

    smol, llama = (9, 3), (32, 8)
    assert [rows(1, 61, smol, 64, c) for c in (384, 1085, 4157, 8253)] == [16, 32, 32, 128]

    def merge_launch(B, N, heads, D, capacity):
        group = heads[0] // heads[1]
        config = tta.gpu_config(N, group, D, torch.bfloat16, False, False, heads=B * heads[1], capacity=capacity)
        layout = tta.split_layout(N, group, B * heads[1], capacity, config)
        return layout.splits > 1 and not tta.folds_merge(layout.splits, layout.rows, D, 2)

    assert not merge_launch(1, 61, smol, 64, 4157) and merge_launch(1, 61, smol, 64, 8253)

    def warps(B, N, heads, D, capacity):
        group = heads[0] // heads[1]
        return tta.gpu_config(N, group, D, torch.bfloat16, False, False, heads=B * heads[1],
                              capacity=capacity).num_warps

    # 32-row blocks take 2 warps where the launch has more programs than SMs (21 x 12 at 4,157),
    # not at 1,085 (21 x 4); other blocks keep theirs
    assert [warps(1, 61, smol, 64, c) for c in (384, 1085, 4157)] == [4, 4, 2]
    assert warps(1, 61, smol, 64, 8253) == 8
    assert merge_launch(1, 64, llama, 128, 4160)  # 64- or 32-row blocks would read 68 / 134 MB of K/V
    assert rows(8, 61, smol, 64, 384) == 64 and rows(1, 8, smol, 64, 300) == 16 and rows(1, 1, smol, 64, 4097) == 16
    assert rows(1, 64, llama, 128, 1088) == 64
    wide = 256 if tta.WIDE_BLOCKS_SUPPORTED else 128
    assert [rows(B, 64, llama, 128, 4160) for B in (1, 8, 32)] == [128, wide, wide]
    assert [rows(1, 64, llama, 128, 4160, torch.float32), rows(1, 61, smol, 256, 384)] == [64, 64]
    assert rows(1, 61, smol, 64, None) == 128  # without the capacity: rows_for's block


@pytest.mark.parametrize("prefix", [250, 1000, 4090], ids=lambda p: f"prefix{p}")
def test_tree_attention_filled_config_runs(prefix):
    """The configuration and split count the launcher picks on an H200 for SmolLM2-135M's 61-node
    verify pass at B 1 (16-row blocks and no split at a 316-entry cache; 32-row blocks, 4 splits
    merged in their last programs at 1,066, 12 at 4,156 in 2-warp blocks), run interpreted against the
    reference (the fold reads 4 splits a round either way)."""
    from eagle_kernels.triton import tree_attention as tta

    N, heads, D = 61, (9, 3), 64
    config = tta.gpu_config(N, 3, D, torch.bfloat16, False, False, heads=3, capacity=prefix + N + 5)
    splits = tta.split_layout(N, 3, 3, prefix + N + 5, config).splits
    expected = {250: (16, 1, 4), 1000: (32, 4, 4), 4090: (32, 12, 2)}[prefix]
    assert (config.block_m, splits, config.num_warps) == expected
    assert splits == 1 or tta.fold_chunk(splits, config.block_m, D, config.num_warps) == 4
    check_attention(config, 1, N, prefix, heads, D, torch.bfloat16, None, False, seed=prefix, num_splits=splits)


def test_tree_attention_merge_choice(monkeypatch):
    """folds_merge: a decoded token's rows (SmolLM2-135M heads, 32 splits) and a 61-node tree
    split 8 ways fold; Llama-3-8B's 128-row blocks split 8 ways (256 KiB of partials), 256-row
    blocks and unsplit launches do not. The launcher follows it: no merge launch when it folds."""
    from eagle_kernels.triton import tree_attention as tta

    assert tta.folds_merge(32, 3, 64, 2) and tta.folds_merge(8, 126, 64, 2)
    assert not tta.folds_merge(8, 128, 128, 2) and not tta.folds_merge(2, 256, 128, 2)
    assert not tta.folds_merge(1, 3, 64, 2) and not tta.folds_merge(16, 126, 64, 2)
    merges = []
    real = tta._tree_attention_merge_kernel

    class Recorder:
        def __getitem__(self, grid):
            merges.append(grid)
            return real[grid]

    monkeypatch.setattr(tta, "_tree_attention_merge_kernel", Recorder())
    q, k, v, seqlens, table = attention_inputs(1, 1, 300, (9, 3), 64, torch.bfloat16, None, seed=4)
    out = tta._launch(q, k, v, seqlens, None, num_splits=4)
    assert not merges
    want = reference.tree_attention(q.double(), k.double(), v.double(), seqlens, None)
    torch.testing.assert_close(out.double(), want, **TOL[torch.bfloat16])
    tta._launch(q, k, v, seqlens, None, num_splits=4, fold_merge=False)
    assert len(merges) == 1


@pytest.mark.parametrize("config,D", every_tile_shape(),
                         ids=lambda x: f"D{x}" if isinstance(x, int) else f"m{x.block_m}k{x.block_k}")
def test_tree_attention_every_gpu_config(config, D):
    """Each tile shape ``gpu_config`` can return, once, on a tiny paged tree-mask case with
    the flash-decoding merge of two splits (bf16; the D 256 one at head dim 256)."""
    check_attention(config, 1, 9, 70, (6, 2), D, torch.bfloat16, 16, False, seed=config.block_m + D, num_splits=2)


@pytest.mark.parametrize("causal", [False, True], ids=["tree", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_tree_attention_configs_fit_shared_memory(dtype, causal):
    """Every configuration the launcher can choose, for each head dim, dtype, mask kind and
    cache layout, fits an H200 block's shared memory by the estimate (which
    test_tree_attention_compile.py checks against the compiled kernels). The goal layout
    (128-row 16-bit blocks, 64-key tiles, 3 stages, D 128, contiguous cache, tree mask) takes
    136,192 B by the estimate (135,200 compiled): a tile's mask words are one per row (the
    earlier 128-row block's [rows, keys] tile of words took 262,144 B at 3 stages)."""
    from eagle_kernels.triton import tree_attention as tta

    element_size = torch.empty((), dtype=dtype).element_size()
    configs = tta.every_gpu_config()
    for D in (64, 128, 256):
        for paged in (False, True):
            picked = tta.gpu_config(64, 4, D, dtype, causal, paged)
            assert picked in configs
            assert picked.shared_bytes(D, element_size, causal, paged) + 1024 <= tta.SHARED_MEMORY_BUDGET
    for config, layouts in configs.items():
        for D, dtype_, causal_, paged in layouts:
            size = torch.empty((), dtype=dtype_).element_size()
            assert config.shared_bytes(D, size, causal_, paged) + 1024 <= tta.SHARED_MEMORY_BUDGET, config
    # Rows per block: every (node, query head) pair of a KV head up to 128 rows, then node blocks.
    assert [tta.gpu_config(N, 4, 128, torch.bfloat16, causal, False).block_m for N in (1, 7, 16, 64, 65, 256)] == [
        16, 32, 64, 128, 128, 128]
    if element_size == 2 and not causal:
        assert tta.GPU_CONFIG.shared_bytes(128, 2, False, False) == 136_192  # compiled: 135,200


@pytest.mark.parametrize("page", [None, 16], ids=layout_id)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_tree_attention_lazy_rescale(dtype, page):
    """The conditional rescale of the goal configuration (GPU_CONFIG): keys 64-127 scaled by 1.5
    raise the rows' maxima by less than the slack (2^8), so the stale maxima stay and the 16-bit
    probabilities of the PV product exceed 1; keys 128-191 scaled by 40 raise them far beyond it
    (2^128 would overflow without a rescale), so the running maxima, sums and accumulators move in
    mid-prefix. Against the float64 reference, with a tree mask, in both cache layouts."""
    from eagle_kernels.triton import tree_attention as tta

    B, N, prefix, heads, D = 1, 12, 200, (8, 2), 64
    q, k, v, seqlens, table = attention_inputs(B, N, prefix, heads, D, dtype, page, seed=11)
    t = torch.arange(prefix)
    scale = torch.ones(prefix, dtype=dtype)
    scale[64:128] = 1.5
    scale[128:192] = 40.0
    if table is None:
        k[0, :prefix] *= scale[:, None, None]
    else:
        slots = (table[0].long()[t // page], t % page)
        k[slots] *= scale[:, None, None]
    mask = random_mask(B, N, seed=11)
    out = tta._launch(q, k, v, seqlens, mask, block_table=table, config=tta.GPU_CONFIG)
    want = reference.tree_attention(q.double(), k.double(), v.double(), seqlens, mask, block_table=table)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
    # The rows' running maxima do rise past the slack in mid-prefix (not only at the first tile).
    scores = torch.einsum("nhd,thd->nht", q[0].double().view(N, 2, 4, D).flatten(1, 2),
                          k[0, :prefix].double().repeat_interleave(4, 1) if table is None
                          else k[slots].double().repeat_interleave(4, 1)) * D ** -0.5 / math.log(2)
    running = scores.cummax(-1).values  # log2 units, per (node, head) row
    assert 64 % tta.GPU_CONFIG.block_k == 0  # the key ranges above are whole tiles
    assert (running[..., 127] - running[..., 63]).max() < 8 < (running[..., 191] - running[..., 127]).max()


OFFSET_CASES = [
    # page (None: contiguous), int32 offsets, K and V with the same strides, flash-decoding splits
    (None, True, True, None),
    (None, False, False, None),
    (16, True, True, None),
    (16, False, False, 2),
    (8, True, False, None),
    (128, True, True, 2),
    (128, False, True, None),
    (24, True, True, None),
]


@pytest.mark.parametrize("page,int32,shared,splits", OFFSET_CASES,
                         ids=lambda x: None if x is None or isinstance(x, bool) else str(x))
def test_tree_attention_offset_paths(monkeypatch, page, int32, shared, splits):
    """The K/V offsets of whole prefix tiles: contiguous (TILE_MODE 1), pages that divide the
    64-key tile (16, 8: 2), tiles inside one page (128: 3), other page sizes (24: 0, the general
    gather); int32 offsets and int64 ones (the launcher's size test forced off); K and V with the
    same strides (one offset for both) or not (V a view of a wider buffer). bf16, 150-entry
    prefixes: whole tiles and a partial one, with the split path where the split starts
    mid-page."""
    from eagle_kernels.triton import tree_attention as tta

    if not int32:
        monkeypatch.setattr(tta, "_fits_int32", lambda cache: False)
    B, N, prefix, heads, D, dtype = 2, 9, 150, (4, 2), 64, torch.bfloat16
    q, k, v, seqlens, table = attention_inputs(B, N, prefix, heads, D, dtype, page, seed=page or 5)
    if not shared:
        wide = torch.full(v.shape[:-1] + (2 * D,), float("nan"), dtype=dtype)
        wide[..., :D] = v
        v = wide[..., :D]
        assert v.stride() != k.stride()
    mask = random_mask(B, N, seed=3)
    out = tta._launch(q, k, v, seqlens, mask, block_table=table, num_splits=splits)
    want = reference.tree_attention(q.double(), k.double(), v.double(), seqlens, mask, block_table=table)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])


@pytest.mark.parametrize("splits", [None, 2], ids=lambda s: f"splits{s}")
def test_tree_attention_row_without_keys(splits):
    """bf16 (the lazy rescale, whose running maxima start at a finite floor): with an empty
    prefix, a node whose mask row is empty sees no key and outputs zeros, and the other rows of
    its block, whose first keys come later, match the reference; alone and through the split merge."""
    from eagle_kernels.triton import tree_attention as tta

    B, N, heads, D, dtype = 1, 6, (4, 2), 64, torch.bfloat16
    q, k, v, seqlens, table = attention_inputs(B, N, 0, heads, D, dtype, 16, seed=21)
    mask = random_mask(B, N, seed=21)
    mask[0, 2] = 0
    out = tta._launch(q, k, v, seqlens, mask, block_table=table, num_splits=splits, config=tta.GPU_CONFIG)
    want = reference.tree_attention(q.double(), k.double(), v.double(), seqlens, mask, block_table=table)
    rest = [i for i in range(N) if i != 2]  # the reference's row 2 is 0 / 0
    torch.testing.assert_close(out[:, rest].double(), want[:, rest], **TOL[dtype])
    assert torch.all(out[0, 2] == 0)


def test_tree_attention_negative_scale():
    """The goal configuration (the lazy rescale: maxima of raw scores, the scale folded into the
    exponent) with a negative scale, which the launcher runs as |scale| on -q; bf16, against the
    reference."""
    from eagle_kernels.triton import tree_attention as tta

    B, N, prefix, heads, D, dtype = 1, 9, 150, (4, 2), 64, torch.bfloat16
    q, k, v, seqlens, table = attention_inputs(B, N, prefix, heads, D, dtype, 16, seed=17)
    mask = random_mask(B, N, seed=17)
    sm_scale = -0.2
    out = tta._launch(q, k, v, seqlens, mask, block_table=table, sm_scale=sm_scale, config=tta.GPU_CONFIG)
    want = reference.tree_attention(q.double(), k.double(), v.double(), seqlens, mask, block_table=table,
                                    sm_scale=sm_scale)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
