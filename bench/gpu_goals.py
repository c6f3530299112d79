"""The GPU goals of the kernel issues, measured side by side in one run: ``python bench/gpu_goals.py [--out DIR]``.

Each goal compares a kernel's device time with a figure of the same device measured in the same
process, so nothing rests on a data-sheet number:

- device: ``copy`` (``dst.copy_(src)`` of 1 GiB, bytes read + written per second), ``read``
  (``x.sum()`` over 1 GiB, bytes read per second) and a bf16 GEMM (8192 cubed) in FLOP/s;
- tree_attention (Llama-3-8B heads 32 / 8 / 128, N 64, bf16, 16-token pages, prefix 1k / 4k /
  16k, B 1 / 8 / 32): KV bytes per second of the kernel as a share of the copy bandwidth (goal
  >= 80% at prefix >= 4k), the share its FLOPs would allow at the GEMM rate, and its speed over
  SDPA with the equivalent boolean mask (goal >= 3x);
- draft_expand (B 1 / 8 / 32, M 8, V 32000 / 128256, top_k 8 / 10, bf16): time over one read
  of the logits at the read bandwidth (goal <= 1.5x), and over the plain torch sequence; beside
  it, the launch's issue time modeled from its SASS (``bench_draft_expand.py --sass``: the
  chunk programs, then the last request's merge);
- verify (B 1 / 8 / 32, N 64, V 128256, bf16; greedy, T = 0.8, T = 0.8 with top-k 50 and
  top-p 0.9, top-p 0.9 alone): time less one launch over one read of the rows the walk visits
  (goal <= 1.5x greedy, <= 3x sampling).

Kernel times are CUDA-graph replays (``triton.testing.do_bench_cudagraph``): the device time of
the launches without Python's launch overhead, which a decoding loop captured in a graph does
not pay either; ``eager`` is ``triton.testing.do_bench`` of the plain call for comparison. The
SDPA baseline and the torch sequence are timed eagerly (the SDPA path reads the prefix length
on the host). Inputs of a few MB stay in the 50 MB L2 between replays, so the small-batch rows
are launch-latency figures more than memory figures. ``--smoke`` runs every case at toy shapes
with wall-clock timing on the CPU (a check of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_draft_expand  # noqa: E402
import bench_tree_attention  # noqa: E402
import bench_verify  # noqa: E402

import eagle_kernels  # noqa: E402

GIB = 1 << 30


class Timer:
    """Seconds per call: device time of graph replays (``graph``) and eager calls (``eager``)
    on CUDA; wall clock on the CPU (``--smoke``)."""

    def __init__(self, device: str):
        self.device = device

    def eager(self, fn) -> float:
        if self.device == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e-3
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def graph(self, fn) -> float:
        if self.device == "cuda":
            import triton.testing

            fn()  # compile outside the capture
            torch.cuda.synchronize()
            return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e-3
        return self.eager(fn)


def device_limits(timer: Timer, nbytes: int, gemm_size: int) -> dict:
    """Copy and read bandwidth over ``nbytes``, and bf16 GEMM throughput (square, ``gemm_size``)."""
    device = timer.device
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_s = timer.eager(lambda: dst.copy_(src))
    read_s = timer.eager(lambda: src.sum())
    src = dst = None
    a = torch.randn(gemm_size, gemm_size, device=device).to(torch.bfloat16)
    b = torch.randn(gemm_size, gemm_size, device=device).to(torch.bfloat16)
    gemm_s = timer.eager(lambda: a @ b)
    return {"copy_GBps": 2 * nbytes / copy_s / 1e9, "read_GBps": nbytes / read_s / 1e9,
            "gemm_TFLOPs": 2 * gemm_size ** 3 / gemm_s / 1e12}


def tree_attention_rows(timer: Timer, limits: dict, shapes, heads) -> Iterator[dict]:
    for B, N, prefix in shapes:
        q, k, v, seqlens, mask, table = bench_tree_attention.make_case(B, N, prefix, heads, torch.bfloat16, 16,
                                                                       timer.device)
        ours = lambda: eagle_kernels.tree_attention(q, k, v, seqlens, mask, block_table=table)  # noqa: E731
        sdpa = lambda: bench_tree_attention.sdpa_tree_attention(q, k, v, seqlens, mask, block_table=table)  # noqa: E731
        t_graph, t_eager, t_sdpa = timer.graph(ours), timer.eager(ours), timer.eager(sdpa)
        nbytes = bench_tree_attention.kv_bytes(B, N, prefix, heads, torch.bfloat16)
        gbps = nbytes / t_graph / 1e9
        # q.k and p.v for every (node, query head) row over prefix + tree keys: with N = 64 and
        # 4 query heads per KV head that is 256 FLOPs per KV byte, above the H200's ratio of
        # tensor throughput to memory bandwidth, so the GEMM rate bounds the share of copy.
        flops = 4 * B * heads[0] * N * (prefix + N) * heads[2]
        bound_s = max(nbytes / (limits["copy_GBps"] * 1e9), flops / (limits["gemm_TFLOPs"] * 1e12))
        q = k = v = None
        bench_tree_attention.make_case.cache_clear()
        yield dict(op="tree_attention", shape=f"B{B}-N{N}-prefix{prefix}", graph_us=t_graph * 1e6,
                   eager_us=t_eager * 1e6, baseline_us=t_sdpa * 1e6, speedup_over_baseline=t_sdpa / t_graph,
                   kv_GBps=gbps, share_of_copy=gbps / limits["copy_GBps"], TFLOPs=flops / t_graph / 1e12,
                   share_bound=nbytes / bound_s / 1e9 / limits["copy_GBps"],
                   goal=("share >= 0.80, " if prefix >= 4096 else "") + "speedup >= 3")


# Tree-attention launch configurations the sweep times against the launcher's own choice:
# (BLOCK_M, BLOCK_K, num_warps, num_stages, maxnreg). The first is the launcher's choice at the
# goal shape (128-row blocks, two per KV head); the others trade tile size, stages, register cap
# and rows (every row of a KV head in one 256-row block: the previous choice, first of them).
SWEEP_CONFIGS = [(128, 64, 8, 3, None), (256, 32, 16, 2, 128), (256, 64, 16, 2, 128), (256, 32, 16, 3, 128),
                 (256, 64, 8, 2, None), (128, 32, 8, 2, 128), (128, 64, 8, 2, None), (64, 64, 4, 3, None)]


def tree_attention_sweep(timer: Timer, shapes, heads, configs) -> list[dict]:
    """Graph-replay time of each launch configuration (``eagle_kernels.triton.tree_attention``
    ``_launch(config=...)``) next to the launcher's default, per shape."""
    from eagle_kernels.triton import tree_attention as triton_tree_attention

    rows = []
    for B, N, prefix in shapes:
        q, k, v, seqlens, mask, table = bench_tree_attention.make_case(B, N, prefix, heads, torch.bfloat16, 16,
                                                                       timer.device)
        row = dict(op="tree_attention_sweep", shape=f"B{B}-N{N}-prefix{prefix}")
        row["default_us"] = timer.graph(
            lambda: triton_tree_attention._launch(q, k, v, seqlens, mask, block_table=table)) * 1e6
        for block_m, block_k, warps, stages, registers in configs:
            config = triton_tree_attention.TreeAttentionConfig(block_m=block_m, block_k=block_k, num_warps=warps,
                                                               num_stages=stages, max_registers=registers)
            call = lambda: triton_tree_attention._launch(q, k, v, seqlens, mask, block_table=table,  # noqa: E731
                                                         config=config)
            try:
                row[f"m{block_m}k{block_k}w{warps}s{stages}r{registers}_us"] = timer.graph(call) * 1e6
            except Exception as error:  # e.g. out of shared memory: recorded, the sweep goes on
                row[f"m{block_m}k{block_k}w{warps}s{stages}r{registers}_error"] = type(error).__name__
        rows.append(row)
        q = k = v = None
        bench_tree_attention.make_case.cache_clear()
    return rows


