"""The step bookkeeping's Triton kernels (eagle_kernels/triton/bookkeeping.py, interpreted on CPU
tensors) against the torch code of the same logic (eagle_kernels/bookkeeping.py, the CPU path):
identical results, on small random cases of each piece and on whole decoding calls with the GPU
path of the bookkeeping forced."""

import types

import pytest
import torch

from eagle_kernels import _dispatch, bookkeeping
from eagle_kernels.decoder import SpeculativeDecoder, StepGraphs, TreeConfig
from eagle_kernels.models import LlamaModel
from helpers import PROMPTS, repeat_head, tiny_hf_model

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_dispatch.implementation("rmsnorm", "triton", "cpu")[0] is None,
                                 reason="triton runs CPU tensors only under TRITON_INTERPRET=1")]


def triton_rmsnorm(*args):
    from eagle_kernels.triton.rmsnorm import rmsnorm

    return rmsnorm(*args)


def both(fn, *args, **kwargs):
    """``fn`` on the torch path and on the Triton path, each on its own copy of the tensors;
    returns (torch result, torch args, triton result, triton args)."""
    copies = [[a.clone() if isinstance(a, torch.Tensor) else a for a in args] for _ in range(2)]
    want = fn(*copies[0], **kwargs)
    with bookkeeping.gpu_path_on_cpu():
        got = fn(*copies[1], **kwargs)
    return want, copies[0], got, copies[1]


def assert_identical(got, want):
    if want is None:
        assert got is None
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    else:
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_identical(g, w)


@pytest.mark.parametrize("M, top_k, offset", [(1, 3, 0), (3, 3, 3), (4, 2, 10)], ids=["root", "M3", "M4-k2"])
def test_expansion_step(M, top_k, offset):
    gen = torch.Generator().manual_seed(M)
    B, W, C = 2, M * top_k, 40
    tokens = torch.randint(0, 1000, (B, W), generator=gen)
    scores = torch.randn(B, W, generator=gen)
    frontier = torch.stack([torch.randperm(W, generator=gen)[:top_k] for _ in range(B)]).int()
    cand_index = torch.full((B, M), -1) if M == 1 else torch.randint(0, 30, (B, M), generator=gen)
    history = (torch.full((B, C), -7), torch.full((B, C), -7.0), torch.full((B, C), -7, dtype=torch.int32))
    want, want_args, got, got_args = both(bookkeeping.expansion_step, tokens, scores, frontier, cand_index,
                                          *history, offset, top_k)
    assert_identical(got, want)
    assert got[4] is None  # no draft: no head-pass inputs
    assert_identical(got_args[4:7], want_args[4:7])  # the history, untouched outside the step's slice


@pytest.mark.parametrize("step, M, embed", [(1, 1, True), (2, 3, True), (4, 3, False)],
                         ids=["step1-embed", "step2-embed", "step4-no-embed"])
