"""Triton block_verify (eagle_kernels/triton/block_verify.py) under the interpreter, against the
reference token for token (docs/ops.md §21): greedy and sampling requests mixed in one batch,
temperature / top-k / top-p (thresholds inside tie groups too), every logits dtype, sampled draft
rows over the target vocabulary or a smaller one mapped by d2t, point-mass drafts, ragged chains
(0 drafts included), invalid draft rows (status 2, the block cut before them), bad target rows
(status 1, the root's finite argmax), and the launch configuration the launcher uses on a GPU
(radix-16 searches, 2048-entry tiles capped at next_pow2(V), 8 warps) on small shapes.

Differences from the reference can only come from the last bits of an exp or a float64 sum, which
flip a decision only where a coin or a top-p mass lands within that of its threshold: inputs with
a top-p mass within 1e-6 of its threshold are skipped (none of the seeds here are).
"""

import pytest
import torch

from eagle_kernels import _dispatch, reference
from eagle_kernels._types import VerifyOutput
from helpers import top_p_margin

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}


@pytest.fixture(scope="module")
def triton_block_verify():
    """The Triton module, on CPU tensors: only under TRITON_INTERPRET=1 with triton installed."""
    fn, reason = _dispatch.implementation("block_verify", "triton", "cpu")
    if fn is None:
        pytest.skip(reason)
    from eagle_kernels.triton import block_verify as module

    return module


def assert_same(got, want, what=""):
    for field, x, y in zip(VerifyOutput._fields, got, want):
        assert x.dtype == y.dtype and torch.equal(x, y), (what, field, x, y)


def check(module, tokens, logits, draft_probs=None, config=None, **kwargs):
    """The launcher's output equals the reference's; returns it."""
    if kwargs.get("temperature") is not None and top_p_margin(logits.double(), kwargs) < 1e-6:
        pytest.skip("a top-p mass within rounding of its threshold")
    want = reference.block_verify(tokens, logits, draft_probs, **kwargs)
    got = module.block_verify(tokens, logits, draft_probs, _config=config, **kwargs)
    assert_same(got, want, config)
    return got


# Per request, cycling: (temperature, top_k, top_p). Greedy, temperature alone, top-k, top-p,
# both, top-k 1, top-k >= V (off), a tiny temperature (every logit below the max at -inf).
MODES = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 12, 1.0), (1.2, 0, 0.8), (0.7, 30, 0.9), (1.0, 1, 1.0),
         (1.0, 100000, 1.0), (1e-6, 0, 1.0)]


def sampling_args(B, gen, modes=MODES):
    picked = [modes[b % len(modes)] for b in range(B)]
    return dict(temperature=torch.tensor([m[0] for m in picked], dtype=torch.float32),
                top_k=torch.tensor([m[1] for m in picked], dtype=torch.int32),
                top_p=torch.tensor([m[2] for m in picked], dtype=torch.float32),
                seed=torch.randint(-2**62, 2**62, (B,), generator=gen),
                offset=torch.randint(0, 2**40, (B,), generator=gen))


