"""coupled_draft_logits (docs/ops.md §16): a drafting step's rows under coupled sampling. The C++
kernel (every instruction-set cap) gives the reference's float32 bits (the same ATen arithmetic and
the noise of coupled_noise); the Triton kernel (interpreter and GPU launch configurations) the
reference's values within float32 rounding of the log-softmax, with the noise term's bits; greedy
requests' rows come back unchanged; bad input. Tests running Triton carry "triton" in their names
(slow lane)."""

import pytest
import torch
from test_verify_backends import ISA_LEVELS

import eagle_kernels
from eagle_kernels import _dispatch, reference


def implementation(name):
    fn, reason = _dispatch.implementation("coupled_draft_logits", name, "cpu")
    if fn is None:
        pytest.skip(reason)
    return fn


def inputs(B=4, M=3, n=45, d2t=True, dtype=torch.float32, seed=0):
    """Request 1 greedy, the others at temperatures 1, 0.6, 1.7; positions a strided view (every
    other entry of a [B, 2] tensor), as the decoder passes one depth's column."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, M, n, generator=gen) * 3).to(dtype)
    temperature = torch.tensor([1.0, 0.0, 0.6, 1.7][:B])
    seeds = torch.randint(-(1 << 62), 1 << 62, (B,), generator=gen)
    positions = torch.randint(0, 1 << 40, (B, 2), generator=gen)[:, 1]
    offsets = torch.randint(0, 40000, (n,), generator=gen) if d2t else None
    return logits, temperature, seeds, positions, offsets


def expected(logits, temperature, seeds, positions, offsets):
    """The contract's formula in float64 (the noise from coupled_noise)."""
    x = logits.double()
    noise = reference.coupled_noise(seeds, positions[:, None].contiguous(), logits.shape[2], d2t=offsets).double()
    t = temperature.double().clamp(min=1e-30)[:, None, None]
    perturbed = torch.log_softmax(x / t, -1) + noise
    return torch.where((temperature > 0)[:, None, None], perturbed, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("d2t", [False, True], ids=["ids", "d2t"])
@pytest.mark.parametrize("n", [1, 45, 1000], ids=lambda n: f"n{n}")
def test_reference_and_cpp(n, d2t, dtype, monkeypatch):
    fn = implementation("cpp")
    args = inputs(n=n, d2t=d2t, dtype=dtype)
    logits, temperature, seeds, positions, offsets = args
    want = reference.coupled_draft_logits(logits, temperature, seeds, positions, d2t=offsets)
    assert want.dtype == torch.float32 and want.shape == logits.shape
    torch.testing.assert_close(want.double(), expected(*args), rtol=0, atol=1e-5)
    assert torch.equal(want[1], logits[1].float())  # the greedy request's rows
    for isa in ISA_LEVELS:
        monkeypatch.setenv("EAGLE_KERNELS_CPU_ISA", isa)
        assert torch.equal(fn(logits, temperature, seeds, positions, d2t=offsets), want), isa


# (Not "gpu": that id would mark the test as needing a CUDA device.)
@pytest.mark.parametrize("config", ["interpreter", "gpu-config"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_reference(dtype, config):
    implementation("triton")
    from eagle_kernels.triton import coupled_draft_logits as module

    launch = module.GPU_CONFIG if config == "gpu-config" else module.INTERPRETER_CONFIG
    logits, temperature, seeds, positions, offsets = inputs(n=2100 if config == "gpu-config" else 150, dtype=dtype)
    # Rows with a stride over M (a slice of a wider tensor): read in place.
    wide = torch.stack([logits, logits], dim=2).flatten(1, 2)[:, ::2]
    assert wide.stride(1) == 2 * logits.shape[2] and torch.equal(wide, logits)
    got = module.coupled_draft_logits(wide, temperature, seeds, positions, d2t=offsets, _config=launch)
    want = reference.coupled_draft_logits(logits, temperature, seeds, positions, d2t=offsets)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert torch.equal(got[1], logits[1].float())
    # The noise term is coupled_noise's, bit for bit: the rows differ from log_softmax by it alone.
    log_probs = torch.log_softmax(logits.float() / temperature.clamp(min=1e-6)[:, None, None], -1)
    noise = reference.coupled_noise(seeds, positions[:, None].contiguous(), logits.shape[2], d2t=offsets)
    torch.testing.assert_close(got[[0, 2, 3]] - log_probs[[0, 2, 3]], noise[[0, 2, 3]].expand(-1, 3, -1),
                               rtol=0, atol=2e-5)


def nonfinite_inputs():
    """Rows with a NaN, a +inf, some -inf and all -inf entries, for a sampling and a greedy request."""
    logits, temperature, seeds, positions, offsets = inputs(B=4, M=4, n=150)
    logits[0, 0, 7] = float("nan")
    logits[0, 1, 3] = float("inf")
    logits[0, 2, ::2] = float("-inf")
    logits[0, 3] = float("-inf")
    logits[1] = logits[0]  # the greedy request: unchanged, non-finite entries too
    return logits, temperature, seeds, positions, offsets


def test_nonfinite_rows_reference_and_cpp():
    """§16: a row with a non-finite entry gives what the log-softmax gives for it, no error; the C++ kernel the
    reference's bits there too (NaN where the reference has NaN)."""
    logits, temperature, seeds, positions, offsets = nonfinite_inputs()
    want = reference.coupled_draft_logits(logits, temperature, seeds, positions, d2t=offsets)
    log_probs = torch.log_softmax(logits[0].float(), -1)  # temperature 1
    assert torch.equal(want[0].isnan(), (log_probs + 0).isnan())
    assert want[0, 0].isnan().all() and want[0, 3].isnan().all()  # a NaN, or nothing finite: the whole row
    assert want[0, 2, ::2].eq(float("-inf")).all() and want[0, 2, 1::2].isfinite().all()  # -inf stays -inf
    assert torch.equal(want[1].nan_to_num(), logits[1].nan_to_num()) and torch.equal(want[1].isnan(), logits[1].isnan())
    got = implementation("cpp")(logits, temperature, seeds, positions, d2t=offsets)
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())


def test_nonfinite_rows_triton():
    """The Triton kernel (both launch configurations) puts NaN and +-inf where the reference does, and its finite
    entries within float32 rounding."""
    implementation("triton")
    from eagle_kernels.triton import coupled_draft_logits as module

    logits, temperature, seeds, positions, offsets = nonfinite_inputs()
    want = reference.coupled_draft_logits(logits, temperature, seeds, positions, d2t=offsets)
    for launch in (module.INTERPRETER_CONFIG, module.GPU_CONFIG):
        got = module.coupled_draft_logits(logits, temperature, seeds, positions, d2t=offsets, _config=launch)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), launch
        assert torch.equal(got[got.isinf()], want[want.isinf()]), launch
        finite = want.isfinite()
        torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=2e-5)


