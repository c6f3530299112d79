"""Kernel launches of one decoding step on a GPU, counted on the CPU (eagle_kernels/launch_count.py).

    TRITON_INTERPRET=1 PYTHONPATH=. python bench/launch_count.py [--out DIR] [--quick]

For each model shape, plain and speculative (EAGLE-3 head, tree (6, 8, 60)'s launch structure),
B = 1, bf16, random weights, a 16-token prompt: launches per target layer, per head layer, the
step's total and the part outside the layers, on the GPU layer path and, for comparison, on the
op-by-op path (TorchLayerPath, what a GPU ran before the GPU layer path). Then the launches of
the speculative step outside the layers by source line. Writes DIR/launch_count.json and
DIR/launch_count.md (default bench/results/launch-count).

Shapes. Launch counts depend on the number of layers, the tree's depth and the batch (and, on a
GPU, on the tree_attention flash-decoding split, not seen on CPU: see the module docstring), not
on widths, so:
- SmolLM2-135M: its own config (30 layers, 576 wide, 9 / 3 heads of 64, vocab 49152);
- Llama-3-8B shape: its 32 layers, 32 / 8 heads of 128, vocab 128256 and Llama-3.1 RoPE, with
  the hidden and MLP widths cut to 512 / 1024 (its 8 B weights do not fit this machine);
- the speculative steps run the tree (6, 2, 8): the same kernels as (6, 8, 60) (six head passes,
  one verify pass) in a fraction of the interpreter's time; ``--tree-check`` also counts both
  trees on a 3-layer model and requires the same counts.
``--quick``: a 3-layer model only (the structure check CI could run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import linecache
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from eagle_kernels.decoder import SpeculativeDecoder, TreeConfig  # noqa: E402
from eagle_kernels.launch_count import count_steps  # noqa: E402
from eagle_kernels.models import layers  # noqa: E402
from eagle_kernels.models.eagle_head import EagleHead  # noqa: E402
from eagle_kernels.models.llama import LlamaConfig, LlamaModel  # noqa: E402
from eagle_kernels.policy import StaticPolicy  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_e2e import norms_apart, random_llama  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SHAPES = {
    "smollm2-135m": LlamaConfig(49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, None, tie_word_embeddings=True),
    "llama3-8b-shape": LlamaConfig(128256, 512, 1024, 32, 32, 8, 128, 1e-5, 500000.0, LLAMA3_ROPE,
                                   max_position_embeddings=131072),
    "tiny-3-layers": LlamaConfig(97, 64, 96, 3, 4, 2, 16, 1e-5, 10000.0, None),
}
# The recorded GPU step models (bench/results/launch-count) used the phase-8 head's 6,144-token draft
# vocabulary; the shipped head's 8,192 adds one 2.4 MB read of LM-head rows per draft step
# (about 0.5 us at the H200's copy bandwidth).
DRAFT_VOCAB = {"smollm2-135m": 6144, "llama3-8b-shape": 32000, "tiny-3-layers": 60}
TREE, DEFAULT_TREE = TreeConfig(6, 2, 8), TreeConfig(6, 8, 60)
DTYPE = torch.bfloat16


# The real matrices of shapes counted at cut widths (bf16 bytes): the GPU layer path's choice between
# rmsnorm_linear / rmsnorm_qkv_rope and cuBLAS (GpuLayerPath.fuses) follows the real model's sizes, not the cut ones.
REAL_MATRIX_BYTES = {"llama3-8b-shape": {"qkv": (32 + 2 * 8) * 128 * 4096 * 2, "gate_up": 2 * 14336 * 4096 * 2,
                                         "draft_lm_head": 32000 * 4096 * 2}}


@contextlib.contextmanager
def real_fusion(name: str):
    """Within the block, the layer path fuses the norms of ``name``'s layers as it would at the real widths."""
    real = REAL_MATRIX_BYTES.get(name, {})
    fused = {matrix: size <= layers.FUSED_NORM_MAX_MATRIX_BYTES for matrix, size in real.items()}
    if len(set(fused.values())) > 1:
        raise NotImplementedError(f"{name}: some real matrices fuse and some do not ({fused}); one limit cannot say so")
    with norms_apart() if real and not any(fused.values()) else contextlib.nullcontext():
        yield


def random_model(config: LlamaConfig) -> LlamaModel:
    """Random bf16 weights of ``config``'s shapes (launch counts do not depend on the values)."""
    return random_llama(config, DTYPE, "cpu")


