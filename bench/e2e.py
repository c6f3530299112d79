"""End-to-end decoding benchmark on SmolLM2-135M-Instruct, every provider measured side by side
in one run on the same held-out prompts (never in any training cache).

Providers
---------
- ``ours-plain``: our Llama target, plain decoding (the baseline of every ratio);
- ``hf-generate``: transformers ``generate`` (greedy at T = 0, sampling at T = 1);
- ``hf-lookup``: transformers prompt-lookup decoding (``prompt_lookup_num_tokens``; batch 1
  only, as transformers' assisted decoding);
- ``eagle1-dDkKnN`` / ``eagle3-…``: our speculative decoder with each shipped head and tree
  (``…lL``: with a prompt-lookup chain of L tokens grafted onto the tree);
- ``ours-lookup`` (opt-in): our decoder without a head, drafting only the prompt-lookup chain
  (``--lookup-chain`` tokens; prompt-lookup decoding on our kernels);
- ``bf16w`` (opt-in, in ``--providers``): ``ours-plain-bf16w`` and ``<head>-…-bf16w``, the same
  decoders on a copy of the target whose weight matrices are stored in bf16 (fp32 compute; on
  CPU the cpu_linear kernel reads them as is). Their "same as plain" compares with
  ``ours-plain-bf16w``.
- ``q8_0w`` / ``q4_1w`` / ``ggufw`` (opt-in, in ``--providers``): the same for weight-only quantized
  matrices (GGML Q8_0 / Q4_1 blocks quantized from the fp32 weights, or the GGUF file's own blocks; fp32
  activations, cpu_linear's exact integer block sums); suffixes ``-q8_0w``, ``-q4_1w``, ``-ggufw``.
  ``q8_0a8w`` / ``q4_1a8w`` / ``ggufa8w``: the same weights with int8 activations (GGML's arithmetic), compared
  with the same llama.cpp rows.
- ``bf16kv`` (opt-in, in ``--providers``): a twin of every target of the run with bf16 K/V caches
  (``kv_cache_dtype``; suffix ``-bf16kv``, e.g. ``ours-plain-ggufa8w-bf16kv``), compared with the same llama.cpp
  rows (whose cache is F16 by default); "same as plain" compares with the twin's own plain decoding.
- ``llamacpp`` (opt-in): llama.cpp through llama-cpp-python (``bench/llamacpp.py``; skipped with a message
  where it is not installed), fed the same token ids, greedy, at the same thread count, one row per weight
  type of the run: ``llamacpp`` (F32), ``llamacpp-bf16w``, ``-q8_0w``, ``-q4_1w``, ``-ggufw`` (the shipped
  file), each a GGUF with exactly the matrices of our provider of that suffix; T = 0, batch 1 only. Its
  "same as plain" compares with our plain decoding at the same weights.

Step policies and head weights (CPU): ``--policies adaptive fixed`` runs every head provider under the adaptive
fitted policy (the CPU default: each greedy step drafts the shape of the tree's ladder that measures the most
tokens per second; names as above) and the fixed one (every step drafts the tree; names ``…-fixed``);
``adaptive-sampling`` lets calls that sample adapt their shapes too (``FittedPolicy(adaptive_sampling=True)``;
names ``…-as``); ``coupled`` and ``adaptive-coupled`` sample by coupled sampling (``FittedPolicy(coupled_sampling=
True)``, with ``adaptive=True``), drafting the greedy calls' tree at every temperature (names ``…-cs``, ``…-acs``);
``--head-weights auto stored q8_0 q4_1`` loads each head with Q8_0 matrices where its target is quantized (the
default), as stored (fp16; names ``…-hstored``) and with Q8_0 / Q4_1 matrices whatever the target (``…-hq8_0``,
``…-hq4_1``). ``--no-fp32w`` leaves out the fp32-weight decoders (with a weight suffix in
``--providers``): ratios are then to the first ``ours-plain-…`` provider.

Prompt sets (``--domains``): ``code`` and ``prose`` come from the held-out documents of the training
corpora; ``offcode`` (numpy's sources), ``offprose`` (license and copyright texts) and ``chat`` (a
fixed list of held-out instructions in the target's chat template) from sources no training cache
ever holds (``eagle_kernels.train.corpus``), to measure a head off its training domain; ``chatlong``
is ``CHAT_PROMPTS``, four long requests in the chat template (70-110 tokens with the system turn).

Every run generates exactly ``--max-new-tokens`` tokens per prompt (EOS ignored) so that
per-token wall clock compares like with like; batch 1 runs the prompts one after another,
batch B runs them together. Two clocks per provider:
- tok/s: generated tokens / wall clock of the whole call, prefill included;
- decode ms/token: time per output token after the first (what vLLM's benchmarks call TPOT):
  (wall clock - time to the first token) / (tokens - 1 per sequence). Our decoder times its
  prefill itself; for transformers the time to the first token is a separate one-token
  ``generate`` of the same batch, measured in the same round.
Within a round the providers take turns on each prompt group (batch 1: each prompt), so a
drift of the machine's speed over the round reaches all of them alike; with ``--rounds R``
every provider runs R such rounds and reports its median round (the faster of two): a VM whose
speed drifts by 10-20% over minutes then biases no provider. Writes ``e2e.md`` (table) and ``e2e.json`` to ``--out``
(one folder per machine under ``bench/results/``); ``--render-docs`` then copies the tables of
those files into the generated sections of README.md and docs/benchmarks.md.

    python bench/e2e.py --out bench/results/MACHINE   # CPU, full table
    python bench/e2e.py --render-docs                 # README.md, docs/benchmarks.md from the JSON
    python bench/e2e.py --quick --device cuda # one prompt per domain; random weights if the
                                              # model package is absent (timing only)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from eagle_kernels import heads as shipped  # noqa: E402
from eagle_kernels.decoder import SpeculativeDecoder, TreeConfig, default_tree, sampled_tree  # noqa: E402
from eagle_kernels.models import smollm2  # noqa: E402
from eagle_kernels.models.cpu_weights import quantize_matrices, with_matrices  # noqa: E402
from eagle_kernels.models.eagle_head import EagleHead  # noqa: E402
from eagle_kernels.models.llama import LlamaConfig, LlamaModel  # noqa: E402
from eagle_kernels.policy import FittedPolicy  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp  # noqa: E402

QUANT_PROVIDERS = ("q8_0", "q4_1", "gguf")  # opt-in providers q8_0w, q4_1w, ggufw (and q8_0a8w ...: int8 activations)
BASE_WEIGHT_SUFFIXES = ("bf16w", "q8_0w", "q4_1w", "ggufw", "q8_0a8w", "q4_1a8w", "ggufa8w")
KV16 = "bf16kv"  # twins of each target with bf16 K/V caches (kv_cache_dtype)
# Longest first: a provider's suffix is the first that its name ends with.
WEIGHT_SUFFIXES = tuple(f"{w}-{KV16}" for w in BASE_WEIGHT_SUFFIXES) + (KV16,) + BASE_WEIGHT_SUFFIXES

# The chatlong domain: user turns (the chat template adds the system turn and the generation prompt).
CHAT_PROMPTS = (
    "I am writing a small command-line tool in Python that reads a CSV file of expenses, groups them by month "
    "and category, and prints a summary table. Which standard library modules should I use, and how would you "
    "structure the code so that it stays easy to test?",
    "Explain to a high-school student why the sky is blue during the day but red and orange at sunset. Use a "
    "simple analogy, mention what happens to light in the atmosphere, and keep the answer to a few short "
    "paragraphs.",
    "My team keeps missing deadlines because tasks are estimated too optimistically. Suggest a practical "
    "process for planning a two-week sprint, including how to split large tasks, how to track progress during "
    "the sprint, and what to discuss at the end.",
    "Write a short story of about two hundred words about a lighthouse keeper who finds a message in a bottle "
    "that seems to be addressed to her, written many years ago. The tone should be quiet and a little "
    "mysterious, with a hopeful ending.",
)


def chat_prompts(tokenizer, count: int) -> list:
    """The first ``count`` of ``CHAT_PROMPTS`` as token ids in the model's chat template."""
    prompts = []
    for text in CHAT_PROMPTS[:count]:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
        prompts.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))  # transformers 5 / 4
    return prompts


