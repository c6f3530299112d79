"""Command line: ``python -m eagle_kernels generate --prompt "..."``, ``python -m eagle_kernels demo``,
``python -m eagle_kernels train --method eagle1|eagle3`` and ``python -m eagle_kernels distill``
(self-distillation data)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "q8_0": "q8_0", "q4_1": "q4_1", "gguf": "gguf"}
DEMO_PROMPTS = {
    "code": "Write a Python function that returns the n-th Fibonacci number.",
    "prose": "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
}


def _load(args):
    from . import heads
    from .decoder import SpeculativeDecoder
    from .models import smollm2
    from .models.eagle_head import EagleHead
    from .policy import FittedPolicy
    from .trees import default_tree

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    weight_dtype = WEIGHT_DTYPES[args.weights] if args.weights else dtype
    if isinstance(weight_dtype, str):  # quantized matrices: fp32 compute
        if dtype != torch.float32:
            raise ValueError(f"--weights {args.weights}: needs --dtype float32 (weight-only quantization)")
    elif weight_dtype.itemsize > dtype.itemsize:
        raise SystemExit(f"--weights {args.weights}: wider than the compute dtype --dtype {args.dtype}")
    if args.activations == "int8" and not isinstance(weight_dtype, str):
        raise SystemExit(f"--activations int8: needs quantized --weights (q8_0, q4_1 or gguf), got {args.weights}")
    kv_cache_dtype = None if args.kv_cache_dtype is None else getattr(torch, args.kv_cache_dtype)
    target, tokenizer = smollm2.load(dtype=dtype, weight_dtype=weight_dtype, activations=args.activations,
                                     kv_cache_dtype=kv_cache_dtype)
    if args.head == "none":
        head, label = None, "no head (prompt-lookup drafts only)"
    elif args.head in ("untrained-eagle1", "untrained-eagle3"):
        kind = args.head.split("-")[1]
        head, label = EagleHead.random(target, kind), f"UNTRAINED {kind} head (random weights: expect tau ~ 1)"
    elif args.head in heads.HEADS:
        folder = heads.path(args.head)
        if folder is None:
            raise SystemExit(f"no shipped {args.head} head in this installation; pass --head FOLDER or "
                             f"--head untrained-{args.head}")
        head, label = EagleHead.load(folder, target), f"shipped {args.head} head ({heads.HEADS[args.head]})"
    else:
        head, label = EagleHead.load(args.head, target), f"head from {args.head}"
    given = {"depth": args.depth, "top_k": args.tree_top_k, "num_nodes": args.num_nodes, "lookup": args.lookup,
             "lookup_ngram": args.lookup_ngram, "lookup_trim": args.lookup_trim, "lookup_alone": args.lookup_alone}
    # At T > 0 without a tree shape given: the device's sampled-draft tree (docs/decoding.md).
    coupled = getattr(args, "coupled_sampling", False) and target.device.type == "cpu"
    sampled = head is not None and getattr(args, "temperature", 0) > 0 and not coupled and (
        args.depth, args.tree_top_k, args.num_nodes) == (None, None, None)
    base = default_tree(target.device, sampled_drafts=sampled, int8_activations=target.activations == "int8")
    if args.lookup == 0 or args.lookup_trim is False:  # the default's chain flags need a (trimmed) chain
        base = dataclasses.replace(base, lookup_alone=False, lookup_trim=base.lookup_trim and args.lookup != 0)
    tree = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
    # --adaptive-sampling: a CPU call at T > 0 adapts its draft shapes too (faster, not repeatable by seed);
    # --coupled-sampling: coupled sampling, drafting the greedy tree and adapting (repeatable by seed).
    policy = None
    if coupled:
        policy = FittedPolicy(adaptive=True, coupled_sampling=True)
    elif getattr(args, "adaptive_sampling", False) and target.device.type == "cpu":
        policy = FittedPolicy(adaptive=True, adaptive_sampling=True)
    decoder = SpeculativeDecoder(target, head, tree, sync_every=args.sync_every, policy=policy)
    return decoder, tokenizer, label


def _chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)  # transformers 5 / 4


def _thread_count(text: str) -> int:
    """--threads: an int >= 0 (0: torch's default), refused by the parser otherwise (one line, status 2)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0 (0: torch's default), got {text!r}")
    return value


