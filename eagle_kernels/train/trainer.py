"""Training loop for EAGLE-1 and EAGLE-3 heads on a :mod:`.features` cache.

Pair ``i`` of a sequence is (token ``i + 1``, target feature ``i``), exactly as the decoder
feeds the head. Training-time test (EAGLE-3 §3.2) unrolls ``steps`` draft steps: step ``j``
feeds pair ``i`` the token ``i + j + 1`` with the head's own step ``j - 1`` output as the
feature, at position ``i + j``, attending to the step-0 keys of pairs ``<= i`` (the committed
prefix) and to its own keys of steps ``1 .. j`` (its ancestors in the draft tree): the same
attention pattern as a draft node at depth ``j`` during decoding. Step ``j`` of pair ``i``
predicts the target's distribution at token ``i + j + 1``.

Objectives
----------
- EAGLE-1 (Li et al. 2024, §4): SmoothL1 between the predicted and the true next feature plus
  ``cls_weight`` x cross-entropy against the target's distribution through the target's LM
  head, with uniform noise added to the input features.
- EAGLE-3 (Li et al. 2025, §3): cross-entropy only, over the reduced draft vocabulary, for every
  unrolled step, step ``j`` weighted ``step_decay ** j``.

The target's distribution is kept as its top-K tokens (renormalised), stored in the cache.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..models.eagle_head import EAGLE1, EAGLE3, EagleHead, HeadConfig, head_weight_shapes
from ..models.llama import LlamaModel, rms_norm, rope_cos_sin, rope_inverse_frequencies, rotate, swiglu
from .features import FeatureCache


@dataclass
class TrainConfig:
    method: str = EAGLE3
    steps: int = 500  # optimizer steps
    batch_size: int = 4  # sequences per optimizer step
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 3  # unrolled draft steps (1 = plain EAGLE-1 training)
    step_decay: float = 0.8
    cls_weight: float = 0.1  # EAGLE-1 cross-entropy weight (regression weight 1)
    noise: float = 0.2  # EAGLE-1 input-feature noise: uniform in [-noise/2, noise/2]
    draft_vocab_size: int | None = None  # EAGLE-3: 6144 for a new head; with ``init``, a larger size grows its
    # vocabulary (grow_draft_vocabulary)
    eval_every: int = 50
    seed: int = 0
    init: str | None = None  # a head folder to start from (its weights and d2t; fresh optimizer)
    autocast: str | None = None  # "bf16": the training forward's matrix products in bfloat16 (fp32 weights,
    # fp32 softmax and loss); evaluation stays in fp32


# ---------------------------------------------------------------------------- draft vocabulary
def draft_vocabulary(cache: FeatureCache, size: int, vocab_size: int) -> torch.Tensor:
    """EAGLE-3's reduced vocabulary: the ``size`` target tokens most often ranked first by the
    target over the cache, sorted by id. Returns d2t int64 [size] (draft id d maps to target
    id ``d + d2t[d]``)."""
    order = np.argsort(-first_choice_counts([cache], vocab_size), kind="stable")[:size]
    ids = torch.from_numpy(np.sort(order)).long()
    return ids - torch.arange(size)


DEFAULT_DRAFT_VOCAB_SIZE = 6144


def first_choice_counts(caches, vocab_size: int) -> np.ndarray:
    """How often the target ranks each token first over ``caches`` (float64 [vocab_size]), the
    generated tokens counted a thousandth as a tie-break, as :func:`draft_vocabulary` ranks them."""
    counts = np.zeros(vocab_size)
    for cache in caches:
        counts += np.bincount(np.asarray(cache.top_ids[: cache.done, :, 0]).reshape(-1), minlength=vocab_size)
        counts += np.bincount(np.asarray(cache.tokens[: cache.done]).reshape(-1), minlength=vocab_size) * 1e-3
    return counts


def grown_ids(base: np.ndarray, counts: np.ndarray, size: int) -> np.ndarray:
    """The target ids ``base`` (sorted) plus the ``size - len(base)`` ids outside it that ``counts``
    ranks highest, sorted."""
    inside = np.zeros(counts.size, dtype=bool)
    inside[base] = True
    extra = [int(i) for i in np.argsort(-counts, kind="stable") if not inside[i]][: max(size - base.size, 0)]
    return np.sort(np.concatenate([base, np.array(extra, dtype=base.dtype)]))


def grow_draft_vocabulary(weights: dict, target_lm_head: torch.Tensor, caches, size: int) -> dict:
    """A trained EAGLE-3 head's weights with its draft vocabulary grown to ``size`` tokens: the
    ones the target ranks first most often over ``caches`` join it. Kept tokens keep their
    trained LM-head rows. A new token's row starts as its target LM-head row mapped by the
    least-squares linear map that takes the target's rows of the kept tokens to the head's rows
    (on the shipped SmolLM2 head that map leaves 33% of the rows' norm unexplained, against a
    cosine of 0.66 for the target rows as they are), so the new tokens start near where
    training would put them instead of at the target's scale. Returns new weights (d2t and
    lm_head.weight replaced)."""
    d2t = weights["d2t"].long().cpu()
    old_ids = (d2t + torch.arange(d2t.numel())).numpy()
    if size < old_ids.size:
        raise ValueError(f"draft_vocab_size: {size} is below the starting head's {old_ids.size} (it only grows)")
    ids = grown_ids(old_ids, first_choice_counts(caches, target_lm_head.shape[0]), size)
    if ids.size < size:
        raise ValueError(f"draft_vocab_size: {size} exceeds the target's vocabulary of {target_lm_head.shape[0]}")
    head_rows = weights["lm_head.weight"].float()
    target_rows = target_lm_head.float()
    mapping = torch.linalg.lstsq(target_rows[torch.from_numpy(old_ids)], head_rows).solution  # [H, H]
    rows = target_rows[torch.from_numpy(ids)] @ mapping
    kept = np.searchsorted(ids, old_ids)
    rows[torch.from_numpy(kept)] = head_rows
    grown = dict(weights)
    grown["lm_head.weight"] = rows.contiguous()
    grown["d2t"] = torch.from_numpy(ids).long() - torch.arange(size)
    return grown


def coverage(cache: FeatureCache, d2t: torch.Tensor) -> float:
    """Share of the target's first-ranked tokens that the draft vocabulary contains."""
    ids = d2t + torch.arange(d2t.numel())
    inside = np.zeros(int(ids.max()) + 1 if ids.numel() else 1, dtype=bool)
    inside[ids.numpy()] = True
    top1 = np.asarray(cache.top_ids[: cache.done, :, 0]).reshape(-1)
    return float(inside[np.clip(top1, 0, inside.size - 1)][top1 < inside.size].sum() / max(top1.size, 1))


