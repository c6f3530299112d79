"""The per-shape graph cache of the decoder, on CPU with a stand-in capture mechanism.

``RecordingGraphs`` implements the decoder's ``StepGraphs`` interface the way CUDA graphs behave
for the loop: ``warm`` runs a real step, ``capture`` records the step without running it (or
fails), and the returned replay runs the recorded step against the same state tensors. So the
decoder's slots, buckets, warm-up, capture-failure fallback and state reuse are exercised on the
CPU exactly as on a GPU, under the GPU's static policy; only the graph itself is a stand-in.
"""

import warnings

import pytest
import torch

from eagle_kernels.decoder import SpeculativeDecoder, StepGraphs, TreeConfig
from eagle_kernels.models import LlamaModel
from eagle_kernels.models.eagle_head import EagleHead
from eagle_kernels.policy import StaticPolicy
from helpers import PROMPTS, repeat_head, tiny_hf_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

TREE = TreeConfig(3, 3, 8)
LOOKUP_TREE = TreeConfig(2, 2, 4, lookup=3)
SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0, seed=[11, 12, 13])


class RecordingGraphs(StepGraphs):
    """Counts warm-up steps, captures and replays; ``fail``: every capture raises."""

    def __init__(self, fail=False):
        self.fail, self.warms, self.captures, self.replays = fail, 0, 0, 0

    def warm(self, step, state):
        self.warms += 1
        step(state)

    def capture(self, step, state):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1

        def replay():
            self.replays += 1
            step(state)

        return replay


@pytest.fixture(scope="module")
def target():
    return LlamaModel.from_transformers(tiny_hf_model(torch.float64))


@pytest.fixture(scope="module")
def head(target):
    return repeat_head(target)


def graphed(target, head, tree=TREE, fail=False, **kwargs):
    return SpeculativeDecoder(target, head, tree, policy=StaticPolicy(), graphs=RecordingGraphs(fail), **kwargs)


def eager(target, head, tree=TREE, **kwargs):
    return SpeculativeDecoder(target, head, tree, policy=StaticPolicy(), cuda_graph=False, **kwargs)


def same(got, want):
    assert (got.sequences, got.steps, got.tau) == (want.sequences, want.steps, want.tau)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_second_call_captures_nothing(target, head, speculative):
    decoder, reference = graphed(target, head), eager(target, head)
    want = reference.generate(PROMPTS, 10, speculative=speculative)
    first = decoder.generate(PROMPTS, 10, speculative=speculative)
    assert decoder.captures == 1 and decoder.graphs.warms == 1 and first.timings["graph"] == "captured"
    replays = decoder.graphs.replays
    second = decoder.generate(PROMPTS, 10, speculative=speculative)
    assert decoder.captures == 1 and decoder.graphs.warms == 1, "the same shape captured again"
    assert second.timings["graph"] == "replayed" and second.timings["capture_s"] == 0.0
    # Every step of the second call is a replay (none eager); up to sync_every - 1 past the end.
    assert decoder.graphs.replays - replays == second.timings["replay_steps"]
    assert max(second.steps) <= second.timings["replay_steps"] <= max(second.steps) + 3
    same(first, want)
    same(second, want)


def test_sampling_equals_eager(target, head):
    for speculative in (False, True):
        decoder, reference = graphed(target, head), eager(target, head)
        want = reference.generate(PROMPTS, 12, speculative=speculative, **SAMPLING)
        for _ in range(2):  # captured, then replayed
            same(decoder.generate(PROMPTS, 12, speculative=speculative, **SAMPLING), want)