def _common(parser):
    parser.add_argument("--head", default="eagle3",
                        help="eagle3 / eagle1 (the shipped trained heads), a head folder, untrained-eagle1 / "
                             "untrained-eagle3 (random weights), or none (prompt-lookup drafts only: needs --lookup)")
    parser.add_argument("--depth", type=int, help="tree depth (default: the device's tree, see --num-nodes)")
    parser.add_argument("--tree-top-k", type=int, help="beams kept per depth (default: the device's tree)")
    parser.add_argument("--num-nodes", type=int,
                        help="verified tree nodes, root included (default: trees.default_tree: 3, 2, 4 and a "
                             "trimmed lookup chain of up to 8 on CPU, 6, 8, 60 on GPU)")
    parser.add_argument("--lookup", type=int,
                        help="prompt-lookup chain added to every tree, in tokens (0: off; default: the device's tree)")
    parser.add_argument("--lookup-ngram", type=int,
                        help="longest context suffix the lookup searches for (default: the device's tree)")
    parser.add_argument("--lookup-trim", action=argparse.BooleanOptionalAction, default=None,
                        help="CPU: size the lookup chain each step by the suffix match length (default: the device's "
                             "tree, on for CPU)")
    parser.add_argument("--lookup-alone", action=argparse.BooleanOptionalAction, default=None,
                        help="CPU, with --lookup-trim: after a full-length suffix match verify the lookup chain "
                             "without the head's tree (default: the device's tree, on for CPU at batch 1)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--weights", choices=list(WEIGHT_DTYPES),
                        help="storage of the weight matrices (default: --dtype); bf16 with float32 compute halves "
                             "the bytes read per token (CPU: the cpu_linear kernel widens them in registers); q8_0 / "
                             "q4_1: GGML's 8- / 4-bit blocks (fp32 activations); gguf: the model file's own blocks")
    parser.add_argument("--activations", default="fp32", choices=["fp32", "int8"],
                        help="with quantized --weights: int8 quantizes each row of activations per block of 32 and "
                             "runs integer dot products, as llama.cpp does (faster; greedy output equal to plain "
                             "decoding at the same setting); fp32 (default) keeps them to 2^-22 of a block's largest")
    parser.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the K/V caches (default: --dtype); bfloat16 / float16 with float32 compute "
                             "halve the bytes attention reads per token (llama.cpp's default cache is F16)")
    parser.add_argument("--threads", type=_thread_count, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--sync-every", type=int,
                        help="host reads of the done flags, every N steps (default: 1 on CPU, 4 on GPU)")


def cmd_generate(args) -> None:
    decoder, tokenizer, label = _load(args)
    print(f"[{label}]", file=sys.stderr)
    prompt = _chat_ids(tokenizer, args.prompt)
    printed = [0]

    def stream(tokens, lengths):
        n = int(lengths[0])
        text = tokenizer.decode(tokens[0, :n].tolist(), skip_special_tokens=True)
        sys.stdout.write(text[printed[0]:])
        sys.stdout.flush()
        printed[0] = len(text)

    result = decoder.generate([prompt], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed, eos_token_id=tokenizer.eos_token_id,
                              speculative=not args.plain, on_sync=stream,
                              allow_beyond_context=args.allow_beyond_context)
    text = tokenizer.decode(result.sequences[0], skip_special_tokens=True)
    sys.stdout.write(text[printed[0]:] + "\n")
    t = result.timings
    print(f"[{t['tokens']} tokens, {t['tokens_per_s']:.1f} tok/s, tau {result.tau[0]:.2f}]", file=sys.stderr)


