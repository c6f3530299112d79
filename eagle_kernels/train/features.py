"""Feature cache: the target runs once over the training tokens and its outputs are stored
memory-mapped in fp16, so training epochs never rerun the target.

Layout of a cache folder (``n`` sequences of ``T`` tokens, hidden size ``H``, ``F`` feature
layers, ``K`` stored target probabilities per token)::

    manifest.json   shapes, model, feature layers, sources, and ``done`` (sequences written)
    tokens.npy      int32   [n, T]
    hidden.bin      float16 [n, T, H]     final normed hidden state (EAGLE-1 feature)
    layers.bin      float16 [n, T, F, H]  outputs of the feature layers (EAGLE-3 input)
    top_ids.bin     int32   [n, T, K]     the target's K most likely next tokens
    top_logp.bin    float16 [n, T, K]     their log-probabilities (full-vocabulary softmax)

Extraction writes sequences in order and records ``done`` after each batch, so an interrupted
run resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np
import torch

from . import corpus

MANIFEST = "manifest.json"
# Share of the token budget per source (code first; prose split between three sources).
SOURCE_SHARES = {"code": 0.45, "pydoc": 0.2, "austen": 0.2, "kjv": 0.15,
                 # the wider domains (corpus.PKGCODE, DOCPROSE) and the evaluation-only ones
                 "pkg": 0.45, "debdoc": 0.4, "numpy": 0.45, "license": 0.2, "copyright": 0.2}


def chunk_documents(docs, tokenizer, seq_len: int, budget_tokens: int, seed: int = 0) -> tuple[np.ndarray, list]:
    """Cut each document into non-overlapping ``seq_len``-token windows and draw windows per
    source (``SOURCE_SHARES``) up to ``budget_tokens``. Returns (tokens int32 [n, seq_len],
    names of the windows' documents)."""
    windows: dict[str, list] = {}
    for doc in docs:
        ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        source = doc.name.split(":")[0]
        for start in range(0, len(ids) - seq_len + 1, seq_len):
            windows.setdefault(source, []).append((doc.name, ids[start:start + seq_len]))
    rng = random.Random(seed)
    chosen = []
    total_share = sum(SOURCE_SHARES.get(s, 0.0) for s in windows) or 1.0
    for source in sorted(windows):
        pool = windows[source]
        rng.shuffle(pool)
        want = int(budget_tokens * SOURCE_SHARES.get(source, 0.0) / total_share) // seq_len
        chosen += pool[:max(want, 0)]
    rng.shuffle(chosen)
    if not chosen:
        return np.zeros((0, seq_len), dtype=np.int32), []
    return np.array([w for _, w in chosen], dtype=np.int32), [n for n, _ in chosen]


class FeatureCache:
    """Read/write access to a cache folder (see the module docstring)."""

    def __init__(self, folder: str, mode: str = "r"):
        self.folder = folder
        with open(os.path.join(folder, MANIFEST)) as f:
            self.manifest = json.load(f)
        m = self.manifest
        n, T, H, F, K = m["num_sequences"], m["seq_len"], m["hidden_size"], len(m["feature_layers"]), m["top_k"]
        open_mode = "r+" if mode == "w" else "r"
        self.tokens = np.load(os.path.join(folder, "tokens.npy"), mmap_mode=open_mode)
        self.hidden = np.memmap(os.path.join(folder, "hidden.bin"), np.float16, open_mode, shape=(n, T, H))
        self.layers = np.memmap(os.path.join(folder, "layers.bin"), np.float16, open_mode, shape=(n, T, F, H))
        self.top_ids = np.memmap(os.path.join(folder, "top_ids.bin"), np.int32, open_mode, shape=(n, T, K))
        self.top_logp = np.memmap(os.path.join(folder, "top_logp.bin"), np.float16, open_mode, shape=(n, T, K))

    @property
    def done(self) -> int:
        return self.manifest["done"]

    @classmethod
    def create(cls, folder: str, tokens: np.ndarray, names: list, hidden_size: int, feature_layers, top_k: int,
               model: str) -> FeatureCache:
        os.makedirs(folder, exist_ok=True)
        n, T = tokens.shape
        np.save(os.path.join(folder, "tokens.npy"), tokens)
        F = len(feature_layers)
        for name, dtype, shape in (("hidden.bin", np.float16, (n, T, hidden_size)),
                                   ("layers.bin", np.float16, (n, T, F, hidden_size)),
                                   ("top_ids.bin", np.int32, (n, T, top_k)),
                                   ("top_logp.bin", np.float16, (n, T, top_k))):
            np.memmap(os.path.join(folder, name), dtype, "w+", shape=shape).flush()
        manifest = {"num_sequences": n, "seq_len": T, "hidden_size": hidden_size,
                    "feature_layers": list(feature_layers), "top_k": top_k, "model": model, "done": 0,
                    "documents": names, "extract_seconds": 0.0}
        with open(os.path.join(folder, MANIFEST), "w") as f:
            json.dump(manifest, f)
        return cls(folder, "w")

    def commit(self, done: int, seconds: float) -> None:
        for array in (self.hidden, self.layers, self.top_ids, self.top_logp):
            array.flush()
        self.manifest["done"] = done
        self.manifest["extract_seconds"] = self.manifest.get("extract_seconds", 0.0) + seconds
        tmp = os.path.join(self.folder, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.manifest, f)
        os.replace(tmp, os.path.join(self.folder, MANIFEST))


@torch.no_grad()
def extract(target, cache: FeatureCache, batch_size: int = 4, progress=None, limit: int | None = None) -> None:
    """Run ``target`` (a LlamaModel) over the cache's remaining sequences (the first ``limit``
    when given) and store its features; resumes at ``cache.done``."""
    m = cache.manifest
    n, T, K = m["num_sequences"], m["seq_len"], m["top_k"]
    n = n if limit is None else min(n, limit)
    layers = tuple(m["feature_layers"])
    start = cache.done
    while start < n:
        t0 = time.perf_counter()
        stop = min(start + batch_size, n)
        tokens = torch.from_numpy(np.array(cache.tokens[start:stop])).long().to(target.device)
        kv = target.new_cache(stop - start, T)
        out = target(tokens, kv, feature_layers=layers)
        logp = torch.log_softmax(out.logits, dim=-1)
        top_logp, top_ids = logp.topk(K, dim=-1)
        cache.hidden[start:stop] = out.hidden.half().cpu().numpy()
        cache.layers[start:stop] = torch.stack([out.layer_states[i] for i in layers], dim=2).half().cpu().numpy()
        cache.top_ids[start:stop] = top_ids.int().cpu().numpy()
        cache.top_logp[start:stop] = top_logp.half().cpu().numpy()
        cache.commit(stop, time.perf_counter() - t0)
        if progress is not None:
            progress(stop - start)
        start = stop


def build(folder: str, target, tokenizer, budget_tokens: int, seq_len: int = 512, feature_layers=(1, 14, 26),
          top_k: int = 16, batch_size: int = 4, seed: int = 0, domains=(corpus.CODE, corpus.PROSE),
          held_out: bool = False, progress=None, model_name: str = "SmolLM2-135M-Instruct") -> FeatureCache:
    """Create (or resume) a feature cache over the training split (or the held-out split). An
    existing cache is extracted up to ``budget_tokens`` (it may hold more sequences than that,
    e.g. when a larger extraction was stopped early); training uses what is extracted."""
    if os.path.exists(os.path.join(folder, MANIFEST)):
        cache = FeatureCache(folder, "w")
    else:
        docs = corpus.split(corpus.documents(domains), held_out=held_out)
        tokens, names = chunk_documents(docs, tokenizer, seq_len, budget_tokens, seed)
        cache = FeatureCache.create(folder, tokens, names, target.config.hidden_size, feature_layers, top_k,
                                    model_name)
    extract(target, cache, batch_size, progress, limit=-(-budget_tokens // seq_len))
    return cache
