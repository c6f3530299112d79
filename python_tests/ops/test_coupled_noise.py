"""coupled_noise (docs/ops.md §15): the C++ kernel (every instruction-set cap) and the Triton
kernel (interpreter and GPU launch configurations) give the reference's float32 bits; the noise is
the one verify's coupled race uses (a race on ``log w + G`` picks verify's token); bad input.
Tests running Triton carry "triton" in their names (slow lane)."""

import pytest
import torch
from test_verify_backends import ISA_LEVELS

import eagle_kernels
from eagle_kernels import _dispatch, reference


def implementation(name):
    fn, reason = _dispatch.implementation("coupled_noise", name, "cpu")
    if fn is None:
        pytest.skip(reason)
    return fn


def inputs(B=3, W=4, n=45, d2t=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(1 << 62), 1 << 62, (B,), generator=gen)
    positions = torch.randint(0, 1 << 40, (B, W), generator=gen)
    offsets = torch.randint(0, 40000, (n,), generator=gen) if d2t else None
    return seeds, positions, n, offsets


@pytest.mark.parametrize("d2t", [False, True], ids=["ids", "d2t"])
@pytest.mark.parametrize("n", [1, 16, 45, 1000], ids=lambda n: f"n{n}")
def test_cpp_matches_reference(n, d2t, monkeypatch):
    fn = implementation("cpp")
    seeds, positions, n, offsets = inputs(n=n, d2t=d2t)
    want = reference.coupled_noise(seeds, positions, n, d2t=offsets)
    assert want.dtype == torch.float32 and want.shape == (3, 4, n) and bool(torch.isfinite(want).all())
    for isa in ISA_LEVELS:
        monkeypatch.setenv("EAGLE_KERNELS_CPU_ISA", isa)
        assert torch.equal(fn(seeds, positions, n, d2t=offsets), want), isa


@pytest.mark.parametrize("config", ["interpreter", "gpu"])
@pytest.mark.parametrize("d2t", [False, True], ids=["ids", "d2t"])
def test_triton_matches_reference(d2t, config):
    implementation("triton")
    from eagle_kernels.triton import coupled_noise as module

    seeds, positions, n, offsets = inputs(n=1100 if config == "gpu" else 45, d2t=d2t)
    launch = module.GPU_CONFIG if config == "gpu" else module.INTERPRETER_CONFIG
    got = module.coupled_noise(seeds, positions, n, d2t=offsets, _config=launch)
    assert torch.equal(got, reference.coupled_noise(seeds, positions, n, d2t=offsets))


def test_noise_is_gumbel_and_keyed_by_position():
    """Standard Gumbel draws (mean: Euler's constant, variance pi^2 / 6), independent of the
    request's other positions: the same (seed, position) gives the same row in any call."""
    fn = eagle_kernels.coupled_noise
    g = fn(torch.tensor([9]), torch.tensor([[5, 6]]), 200000)
    assert abs(float(g.mean()) - 0.5772) < 0.01 and abs(float(g.var()) - 1.6449) < 0.03
    assert float((g[0, 0] - g[0, 1]).abs().mean()) > 0.5
    assert torch.equal(fn(torch.tensor([1, 9]), torch.tensor([[0], [6]]), 200000)[1, 0], g[0, 1])


def test_verify_races_on_the_same_noise():
    """argmax_x (log w(x) + G(x)) over the target vocabulary is verify's coupled token."""
    V, trials = 50, 200
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(trials, 1, V, generator=gen) * 2
    seeds = torch.arange(trials)
    positions = torch.randint(0, 1000, (trials,), generator=gen)
    root = torch.zeros(trials, 1, dtype=torch.int64)
    out = eagle_kernels.verify(root, torch.full((trials, 1), -1, dtype=torch.int32), logits,
                               max_depth=0, temperature=torch.ones(trials), seed=seeds,
                               offset=torch.zeros(trials, dtype=torch.int64), positions=positions)
    noise = eagle_kernels.coupled_noise(seeds, positions[:, None], V)
    race = (torch.log_softmax(logits.double(), -1) + noise.double()).argmax(-1)[:, 0]
    assert torch.equal(out.out_tokens[:, 0], race)


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("case", ["seed-int32", "seed-2d", "positions-B", "positions-1d", "num-tokens-0",
                                  "d2t-shape", "d2t-negative-id"])
def test_bad_input(backend, case):
    fn = implementation(backend)
    seeds, positions, n, offsets = inputs(B=2, W=2, n=5, d2t=True)
    args = {"seed": seeds, "positions": positions, "num_tokens": n, "d2t": offsets}
    name = case.split("-")[0].replace("num", "num_tokens")
    if case == "seed-int32":
        args["seed"] = seeds.int()
    elif case == "seed-2d":
        args["seed"] = seeds[:, None]
    elif case == "positions-B":
        args["positions"] = positions[:1]
    elif case == "positions-1d":
        args["positions"] = positions[:, 0]
    elif case == "num-tokens-0":
        args["num_tokens"], args["d2t"] = 0, None
    elif case == "d2t-shape":
        args["d2t"] = offsets[:4]
    else:
        args["d2t"] = torch.tensor([0, 0, -3, 0, 0])
    with pytest.raises(ValueError, match=name):
        fn(args["seed"], args["positions"], args["num_tokens"], d2t=args["d2t"])


@pytest.mark.gpu
def test_gpu_matches_cpp(gpu_op_impl):
    fn, cpp = gpu_op_impl("coupled_noise"), implementation("cpp")
    seeds, positions, n, offsets = inputs(B=8, W=6, n=32000, d2t=True)
    want = cpp(seeds, positions, n, d2t=offsets)
    got = fn(seeds.cuda(), positions.cuda(), n, d2t=offsets.cuda())
    torch.cuda.synchronize()
    # float64 logs on the GPU (libdevice) may round differently from the CPU's in the last bit of a double:
    # after the float32 rounding almost every entry is identical.
    assert float((got.cpu() != want).float().mean()) < 1e-4
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
