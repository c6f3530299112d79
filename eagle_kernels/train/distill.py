"""Self-distillation data: the target continues prompts from the offline corpora and its
features are recorded while it generates.

A head is judged by how well it predicts the target on the target's *own* text (that is what
speculative decoding drafts), and greedy continuations of a 135M model differ from human text:
more repetition, more formulaic code. EAGLE-3 trains on target-generated responses for the same
reason. Here every sequence is ``prompt_len`` corpus tokens followed by ``seq_len - prompt_len``
tokens the target generates (greedy, or sampled at the batch's temperature); the features of
every position come from the same forward passes that generate the text, so the data costs one
decoding run and no separate extraction.

Chat prompts (``domains=("chat",)``) are whole instructions in the target's chat template, of
different lengths: a batch prefills its shortest prompt and feeds the rest of each prompt token
by token (the generated token is replaced by the prompt's while a row is still in its prompt), so
every row's answer starts right after its own prompt. Their lengths are in the manifest
(``"prompt_lens"``).

The result is an ordinary :class:`~.features.FeatureCache` (same layout, resumable per batch)
whose manifest also records ``"generated": {"prompt_len", "temperatures", "seed"}``; training
mixes it with real-text caches (``train --features A,B``).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import torch

from . import corpus
from .features import MANIFEST, FeatureCache, chunk_documents


def choose_prompts(tokenizer, count: int, prompt_len: int, held_out: bool = False, seed: int = 0,
                   domains=(corpus.CODE, corpus.PROSE)) -> tuple[np.ndarray, list]:
    """``count`` prompt windows (int32 [count, prompt_len]) drawn per source share from the
    training (or held-out) split, and their documents' names."""
    docs = corpus.split(corpus.documents(domains), held_out=held_out)
    # Draw windows at 4x the need so every source can fill its share, then keep ``count``.
    tokens, names = chunk_documents(docs, tokenizer, prompt_len, 4 * count * prompt_len, seed)
    order = np.random.default_rng(seed).permutation(len(names))[:count]
    return tokens[order], [names[i] for i in order]