def test_expansion_step_with_draft_inputs(step, M, embed):
    """The expansion step of depth ``step - 1`` and the inputs of the head's pass at ``step`` in
    one launch: the same as the expansion step followed by draft_inputs (the torch path)."""
    gen = torch.Generator().manual_seed(10 + step)
    B, top_k, H, depth, C = 2, 3, 40, 30, 60  # 90 draft slots: two mask words
    F, W, offset = top_k, M * top_k, 0 if step == 1 else 3 + (step - 2) * 9
    tokens = torch.randint(0, 50, (B, W), generator=gen)
    scores = torch.randn(B, W, generator=gen)
    frontier = torch.stack([torch.randperm(W, generator=gen)[:F] for _ in range(B)]).int()
    cand_index = torch.full((B, M), -1) if M == 1 else torch.randint(0, 30, (B, M), generator=gen)
    history = (torch.full((B, C), -7), torch.full((B, C), -7.0), torch.full((B, C), -7, dtype=torch.int32))
    hidden = torch.randn(B, M, H, generator=gen).to(torch.bfloat16)
    slot_masks = torch.randint(-2**62, 2**62, (B, depth * F, 2), generator=gen)
    seqlens = torch.tensor([5, 17], dtype=torch.int32)
    table = torch.randn(50, H, generator=gen).to(torch.bfloat16 if embed else torch.float16)
    copies = [(hidden.clone(), slot_masks.clone(), [h.clone() for h in history]) for _ in range(2)]
    results = []
    for forced, (hid, masks, hist) in zip((False, True), copies):
        with bookkeeping.gpu_path_on_cpu(forced):
            draft = bookkeeping.DraftInputs(hid, masks, seqlens, table, step)
            results.append(bookkeeping.expansion_step(tokens, scores, frontier, cand_index, *hist, offset, top_k,
                                                      draft))
    want, got = results
    assert_identical(got[:4], want[:4])
    assert_identical(got[4][:2], want[4][:2])  # the feature rows and the position
    assert want[4][2] is None  # the CPU path leaves the embedding to the head
    if embed:
        assert_identical(got[4][2], torch.nn.functional.embedding(got[0], table))
    else:
        assert got[4][2] is None  # a table in another dtype: the head embeds (and converts) itself
    assert_identical(copies[1][1], copies[0][1])  # the frontier's mask rows, the others unchanged
    assert_identical(copies[1][2], copies[0][2])  # the history
    # The same as the separate launches.
    separate = bookkeeping.draft_inputs(hidden, want[2], slot_masks.clone(), seqlens, step, want[0], table)
    assert_identical(want[4][:2], separate[:2])
    with bookkeeping.gpu_path_on_cpu(), pytest.raises(ValueError, match="slot_masks"):
        bookkeeping.expansion_step(tokens, scores, frontier, cand_index, *history, offset, top_k,
                                   bookkeeping.DraftInputs(hidden, slot_masks[:, :2], seqlens, table, step))


