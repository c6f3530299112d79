"""Model card (README.md) of a trained head, rendered from what training and measurement
recorded: the feature cache's manifest, ``train_state.pt`` and, when given, the rows of a
``bench/e2e.py`` result file.

    python -m eagle_kernels.train.card HEAD_DIR FEATURE_DIR [E2E_JSON ...]
    python -m eagle_kernels.train.card --measured-only HEAD_DIR E2E_JSON ...
"""

from __future__ import annotations

import json
import os
import sys

import torch

from .features import FeatureCache
from .trainer import DEFAULT_DRAFT_VOCAB_SIZE, cpu_name, data_summary

SOURCE_NAMES = ("code = CPython standard library; austen = Jane Austen's novels; kjv = King James Bible; "
                "pydoc = Python 3.11 documentation sources; pkg = sources of installed Python packages (not numpy); "
                "debdoc = Debian package documentation (no copyright or license files); chat = generated "
                "instructions in the target's chat template")


def _data_lines(data: list) -> list:
    lines = []
    for d in data:
        sources = ", ".join(f"{n} {s}" for s, n in sorted(d["sources"].items()))
        tokens = d["sequences"] * d["seq_len"]
        if d.get("generated"):
            g = d["generated"]
            temps = ", ".join(f"{t:g}" for t in g["temperatures"])
            prompt = (f"an instruction in the chat template (up to {g['prompt_len']} tokens; {sources}) answered"
                      if g.get("domains") == ["chat"] else f"{g['prompt_len']} corpus tokens ({sources}) continued")
            lines.append(f"- Self-distilled ({d['folder']}): {d['sequences']} sequences x {d['seq_len']} tokens = "
                         f"{tokens:,} tokens, each {prompt} by the "
                         f"target itself (batches cycle through temperatures {temps}; 0 = greedy); features "
                         f"recorded while generating ({d['extract_seconds'] / 60:.0f} min).")
        else:
            lines.append(f"- Real text ({d['folder']}): {d['sequences']} sequences x {d['seq_len']} tokens = "
                         f"{tokens:,} tokens: {sources}; target features extracted once with our Llama forward in "
                         f"fp32, stored in fp16 ({d['extract_seconds'] / 60:.0f} min of extraction).")
    return lines


def _draft_vocab_sizes(phases: list, final_size: int) -> list:
    """Each phase's draft vocabulary size: its own setting where it made one (a new head, or a
    continued head grown to it), else the previous phase's; the final phase has the head's."""
    sizes, previous = [], None
    for p in phases:
        asked = p["config"].get("draft_vocab_size")
        previous = asked or (previous if p["config"].get("init") and previous else DEFAULT_DRAFT_VOCAB_SIZE)
        sizes.append(previous)
    return sizes[:-1] + [final_size] if sizes else sizes


def _phase_line(state: dict, vocab: int, grown_from: int | None, kind: str) -> str:
    cfg = state["config"]
    grown = f" (grown from {grown_from} tokens)" if grown_from else ""
    objective = (f"SmoothL1 feature loss + {cfg['cls_weight']} x cross-entropy, feature noise "
                 f"U(-{cfg['noise'] / 2:g}, {cfg['noise'] / 2:g})" if kind == "eagle1" else
                 f"cross-entropy over a {vocab}-token draft vocabulary{grown}")
    start = "continuing from the previous phase's head" if cfg.get("init") else (
        "fc initialised by ridge regression onto the final hidden state" if kind == "eagle3" else "from scratch")
    data = " + ".join(d["folder"] for d in state.get("data") or []) or "the real-text cache"
    return (f"- {state['step']} optimizer steps x {cfg['batch_size']} sequences on {data}, AdamW lr {cfg['lr']} "
            f"(warm-up {cfg['warmup']}, cosine), grad clip {cfg['grad_clip']}; training-time test with "
            f"{cfg['ttt_steps']} unrolled step(s), step weights {cfg['step_decay']}^j; {objective}; {start}. "
            f"{state['seconds'] / 60:.0f} min on {state.get('cpu') or cpu_name()} ({state.get('threads', '?')} torch "
            "thread(s)).")