def test_warmup_captures_ahead(target, head):
    decoder, reference = graphed(target, head), eager(target, head)
    assert decoder.warmup(batch_sizes=[1, 4], max_len=40) == 4  # plain and speculative, two sizes
    warms = decoder.graphs.warms
    for prompts in (PROMPTS, PROMPTS[:1], PROMPTS[1:]):  # buckets 4, 1, 4 (2 requests padded)
        for speculative in (False, True):
            got = decoder.generate(prompts, 12, speculative=speculative)
            assert got.timings["graph"] == "replayed"
            same(got, reference.generate(prompts, 12, speculative=speculative))
    assert decoder.captures == 4 and decoder.graphs.warms == warms
    # Plain and speculative slots of a batch size share one target cache.
    assert len({id(slot.state.target_cache) for slot in decoder._slots.values()}) == 2
    assert decoder.warmup(batch_sizes=[4], max_len=40) == 0  # already captured
    decoder.release()
    assert decoder._slots == {} and decoder._caches == {}
    decoder.generate(PROMPTS, 60)  # past the released max_len: no error, a new shape
    assert decoder.captures == 5


def test_each_new_bucket_captures_once(target, head):
    decoder, reference = graphed(target, head), eager(target, head)
    decoder.MIN_CAPACITY = 32  # smallest cache bucket (256 by default, the tiny model's whole context)
    calls = [(PROMPTS, 8, 1), (PROMPTS[:1], 8, 2), (PROMPTS[:2], 8, 3), (PROMPTS[:1], 8, 3), (PROMPTS, 6, 3),
             (PROMPTS[:1], 40, 4)]  # the last: 5 + 40 + 8 + 3 + 2 = 58 tokens, past the 32-token bucket
    for prompts, max_new, captures in calls:
        same(decoder.generate(prompts, max_new), reference.generate(prompts, max_new))
        assert decoder.captures == captures, (len(prompts), max_new)
    # A slot with a larger capacity serves a shorter call of its batch bucket.
    decoder.generate(PROMPTS[:1], 5)
    assert decoder.captures == 4


def test_state_reuse_does_not_leak(target, head):
    """Calls of different prompts, batch sizes, EOS, sampling and modes in sequence on one
    decoder give what a fresh decoder gives for each call alone."""
    eos = eager(target, head).generate(PROMPTS, 10, speculative=False).sequences[1][2]
    calls = [(PROMPTS, dict(eos_token_id=eos)), (PROMPTS[:1], dict(speculative=False)),
             ([[5, 6, 7, 8, 9, 10, 11, 12, 13]], {}), (PROMPTS, SAMPLING), (PROMPTS[1:], {}),
             (PROMPTS, dict(eos_token_id=eos, speculative=False)), (PROMPTS, {})]
    for tree in (TREE, LOOKUP_TREE):
        decoder = graphed(target, head, tree)
        for prompts, kwargs in calls:
            got = decoder.generate(prompts, 10, **kwargs)
            same(got, graphed(target, head, tree).generate(prompts, 10, **kwargs))
            same(got, eager(target, head, tree).generate(prompts, 10, **kwargs))


def test_capture_failure_warns_once_and_runs_eager(target, head):
    decoder, reference = graphed(target, head, fail=True), eager(target, head)
    with pytest.warns(RuntimeWarning, match="capture failed") as caught:
        results = [decoder.generate(PROMPTS, 10, speculative=s) for s in (True, False, True)]
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert decoder.captures == 0 and decoder.graphs.replays == 0
    assert [r.timings["graph"] for r in results] == ["eager", "eager", "eager"]
    for result, speculative in zip(results, (True, False, True)):
        same(result, reference.generate(PROMPTS, 10, speculative=speculative))


def test_on_sync_sees_the_call_s_requests_only(target, head):
    decoder = graphed(target, head, sync_every=2)
    seen = []
    decoder.generate(PROMPTS, 8, on_sync=lambda out, n: seen.append((out.shape[0], n.shape[0])))
    assert seen and all(shape == (3, 3) for shape in seen)  # bucket 4, 3 requests


def test_cpu_default_keeps_no_slots(target, head):
    """The CPU's fitted policy runs eager steps on state sized to each call: no cache."""
    decoder = SpeculativeDecoder(target, head, TREE)
    decoder.generate(PROMPTS, 6)
    assert decoder._slots == {} and decoder.captures == 0
    assert decoder.warmup(batch_sizes=[2], max_len=20) == 0 and decoder._slots == {}


