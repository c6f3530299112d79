"""draft_expand: one depth of EAGLE-2 expansion, eagle_kernels against the plain torch sequence.

Providers (the names bench/conftest.py pairs in its ratio table):
- ``eagle``: ``eagle_kernels.draft_expand``, backend ``backend_of("draft_expand", device)`` in
  ``extra_info["backend"]`` (cpp on CPU; triton on CUDA unless a CUDA kernel exists);
- ``reference``: here NOT ``eagle_kernels.reference.draft_expand`` (a full sort and a Python
  loop per request) but the stronger baseline an engine would write by hand:
  ``log_softmax`` (fp32) -> ``topk`` -> add the frontier scores -> ``topk`` of the candidates.
  Its tie order among equal scores is torch's, otherwise it computes the same outputs.

Modes: ``greedy`` (the deterministic top-k of every row) and ``sampled`` (every request at T = 1:
top_k children drawn without replacement by Gumbel-top-k, docs/ops.md §2); the ``reference``
of a sampled case is the torch sequence with Gumbel noise from ``torch.rand`` (same law, not the
same stream): ``log_softmax(logits / T)`` -> keys ``logp - log(-log U)`` -> ``topk`` -> gather.

Shapes: CPU ``B in {1, 4}``, ``M = 8``, ``V = 49152``, ``top_k = 8``, fp32 and bf16 logits;
CUDA (only with a device) ``B in {1, 8, 32}``, ``M = 8``, ``V in {32000, 128256}``,
``top_k in {8, 10}``, bf16 logits. Throughput: logits bytes read per second
(``B * M * V * element size`` / mean time). CUDA timings synchronise after every call.
Set ``EAGLE_BENCH_THREADS=1`` or ``2`` to compare thread counts.

Without a GPU, ``python bench/bench_draft_expand.py --sass`` compiles the Triton kernels for
sm_90 as the launcher would launch them (its constexprs, warps and the JIT's specialisation of
the argument tensors), reads the SASS and counts the instructions one thread executes along the
path of a full chunk of ordinary logits (no masked loads, no fallback rounds; a loop counts
``TOP_K`` times) and, for the program that also merges a request, the merge's, then models the
launch's issue time on an H200 (132 SMs, 4 warp instructions per cycle per SM, 1.98 GHz: the
chunk programs, then the last request's merge alone) beside one read of the logits at 4.3 TB/s.
Needs ``TRITON_INTERPRET`` unset.
"""

import argparse
import collections
import math
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

import eagle_kernels

HAS_CUDA = torch.cuda.is_available()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def torch_sequence(logits, frontier_scores, top_k):
    """The hand-written torch baseline: (tokens [B, M*k], scores [B, M*k], frontier [B, k])."""
    B = logits.shape[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(top_k, dim=-1)
    scores = (frontier_scores[..., None] + values).reshape(B, -1)
    frontier = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    return ids.reshape(B, -1), scores, frontier


def torch_sampled_sequence(logits, frontier_scores, top_k, *, temperature, seed=None, offset=None, depth=0):
    """The hand-written torch baseline of sampled children (Gumbel-top-k with torch.rand)."""
    B = logits.shape[0]
    logp = torch.log_softmax(logits.float() / temperature[:, None, None], dim=-1)
    keys = logp - torch.log(-torch.log(torch.rand_like(logp)))
    ids = keys.topk(top_k, dim=-1).indices
    values = logp.gather(-1, ids)
    scores = (frontier_scores[..., None] + values).reshape(B, -1)
    frontier = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    return ids.reshape(B, -1), scores, frontier


def make_inputs(B, M, V, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, M, V, generator=gen) * 3).to(dtype).to(device)
    frontier_scores = (-3 * torch.rand(B, M, generator=gen)).to(device)
    return logits, frontier_scores


def provider_fn(provider, device):
    if provider == "eagle":
        return eagle_kernels.draft_expand, eagle_kernels.backend_of("draft_expand", device)
    return torch_sequence, "torch"


