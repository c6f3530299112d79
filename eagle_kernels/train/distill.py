"""Self-distillation data: the target continues prompts from the offline corpora and its
features are recorded while it generates.

A head is judged by how well it predicts the target on the target's *own* text (that is what
speculative decoding drafts), and greedy continuations of a 135M model differ from human text:
more repetition, more formulaic code. EAGLE-3 trains on target-generated responses for the same
reason. Here every sequence is ``prompt_len`` corpus tokens followed by ``seq_len - prompt_len``
tokens the target generates (greedy, or sampled at the batch's temperature); the features of
every position come from the same forward passes that generate the text, so the data costs one
decoding run and no separate extraction.

The result is an ordinary :class:`~.features.FeatureCache` (same layout, resumable per batch)
whose manifest also records ``"generated": {"prompt_len", "temperatures", "seed"}``; training
mixes it with real-text caches (``train --features A,B``).
"""

from __future__ import annotations

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


def _next_tokens(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """Next token per row of ``logits`` [B, V]: argmax at T = 0, else a sample at ``temperature``."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


@torch.no_grad()
def generate_batch(target, prompts: torch.Tensor, seq_len: int, feature_layers, top_k: int,
                   temperature: float, gen: torch.Generator) -> dict:
    """Continue ``prompts`` (int64 [B, P]) to ``seq_len`` tokens, recording per position the
    final hidden state, the feature layers' outputs and the top-``top_k`` log-probabilities.
    Returns numpy arrays in the cache's dtypes."""
    B, P = prompts.shape
    H = target.config.hidden_size
    tokens = torch.zeros(B, seq_len, dtype=torch.int64)
    tokens[:, :P] = prompts
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
    out = target(prompts.to(target.device), cache, feature_layers=feature_layers)
    cache.seqlens.fill_(P)
    record(out, 0)
    for t in range(P, seq_len):
        token = _next_tokens(out.logits[:, -1], temperature, gen)
        tokens[:, t] = token.cpu()
        out = target(token[:, None], cache, feature_layers=feature_layers)
        cache.seqlens += 1
        record(out, t)
    return {"tokens": tokens.int().numpy(), "hidden": hidden.half().numpy(), "layers": layers.half().numpy(),
            "top_ids": top_ids.numpy(), "top_logp": top_logp.half().numpy()}


def build(folder: str, target, tokenizer, num_sequences: int, seq_len: int = 512, prompt_len: int = 64,
          temperatures=(0.0,), feature_layers=(1, 14, 26), top_k: int = 16, batch_size: int = 16, seed: int = 0,
          held_out: bool = False, progress=None, model_name: str = "SmolLM2-135M-Instruct",
          domains=(corpus.CODE, corpus.PROSE)) -> FeatureCache:
    """Create (or resume) a self-distilled cache of ``num_sequences`` sequences whose prompts
    come from ``domains``. Batch ``j`` generates at ``temperatures[j % len(temperatures)]`` with
    a generator seeded ``seed + j``, so a resumed run produces the same data."""
    if not 0 < prompt_len < seq_len:
        raise ValueError(f"prompt_len: must be in (0, seq_len={seq_len}), got {prompt_len}")
    if not domains or any(d not in (corpus.CODE, corpus.PROSE) for d in domains):
        raise ValueError(f"domains: expected a non-empty subset of ({corpus.CODE!r}, {corpus.PROSE!r}), "
                         f"got {domains!r}")
    if os.path.exists(os.path.join(folder, MANIFEST)):
        cache = FeatureCache(folder, "w")
        meta = cache.manifest.get("generated", {})
        prompt_len, temperatures, seed = meta["prompt_len"], tuple(meta["temperatures"]), meta["seed"]
        batch_size = meta.get("batch_size", batch_size)
    else:
        prompts, names = choose_prompts(tokenizer, num_sequences, prompt_len, held_out, seed, domains=tuple(domains))
        tokens = np.zeros((len(names), seq_len), dtype=np.int32)
        tokens[:, :prompt_len] = prompts
        cache = FeatureCache.create(folder, tokens, names, target.config.hidden_size, feature_layers, top_k,
                                    model_name)
        cache.manifest["generated"] = {"prompt_len": prompt_len, "temperatures": list(temperatures), "seed": seed,
                                       "batch_size": batch_size, "domains": list(domains)}
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
        data = generate_batch(target, prompts, seq_len, layers, top_k, temperatures[index % len(temperatures)], gen)
        cache.tokens[start:stop] = data["tokens"]
        for name in ("hidden", "layers", "top_ids", "top_logp"):
            getattr(cache, name)[start:stop] = data[name]
        cache.tokens.flush()
        cache.commit(stop, time.perf_counter() - t0)
        if progress is not None:
            progress(stop - start)
    return cache