# ------------------------------------------------------------------ bad input
def _no_forward(monkeypatch, decoder):
    def forward(*args, **kwargs):
        raise AssertionError("a kernel ran before the argument checks")

    monkeypatch.setattr(decoder.target, "forward", forward)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_warmed_limits_raise_before_any_kernel(target, head, graphs, monkeypatch):
    decoder = graphed(target, head) if graphs else SpeculativeDecoder(target, head, TREE)
    decoder.warmup(batch_sizes=[2], max_len=20)
    warms = decoder.graphs.warms if graphs else 0
    _no_forward(monkeypatch, decoder)
    with pytest.raises(ValueError, match=r"prompts: 3 requests exceed the largest batch size warmed up, 2"):
        decoder.generate(PROMPTS, 4)
    with pytest.raises(ValueError, match=r"prompts\[1\]: 7 prompt tokens \+ max_new_tokens 14 = 21 exceed the cache "
                                         r"capacity of 20"):
        decoder.generate([PROMPTS[0], PROMPTS[2]], 14)
    if graphs:
        assert decoder.graphs.warms == warms


def test_mixed_devices_and_dtypes_raise(target, head, monkeypatch):
    decoder = graphed(target, head)
    _no_forward(monkeypatch, decoder)
    meta = torch.zeros(3, device="meta")
    for name in ("temperature", "top_p", "seed"):
        with pytest.raises(ValueError, match=rf"^{name}: a tensor on meta, the model on cpu"):
            decoder.generate(PROMPTS, 4, **{name: meta})
    with pytest.raises(ValueError, match=r"^prompts\[1\]: a tensor on meta"):
        decoder.generate([PROMPTS[0], torch.tensor(PROMPTS[1], device="meta")], 4)
    other = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    with pytest.raises(ValueError, match=r"^head: compute dtype torch.float32, the target's torch.float64"):
        SpeculativeDecoder(target, EagleHead.random(other, "eagle1"))


def test_warmup_arguments(target, head):
    decoder = graphed(target, head)
    with pytest.raises(ValueError, match="batch_sizes"):
        decoder.warmup(batch_sizes=[0])
    with pytest.raises(ValueError, match="max_len: 10000 exceeds the model's context"):
        decoder.warmup(batch_sizes=[1], max_len=10_000)
    with pytest.raises(ValueError, match="speculative"):
        graphed(target, None).warmup(batch_sizes=[1], max_len=20, speculative=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert graphed(target, None).warmup(batch_sizes=[1], max_len=20) == 1  # plain only


def test_batches_past_disable_by_batch_size_decode_plain(target, head):
    """Calls of more requests than disable_by_batch_size run plain steps (the plain decoder's tokens, no tree in the
    result) whether or not they asked for speculation; smaller calls stay speculative; warm-up captures no
    speculative step for the sizes that decode plain."""
    decoder = graphed(target, head, disable_by_batch_size=2)
    reference = eager(target, head)
    for sampling in ({}, SAMPLING):
        batch = decoder.generate(PROMPTS, 8, **sampling)
        same(batch, reference.generate(PROMPTS, 8, speculative=False, **sampling))
        assert batch.tree is None and all(tau == 1.0 for tau in batch.tau)
    pair = decoder.generate(PROMPTS[:2], 8)
    same(pair, reference.generate(PROMPTS[:2], 8))
    assert pair.tree == TREE
    fresh = graphed(target, head, disable_by_batch_size=2)
    fresh.warmup(batch_sizes=(2, 4), max_len=32)
    assert fresh.captures == 3  # plain at 2 and 4, speculative at 2 only
    with pytest.raises(ValueError, match="^disable_by_batch_size"):
        graphed(target, head, disable_by_batch_size=0)
    for bad in (True, 1.5, "2"):
        with pytest.raises(ValueError, match="^disable_by_batch_size"):
            SpeculativeDecoder(target, head, disable_by_batch_size=bad)
