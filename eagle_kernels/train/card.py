"""Model card (README.md) of a trained head, rendered from what training and measurement
recorded: the feature cache's manifest, ``train_state.pt`` and, when given, the rows of a
``bench/e2e.py`` result file.

    python -m eagle_kernels.train.card HEAD_DIR FEATURE_DIR [E2E_JSON ...]
"""

from __future__ import annotations

import collections
import json
import os
import platform
import sys

import torch


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def render(head_dir: str, feature_dir: str, e2e_files=()) -> str:
    state = torch.load(os.path.join(head_dir, "train_state.pt"), weights_only=False, map_location="cpu")
    with open(os.path.join(feature_dir, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(head_dir, "config.json")) as f:
        config = json.load(f)
    cfg = state["config"]
    done, T = manifest["done"], manifest["seq_len"]
    sources = collections.Counter(name.split(":")[0] for name in manifest["documents"][:done])
    kind = config["eagle_kind"]
    size = os.path.getsize(os.path.join(head_dir, "model.safetensors")) / 2**20
    lines = [f"# SmolLM2-135M-Instruct {kind.upper().replace('EAGLE', 'EAGLE-')} draft head", "",
             f"Trained with `python -m eagle_kernels train --method {kind}` on this project's offline corpora "
             f"(eagle_kernels/train/corpus.py). fp16 safetensors, {size:.1f} MiB, EAGLE reference key layout "
             "(docs/eagle_heads.md).", "",
             "## Data", "",
             f"- {done} sequences x {T} tokens = {done * T:,} training tokens: "
             + ", ".join(f"{n} {s}" for s, n in sorted(sources.items()))
             + " (code = CPython standard library; austen = Jane Austen's novels; kjv = King James Bible; "
               "pydoc = Python 3.11 documentation sources).",
             "- Held out by document name (one document in ten by CRC32 of its name, and Austen's *Persuasion*); "
             "the measurements below use held-out documents only.",
             f"- Target features extracted once with our Llama forward in fp32 and stored in fp16 "
             f"({manifest.get('extract_seconds', 0) / 60:.0f} min of extraction).", "",
             "## Training", "",
             f"- {state['step']} optimizer steps x {cfg['batch_size']} sequences, AdamW lr {cfg['lr']} "
             f"(warm-up {cfg['warmup']}, cosine), grad clip {cfg['grad_clip']}; "
             f"training-time test with {cfg['ttt_steps']} unrolled step(s), step weights {cfg['step_decay']}^j"
             + (f"; SmoothL1 feature loss + {cfg['cls_weight']} x cross-entropy, feature noise "
                f"U(-{cfg['noise'] / 2:g}, {cfg['noise'] / 2:g})" if kind == "eagle1" else
                f"; cross-entropy over a {config['draft_vocab_size']}-token draft vocabulary, fc initialised by "
                "ridge regression onto the final hidden state") + ".",
             f"- Wall time {state['seconds'] / 60:.0f} min of optimizer steps on {_cpu_name()} "
             f"({state.get('threads', '?')} torch thread(s)).",
             ""]
    if state["history"]:
        lines += ["Held-out teacher-forced top-1 agreement with the target, per unrolled step "
                  "(chain tau estimate = 1 + a0 + a0 a1 + ...):", "",
                  "| optimizer step | held-out loss | agreement at draft depth 1, 2, 3, 4 | chain tau estimate |", "|---|---|---|---|"]
        for h in state["history"]:
            lines.append(f"| {h['step']} | {h['loss']:.3f} | {', '.join(f'{a:.3f}' for a in h['agreement'])} | "
                         f"{h['chain_tau']:.2f} |")
        lines.append("")
    rows, setups = [], []
    for path in e2e_files:
        with open(path) as f:
            data = json.load(f)
        rows += [r for r in data["rows"] if r["provider"].startswith(kind + "-")]
        m = data["meta"]
        setups.append(f"{m['prompts_per_domain']} held-out prompts x {m['max_new_tokens']} new tokens per cell, "
                      f"{m['device']} with {m['threads']} threads, torch {m['torch']}")
    if rows:
        lines += ["## Measured (bench/e2e.py, held-out prompts)", "", "; ".join(setups) + 
                  ". tau = tokens per decoding step, bonus token included.", "",
                  "| domain | T | batch | tree | tau | tok/s | x our plain decoding |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['domain']} | {r['temperature']:g} | {r['batch']} | {r['provider'][len(kind) + 1:]} | "
                         f"{r['tau']:.2f} | {r['tok_per_s']:.1f} | {r.get('vs_ours_plain', '')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    head_dir, feature_dir, *e2e = argv
    text = render(head_dir, feature_dir, e2e)
    with open(os.path.join(head_dir, "README.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
