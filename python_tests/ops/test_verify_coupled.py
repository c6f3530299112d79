"""verify with coupled sampling (docs/ops.md §4, "Coupled sampling"): ``positions`` makes the
token at every sequence position the exponential race ``argmax_x w(x) / E(x)`` over the filtered
target weights, ``E(x) = -log U(seed, position, x)``. Tested here:

- the C++ kernel gives the reference's outputs on the tricky batches of test_verify_backends
  (greedy and sampling rows mixed, ties, masks, top-k / top-p), under every instruction-set cap;
- the emitted tokens do not depend on the draft: a tree and plain one-token steps give the same
  sequences for the same seeds (the property the decoder's equality tests rely on);
- exactness: sequences of the toy model of test_verify_chi2 have the joint law of plain sampling
  (χ² against the exact joint), and two planted bugs (a noise reused across positions; a race on
  ``w * U`` instead of ``w / E``) fail the same check;
- the Triton launcher (one launch: the race over a row's candidate list, or a race pass over its
  chunks; interpreted, in every launch configuration) gives the reference's outputs too;
- bad input: ``positions`` of the wrong dtype or shape is a ValueError naming it.
"""

import numpy as np
import pytest
import torch
from test_verify_backends import CASES, ISA_LEVELS, backend_impl, tricky_batch
from test_verify_chi2 import PROMPT, V_TOY, chi2_pvalue, exact_joint, toy_step_inputs

from eagle_kernels import reference
from eagle_kernels._types import VerifyOutput
from eagle_kernels.reference.random import COUPLED_DRAW
from eagle_kernels.reference.verify import sampling_probs
from helpers import assert_same, top_p_margin

EMIT = 3


def positions_for(B, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << 40, (B,), generator=gen, dtype=torch.int64)


