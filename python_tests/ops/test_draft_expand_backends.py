"""draft_expand, backend-specific cases beyond test_draft_expand.py: the C++ kernel's ISA paths,
large vocabularies and top_k, NaN / +inf / all -inf rows against the reference, the Triton
multi-chunk merge, and the GPU path (CUDA tensors, skipped without a device)."""

import numpy as np
import pytest
import torch

from eagle_kernels import reference
from helpers import (
    SCORE_TOL,
    assert_matches,
    check_invariants,
    naive_draft_expand,
    planted_logits,
    random_frontier_scores,
)

ISAS = ("native", "avx512-bf16", "avx512", "avx512-ymm", "avx2", "scalar", "portable")  # portable = scalar


def assert_same_as_reference(out, ref):
    """Tokens and frontier identical; scores equal up to float rounding, NaN where the
    reference has NaN."""
    assert out.tokens.tolist() == ref.tokens.tolist()
    assert out.frontier.tolist() == ref.frontier.tolist()
    torch.testing.assert_close(out.scores, ref.scores, equal_nan=True, **SCORE_TOL[torch.float32])


# ------------------------------------------------------------------------- C++ ISA paths
@pytest.fixture(params=ISAS)
def cpp_isa(request, monkeypatch, op_impl, backend):
    """The cpp kernel with EAGLE_KERNELS_CPU_ISA capping its inner loop (native = best the CPU
    has); other backends run once, as ``native``."""
    if backend != "cpp" and request.param != "native":
        pytest.skip("ISA cap only applies to the cpp backend")
    if request.param != "native":
        monkeypatch.setenv("EAGLE_KERNELS_CPU_ISA", request.param)
    return op_impl("draft_expand")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("V", [1, 7, 33, 64, 65, 1031], ids=lambda v: f"V{v}")
def test_vector_tails(cpp_isa, V, dtype):
    """Vocabularies around the SIMD block sizes (32 and 64 entries)."""
    top_k = min(V, 5)
    logits = planted_logits(2, 3, V, top_k, dtype, V)
    fs = random_frontier_scores(2, 3, V)
    out = cpp_isa(logits, fs, top_k)
    check_invariants(out, fs, top_k, V)
    assert_matches(out, naive_draft_expand(logits, fs, top_k), reference.draft_expand(logits, fs, top_k),
                   dtype, top_k)


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_monotone_rows(cpp_isa, order):
    """Ascending logits make every entry enter the top-k buffer (and raise the running max);
    descending ones none after the first k."""
    V, top_k = 2000, 8
    row = torch.linspace(-5, 5, V, dtype=torch.float64)
    if order == "descending":
        row = row.flip(0)
    logits = row.expand(1, 2, V).contiguous().float()
    fs = torch.tensor([[0.0, -1.0]])
    out = cpp_isa(logits, fs, top_k)
    assert_matches(out, naive_draft_expand(logits, fs, top_k), reference.draft_expand(logits, fs, top_k),
                   torch.float32, top_k)


def test_large_top_k(cpp_isa):
    """top_k above the C++ buffer (64): ids ranked by a partial sort instead."""
    V, top_k = 1031, 100
    logits = planted_logits(2, 2, V, top_k, torch.float32, 5)
    fs = random_frontier_scores(2, 2, 5)
    out = cpp_isa(logits, fs, top_k)
    check_invariants(out, fs, top_k, V)
    assert_matches(out, naive_draft_expand(logits, fs, top_k), reference.draft_expand(logits, fs, top_k),
                   torch.float32, top_k)


@pytest.mark.parametrize("top_k", [1, 7, 32], ids=lambda k: f"k{k}")
def test_many_ties(cpp_isa, backend, top_k):
    """16 distinct logit levels over a few thousand ids: the k-th value ties with hundreds of
    entries, so the buffer's strict threshold decides which ids get in (smaller ids first)."""
    V = 4099 if backend == "cpp" else 1031
    gen = torch.Generator().manual_seed(top_k)
    logits = (torch.randint(0, 16, (2, 3, V), generator=gen) * 0.25).to(torch.bfloat16)
    fs = torch.zeros(2, 3)
    out = cpp_isa(logits, fs, top_k)
    naive = naive_draft_expand(logits, fs, top_k)
    np.testing.assert_array_equal(out.tokens.numpy(), naive[0])
    assert_same_as_reference(out, reference.draft_expand(logits, fs, top_k))