def draft_expand_modeled_us(B, M, V, top_k) -> float | None:
    """The launch's issue time modeled from its sm_90 SASS (bench_draft_expand.sass_report: the
    chunk programs, then the last request's merge), printed beside the measured time; None where
    the kernels cannot be compiled here."""
    try:
        rows = bench_draft_expand.sass_report(B, M, V, top_k, dtype=torch.bfloat16)
    except Exception:  # e.g. no cuobjdump beside triton: the measurement goes on without it
        return None
    return sum(r["modeled_issue_us"] + r.get("modeled_merge_issue_us", 0.0) for r in rows if "modeled_issue_us" in r)


def draft_expand_rows(timer: Timer, limits: dict, shapes) -> Iterator[dict]:
    for B, M, V, top_k in shapes:
        logits, fs = bench_draft_expand.make_inputs(B, M, V, torch.bfloat16, timer.device)
        ours = lambda: eagle_kernels.draft_expand(logits, fs, top_k)  # noqa: E731
        plain = lambda: bench_draft_expand.torch_sequence(logits, fs, top_k)  # noqa: E731
        t_graph, t_eager, t_torch = timer.graph(ours), timer.eager(ours), timer.eager(plain)
        read_s = logits.numel() * logits.element_size() / (limits["read_GBps"] * 1e9)
        yield dict(op="draft_expand", shape=f"B{B}-M{M}-V{V}-k{top_k}", graph_us=t_graph * 1e6,
                   eager_us=t_eager * 1e6, baseline_us=t_torch * 1e6, speedup_over_baseline=t_torch / t_graph,
                   one_read_us=read_s * 1e6, x_one_read=t_graph / read_s, goal="x_one_read <= 1.5")