def tiny_temperature_case(temperature):
    """One request at ``temperature``, two rows of finite logits that overflow when divided by it (below ~1e-36): a
    single largest entry, and two tied ones. Returns the call's inputs and a check of a result against the limit
    T -> 0: no NaN, log(1 / ties) plus the noise on the largest entries, the others below -1e15 (-inf where
    (logit - max) / T overflows)."""
    logits = torch.tensor([[[0.0, 1.0, 0.5, 100.0, -3.0], [2.0, 7.0, 7.0, -1.0, 6.5]]])
    args = (logits, torch.tensor([temperature]), torch.tensor([11]), torch.tensor([5]))
    noise = reference.coupled_noise(args[2], args[3][:, None], 5)[0, 0]
    top = logits[0] == logits[0].amax(-1, keepdim=True)
    limit = noise - torch.log(top.sum(-1, keepdim=True).float())

    def check(out):
        assert not out.isnan().any()
        torch.testing.assert_close(out[0][top], limit.expand(-1, 5)[top], rtol=0, atol=1e-6)
        assert (out[0][~top] < -1e15).all()

    return args, check


@pytest.mark.parametrize("temperature", [1e-40, 1e-37, 1e-20], ids=["1e-40", "1e-37", "1e-20"])
def test_tiny_temperature_is_the_limit(temperature, monkeypatch):
    """(logits - max) / T, as verify: a temperature so small that a logit over it overflows gives the limit T -> 0
    (the largest entries share the mass, the others -inf), never NaN; the C++ kernel the reference's bits."""
    args, check = tiny_temperature_case(temperature)
    want = reference.coupled_draft_logits(*args)
    check(want)
    fn = implementation("cpp")
    for isa in ISA_LEVELS:
        monkeypatch.setenv("EAGLE_KERNELS_CPU_ISA", isa)
        assert torch.equal(fn(*args), want), isa


