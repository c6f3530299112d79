"""The decoding loop on CUDA: steps captured as one CUDA graph give exactly the tokens of eager
steps (and of plain decoding), a shape is captured once per decoder (or ahead of time by
``warmup``), and a step never synchronises with the host.

Most tests decode 4 prompts, a batch bucket of its own, so graph and eager steps run the same
shapes and must agree bit for bit; a padded batch is compared with the eager steps of the same
batch padded with a dummy request (GEMMs of another row count may round differently)."""

import contextlib
import os

import pytest
import torch

from eagle_kernels.decoder import SpeculativeDecoder, StepGraphs, TreeConfig
from eagle_kernels.models import LlamaModel
from eagle_kernels.models.eagle_head import EagleHead

transformers = pytest.importorskip("transformers")
from helpers import (  # noqa: E402
    PROMPTS,
    TREES,
    repeat_head,
    tiny_hf_model,  # noqa: E402
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
    # conftest defaults TRITON_INTERPRET to 1 for the CPU tests; the interpreter copies CUDA
    # tensors through the host, which neither a sync-free step nor a capture allows.
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="Triton interpreter active: run the GPU tests with TRITON_INTERPRET=0"),
]

PROMPTS4 = PROMPTS + [[30, 31, 32, 33]]
HEADS = {
    "eagle1-repeat": repeat_head,
    "eagle3-random": lambda t: EagleHead.random(t, "eagle3", draft_vocab_size=60),
}
SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0, seed=[11, 12, 13, 14])


@pytest.fixture(scope="module")
def target():
    # Triton's tree attention has no fp64 path: fp32 (matmuls without TF32, torch's default).
    return LlamaModel.from_transformers(tiny_hf_model(torch.float32), device="cuda")


def decoders(target, head, tree, **kwargs):
    return (SpeculativeDecoder(target, head, tree, cuda_graph=True, **kwargs),
            SpeculativeDecoder(target, head, tree, cuda_graph=False, **kwargs))


def assert_same(got, want):
    assert got.sequences == want.sequences
    assert got.steps == want.steps
    assert got.tau == want.tau


def record_runs(decoder, monkeypatch, around=None):
    """Wrap the decoder's step loops (optionally inside the context manager ``around()``); the
    list returned collects "slot" (steps on a slot: captured or replayed) or "eager" per call."""
    runs = []
    for name, kind in (("_run_slot", "slot"), ("_run_steps", "eager")):
        original = getattr(decoder, name)

        def run(*args, original=original, kind=kind):
            with around() if around is not None else contextlib.nullcontext():
                result = original(*args)
            runs.append(kind)
            return result

        monkeypatch.setattr(decoder, name, run)
    return runs


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"d{t.depth}k{t.top_k}n{t.num_nodes}")
@pytest.mark.parametrize("make_head", HEADS.values(), ids=HEADS.keys())
def test_greedy_graph_equals_eager_equals_plain(target, make_head, tree):
    graphed, eager = decoders(target, make_head(target), tree)
    plain = eager.generate(PROMPTS4, 14, speculative=False)
    assert all(len(s) == 14 for s in plain.sequences)
    assert_same(graphed.generate(PROMPTS4, 14, speculative=False), plain)
    spec = eager.generate(PROMPTS4, 14)
    assert spec.sequences == plain.sequences
    assert_same(graphed.generate(PROMPTS4, 14), spec)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_sampling_graph_equals_eager(target, speculative):
    graphed, eager = decoders(target, repeat_head(target), TreeConfig(3, 3, 8))
    want = eager.generate(PROMPTS4, 12, speculative=speculative, **SAMPLING)
    got = graphed.generate(PROMPTS4, 12, speculative=speculative, **SAMPLING)
    assert_same(got, want)
    assert all(0 <= t < target.config.vocab_size for s in got.sequences for t in s)