def run_case(measure, provider, B, M, V, top_k, dtype, device, mode="greedy"):
    fn, backend = provider_fn(provider, device)
    logits, fs = make_inputs(B, M, V, dtype, device)
    if mode == "sampled":
        sampling = dict(temperature=torch.ones(B, device=device), seed=torch.arange(B, device=device),
                        offset=torch.zeros(B, dtype=torch.int64, device=device), depth=0)
        if provider != "eagle":
            fn = torch_sampled_sequence

        def sampled(logits, fs, top_k):
            return fn(logits, fs, top_k, **sampling)

        nbytes = logits.numel() * logits.element_size()
        measure(sampled, logits, fs, top_k, work=nbytes, unit="logits_bytes",
                info={"backend": backend, "B": B, "M": M, "V": V, "top_k": top_k, "mode": mode,
                      "dtype": str(dtype).removeprefix("torch.")})
        return
    if provider == "eagle":  # the comparison is only meaningful if both agree
        want = torch_sequence(logits, fs, top_k)
        got = fn(logits, fs, top_k)
        torch.testing.assert_close(got.scores, want[1], atol=1e-4, rtol=1e-5)
    call = fn
    if device == "cuda":
        def call(*args):
            out = fn(*args)
            torch.cuda.synchronize()
            return out
    nbytes = logits.numel() * logits.element_size()
    measure(call, logits, fs, top_k, work=nbytes, unit="logits_bytes",
            info={"backend": backend, "B": B, "M": M, "V": V, "top_k": top_k,
                  "dtype": str(dtype).removeprefix("torch.")})


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("B", [1, 4], ids=lambda b: f"B{b}")
def test_draft_expand_cpu(measure, provider, B, dtype, mode):
    run_case(measure, provider, B, 8, 49152, 8, dtype, "cpu", mode)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("top_k", [8, 10], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("V", [32000, 128256], ids=lambda v: f"V{v}")
@pytest.mark.parametrize("B", [1, 8, 32], ids=lambda b: f"B{b}")
def test_draft_expand_cuda(measure, provider, B, V, top_k):
    run_case(measure, provider, B, 8, V, top_k, torch.bfloat16, "cuda")


# --------------------------------------------------------------------- SASS count (no GPU)
H200 = dict(sms=132, issue_per_cycle=4, clock_hz=1.98e9, read_Bps=4.3e12)
_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[.A-Z0-9_]*\s*([^;]*);")


def _sass_paths(sass: str, trips: int, outer_once: bool):
    """(op counts, loops, predicated LDGs) of every path from the entry to an EXIT (a
    predicated one both ends a path and falls through): forward conditional branches both ways,
    a backward branch closes a loop whose body then runs ``trips`` times in all; with
    ``outer_once`` the outermost loop runs once (a loop over blocks of rows: one block at the
    shapes reported)."""
    instrs = [(int(m[1], 16), m[2] is not None, m[3], m[4]) for m in map(_INSTR.match, sass.splitlines()) if m]
    index = {addr: i for i, (addr, *_rest) in enumerate(instrs)}
    # BRA [Pn,] target: a predicate operand makes the branch conditional like a guard does.
    targets = [(index.get(int(a.split()[-1], 16), i), i) for i, (_, _, o, a) in enumerate(instrs) if o == "BRA"]
    outermost = min((t for t, i in targets if t < i), default=None) if outer_once else None
    found = []

    def walk(i, counts, loops, masked, depth):
        if len(found) >= 4096:  # fp64's branchy slow paths would multiply paths without end
            return
        counts = collections.Counter(counts)
        while i < len(instrs):
            _addr, pred, op, args = instrs[i]
            counts[op] += 1
            masked += op == "LDG" and pred
            if op == "EXIT":  # a predicated EXIT ends the paths of the threads it holds
                found.append((collections.Counter(counts), loops, masked))
                if not pred:
                    return
            if op == "BRA":
                target = index.get(int(args.split()[-1], 16))
                pred = pred or "," in args
                if target is None or target == i:
                    return
                if target < i:
                    for *_rest, body_op, _args in instrs[target:i + 1]:
                        counts[body_op] += 0 if target == outermost else trips - 1
                    loops += 1
                elif not pred:
                    i = target
                    continue
                elif depth < 24:
                    walk(target, counts, loops, masked, depth + 1)
            i += 1

    walk(0, {}, 0, 0, 0)
    return found


def sass_report(B=8, M=8, V=128256, top_k=8, dtype=torch.bfloat16, arch=90, sampled=False) -> list[dict]:
    """One dict per kernel launch of ``draft_expand`` at this shape, compiled for ``sm_arch``.
    ``sampled``: every request at temperature 1 (the sampled specialisation; the chunk's path
    counted, the longest path without fallback rounds, is then the Gumbel keys')."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compile_audit

    from eagle_kernels.triton import draft_expand as triton_draft_expand

    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs, grid))

    original, JITFunction.run = JITFunction.run, record
    try:
        sampling = dict(temperature=torch.ones(B), seed=torch.zeros(B, dtype=torch.int64),
                        offset=torch.zeros(B, dtype=torch.int64), depth=1) if sampled else {}
        triton_draft_expand._launch(torch.randn(B, M, V).to(dtype), torch.zeros(B, M), top_k, None,
                                    triton_draft_expand.GPU_CONFIG, **sampling)
    finally:
        JITFunction.run = original
    target = GPUTarget("cuda", arch, 32)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    rows = []
    for kernel, args, kwargs, grid in launches:
        compiled, log, _ = compile_audit.compile_specialised(
            compile_audit.Launch(kernel, args, kwargs, tuple(grid), "draft_expand"), target)
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                   check=True).stdout
        res = {k: int(v) for k, v in re.findall(r"(REG):(\d+)", usage)}
        _, spill_stores, spill_loads = compile_audit.ptxas_spills(log)
        # One kernel: every program computes its chunk; the last one of a request (its second
        # ATOMG: the ticket reset) also merges the request. Chunk path: fewest loops and fewest
        # barriers (no fallback rounds: triton 3.6 unrolls them, so they are no loop there), fewest
        # masked loads (the rank step's gathers are predicated in both versions; the last chunk's
        # loads add to them), longest. Merging path: the same from the paths through the merge
        # (deterministic: the threshold merge, no rounds; sampled: every loop entered).
        paths = _sass_paths(sass, kwargs["TOP_K"], outer_once=False)
        chunk_paths = [p for p in paths if p[0]["ATOMG"] < 2]
        merge_paths = [p for p in paths if p[0]["ATOMG"] >= 2]
        counts, loops, _ = min(chunk_paths, key=lambda p: (p[1], p[0]["BAR"], p[2], -sum(p[0].values())))
        if sampled:
            merging, _, _ = max(merge_paths, key=lambda p: (p[1], -p[2], sum(p[0].values())))
        else:
            merging, _, _ = min(merge_paths, key=lambda p: (p[1], p[0]["BAR"], p[2], -sum(p[0].values())))
        warps, programs = kwargs["num_warps"], math.prod(grid)
        per_thread = sum(counts.values())
        merge_extra = sum(merging.values()) - per_thread
        row = dict(kernel=kernel.fn.__name__, grid=grid, warps=warps, registers=res["REG"],
                   spill_stores=spill_stores, spill_loads=spill_loads,
                   instr_per_thread=per_thread, barriers=counts["BAR"], shuffles=counts["SHFL"], loops=loops,
                   warp_instr_per_program=per_thread * warps,
                   merge_instr_per_thread=merge_extra, merge_barriers=merging["BAR"] - counts["BAR"])
        block_v = kwargs["BLOCK_V"]
        row.update(block_v=block_v, thread_instr_per_entry=per_thread * warps * 32 / block_v)
        issue_s = programs * per_thread * warps / (H200["sms"] * H200["issue_per_cycle"] * H200["clock_hz"])
        # The last request's merge runs after every chunk: its warps alone on an SM, one
        # instruction per warp per cycle on each of the 4 schedulers at best.
        merge_s = merge_extra * warps / (H200["issue_per_cycle"] * H200["clock_hz"])
        read_s = B * M * V * torch.finfo(dtype).bits / 8 / H200["read_Bps"]
        row.update(modeled_issue_us=issue_s * 1e6, modeled_merge_issue_us=merge_s * 1e6, one_read_us=read_s * 1e6,
                   issue_over_read=issue_s / read_s, op_over_read=(issue_s + merge_s) / read_s)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sass", action="store_true", help="count the compiled kernels' instructions (no GPU)")
    parser.add_argument("--shape", type=int, nargs=4, default=[8, 8, 128256, 8], metavar=("B", "M", "V", "TOP_K"))
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--sampled", action="store_true", help="sampled children (temperature 1) for every request")
    args = parser.parse_args()
    if not args.sass:
        parser.error("run the benchmarks with pytest (see bench/README.md); --sass for the instruction count")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    for row in sass_report(*args.shape, dtype=dtype, sampled=args.sampled):
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})


if __name__ == "__main__":
    main()