@pytest.mark.parametrize("temperature", [1e-40, 1e-37], ids=["1e-40", "1e-37"])
def test_tiny_temperature_triton(temperature):
    implementation("triton")
    from eagle_kernels.triton import coupled_draft_logits as module

    args, check = tiny_temperature_case(temperature)
    for launch in (module.INTERPRETER_CONFIG, module.GPU_CONFIG):
        check(module.coupled_draft_logits(*args, _config=launch))


def test_drafts_race_like_the_target():
    """With the target's own logits as draft logits, the perturbed argmax is verify's coupled token:
    a head that agrees with the target drafts exactly the target's winners."""
    V, trials = 60, 200
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(trials, 1, V, generator=gen) * 2
    temperature = torch.full((trials,), 0.8)
    seeds = torch.arange(trials)
    positions = torch.randint(0, 1000, (trials,), generator=gen)
    root, parents = torch.zeros(trials, 1, dtype=torch.int64), torch.full((trials, 1), -1, dtype=torch.int32)
    out = eagle_kernels.verify(root, parents, logits, max_depth=0, temperature=temperature, seed=seeds,
                               offset=torch.zeros(trials, dtype=torch.int64), positions=positions)
    drafts = eagle_kernels.coupled_draft_logits(logits, temperature, seeds, positions)
    assert float((drafts.argmax(-1)[:, 0] == out.out_tokens[:, 0]).float().mean()) > 0.99


def test_fake_and_opcheck():
    args = inputs(n=33)
    fake = torch.library.opcheck(torch.ops.eagle_kernels.coupled_draft_logits, args[:4], {"d2t": args[4]})
    assert all(v == "SUCCESS" for v in fake.values()), fake


BAD_CASES = ["logits-int", "logits-2d", "logits-empty", "temperature-fp64", "temperature-B", "temperature-negative",
             "temperature-nan", "seed-int32", "seed-B", "positions-2d", "positions-int32", "d2t-shape",
             "d2t-negative-id"]


@pytest.mark.parametrize("backend", ["reference", "cpp", "triton"])
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input(backend, case):
    fn = implementation(backend)
    logits, temperature, seeds, positions, offsets = inputs(B=2, M=2, n=5, d2t=True)
    args = {"logits": logits, "temperature": temperature, "seed": seeds, "positions": positions, "d2t": offsets}
    name, _, what = case.partition("-")
    if what == "int":
        args["logits"] = logits.int()
    elif what == "2d":
        args[name] = args[name][:, 0] if name == "logits" else args[name][:, None]
    elif what == "empty":
        args["logits"], args["d2t"] = logits[:, :, :0], None
    elif what == "fp64":
        args["temperature"] = temperature.double()
    elif what == "B":
        args[name] = args[name][:1]
    elif what == "negative" and name == "temperature":
        args["temperature"] = torch.tensor([1.0, -0.5])
    elif what == "nan":
        args["temperature"] = torch.tensor([float("nan"), 1.0])
    elif what == "int32":
        args[name] = args[name].int()
    elif what == "shape":
        args["d2t"] = offsets[:4]
    else:
        args["d2t"] = torch.tensor([0, 0, -3, 0, 0])
    with pytest.raises(ValueError, match=name):
        fn(args["logits"], args["temperature"], args["seed"], args["positions"], d2t=args["d2t"])


@pytest.mark.gpu
def test_gpu_matches_cpp(gpu_op_impl):
    fn, cpp = gpu_op_impl("coupled_draft_logits"), implementation("cpp")
    logits, temperature, seeds, positions, offsets = inputs(B=4, M=8, n=8192, dtype=torch.bfloat16)
    want = cpp(logits, temperature, seeds, positions, d2t=offsets)
    got = fn(logits.cuda(), temperature.cuda(), seeds.cuda(), positions.cuda(), d2t=offsets.cuda())
    torch.cuda.synchronize()
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=2e-5)
