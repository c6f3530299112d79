"""cpu_linear: the few-row linear layers of SmolLM2-135M on CPU, eagle vs torch's F.linear.

Providers:
- ``torch``: ``torch.nn.functional.linear`` with fp32 weights (what the model ran before);
- ``eagle``: ``eagle_kernels.cpu_linear`` with the same fp32 weights;
- ``eagle-bf16``: ``eagle_kernels.cpu_linear`` with the weights in bf16 (half the bytes; fp32
  compute and accumulation);
- ``packed``, ``packed-bf16``: the same with the weights packed by ``eagle_kernels.cpu_linear_pack``
  (K-major groups of 32 columns, the layout the model reads on CPU);
- ``packed-q8_0``, ``packed-q4_1``: weight-only quantized (GGML Q8_0 / Q4_1 blocks of the fp32 weights, 8.5 /
  5 bits per weight), packed; fp32 activations and accumulation.

Shapes: SmolLM2-135M's (N, K) as the model runs them: (960, 576) fused q/k/v, (576, 576) o,
(3072, 576) fused gate/up, (576, 1536) down, (49152, 576) the tied LM head; M in {1 (decoding),
4, 16 (a verify tree), 64} rows of x.

Every call reads its weights from DRAM, as in a forward pass over the whole model: each
provider cycles through its own copies of the weight matrix, at least 96 MiB of them (three
times the L3 here), so no copy is still cached when its turn comes again.

``extra_info``: ``weight_bytes`` (N * K * element size: what one call must stream) and
``weight_bytes_per_s``, ``flops`` (2 M N K) and ``flops_per_s``; the eagle entries also get
``ratio_<provider>_over_torch`` (mean time / torch's mean time for the same shape) once torch
ran for it.

Run: ``PYTHONPATH=. python -m pytest bench/bench_cpu_linear.py --benchmark-only -q``
(``EAGLE_BENCH_THREADS=1`` pins the thread count), or ``python bench/bench_cpu_linear.py``
for the compact side-by-side table at 1 and 2 threads (providers interleaved call by call, so
machine noise hits all of them alike; median per provider). ``python bench/bench_cpu_linear.py
--forward`` times the linear layers of one whole forward pass instead (30 layers + LM head,
every weight from DRAM) at 1, 4, 8 and 12 rows, 1 and 2 threads, for torch, cpu_linear with
row-major fp32 weights (the best ISA path, the AVX-512 path without paired tiles, capped at AVX2,
and ``EAGLE_KERNELS_CPU_LINEAR_CHUNK=8388608``: only the LM head splits over threads), row-major bf16
weights, packed fp32 (best path, AVX2) and bf16 weights (pairs of k, and ``bf16-kmajor``: the K-major
layout the pairs replaced), and packed Q8_0 / Q4_1 (best path, AVX2).
``python bench/bench_cpu_linear.py --step [fp32,bf16,q8_0,q4_1,gguf] [ROUNDS]`` splits one plain decoding
step of the real SmolLM2-135M (one token after a 96-token prompt, 1 thread) into the decoder layers' linear
layers, the LM head and the rest (norms, attention, RoPE, K/V writes, Python), per weight storage,
interleaved, in the thread's CPU time (``time.thread_time``): on cores shared with other busy processes
wall clocks swing by 20% and more, CPU time by a few percent.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import eagle_kernels
from eagle_kernels.reference.cpu_linear import quantize

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # (N, K)
FORWARD_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
ROWS = [1, 4, 16, 64]
PROVIDERS = ("torch", "eagle", "eagle-bf16", "packed", "packed-bf16", "packed-q8_0", "packed-q4_1")
BITS = {"q8_0": 8.5, "q4_1": 5.0, "bf16": 16}  # bits per weight streamed (fp32: 32)
FOOTPRINT_BYTES = 96 * 2**20
_MEANS: dict = {}


@functools.lru_cache(maxsize=1)
def weight_copies(N, K):
    """fp32 copies (torch and eagle walk them from opposite ends of the cycle), bf16 copies, and
    the packed forms of both, each set at least FOOTPRINT_BYTES."""
    count = max(2, math.ceil(FOOTPRINT_BYTES / (N * K * 4)))
    gen = torch.Generator().manual_seed(N + K)
    fp32 = [torch.randn(N, K, generator=gen) for _ in range(count)]
    count16 = max(2, math.ceil(FOOTPRINT_BYTES / (N * K * 2)))
    bf16 = [fp32[i % count].bfloat16() if i < count else torch.randn(N, K, generator=gen).bfloat16()
            for i in range(count16)]
    quant = {fmt: [eagle_kernels.cpu_linear_pack(quantize(w, fmt)) for w in fp32] for fmt in ("q8_0", "q4_1")}
    return {"fp32": fp32, "bf16": bf16, "packed": [eagle_kernels.cpu_linear_pack(w) for w in fp32],
            "packed-bf16": [eagle_kernels.cpu_linear_pack(w) for w in bf16], "packed-q8_0": quant["q8_0"],
            "packed-q4_1": quant["q4_1"]}


def provider_call(provider, x, N, K):
    """A no-argument callable that runs ``provider`` on the next weight copy of its cycle."""
    copies = weight_copies(N, K)
    fn = F.linear if provider == "torch" else eagle_kernels.cpu_linear
    copies = copies[{"torch": "fp32", "eagle": "fp32", "eagle-bf16": "bf16"}.get(provider, provider)]
    state = {"i": len(copies) // 2 if provider == "eagle" else 0}

    def call():
        i = state["i"]
        state["i"] = (i + 1) % len(copies)
        return fn(x, copies[i])

    return call


def work(provider, M, N, K):
    bits = next((b for name, b in BITS.items() if provider.endswith(name)), 32)
    return int(N * K * bits / 8), 2 * M * N * K


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("M", ROWS, ids=[f"M{m}" for m in ROWS])
@pytest.mark.parametrize("N,K", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
def test_cpu_linear(benchmark, provider, N, K, M):
    benchmark.group = f"cpu_linear[N{N}-K{K}-M{M}]"
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    call = provider_call(provider, x, N, K)
    call()
    start = time.perf_counter()
    call()
    once = time.perf_counter() - start
    budget = float(os.environ.get("EAGLE_BENCH_TIME_S", "0.25"))
    benchmark.pedantic(call, rounds=max(5, min(500, math.ceil(budget / max(once, 1e-7)))), warmup_rounds=1)
    if benchmark.stats is None:  # --benchmark-disable
        return
    mean = benchmark.stats.stats.mean
    weight_bytes, flops = work(provider, M, N, K)
    backend = eagle_kernels.backend_of("cpu_linear", "cpu") if provider != "torch" else "torch"
    benchmark.extra_info.update(provider=provider, backend=backend, threads=torch.get_num_threads(),
                                weight_bytes=weight_bytes, weight_bytes_per_s=weight_bytes / mean, flops=flops,
                                flops_per_s=flops / mean)
    results = _MEANS.setdefault((N, K, M, torch.get_num_threads()), {})
    results[provider] = mean
    if "torch" in results:
        for other, t in results.items():
            if other != "torch" and (other == provider or provider == "torch"):
                benchmark.extra_info[f"ratio_{other}_over_torch"] = t / results["torch"]


# ------------------------------------------------------------------ side-by-side table (main)
def interleaved(calls, budget=0.6, min_rounds=5, max_rounds=400):
    """Median seconds per call of each callable, measured round-robin."""
    for call in calls:
        call()
    times = [[] for _ in calls]
    deadline = time.perf_counter() + budget
    while len(times[0]) < min_rounds or (time.perf_counter() < deadline and len(times[0]) < max_rounds):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - start)
    return [sorted(t)[len(t) // 2] for t in times]


def main(argv):
    threads_list = [int(a) for a in argv if a.isdigit()] or [1, 2]
    others = PROVIDERS[1:]
    print("per call, median of interleaved calls; x torch = torch's time / the provider's; GB/s of weights read")
    print(f"{'N x K':<13} {'M':>3} {'thr':>3} | {'torch':>9} " + " ".join(f"{p:>11}" for p in others) + " | "
          + " ".join(f"{'x torch':>11}" for _ in others) + " | " + " ".join(f"{'GB/s':>11}" for _ in others))
    for threads in threads_list:
        torch.set_num_threads(threads)
        for N, K in SHAPES:
            for M in ROWS:
                x = torch.randn(M, K)
                times = dict(zip(PROVIDERS, interleaved([provider_call(p, x, N, K) for p in PROVIDERS])))
                print(f"{N:>5} x {K:<5} {M:>3} {threads:>3} | {times['torch'] * 1e6:7.0f}us "
                      + " ".join(f"{times[p] * 1e6:9.0f}us" for p in others) + " | "
                      + " ".join(f"{times['torch'] / times[p]:10.2f}x" for p in others) + " | "
                      + " ".join(f"{work(p, M, N, K)[0] / times[p] / 1e9:11.1f}" for p in others), flush=True)
        weight_copies.cache_clear()


def in_features(w):
    """K of a cpu_linear weight: row-major [N, K], packed [N / 32, 2, K, 16], bf16 pairs [N / 32, 2, K / 2, 16, 2]
    or quantized [N / 32, 2, K / 32, ...]."""
    if w.dim() == 2:
        return w.shape[1]
    if w.dtype in (torch.int8, torch.uint8):
        return w.shape[2] * 32
    return w.shape[2] * 2 if w.dim() == 5 else w.shape[2]


def pack_k_major(w):
    """[N / 32, 2, K, 16] for any dtype: the layout cpu_linear_pack gives bf16 only with K odd (else pairs)."""
    N, K = w.shape
    return w.reshape(N // 32, 2, 16, K).transpose(2, 3).contiguous()


def forward_table(threads_list, rounds=7):
    """Linear layers of one SmolLM2-135M forward, per provider: median over interleaved rounds."""
    gen = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(N, K, generator=gen) for N, K in FORWARD_SHAPES]  # 540 MB: all from DRAM
    bf16 = [w.bfloat16() for w in fp32]
    packed = [eagle_kernels.cpu_linear_pack(w) for w in fp32]
    packed16 = [eagle_kernels.cpu_linear_pack(w) for w in bf16]
    packed16_k = [pack_k_major(w) for w in bf16]
    q8 = [eagle_kernels.cpu_linear_pack(quantize(w, "q8_0")) for w in fp32]
    q41 = [eagle_kernels.cpu_linear_pack(quantize(w, "q4_1")) for w in fp32]
    chunk_env, isa_env = "EAGLE_KERNELS_CPU_LINEAR_CHUNK", "EAGLE_KERNELS_CPU_ISA"

    def one_pass(fn, weights, **env):
        def run(xs):
            os.environ.update(env)
            try:
                for w in weights:
                    fn(xs[in_features(w)], w)
            finally:
                for name in env:
                    os.environ.pop(name, None)
        return run

    providers = {"torch": one_pass(F.linear, fp32), "eagle": one_pass(eagle_kernels.cpu_linear, fp32),
                 "eagle-ymm": one_pass(eagle_kernels.cpu_linear, fp32, **{isa_env: "avx512-ymm"}),
                 "eagle-avx2": one_pass(eagle_kernels.cpu_linear, fp32, **{isa_env: "avx2"}),
                 "eagle-coarse": one_pass(eagle_kernels.cpu_linear, fp32, **{chunk_env: "8388608"}),
                 "eagle-bf16": one_pass(eagle_kernels.cpu_linear, bf16),
                 "packed": one_pass(eagle_kernels.cpu_linear, packed),
                 "packed-avx2": one_pass(eagle_kernels.cpu_linear, packed, **{isa_env: "avx2"}),
                 "packed-bf16": one_pass(eagle_kernels.cpu_linear, packed16),
                 "bf16-kmajor": one_pass(eagle_kernels.cpu_linear, packed16_k),
                 "packed-q8_0": one_pass(eagle_kernels.cpu_linear, q8),
                 "q8_0-avx2": one_pass(eagle_kernels.cpu_linear, q8, **{isa_env: "avx2"}),
                 "packed-q4_1": one_pass(eagle_kernels.cpu_linear, q41),
                 "q4_1-avx2": one_pass(eagle_kernels.cpu_linear, q41, **{isa_env: "avx2"})}
    total_bytes = sum(w.numel() * 4 for w in fp32)
    print(f"one forward's linear layers ({total_bytes / 1e6:.0f} MB of fp32 weights), ms, median of {rounds} "
          f"interleaved rounds; eagle* = row-major weights, packed* = cpu_linear_pack'ed; eagle-coarse = "
          f"{chunk_env}=8388608; eagle-ymm = {isa_env}=avx512-ymm (8-lane tiles only), *-avx2 = {isa_env}=avx2 "
          f"(the best path otherwise: AVX-512 where the CPU has it)")
    print(f"{'thr':>3} {'M':>3} | " + " ".join(f"{name:>12}" for name in providers) + " | eagle GB/s packed GB/s")
    for threads in threads_list:
        torch.set_num_threads(threads)
        for M in (1, 4, 8, 12):
            xs = {K: torch.randn(M, K) for K in (576, 1536)}
            times = {name: [] for name in providers}
            for _ in range(rounds):
                for name, run in providers.items():
                    start = time.perf_counter()
                    run(xs)
                    times[name].append(time.perf_counter() - start)
            med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
            print(f"{threads:>3} {M:>3} | " + " ".join(f"{med[n] * 1e3:12.1f}" for n in providers)
                  + f" | {total_bytes / med['eagle'] / 1e9:10.1f} {total_bytes / med['packed'] / 1e9:11.1f}",
                  flush=True)


def step_table(kinds, rounds):
    """CPU time of one plain decoding step per weight storage, split as the module docstring says."""
    from eagle_kernels.models import smollm2

    torch.set_num_threads(1)
    storage = {"fp32": None, "bf16": torch.bfloat16}
    models = {w: smollm2.load(weight_dtype=storage.get(w, w))[0] for w in kinds}
    state = {}
    for w, m in models.items():
        cache = m.new_cache(1, 256)
        with torch.inference_mode():
            m(torch.arange(100, 196)[None], cache)
        cache.seqlens += 96
        layers = [m.packed(t) for layer in range(m.config.num_layers) for t in m.layer_weights(layer).matrices]
        state[w] = (m, cache, layers, m.packed(m.weights["lm_head.weight"]))
    xs = {576: torch.randn(1, 576), 1536: torch.randn(1, 1536)}
    token = torch.tensor([[5]])

    def step(w):
        m, cache = state[w][:2]
        with torch.inference_mode():
            m(token, cache)  # the same position every time: the cache's length is not advanced

    def layers(w):
        for t in state[w][2]:
            eagle_kernels.cpu_linear(xs[in_features(t)], t)

    def head(w):
        eagle_kernels.cpu_linear(xs[576], state[w][3])

    parts = {"step": step, "layers": layers, "head": head}
    times = {(w, p): [] for w in kinds for p in parts}
    for _ in range(rounds + 1):  # the first round warms up
        for w in kinds:
            for p, fn in parts.items():
                start = time.thread_time()
                fn(w)
                times[(w, p)].append(time.thread_time() - start)
    med = {k: sorted(v[1:])[len(v[1:]) // 2] * 1e3 for k, v in times.items()}
    print(f"one plain decoding step, ms of CPU time (1 thread), median of {rounds} interleaved rounds")
    print(f"{'weights':8} {'step':>7} {'layers':>7} {'LM head':>7} {'rest':>7} | {'MB read':>7} {'GB/s':>5}")
    for w in kinds:
        nbytes = sum(t.numel() * t.element_size() for t in state[w][2] + [state[w][3]])
        step_ms, layers_ms, head_ms = med[(w, "step")], med[(w, "layers")], med[(w, "head")]
        print(f"{w:8} {step_ms:7.2f} {layers_ms:7.2f} {head_ms:7.2f} {step_ms - layers_ms - head_ms:7.2f} | "
              f"{nbytes / 1e6:7.1f} {nbytes / (layers_ms + head_ms) / 1e6:5.1f}", flush=True)


if __name__ == "__main__":
    if "--step" in sys.argv[1:]:
        rest = [a for a in sys.argv[1:] if a != "--step"]
        step_table(next((a.split(",") for a in rest if not a.isdigit()), ["fp32", "bf16", "q8_0", "q4_1", "gguf"]),
                   next((int(a) for a in rest if a.isdigit()), 30))
    elif "--forward" in sys.argv[1:]:
        forward_table([int(a) for a in sys.argv[1:] if a.isdigit()] or [1, 2])
    else:
        main(sys.argv[1:])
