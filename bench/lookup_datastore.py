"""Would a lookup chain drawn from earlier answers (a datastore of the target's own outputs, as
suffix-decoding servers keep) draft chat better than the request's own context? Measured on the CPU.

    python bench/lookup_datastore.py --held-out 32 --earlier 160 --out DIR

The target answers the held-out chat instructions and ``--earlier`` generated training
instructions at T = 0 (greedy, ``--max-new-tokens`` each, up to its end-of-turn token). Then, for
each held-out answer, chain-only speculative decoding is replayed on it (greedy: the target's
tokens are known): each step drafts the ``--chain`` tokens that followed the longest suffix of at
most ``--ngram`` tokens of the context (prompt plus answer so far), found

- ``own``: earlier in the context itself (the package's lookup chain, ``lookup_search_host``);
- ``datastore``: in the other held-out answers and the earlier ones (the most recent occurrence);
- ``best``: the longer of the two matches (the context's on a tie),

accepts the drafts up to the first that differs from the target's token, plus the target's own
token. Printed: tau (tokens a step) per source, with the datastore of the held-out answers alone
and with the earlier answers added. The head's tree is not part of the replay: these taus are the
chain's alone. Results: docs/benchmarks.md ("A datastore of earlier answers").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import shipped_smollm2  # noqa: E402  (bench/)

from eagle_kernels.decoder import SpeculativeDecoder  # noqa: E402
from eagle_kernels.lookup import lookup_search_host  # noqa: E402
from eagle_kernels.train.chat import HELD_OUT, prompt_ids, training_instructions  # noqa: E402


def answers(decoder, tokenizer, instructions, max_new: int) -> list[dict]:
    out = []
    with torch.inference_mode():
        for text in instructions:
            prompt = prompt_ids(tokenizer, text)
            tokens = decoder.generate([prompt], max_new, eos_token_id=tokenizer.eos_token_id).sequences[0]
            out.append({"prompt": prompt, "answer": [int(t) for t in tokens]})
    return out


class Datastore:
    """Every n-gram (n <= ngram) of some token sequences -> its most recent (sequence, end)."""

    def __init__(self, sequences: list[list[int]], ngram: int):
        self.sequences, self.ngram, self.last = sequences, ngram, defaultdict(tuple)
        for s, seq in enumerate(sequences):
            for end in range(len(seq) - 1):  # an occurrence needs a token after it
                for n in range(1, min(ngram, end + 1) + 1):
                    self.last[tuple(seq[end - n + 1:end + 1])] = (s, end)

    def chain(self, context: list[int], length: int) -> tuple[int, list[int]]:
        for n in range(min(self.ngram, len(context)), 0, -1):
            found = self.last.get(tuple(context[-n:]))
            if found:
                s, end = found
                return n, self.sequences[s][end + 1:end + 1 + length]
        return 0, []


def own_chain(context: list[int], ngram: int, length: int) -> tuple[int, list[int]]:
    history = torch.tensor([context])
    start, matched = lookup_search_host(history, torch.tensor([len(context)]), ngram)
    start, matched = int(start[0]), int(matched[0])
    return matched, (context[start:start + length] if start >= 0 else [])


def replay(prompt: list[int], answer: list[int], store: Datastore | None, source: str, ngram: int,
           length: int) -> int:
    """Steps of chain-only greedy speculative decoding of ``answer``."""
    done = steps = 0
    while done < len(answer):
        context = prompt + answer[:done]
        own = own_chain(context, ngram, length)
        theirs = store.chain(context, length) if store is not None else (0, [])
        drafts = {"own": own, "datastore": theirs, "best": own if own[0] >= theirs[0] else theirs}[source][1]
        accepted = 0
        while accepted < len(drafts) and done + accepted < len(answer) and drafts[accepted] == answer[done + accepted]:
            accepted += 1
        done += accepted + 1
        steps += 1
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--held-out", type=int, default=32, help="held-out chat instructions (at most 32)")
    parser.add_argument("--earlier", type=int, default=160, help="generated training instructions answered first")
    parser.add_argument("--seed", type=int, default=1234, help="which training instructions")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--chain", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, tokenizer, head = shipped_smollm2.load(args.threads)
    decoder = SpeculativeDecoder(model, head)
    held = answers(decoder, tokenizer, HELD_OUT[:args.held_out], args.max_new_tokens)
    earlier = answers(decoder, tokenizer, training_instructions(args.earlier, seed=args.seed), args.max_new_tokens)
    tokens = sum(len(h["answer"]) for h in held)
    lines = [f"Chain-only greedy replay of {len(held)} held-out chat answers ({tokens} tokens), chains of "
             f"{args.chain} after suffixes of <= {args.ngram} tokens; tau per source of the chain", "",
             "| datastore | own context | datastore | best of both |", "|---|---:|---:|---:|"]
    results = {}
    for label, extra in (("the other held-out answers", []), (f"+ {len(earlier)} earlier answers", earlier)):
        taus = {}
        for source in ("own", "datastore", "best"):
            steps = 0
            for i, h in enumerate(held):
                others = [o["answer"] for j, o in enumerate(held) if j != i] + [e["answer"] for e in extra]
                steps += replay(h["prompt"], h["answer"], Datastore(others, args.ngram), source, args.ngram,
                                args.chain)
            taus[source] = tokens / steps
        results[label] = taus
        lines.append(f"| {label} | {taus['own']:.3f} | {taus['datastore']:.3f} | {taus['best']:.3f} |")
        print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lookup_datastore.json"), "w") as f:
        json.dump({"args": vars(args), "tau": results, "held": held, "earlier": earlier}, f)
    with open(os.path.join(args.out, "lookup_datastore.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