def fit_fusion(cache: FeatureCache, rows: int = 16384, ridge: float = 1e-2, seed: int = 0) -> torch.Tensor:
    """EAGLE-3's ``fc`` start point: the ridge-regression map from the concatenated low/mid/
    high layer states to the target's final normed hidden state, over ``rows`` cached tokens.
    The raw layer states carry a few huge outlier channels (|x| ~ 2.5e4 on SmolLM2); a random
    ``fc`` passes them straight into the residual stream, this one starts from a feature of
    the final hidden state's scale. Returns fc.weight [H, F * H]."""
    rng = np.random.default_rng(seed)
    n, T = cache.done, cache.manifest["seq_len"]
    picks = np.sort(rng.choice(n * T, size=min(rows, n * T), replace=False))
    seq, pos = picks // T, picks % T
    x = torch.from_numpy(np.array(cache.layers[seq, pos])).double().flatten(1)
    y = torch.from_numpy(np.array(cache.hidden[seq, pos])).double()
    scale = x.pow(2).mean(0).sqrt().clamp(min=1e-6)  # per-channel standardisation for conditioning
    xs = x / scale
    gram = xs.T @ xs + ridge * xs.shape[0] * torch.eye(xs.shape[1], dtype=torch.float64)
    solution = torch.linalg.solve(gram, xs.T @ y)  # [F * H, H] on standardised inputs
    return (solution / scale[:, None]).T.float().contiguous()