def planted_batch(V, B, N, dtype):
    """A tricky batch (test_verify_backends) with positions, its coupled tokens planted as children so
    that walks go deep, and the reference's result; the test skips when a top-p mass is within rounding."""
    tokens, parents, logits, sampling = tricky_batch(5000 + V, B, N, V, dtype=dtype)
    if top_p_margin(logits.double(), sampling) < 1e-6:
        pytest.skip("a top-p mass within rounding of its threshold")
    positions = positions_for(B, V)
    # Each request's last child of the root gets the root's coupled token.
    first = reference.verify(tokens, parents, logits, max_depth=5, positions=positions, **sampling)
    for b in range(B):
        children = (parents[b] == 0).nonzero().flatten()
        if len(children):
            tokens[b, children[-1]] = first.out_tokens[b, 0]
    want = reference.verify(tokens, parents, logits, max_depth=5, positions=positions, **sampling)
    assert int(want.accept_len.sum()) > 0
    return tokens, parents, logits, sampling, positions, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpp_matches_reference(case, dtype, monkeypatch):
    name, B, N, V = case
    verify = backend_impl("cpp")
    tokens, parents, logits, sampling, positions, want = planted_batch(V, B, N, dtype)
    for isa in ISA_LEVELS:
        monkeypatch.setenv("EAGLE_KERNELS_CPU_ISA", isa)
        assert_same(verify(tokens, parents, logits, max_depth=5, positions=positions, **sampling), want)
    # Greedy rows are the greedy rule's, with or without positions.
    plain = reference.verify(tokens, parents, logits, max_depth=5, **sampling)
    greedy = sampling["temperature"] == 0
    for field, x, y in zip(VerifyOutput._fields, want, plain):
        assert torch.equal(x[greedy], y[greedy]), field


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("case", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_triton_matches_reference(case, dtype):
    """The Triton launcher (one launch, interpreted): draft rows given too, which coupled requests ignore."""
    name, B, N, V = case
    verify = backend_impl("triton")
    tokens, parents, logits, sampling, positions, want = planted_batch(V, B, N, dtype)
    drafts = dict(draft_probs=torch.softmax(torch.randn(B, N, V), -1), draft_sampled=torch.ones(B, N, dtype=torch.bool))
    assert_same(verify(tokens, parents, logits, max_depth=5, positions=positions, **sampling, **drafts), want)


# (Not "gpu": that id would mark the test as needing a CUDA device.)
@pytest.mark.parametrize("config", ["interpreter", "gpu-config", "search"])
def test_triton_launch_configs_match_reference(config):
    """Every launch configuration of the one-launch kernel, interpreted: the GPU's (lists of 1,024,
    4,096-entry tiles), the interpreter's (lists of 32: top-k rows race over the list, the rest take
    the race pass over 2-4 chunks) and the full-row search (candidates 0: every coupled row takes the
    race pass); temperature-only rows, top-k, top-p and greedy rows mixed, V 300."""
    import dataclasses

    backend_impl("triton")
    from eagle_kernels.triton import verify as triton_verify

    config = {"interpreter": triton_verify.INTERPRETER_CONFIG, "gpu-config": triton_verify.GPU_CONFIG,
              "search": dataclasses.replace(triton_verify.INTERPRETER_CONFIG, candidates=0)}[config]
    tokens, parents, logits, sampling, positions, want = planted_batch(300, 8, 12, torch.float32)
    strided = torch.stack([positions, positions + 7], dim=1)[:, 0]  # read in place, as the decoder passes them
    got = triton_verify.verify(tokens, parents, logits, max_depth=5, positions=strided, **sampling, _config=config)
    assert_same(got, want)


def test_triton_steps_emit_the_cpp_tokens():
    """Triton coupled steps on the toy model (trees and plain steps) give the C++ kernel's sequences."""
    variant = CHI2_VARIANTS[2]
    want = coupled_sequences(backend_impl("cpp"), 24, *variant)
    assert np.array_equal(coupled_sequences(backend_impl("triton"), 24, *variant), want)
    assert np.array_equal(coupled_sequences(backend_impl("triton"), 24, *variant, tree=False), want)


@pytest.mark.parametrize("backend_name", ["cpp", "triton"])
def test_bad_rows_match_reference(backend_name):
    """A NaN row (or a +inf entry) on a coupled walk: status 1, nothing accepted, the root's finite argmax."""
    verify = backend_impl(backend_name)
    tokens, parents, logits, sampling, positions, want = planted_batch(37, 8, 12, torch.float32)
    logits[:, 1] = float("nan")
    logits[2, 0, 5] = float("inf")
    want = reference.verify(tokens, parents, logits, max_depth=5, positions=positions, **sampling)
    assert int((want.status == 1).sum()) >= 2
    assert_same(verify(tokens, parents, logits, max_depth=5, positions=positions, **sampling), want)


def test_cpp_long_rows_match_reference():
    """A vocabulary of 49,163 (not a multiple of the 16-token blocks) at temperature 1 and 0.6, no
    filter: every entry is in the support, the case the AVX-512 blocks and the skipped logs serve."""
    verify = backend_impl("cpp")
    gen = torch.Generator().manual_seed(7)
    B, N, V = 2, 3, 49163
    logits = torch.randn(B, N, V, generator=gen) * 4
    parents = torch.tensor([[-1, 0, 1]] * B, dtype=torch.int32)
    tokens = torch.zeros(B, N, dtype=torch.int64)
    sampling = dict(temperature=torch.tensor([1.0, 0.6]), seed=torch.tensor([3, -5]),
                    offset=torch.zeros(B, dtype=torch.int64))
    positions = torch.tensor([17, 1 << 33])
    for _ in range(2):  # plant the coupled tokens one depth at a time
        out = reference.verify(tokens, parents, logits, max_depth=2, positions=positions, **sampling)
        for b in range(B):
            tokens[b, 1 + int(out.accept_len[b])] = out.out_tokens[b, int(out.accept_len[b])]
    want = reference.verify(tokens, parents, logits, max_depth=2, positions=positions, **sampling)
    assert want.accept_len.tolist() == [2, 2]
    assert_same(verify(tokens, parents, logits, max_depth=2, positions=positions, **sampling), want)


def coupled_sequences(verify, trials, temperature, top_k, top_p, tree=True, race=None):
    """The first EMIT tokens of ``trials`` requests (seed = trial) decoded by coupled steps on
    the toy model: the depth-2 tree of test_verify_chi2, or one-node plain steps (``tree=False``).
    ``race`` replaces verify by a toy coupled verifier with a planted bug."""
    histories = [list(PROMPT) for _ in range(trials)]
    emitted = [[] for _ in range(trials)]
    while True:
        active = [i for i in range(trials) if len(emitted[i]) < EMIT]
        if not active:
            break
        tokens, parents, logits = toy_step_inputs([histories[i] for i in active])
        if not tree:
            tokens, parents, logits = tokens[:, :1], parents[:, :1], logits[:, :1]
        B = len(active)
        kwargs = dict(max_depth=2 if tree else 0, temperature=torch.full((B,), temperature),
                      top_k=torch.full((B,), top_k, dtype=torch.int32), top_p=torch.full((B,), top_p),
                      seed=torch.tensor(active, dtype=torch.int64), offset=torch.zeros(B, dtype=torch.int64),
                      positions=torch.tensor([len(histories[i]) for i in active], dtype=torch.int64))
        out = (verify if race is None else buggy_coupled(race))(tokens, parents, logits, **kwargs)
        for row, i in enumerate(active):
            new = out.out_tokens[row, : int(out.accept_len[row]) + 1].tolist()
            histories[i] += new
            emitted[i] += new
    return np.array([e[:EMIT] for e in emitted])


def buggy_coupled(race):
    """A toy coupled verifier with a planted bug: ``reused`` draws every position's race from
    position 0's numbers; ``product`` races on ``w * U`` (not exponential clocks)."""

    def verify(tokens, parents, logits, *, max_depth, temperature, top_k, top_p, seed, offset, positions):
        B, N, V = logits.shape
        accept_len = torch.zeros(B, dtype=torch.int32)
        nodes = torch.full((B, max_depth + 1), -1, dtype=torch.int32)
        out = torch.full((B, max_depth + 1), -1, dtype=torch.int64)
        ids = torch.arange(V)
        for b in range(B):
            node, depth = 0, 0
            nodes[b, 0] = 0
            while True:
                w = sampling_probs(logits[b, node], float(temperature[b]), int(top_k[b]), float(top_p[b])).double()
                position = 0 if race == "reused" else int(positions[b]) + depth
                u = reference.uniform(int(seed[b]), position, ids, COUPLED_DRAW)
                score = w * u if race == "product" else w / -torch.log(u)
                token = int(torch.argmax(torch.where(w > 0, score, torch.full_like(score, -1.0))))
                children = [c for c in range(1, N) if int(parents[b, c]) == node and int(tokens[b, c]) == token]
                if depth == max_depth or not children:
                    out[b, depth] = token
                    break
                node, depth = children[0], depth + 1
                nodes[b, depth] = node
                out[b, depth - 1] = token
            accept_len[b] = depth
        return VerifyOutput(accept_len, nodes, out, torch.zeros(B, dtype=torch.int32))

    return verify


CHI2_VARIANTS = [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.0, 0, 0.8)]
CHI2_IDS = ["t1", "t0.7-k3", "p0.8"]