def add_draft_expand_models(rows: list[dict]) -> None:
    """The SASS issue model beside each measured draft_expand row (compiles each shape's kernels:
    seconds a shape, so it runs after every measurement, in what is left of the budget)."""
    for row in rows:
        if row["op"] == "draft_expand":
            B, M, V, k = (int(part[1:]) for part in row["shape"].split("-"))
            modeled = draft_expand_modeled_us(B, M, V, k)
            if modeled is not None:
                row.update(modeled_issue_us=modeled, goal=f"x_one_read <= 1.5 (issue modeled {modeled:.1f} us)")


def verify_rows(timer: Timer, limits: dict, shapes, modes) -> Iterator[dict]:
    """verify against one read of the rows its walk visits (accepted nodes + the last row of
    each request: all the op needs to read) at the read bandwidth, plus one launch (the graph
    time of a one-element add): greedy <= 1.5x that read + a launch, sampling <= 3x."""
    one = torch.zeros(1, device=timer.device)
    launch_s = timer.graph(lambda: one.add_(1))
    for B, N, V in shapes:
        for mode in modes:
            tokens, parents, logits, sampling = bench_verify.make_inputs(B, N, V, mode, torch.bfloat16, timer.device)
            ours = lambda: eagle_kernels.verify(tokens, parents, logits, max_depth=bench_verify.MAX_DEPTH,  # noqa: E731
                                                **sampling)
            visited = int((ours().accept_len + 1).sum())
            t_graph, t_eager = timer.graph(ours), timer.eager(ours)
            read_s = visited * V * logits.element_size() / (limits["read_GBps"] * 1e9)
            factor = 1.5 if mode in ("greedy", "greedyrows") else 3.0
            after_launch = max(t_graph - launch_s, 1e-9) / read_s
            yield dict(op="verify", shape=f"B{B}-N{N}-V{V}-{mode}", graph_us=t_graph * 1e6,
                       eager_us=t_eager * 1e6, one_read_us=read_s * 1e6, x_one_read=t_graph / read_s,
                       launch_us=launch_s * 1e6, visited_rows=visited, x_one_read_after_launch=after_launch,
                       goal=f"one read = the {visited} visited rows; (graph - launch {launch_s * 1e6:.1f} us) "
                            f"/ one read = {after_launch:.1f} <= {factor}")