# ---------------------------------------------------------------------------- the trainable head
def initial_weights(target: LlamaModel, config: HeadConfig, d2t: torch.Tensor | None, seed: int,
                    fusion: torch.Tensor | None = None) -> dict:
    """Start point: small random projections, unit norms, the feature passed through ``fc``
    (so step 0 starts from "next feature = this feature"; EAGLE-3: ``fusion`` from
    :func:`fit_fusion` when given), and for EAGLE-3 the draft LM head and final norm copied
    from the target's rows of the draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    H = config.hidden_size
    weights = {}
    for name, shape in head_weight_shapes(config).items():
        if name == "d2t":
            continue
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:  # the two projections that write into the residual stream start smaller
            std = 0.02 / math.sqrt(2) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            weights[name] = torch.randn(shape, generator=g) * std
    if config.kind == EAGLE1:
        weights["fc.bias"] = torch.zeros(H)
        weights["fc.weight"][:, H:] += torch.eye(H)
    else:
        if fusion is not None:
            weights["fc.weight"] = fusion.clone()
        else:
            weights["fc.weight"][:, 2 * H:] += torch.eye(H)
        ids = d2t + torch.arange(d2t.numel())
        weights["lm_head.weight"] = target.weights["lm_head.weight"].float()[ids].clone()
        # A softer start than the target's own scale: early wrong guesses cost log-probabilities, not tens of nats.
        weights["norm.weight"] = target.weights["model.norm.weight"].float() * 0.25
        weights["d2t"] = d2t.clone()
    return weights


class TrainableHead(torch.nn.Module):
    """The head's weights as parameters, with a differentiable training-time-test forward
    that matches :meth:`EagleHead.forward` (tested) step for step."""

    def __init__(self, config: HeadConfig, weights: dict, target: LlamaModel):
        super().__init__()
        self.config = config
        self.names = [n for n in head_weight_shapes(config) if n != "d2t"]
        self.params = torch.nn.ParameterList([torch.nn.Parameter(weights[n].detach().float().clone())
                                              for n in self.names])
        self.register_buffer("embed", target.weights["model.embed_tokens.weight"].float(), persistent=False)
        self.register_buffer("target_lm_head", target.weights["lm_head.weight"].float(), persistent=False)
        self.register_buffer("inv_freq", rope_inverse_frequencies(config.as_llama()), persistent=False)
        d2t = weights.get("d2t")
        self.register_buffer("d2t", d2t.clone() if d2t is not None else None, persistent=False)
        self.prefix = "layers.0." if config.kind == EAGLE1 else "midlayer."

    def weights(self) -> dict:
        w = dict(zip(self.names, self.params))
        if self.d2t is not None:
            w["d2t"] = self.d2t
        return w

    def input_features(self, hidden: torch.Tensor, layers: torch.Tensor) -> torch.Tensor:
        """Step-0 features [B, T, H] from the cache's hidden [B, T, H] / layers [B, T, F, H]."""
        if self.config.kind == EAGLE1:
            return hidden
        w = self.weights()
        return F.linear(layers.flatten(-2), w["fc.weight"])

    def _layer_inputs(self, tokens, features):
        c, w, p = self.config, self.weights(), self.prefix
        embed = F.embedding(tokens, self.embed)
        if c.kind == EAGLE1:
            x = F.linear(torch.cat([embed, features], dim=-1), w["fc.weight"], w["fc.bias"])
            return x, x
        attn_in = torch.cat([rms_norm(embed, w[p + "input_layernorm.weight"], c.rms_norm_eps),
                             rms_norm(features, w[p + "hidden_norm.weight"], c.rms_norm_eps)], dim=-1)
        return attn_in, features

    def unrolled(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test. tokens int64 [B, T] (the sequence), features [B, T, H] (step-0
        features of tokens 0 .. T-1). Returns the hidden outputs [B, T-1, H] of each step;
        row ``i`` of step ``j`` predicts the feature of token ``i + j + 1``."""
        c, w, p = self.config, self.weights(), self.prefix
        B, T = tokens.shape
        P = T - 1
        Hq, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        group = Hq // Hkv
        index = torch.arange(P, device=tokens.device)
        causal = index[None, :] <= index[:, None]  # [P, P] query i sees step-0 key j <= i
        keys, values, outputs = [], [], []
        feats = features[:, :P]
        for step in range(steps):
            shifted = torch.zeros(B, P, dtype=torch.long, device=tokens.device)
            shifted[:, : max(P - step, 0)] = tokens[:, 1 + step:]
            positions = (index + step)[None].expand(B, P)
            attn_in, residual = self._layer_inputs(shifted, feats)
            cos, sin = rope_cos_sin(self.inv_freq, positions, attn_in.dtype)
            q = rotate(F.linear(attn_in, w[p + "self_attn.q_proj.weight"]).view(B, P, Hq, D), cos, sin)
            k = rotate(F.linear(attn_in, w[p + "self_attn.k_proj.weight"]).view(B, P, Hkv, D), cos, sin)
            v = F.linear(attn_in, w[p + "self_attn.v_proj.weight"]).view(B, P, Hkv, D)
            keys.append(k.repeat_interleave(group, dim=2).transpose(1, 2))  # [B, Hq, P, D]
            values.append(v.repeat_interleave(group, dim=2).transpose(1, 2))
            qh = q.transpose(1, 2) * D ** -0.5  # [B, Hq, P, D]
            prefix_scores = (qh @ keys[0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))
            own = [(qh * kk).sum(-1, keepdim=True) for kk in keys[1:]]  # diagonal of later steps
            probs = torch.softmax(torch.cat([prefix_scores] + own, dim=-1), dim=-1)
            attn = probs[..., :P] @ values[0]
            for s, vv in enumerate(values[1:]):
                attn = attn + probs[..., P + s: P + s + 1] * vv
            attn = attn.transpose(1, 2).reshape(B, P, Hq * D)
            x = residual + F.linear(attn, w[p + "self_attn.o_proj.weight"])
            hidden = x + swiglu(rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps), w, p)
            outputs.append(hidden)
            feats = hidden
        return outputs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.kind == EAGLE1:
            return F.linear(hidden, self.target_lm_head)
        w = self.weights()
        return F.linear(rms_norm(hidden, w["norm.weight"], self.config.rms_norm_eps), w["lm_head.weight"])

    def to_eagle_head(self, target: LlamaModel) -> EagleHead:
        weights = {n: t.detach().to(target.device, target.dtype) for n, t in zip(self.names, self.params)}
        if self.d2t is not None:
            weights["d2t"] = self.d2t.to(target.device)
        return EagleHead(self.config, weights, target)


# ---------------------------------------------------------------------------- losses
def soft_cross_entropy(logits: torch.Tensor, target_ids: torch.Tensor, target_logp: torch.Tensor,
                       t2d: torch.Tensor | None, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``logits`` [R, V'] against the target's renormalised top-K
    distribution (ids [R, K], log-probs [R, K]); with ``t2d`` the ids are mapped into the draft
    vocabulary and ids outside it are dropped. Returns (mean loss over valid rows, top-1
    agreement [R] bool: the draft's argmax equals the target's first-ranked token)."""
    ids = target_ids.long()
    weight = torch.softmax(target_logp.float(), dim=-1)
    if t2d is not None:
        ids = t2d[ids]
        weight = torch.where(ids >= 0, weight, 0.0)
        ids = ids.clamp(min=0)
    total = weight.sum(-1, keepdim=True)
    weight = weight / total.clamp(min=1e-9)
    logp = torch.log_softmax(logits.float(), dim=-1)
    rows = valid & (total[:, 0] > 0)
    loss = -(torch.gather(logp, 1, ids) * weight).sum(-1)
    loss = (loss * rows).sum() / rows.sum().clamp(min=1)
    agree = (logits.argmax(-1) == ids[:, 0]) & (target_ids[:, 0] >= 0)
    if t2d is not None:
        agree &= t2d[target_ids[:, 0].long()] >= 0
    return loss, agree & valid


class Batches:
    """Random batches of whole sequences, as float32 tensors, from one cache or several (each
    batch comes from one cache, picked with probability proportional to its sequences, so
    caches of different sequence lengths mix)."""

    def __init__(self, cache, batch_size: int, seed: int):
        self.caches = list(cache) if isinstance(cache, (list, tuple)) else [cache]
        self.cache, self.batch_size = self.caches[0], batch_size
        self.rng = np.random.default_rng(seed)
        done = np.array([c.done for c in self.caches], dtype=np.float64)
        self.weights = done / done.sum() if done.sum() > 0 else None

    def take(self, rows, cache: FeatureCache | None = None) -> dict:
        c = self.cache if cache is None else cache
        rows = np.sort(np.asarray(rows))
        return {"tokens": torch.from_numpy(np.array(c.tokens[rows])).long(),
                "hidden": torch.from_numpy(np.array(c.hidden[rows])).float(),
                "layers": torch.from_numpy(np.array(c.layers[rows])).float(),
                "top_ids": torch.from_numpy(np.array(c.top_ids[rows])),
                "top_logp": torch.from_numpy(np.array(c.top_logp[rows])).float()}

    def next(self) -> dict:
        c = self.caches[self.rng.choice(len(self.caches), p=self.weights)] if len(self.caches) > 1 else self.cache
        return self.take(self.rng.choice(c.done, size=min(self.batch_size, c.done), replace=False), c)


def step_losses(head: TrainableHead, batch: dict, cfg: TrainConfig, t2d, noise_gen=None):
    """Loss of one batch and, per unrolled step, the top-1 agreement rate with the target."""
    tokens, hidden = batch["tokens"], batch["hidden"]
    B, T = tokens.shape
    P = T - 1
    feats = head.input_features(hidden, batch["layers"])
    if head.config.kind == EAGLE1 and cfg.noise > 0 and noise_gen is not None:
        feats = feats + (torch.rand(feats.shape, generator=noise_gen) - 0.5) * cfg.noise
    outputs = head.unrolled(tokens, feats, cfg.ttt_steps)
    index = torch.arange(P)
    total, agreements = 0.0, []
    for step, out in enumerate(outputs):
        valid = (index <= P - 1 - step)[None].expand(B, P).reshape(-1)
        src = (index + step + 1).clamp(max=T - 1)  # token whose distribution this row predicts
        ids = batch["top_ids"][:, src].reshape(B * P, -1)
        logp = batch["top_logp"][:, src].reshape(B * P, -1)
        ce, agree = soft_cross_entropy(head.logits(out).float().reshape(B * P, -1), ids, logp, t2d, valid)
        loss = cfg.cls_weight * ce if head.config.kind == EAGLE1 else ce
        if head.config.kind == EAGLE1:
            true_next = hidden[:, src]
            reg = F.smooth_l1_loss(out, true_next, reduction="none").mean(-1).reshape(-1)
            loss = loss + (reg * valid).sum() / valid.sum()
        total = total + cfg.step_decay ** step * loss
        agreements.append(float(agree.sum()) / max(int(valid.sum()), 1))
    return total, agreements


def chain_tau(agreements: list[float]) -> float:
    """Tokens per step of a greedy chain whose step-j drafts match with the given rates:
    1 (bonus) + a0 + a0 a1 + ...; an estimate from teacher-forced agreement rates."""
    tau, run = 1.0, 1.0
    for a in agreements:
        run *= a
        tau += run
    return tau


@torch.no_grad()
def evaluate(head: TrainableHead, cache: FeatureCache, cfg: TrainConfig, t2d, max_sequences: int = 8,
             min_steps: int = 4) -> dict:
    """Held-out loss and per-step top-1 agreement, unrolled at least ``min_steps`` deep (beyond
    the trained depth too: drafting goes deeper than training-time test)."""
    rows = np.arange(min(cache.done, max_sequences))
    if rows.size == 0:
        return {}
    batch = Batches(cache, len(rows), 0).take(rows)
    loss, agree = step_losses(head, batch, dataclasses.replace(cfg, ttt_steps=max(cfg.ttt_steps, min_steps)), t2d)
    return {"loss": float(loss), "agreement": agree, "chain_tau": chain_tau(agree)}


def data_summary(cache: FeatureCache) -> dict:
    """Where a cache's sequences come from, for the model card."""
    m = cache.manifest
    sources = dict(collections.Counter(name.split(":")[0] for name in m["documents"][: cache.done]))
    return {"folder": os.path.basename(os.path.normpath(cache.folder)), "sequences": cache.done,
            "seq_len": m["seq_len"], "sources": sources, "extract_seconds": m.get("extract_seconds", 0.0),
            "generated": m.get("generated")}


TRAINING_RECORD = "training.json"  # the phases that made a head; ships with it (train_state.pt does not)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def phase_summary(state: dict) -> dict:
    """One training phase as the model card and later phases need it (no weights, no optimizer)."""
    return {k: state.get(k) for k in ("step", "seconds", "config", "threads", "cpu", "data")} | {
        "final_eval": state["history"][-1] if state.get("history") else None}


def prior_lineage(head_dir: str) -> list:
    """The phases that produced the head in ``head_dir``, oldest first: from its
    ``train_state.pt`` where it is still there, else from the ``training.json`` shipped with it."""
    state_path = os.path.join(head_dir, "train_state.pt")
    if os.path.exists(state_path):
        prior = torch.load(state_path, weights_only=False, map_location="cpu")
        return prior.get("lineage", []) + [phase_summary(prior)]
    record = os.path.join(head_dir, TRAINING_RECORD)
    if os.path.exists(record):
        with open(record) as f:
            return json.load(f)["lineage"]
    return []


def _as_list(caches) -> list:
    if caches is None:
        return []
    return list(caches) if isinstance(caches, (list, tuple)) else [caches]


def train(target: LlamaModel, cache, cfg: TrainConfig, out_dir: str, eval_cache=None, log=print,
          resume: bool = True) -> EagleHead:
    """Train a head on ``cache`` (one :class:`FeatureCache` or a list, e.g. real text plus
    self-distilled data); checkpoints (EAGLE layout, :meth:`EagleHead.save`) and
    ``train_state.pt`` go to ``out_dir``; an existing ``train_state.pt`` is resumed. ``eval_cache``
    (one or a list) gives held-out agreement every ``cfg.eval_every`` steps; the first is the
    headline entry of the history, the others are recorded under ``"also"`` by folder name.
    With ``cfg.init`` training starts from that head's weights (and its draft vocabulary)."""
    if cfg.autocast not in (None, "bf16"):
        raise ValueError(f"autocast: expected None or 'bf16', got {cfg.autocast!r}")
    torch.manual_seed(cfg.seed)
    caches, eval_caches = _as_list(cache), _as_list(eval_cache)
    first = caches[0]
    if cfg.init:
        start_head = EagleHead.load(cfg.init, target)
        if start_head.config.kind != cfg.method:
            raise ValueError(f"init: {cfg.init} holds an {start_head.config.kind} head, not {cfg.method}")
        config = start_head.config
        weights = {n: t.float() if t.is_floating_point() else t for n, t in start_head.weights.items()}
        log(f"starting from the head in {cfg.init}")
        if cfg.method == EAGLE3 and cfg.draft_vocab_size not in (None, config.draft_vocab_size):
            weights = grow_draft_vocabulary(weights, target.weights["lm_head.weight"], caches, cfg.draft_vocab_size)
            log(f"draft vocabulary grown from {config.draft_vocab_size} to {cfg.draft_vocab_size} tokens")
            config = dataclasses.replace(config, draft_vocab_size=cfg.draft_vocab_size)
        d2t = weights.get("d2t")
    else:
        vocab = cfg.draft_vocab_size or DEFAULT_DRAFT_VOCAB_SIZE
        config = HeadConfig.for_target(target.config, cfg.method, vocab if cfg.method == EAGLE3 else None)
        d2t = None
        if cfg.method == EAGLE3:
            config.feature_layers = tuple(first.manifest["feature_layers"])
            d2t = draft_vocabulary(first, vocab, target.config.vocab_size)
        fusion = fit_fusion(first, seed=cfg.seed) if cfg.method == EAGLE3 else None
        weights = initial_weights(target, config, d2t, cfg.seed, fusion)
    if cfg.method == EAGLE3:
        for c in caches:
            if tuple(c.manifest["feature_layers"]) != tuple(config.feature_layers):
                raise ValueError(f"cache: {c.folder} holds layers {c.manifest['feature_layers']}, the head reads "
                                 f"{list(config.feature_layers)}")
        d2t = d2t.long().cpu()
        log(f"draft vocabulary {d2t.numel()}: covers {coverage(first, d2t):.1%} of the target's top-1 tokens")
        t2d = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
        t2d[d2t + torch.arange(d2t.numel())] = torch.arange(d2t.numel())
    else:
        d2t, t2d = None, None
    head = TrainableHead(config, weights, target)
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(cfg.warmup, 1)) * 0.5 * (
        1 + math.cos(math.pi * min(s, cfg.steps) / max(cfg.steps, 1))))
    os.makedirs(out_dir, exist_ok=True)
    state_path = os.path.join(out_dir, "train_state.pt")
    start, history, seconds = 0, [], 0.0
    # What the model card needs: the data of this run and the runs it continues.
    data = [data_summary(c) for c in caches]
    lineage = prior_lineage(cfg.init) if cfg.init else []
    if resume and os.path.exists(state_path):
        state = torch.load(state_path, weights_only=False)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        start, history, seconds = state["step"], state["history"], state["seconds"]
        log(f"resumed at step {start}")
    batches = Batches(caches, cfg.batch_size, cfg.seed + start)
    eval_names = [os.path.basename(os.path.normpath(c.folder)) for c in eval_caches]
    noise = torch.Generator().manual_seed(cfg.seed + 1 + start)

    def save(step):
        head.to_eagle_head(target).save(out_dir)
        state = {"head": head.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                 "step": step, "history": history, "seconds": seconds, "config": asdict(cfg),
                 "threads": torch.get_num_threads(), "cpu": cpu_name(), "data": data, "lineage": lineage}
        torch.save(state, state_path)
        with open(os.path.join(out_dir, TRAINING_RECORD), "w") as f:
            json.dump({"lineage": lineage + [phase_summary(state)]}, f, indent=1)

    try:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=start, desc=f"train {cfg.method}", unit="step", mininterval=5)
    except ImportError:  # pragma: no cover
        bar = None
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        with torch.autocast(head.embed.device.type, dtype=torch.bfloat16, enabled=cfg.autocast == "bf16"):
            loss, agree = step_losses(head, batches.next(), cfg, t2d, noise)
        loss_value = float(loss.detach())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        seconds += time.perf_counter() - t0
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", acc0=f"{agree[0]:.2f}")
        last = step + 1 == cfg.steps
        if eval_caches and ((step + 1) % cfg.eval_every == 0 or last):
            results = [evaluate(head, c, cfg, t2d) for c in eval_caches]
            result = dict(results[0], step=step + 1, seconds=round(seconds, 1), train_loss=loss_value,
                          folder=eval_names[0])
            if len(results) > 1:
                result["also"] = dict(zip(eval_names[1:], results[1:]))
            history.append(result)
            for name, r in zip(eval_names, results):
                log(f"step {step + 1}: held-out {name} loss {r['loss']:.3f}, "
                    f"top-1 agreement per step {[round(a, 3) for a in r['agreement']]}, "
                    f"chain tau estimate {r['chain_tau']:.2f}")
        if (step + 1) % cfg.eval_every == 0 or last:
            save(step + 1)
    if bar is not None:
        bar.close()
    if cfg.steps <= start:
        save(start)
    return head.to_eagle_head(target)
