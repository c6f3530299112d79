"""Would a sampled draft chain that stops where the head is unsure pay? Measured on the CPU.

    python bench/chain_stop.py --domains code offprose chat --prompts 8 --out DIR

Decodes held-out prompts at ``--temperature`` with a sampled chain of ``--depth`` draws
(``sampled_tree(depth, 1, 1)``: each draw from the head at the request's temperature, verified by
the draft-aware rule; no lookup chain) and logs, per step, each chain node's cumulative draft
log-probability (``cand_scores``) and how many of its drafts the target accepted. From the log it
tabulates, per domain:

- fixed depth ``d`` (``1 .. depth``): tau if the chain had stopped at ``d`` draws, and ``d``
  drafted nodes a step;
- the stop rule "draw node ``d + 1`` only while the cumulative draft probability of nodes
  ``1 .. d`` is at least ``c``": tau and its mean drafted nodes a step.

Truncating a chain keeps the accepted drafts below the cut (verify accepts node ``d`` from the
target's row of node ``d - 1`` alone), and the rule decides on draws already made, never on the
draw it would cut, so the draft-aware rule stays exact under it. Results: docs/benchmarks.md
("Sampled chains that stop early").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import shipped_smollm2  # noqa: E402  (bench/)

from eagle_kernels import decoder as decoder_module  # noqa: E402
from eagle_kernels.decoder import SpeculativeDecoder, sampled_tree  # noqa: E402
from eagle_kernels.train import corpus  # noqa: E402

THRESHOLDS = (0.02, 0.05, 0.1, 0.2, 0.4)


def log_steps(decoder: SpeculativeDecoder, prompts, max_new: int, temperature: float) -> list:
    """[(cumulative draft log-probs of the chain's nodes, drafts accepted)] per speculative step."""
    steps, scores = [], []
    expand, verify = decoder_module.expand_sampled_tree, decoder_module.ops.verify

    def logged_expand(*args, **kwargs):
        expansion = expand(*args, **kwargs)
        scores.append(expansion.cand_scores[0].tolist())
        return expansion

    def logged_verify(*args, **kwargs):
        result = verify(*args, **kwargs)
        if scores:  # a step without a draft (none here: the policy is fixed) logs nothing
            steps.append((scores.pop(), int(result.accept_len[0])))
        return result

    decoder_module.expand_sampled_tree, decoder_module.ops.verify = logged_expand, logged_verify
    try:
        with torch.inference_mode():
            for i, prompt in enumerate(prompts):
                decoder.generate([prompt], max_new, temperature=temperature, seed=i)
    finally:
        decoder_module.expand_sampled_tree, decoder_module.ops.verify = expand, verify
    return steps


def chain_length(scores: list, threshold: float | None, depth: int) -> int:
    """Draws of a chain cut at ``depth`` (threshold None) or by the stop rule."""
    length = 1
    while length < (depth if threshold is None else len(scores)):
        if threshold is not None and math.exp(scores[length - 1]) < threshold:
            break
        length += 1
    return length


def table(steps: list, depth: int) -> list[dict]:
    rows = []
    for rule, value in [("fixed", d) for d in range(1, depth + 1)] + [("stop", c) for c in THRESHOLDS]:
        lengths = [chain_length(s, value if rule == "stop" else None, value if rule == "fixed" else depth)
                   for s, _ in steps]
        tau = sum(min(a, n) + 1 for (_, a), n in zip(steps, lengths)) / len(steps)
        rows.append({"rule": rule, "value": value, "tau": tau, "nodes": sum(lengths) / len(steps)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--domains", nargs="+", default=["code", "offprose", "chat"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, tokenizer, head = shipped_smollm2.load(args.threads)
    decoder = SpeculativeDecoder(model, head, sampled_tree(args.depth, 1, 1))
    os.makedirs(args.out, exist_ok=True)
    results = {}
    lines = [f"Sampled chain of {args.depth} draws, T {args.temperature:g}, {args.prompts} prompts x "
             f"{args.max_new_tokens} tokens per domain; tau / drafted nodes a step", "",
             "| domain | steps | " + " | ".join([f"depth {d}" for d in range(1, args.depth + 1)]
                                              + [f"stop below {c:g}" for c in THRESHOLDS]) + " |",
             "|---|---:|" + "---|" * (args.depth + len(THRESHOLDS))]
    for domain in args.domains:
        prompts = corpus.held_out_prompts(tokenizer, domain, args.prompts, args.prompt_tokens)
        if not prompts:
            print(f"no held-out {domain} documents on this machine: skipped")
            continue
        steps = log_steps(decoder, prompts, args.max_new_tokens, args.temperature)
        rows = table(steps, args.depth)
        results[domain] = {"steps": steps, "rows": rows}
        lines.append(f"| {domain} | {len(steps)} | "
                     + " | ".join(f"{r['tau']:.3f} / {r['nodes']:.2f}" for r in rows) + " |")
        print(lines[-1], flush=True)
    with open(os.path.join(args.out, "chain_stop.json"), "w") as f:
        json.dump({"args": vars(args), "domains": results}, f)
    with open(os.path.join(args.out, "chain_stop.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