def chain_batch(seed, B, N, V, *, Vd=None, dtype=torch.float32, ties=False):
    """Chains drafted from draft rows close to the target (so blocks keep several drafts), some
    drafts the target's argmax (greedy walks go deep) and some with a -inf target logit (P = 0).
    ``Vd``: a draft vocabulary of Vd < V target ids (d2t). ``ties``: logits on a 0.5 grid with
    -inf masks, so top-k and top-p thresholds fall inside tie groups."""
    gen = torch.Generator().manual_seed(seed)
    if ties:
        logits = torch.randint(-6, 3, (B, N, V), generator=gen).double() * 0.5
    else:
        logits = torch.randn(B, N, V, generator=gen, dtype=torch.float64) * 2.0
    logits = logits.masked_fill(torch.rand(B, N, V, generator=gen) < 0.1, float("-inf"))
    logits[..., 3] = 0.25  # every row keeps a finite entry
    Vd = Vd or V
    d2t, targets = None, torch.arange(V)
    if Vd != V:
        targets = torch.randperm(V, generator=gen)[:Vd].sort().values
        d2t = targets - torch.arange(Vd)
    draft_logits = torch.where(torch.isfinite(logits[..., targets]), logits[..., targets], -3.0)
    noise = 0.3 * torch.randn(B, N, Vd, generator=gen, dtype=torch.float64)
    draft_probs = torch.softmax(draft_logits + noise, -1).float()
    draws = torch.multinomial(draft_probs.reshape(B * N, Vd).double(), 1, generator=gen).reshape(B, N)
    tokens = torch.zeros(B, N, dtype=torch.int64)
    tokens[:, 1:] = targets[draws[:, :-1]]
    kwargs = sampling_args(B, gen)
    kind = torch.randint(0, 12, (B, N), generator=gen)
    argmax = targets[logits[..., targets].argmax(-1)]
    greedy = (kwargs["temperature"] == 0)[:, None]
    tokens[:, 1:] = torch.where((kind[:, 1:] < 2) | (greedy & (kind[:, 1:] < 10)), argmax[:, :-1], tokens[:, 1:])
    masked = targets[torch.isinf(logits[..., targets]).double().argmax(-1)]  # a -inf logit where the row has one
    tokens[:, 1:] = torch.where(kind[:, 1:] == 11, masked[:, :-1], tokens[:, 1:])
    kwargs["num_drafts"] = torch.randint(0, N, (B,), generator=gen, dtype=torch.int32)
    kwargs["num_drafts"][1] = N - 1
    kwargs["num_drafts"][5 % B] = 0
    return tokens, logits.to(dtype), draft_probs, d2t, kwargs


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_mixed_batch_matches_reference(triton_block_verify, dtype):
    tokens, logits, draft_probs, _, kwargs = chain_batch(1, 8, 6, 150, dtype=dtype)
    got = check(triton_block_verify, tokens, logits, draft_probs, **kwargs)
    assert int(got.accept_len.max()) >= 2 and set(got.status.tolist()) == {0}
    # A request's result does not depend on its batch.
    b = 4
    alone = triton_block_verify.block_verify(tokens[b:b + 1], logits[b:b + 1], draft_probs[b:b + 1],
                                             **{k: v[b:b + 1] for k, v in kwargs.items()})
    for field in range(4):
        assert torch.equal(alone[field][0], got[field][b])


def test_d2t_draft_vocabulary(triton_block_verify):
    tokens, logits, draft_probs, d2t, kwargs = chain_batch(2, 8, 6, 200, Vd=90)
    got = check(triton_block_verify, tokens, logits, draft_probs, d2t=d2t, **kwargs)
    assert int(got.accept_len.max()) >= 2 and set(got.status.tolist()) == {0}


def test_point_mass_drafts_and_ties(triton_block_verify):
    """draft_probs None (every draft a point mass), full chains (num_drafts None), tie groups;
    then the same chains with temperature None (every request greedy)."""
    tokens, logits, _, _, kwargs = chain_batch(3, 8, 6, 64, ties=True)
    kwargs.pop("num_drafts")
    got = check(triton_block_verify, tokens, logits, **kwargs)
    assert int(got.accept_len.max()) >= 1
    check(triton_block_verify, tokens, logits)


def test_single_node_and_empty_batch(triton_block_verify):
    tokens, logits, draft_probs, _, kwargs = chain_batch(4, 8, 1, 50)
    got = check(triton_block_verify, tokens, logits, draft_probs, **kwargs)
    assert (got.accept_len == 0).all()
    empty = triton_block_verify.block_verify(tokens[:0], logits[:0], draft_probs[:0],
                                             **{k: v[:0] for k, v in kwargs.items()})
    assert [t.shape for t in empty] == [(0,), (0, 1), (0, 1), (0,)]


