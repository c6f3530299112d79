"""Draft-head training: the training-time-test forward equals the decoder's draft path, the
losses and the draft vocabulary are right, and a short run on a tiny target learns."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from eagle_kernels.models import LlamaModel
from eagle_kernels.models.eagle_head import EagleHead, HeadConfig
from eagle_kernels.train import corpus, features, trainer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")
from helpers import tiny_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def target():
    return LlamaModel.from_transformers(tiny_hf_model(torch.float64))


def random_trainable(target, kind, seed=0):
    config = HeadConfig.for_target(target.config, kind, 40 if kind == "eagle3" else None)
    d2t = None
    if kind == "eagle3":
        ids = torch.sort(torch.randperm(target.config.vocab_size,
                                        generator=torch.Generator().manual_seed(seed))[:40]).values
        d2t = ids - torch.arange(40)
    weights = trainer.initial_weights(target, config, d2t, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name, w in weights.items():  # move away from the structured start so every weight matters
        if w.is_floating_point():
            weights[name] = w + torch.randn(w.shape, generator=g) * 0.05
    return trainer.TrainableHead(config, weights, target).double()


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_unrolled_steps_equal_the_decoders_draft_path(target, kind):
    """Step j of pair i must be what the decoder computes for a depth-j draft node whose
    ancestors carry tokens i+2 .. i+j+1 on top of a head cache holding pairs 0 .. i."""
    head = random_trainable(target, kind)
    eagle = head.to_eagle_head(target)
    T, steps = 9, 3
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, target.config.vocab_size, (1, T), generator=g)
    H = target.config.hidden_size
    if kind == "eagle1":
        hidden, layers = torch.randn(1, T, H, generator=g, dtype=torch.float64), None
    else:
        hidden, layers = None, torch.randn(1, T, 3, H, generator=g, dtype=torch.float64)
    feats = head.input_features(hidden, layers)
    with torch.no_grad():
        unrolled = head.unrolled(tokens, feats, steps)
    for i in range(T - steps):
        cache = eagle.new_cache(1, 32)
        pair_tokens = tokens[:, 1: i + 2]
        out = eagle(pair_tokens, feats[:, : i + 1], cache)
        torch.testing.assert_close(out, unrolled[0][:, : i + 1], rtol=1e-7, atol=1e-7)
        cache.seqlens.fill_(i + 1)
        parent = out[:, i:i + 1]
        masks = torch.zeros(1, steps - 1, 1, dtype=torch.int64)
        for depth in range(1, steps):
            masks[0, depth - 1, 0] = (1 << depth) - 1  # the slot and all its ancestors
            parent = eagle(tokens[:, i + 1 + depth: i + 2 + depth], parent, cache,
                           positions=torch.tensor([[i + depth]]), tree_mask=masks[:, :depth],
                           slot_offset=depth - 1)
            torch.testing.assert_close(parent[:, 0], unrolled[depth][:, i], rtol=1e-7, atol=1e-7)


def test_soft_cross_entropy_against_explicit_sum():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 12, generator=g)
    ids = torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(5)])
    logp = torch.log_softmax(torch.randn(5, 3, generator=g), -1)
    valid = torch.tensor([True, True, False, True, True])
    loss, agree = trainer.soft_cross_entropy(logits, ids, logp, None, valid)
    want = []
    for r in range(5):
        if valid[r]:
            p = torch.softmax(logp[r], -1)
            want.append(-(p * torch.log_softmax(logits[r], -1)[ids[r]]).sum())
    torch.testing.assert_close(loss, torch.stack(want).mean())
    assert agree.tolist() == [bool(valid[r] and logits[r].argmax() == ids[r, 0]) for r in range(5)]


def test_soft_cross_entropy_drops_tokens_outside_the_draft_vocabulary():
    logits = torch.zeros(1, 2)
    logits[0, 1] = 3.0
    t2d = torch.tensor([-1, 0, -1, 1])  # draft vocabulary = target ids 1 and 3
    ids = torch.tensor([[3, 0, 1]])
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    loss, agree = trainer.soft_cross_entropy(logits, ids, logp, t2d, torch.tensor([True]))
    p = torch.tensor([0.5, 0.2]) / 0.7  # ids 3 and 1 kept, renormalised
    want = -(p * torch.log_softmax(logits[0], -1)[torch.tensor([1, 0])]).sum()
    torch.testing.assert_close(loss, want)
    assert agree.tolist() == [True]  # the draft's argmax (draft id 1) is target id 3


def test_chain_tau():
    assert trainer.chain_tau([]) == 1.0
    assert trainer.chain_tau([1.0, 1.0, 1.0]) == 4.0
    assert trainer.chain_tau([0.5, 0.5]) == pytest.approx(1.75)


def test_corpus_split_is_by_name_and_stable():
    docs = [corpus.Document(f"code:m{i}.py", corpus.CODE, "x") for i in range(200)]
    held = corpus.split(docs, held_out=True)
    train = corpus.split(docs, held_out=False)
    assert len(held) + len(train) == 200 and 5 <= len(held) <= 40
    assert {d.name for d in held}.isdisjoint(d.name for d in train)
    assert corpus.Document("austen:Persuasion", corpus.PROSE, "").held_out
    assert not corpus.Document("austen:Emma", corpus.PROSE, "").held_out


class ToyTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 97 for c in text]}


@pytest.fixture(scope="module")
def toy_cache(tmp_path_factory, target):
    """A feature cache of a float32 tiny target over a repetitive toy text."""
    target32 = LlamaModel(target.config, {n: t.float() for n, t in target.weights.items()})
    text = "".join(chr(33 + (i * 7) % 23) for i in range(4000))
    docs = [corpus.Document("code:toy.py", corpus.CODE, text)]
    tokens, names = features.chunk_documents(docs, ToyTokenizer(), 33, 4000)
    folder = str(tmp_path_factory.mktemp("features"))
    cache = features.FeatureCache.create(folder, tokens[:12], names[:12], 64, (0, 1, 2), 4, "tiny")
    features.extract(target32, cache, batch_size=5)
    return target32, folder


def test_feature_cache_matches_the_target_and_resumes(toy_cache):
    target32, folder = toy_cache
    cache = features.FeatureCache(folder)
    assert cache.done == 12
    tokens = torch.from_numpy(np.array(cache.tokens[:2])).long()
    out = target32(tokens, target32.new_cache(2, 33), feature_layers=(0, 1, 2))
    torch.testing.assert_close(torch.from_numpy(np.array(cache.hidden[:2])).float(), out.hidden, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(torch.from_numpy(np.array(cache.layers[:2, :, 2])).float(), out.layer_states[2],
                               atol=2e-3, rtol=2e-3)
    assert (torch.from_numpy(np.array(cache.top_ids[:2, :, 0])).long() == out.logits.argmax(-1)).all()
    # Resuming a finished cache runs nothing and changes nothing.
    before = np.array(cache.hidden)
    features.extract(target32, features.FeatureCache(folder, "w"))
    assert np.array_equal(before, np.array(features.FeatureCache(folder).hidden))


@pytest.mark.parametrize("kind,autocast", [("eagle1", None), ("eagle3", None), ("eagle3", "bf16")])
def test_short_training_learns_and_saves_a_loadable_head(toy_cache, kind, autocast, tmp_path):
    target32, folder = toy_cache
    cache = features.FeatureCache(folder)
    cfg = trainer.TrainConfig(method=kind, steps=30, batch_size=4, lr=3e-3, warmup=5, ttt_steps=2,
                              draft_vocab_size=30, eval_every=15, autocast=autocast)
    logs = []
    trainer.train(target32, cache, cfg, str(tmp_path), eval_cache=cache, log=logs.append)
    state = torch.load(tmp_path / "train_state.pt", weights_only=False)
    first, last = state["history"][0], state["history"][-1]
    assert state["step"] == 30 and len(state["history"]) == 2
    assert last["loss"] < first["loss"]
    head = EagleHead.load(str(tmp_path), target32)
    assert head.config.kind == kind
    if kind == "eagle3":
        assert head.config.draft_vocab_size == 30 and head.d2t.shape == (30,)
    # A finished run resumes to the same place without training further.
    trainer.train(target32, cache, cfg, str(tmp_path), eval_cache=None, log=logs.append)
    assert torch.load(tmp_path / "train_state.pt", weights_only=False)["step"] == 30


def test_autocast_names_the_setting(toy_cache, tmp_path):
    target32, folder = toy_cache
    with pytest.raises(ValueError, match="autocast"):
        trainer.train(target32, features.FeatureCache(folder), trainer.TrainConfig(autocast="fp8"), str(tmp_path),
                      log=lambda *_: None)


def test_draft_vocabulary_prefers_frequent_first_choices(toy_cache):
    _, folder = toy_cache
    cache = features.FeatureCache(folder)
    d2t = trainer.draft_vocabulary(cache, 10, 97)
    ids = d2t + torch.arange(10)
    assert torch.all(ids[1:] > ids[:-1])  # sorted, distinct
    top1 = np.asarray(cache.top_ids[:, :, 0]).reshape(-1)
    counts = np.bincount(top1, minlength=97)
    assert counts[ids.numpy()].min() >= np.sort(counts)[-10]
    assert 0 < trainer.coverage(cache, d2t) <= 1


# ---------------------------------------------------------------------------- self-distillation
from eagle_kernels.train import distill  # noqa: E402


def test_self_distilled_features_equal_a_forward_pass_over_the_generated_text(toy_cache):
    target32, folder = toy_cache
    prompts = torch.from_numpy(np.array(features.FeatureCache(folder).tokens[:3, :8])).long()
    data = distill.generate_batch(target32, prompts, 20, (0, 1, 2), 4, 0.0, torch.Generator().manual_seed(0))
    tokens = torch.from_numpy(data["tokens"]).long()
    assert torch.equal(tokens[:, :8], prompts)
    out = target32(tokens, target32.new_cache(3, 20), feature_layers=(0, 1, 2))
    # Greedy: each generated token is the target's first choice after the previous position.
    assert torch.equal(tokens[:, 8:], out.logits[:, 7:-1].argmax(-1))
    assert torch.equal(torch.from_numpy(data["top_ids"]).long()[..., 0], out.logits.argmax(-1))
    torch.testing.assert_close(torch.from_numpy(data["hidden"]).float(), out.hidden, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(torch.from_numpy(data["layers"][:, :, 1]).float(), out.layer_states[1],
                               atol=2e-3, rtol=2e-3)
    logp = torch.log_softmax(out.logits, -1).topk(4, -1).values
    torch.testing.assert_close(torch.from_numpy(data["top_logp"]).float(), logp, atol=5e-3, rtol=2e-3)


def test_self_distilled_cache_is_deterministic_and_resumes(toy_cache, tmp_path, monkeypatch):
    target32, folder = toy_cache
    source = features.FeatureCache(folder)
    monkeypatch.setattr(distill, "choose_prompts", lambda tokenizer, count, prompt_len, held_out, seed, domains: (
        np.array(source.tokens[:count, :prompt_len]), list(source.manifest["documents"][:count])))

    def build(path, progress=None):
        return distill.build(str(path), target32, None, 5, seq_len=16, prompt_len=6, temperatures=(0.0, 1.0),
                             feature_layers=(0, 1, 2), top_k=4, batch_size=2, seed=7, progress=progress)

    whole = build(tmp_path / "whole")
    assert whole.done == 5 and whole.manifest["generated"]["temperatures"] == [0.0, 1.0]
    assert whole.manifest["generated"]["domains"] == ["code", "prose"]

    def stop_after_first_batch(count):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "resumed", progress=stop_after_first_batch)
    assert features.FeatureCache(str(tmp_path / "resumed")).done == 2
    resumed = build(tmp_path / "resumed")
    for name in ("tokens", "hidden", "top_ids"):
        assert np.array_equal(np.array(getattr(whole, name)), np.array(getattr(resumed, name))), name
    # The sampled batch (temperature 1) really differs from greedy decoding of the same prompts.
    greedy = distill.generate_batch(target32, torch.from_numpy(np.array(whole.tokens[2:4, :6])).long(), 16,
                                    (0, 1, 2), 4, 0.0, torch.Generator().manual_seed(0))
    assert not np.array_equal(greedy["tokens"], np.array(whole.tokens[2:4]))
    with pytest.raises(ValueError, match="domains"):
        distill.build(str(tmp_path / "bad"), target32, None, 2, seq_len=16, prompt_len=6, domains=("poetry",))


def test_variable_length_prompts_continue_after_their_own_prompt(toy_cache):
    """Chat prompts of different lengths in one batch: each row keeps its whole prompt and its
    greedy continuation starts right after it, as if it had been decoded alone."""
    target32, folder = toy_cache
    prompts = torch.from_numpy(np.array(features.FeatureCache(folder).tokens[:3, :9])).long()
    lens = [5, 9, 7]
    data = distill.generate_batch(target32, prompts, 16, (0, 1, 2), 4, 0.0, torch.Generator().manual_seed(0), lens)
    for b, n in enumerate(lens):
        alone = distill.generate_batch(target32, prompts[b:b + 1, :n], 16, (0, 1, 2), 4, 0.0,
                                       torch.Generator().manual_seed(0))
        assert np.array_equal(data["tokens"][b, :n], prompts[b, :n].numpy())
        assert np.array_equal(data["tokens"][b], alone["tokens"][0]), b
        torch.testing.assert_close(torch.from_numpy(data["hidden"][b]).float(),
                                   torch.from_numpy(alone["hidden"][0]).float(), atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="prompt_lens"):
        distill.generate_batch(target32, prompts, 16, (0, 1, 2), 4, 0.0, torch.Generator(), [5, 10, 7])


def test_chat_cache_records_prompt_lengths_and_resumes(toy_cache, tmp_path, monkeypatch):
    target32, folder = toy_cache
    rows = np.array(features.FeatureCache(folder).tokens[:3, :9])
    monkeypatch.setattr(distill, "choose_chat_prompts", lambda tokenizer, count, max_len, held_out, seed, exclude: (
        rows[:count, :max_len], [5, 9, 7][:count], [f"chat:q{i}" for i in range(count)]))

    def build(path, progress=None):
        return distill.build(str(path), target32, None, 3, seq_len=16, prompt_len=9, temperatures=(0.0,),
                             feature_layers=(0, 1, 2), top_k=4, batch_size=2, domains=("chat",), progress=progress)

    def stop_after_first_batch(count):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "chat", progress=stop_after_first_batch)
    cache = build(tmp_path / "chat")
    assert cache.done == 3 and cache.manifest["prompt_lens"] == [5, 9, 7]
    alone = distill.generate_batch(target32, torch.from_numpy(rows[2:3, :7]).long(), 16, (0, 1, 2), 4, 0.0,
                                   torch.Generator().manual_seed(0))
    assert np.array_equal(np.array(cache.tokens[2]), alone["tokens"][0])


def test_a_chat_cache_can_skip_the_instructions_of_earlier_caches(tmp_path):
    from eagle_kernels.train import chat

    class Template:  # one token per character: every instruction fits
        def apply_chat_template(self, turns, add_generation_prompt):
            return [ord(c) % 97 for c in turns[0]["content"]]

    first = distill.choose_chat_prompts(Template(), 40, 400, seed=1)[2]
    overlapping = distill.choose_chat_prompts(Template(), 40, 400, seed=1)[2]
    assert first == overlapping  # the same seed takes the same instructions
    folder = tmp_path / "earlier"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"documents": first}))
    fresh = distill.choose_chat_prompts(Template(), 40, 400, seed=1,
                                        exclude=distill.cache_documents([str(folder)]))[2]
    assert len(fresh) == 40 and set(fresh).isdisjoint(first)
    assert fresh == [n for n in distill.choose_chat_prompts(Template(), 80, 400, seed=1)[2] if n not in first][:40]
    assert all(n.removeprefix("chat:") in chat.training_instructions(seed=1) for n in fresh)
    with pytest.raises(ValueError, match="exclude_documents"):
        distill.build("unused", None, None, 2, seq_len=16, prompt_len=6, domains=(corpus.CODE,),
                      exclude_documents=first)


def test_evaluation_domains_never_reach_a_training_split(target):
    from eagle_kernels.train import chat

    for name in ("numpy:core/x.py", "license:GPL-3", "copyright:bash", "chateval:Why is the sky blue?"):
        assert corpus.Document(name, corpus.PROSE, "").held_out, name
    assert not corpus.Document("chat:Describe coffee in three sentences.", "chat", "").held_out
    generated = chat.training_instructions(400)
    assert len(generated) == 400 and len(set(generated)) == 400
    assert set(generated).isdisjoint(chat.HELD_OUT) and len(set(chat.HELD_OUT)) == len(chat.HELD_OUT)
    assert "numpy" not in corpus.PACKAGES
    with pytest.raises(ValueError, match="domains"):
        corpus.documents(("poetry",))
    with pytest.raises(ValueError, match="domains"):  # evaluation-only domains cannot feed training data
        distill.build("unused", target, None, 2, seq_len=16, prompt_len=6, domains=(corpus.OFFCODE,))
    with pytest.raises(ValueError, match="domains"):  # a chat cache holds chat only (its own prompt lengths)
        distill.build("unused", target, None, 2, seq_len=16, prompt_len=6, domains=(corpus.CHAT, corpus.CODE))


def test_training_mixes_caches_and_continues_from_a_head(toy_cache, tmp_path, monkeypatch):
    target32, folder = toy_cache
    real = features.FeatureCache(folder)
    monkeypatch.setattr(distill, "choose_prompts", lambda tokenizer, count, prompt_len, held_out, seed, domains: (
        np.array(real.tokens[:count, :prompt_len]), list(real.manifest["documents"][:count])))
    generated = distill.build(str(tmp_path / "gen"), target32, None, 6, seq_len=20, prompt_len=8,
                              feature_layers=(0, 1, 2), top_k=4, batch_size=3)
    cfg = trainer.TrainConfig(method="eagle3", steps=12, batch_size=3, lr=3e-3, warmup=2, ttt_steps=2,
                              draft_vocab_size=30, eval_every=6)
    trainer.train(target32, real, cfg, str(tmp_path / "first"), log=lambda *_: None)
    first = EagleHead.load(str(tmp_path / "first"), target32)
    seen = []
    original_take = trainer.Batches.take

    def take(self, rows, cache=None):
        seen.append((cache or self.cache).manifest["seq_len"])
        return original_take(self, rows, cache)

    monkeypatch.setattr(trainer.Batches, "take", take)
    logs = []
    cont = trainer.TrainConfig(method="eagle3", steps=12, batch_size=3, lr=1e-3, warmup=2, ttt_steps=2,
                               eval_every=6, init=str(tmp_path / "first"), seed=1)
    trainer.train(target32, [real, generated], cont, str(tmp_path / "second"), eval_cache=[real, generated],
                  log=logs.append)
    assert set(seen) == {33, 20}  # both caches fed batches
    second = EagleHead.load(str(tmp_path / "second"), target32)
    assert torch.equal(second.d2t, first.d2t)  # the draft vocabulary comes with the starting head
    history = torch.load(tmp_path / "second" / "train_state.pt", weights_only=False)["history"]
    assert set(history[-1]["also"]) == {"gen"} and len(history[-1]["also"]["gen"]["agreement"]) == 4
    assert any("starting from the head" in line for line in logs)
    # The model card lists both phases and both data sources.
    from eagle_kernels.train import card
    text = card.render(str(tmp_path / "second"), folder)
    assert "24 optimizer steps in 2 phase(s)" in text
    assert "Self-distilled (gen): 6 sequences x 20 tokens" in text and "Real text" in text
    assert "gen: chain tau" in text
    # training.json (shipped with a head, unlike train_state.pt) carries the phases on.
    import shutil
    record = json.loads((tmp_path / "second" / trainer.TRAINING_RECORD).read_text())["lineage"]
    assert [p["step"] for p in record] == [12, 12] and record[-1]["data"][1]["folder"] == "gen"
    shutil.copytree(tmp_path / "second", tmp_path / "shipped")
    (tmp_path / "shipped" / "train_state.pt").unlink()
    third = trainer.TrainConfig(method="eagle3", steps=2, batch_size=3, lr=1e-3, warmup=1, ttt_steps=2,
                                init=str(tmp_path / "shipped"))
    trainer.train(target32, [real], third, str(tmp_path / "third"), log=lambda *_: None)
    assert "26 optimizer steps in 3 phase(s)" in card.render(str(tmp_path / "third"), folder)
    # With a zero learning rate the continued head is the starting head, weight for weight.
    frozen = trainer.TrainConfig(method="eagle3", steps=1, batch_size=3, lr=0.0, warmup=1, ttt_steps=2,
                                 init=str(tmp_path / "first"))
    trainer.train(target32, [real, generated], frozen, str(tmp_path / "frozen"), log=lambda *_: None)
    kept = EagleHead.load(str(tmp_path / "frozen"), target32)
    for name, weight in first.weights.items():
        assert torch.equal(kept.weights[name], weight), name
    with pytest.raises(ValueError, match="init"):
        trainer.train(target32, real, trainer.TrainConfig(method="eagle1", steps=1, init=str(tmp_path / "first")),
                      str(tmp_path / "third"), log=lambda *_: None)


def test_card_measured_section_is_replaced_from_e2e_rows(tmp_path):
    from eagle_kernels.train import card

    rows = [{"domain": "code", "temperature": 0.0, "batch": 1, "provider": "eagle1-d4k4n16", "tau": 1.5,
             "tok_per_s": 20.0, "vs_ours_plain": 0.6},
            {"domain": "code", "temperature": 0.0, "batch": 1, "provider": "eagle3-d4k4n16", "tau": 2.5,
             "tok_per_s": 50.0, "vs_ours_plain": 1.3}]
    meta = {"prompts_per_domain": 4, "max_new_tokens": 48, "device": "cpu", "threads": 2, "torch": "x"}
    result = tmp_path / "e2e.json"
    result.write_text(json.dumps({"meta": meta, "rows": rows}))
    old = "# Card\n\n## Training\n\nkept\n\n## Measured (bench/e2e.py, held-out prompts)\n\n| old | row |\n"
    new = card.replace_measured(old, "eagle1", [str(result)])
    assert new.startswith("# Card\n\n## Training\n\nkept\n\n## Measured")
    assert "| code | 0 | 1 | d4k4n16 | 1.50 | 20.0 | 0.6 |" in new and "old" not in new and "2.50" not in new
    with pytest.raises(ValueError, match="card"):
        card.replace_measured("# no table\n", "eagle1", [str(result)])


def test_growing_the_draft_vocabulary_keeps_trained_rows_and_adds_frequent_tokens(toy_cache, tmp_path):
    target32, folder = toy_cache
    cache = features.FeatureCache(folder)
    small = trainer.TrainConfig(method="eagle3", steps=4, batch_size=3, lr=3e-3, warmup=1, ttt_steps=2,
                                draft_vocab_size=12)
    trainer.train(target32, cache, small, str(tmp_path / "small"), log=lambda *_: None)
    start = EagleHead.load(str(tmp_path / "small"), target32)
    logs = []
    # Zero learning rate: the grown head is exactly what the growth made.
    grow = trainer.TrainConfig(method="eagle3", steps=1, batch_size=3, lr=0.0, warmup=1, ttt_steps=2,
                               draft_vocab_size=20, init=str(tmp_path / "small"))
    trainer.train(target32, cache, grow, str(tmp_path / "grown"), log=logs.append)
    grown = EagleHead.load(str(tmp_path / "grown"), target32)
    assert grown.config.draft_vocab_size == 20 and grown.d2t.shape == (20,)
    old_ids = start.d2t.long() + torch.arange(12)
    new_ids = grown.d2t.long() + torch.arange(20)
    assert torch.all(new_ids[1:] > new_ids[:-1]) and set(old_ids.tolist()) <= set(new_ids.tolist())
    # The added tokens are the most frequent first choices outside the old vocabulary.
    counts = trainer.first_choice_counts([cache], target32.config.vocab_size)
    outside = [i for i in np.argsort(-counts, kind="stable") if i not in set(old_ids.tolist())][:8]
    assert set(new_ids.tolist()) - set(old_ids.tolist()) == set(int(i) for i in outside)
    # Kept tokens keep their rows; new rows are the target's rows through the fitted linear map.
    position = {int(t): i for i, t in enumerate(new_ids)}
    rows = grown.weights["lm_head.weight"].float()
    for i, t in enumerate(old_ids.tolist()):
        assert torch.equal(rows[position[t]], start.weights["lm_head.weight"].float()[i])
    target_rows = target32.weights["lm_head.weight"].float()
    mapping = torch.linalg.lstsq(target_rows[old_ids], start.weights["lm_head.weight"].float()).solution
    for t in outside:
        torch.testing.assert_close(rows[position[int(t)]], target_rows[int(t)] @ mapping, rtol=1e-3, atol=1e-3)
    for name, weight in start.weights.items():
        if name not in ("lm_head.weight", "d2t"):
            assert torch.equal(grown.weights[name], weight), name
    assert any("grown from 12 to 20" in line for line in logs)
    from eagle_kernels.train import card
    text = card.render(str(tmp_path / "grown"), folder)
    assert "over a 12-token draft vocabulary; fc initialised" in text
    assert "over a 20-token draft vocabulary (grown from 12 tokens); continuing" in text
    with pytest.raises(ValueError, match="draft_vocab_size"):
        trainer.train(target32, cache, dataclasses.replace(grow, draft_vocab_size=8), str(tmp_path / "shrunk"),
                      log=lambda *_: None)
