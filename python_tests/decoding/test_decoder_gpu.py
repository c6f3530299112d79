"""The decoding loop on CUDA: steps captured as one CUDA graph give exactly the tokens of eager
steps (and of plain decoding), and a step never synchronises with the host."""

import contextlib
import os

import pytest
import torch

from eagle_kernels.decoder import SpeculativeDecoder, TreeConfig
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

HEADS = {
    "eagle1-repeat": repeat_head,
    "eagle3-random": lambda t: EagleHead.random(t, "eagle3", draft_vocab_size=60),
}
SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0, seed=[11, 12, 13])


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


def record_graphs(decoder, monkeypatch, around=None):
    """Wrap ``decoder._run_steps`` (optionally inside the context manager ``around()``); the
    list returned collects what each call returned: its CUDA graph, or None for eager steps."""
    graphs, original = [], decoder._run_steps

    def run(*args):
        with around() if around is not None else contextlib.nullcontext():
            graphs.append(original(*args))
        return graphs[-1]

    monkeypatch.setattr(decoder, "_run_steps", run)
    return graphs


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"d{t.depth}k{t.top_k}n{t.num_nodes}")
@pytest.mark.parametrize("make_head", HEADS.values(), ids=HEADS.keys())
def test_greedy_graph_equals_eager_equals_plain(target, make_head, tree):
    graphed, eager = decoders(target, make_head(target), tree)
    plain = eager.generate(PROMPTS, 14, speculative=False)
    assert all(len(s) == 14 for s in plain.sequences)
    assert_same(graphed.generate(PROMPTS, 14, speculative=False), plain)
    spec = eager.generate(PROMPTS, 14)
    assert spec.sequences == plain.sequences
    assert_same(graphed.generate(PROMPTS, 14), spec)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_sampling_graph_equals_eager(target, speculative):
    graphed, eager = decoders(target, repeat_head(target), TreeConfig(3, 3, 8))
    want = eager.generate(PROMPTS, 12, speculative=speculative, **SAMPLING)
    got = graphed.generate(PROMPTS, 12, speculative=speculative, **SAMPLING)
    assert_same(got, want)
    assert all(0 <= t < target.config.vocab_size for s in got.sequences for t in s)


@pytest.mark.parametrize("max_new", [1, 2, 3], ids=lambda n: f"max{n}")
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_short_generations(target, speculative, max_new):
    """1 token: the prefill's alone; 2: the eager first step alone (no capture); 3: a capture
    and a replay, unless the first speculative step already finished every request."""
    graphed, eager = decoders(target, repeat_head(target), TreeConfig(4, 2, 7), sync_every=1)
    want = eager.generate(PROMPTS, max_new, speculative=speculative)
    assert_same(graphed.generate(PROMPTS, max_new, speculative=speculative), want)
    assert all(len(s) == max_new for s in want.sequences)


@pytest.mark.parametrize("sync_every", [1, 3], ids=lambda n: f"sync{n}")
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_eos_with_graph(target, speculative, sync_every):
    graphed, eager = decoders(target, repeat_head(target), TreeConfig(3, 2, 5), sync_every=sync_every)
    free = eager.generate(PROMPTS, 14, speculative=False).sequences
    eos = free[0][3]
    want = eager.generate(PROMPTS, 14, eos_token_id=eos, speculative=speculative)
    assert_same(graphed.generate(PROMPTS, 14, eos_token_id=eos, speculative=speculative), want)
    for row, full in zip(want.sequences, free):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert row == full[:cut]


def test_on_sync_sees_replayed_steps(target):
    """on_sync runs between replays and reads the static output buffer."""
    graphed, eager = decoders(target, repeat_head(target), TreeConfig(3, 3, 8), sync_every=2)
    seen = {True: [], False: []}
    for flag, decoder in ((True, graphed), (False, eager)):
        decoder.generate(PROMPTS, 10, on_sync=lambda out, n, f=flag: seen[f].append((out.tolist(), n.tolist())))
    assert seen[True] == seen[False] and len(seen[True]) >= 1


def test_value_checks_fall_back_to_eager_steps(target, monkeypatch):
    """EAGLE_KERNELS_CHECK_VALUES=1 reads values on the host inside ops: no capture then."""
    graphed, eager = decoders(target, repeat_head(target), TreeConfig(3, 3, 8))
    want = eager.generate(PROMPTS, 8)
    monkeypatch.setenv("EAGLE_KERNELS_CHECK_VALUES", "1")
    graphs = record_graphs(graphed, monkeypatch)
    assert_same(graphed.generate(PROMPTS, 8), want)
    assert graphs == [None]


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
    (warm-up step, capture, replays; ``done`` is read only after it) runs."""
    monkeypatch.setenv("EAGLE_KERNELS_CHECK_VALUES", "0")
    head, tree = repeat_head(target), TreeConfig(3, 3, 8)
    want = SpeculativeDecoder(target, head, tree, cuda_graph=False).generate(PROMPTS, 8, speculative=speculative)
    decoder = SpeculativeDecoder(target, head, tree, sync_every=1000, cuda_graph=cuda_graph)
    graphs = record_graphs(decoder, monkeypatch, around=sync_debug_error)
    result = decoder.generate(PROMPTS, 8, speculative=speculative)
    assert len(graphs) == 1 and isinstance(graphs[0], torch.cuda.CUDAGraph) == cuda_graph
    assert_same(result, want)