def render(rows: list[dict], limits: dict, header: str) -> str:
    lines = [header, "",
             f"Device: copy {limits['copy_GBps']:.0f} GB/s (read + write), read {limits['read_GBps']:.0f} GB/s, "
             f"bf16 GEMM {limits['gemm_TFLOPs']:.0f} TFLOP/s. `share bound`: the share of copy bandwidth "
             "a kernel would reach running its FLOPs at that GEMM rate (or the copy rate, whichever binds).", "",
             "| op | shape | graph us | eager us | baseline us | x baseline | KV GB/s | share of copy "
             "| share bound | TFLOP/s | one read us | x one read | goal |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    lines += [table_row(r) for r in rows]
    return "\n".join(lines) + "\n"


def table_row(r: dict) -> str:
    def cell(key, fmt):
        return format(r[key], fmt) if key in r else ""

    return (f"| {r['op']} | {r['shape']} | {r['graph_us']:.1f} | {r['eager_us']:.1f} | "
            f"{cell('baseline_us', '.1f')} | {cell('speedup_over_baseline', '.2f')} | "
            f"{cell('kv_GBps', '.0f')} | {cell('share_of_copy', '.2f')} | "
            f"{cell('share_bound', '.2f')} | {cell('TFLOPs', '.1f')} | "
            f"{cell('one_read_us', '.1f')} | {cell('x_one_read', '.1f')} | {r['goal']} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for gpu_goals.md and gpu_goals.json")
    parser.add_argument("--ops", nargs="+", default=["verify", "tree_attention", "draft_expand"],
                        choices=["verify", "tree_attention", "draft_expand"], help="in this order")
    parser.add_argument("--smoke", action="store_true", help="toy shapes on the CPU, wall-clock timing")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the tree-attention launch configurations of SWEEP_CONFIGS (GPU)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new case after this many seconds (the case in flight finishes); every "
                             "row is printed and saved as it is measured, so a stage killed later keeps them")
    args = parser.parse_args(argv)
    start = time.monotonic()
    if args.smoke:
        device, nbytes, gemm_size = "cpu", 1 << 20, 256
        attention_shapes, heads = [(1, 7, 64)], (4, 2, 64)
        draft_shapes = [(1, 2, 1031, 4)]
        verify_shapes, modes = [(1, 7, 1031)], list(bench_verify.MODES)
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device (use --smoke to check the script on the CPU)")
        device, nbytes, gemm_size = "cuda", GIB, 8192
        attention_shapes, heads = bench_tree_attention.GPU_SHAPES, bench_tree_attention.GPU_HEADS
        draft_shapes = [(B, 8, V, k) for B in (1, 8, 32) for V in (32000, 128256) for k in (8, 10)]
        verify_shapes, modes = [(B, 64, 128256) for B in (1, 8, 32)], list(bench_verify.MODES)
    timer = Timer(device)
    limits = device_limits(timer, nbytes, gemm_size)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run, not a measurement)"
    # The card's SM count, for the cost model of the same run (bench/gpu_model.py --device-limits).
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else None
    header = (f"# GPU goals: {name}, torch {torch.__version__}"
              + (f", triton {__import__('triton').__version__}" if device == "cuda" else ""))
    cases = {"verify": lambda: verify_rows(timer, limits, verify_shapes, modes),
             "tree_attention": lambda: tree_attention_rows(timer, limits, attention_shapes, heads),
             "draft_expand": lambda: draft_expand_rows(timer, limits, draft_shapes)}
    rows, sweep, unmeasured = [], [], []

    def over_budget() -> bool:
        return args.budget_s is not None and time.monotonic() - start > args.budget_s

    def save() -> str:
        text = render(rows, limits, header)
        for row in sweep:
            text += "\n" + " ".join(f"{key}={value:.1f}" if isinstance(value, float) else f"{key}={value}"
                                    for key, value in row.items())
        text += "\n" if sweep else ""
        if unmeasured:
            text += f"\nNot measured (the --budget-s of {args.budget_s:g} s was spent): {', '.join(unmeasured)}\n"
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu_goals.md"), "w") as f:
                f.write(text)
            with open(os.path.join(args.out, "gpu_goals.json"), "w") as f:
                json.dump({"device": name, "sms": sms, "limits": limits, "rows": rows, "sweep": sweep,
                           "unmeasured": unmeasured}, f, indent=1)
        return text

    print(render([], limits, header), end="", flush=True)
    for op in args.ops:
        if over_budget():
            unmeasured.append(f"{op} (all)")
            continue
        for row in cases[op]():
            rows.append(row)
            print(table_row(row), flush=True)
            save()
            if over_budget():
                unmeasured.append(f"{op} after {row['shape']}")
                break
    if args.sweep:
        if over_budget():
            unmeasured.append("tree_attention sweep")
        else:
            sweep = tree_attention_sweep(timer, attention_shapes, heads, SWEEP_CONFIGS)
    if device == "cuda" and not over_budget():
        add_draft_expand_models(rows)
    text = save()
    print("", text, sep="\n", end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