@pytest.mark.parametrize("variant", CHI2_VARIANTS, ids=CHI2_IDS)
def test_tree_and_plain_steps_emit_the_same_tokens(variant):
    """The output is a function of the seed and the positions only: the tree's drafts change the
    number of steps, never the tokens."""
    verify = backend_impl("cpp")
    tree = coupled_sequences(verify, 300, *variant)
    plain = coupled_sequences(verify, 300, *variant, tree=False)
    assert np.array_equal(tree, plain)
    assert np.array_equal(tree[:40], coupled_sequences(backend_impl("reference"), 40, *variant))


@pytest.mark.slow
@pytest.mark.parametrize("variant", CHI2_VARIANTS, ids=CHI2_IDS)
def test_coupled_sampling_is_exact_chi2(variant):
    samples = coupled_sequences(backend_impl("cpp"), 2000, *variant)
    assert chi2_pvalue(samples, exact_joint(*variant)) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("race", ["reused", "product"])
def test_chi2_detects_planted_bugs(race):
    variant = (1.0, 0, 1.0)
    samples = coupled_sequences(None, 2000, *variant, race=race)
    assert chi2_pvalue(samples, exact_joint(*variant)) < 1e-6
    # The toy verifier without a bug passes, so the failures are the bugs'.
    assert np.array_equal(coupled_sequences(None, 200, *variant, race="none"),
                          coupled_sequences(backend_impl("cpp"), 200, *variant))


@pytest.mark.parametrize("backend_name", ["reference", "cpp", "triton"])
@pytest.mark.parametrize("bad", [torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int64),
                                 torch.zeros(2, 1, dtype=torch.int64)], ids=["int32", "B3", "2d"])
def test_bad_positions(backend_name, bad):
    verify = backend_impl(backend_name)
    logits = torch.randn(2, 1, V_TOY)
    tokens = torch.zeros(2, 1, dtype=torch.int64)
    parents = torch.full((2, 1), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="positions"):
        verify(tokens, parents, logits, max_depth=0, temperature=torch.ones(2), positions=bad)




@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("V", [49152, 128256])
def test_gpu_matches_cpp(gpu_op_impl, V, dtype):
    """The CUDA kernel against the C++ kernel on the same inputs:
    temperature-only, top-k and top-p requests with a greedy one, coupled tokens planted as children."""
    fn, cpp = gpu_op_impl("verify"), backend_impl("cpp")
    B, N = 4, 16
    gen = torch.Generator().manual_seed(V)
    logits = (torch.randn(B, N, V, generator=gen) * 3).to(dtype)
    parents = torch.tensor([[-1] + [i // 2 for i in range(N - 1)]] * B, dtype=torch.int32)
    tokens = torch.randint(0, V, (B, N), generator=gen)
    sampling = dict(temperature=torch.tensor([1.0, 0.7, 0.0, 1.0]),
                    top_k=torch.tensor([0, 50, 0, 0], dtype=torch.int32), top_p=torch.tensor([1.0, 1.0, 1.0, 0.9]),
                    seed=torch.tensor([1, 2, 3, 4]), offset=torch.zeros(B, dtype=torch.int64),
                    positions=torch.tensor([10, 200, 3000, 1 << 35]))
    for _ in range(3):  # plant each request's coupled path one depth at a time
        out = cpp(tokens, parents, logits, max_depth=4, **sampling)
        for b in range(B):
            n = int(out.accept_len[b])
            children = (parents[b] == int(out.accept_nodes[b, n])).nonzero().flatten()
            if len(children):
                tokens[b, children[-1]] = out.out_tokens[b, n]
    want = cpp(tokens, parents, logits, max_depth=4, **sampling)
    assert int(want.accept_len.sum()) >= 4
    got = fn(tokens.cuda(), parents.cuda(), logits.cuda(), max_depth=4, **{k: v.cuda() for k, v in sampling.items()})
    torch.cuda.synchronize()
    assert_same(VerifyOutput(*(t.cpu() for t in got)), want)
