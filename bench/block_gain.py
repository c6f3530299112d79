"""How many more drafts does block verification keep than draft-by-draft verification? Measured
on the CPU with the real model, without sampling noise.

    python bench/block_gain.py --domains code offprose chat --prompts 8 --temperatures 1.0 0.7 --out DIR

Decodes held-out prompts with a sampled chain of ``--depth`` draws (``sampled_tree(depth, 1)``,
the shipped EAGLE-3 head, no lookup chain) and keeps every step's chain: its drafts, the target's
rows and the draft rows they were drawn from. For each step and each chain length ``G`` (the
chain's first ``G`` drafts, ``1 .. depth``) it computes the *expected* number of drafts each rule
accepts given those drafts, exactly, from the rows (docs/ops.md §4 and §21):

- draft by draft: ``sum_i prod_(j <= i) a_j``, ``a_j = min(1, P_(j-1)(x_j) / q_(j-1)(x_j))``;
- as one block: ``sum_i i h_i prod_(j > i) (1 - h_j)`` with §21's ``h_i``.

Both rules are evaluated on the same chains (a paired comparison: the chains are drawn from the
head, as the decoder draws them), so the difference carries no noise of the coins. tau = 1 + the
mean. Results: docs/benchmarks.md ("Block verification").
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import shipped_smollm2  # noqa: E402  (bench/)

from eagle_kernels import decoder as decoder_module  # noqa: E402
from eagle_kernels.decoder import SpeculativeDecoder, sampled_tree  # noqa: E402
from eagle_kernels.reference.verify import draft_row, sampling_probs  # noqa: E402
from eagle_kernels.train import corpus  # noqa: E402


def chain_rows(tokens, logits, draft_probs, d2t, temperature):
    """(P_i float64 [G + 1, V], r_i float64 [G, V], drafts x_1 .. x_G) of one logged step."""
    V = logits.shape[-1]
    P = torch.stack([sampling_probs(row, temperature, 0, 1.0).double() for row in logits])
    P = P / P.sum(-1, keepdim=True)
    G = tokens.shape[0] - 1
    r = torch.stack([draft_row(draft_probs[i], d2t, V) for i in range(G)])
    return P, r, tokens[1:].tolist()


def expected_accepted(P, r, drafts, G):
    """Expected drafts accepted of the chain's first G drafts: (draft by draft, as one block)."""
    ratios = [min(1.0, float(P[i, x]) / float(r[i, x])) for i, x in enumerate(drafts[:G])]
    token_rule, survive = 0.0, 1.0
    for a in ratios:
        survive *= a
        token_rule += survive
    p = [1.0]
    for i, x in enumerate(drafts[:G]):
        p.append(min(1.0, p[-1] * float(P[i, x]) / float(r[i, x])))
    h = []
    for i in range(1, G + 1):
        if i < G:
            residual = float(torch.clamp(p[i] * P[i] - r[i], min=0).sum())
            denominator = residual + 1.0 - p[i]
            h.append(residual / denominator if denominator > 0 else 1.0)
        else:
            h.append(p[G])
    block_rule = 0.0
    for i in range(1, G + 1):
        beyond = 1.0
        for j in range(i + 1, G + 1):
            beyond *= 1.0 - h[j - 1]
        block_rule += i * h[i - 1] * beyond
    return token_rule, block_rule


def log_chains(decoder, prompts, max_new, temperature):
    """Every speculative step's (tokens [N], logits [N, V], draft_probs [N, Vd]) of request 0."""
    steps, verify = [], decoder_module.ops.verify

    def logged_verify(tokens, parents, logits, **kwargs):
        if kwargs.get("draft_probs") is not None and tokens.shape[1] > 1:
            steps.append((tokens[0].clone(), logits[0].float().clone(), kwargs["draft_probs"][0].clone()))
        return verify(tokens, parents, logits, **kwargs)

    decoder_module.ops.verify = logged_verify
    try:
        with torch.inference_mode():
            for i, prompt in enumerate(prompts):
                decoder.generate([prompt], max_new, temperature=temperature, seed=i)
    finally:
        decoder_module.ops.verify = verify
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--domains", nargs="+", default=["code", "offprose", "chat"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, tokenizer, head = shipped_smollm2.load(args.threads)
    decoder = SpeculativeDecoder(model, head, sampled_tree(args.depth, 1))
    d2t = head.d2t
    os.makedirs(args.out, exist_ok=True)
    results = []
    depths = range(1, args.depth + 1)
    lines = [f"Sampled chains of {args.depth} draws, the shipped EAGLE-3 head, {args.prompts} held-out prompts x "
             f"{args.max_new_tokens} tokens per domain; tau draft by draft / as one block (gain) for the chain's "
             "first G drafts", "",
             "| domain | T | steps | " + " | ".join(f"G = {g}" for g in depths) + " |",
             "|---|---|---:|" + "---|" * args.depth]
    for domain in args.domains:
        prompts = corpus.held_out_prompts(tokenizer, domain, args.prompts, args.prompt_tokens)
        if not prompts:
            print(f"no held-out {domain} documents on this machine: skipped")
            continue
        for temperature in args.temperatures:
            steps = log_chains(decoder, prompts, args.max_new_tokens, temperature)
            sums = {g: [0.0, 0.0] for g in depths}
            for tokens, logits, draft_probs in steps:
                P, r, drafts = chain_rows(tokens, logits, draft_probs, d2t, temperature)
                for g in depths:
                    token_rule, block_rule = expected_accepted(P, r, drafts, g)
                    sums[g][0] += token_rule
                    sums[g][1] += block_rule
            row = {"domain": domain, "temperature": temperature, "steps": len(steps),
                   "tau": {g: (1 + s[0] / len(steps), 1 + s[1] / len(steps)) for g, s in sums.items()}}
            results.append(row)
            cells = [f"{t:.3f} / {b:.3f} ({b / t - 1:+.1%})" for t, b in row["tau"].values()]
            lines.append(f"| {domain} | {temperature:g} | {len(steps)} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    with open(os.path.join(args.out, "block_gain.json"), "w") as f:
        json.dump({"args": vars(args), "rows": results}, f, indent=1)
    with open(os.path.join(args.out, "block_gain.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