def parse_tree(text: str) -> TreeConfig:
    """``depth,top_k,num_nodes[,lookup[,lookup_ngram]][,t|ta]`` (``t``: lookup_trim, ``ta``:
    lookup_trim and lookup_alone), or a sampled-draft tree ``sdepth,top_k,frontier[,lookup[,lookup_ngram]][,t|ta]``
    (``TreeConfig.sampled``: every candidate verified), or ``bdepth``: a sampled chain of ``depth`` drafts
    verified as one block (``TreeConfig.block``)."""
    if text.startswith("b"):
        return sampled_tree(int(text[1:]), 1, block=True)
    sampled = text.startswith("s")
    parts = text.removeprefix("s").split(",")
    flags = parts[-1] if parts[-1] in ("t", "ta") else ""
    numbers = [int(x) for x in (parts[:-1] if flags else parts)]
    chain = dict(lookup_trim=bool(flags), lookup_alone=flags == "ta")
    if sampled:
        chain.update(zip(("lookup", "lookup_ngram"), numbers[3:]))
        return sampled_tree(*numbers[:3], **chain)
    return TreeConfig(*numbers, **chain)


def tree_name(tree: TreeConfig) -> str:
    flags = ("t" if tree.lookup_trim else "") + ("a" if tree.lookup_trim and tree.lookup_alone else "")
    lookup = f"l{tree.lookup}{flags}" if tree.lookup else ""
    if tree.block:  # a sampled chain verified as one block
        return f"b{tree.depth}n{tree.num_nodes}"
    if tree.sampled:  # sampled drafts: depth, children, frontier (verify rows: num_nodes)
        return f"s{tree.depth}k{tree.top_k}f{tree.frontier_width}n{tree.num_nodes}" + lookup
    return f"d{tree.depth}k{tree.top_k}n{tree.num_nodes}" + lookup