def test_non_contiguous_inputs(backend, op_impl):
    fn = op_impl("draft_expand")
    base = planted_logits(3, 2, 500, 4, torch.float32, 2)  # [M, B, V] viewed as [B, M, V]
    logits = base.transpose(0, 1)
    fs = random_frontier_scores(3, 2, 2).t()
    assert not logits.is_contiguous() and not fs.is_contiguous()
    out = fn(logits, fs, 4)
    want = fn(logits.contiguous(), fs.contiguous(), 4)
    for got, ref in zip(out, want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert_same_as_reference(out, reference.draft_expand(logits.contiguous(), fs.contiguous(), 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vocab_262144_top_k_32(backend, op_impl, dtype):
    if backend != "cpp":
        pytest.skip("V = 262144 only on the C++ backend (the interpreter is too slow)")
    fn = op_impl("draft_expand")
    V, top_k = 262144, 32
    logits = planted_logits(1, 2, V, top_k, dtype, 262)
    fs = random_frontier_scores(1, 2, 262)
    out = fn(logits, fs, top_k)
    check_invariants(out, fs, top_k, V)
    assert_matches(out, naive_draft_expand(logits, fs, top_k), reference.draft_expand(logits, fs, top_k),
                   dtype, top_k)


# ------------------------------------------------------------------ NaN / inf rows, all backends
def _bad_rows(dtype):
    """Rows: 0 NaN, 1 +inf, 2 all -inf, 3 ordinary, 4 NaN and +inf together; two requests."""
    V = 300
    logits = planted_logits(2, 5, V, 4, dtype, 9)
    logits[0, 0, 17] = float("nan")
    logits[0, 1, 250] = float("inf")
    logits[0, 2] = float("-inf")
    logits[0, 4, 3] = float("nan")
    logits[0, 4, 5] = float("inf")
    logits[1, 0, 299] = float("nan")  # last entry: the tail of every block layout
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["fp32", "bf16", "fp16", "fp64"])
def test_nan_and_inf_rows_like_reference(cpp_isa, dtype):
    """A row with NaN or +inf, or no entry above -inf, has all log-probs NaN: ids 0..k-1 with NaN
    scores; NaN ranks as -inf in the frontier. Everything as the reference computes it."""
    logits = _bad_rows(dtype)
    fs = random_frontier_scores(2, 5, 9)
    out = cpp_isa(logits, fs, 4)
    ref = reference.draft_expand(logits, fs, 4)
    assert_same_as_reference(out, ref)
    for m in (0, 1, 2, 4):
        assert out.tokens[0, m * 4:(m + 1) * 4].tolist() == [0, 1, 2, 3]
        assert bool(out.scores[0, m * 4:(m + 1) * 4].isnan().all())
    assert bool(out.scores[0, 12:16].isfinite().all())
    # Request 0: only node 3 is finite, so its four candidates are the frontier.
    assert out.frontier[0].tolist() == [12, 13, 14, 15]


# ---------------------------------------------------------------------- Triton chunk merge
@pytest.mark.parametrize("block_v,V,top_k", [(16, 1000, 4), (16, 203, 20), (32, 50, 50)],
                         ids=["b16V1000k4", "b16V203k20", "b32V50k50"])
def test_triton_many_chunks(backend, op_impl, block_v, V, top_k):
    """Small chunks: many partials to merge, and chunks holding fewer than top_k entries."""
    if backend != "triton":
        pytest.skip("triton launcher only")
    op_impl("draft_expand")  # skips when triton is unavailable
    from eagle_kernels.triton.draft_expand import DraftExpandConfig, _launch

    logits = planted_logits(2, 3, V, top_k, torch.float32, block_v + V)
    logits[1, 2, :V // 2] = float("-inf")
    fs = random_frontier_scores(2, 3, V)
    out = _launch(logits, fs, top_k, None, DraftExpandConfig(block_v=block_v))
    naive = naive_draft_expand(logits, fs, top_k)
    np.testing.assert_array_equal(out.tokens.numpy(), naive[0])
    ref = reference.draft_expand(logits, fs, top_k)
    assert_same_as_reference(out, ref)


def _threshold_rows(V, block_v, top_k):
    """[1, 7, V] float32 rows aimed at the chunk threshold: random; the top ``top_k`` in one
    thread's registers (more survivors than a thread compacts: plain rounds); ties at the max
    spread over threads (ranked by id); ties at the max in two threads (plain rounds); a flat row
    (plain rounds); ascending values (the best entries in the last chunk); half -inf."""
    from eagle_kernels.triton.draft_expand import chunk_shape, chunk_vector

    shape = chunk_shape(block_v, top_k)
    threads, vec = shape.threads, chunk_vector(block_v, shape, 4)
    regs = block_v // threads
    k = torch.arange(top_k)
    # Register k of thread 5 (registers past the chunk's: the next chunks' thread 5).
    r = k % regs
    one_thread = k // regs * block_v + (r // vec * threads + 5) * vec + r % vec
    gen = torch.Generator().manual_seed(V + block_v)
    rows = torch.randn(7, V, generator=gen).clamp(-3, 3)
    rows[1, one_thread % V] = 10.0 + torch.arange(top_k, dtype=torch.float32)
    rows[2] = rows[2].clamp(max=2.0)
    rows[2, :: threads + 1] = 2.0
    rows[3] = rows[3].clamp(max=2.0)
    owner = torch.arange(V) % block_v // vec % threads
    rows[3, owner % (threads // 2) == 0] = 2.0  # every entry of threads 0 and threads / 2
    rows[4] = 0.5
    rows[5] = torch.linspace(-5, 5, V)
    rows[6, : V // 2] = float("-inf")
    return rows[None]


def _expected_survivors(row, chunk, block_v, top_k):
    """(ids >= the chunk's threshold, whether the chunk takes the compaction) by the kernel's
    definition: thread ``t`` owns ids ``base + (g * threads + t) * vec + e`` (runs of ``vec``);
    super-groups are runs of threads; a threshold of -inf sends the chunk to the plain rounds."""
    from eagle_kernels.triton.draft_expand import PER_THREAD, chunk_shape, chunk_vector

    shape = chunk_shape(block_v, top_k)
    vec = chunk_vector(block_v, shape, row.element_size())
    V = row.numel()
    ids = chunk * block_v + torch.arange(block_v)
    valid = ids < V
    x = torch.full((block_v,), float("-inf"))
    x[valid] = row[ids[valid]]
    tmax = x.view(-1, shape.threads, vec).amax((0, 2))
    smax = tmax.view(shape.n_super, -1).amax(1)
    t = smax[(smax[None, :] >= smax[:, None]).sum(1) >= top_k].max()
    surv = (x >= t) & valid
    per_thread = surv.view(-1, shape.threads, vec).sum((0, 2))
    compacted = bool(t > float("-inf")) and int(surv.sum()) <= shape.cap and int(per_thread.max()) <= PER_THREAD.value
    return set(ids[surv].tolist()), compacted


@pytest.mark.parametrize("block_v,V,top_k", [(1024, 1100, 8), (256, 700, 10), (16384, 17500, 8)],
                         ids=["b1024k8", "b256k10", "b16384k8"])
def test_triton_chunk_threshold(backend, op_impl, block_v, V, top_k):
    """The chunk kernel's threshold and compaction: each chunk that takes them stores exactly
    the ids at or above its threshold (read back from the scratch), the others take the plain
    rounds; both give the exact top-k and tie order of a full search, tail chunks included."""
    if backend != "triton":
        pytest.skip("triton launcher only")
    op_impl("draft_expand")
    from eagle_kernels.triton.draft_expand import DraftExpandConfig, _launch, chunk_shape

    logits = _threshold_rows(V, block_v, top_k)
    fs = random_frontier_scores(1, 7, V)
    NC = -(-V // block_v)
    scratch = torch.full((7, NC, chunk_shape(block_v, top_k).cap), -1, dtype=torch.int32)
    out = _launch(logits, fs, top_k, None, DraftExpandConfig(block_v=block_v), survivors=scratch)
    np.testing.assert_array_equal(out.tokens.numpy(), naive_draft_expand(logits, fs, top_k)[0])
    assert_same_as_reference(out, reference.draft_expand(logits, fs, top_k))
    paths = set()
    for m in range(7):
        for chunk in range(NC):
            want, compacted = _expected_survivors(logits[0, m], chunk, block_v, top_k)
            paths.add(compacted)
            if compacted:
                assert set(scratch[m, chunk].tolist()) - {-1} == want, (m, chunk)
    assert paths == {True, False}  # both the compaction and the plain rounds ran


@pytest.mark.parametrize("lanes", [1, 64], ids=["one-row-per-block", "two-rows-per-block"])
def test_triton_merge_row_blocks(backend, op_impl, lanes):
    """The merge kernel takes the frontier rows in blocks of BLOCK_M (all at once at the
    benchmark's shapes): blocks of 1 and 2 rows over M = 5, the last block partial."""
    if backend != "triton":
        pytest.skip("triton launcher only")
    op_impl("draft_expand")
    from eagle_kernels.triton import draft_expand as triton_draft_expand

    logits = planted_logits(2, 5, 200, 6, torch.float32, 11)
    logits[1, 3] = float("nan")  # a bad row inside a block
    fs = random_frontier_scores(2, 5, 200)
    config = triton_draft_expand.DraftExpandConfig(block_v=64, merge_lanes=lanes)  # 32 candidate lanes per row here
    out = triton_draft_expand._launch(logits, fs, 6, None, config)
    assert_same_as_reference(out, reference.draft_expand(logits, fs, 6))


def _merge_threshold_survivors(logits, m, block_v, top_k):
    """Ids of row ``m`` the merge compacts: the entries of its chunks' top-k lists at or above
    the top_k-th largest of the lists' first ``merge_lead`` entries (-inf with fewer), by the
    kernel's definition."""
    from eagle_kernels.triton.draft_expand import merge_lead

    row = logits[0, m].double()
    V = row.numel()
    chunks = [row[c: c + block_v] for c in range(0, V, block_v)]
    lead = min(merge_lead(len(chunks), top_k), top_k)
    lists = [sorted(range(ch.numel()), key=lambda i: (-float(ch[i]), i))[:top_k] for ch in chunks]
    leading = sorted((float(ch[i]) for ch, order in zip(chunks, lists) for i in order[:lead]), reverse=True)
    t = leading[top_k - 1] if len(leading) >= top_k else float("-inf")
    ids = set()
    for c, (ch, order) in enumerate(zip(chunks, lists)):
        ids |= {c * block_v + i for i in order if float(ch[i]) >= t}
    return ids


# (block_v, V, top_k): one chunk; two (fewer than top_k: every list survives); 12 chunks at
# top_k 8, 1 and 10; 16 chunks of 64 threads (the rank's tile too large: plain rounds); top_k
# above the threshold's limit (plain rounds).
MERGE_CASES = [(1024, 700, 8), (256, 500, 8), (256, 3000, 8), (128, 1500, 1), (128, 1500, 10), (64, 1000, 8),
               (64, 300, 40)]


@pytest.mark.parametrize("block_v,V,top_k", MERGE_CASES, ids=lambda x: str(x))
def test_triton_merge_threshold(backend, op_impl, block_v, V, top_k):
    """The merge inside the last chunk program of each request: each row's compacted
    survivors (read back from the merge's scratch) are exactly its chunk-list entries at or
    above the threshold; rows with more than ``cap`` of them (a row of ties) and bad rows take
    the plain rounds or the NaN rule; every output equals the reference's, with d2t; and the
    request counters are back at zero after the launch."""
    if backend != "triton":
        pytest.skip("triton launcher only")
    op_impl("draft_expand")
    from eagle_kernels.triton import draft_expand as de
    from eagle_kernels.triton._launch_config import tickets

    M = 5
    logits = torch.randn(2, M, V, generator=torch.Generator().manual_seed(V + top_k))
    logits[0, 1] = logits[0, 1].round()  # ties
    logits[0, 3, 5:] = float("-inf")  # few finite entries
    logits[1, 0] = 0.25  # a flat row: every candidate survives
    logits[1, 2, 7] = float("nan")
    fs = random_frontier_scores(2, M, V)
    d2t = torch.randint(0, 100, (V,), generator=torch.Generator().manual_seed(3))
    cap = de.chunk_shape(min(block_v, 1 << (V - 1).bit_length()), top_k).cap
    scratch = torch.full((2 * M, max(cap, 1)), -1, dtype=torch.int32)
    out = de._launch(logits, fs, top_k, d2t, de.DraftExpandConfig(block_v=block_v), merge_survivors=scratch)
    ref = reference.draft_expand(logits, fs, top_k, d2t=d2t)
    assert_same_as_reference(out, ref)
    torch.testing.assert_close(out.logprobs, ref.logprobs, equal_nan=True, **SCORE_TOL[torch.float32])
    assert not tickets(logits.device, 2)[:2].any()
    NC = -(-V // block_v)
    if not de.merge_filters(de.chunk_shape(block_v, top_k), M, NC, top_k):
        assert (block_v, top_k) in ((64, 8), (64, 40))
        assert (scratch == -1).all()  # plain rounds: nothing compacted
        return
    for m in range(M):  # request 0: rows 1 and 3 (ties, -inf) may overflow the slots (then: the plain rounds)
        want = _merge_threshold_survivors(logits, m, block_v, top_k)
        assert len(want) <= cap or m in (1, 3), m
        if len(want) <= cap:
            assert set(scratch[m, : len(want)].tolist()) == want, m


# ---------------------------------------------------------------------------------- GPU path
GPU_SHAPES = [(8, 8, 32000, 8), (4, 8, 128256, 10), (1, 1, 128256, 8), (2, 4, 262144, 32), (3, 4, 1031, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("B,M,V,top_k", GPU_SHAPES, ids=lambda x: str(x))
def test_gpu_matches_reference(gpu_op_impl, B, M, V, top_k, dtype):
    fn = gpu_op_impl("draft_expand")
    logits = planted_logits(B, M, V, top_k, dtype, V + top_k).cuda()
    fs = random_frontier_scores(B, M, V).cuda()
    d2t = torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(1)).cuda()
    out = fn(logits, fs, top_k, d2t=d2t)
    torch.cuda.synchronize()
    cpu = logits.cpu(), fs.cpu()
    naive = naive_draft_expand(*cpu, top_k, d2t=d2t.cpu())
    assert_matches(tuple(t.cpu() for t in out), naive,
                   reference.draft_expand(*cpu, top_k, d2t=d2t.cpu()), dtype, top_k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_nan_and_inf_rows(gpu_op_impl, dtype):
    fn = gpu_op_impl("draft_expand")
    logits = _bad_rows(dtype)
    fs = random_frontier_scores(2, 5, 9)
    out = fn(logits.cuda(), fs.cuda(), 4)
    assert_same_as_reference(type(out)(*(t.cpu() for t in out)), reference.draft_expand(logits, fs, 4))


# ------------------------------------------------------------------ Triton sampled children
def _sampled_inputs(B, M, V, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, M, V, generator=gen, dtype=torch.float64) * 2.5).to(dtype)
    fs = random_frontier_scores(B, M, V)
    # Mixed batch: sampled, deterministic, hot, a temperature that sends every logit but the max to -inf.
    temperature = torch.tensor([0.8, 0.0, 1.7, 1e-30, 1.0][:B], dtype=torch.float32)
    seeds = torch.tensor([3, -1, 2**40 + 7, 11, 0][:B], dtype=torch.int64)
    offsets = torch.tensor([0, 5, 2**33 + 1, 9, 123][:B], dtype=torch.int64)
    d2t = torch.randint(0, 50, (V,), generator=gen, dtype=torch.int64)
    return logits, fs, dict(d2t=d2t, temperature=temperature, seed=seeds, offset=offsets)


def assert_sampled_same_as_reference(out, ref):
    assert_same_as_reference(out, ref)
    torch.testing.assert_close(out.logprobs, ref.logprobs, equal_nan=True, **SCORE_TOL[torch.float32])


# (launch configuration, B, M, V, top_k, dtype): the GPU's sampled chunks (2048 entries, 128 threads) with a
# tail, the interpreter's chunks with a tail (with M 8, the temperature-0 rows take the merge's plain rounds:
# test_sampled_merge_tiles), chunks smaller than top_k, and top_k above the chunk threshold's limit (plain rounds).
SAMPLED_CASES = [
    ("gpu-block", 3, 2, 3000, 6, torch.float32),
    ("interp-block", 4, 2, 1100, 8, torch.bfloat16),
    ("interp-block-m8", 2, 8, 2000, 10, torch.float16),
    ("block16", 3, 1, 150, 20, torch.float64),
    ("plain-rounds", 3, 1, 300, 40, torch.float16),
]


@pytest.mark.parametrize("case", SAMPLED_CASES, ids=[c[0] for c in SAMPLED_CASES])
def test_triton_sampled_matches_reference(backend, op_impl, case):
    """Sampled children on every launch shape the Triton launcher can take: the same draws as
    the reference (the same random stream), in a batch mixing sampled and deterministic rows."""
    if backend != "triton":
        pytest.skip("triton launcher only")
    op_impl("draft_expand")
    from eagle_kernels.triton import draft_expand as triton_draft_expand

    name, B, M, V, top_k, dtype = case
    config = {"gpu-block": triton_draft_expand.GPU_CONFIG, "interp-block": triton_draft_expand.INTERPRETER_CONFIG,
              "interp-block-m8": triton_draft_expand.INTERPRETER_CONFIG,
              "block16": triton_draft_expand.DraftExpandConfig(block_v=16),
              "plain-rounds": triton_draft_expand.DraftExpandConfig(block_v=128)}[name]
    logits, fs, kwargs = _sampled_inputs(B, M, V, dtype, V + top_k)
    out = triton_draft_expand._launch(logits, fs, top_k, kwargs["d2t"], config, temperature=kwargs["temperature"],
                                      seed=kwargs["seed"], offset=kwargs["offset"], depth=7)
    ref = reference.draft_expand(logits, fs, top_k, depth=7, **kwargs)
    assert_sampled_same_as_reference(out, ref)
    # The deterministic row is the deterministic op's, and another depth draws other children.
    det = reference.draft_expand(logits, fs, top_k, d2t=kwargs["d2t"])
    assert out.tokens[1].tolist() == det.tokens[1].tolist()
    other = triton_draft_expand._launch(logits, fs, top_k, kwargs["d2t"], config, temperature=kwargs["temperature"],
                                        seed=kwargs["seed"], offset=kwargs["offset"], depth=8)
    assert other.tokens[0].tolist() != out.tokens[0].tolist()


def test_sampled_merge_tiles():
    """A sampled launch's temperature-0 rows take the merge's threshold step only where its tiles
    fit 32 elements a thread (64 in a deterministic launch): at the GPU's V 32000, M 8, top_k 10
    (16 chunks of 2048) and at the interpreted M 8 case above they take the plain rounds."""
    from eagle_kernels.triton.draft_expand import chunk_shape, merge_filters

    for block_v, M, NC, top_k in [(2048, 8, 16, 10), (2048, 8, 16, 8), (1024, 8, 2, 10)]:
        shape = chunk_shape(block_v, top_k)
        assert merge_filters(shape, M, NC, top_k) and not merge_filters(shape, M, NC, top_k, sampled=True)
    assert merge_filters(chunk_shape(1024, 8), 2, 2, 8, sampled=True)  # "interp-block": the threshold step


def test_triton_sampled_bad_rows(backend, op_impl):
    """NaN, +inf and all -inf rows of sampled requests give the reference's ids 0..k-1 with NaN
    scores and log-probs; -inf entries of a good row are never drawn before finite ones."""
    if backend != "triton":
        pytest.skip("triton launcher only")
    fn = op_impl("draft_expand")
    logits = _bad_rows(torch.float32)
    logits[1, 4, 3:] = float("-inf")  # three finite entries: drawn first, then -inf ties by id
    fs = random_frontier_scores(2, 5, 9)
    kwargs = dict(temperature=torch.tensor([0.9, 1.3]), seed=torch.tensor([1, 2]), offset=torch.tensor([0, 4]))
    out = fn(logits, fs, 4, **kwargs)
    ref = reference.draft_expand(logits, fs, 4, **kwargs)
    assert_sampled_same_as_reference(out, ref)
    assert out.tokens[1, 16:19].sort().values.tolist() == [0, 1, 2] and int(out.tokens[1, 19]) == 3


def test_sampled_arguments_are_checked(backend, op_impl):
    if backend == "cpp":
        pytest.skip("the C++ kernel's sampled arguments are checked with it")
    fn = op_impl("draft_expand")
    logits, fs = torch.zeros(2, 1, 10), torch.zeros(2, 1)
    with pytest.raises(ValueError, match="temperature"):
        fn(logits, fs, 2, temperature=torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="seed"):
        fn(logits, fs, 2, temperature=torch.ones(2), seed=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="temperature"):
        fn(logits, fs, 2, temperature=torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="depth"):
        fn(logits, fs, 2, temperature=torch.ones(2), depth=65535)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,M,V,top_k", [(5, 8, 32000, 8), (5, 1, 128256, 10), (3, 4, 1031, 40)], ids=lambda x: str(x))
def test_gpu_sampled_matches_reference(gpu_op_impl, B, M, V, top_k, dtype):
    fn = gpu_op_impl("draft_expand")
    logits, fs, kwargs = _sampled_inputs(B, M, V, dtype, V)
    out = fn(logits.cuda(), fs.cuda(), top_k, depth=3, **{k: v.cuda() for k, v in kwargs.items()})
    torch.cuda.synchronize()
    assert_sampled_same_as_reference(type(out)(*(t.cpu() for t in out)),
                                     reference.draft_expand(logits, fs, top_k, depth=3, **kwargs))