def choose_chat_prompts(tokenizer, count: int, max_len: int, held_out: bool = False,
                        seed: int = 0, exclude=()) -> tuple[np.ndarray, list, list]:
    """``count`` chat prompts (int32 [count, max_len], zero-padded), their lengths and their
    instructions' document names: generated training instructions, or the held-out list
    (cycled when ``count`` exceeds it). Prompts longer than ``max_len`` are skipped, and so are
    the training instructions whose document names are in ``exclude`` (those of earlier caches:
    every seed shuffles the same instructions, so two seeds' first ones overlap)."""
    from . import chat

    prefix, exclude = ("chateval:" if held_out else "chat:"), frozenset(exclude)
    texts = list(chat.HELD_OUT) if held_out else [
        text for text in chat.training_instructions(seed=seed) if prefix + text not in exclude]
    rows, lens, names = [], [], []
    for i in range(len(texts) * (-(-count // len(texts)) if held_out else 1)):
        ids = chat.prompt_ids(tokenizer, texts[i % len(texts)])
        if len(ids) <= max_len:
            rows.append(ids + [0] * (max_len - len(ids)))
            lens.append(len(ids))
            names.append(prefix + texts[i % len(texts)])
        if len(rows) == count:
            break
    return np.array(rows, dtype=np.int32).reshape(-1, max_len), lens, names


def _next_tokens(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """Next token per row of ``logits`` [B, V]: argmax at T = 0, else a sample at ``temperature``."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


@torch.no_grad()
def generate_batch(target, prompts: torch.Tensor, seq_len: int, feature_layers, top_k: int,
                   temperature: float, gen: torch.Generator, prompt_lens=None) -> dict:
    """Continue ``prompts`` (int64 [B, P]) to ``seq_len`` tokens, recording per position the
    final hidden state, the feature layers' outputs and the top-``top_k`` log-probabilities.
    With ``prompt_lens`` (B lengths <= P), row ``b``'s prompt is ``prompts[b, :prompt_lens[b]]``
    and its continuation starts there. Returns numpy arrays in the cache's dtypes."""
    B, width = prompts.shape
    lens = torch.full((B,), width) if prompt_lens is None else torch.as_tensor(list(prompt_lens)).long()
    if lens.shape != (B,) or int(lens.min()) < 1 or int(lens.max()) > width:
        raise ValueError(f"prompt_lens: expected {B} lengths in [1, {width}], got {list(lens)}")
    P = int(lens.min())
    H = target.config.hidden_size
    tokens = torch.zeros(B, seq_len, dtype=torch.int64)
    tokens[:, :width] = prompts
    hidden = torch.zeros(B, seq_len, H)
    layers = torch.zeros(B, seq_len, len(feature_layers), H)
    top_ids = torch.zeros(B, seq_len, top_k, dtype=torch.int32)
    top_logp = torch.zeros(B, seq_len, top_k)

    def record(out, start: int) -> None:
        stop = start + out.hidden.shape[1]
        hidden[:, start:stop] = out.hidden.float()
        layers[:, start:stop] = torch.stack([out.layer_states[i] for i in feature_layers], dim=2).float()
        logp, ids = torch.log_softmax(out.logits.float(), dim=-1).topk(top_k, dim=-1)
        top_ids[:, start:stop] = ids.int()
        top_logp[:, start:stop] = logp

    cache = target.new_cache(B, seq_len)
    out = target(prompts[:, :P].to(target.device), cache, feature_layers=feature_layers)
    cache.seqlens.fill_(P)
    record(out, 0)
    for t in range(P, seq_len):
        token = _next_tokens(out.logits[:, -1], temperature, gen).cpu()
        token = torch.where(lens > t, tokens[:, t], token)  # rows still in their prompt
        tokens[:, t] = token
        out = target(token[:, None].to(target.device), cache, feature_layers=feature_layers)
        cache.seqlens += 1
        record(out, t)
    return {"tokens": tokens.int().numpy(), "hidden": hidden.half().numpy(), "layers": layers.half().numpy(),
            "top_ids": top_ids.numpy(), "top_logp": top_logp.half().numpy()}


def cache_documents(folders) -> frozenset:
    """The document names of the feature caches in ``folders`` (their manifests), to exclude."""
    names = set()
    for folder in folders:
        with open(os.path.join(folder, MANIFEST)) as f:
            names.update(json.load(f)["documents"])
    return frozenset(names)


def build(folder: str, target, tokenizer, num_sequences: int, seq_len: int = 512, prompt_len: int = 64,
          temperatures=(0.0,), feature_layers=(1, 14, 26), top_k: int = 16, batch_size: int = 16, seed: int = 0,
          held_out: bool = False, progress=None, model_name: str = "SmolLM2-135M-Instruct",
          domains=(corpus.CODE, corpus.PROSE), exclude_documents=()) -> FeatureCache:
    """Create (or resume) a self-distilled cache of ``num_sequences`` sequences whose prompts
    come from ``domains``. Batch ``j`` generates at ``temperatures[j % len(temperatures)]`` with
    a generator seeded ``seed + j``, so a resumed run produces the same data. ``domains=("chat",)``
    takes chat prompts of at most ``prompt_len`` tokens (a chat cache holds chat only), none of
    whose instructions is in ``exclude_documents`` (document names, e.g. :func:`cache_documents`
    of earlier chat caches)."""
    if not 0 < prompt_len < seq_len:
        raise ValueError(f"prompt_len: must be in (0, seq_len={seq_len}), got {prompt_len}")
    allowed = corpus.DOMAINS if held_out else corpus.TRAIN_DOMAINS  # offcode / offprose: evaluation only
    if not domains or any(d not in allowed for d in domains) or (corpus.CHAT in domains and len(domains) > 1):
        raise ValueError(f"domains: expected a non-empty subset of {allowed!r} (chat alone), got {domains!r}")
    if exclude_documents and (corpus.CHAT not in domains or held_out):
        raise ValueError("exclude_documents: only a training chat cache skips earlier caches' instructions")
    if os.path.exists(os.path.join(folder, MANIFEST)):
        cache = FeatureCache(folder, "w")
        meta = cache.manifest.get("generated", {})
        prompt_len, temperatures, seed = meta["prompt_len"], tuple(meta["temperatures"]), meta["seed"]
        batch_size = meta.get("batch_size", batch_size)
        prompt_lens = cache.manifest.get("prompt_lens")
    else:
        prompt_lens = None
        if corpus.CHAT in domains:
            prompts, prompt_lens, names = choose_chat_prompts(tokenizer, num_sequences, prompt_len, held_out, seed,
                                                              exclude=exclude_documents)
        else:
            prompts, names = choose_prompts(tokenizer, num_sequences, prompt_len, held_out, seed,
                                            domains=tuple(domains))
        tokens = np.zeros((len(names), seq_len), dtype=np.int32)
        tokens[:, :prompt_len] = prompts
        cache = FeatureCache.create(folder, tokens, names, target.config.hidden_size, feature_layers, top_k,
                                    model_name)
        cache.manifest["generated"] = {"prompt_len": prompt_len, "temperatures": list(temperatures), "seed": seed,
                                       "batch_size": batch_size, "domains": list(domains)}
        if prompt_lens is not None:
            cache.manifest["prompt_lens"] = [int(n) for n in prompt_lens]
        cache.commit(0, 0.0)
    n = cache.manifest["num_sequences"]
    layers = tuple(cache.manifest["feature_layers"])
    while cache.done < n:
        t0 = time.perf_counter()
        start = cache.done
        stop = min(start + batch_size, n)
        index = start // batch_size
        gen = torch.Generator().manual_seed(seed + index)
        prompts = torch.from_numpy(np.array(cache.tokens[start:stop, :prompt_len])).long()
        lens = None if prompt_lens is None else prompt_lens[start:stop]
        data = generate_batch(target, prompts, seq_len, layers, top_k, temperatures[index % len(temperatures)], gen,
                              lens)
        cache.tokens[start:stop] = data["tokens"]
        for name in ("hidden", "layers", "top_ids", "top_logp"):
            getattr(cache, name)[start:stop] = data[name]
        cache.tokens.flush()
        cache.commit(stop, time.perf_counter() - t0)
        if progress is not None:
            progress(stop - start)
    return cache
