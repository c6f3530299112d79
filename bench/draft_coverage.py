"""How much of the target's probability mass a draft vocabulary can reach, on held-out prompts.

An EAGLE-3 head drafts only inside its reduced vocabulary (``d2t``); a token outside it can
never be drafted, so at T > 0 the target mass outside the vocabulary is mass no verification
rule can accept. For each domain (``bench/e2e.py``'s held-out prompt sets: ``code``, ``prose``,
``offcode``, ``offprose``, ``chat``) and temperature, the target samples ``--new-tokens`` tokens
after each prompt (plain decoding, seeded), and at every sampled position we record the target's
probability mass at that temperature that lies inside each vocabulary, and (at any temperature)
whether its first-ranked token lies inside (what T = 0 drafting needs).

Vocabularies: the shipped head's (``--head``), and with ``--vocab-caches`` (feature caches of the
target's own generations, e.g. self-distilled training data) vocabularies of ``--sizes`` tokens
grown from it by adding the tokens the target ranks first most often in those caches
(``grown-N``), and the same rule from scratch (``fresh-N``, as training chooses a new head's
vocabulary). ``--lm-head-timing`` also times the draft LM head (one matrix product of
``--rows`` rows, fp32, this machine's threads) at each size against one draft forward of the
shipped head, the cost a larger vocabulary adds to every draft step.

    python bench/draft_coverage.py --out bench/results/coverage   # writes coverage.json / .md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from eagle_kernels import heads as shipped  # noqa: E402
from eagle_kernels.models import smollm2  # noqa: E402
from eagle_kernels.models.cpu_weights import linear  # noqa: E402
from eagle_kernels.models.eagle_head import EagleHead  # noqa: E402
from eagle_kernels.train import corpus  # noqa: E402
from eagle_kernels.train.features import FeatureCache  # noqa: E402
from eagle_kernels.train.trainer import first_choice_counts, grown_ids  # noqa: E402


def vocab_ids(d2t: torch.Tensor) -> np.ndarray:
    return (d2t.long().cpu() + torch.arange(d2t.numel())).numpy()


@torch.no_grad()
def sample_positions(target, prompt: list, new_tokens: int, temperature: float, seed: int) -> torch.Tensor:
    """The target's logits [new_tokens, V] at each position of a continuation it samples at
    ``temperature`` (greedy at 0) after ``prompt``."""
    gen = torch.Generator().manual_seed(seed)
    cache = target.new_cache(1, len(prompt) + new_tokens)
    out = target(torch.tensor([prompt]), cache)
    cache.seqlens.fill_(len(prompt))
    rows = []
    for _ in range(new_tokens):
        logits = out.logits[0, -1].float()
        rows.append(logits)
        if temperature > 0:
            token = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
        else:
            token = logits.argmax(-1, keepdim=True)
        out = target(token[None], cache)
        cache.seqlens += 1
    return torch.stack(rows)


def time_lm_heads(head: EagleHead, sizes, rows: int, repeats: int = 50) -> dict:
    """ms per draft LM head product (rows x hidden times hidden x size) and per draft forward."""
    H = head.config.hidden_size
    x = torch.randn(rows, H)
    result = {}
    for size in sizes:
        w = torch.randn(size, H) * 0.02
        linear(x, w)
        t0 = time.perf_counter()
        for _ in range(repeats):
            linear(x, w)
        result[f"lm_head_{size}_ms"] = round(1e3 * (time.perf_counter() - t0) / repeats, 3)
    tokens = torch.zeros(1, rows, dtype=torch.long)
    features = torch.randn(1, rows, H)
    cache = head.new_cache(1, rows + 8)

    def forward():  # one draft step: the head's layer and its LM head
        cache.seqlens.zero_()
        return head.logits(head.forward(tokens, features, cache))

    forward()
    t0 = time.perf_counter()
    for _ in range(repeats):
        forward()
    result[f"draft_step_{head.config.draft_vocab_size}_ms"] = round(1e3 * (time.perf_counter() - t0) / repeats, 3)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domains", nargs="+", default=["code", "prose", "offcode", "offprose", "chat"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--head", default=None, help="head folder (default: the shipped EAGLE-3 head)")
    parser.add_argument("--vocab-caches", default="", help="comma-separated feature caches for grown vocabularies")
    parser.add_argument("--sizes", type=int, nargs="+", default=[6144, 8192, 12288, 16384])
    parser.add_argument("--lm-head-timing", action="store_true")
    parser.add_argument("--rows", type=int, default=60, help="draft rows per LM head product in the timing")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "coverage"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = smollm2.load()
    head = EagleHead.load(args.head or shipped.path("eagle3"), target)
    V = target.config.vocab_size
    base = vocab_ids(head.d2t)
    vocabs = {f"shipped-{base.size}": base}
    if args.vocab_caches:
        counts = first_choice_counts([FeatureCache(f) for f in args.vocab_caches.split(",")], V)
        for size in args.sizes:
            vocabs[f"fresh-{size}"] = np.sort(np.argsort(-counts, kind="stable")[:size])
            if size > base.size:
                vocabs[f"grown-{size}"] = grown_ids(base, counts, size)
    masks = {}
    for name, ids in vocabs.items():
        m = torch.zeros(V, dtype=torch.bool)
        m[torch.from_numpy(ids).long()] = True
        masks[name] = m
    rows = []
    for domain in args.domains:
        prompts = corpus.held_out_prompts(tokenizer, domain, args.prompts, args.prompt_tokens)
        if not prompts:  # e.g. prose without Debian's python3.11-doc, bible-kjv, r-cran-janeaustenr
            print(f"no held-out {domain} documents on this machine: {domain} skipped")
            continue
        for temperature in args.temperatures:
            sums = {name: [0.0, 0.0] for name in masks}  # mass inside, first choice inside
            n = 0
            for i, prompt in enumerate(prompts):
                logits = sample_positions(target, prompt, args.new_tokens, temperature, seed=1000 * i + 7)
                probs = torch.softmax(logits / temperature, -1)
                top1 = logits.argmax(-1)
                for name, m in masks.items():
                    sums[name][0] += float(probs[:, m].sum())
                    sums[name][1] += float(m[top1].sum())
                n += logits.shape[0]
            row = {"domain": domain, "temperature": temperature, "positions": n}
            for name, (mass, first) in sums.items():
                row[name] = {"mass_inside": round(mass / n, 4), "top1_inside": round(first / n, 4)}
            rows.append(row)
            print(f"{domain:8s} T={temperature:g} " + "  ".join(
                f"{name} {row[name]['mass_inside']:.3f}/{row[name]['top1_inside']:.3f}" for name in masks), flush=True)
    meta = {"head": args.head or "eagle_kernels/heads/smollm2-135m-eagle3", "prompts_per_domain": args.prompts,
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
            "vocab_caches": args.vocab_caches.split(",") if args.vocab_caches else [],
            "threads": torch.get_num_threads()}
    if args.lm_head_timing:
        meta["timing"] = time_lm_heads(head, sorted({base.size, *args.sizes}), args.rows)
        print(meta["timing"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "coverage.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    names = list(masks)
    lines = [f"Target mass inside the draft vocabulary / share of first-ranked tokens inside, on "
             f"{args.prompts} held-out prompts x {args.new_tokens} sampled tokens per domain.", "",
             "| domain | T | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in rows:
        lines.append(f"| {r['domain']} | {r['temperature']:g} | " + " | ".join(
            f"{r[n]['mass_inside']:.3f} / {r[n]['top1_inside']:.3f}" for n in names) + " |")
    with open(os.path.join(args.out, "coverage.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
