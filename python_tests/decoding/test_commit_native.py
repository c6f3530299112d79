"""decoder_commit (csrc/cpu/decoder_commit.cpp): the CPU kernel of the decoder's token bookkeeping against its
torch path (bookkeeping.commit_tokens), write for write, and its input checks."""

import types

import pytest
import torch

from eagle_kernels import bookkeeping


def native():
    op = bookkeeping._native_commit()
    if op is None:
        pytest.skip("the C++ extension is not built")
    return op


def make_state(seed, *, eos, history, head, out_len, OW=12):
    gen = torch.Generator().manual_seed(seed)
    B = len(out_len)
    state = types.SimpleNamespace(
        out=torch.randint(0, 50, (B, OW), generator=gen), out_len=torch.tensor(out_len),
        steps=torch.randint(0, 5, (B,), generator=gen), root=torch.randint(0, 50, (B,), generator=gen),
        done=torch.tensor([False, False, True, False, False][:B]), offset=torch.randint(0, 9, (B,), generator=gen),
        limit=10, eos=13 if eos else None,
        history=torch.randint(0, 50, (B, 40), generator=gen) if history else None,
        prompt_len=torch.randint(0, 20, (B,), generator=gen) if history else None,
        target_cache=types.SimpleNamespace(seqlens=torch.randint(0, 30, (B,), generator=gen, dtype=torch.int32)))
    head_cache = types.SimpleNamespace(seqlens=torch.randint(0, 30, (B,), generator=gen, dtype=torch.int32)) \
        if head else None
    return state, head_cache


def tensors(state, head_cache):
    found = [state.out, state.out_len, state.steps, state.root, state.done, state.offset, state.target_cache.seqlens]
    if state.history is not None:
        found.append(state.history)
    if head_cache is not None:
        found.append(head_cache.seqlens)
    return found


def run_native(state, tokens, accept_len, head_cache):
    native()(tokens, accept_len, state.done, state.out, state.out_len, state.steps, state.root, state.offset,
             state.limit, -1 if state.eos is None else state.eos, state.history,
             state.prompt_len if state.history is not None else None, state.target_cache.seqlens,
             None if head_cache is None or accept_len is None else head_cache.seqlens)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "plain"])
@pytest.mark.parametrize("eos, history, head", [(False, False, False), (True, True, True), (True, False, True),
                                                (False, True, False)])
def test_native_commit_equals_the_torch_path(seed, speculative, eos, history, head):
    """Random tokens (EOS 13 among them), accept lengths, finished requests, outputs near or at their last
    column (the torch path clamps positions there and puts the earlier values back), per-request limits
    reached: every tensor the commit touches ends the same."""
    gen = torch.Generator().manual_seed(100 + seed)
    out_len = [1, 9, 3, 10, 11]  # 12 columns: the last two requests overflow (clamped writes)
    W = 5 if speculative else 1
    tokens = torch.randint(10, 16, (len(out_len), W), generator=gen)
    accept_len = torch.randint(0, W, (len(out_len),), generator=gen, dtype=torch.int32) if speculative else None
    results = []
    for path in ("torch", "native"):
        state, head_cache = make_state(seed, eos=eos, history=history, head=head, out_len=out_len)
        if path == "torch":
            bookkeeping.commit_tokens(state, tokens, accept_len, head_cache)
        else:
            run_native(state, tokens, accept_len, head_cache)
        results.append(tensors(state, head_cache))
    for got, want in zip(results[1], results[0]):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_commit_takes_the_native_kernel_for_cpu_states():
    """bookkeeping.commit on a CPU state (int limit and EOS) calls the kernel (one operator call)."""
    native()
    state, head_cache = make_state(0, eos=True, history=True, head=True, out_len=[1, 2, 3])
    tokens = torch.tensor([[10, 11, 13], [12, 13, 10], [11, 11, 11]])
    with torch.profiler.profile() as prof:
        bookkeeping.commit(state, tokens, torch.tensor([2, 1, 0], dtype=torch.int32), None, head_cache)
    names = [e.name for e in prof.events()]
    assert names.count("eagle_kernels::decoder_commit") == 1
    # Request 0 stops at its EOS (13, the third token), request 1 emits both tokens (13 last), request 2 was done.
    assert state.out_len.tolist() == [4, 4, 3] and state.done.tolist() == [True, True, True]


BAD = {
    "tokens": lambda a: a.__setitem__(0, a[0].int()),
    "accept_len": lambda a: a.__setitem__(1, torch.tensor([0, 5, 0], dtype=torch.int32)),  # past W = 3
    "done": lambda a: a.__setitem__(2, a[2].long()),
    "out_len": lambda a: a.__setitem__(4, a[4][:2]),
    "history": lambda a: a.__setitem__(10, a[10][:, :4]),  # no room at prompt_len + out_len
    "target_seqlens": lambda a: a.__setitem__(12, a[12].long()),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_tensor(name):
    state, head_cache = make_state(0, eos=False, history=True, head=True, out_len=[1, 2, 3])
    args = [torch.tensor([[10, 11, 12]] * 3), torch.tensor([2, 1, 0], dtype=torch.int32), state.done, state.out,
            state.out_len, state.steps, state.root, state.offset, 10, -1, state.history,
            state.prompt_len + 30, state.target_cache.seqlens, head_cache.seqlens]
    if name != "history":
        args[11] = state.prompt_len
    BAD[name](args)
    with pytest.raises(ValueError, match=name):
        native()(*args)