def cmd_demo(args) -> None:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        tqdm = None
    decoder, tokenizer, label = _load(args)
    tree = decoder.tree
    print(f"SmolLM2-135M-Instruct, {label}, tree (depth {tree.depth}, top-k {tree.top_k}, "
          f"{tree.num_nodes} nodes, lookup chain {'up to ' if tree.lookup_trim else ''}{tree.lookup}"
          f"{', alone after a full match' if tree.lookup_trim and tree.lookup_alone else ''}), "
          f"{args.max_new_tokens} new tokens, T = 0")
    runs = [(name, mode) for name in DEMO_PROMPTS for mode in ("plain", "speculative")]
    rows, bar = [], tqdm(runs, desc="demo", unit="run") if tqdm else runs
    for name, mode in bar:
        prompt = _chat_ids(tokenizer, DEMO_PROMPTS[name])
        result = decoder.generate([prompt], args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                  speculative=mode == "speculative")
        rows.append((name, mode, result))
    print("\n| prompt | mode | tokens | tok/s | tau | same text as plain |\n|---|---|---|---|---|---|")
    plain = {name: r for name, mode, r in rows if mode == "plain"}
    for name, mode, r in rows:
        same = "yes" if r.sequences == plain[name].sequences else "NO"
        print(f"| {name} | {mode} | {r.timings['tokens']} | {r.timings['tokens_per_s']:.1f} | {r.tau[0]:.2f} | "
              f"{same} |")
    for name, mode, r in rows:
        if mode == "speculative":
            print(f"\n[{name}] {tokenizer.decode(r.sequences[0], skip_special_tokens=True)}")