def random_smollm2(device) -> tuple[LlamaModel, None]:
    """SmolLM2-135M's shapes with random weights, for timing where the model is absent."""
    config = LlamaConfig(49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, None)
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)}
    for i in range(30):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (576,), p + "post_attention_layernorm.weight": (576,),
                       p + "self_attn.q_proj.weight": (576, 576), p + "self_attn.k_proj.weight": (192, 576),
                       p + "self_attn.v_proj.weight": (192, 576), p + "self_attn.o_proj.weight": (576, 576),
                       p + "mlp.gate_proj.weight": (1536, 576), p + "mlp.up_proj.weight": (1536, 576),
                       p + "mlp.down_proj.weight": (576, 1536)})
    weights = {n: (torch.ones(s) if n.endswith("norm.weight") else torch.randn(s, generator=g) * 0.02).to(device)
               for n, s in shapes.items()}
    return LlamaModel(config, weights), None


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak so far (Linux: KiB)


def run_ours(decoder, prompts, batch, max_new, temperature, speculative, seed_base=0):
    tokens, seconds, first_token_seconds, steps, sequences = 0, 0.0, 0.0, 0, []
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        t0 = time.perf_counter()
        result = decoder.generate(group, max_new, temperature=temperature, seed=seed_base + start,
                                  speculative=speculative)
        if decoder.target.device.type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - t0
        first_token_seconds += result.timings["prefill_s"]
        tokens += sum(len(s) for s in result.sequences)
        steps += sum(result.steps)
        sequences += result.sequences
    # tau counts decoding steps only (the prefill's first token excluded), as GenerationResult.
    return {"tokens": tokens, "seconds": seconds, "first_token_seconds": first_token_seconds,
            "tau": (tokens - len(prompts)) / max(steps, 1), "steps": steps, "sequences": sequences}


def merge_runs(runs: list[dict]) -> dict:
    """One provider's runs over consecutive prompt groups as one run over all the prompts."""
    total = {key: sum(r[key] for r in runs) for key in ("tokens", "seconds", "first_token_seconds")}
    total["sequences"] = [seq for r in runs for seq in r["sequences"]]
    if "steps" in runs[0]:
        total["steps"] = sum(r["steps"] for r in runs)
        total["tau"] = (total["tokens"] - len(total["sequences"])) / max(total["steps"], 1)
    else:
        total["tau"] = None
    return total


