"""Teacher-forced top-1 agreement of draft heads with the target on feature caches, side by side.

For each head and each cache (e.g. the held-out sets of ``scripts/train_heads.sh``: in-domain,
off-domain code and prose, chat), the head drafts along the cached sequences with its own outputs
fed back for ``--steps`` unrolled steps (as training-time test and as decoding does), and we report
the share of positions where its first choice is the target's, per draft depth, with the chain tau
estimate ``1 + a0 + a0 a1 + ...`` (``eagle_kernels.train.trainer.evaluate``).

    python bench/head_agreement.py --heads shipped=eagle_kernels/heads/smollm2-135m-eagle3 \\
        candidate=runs/eagle3-wide --caches runs/heldout_chat,runs/heldout_offcode --out agreement.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from eagle_kernels.models import smollm2  # noqa: E402
from eagle_kernels.models.eagle_head import EagleHead  # noqa: E402
from eagle_kernels.train import trainer  # noqa: E402
from eagle_kernels.train.features import FeatureCache  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", required=True, metavar="NAME=FOLDER")
    parser.add_argument("--caches", required=True, help="comma-separated feature caches")
    parser.add_argument("--sequences", type=int, default=8, help="sequences per cache")
    parser.add_argument("--steps", type=int, default=6, help="unrolled draft steps")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, _ = smollm2.load()
    results = {}
    for spec in args.heads:
        name, _, folder = spec.partition("=")
        head = EagleHead.load(folder, target)
        if head.config.kind != trainer.EAGLE3:
            raise ValueError(f"--heads: {folder} holds an {head.config.kind} head; this measures EAGLE-3 heads")
        weights = {n: t.float() if t.is_floating_point() else t for n, t in head.weights.items()}
        trainable = trainer.TrainableHead(head.config, weights, target).eval()
        d2t = head.d2t.long().cpu()
        t2d = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
        t2d[d2t + torch.arange(d2t.numel())] = torch.arange(d2t.numel())
        cfg = trainer.TrainConfig(method=trainer.EAGLE3, ttt_steps=args.steps)
        for folder_c in args.caches.split(","):
            cache = FeatureCache(folder_c)
            with torch.no_grad():
                r = trainer.evaluate(trainable, cache, cfg, t2d, max_sequences=args.sequences, min_steps=args.steps)
            key = os.path.basename(os.path.normpath(folder_c))
            results.setdefault(key, {})[name] = r
            print(f"{key:18s} {name:10s} agreement {[round(a, 3) for a in r['agreement']]} "
                  f"chain tau {r['chain_tau']:.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"heads": args.heads, "sequences": args.sequences, "steps": args.steps, "results": results},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