@pytest.mark.parametrize("max_new", [1, 2, 3], ids=lambda n: f"max{n}")
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_short_generations(target, speculative, max_new):
    """1 token: the prefill's alone; 2: the eager first step alone (no capture); 3: a capture
    and a replay, unless the first speculative step already finished every request."""
    graphed, eager = decoders(target, repeat_head(target), TreeConfig(4, 2, 7), sync_every=1)
    want = eager.generate(PROMPTS4, max_new, speculative=speculative)
    assert_same(graphed.generate(PROMPTS4, max_new, speculative=speculative), want)
    assert all(len(s) == max_new for s in want.sequences)


@pytest.mark.parametrize("sync_every", [1, 3], ids=lambda n: f"sync{n}")
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_eos_with_graph(target, speculative, sync_every):
    graphed, eager = decoders(target, repeat_head(target), TreeConfig(3, 2, 5), sync_every=sync_every)
    free = eager.generate(PROMPTS4, 14, speculative=False).sequences
    eos = free[0][3]
    want = eager.generate(PROMPTS4, 14, eos_token_id=eos, speculative=speculative)
    assert_same(graphed.generate(PROMPTS4, 14, eos_token_id=eos, speculative=speculative), want)
    for row, full in zip(want.sequences, free):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert row == full[:cut]


def test_on_sync_sees_replayed_steps(target):
    """on_sync runs between replays and reads the static output buffer."""
    graphed, eager = decoders(target, repeat_head(target), TreeConfig(3, 3, 8), sync_every=2)
    seen = {True: [], False: []}
    for flag, decoder in ((True, graphed), (False, eager)):
        # Rows up to each request's valid length: the graph's buffer is as wide as its cache.
        decoder.generate(PROMPTS4, 10, on_sync=lambda out, n, f=flag: seen[f].append(
            [row[:k] for row, k in zip(out.tolist(), n.tolist())]))
    assert seen[True] == seen[False] and len(seen[True]) >= 1


def test_value_checks_fall_back_to_eager_steps(target, monkeypatch):
    """EAGLE_KERNELS_CHECK_VALUES=1 reads values on the host inside ops: no capture then."""
    graphed, eager = decoders(target, repeat_head(target), TreeConfig(3, 3, 8))
    want = eager.generate(PROMPTS4, 8)
    monkeypatch.setenv("EAGLE_KERNELS_CHECK_VALUES", "1")
    runs = record_runs(graphed, monkeypatch)
    assert_same(graphed.generate(PROMPTS4, 8), want)
    assert runs == ["eager"] and graphed.captures == 0


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_second_call_replays_without_capture(target, speculative):
    graphed, eager = decoders(target, repeat_head(target), TreeConfig(3, 3, 8))
    want = eager.generate(PROMPTS4, 12, speculative=speculative)
    first = graphed.generate(PROMPTS4, 12, speculative=speculative)
    second = graphed.generate(PROMPTS4, 12, speculative=speculative)
    assert graphed.captures == 1
    assert (first.timings["graph"], second.timings["graph"]) == ("captured", "replayed")
    assert second.timings["capture_s"] == 0.0 and second.timings["replay_s"] > 0
    assert second.timings["replay_steps"] >= max(second.steps)
    assert_same(first, want)
    assert_same(second, want)


def test_warmup_then_padded_batches(target):
    """warmup captures ahead; a batch of 3 runs padded in the 4-bucket and gets the tokens of
    eager steps on the same 4 rows (the 4th a dummy)."""
    head = repeat_head(target)
    graphed, eager = decoders(target, head, TreeConfig(3, 3, 8))
    assert graphed.warmup(batch_sizes=[1, 4], max_len=64) == 4
    for prompts in (PROMPTS, PROMPTS4, PROMPTS[:1]):
        for speculative in (False, True):
            got = graphed.generate(prompts, 10, speculative=speculative)
            assert got.timings["graph"] == "replayed"
            padded = prompts + [[0]] * ((4 if len(prompts) > 1 else 1) - len(prompts))
            want = eager.generate(padded, 10, speculative=speculative)
            assert got.sequences == want.sequences[: len(prompts)]
    assert graphed.captures == 4
    with pytest.raises(ValueError, match="exceed the largest batch size warmed up"):
        graphed.generate(PROMPTS4 + PROMPTS, 4)