@pytest.mark.parametrize("step, H", [(1, 40), (3, 40), (2, 1100)], ids=["step1", "step3", "step2-H1100"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_expansion_step_writes_the_heads_normed_input(step, H, dtype):
    """With an EAGLE-3 layer's input norms the GPU path's expansion step (and draft_inputs) also
    writes the layer's normed input: the rmsnorm op's [norm(embed) * embed_weight, norm(feature) * weight] rows bit
    for bit (its Triton row function), the other outputs as without the norms; the CPU path
    leaves the norm to the layer (no fourth entry). H 1100: one tile past 1024."""
    from eagle_kernels.triton.rmsnorm import rmsnorm

    gen = torch.Generator().manual_seed(30 + step)
    B, top_k, M, depth, C = 2, 3, 3, 4, 40
    W, offset = M * top_k, 3
    tokens = torch.randint(0, 50, (B, W), generator=gen)
    scores = torch.randn(B, W, generator=gen)
    frontier = torch.stack([torch.randperm(W, generator=gen)[:top_k] for _ in range(B)]).int()
    cand_index = torch.randint(0, 30, (B, M), generator=gen)
    hidden = (3 * torch.randn(B, M, H, generator=gen)).to(dtype)
    table = torch.randn(50, H, generator=gen).to(dtype)
    norm = (torch.rand(H, generator=gen).to(dtype) + 0.5, torch.rand(H, generator=gen).to(dtype) + 0.5, 1e-5)
    seqlens = torch.tensor([5, 17], dtype=torch.int32)
    results = []
    for forced, with_norm in ((True, False), (True, True), (False, True)):
        history = (torch.full((B, C), -7), torch.full((B, C), -7.0), torch.full((B, C), -7, dtype=torch.int32))
        masks = torch.zeros(B, depth * top_k, 1, dtype=torch.int64)
        with bookkeeping.gpu_path_on_cpu(forced):
            draft = bookkeeping.DraftInputs(hidden, masks, seqlens, table, step, norm if with_norm else None)
            results.append((bookkeeping.expansion_step(tokens, scores, frontier, cand_index, *history, offset,
                                                       top_k, draft), history, masks))
    (plain, plain_history, plain_masks), (fused, fused_history, fused_masks), (cpu, _, _) = results
    assert_identical(fused[:4], plain[:4])
    assert_identical(fused[4][:3], plain[4][:3])  # feature, positions, embedding rows
    assert_identical(fused_history, plain_history)
    assert_identical(fused_masks, plain_masks)
    feature, _, embed, normed = fused[4]
    want, residual = rmsnorm(feature, norm[0], norm[2], embed=embed, embed_weight=norm[1])
    assert normed.shape == (B, top_k, 2 * H) and normed.dtype == dtype
    assert_identical(normed, want)
    assert_identical(residual, feature)
    assert len(cpu[4]) == 3 and cpu[4][2] is None
    # draft_inputs (the sampled-draft expansion's) writes the same normed rows.
    with bookkeeping.gpu_path_on_cpu():
        alone = bookkeeping.draft_inputs(hidden, plain[2], torch.zeros(B, depth * top_k, 1, dtype=torch.int64),
                                         seqlens, step, plain[0], table, norm)
    assert_identical(alone, fused[4])
    with bookkeeping.gpu_path_on_cpu(), pytest.raises(ValueError, match="norm embed_weight"):
        bookkeeping.expansion_step(tokens, scores, frontier, cand_index, *history, offset, top_k,
                                   bookkeeping.DraftInputs(hidden, masks, seqlens, table, step,
                                                           (norm[0], norm[1][:-1], 1e-5)))


@pytest.mark.parametrize("step", [1, 2, 4], ids=["step1", "step2", "step4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_draft_inputs(step, dtype):
    gen = torch.Generator().manual_seed(step)
    B, F, H, depth = 2, 3, 40, 30  # 90 draft slots: two mask words
    M = 1 if step == 1 else F
    root = torch.randn(B, H, generator=gen).to(dtype)
    hidden = root[:, None] if step == 1 else torch.randn(B, M, H, generator=gen).to(dtype)
    parent_row = torch.randint(0, M, (B, F), generator=gen)
    slot_masks = torch.randint(-2**62, 2**62, (B, depth * F, 2), generator=gen)
    seqlens = torch.tensor([5, 17], dtype=torch.int32)
    tokens, table = torch.randint(0, 50, (B, F), generator=gen), torch.randn(50, H, generator=gen).half()
    want, want_args, got, got_args = both(bookkeeping.draft_inputs, hidden, parent_row, slot_masks, seqlens, step,
                                          tokens, table)
    assert_identical(got[:2], want[:2])
    assert want[2] is None  # the CPU path leaves the embedding to the head: the same rows
    assert got[2] is None  # a table in another dtype: the head embeds (and converts) itself
    want, _, got, _ = both(bookkeeping.draft_inputs, hidden, parent_row, slot_masks, seqlens, step, tokens,
                           table.to(dtype))
    assert_identical(got[2], torch.nn.functional.embedding(tokens, table.to(dtype)))
    own = slice((step - 1) * F, step * F)
    assert_identical(got_args[2][:, own], want_args[2][:, own])  # the frontier's mask rows
    assert_identical(got_args[2][:, : (step - 1) * F], slot_masks[:, : (step - 1) * F])  # ancestors unchanged


@pytest.mark.parametrize("width, count", [(None, 3), (2, 1), (None, 0)], ids=["all-3", "width2-1", "all-0"])
def test_commit_inputs(width, count):
    """The accepted path's rows, tokens, positions, embedding rows and (with ``features``) the
    target feature rows side by side, in one launch: the same as the torch path and gather_rows."""
    accept_nodes = torch.tensor([[0, 3, 5, -1], [0, -1, -1, -1]], dtype=torch.int32)
    out_tokens = torch.tensor([[11, 12, 13, 14], [21, 22, -1, -1]])  # ids < 30: rows of table
    seqlens = torch.tensor([6, 9], dtype=torch.int32)
    table = torch.randn(30, 40).bfloat16()
    base = torch.randn(2, 7, 2 * 24).bfloat16()
    features = [base[..., :24]] + [torch.randn(2, 7, 24).bfloat16() for _ in range(count - 1)] if count else None
    want, _, got, _ = both(bookkeeping.commit_inputs, accept_nodes, out_tokens, seqlens, width, table,
                           torch.bfloat16, features)
    assert_identical(got[:2], want[:2])
    assert want[2] is None and want[3] is None and want[4] is None  # the CPU path leaves the head its defaults
    assert_identical(got[2], seqlens[:, None].long() + torch.arange(got[0].shape[1]))
    assert_identical(got[3], torch.nn.functional.embedding(got[1], table))
    if count:
        assert_identical(got[4], bookkeeping.gather_rows(features, want[0]))
    else:
        assert got[4] is None


def test_tree_positions():
    seqlens, depths = torch.tensor([6, 9], dtype=torch.int32), torch.tensor([[0, 1, 1, 2], [0, 1, 2, 3]],
                                                                           dtype=torch.int32)
    assert torch.equal(bookkeeping.tree_positions(seqlens, depths), torch.tensor([[6, 7, 7, 8], [9, 10, 11, 12]],
                                                                               dtype=torch.int32))
    assert torch.equal(bookkeeping.tree_positions(seqlens), seqlens[:, None])


@pytest.mark.parametrize("depths", [True, False], ids=["tree", "positions-given"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_token_rows(depths, dtype):
    """The first layer's input in one launch: the embedding rows (exact), their norm (the
    rmsnorm op's Triton arithmetic exactly, torch's to rounding) and a tree's positions."""
    gen = torch.Generator().manual_seed(3)
    B, N, H = 2, 5, 40
    tokens = torch.randint(0, 30, (B, N), generator=gen)
    table = (torch.randn(30, 2 * H, generator=gen) * 2).to(dtype)[:, :H]  # strided rows
    weight = (torch.rand(H, generator=gen) + 0.5).to(dtype)
    seqlens = torch.tensor([6, 9], dtype=torch.int32)
    tree_depths = torch.tensor([[0, 1, 1, 2, 3], [0, 1, 2, 3, 4]], dtype=torch.int32) if depths else None
    want, _, got, _ = both(bookkeeping.token_rows, tokens, table, weight, 1e-5, seqlens, tree_depths)
    assert_identical(got[1:], want[1:])
    assert_identical(got[1], torch.nn.functional.embedding(tokens, table))
    if depths:
        assert_identical(got[2], bookkeeping.tree_positions(seqlens, tree_depths))
    assert_identical(got[0], triton_rmsnorm(got[1], weight, 1e-5)[0])
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=2 ** -6 if dtype == torch.bfloat16 else 1e-5)
    with bookkeeping.gpu_path_on_cpu(), pytest.raises(ValueError, match="depths"):
        bookkeeping.token_rows(tokens, table, weight, 1e-5, seqlens, torch.zeros(B, N, dtype=torch.int64))


@pytest.mark.usefixtures("single_thread")
def test_target_tree_pass_embeds_in_its_first_layer(monkeypatch):
    """A target tree pass on the GPU layer path with the depths (embedding, first norm and
    positions in the first layer's first launch) gives the same logits, states and cache as
    with the positions computed before it and the embedding outside the layers."""
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32), dtype=torch.bfloat16)
    target.layer_paths._gpu_path_on_cpu = True
    monkeypatch.setenv(_dispatch.BACKEND_ENV, "triton")
    tokens = torch.randint(0, 97, (2, 4), generator=torch.Generator().manual_seed(2))
    depths = torch.tensor([[0, 1, 1, 2], [0, 1, 2, 3]], dtype=torch.int32)
    mask = torch.tensor([[[1], [3], [5], [11]], [[1], [3], [7], [15]]])
    results = []
    for fused in (False, True):
        cache = target.new_cache(2, 16)
        cache.seqlens += torch.tensor([3, 5], dtype=torch.int32)
        with bookkeeping.gpu_path_on_cpu(fused):
            kwargs = dict(depths=depths) if fused else dict(positions=bookkeeping.tree_positions(cache.seqlens, depths))
            out = target(tokens, cache, tree_mask=mask, feature_layers=(0, 2), **kwargs)
        results.append([out.logits.float(), out.hidden, *out.layer_states.values(), cache.k, cache.v])
    assert_identical(results[1], results[0])


@pytest.mark.parametrize("count", [1, 2, 3], ids=["one", "two", "three"])
def test_gather_rows(count):
    gen = torch.Generator().manual_seed(count)
    B, N, H, P = 2, 7, 40, 4
    base = torch.randn(B, N, 2 * H, generator=gen).to(torch.bfloat16)
    tensors = [base[..., :H]] + [torch.randn(B, N, H, generator=gen).to(torch.bfloat16) for _ in range(count - 1)]
    rows = torch.randint(0, N, (B, P), generator=gen)
    want, _, got, _ = both(bookkeeping.gather_rows, tensors, rows)
    assert_identical(got, want)
    with bookkeeping.gpu_path_on_cpu(), pytest.raises(ValueError, match="rows"):
        bookkeeping.gather_rows(tensors, rows.int())


def fake_state(B, T, H, *, slot, eos, history, head, seed):
    gen = torch.Generator().manual_seed(seed)
    OW = 12
    state = types.SimpleNamespace(
        out=torch.randint(0, 50, (B, OW), generator=gen), out_len=torch.tensor([1, 3, 9, 2])[:B],
        steps=torch.tensor([0, 2, 5, 1])[:B], root=torch.tensor([4, 5, 6, 7])[:B],
        done=torch.tensor([False, False, True, False])[:B], offset=torch.tensor([1, 3, 6, 2])[:B],
        limit=torch.tensor([10, 4, 10, 3])[:B] if slot else 10,
        eos=(torch.full((B, 1), 13) if slot else 13) if eos else None,
        history=torch.randint(0, 50, (B, 30), generator=gen) if history else None,
        prompt_len=torch.tensor([5, 2, 7, 4])[:B] if history else None,
        target_cache=types.SimpleNamespace(seqlens=torch.tensor([8, 9, 10, 11], dtype=torch.int32)[:B]),
        root_hidden=torch.zeros(B, H, dtype=torch.bfloat16) if head else None,
        root_normed=torch.zeros(B, H, dtype=torch.bfloat16) if head else None)
    head_cache = types.SimpleNamespace(seqlens=torch.tensor([7, 8, 9, 10], dtype=torch.int32)[:B]) if head else None
    return state, head_cache


def state_tensors(state, head_cache):
    names = ["out", "out_len", "steps", "root", "done", "offset", "history", "root_hidden", "root_normed"]
    found = [getattr(state, n) for n in names if getattr(state, n) is not None]
    found.append(state.target_cache.seqlens)
    if head_cache is not None:
        found.append(head_cache.seqlens)
    return found


@pytest.mark.parametrize("speculative, norm", [(True, False), (True, True), (False, False)],
                         ids=["speculative", "speculative-norm", "plain"])
@pytest.mark.parametrize("slot, eos, history", [(False, False, False), (False, True, True), (True, True, False),
                                                (True, False, True)],
                         ids=["plain-state", "int-eos-history", "slot-eos", "slot-history"])
def test_commit(speculative, norm, slot, eos, history):
    B, T, H = 4, 4 if speculative else 1, 24
    gen = torch.Generator().manual_seed(T)
    tokens = torch.randint(10, 16, (B, T), generator=gen)  # EOS 13 in some rows
    tokens[1, 3:] = -1
    accept_len = torch.tensor([3, 2, 1, 0], dtype=torch.int32) if speculative else None
    hidden = (torch.randn(B, T, H, generator=gen) * 3).to(torch.bfloat16) if speculative else None
    weight = (torch.rand(H, generator=gen) + 0.5).to(torch.bfloat16)
    results = []
    for forced in (False, True):
        state, head_cache = fake_state(B, T, H, slot=slot, eos=eos, history=history, head=speculative, seed=T)
        with bookkeeping.gpu_path_on_cpu(forced):
            bookkeeping.commit(state, tokens, accept_len, hidden, head_cache, (weight, 1e-5) if norm else None)
        results.append(state_tensors(state, head_cache))
    if norm:  # the root's final norm: the Triton rmsnorm's arithmetic, and torch's to rounding (bf16)
        normed = [r.pop(-3) for r in results]
        assert_identical(normed[1], triton_rmsnorm(results[1][-3], weight, 1e-5)[0])  # root_hidden's norm
        torch.testing.assert_close(normed[1], normed[0], atol=0, rtol=2 ** -6)
        assert normed[0].abs().sum() > 0
    assert_identical(results[1], results[0])


class ReplayGraphs(StepGraphs):
    """Captures by recording the step; a replay runs it (the slot path: per-request limits and
    EOS as tensors)."""

    def warm(self, step, state):
        step(state)

    def capture(self, step, state):
        return lambda: step(state)


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("slots", [False, True], ids=["eager", "slots"])
def test_decoding_with_the_gpu_bookkeeping(slots):
    """Whole calls (EOS, a lookup chain, plain and speculative) give the same tokens with the
    bookkeeping's GPU path forced."""
    from eagle_kernels.policy import StaticPolicy

    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    head = repeat_head(target)
    tree = TreeConfig(3, 2, 5, lookup=3)
    kwargs = dict(graphs=ReplayGraphs()) if slots else dict(cuda_graph=False)
    decoder = SpeculativeDecoder(target, head, tree, policy=StaticPolicy(), **kwargs)
    for speculative in (True, False):
        want = decoder.generate(PROMPTS, 10, eos_token_id=9, speculative=speculative)
        with bookkeeping.gpu_path_on_cpu():
            got = decoder.generate(PROMPTS, 10, eos_token_id=9, speculative=speculative)
        assert (got.sequences, got.steps) == (want.sequences, want.steps)
        assert max(len(s) for s in want.sequences) > 1


@pytest.mark.usefixtures("single_thread")
def test_greedy_decoding_on_the_gpu_path_fp8_head(monkeypatch):
    """A bf16 target on the GPU path with an "fp8" EAGLE-3 head (its GEMMs fp8_linear over fp8 copies): greedy
    speculative decoding emits what plain greedy decoding on the same path emits."""
    import os
    import sys
    import warnings

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from gpu_e2e import random_llama

    from eagle_kernels.models.eagle_head import EagleHead
    from eagle_kernels.models.llama import LlamaConfig
    from eagle_kernels.policy import StaticPolicy

    target = random_llama(LlamaConfig(97, 128, 256, 3, 4, 2, 32), torch.bfloat16, "cpu")
    head = EagleHead.random(target, "eagle3", draft_vocab_size=60, weight_dtype="fp8")
    decoder = SpeculativeDecoder(target, head, TreeConfig(3, 2, 4), policy=StaticPolicy(), cuda_graph=False,
                                 sync_every=1)
    for model in (target, head):
        monkeypatch.setattr(model.layer_paths, "_gpu_path_on_cpu", True)
    monkeypatch.setenv(_dispatch.BACKEND_ENV, "triton")
    with bookkeeping.gpu_path_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ops without a Triton kernel run the reference
        want = decoder.generate(PROMPTS[:1], 4, speculative=False)
        got = decoder.generate(PROMPTS[:1], 4, speculative=True)
    assert got.sequences == want.sequences and got.steps[0] >= 1
    assert len(head.packed._fp8) == 6


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("head_weights, pdl", [(None, False), ("q8_0", False), (None, True)],
                         ids=["stored-head", "q8_0-head", "stored-head-pdl"])
def test_greedy_decoding_on_the_gpu_path(monkeypatch, head_weights, pdl):
    """The whole GPU code path (GPU layer path with the first layer's token rows, the
    bookkeeping kernels, an EAGLE-3 head's fused expansion steps and the commit's root norm; or
    the head's matrices as Q8_0 blocks through q8_0_linear; or every Triton kernel launched with
    programmatic dependent launch, its PDL branch interpreted): greedy speculative decoding emits
    what plain greedy decoding on the CPU path emits."""
    import warnings

    from eagle_kernels.models.eagle_head import EagleHead
    from eagle_kernels.policy import StaticPolicy
    from eagle_kernels.triton import _pdl

    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    head = EagleHead.random(target, "eagle3", draft_vocab_size=60, weight_dtype=head_weights)
    decoder = SpeculativeDecoder(target, head, TreeConfig(3, 2, 4), policy=StaticPolicy(), cuda_graph=False,
                                 sync_every=1)
    want = decoder.generate(PROMPTS[:1], 3, speculative=False)
    for model in (target, head):
        monkeypatch.setattr(model.layer_paths, "_gpu_path_on_cpu", True)
    monkeypatch.setenv(_dispatch.BACKEND_ENV, "triton")
    with bookkeeping.gpu_path_on_cpu(), warnings.catch_warnings(), _pdl.forced(pdl):
        warnings.simplefilter("ignore")  # ops without a Triton kernel run the reference
        got = decoder.generate(PROMPTS[:1], 3, speculative=True)
    assert got.sequences == want.sequences and got.steps[0] >= 1