def count(name: str, tree: TreeConfig, gpu_layer_path: bool) -> dict:
    target = random_model(SHAPES[name])
    head = EagleHead.random(target, "eagle3", draft_vocab_size=DRAFT_VOCAB[name])
    decoder = SpeculativeDecoder(target, head, tree, policy=StaticPolicy(), cuda_graph=False)
    prompt = [list(range(1, 17))]
    rows = {}
    for mode in ("plain", "speculative"):
        start = time.perf_counter()
        with real_fusion(name):
            step = count_steps(decoder, prompt, steps=2, speculative=mode == "speculative",
                               gpu_layer_path=gpu_layer_path)[-1]  # the steady state
        rows[mode] = {"total": step.total, "target_layers": step.per_layer("target"),
                      "head_layers": step.per_layer("head"), "outside_layers": step.outside_layers,
                      "pdl_edges": step.pdl_edges,
                      "triton": sum(1 for launch in step.launches if launch.kind == "triton"),
                      "by_kernel": dict(step.by_kernel.most_common()), "by_line": dict(sorted(step.by_line.items())),
                      "host_reads": dict(step.host_reads), "seconds": round(time.perf_counter() - start, 1)}
        print(f"{name:16} {'gpu' if gpu_layer_path else 'ops'} {mode:11} total {step.total:5}  per target layer "
              f"{sorted(set(rows[mode]['target_layers']))}  per head layer {sorted(set(rows[mode]['head_layers']))}  "
              f"outside layers {step.outside_layers:4}  ({rows[mode]['seconds']} s)", flush=True)
    return rows


def per_layer(values: list) -> str:
    return "-" if not values else "/".join(str(v) for v in sorted(set(values)))


def render(results: dict) -> str:
    lines = ["| shape | layer path | step | launches | target layers x per layer | head layers x per layer "
             "| outside the layers | Triton launches | PDL edges |", "|---|---|---|---:|---|---|---:|---:|---:|"]
    for (name, path), rows in results["counts"].items():
        for mode, r in rows.items():
            lines.append(f"| {name} | {path} | {mode} | {r['total']} | {len(r['target_layers'])} x "
                         f"{per_layer(r['target_layers'])} | {len(r['head_layers'])} x {per_layer(r['head_layers'])} "
                         f"| {r['outside_layers']} | {r['triton']} | {r['pdl_edges']} |")
    lines += ["", "Speculative step on the GPU layer path, launches outside the layers by source line "
              f"({results['by_line_shape']}):", "", "| line | launches | code |", "|---|---:|---|"]
    for where, n in results["by_line"].items():
        path, _, number = where.rpartition(":")
        code = linecache.getline(os.path.join(ROOT, path), int(number)).strip() if number.isdigit() else ""
        lines.append(f"| {where} | {n} | `{code.replace('|', '∣')}` |")
    lines += ["", "PDL edges: launches that may start while the launch before them runs (programmatic dependent "
              "launch, on by default on sm_90: a Triton launch after a Triton launch; eagle_kernels/triton/_pdl.py)."]
    if results.get("tree_check"):
        lines += ["", f"Tree structure check (3-layer model): {results['tree_check']}"]
    return "\n".join(lines) + "\n"


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "launch-count"))
    parser.add_argument("--quick", action="store_true", help="the 3-layer model only")
    parser.add_argument("--tree-check", action="store_true", help="(6, 8, 60) and (6, 2, 8) count the same")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    names = ["tiny-3-layers"] if args.quick else ["smollm2-135m", "llama3-8b-shape"]
    results = {"counts": {}, "tree": [TREE.depth, TREE.top_k, TREE.num_nodes], "dtype": str(DTYPE), "batch": 1}
    for name in names:
        for gpu in (True, False):
            results["counts"][(name, "gpu" if gpu else "ops")] = count(name, TREE, gpu)
    results["by_line_shape"] = names[0]
    results["by_line"] = results["counts"][(names[0], "gpu")]["speculative"]["by_line"]
    if args.tree_check:
        small = count("tiny-3-layers", TREE, True)["speculative"]
        default = count("tiny-3-layers", DEFAULT_TREE, True)["speculative"]
        same = all(small[k] == default[k] for k in ("total", "target_layers", "head_layers", "by_kernel"))
        results["tree_check"] = (f"tree (6, 8, 60) {default['total']} launches, tree (6, 2, 8) {small['total']}: "
                                 + ("the same kernels" if same else "DIFFERENT"))
        if not same:
            raise SystemExit(results["tree_check"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_count.json"), "w") as f:
        json.dump({**results, "counts": {f"{n}/{p}": r for (n, p), r in results["counts"].items()}}, f, indent=1)
    table = render(results)
    with open(os.path.join(args.out, "launch_count.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