def test_capture_failure_falls_back_to_eager(target, monkeypatch):
    graphed, eager = decoders(target, repeat_head(target), TreeConfig(3, 3, 8))
    want = eager.generate(PROMPTS4, 10)

    def failing_graph(*args, **kwargs):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(torch.cuda, "graph", failing_graph)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        got = graphed.generate(PROMPTS4, 10)
    assert_same(got, want)
    assert got.timings["graph"] == "eager" and graphed.captures == 0


class EagerReplays(StepGraphs):
    """The slots' mechanism without graphs: a "replay" runs the step eagerly. The reference
    for bf16, where eager steps of another cache capacity may round differently (tree
    attention's split count follows the capacity)."""

    def warm(self, step, state):
        step(state)

    def capture(self, step, state):
        return lambda: step(state)


def test_bf16_graph_equals_eager():
    """16-bit end to end: bf16 weights, activations and KV cache; graph replays (captured,
    then replayed in a second call) give the tokens of eager steps on the same slot."""
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32), dtype=torch.bfloat16, device="cuda")
    head = EagleHead.random(target, "eagle3", draft_vocab_size=60)
    tree = TreeConfig(3, 3, 8)
    graphed = SpeculativeDecoder(target, head, tree)
    eager = SpeculativeDecoder(target, head, tree, graphs=EagerReplays())
    for speculative in (False, True):
        want = eager.generate(PROMPTS4, 12, speculative=speculative)
        for _ in range(2):
            assert_same(graphed.generate(PROMPTS4, 12, speculative=speculative), want)
    assert graphed.captures == 2 and eager.captures == 2


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs sm_90 or later")
def test_bf16_pdl_on_equals_off():
    """Programmatic dependent launch changes when kernels start, never what they compute: the bf16
    GPU path's tokens with every Triton kernel launched with PDL (graphs captured, then replayed)
    equal those with none, plain and speculative."""
    from eagle_kernels.triton import _pdl

    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32), dtype=torch.bfloat16, device="cuda")
    head = EagleHead.random(target, "eagle3", draft_vocab_size=60)
    tree = TreeConfig(3, 3, 8)
    results = {}
    for on in (False, True):
        with _pdl.forced(on):
            decoder = SpeculativeDecoder(target, head, tree)
            results[on] = [decoder.generate(PROMPTS4, 12, speculative=speculative)
                           for speculative in (False, True) for _ in range(2)]
            assert decoder.captures == 2
    for got, want in zip(results[True], results[False]):
        assert_same(got, want)


@contextlib.contextmanager
def sync_debug_error():
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_steps_never_synchronise(target, speculative, cuda_graph, monkeypatch):
    """torch's sync debug mode raises on any synchronising CUDA call made while the step loop
    (warm-up step, capture, replays; ``done`` is read only after it) runs, on the first call
    of a shape and on a replayed one."""
    monkeypatch.setenv("EAGLE_KERNELS_CHECK_VALUES", "0")
    head, tree = repeat_head(target), TreeConfig(3, 3, 8)
    want = SpeculativeDecoder(target, head, tree, cuda_graph=False).generate(PROMPTS4, 8, speculative=speculative)
    decoder = SpeculativeDecoder(target, head, tree, sync_every=1000, cuda_graph=cuda_graph)
    runs = record_runs(decoder, monkeypatch, around=sync_debug_error)
    for _ in range(2):
        assert_same(decoder.generate(PROMPTS4, 8, speculative=speculative), want)
    assert runs == (["slot", "slot"] if cuda_graph else ["eager", "eager"])