def render(head_dir: str, feature_dir: str, e2e_files=()) -> str:
    state = torch.load(os.path.join(head_dir, "train_state.pt"), weights_only=False, map_location="cpu")
    with open(os.path.join(head_dir, "config.json")) as f:
        config = json.load(f)
    kind = config["eagle_kind"]
    size = os.path.getsize(os.path.join(head_dir, "model.safetensors")) / 2**20
    # Runs recorded before data summaries existed trained on ``feature_dir`` alone.
    phases = state.get("lineage", []) + [state]
    if not all(p.get("data") for p in phases):
        legacy = [data_summary(FeatureCache(feature_dir))]
        phases = [dict(p, data=p.get("data") or legacy) for p in phases]
    data, seen = [], set()
    for p in phases:
        for d in p["data"]:
            if d["folder"] not in seen:
                seen.add(d["folder"])
                data.append(d)
    total_steps = sum(p["step"] for p in phases)
    total_minutes = sum(p["seconds"] for p in phases) / 60
    lines = [f"# SmolLM2-135M-Instruct {kind.upper().replace('EAGLE', 'EAGLE-')} draft head", "",
             f"Trained with `python -m eagle_kernels train --method {kind}` on this project's offline corpora "
             f"(eagle_kernels/train/corpus.py) and, where listed, on the target's own continuations "
             f"(`python -m eagle_kernels distill`). fp16 safetensors, {size:.1f} MiB, EAGLE reference key layout "
             "(docs/eagle_heads.md).", "",
             "## Data", ""] + _data_lines(data) + [
             f"- Sources: {SOURCE_NAMES}.",
             "- Held out by document name (one document in ten by CRC32 of its name, and Austen's *Persuasion*); "
             "the measurements below use held-out documents (and prompts from them) only.", "",
             "## Training", "",
             f"{total_steps} optimizer steps in {len(phases)} phase(s), "
             f"{total_minutes:.0f} min of optimizer steps in all:", ""]
    vocabs = _draft_vocab_sizes(phases, config["draft_vocab_size"])
    lines += [_phase_line(p, v, vocabs[i - 1] if i and vocabs[i - 1] != v else None, kind)
              for i, (p, v) in enumerate(zip(phases, vocabs))] + [""]
    if state["history"]:
        also = sorted({name for h in state["history"] for name in h.get("also", {})})
        first_eval = state["history"][-1].get("folder")  # older runs: the real-text held-out cache
        depths = ", ".join(str(d + 1) for d in range(len(state["history"][-1]["agreement"])))
        lines += [("Last phase: held-out" if len(phases) > 1 else "Held-out") + " teacher-forced top-1 agreement with "
                  "the target per unrolled step (chain tau estimate = 1 + a0 + a0 a1 + ...), on "
                  + (first_eval or "real held-out text")
                  + (f" and on {', '.join(also)} (the target's own continuations of held-out prompts)" if also else "")
                  + ":", "",
                  f"| optimizer step | held-out loss | agreement at draft depth {depths} | chain tau estimate |"
                  + "".join(f" {name}: agreement | {name}: chain tau |" for name in also),
                  "|---|---|---|---|" + "---|---|" * len(also)]
        for h in state["history"]:
            extra = "".join(f" {', '.join(f'{a:.3f}' for a in h['also'][n]['agreement'])} | "
                            f"{h['also'][n]['chain_tau']:.2f} |"
                            if n in h.get("also", {}) else " | |" for n in also)
            lines.append(f"| {h['step']} | {h['loss']:.3f} | {', '.join(f'{a:.3f}' for a in h['agreement'])} | "
                         f"{h['chain_tau']:.2f} |" + extra)
        lines.append("")
    return "\n".join(lines + measured_section(kind, e2e_files))


def measured_section(kind: str, e2e_files=()) -> list:
    """The card's "Measured" lines: the ``kind`` rows of ``bench/e2e.py`` result files."""
    lines, rows, setups = [], [], []
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
    return lines


def replace_measured(card: str, kind: str, e2e_files) -> str:
    """``card`` with its "Measured" section rendered anew from ``e2e_files`` (for a head whose
    training record is gone but whose measurements are rerun)."""
    head, marker, _ = card.partition("## Measured")
    if not marker:
        raise ValueError("card: no '## Measured' section to replace")
    return head + "\n".join(measured_section(kind, e2e_files))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--measured-only":  # HEAD_DIR E2E_JSON ...: keep the card, redo its table
        head_dir, *e2e = argv[1:]
        with open(os.path.join(head_dir, "config.json")) as f:
            kind = json.load(f)["eagle_kind"]
        with open(os.path.join(head_dir, "README.md")) as f:
            text = replace_measured(f.read(), kind, e2e).rstrip("\n")
    else:
        head_dir, feature_dir, *e2e = argv
        text = render(head_dir, feature_dir, e2e)
    with open(os.path.join(head_dir, "README.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