def valid_chain(B, N, V, seed):
    """Full-strength drafts (the draft rows equal to a point near the target) that the blocks would
    keep, so that a cut shows in accept_len."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, N, V, generator=gen) * 3.0
    q = torch.softmax(logits.double() * 1.1, -1).float()
    tokens = torch.zeros(B, N, dtype=torch.int64)
    tokens[:, 1:] = q[:, :-1].argmax(-1)
    kwargs = dict(temperature=torch.ones(B), top_k=torch.zeros(B, dtype=torch.int32), top_p=torch.ones(B),
                  seed=torch.arange(B, dtype=torch.int64) * 7919, offset=torch.full((B,), 5, dtype=torch.int64))
    return tokens, logits, q, kwargs


def test_invalid_draft_rows(triton_block_verify):
    """A draft row with a NaN, an inf, a negative entry, a sum 1e-2 from 1 or a zero at its draft
    ends the block before that draft: status 2 and at most that many drafts kept; a sum 5e-4 from 1
    is within the tolerance."""
    B, N, V = 8, 5, 70
    tokens, logits, q, kwargs = valid_chain(B, N, V, 5)
    q[0, 2, 9] = float("nan")
    q[1, 1, 4] = float("inf")
    q[2, 3, 0] += q[2, 3, 66] + 1e-4  # a negative entry in the draft row's second chunk, the sum still 1
    q[2, 3, 66] = -1e-4
    q[3, 0] *= 1.01
    q[4, 2] *= 1.0005  # valid
    q[5, 1, tokens[5, 2]] = 0.0  # draft 2 could not have been drawn from its row
    q[5, 1] /= q[5, 1].double().sum().float()
    q[6, 3] = 0.0  # S = 0, the last row of the chain
    kwargs["num_drafts"] = torch.tensor([4, 4, 4, 4, 4, 4, 4, 2], dtype=torch.int32)
    q[7, 3, 0] = float("nan")  # past request 7's chain: never read
    got = check(triton_block_verify, tokens, logits, q, **kwargs)
    assert got.status.tolist() == [2, 2, 2, 2, 0, 2, 2, 0]
    cut = [2, 1, 3, 0, 4, 1, 3, 2]
    assert all(int(got.accept_len[b]) <= cut[b] for b in range(B)), got.accept_len
    assert int(got.accept_len[4]) >= 1  # the valid chain keeps drafts
    # d2t mapping a draft id outside [0, V): every draft row is invalid, the block is empty.
    Vd = 30
    d2t = torch.arange(Vd, dtype=torch.int64)  # draft id x -> target 2x
    d2t[-1] = V  # -> V + 29: out of range
    qd = torch.softmax(torch.randn(B, N, Vd, generator=torch.Generator().manual_seed(6)), -1)
    tokens_d = 2 * torch.randint(0, Vd - 1, (B, N), generator=torch.Generator().manual_seed(7))
    got = check(triton_block_verify, tokens_d, logits, qd, d2t=d2t, **kwargs)
    assert got.status.tolist() == [2] * B and (got.accept_len == 0).all()


def test_bad_target_rows(triton_block_verify):
    """NaN, +inf or no finite entry in a row a request reads: status 1, nothing kept, the bonus
    the argmax over the root's finite logits (0 when it has none). A sampling request reads rows
    0 .. num_drafts (also past a draft-row cut); a greedy one the rows it walks."""
    B, N, V = 10, 5, 90
    tokens, logits, q, kwargs = valid_chain(B, N, V, 8)
    kwargs["temperature"][5:] = 0.0
    kwargs["num_drafts"] = torch.tensor([4, 4, 4, 2, 4, 4, 4, 1, 4, 4], dtype=torch.int32)
    logits[0, 0, 7] = float("nan")  # the root
    logits[1, 4, 70] = float("inf")  # the bonus row of a full chain (its second chunk: entries 64-89)
    logits[2, 2] = float("-inf")  # no finite entry
    logits[3, 3, 0] = float("nan")  # past request 3's chain (2 drafts): never read
    logits[4, 4, 1] = float("nan")
    q[4, 0] = 0.0  # invalid first draft row: the block is cut to 0 drafts, row 4 is still read
    logits[5, 0] = float("-inf")  # greedy, root with no finite entry: bonus 0
    logits[6, 2, 0] = float("nan")  # greedy, the walk reaches row 2 (the drafts are its argmaxes)
    logits[7, 2, 0] = float("nan")  # greedy, past the chain
    logits[8, 0, 75] = float("inf")  # greedy root, other entries finite (second chunk)
    logits[9, 0, tokens[9, 1]] = -50.0  # greedy walk stops at the root ...
    logits[9, 1, 0] = float("nan")  # ... before this row
    got = check(triton_block_verify, tokens, logits, q, **kwargs)
    assert got.status.tolist() == [1, 1, 1, 0, 1, 1, 1, 0, 1, 0]
    assert int(got.accept_len[7]) == 1 and int(got.accept_len[9]) == 0
    for b in (0, 1, 2, 4, 5, 6, 8):
        root = logits[b, 0]
        finite = torch.isfinite(root)
        want = int(torch.where(finite, root, float("-inf")).argmax()) if finite.any() else 0
        assert int(got.accept_len[b]) == 0 and got.out_tokens[b].tolist() == [want] + [-1] * (N - 1)


# The GPU configuration on shapes that reach its tile sizes: BLOCK_V = min(2048, next_pow2(V)),
# BLOCK_S = min(BLOCK_V, 256): (64, 64) at V 37 (one tile, a short search tile), (512, 256) at
# V 300, (2048, 256) at V 2100 (two tiles, two chunks a row: the bonus draw's chunk from the
# chunks' totals).
GPU_SHAPES = [("V37-fp32", 37, torch.float32, None), ("V300-fp16-d2t", 300, torch.float16, 120),
              ("V2100-bf16", 2100, torch.bfloat16, None)]


@pytest.mark.parametrize("name, V, dtype, Vd", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
def test_gpu_config(triton_block_verify, name, V, dtype, Vd):
    module = triton_block_verify
    assert module.launch_config() == module.INTERPRETER_CONFIG  # interpreted: unless told otherwise
    tokens, logits, draft_probs, d2t, kwargs = chain_batch(10 + V, 6, 5, V, Vd=Vd, dtype=dtype)
    got = check(module, tokens, logits, draft_probs, config=module.GPU_CONFIG, d2t=d2t, **kwargs)
    assert int(got.accept_len.max()) >= 1
    # Point-mass drafts and every request sampling, with top-k and top-p.
    kwargs["temperature"] = torch.where(kwargs["temperature"] == 0, 0.9, kwargs["temperature"])
    kwargs["top_k"][::2] = 7
    kwargs["top_p"][1::2] = 0.85
    check(module, tokens, logits, config=module.GPU_CONFIG, **kwargs)


def test_chunking_on_an_h200(triton_block_verify):
    """Chunks a row on a GPU of 132 SMs: about two programs an SM over the B * N rows, in whole
    2048-entry tiles; without a GPU, up to 4 so that the merges run."""
    chunking = triton_block_verify.chunking
    assert chunking(1, 6, 49152, 2048, 132) == (24, 2048)  # SmolLM2, a chain of 5: 144 programs
    assert chunking(8, 6, 128256, 2048, 132) == (6, 22528)  # 288 programs of 11 tiles
    assert chunking(64, 6, 128256, 2048, 132) == (1, 129024)  # enough rows: one program a row
    assert chunking(1, 6, 2100, 2048, None) == (2, 2048)


def test_gpu_config_fp64(triton_block_verify):
    """fp64 logits: 64-bit order keys, 16 radix-16 digits per threshold search."""
    module = triton_block_verify
    tokens, logits, draft_probs, _, kwargs = chain_batch(12, 4, 4, 80, dtype=torch.float64)
    kwargs["temperature"][0] = 0.6
    check(module, tokens, logits, draft_probs, config=module.GPU_CONFIG, **kwargs)