def run_hf(hf, prompts, batch, max_new, temperature, lookup, pad_id, seed_base=0):
    tokens, seconds, first_token_seconds, sequences = 0, 0.0, 0.0, []
    device = hf.device
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        width = max(len(p) for p in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, p in enumerate(group):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kwargs = dict(max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id,
                      do_sample=temperature > 0)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        if lookup:
            kwargs["prompt_lookup_num_tokens"] = 10
        for new_tokens in sorted({1, max_new}):  # a one-token generate first: time to the first token
            kwargs.update(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            torch.manual_seed(seed_base + start)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            if new_tokens == 1:
                first_token_seconds += elapsed
        seconds += elapsed
        new = out[:, width:]
        tokens += new.numel()
        sequences += new.tolist()
    return {"tokens": tokens, "seconds": seconds, "first_token_seconds": first_token_seconds, "tau": None,
            "sequences": sequences}


def decode_ms_per_token(run: dict, sequences: int) -> float:
    """Time per output token after the first, in ms (TPOT)."""
    later = run["tokens"] - sequences
    return 1e3 * (run["seconds"] - run["first_token_seconds"]) / later if later > 0 else float("nan")


def shown_path(folder):
    """A head folder as e2e.json records it: relative to the repository when inside it (results
    are committed, and one machine's checkout path means nothing on another), else as given."""
    if folder and os.path.abspath(folder).startswith(ROOT + os.sep):
        return os.path.relpath(os.path.abspath(folder), ROOT)
    return folder


def table_lines(meta: dict, rows: list) -> list:
    """The lines of ``e2e.md``: a sentence on the setup (from ``meta``) and one table row per
    provider and cell, as ``main`` writes them and ``render_doc`` copies them into the docs."""
    peak = "CUDA max allocated" if meta["device"].startswith("cuda") else "process peak RSS so far (monotone)"
    lines = [f"Device {meta['device']} ({meta['threads']} threads, torch {meta['torch']}), {meta['model']}, "
             f"{meta['prompts_per_domain']} held-out prompts x {meta['prompt_tokens']} tokens per domain, "
             f"{meta['max_new_tokens']} new tokens each (EOS ignored), median of {meta['rounds']} interleaved "
             f"round(s). tok/s = generated tokens / wall clock including prefill; decode ms/tok = time per output "
             f"token after the first (TPOT). Ratios: whole call (tok/s) / decode only. Peak memory: {peak}.", "",
             "| domain | T | batch | provider | tok/s | decode ms/tok | tau | x ours-plain | x hf-generate "
             "| same as plain | peak MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(r, key):
        return f"{r[key]:.2f} / {r['decode_' + key]:.2f}" if key in r else ""

    for r in rows:
        same = {True: "yes", False: "NO"}.get(r.get("same_as_plain"), "")
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(f"| {r['domain']} | {r['temperature']:g} | {r['batch']} | {r['provider']} | "
                     f"{r['tok_per_s']:.1f} | {r['decode_ms_per_token']:.1f} | {tau} | {ratio(r, 'vs_ours_plain')} | "
                     f"{ratio(r, 'vs_hf_generate')} | {same} | {r['peak_mb']:.0f} |")
    return lines


SUMMARY_NAMES = {"hf-generate": "transformers `generate`", "hf-lookup": "transformers prompt lookup",
                 "ours-plain": "eagle_kernels, plain decoding"}


def summary_lines(meta: dict, rows: list) -> list:
    """The headline table: T = 0, batch 1, one line per provider (transformers, our plain
    decoding, our speculative decoder with the first head and tree of the run, fp32 weights),
    the domains side by side."""
    cells = {(r["provider"], r["domain"]): r for r in rows if r["temperature"] == 0 and r["batch"] == 1}
    domains = list(dict.fromkeys(domain for _, domain in cells))
    speculative = next((p for p, _ in cells if p.split("-")[0] not in ("hf", "ours", "llamacpp")
                        and not p.endswith("-bf16w")),
                       None)
    providers = [p for p in ("hf-generate", "hf-lookup", "ours-plain", speculative)
                 if any((p, d) in cells for d in domains)]
    lines = ["| decoder | " + " | ".join(f"{d}: tok/s | {d}: ms/token | {d}: x plain" for d in domains) + " |",
             "|---|" + "---:|---:|---:|" * len(domains)]
    for p in providers:
        name = SUMMARY_NAMES.get(p) or f"eagle_kernels, speculative (`{p}`)"
        row = []
        for d in domains:
            r = cells.get((p, d))
            row += ([f"{r['tok_per_s']:.1f}", f"{r['decode_ms_per_token']:.1f}",
                     f"{r['decode_vs_ours_plain']:.2f}x" + (f" (τ {r['tau']:.2f})" if p == speculative else "")]
                    if r else ["", "", ""])
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return lines


BASE_WEIGHT_NAMES = {"": "fp32", "-bf16w": "bf16", "-q8_0w": "Q8_0", "-q4_1w": "Q4_1",
                     "-ggufw": "the GGUF (Q4_1, Q8_0 head)", "-q8_0a8w": "Q8_0, int8 activations",
                     "-q4_1a8w": "Q4_1, int8 activations", "-ggufa8w": "the GGUF, int8 activations"}
WEIGHT_NAMES = {key: value for suffix, name in BASE_WEIGHT_NAMES.items()
                for key, value in ((suffix, name), (f"{suffix}-{KV16}", f"{name}, bf16 K/V"))}


def weight_suffix(provider: str) -> str:
    """The weight suffix of a provider's name ("" for the fp32 target's providers)."""
    return next((f"-{w}" for w in WEIGHT_SUFFIXES if provider.endswith(f"-{w}")), "")


def llama_suffix(suffix: str) -> str:
    """The llama.cpp provider our weights compare with: the same blocks (ours with int8 activations or a bf16
    K/V cache: the same; llama.cpp keeps its default F16 cache)."""
    return suffix.replace(f"-{KV16}", "").replace("a8w", "w")


def llamacpp_lines(meta: dict, rows: list) -> list:
    """Ours against llama.cpp (T = 0, batch 1), per domain and weight type: decode ms/token of llama.cpp, of our
    plain decoding and of our speculative decoder (the first head and tree of the run) at the same weights, and
    their ratios (llama.cpp's time / ours: above 1, ours is faster); "x fastest" against llama.cpp's fastest weight
    type in that domain (per token; whole call: tok/s against its best tok/s)."""
    cells = {(r["provider"], r["domain"]): r for r in rows if r["temperature"] == 0 and r["batch"] == 1}
    info = meta.get("llamacpp", {})
    lines = [f"llama-cpp-python {info.get('version', '?')}, {info.get('threads', '?')} thread(s) on both sides; "
             f"{meta['prompts_per_domain']} prompts per domain, {meta['max_new_tokens']} new tokens, median of "
             f"{meta['rounds']} interleaved round(s). ms = decode ms/token; x = llama.cpp's / ours (above 1: ours "
             "faster); same = greedy tokens equal to our plain decoding with the same weights.", "",
             "| domain | weights | llama.cpp ms | ours plain ms | plain x | speculative ms (tau) | speculative x | "
             "speculative x fastest llama.cpp (per token / whole call) | same: llama.cpp / speculative |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    domains = list(dict.fromkeys(d for _, d in cells))
    for d in domains:
        ours_llama = [r for (p, dd), r in cells.items() if dd == d and p.startswith("llamacpp")]
        if not ours_llama:
            continue
        fastest = min(r["decode_ms_per_token"] for r in ours_llama)
        best_tps = max(r["tok_per_s"] for r in ours_llama)
        for suffix, weights in WEIGHT_NAMES.items():
            llama = cells.get(("llamacpp" + llama_suffix(suffix), d))
            plain = cells.get(("ours-plain" + suffix, d))
            if llama is None or plain is None:
                continue
            spec = next((r for (p, dd), r in cells.items() if dd == d and p.split("-")[0] not in
                         ("hf", "ours", "llamacpp") and weight_suffix(p) == suffix), None)
            same = {True: "yes", False: "NO", None: ""}
            row = [d, weights, f"{llama['decode_ms_per_token']:.1f}", f"{plain['decode_ms_per_token']:.1f}",
                   f"{llama['decode_ms_per_token'] / plain['decode_ms_per_token']:.2f}"]
            if spec:
                row += [f"{spec['decode_ms_per_token']:.1f} ({spec['tau']:.2f})",
                        f"{llama['decode_ms_per_token'] / spec['decode_ms_per_token']:.2f}",
                        f"{fastest / spec['decode_ms_per_token']:.2f} / {spec['tok_per_s'] / best_tps:.2f}",
                        f"{same[llama.get('same_as_plain')]} / {same[spec.get('same_as_plain')]}"]
            else:
                row += ["", "", "", f"{same[llama.get('same_as_plain')]} / "]
            lines.append("| " + " | ".join(row) + " |")
    return lines


DOCS = ("README.md", "docs/benchmarks.md")  # the files with generated sections

# A generated section of a Markdown file: <!-- e2e-table PATH --> ... <!-- /e2e-table --> (or
# e2e-summary, e2e-llamacpp), PATH an e2e.json relative to the repository root.
GENERATED = re.compile(r"(<!-- (e2e-table|e2e-summary|e2e-llamacpp) (\S+) -->\n).*?(<!-- /\2 -->)", re.S)
RENDERERS = {"e2e-table": table_lines, "e2e-summary": summary_lines, "e2e-llamacpp": llamacpp_lines}


def render_doc(text: str) -> str:
    """``text`` with every generated section rendered anew from the e2e.json it names."""
    def section(match):
        with open(os.path.join(ROOT, match.group(3))) as f:
            data = json.load(f)
        render = RENDERERS[match.group(2)]
        return match.group(1) + "\n".join(render(data["meta"], data["rows"])) + "\n" + match.group(4)

    return GENERATED.sub(section, text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--quick", action="store_true", help="1 prompt per domain, 32 tokens, batch 1, T = 0")
    parser.add_argument("--domains", nargs="+", default=["code", "prose"],
                        help="held-out prompt sets: code, prose (the training corpora's held-out documents), "
                             "offcode (numpy's sources), offprose (license and copyright texts), chat (held-out "
                             "instructions in the chat template; whole prompts, --prompt-tokens does not apply; "
                             "see eagle_kernels.train.corpus), chatlong (CHAT_PROMPTS: four long requests)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per domain")
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--heads", nargs="+", default=["eagle1", "eagle3"])
    parser.add_argument("--trees", type=parse_tree, nargs="+",
                        help="depth,top_k,num_nodes[,lookup[,lookup_ngram]][,t|ta] (t: lookup_trim, ta: lookup_trim "
                             "and lookup_alone), or sdepth,top_k,frontier[,...] for a sampled-draft tree; several "
                             "allowed; default: the device's tree for each batch size and temperature, "
                             "eagle_kernels.decoder.default_tree, and at T > 0 also its sampled-draft tree)")
    parser.add_argument("--lookup-chain", type=int, default=4, help="draft tokens per step of ours-lookup")
    parser.add_argument("--providers", nargs="+", default=["ours-plain", "hf-generate", "hf-lookup", "eagle"],
                        help="ours-plain, hf-generate, hf-lookup, eagle, ours-lookup, llamacpp; q8_0w, q4_1w, "
                             "ggufw add the quantized-weight providers as bf16w (q8_0a8w, q4_1a8w, ggufa8w: the "
                             "same weights with int8 activations, beside the same llama.cpp rows); bf16w adds the "
                             "bf16-weight twins of ours-plain, ours-lookup, eagle and llamacpp; bf16kv a twin of every "
                             "target with bf16 K/V caches")
    parser.add_argument("--llamacpp-python",
                        help="a Python that imports llama_cpp, for the llamacpp providers (default: this one, if it "
                             "can; e.g. a separate venv's bin/python)")
    parser.add_argument("--gguf-dir", default=os.path.join(ROOT, "build", "llamacpp-gguf"),
                        help="where the llamacpp providers' GGUF files are written (once) and read")
    parser.add_argument("--llamacpp-amx", action="store_true",
                        help="let ggml use AMX (default: refused by bench/llamacpp_noamx.c, preloaded into the "
                             "llama.cpp worker: its AMX path crashed on Q8_0 / Q4_1 models, see docs/benchmarks.md)")
    parser.add_argument("--head-folder", action="append", default=[], metavar="NAME=FOLDER",
                        help="one more head to run beside the shipped ones, e.g. a candidate from training "
                             "(NAME without '-'; rows are NAME-TREE); repeatable")
    parser.add_argument("--policies", nargs="+",
                        choices=["adaptive", "fixed", "adaptive-sampling", "coupled", "adaptive-coupled"],
                        default=["adaptive"],
                        help="step policies of the head providers on CPU: adaptive (the default: draft shapes by "
                             "measured tokens per second, greedy calls only), fixed (every step drafts the tree; "
                             "rows …-fixed), adaptive-sampling (calls that sample adapt too; rows …-as), coupled "
                             "and adaptive-coupled (coupled sampling, fixed or adaptive shapes; rows …-cs, …-acs)")
    parser.add_argument("--head-weights", nargs="+", choices=["auto", "stored", "q8_0", "q4_1"], default=["auto"],
                        help="head matrices: auto (Q8_0 blocks with a quantized target; the default), stored "
                             "(as the checkpoint, fp16; rows …-hstored), q8_0 / q4_1 (those blocks whatever the "
                             "target; rows …-hq8_0, …-hq4_1)")
    parser.add_argument("--no-fp32w", action="store_true",
                        help="leave out the fp32-weight decoders (keep those of the weight suffixes in --providers)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--sync-every", type=int,
                        help="host reads of the done flags, every N steps (default: 1 on CPU, 4 on GPU)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds per provider (providers take turns on each prompt group); "
                             "each reports its median round")
    parser.add_argument("--render-docs", nargs="*", metavar="DOC",
                        help="measure nothing: render the generated tables of these Markdown files anew from the "
                             "e2e.json files they name (default: " + " and ".join(DOCS) + ")")
    args = parser.parse_args(argv)
    if args.render_docs is not None:
        for doc in args.render_docs or [os.path.join(ROOT, d) for d in DOCS]:
            with open(doc) as f:
                text = f.read()
            with open(doc, "w") as f:
                f.write(render_doc(text))
        return 0
    if args.quick:
        args.prompts, args.max_new_tokens, args.batches, args.temperatures = 1, 32, [1], [0.0]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)

    have_model = smollm2.gguf_path() is not None
    if have_model:
        target, tokenizer = smollm2.load(device=device)
    else:
        print("SmolLM2-135M is not installed: random weights of its shape (timings only, tau meaningless)")
        target, tokenizer = random_smollm2(device)
    hf = None
    if have_model and any(p.startswith("hf-") for p in args.providers):
        hf = smollm2.transformers_model().to(device)
    targets = {"": target}
    if "bf16w" in args.providers:
        targets["-bf16w"] = LlamaModel(target.config, dict(target.weights), weight_dtype=torch.bfloat16)
    for fmt, a8 in [(f, a8) for f in QUANT_PROVIDERS for a8 in ("", "a8")]:
        if fmt + a8 + "w" not in args.providers:
            continue
        activations = "int8" if a8 else "fp32"
        if fmt == "gguf":
            if have_model:
                targets[f"-gguf{a8}w"] = smollm2.load(device=device, weight_dtype="gguf", activations=activations)[0]
            else:
                print(f"gguf{a8}w: SmolLM2-135M is not installed: skipped")
            continue
        tied = {n: t for n, t in target.weights.items() if n != "lm_head.weight"}  # tied: one quantized matrix
        matrices = with_matrices(tied, quantize_matrices(tied, fmt), target.dtype, device)
        targets[f"-{fmt}{a8}w"] = LlamaModel(target.config, matrices, activations=activations)
    if args.no_fp32w and len(targets) > 1:
        del targets[""]
    if KV16 in args.providers:  # the same weights (packed once more), bf16 K/V caches
        for suffix, model in list(targets.items()):
            weights, narrow = (target.weights, torch.bfloat16) if suffix == "-bf16w" else (model.weights, None)
            targets[f"{suffix}-{KV16}"] = LlamaModel(model.config, weights, weight_dtype=narrow,
                                                     activations=model.activations, kv_cache_dtype=torch.bfloat16)
    heads, head_folders = {}, {}
    for suffix, model in targets.items():
        for kind in args.heads if "eagle" in args.providers else []:
            folder = shipped.path(kind)
            for weights in args.head_weights:
                variant = "" if weights == "auto" else "-h" + weights
                head = (EagleHead.load(folder, model, None if weights == "auto" else weights)
                        if (have_model and folder) else EagleHead.random(model, kind))
                heads[kind + variant + suffix] = (head, kind, variant, suffix)
                head_folders[kind + variant + suffix] = shown_path(folder)
        for spec in args.head_folder:
            name, sep, folder = spec.partition("=")
            if not sep or not name or "-" in name or not os.path.isdir(folder):
                parser.error(f"--head-folder: expected NAME=FOLDER (NAME without '-', FOLDER a head), got {spec!r}")
            heads[name + suffix] = (EagleHead.load(folder, model), name, "", suffix)
            head_folders[name + suffix] = shown_path(folder)

    prompts = {}
    for domain in args.domains:
        if domain == "chatlong":
            if have_model:
                prompts[domain] = chat_prompts(tokenizer, args.prompts)
            else:
                print("chatlong: SmolLM2-135M is not installed (no chat template): chatlong skipped")
            continue
        if have_model:
            from eagle_kernels.train import corpus

            prompts[domain] = corpus.held_out_prompts(tokenizer, domain, args.prompts, args.prompt_tokens)
            if not prompts[domain]:  # prose needs Debian's python3.11-doc, bible-kjv, r-cran-janeaustenr;
                # offprose /usr/share/common-licenses and /usr/share/doc/*/copyright
                print(f"no held-out {domain} documents on this machine: {domain} skipped")
                del prompts[domain]
        else:
            g = torch.Generator().manual_seed(len(domain))
            prompts[domain] = torch.randint(0, 49152, (args.prompts, args.prompt_tokens), generator=g).tolist()

    plain_decoders = {suffix: SpeculativeDecoder(model, None, sync_every=args.sync_every)
                      for suffix, model in targets.items()}
    llama, llama_files, llama_threads = None, {}, args.threads or torch.get_num_threads()
    if "llamacpp" in args.providers:
        python = llamacpp.find_python(args.llamacpp_python)
        if not have_model:
            print("llamacpp: SmolLM2-135M is not installed (its GGUF is llama.cpp's input): skipped")
        elif python is None:
            print("llamacpp: llama_cpp is not installed (pip install llama-cpp-python, or --llamacpp-python "
                  "PYTHON of an environment that has it): skipped")
        elif device.type != "cpu":
            print("llamacpp: CPU runs only: skipped")
        else:
            os.makedirs(args.gguf_dir, exist_ok=True)
            for suffix in dict.fromkeys(map(llama_suffix, targets)):
                kind = llamacpp.KINDS[suffix]
                llama_files[suffix] = smollm2.gguf_path() if kind == "gguf" else llamacpp.write_gguf(
                    smollm2.gguf_path(), os.path.join(args.gguf_dir, f"smollm2-135m-instruct-{kind}.gguf"), kind)
            shim = None if args.llamacpp_amx else llamacpp.noamx_shim(args.gguf_dir)
            llama = llamacpp.LlamaCpp(python, preload=shim)
            print(f"llamacpp: llama-cpp-python {llama.version} ({python}), {llama_threads} thread(s), "
                  + ("AMX refused (bench/llamacpp_noamx.c)" if shim else "AMX allowed"))
    rows, warmed = [], set()
    for domain in prompts:
        for temperature in args.temperatures:
            for batch in args.batches:
                runs = []

                def group(g):
                    """Prompt group ``g`` of the batch size (the warm-up: group 0)."""
                    return prompts[domain][g * batch:(g + 1) * batch]

                def ours(decoder, speculative):
                    """A run of our decoder over one prompt group: the warm-up decodes 4 tokens."""
                    return lambda g=0, warmup=False: run_ours(
                        decoder, group(g), batch, 4 if warmup else args.max_new_tokens, temperature, speculative,
                        seed_base=g * batch)

                for suffix, plain_decoder in plain_decoders.items():
                    if "ours-plain" in args.providers:
                        runs.append(("ours-plain" + suffix, ours(plain_decoder, False)))
                    if "ours-lookup" in args.providers:
                        decoder = SpeculativeDecoder(plain_decoder.target, None, TreeConfig(lookup=args.lookup_chain),
                                                     sync_every=args.sync_every)
                        runs.append((f"ours-lookup-l{args.lookup_chain}" + suffix, ours(decoder, True)))
                for suffix, path in llama_files.items() if temperature == 0 and batch == 1 else ():
                    runs.append(("llamacpp" + suffix, lambda g=0, warmup=False, path=path: llama.run(
                        path, llama_threads, group(g), 4 if warmup else args.max_new_tokens)))
                for name, lookup in (("hf-generate", False), ("hf-lookup", True)):
                    # transformers' assisted decoding (prompt lookup) runs batch 1 only.
                    if hf is not None and name in args.providers and not (lookup and batch > 1):
                        runs.append((name, lambda g=0, warmup=False, lookup=lookup: run_hf(
                            hf, group(g), batch, 4 if warmup else args.max_new_tokens, temperature, lookup,
                            tokenizer.eos_token_id or 0, seed_base=g * batch)))
                for head, kind, variant, suffix in heads.values():
                    # Default: the device's tree, and at T > 0 also its sampled-draft tree.
                    int8 = head.target.activations == "int8"
                    defaults = dict.fromkeys(default_tree(device, batch, sampling=temperature > 0, sampled_drafts=s,
                                                          int8_activations=int8)
                                             for s in sorted({False, temperature > 0}))
                    chosen = {"fixed": FittedPolicy(),
                              "adaptive-sampling": FittedPolicy(adaptive=True, adaptive_sampling=True),
                              "coupled": FittedPolicy(coupled_sampling=True),
                              "adaptive-coupled": FittedPolicy(adaptive=True, coupled_sampling=True)}
                    tags = {"fixed": "-fixed", "adaptive-sampling": "-as", "coupled": "-cs", "adaptive-coupled": "-acs"}
                    for policy in args.policies:
                        # Coupled calls draft the greedy calls' tree at every temperature.
                        coupled_trees = [default_tree(device, batch)] if "coupled" in policy else None
                        for tree in args.trees or coupled_trees or list(defaults):
                            decoder = SpeculativeDecoder(head.target, head, tree, sync_every=args.sync_every,
                                                         policy=chosen.get(policy) if device.type == "cpu" else None)
                            tag = tags.get(policy, "")
                            name = f"{kind}-{tree_name(tree)}" + tag + variant + suffix
                            runs.append((name, ours(decoder, True)))
                rounds = {name: [] for name, _ in runs}
                groups = (len(prompts[domain]) + batch - 1) // batch
                for _ in range(args.rounds):
                    # Providers take turns on each prompt group, so that a drift of the machine's
                    # speed over a round reaches every provider alike.
                    parts, peaks = {name: [] for name, _ in runs}, {name: 0.0 for name, _ in runs}
                    for g in range(groups):
                        for name, fn in runs:
                            if (name, batch) not in warmed:  # kernel compilation, allocator and caches
                                fn(warmup=True)
                                warmed.add((name, batch))
                            if device.type == "cuda":
                                torch.cuda.reset_peak_memory_stats(device)
                            parts[name].append(fn(g))
                            # llamacpp runs report their own process's peak
                            peaks[name] = max(peaks[name], parts[name][-1].get("peak_mb") or peak_memory_mb(device))
                    for name, _ in runs:
                        r = merge_runs(parts[name])
                        r["peak_mb"] = peaks[name]
                        rounds[name].append(r)
                        print(f"{domain:5s} T={temperature:g} B={batch} {name:22s} "
                              f"{r['tokens'] / r['seconds']:7.1f} tok/s"
                              + (f"  tau {r['tau']:.2f}" if r["tau"] is not None else ""), flush=True)
                results = {}
                for name, runs_of_name in rounds.items():
                    seconds = [r["seconds"] for r in runs_of_name]
                    results[name] = runs_of_name[seconds.index(statistics.median_low(seconds))]
                base = results.get("ours-plain") or next(
                    (r for name, r in results.items() if name.startswith("ours-plain")), None)
                hf_base = results.get("hf-generate")
                count = len(prompts[domain])
                for name, r in results.items():
                    tps = r["tokens"] / r["seconds"]
                    tpot = decode_ms_per_token(r, count)
                    row = {"domain": domain, "temperature": temperature, "batch": batch, "provider": name,
                           "tokens": r["tokens"], "seconds": round(r["seconds"], 3), "tok_per_s": round(tps, 2),
                           "first_token_s": round(r["first_token_seconds"], 3),
                           "decode_ms_per_token": round(tpot, 2), "rounds": args.rounds,
                           "tau": None if r["tau"] is None else round(r["tau"], 3), "peak_mb": round(r["peak_mb"], 1)}
                    if base:
                        row["vs_ours_plain"] = round(tps / (base["tokens"] / base["seconds"]), 3)
                        row["decode_vs_ours_plain"] = round(decode_ms_per_token(base, count) / tpot, 3)
                        suffix = weight_suffix(name)
                        same_base = results.get("ours-plain" + suffix) if suffix else base
                        if temperature == 0 and not name.startswith(("ours-plain", "hf-")) and same_base:
                            row["same_as_plain"] = r["sequences"] == same_base["sequences"]
                    if hf_base:
                        row["vs_hf_generate"] = round(tps / (hf_base["tokens"] / hf_base["seconds"]), 3)
                        row["decode_vs_hf_generate"] = round(decode_ms_per_token(hf_base, count) / tpot, 3)
                    rows.append(row)

    meta = {"device": str(device), "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "model": "SmolLM2-135M-Instruct"
            if have_model else "random weights (SmolLM2-135M shapes)", "max_new_tokens": args.max_new_tokens,
            "prompts_per_domain": args.prompts, "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
            "heads": head_folders}
    if llama is not None:
        meta["llamacpp"] = {"version": llama.version, "threads": llama_threads,
                            "files": {"llamacpp" + s: os.path.basename(p) for s, p in llama_files.items()}}
        llama.close()
    with open(os.path.join(args.out, "e2e.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = table_lines(meta, rows)
    with open(os.path.join(args.out, "e2e.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