def cmd_train(args) -> None:
    import dataclasses
    import os

    from .models import smollm2
    from .train import features, trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = smollm2.load()
    layers = trainer.HeadConfig.for_target(target.config, trainer.EAGLE3).feature_layers

    def build(folder, budget, held_out):
        if not os.path.exists(os.path.join(folder, features.MANIFEST)):
            print(f"feature cache {folder}: tokenising the {'held-out' if held_out else 'training'} split")
        cache_bar = _bar(budget // args.seq_len, f"features {'held-out' if held_out else 'train'}", "seq")
        cache = features.build(folder, target, tokenizer, budget, args.seq_len, layers, held_out=held_out,
                               progress=cache_bar.update if cache_bar else None)
        if cache_bar:
            cache_bar.close()
        return cache

    # The first folder is built (or extended) to --tokens; further folders must be existing caches
    # (e.g. self-distilled data from ``distill``).
    folders = args.features.split(",")
    caches = [build(folders[0], args.tokens, False)] + [features.FeatureCache(f) for f in folders[1:]]
    eval_caches = []
    if args.eval_features:
        eval_folders = args.eval_features.split(",")
        eval_caches = ([build(eval_folders[0], args.eval_tokens, True)]
                       + [features.FeatureCache(f) for f in eval_folders[1:]])
    fields = {f.name for f in dataclasses.fields(trainer.TrainConfig)}
    cfg = trainer.TrainConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
    print(f"training {cfg.method} on " + " + ".join(f"{c.done} x {c.manifest['seq_len']} tokens ({c.folder})"
                                                     for c in caches) + f": {cfg}")
    trainer.train(target, caches, cfg, args.out, eval_cache=eval_caches)
    print(f"head written to {args.out}")


def cmd_distill(args) -> None:
    from .models import smollm2
    from .train import distill, trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = smollm2.load()
    layers = trainer.HeadConfig.for_target(target.config, trainer.EAGLE3).feature_layers
    bar = _bar(args.sequences, "self-distillation", "seq")
    temperatures = tuple(float(t) for t in args.temperatures.split(","))
    cache = distill.build(args.out, target, tokenizer, args.sequences, args.seq_len, args.prompt_len, temperatures,
                          layers, batch_size=args.batch_size, seed=args.seed, held_out=args.held_out,
                          progress=bar.update if bar else None, domains=tuple(args.domains.split(",")),
                          exclude_documents=distill.cache_documents(args.exclude_caches.split(","))
                          if args.exclude_caches else ())
    if bar:
        bar.close()
    print(f"{cache.done} sequences in {args.out} ({cache.manifest['extract_seconds']:.0f} s of generation)")


def _bar(total, desc, unit):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc=desc, unit=unit, mininterval=5)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle_kernels", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate text from a prompt, streaming")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--plain", action="store_true", help="plain decoding (no speculation)")
    sampling_mode = generate.add_mutually_exclusive_group()
    sampling_mode.add_argument("--adaptive-sampling", action="store_true",
                               help="at --temperature > 0 on a CPU, let the steps' draft shapes adapt (no draft where "
                                    "none pays): faster, and the output distribution stays exact, but --seed no longer "
                                    "gives the same tokens from run to run")
    sampling_mode.add_argument("--coupled-sampling", action="store_true",
                               help="at --temperature > 0 on a CPU, sample by coupled sampling (docs/decoding.md): "
                                    "each token a function of the prompt and --seed, so the drafts, shapes and --plain "
                                    "give the same tokens; exact; drafts the greedy tree and adapts its shapes")
    generate.add_argument("--allow-beyond-context", action="store_true",
                          help="let the prompt plus --max-new-tokens run past the model's context (a warning)")
    _common(generate)
    demo = commands.add_parser("demo", help="SmolLM2-135M: plain vs speculative decoding, tok/s and tau")
    _common(demo)
    train = commands.add_parser("train", help="train an EAGLE-1 or EAGLE-3 head for SmolLM2-135M on offline text")
    train.add_argument("--method", choices=["eagle1", "eagle3"], default="eagle3")
    train.add_argument("--out", required=True, help="output folder (head checkpoint + resumable train state)")
    train.add_argument("--features", required=True,
                       help="feature-cache folder (built on first use, resumable); more existing caches after commas")
    train.add_argument("--eval-features",
                       help="held-out feature-cache folder(s), comma-separated, for acceptance estimates")
    train.add_argument("--init", help="start from this head folder (weights and draft vocabulary; fresh optimizer)")
    train.add_argument("--tokens", type=int, default=400_000, help="training tokens to cache")
    train.add_argument("--eval-tokens", type=int, default=8192)
    train.add_argument("--seq-len", type=int, default=512)
    train.add_argument("--steps", type=int)
    train.add_argument("--batch-size", type=int)
    train.add_argument("--lr", type=float)
    train.add_argument("--warmup", type=int)
    train.add_argument("--ttt-steps", type=int)
    train.add_argument("--draft-vocab-size", type=int)
    train.add_argument("--noise", type=float)
    train.add_argument("--eval-every", type=int)
    train.add_argument("--seed", type=int)
    train.add_argument("--autocast", choices=["bf16"], help="training forward in bfloat16 (fp32 weights and loss)")
    train.add_argument("--threads", type=_thread_count, default=0)
    distill = commands.add_parser("distill", help="self-distillation data: the target continues corpus prompts and "
                                                  "its features are cached while it generates")
    distill.add_argument("--out", required=True, help="feature-cache folder (resumable)")
    distill.add_argument("--sequences", type=int, default=256)
    distill.add_argument("--seq-len", type=int, default=256)
    distill.add_argument("--prompt-len", type=int, default=64)
    distill.add_argument("--temperatures", default="0,0,0.7", help="comma-separated; batch j uses entry j mod count")
    distill.add_argument("--batch-size", type=int, default=32)
    distill.add_argument("--seed", type=int, default=0)
    distill.add_argument("--domains", default="code,prose", help="prompt domains, comma-separated (code, prose)")
    distill.add_argument("--held-out", action="store_true", help="prompts from the held-out split (evaluation)")
    distill.add_argument("--exclude-caches", default="",
                         help="chat: comma-separated earlier caches whose instructions this one skips")
    distill.add_argument("--threads", type=_thread_count, default=0)
    args = parser.parse_args(argv)
    command = {"generate": cmd_generate, "demo": cmd_demo, "train": cmd_train, "distill": cmd_distill}[args.command]
    try:
        command(args)
    except (ValueError, TypeError, OSError) as error:
        # Bad input (arguments, files, a head that does not fit): one line and exit status 2, as
        # argparse does for bad flags, instead of a traceback.
        message = " ".join(str(error).split()) or type(error).__name__
        parser.exit(2, f"{parser.prog} {args.command}: error: {message}\n")


if __name__ == "__main__":
    main()
