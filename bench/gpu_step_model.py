"""A decoding step on the H200, modeled launch by launch from the CPU launch count.

    TRITON_INTERPRET=1 PYTHONPATH=. python bench/gpu_step_model.py [--out DIR] [--quick]

The launch list of one steady-state step (the second, eagle_kernels/launch_count.py) is counted
on the CPU, with every launch's tensor shapes. Each launch gets the bytes it must move and the
FLOPs it does at the real model's sizes, and a device time

    t = max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s, t_min)

with t_min the floor of one graph node (a kernel's ramp-up and drain between dependent nodes of
a replayed CUDA graph: no host launch cost). t_min is not calibrated on this project, so every
step time is given over a sweep of t_min. The step is the sum of its launches (one stream,
dependent kernels).

Bytes per launch:
- aten ops: every tensor given and returned once (a GEMM: both operands and the result; an
  in-place ``addmm_`` reads and writes its accumulator); GEMM FLOPs 2 M N K from the operands;
- Triton kernels and the native ops: every tensor argument once (an upper bound), except
  the KV caches: tree_attention reads the prefix it attends (``prefix`` + the pass's tokens, K
  and V), rope_write_kv writes the pass's rows, compact_kv moves the accepted rows of every
  layer (read and write); an embedding table given to a kernel counts for the rows it gathers;
  q8_0_linear's scales count 2 bytes per 32 quants.

Launches whose programs hand phases to each other (o_proj_mlp: the o, gate/up and down GEMMs, ``PHASED_KERNELS``) are
priced phase by phase, each phase as a launch of its own (its bytes and FLOPs against the floor), the phases after
the first with a hand-off's floor instead of t_min: by default t_min itself, so such a launch costs what its phases
as separate launches would (no gain claimed where nothing has measured a hand-off); a line beside the table gives
the plain step by what a hand-off costs.

Sizes. The launch list does not depend on the widths or the prefix, so it is counted on cut
models (fast) and the shapes are mapped to the real ones: the Llama-3-8B shape is counted with
hidden / MLP widths 640 / 1152 (values no other dimension takes; multiples of 128, for 8-bit
heads) and each dimension equal to a multiple of them is mapped to the same multiple of 4096 /
14336; SmolLM2-135M is counted at its
own widths. The tree is counted as (6, 2, 13) (the same kernels as (6, 8, 60), bench/launch_count.py
--tree-check, at a fraction of the interpreter's time) and every dimension equal to its 13 verified
nodes is mapped to 60 (the verify pass's rows: its GEMMs, logits and tree mask); the head passes'
rows stay at top_k 2 instead of 8 (kernels at the t_min floor either way). The prompt is 16
tokens; the modeled KV prefix is 512 and 4096 tokens (tree_attention's reads). On a GPU
tree_attention splits the prefix (flash-decoding, not seen on CPU tensors) where the GPU
launcher's split rule (``num_splits``, 132 SMs) splits, and merges the splits in each block's
last program (``folds_merge``: their partials' bytes charged to the attention launch, written
and read back, plus a tail after its waves: one program's read of its block's partials from L2,
``SM_L2_BYTES_PER_S`` and ``L2_ROUND_S`` a round) or in a merge launch (added here).
tau (tokens per speculative step) comes from bench/results/cpu_tau (greedy: device independent),
plain tau is 1. ``--coupled``: also the speculative step of ``StaticPolicy(coupled_sampling=True)``
at T = 1 (no tau: its tok/s are left out; results ``gpu_step_model_coupled.*``). ``--quick``: the
3-layer model only. ``--counts FILE``: the counted launch lists, read from FILE if it exists, else
written to it (a re-run of the model alone). ``--head-weights q8_0`` / ``fp8``: the EAGLE-3 head's
matrices as Q8_0 blocks run by q8_0_linear, or multiplied as fp8 copies by fp8_linear (results
``gpu_step_model_q8_0head.*`` / ``..._fp8head.*``); ``--models``: some models only.
Cross-checks beside the table: the speculative step with its two verify launches (a walk of tau's length:
``VERIFY_WALK_CASES``; without tau a full-depth walk: ``VERIFY_CASES``), then also its draft_expand launches
(``DRAFT_EXPAND_MODEL``), at the kernel model's device time, the Llama shape's verify-pass attention at the
calibrated model's (``CALIBRATED_VERIFY_ATTENTION``) and an 8-bit head's GEMMs at the kernel model's
(``KERNEL_MODELS``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pickle
import sys
import time
from collections import defaultdict

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402
from launch_count import DRAFT_VOCAB, SHAPES, random_model, real_fusion  # noqa: E402

from eagle_kernels.decoder import SpeculativeDecoder, TreeConfig  # noqa: E402
from eagle_kernels.launch_count import Launch, count_steps  # noqa: E402
from eagle_kernels.models.eagle_head import EagleHead  # noqa: E402
from eagle_kernels.policy import StaticPolicy  # noqa: E402

HBM_BYTES_PER_S = 4.3e12  # H200 copy bandwidth (HBM peak ~4.8 TB/s)
BF16_FLOPS_PER_S = 790e12  # bf16 dense, measured on a GEMM
# A folded tree_attention merge (tree_attention_config.folds_merge): one program a block reads its
# splits' partials from L2 alone, at about 64 B a cycle of one SM (1.98 GHz), in rounds of
# dependent loads of about 400 cycles each. Assumed, not measured: bench_tree_attention.py's
# test_tree_attention_merge_gpu times it on a device.
SM_L2_BYTES_PER_S = 64 * 1.98e9
L2_ROUND_S = 0.2e-6
T_MIN_SWEEP_US = (1.0, 1.5, 2.0, 3.0)
TREE = TreeConfig(6, 8, 60)
COUNT_TREE = TreeConfig(6, 2, 13)  # the same launches; 13 occurs as no other dimension
SMS = 132
# The calibrated kernel model's device time of tree_attention at the Llama-3-8B goal shape (docs/gpu_model.md,
# "Goal shapes after tree_attention's row-sum MMA and fp16 split partials": bf16 B1 N64 Hq32/Hkv8 D128
# prefix 4096): attention 11.7 us, merge 1.1 us. Applied to the verify pass's launches as a cross-check.
CALIBRATED_VERIFY_ATTENTION = {("llama3-8b-shape", 4096): {"_tree_attention_kernel": 11.7e-6,
                                                          "_tree_attention_merge_kernel": 1.1e-6}}
PREFIXES = (512, 4096)
# The kernel model's device time of verify at the step's shape (B 1, the (6, 8, 60) tree's 61 rows, greedy as at
# T 0), as the decoder calls it: with its temperature, top_k and top_p tensors, i.e. two launches, the all-rows
# kernel (_verify_temperature_kernel, the greedy chunk pass and the walk over the rows' argmaxes) and the walk's
# (_verify_kernel with SKIP_ROWS: every program leaves at once); bench/gpu_model.py decode --only verify, each launch
# less its launch constant; docs/gpu_kernels.md, "Temperature calls: every row at once"; not calibrated (neither
# kernel has run on a GPU). Applied to the speculative step's two verify launches as a cross-check of their
# bytes-only time.
VERIFY_MODEL = os.path.join(ROOT, "bench", "results", "sm90-compile", "verify-temperature-rows", "decode_model.json")
VERIFY_KERNELS = ("_verify_temperature_kernel", "_verify_kernel")
VERIFY_CASES = {"smollm2-135m": "verify B1 N61 V49152 greedy", "llama3-8b-shape": "verify B1 N61 V128256 greedy"}
# Those inputs accept a draft at every depth (the walk over 7 rows' argmaxes). A step's walk visits as many rows as
# its accepted drafts plus one, tau on average; the modeled time is linear in them, so the step's mean verify time is
# that of a walk of tau - 1 accepted drafts, taken between the rows of 2 and 3 (bench/gpu_model.py decode --only
# accepted).
VERIFY_WALK_CASES = {name: {accepted: f"{case}, {accepted} accepted" for accepted in (2, 3)}
                     for name, case in VERIFY_CASES.items()}
# A step whose verify is the walk's launch alone (coupled sampling passes ``positions``): the walk modeled alone,
# greedy (bench/results/sm90-compile/verify-cooperative: the full walk and the walks of 2 and 3 accepted drafts).
WALK_ALONE_MODEL = os.path.join(ROOT, "bench", "results", "sm90-compile", "verify-cooperative", "decode_sum_alone.json")
WALK_ALONE_LENGTHS = os.path.join(ROOT, "bench", "results", "sm90-compile", "verify-cooperative",
                                  "decode_walk_length.json")
# Likewise draft_expand at the head passes' shapes (the root's row, then the tree's 8 frontier rows; counted at 2), in
# each head's draft vocabulary: bench/gpu_model.py decode --only draft_expand.
DRAFT_EXPAND_MODEL = os.path.join(ROOT, "bench", "results", "sm90-compile", "draft_expand_decode_model.json")
DRAFT_EXPAND_CASES = {"smollm2-135m": {1: "draft_expand B1 M1 V6144 top_k8", 8: "draft_expand B1 M8 V6144 top_k8"},
                      "llama3-8b-shape": {1: "draft_expand B1 M1 V32000 top_k8",
                                          8: "draft_expand B1 M8 V32000 top_k8"}}
# The kernel model's tree_attention at SmolLM2-135M's decoding-step launches (B 1, the launcher's configuration, a
# cache of prefix + N entries; bench/gpu_model.py decode --only Hq9/Hkv3): a decoded token (N 1), a head pass's
# frontier (N 8) and the verify pass (N 61), at each prefix of the step model; with a fold's tail included, so the
# step model's own tail is not added again. Applied to every tree_attention launch of both steps as a cross-check.
ATTENTION_MODEL = os.path.join(ROOT, "bench", "results", "sm90-compile", "tree_attention_decode_model.json")
ATTENTION_CASES = {"smollm2-135m": {(N, prefix): f"tree_attention B1 N{N} Hq9/Hkv3 D64 prefix{prefix} launcher"
                                   for N in (1, 8, 61) for prefix in PREFIXES}}
# The kernel model's 8-bit GEMMs at a Llama-3-8B-sized head's matrices (bench/gpu_model.py decode --only ...,
# fitted issue rate): applied to an 8-bit head's launches as a cross-check of their bytes-only time.
KERNEL_MODELS = {name: os.path.join(ROOT, "bench", "results", "sm90-compile", f"{op}_model.json")
                 for name, op in (("_q8_0_linear_kernel", "q8_0_linear"), ("_fp8_linear_kernel", "fp8_linear"))}
# The H200 run of 2026-12-04: a replayed plain SmolLM2 step of 276 launches took 954 us (docs/gpu_model.md, "Measured:
# the step on an H200"), before programmatic dependent launch.
MEASURED_T_MIN_US = 3.46
FITTED_ISSUE_RATE = 1.25  # bench/gpu_model.py's ISSUE_RATE: warp instructions a cycle per SM
FITTED_LAUNCH_S = 58e-6  # bench/gpu_model.py's LAUNCH_OVERHEAD_S (host time; a replayed graph does not pay it)
TAU_FILE = os.path.join(ROOT, "bench", "results", "cpu_tau", "smollm2_eagle3_d6k8n60.json")

# Counted widths -> real widths. The Llama-3-8B shape is counted cut (its 8 B weights do not fit
# here); the cut values are chosen so that no other dimension of the step equals a multiple of them.
# Multiples of 128, so that 8-bit heads (--head-weights q8_0: K / 32 blocks, fp8: K / 128) can be counted at them.
CUT = {"llama3-8b-shape": dataclasses.replace(SHAPES["llama3-8b-shape"], hidden_size=640, intermediate_size=1152)}
REAL_WIDTHS = {"llama3-8b-shape": (4096, 14336)}

# Triton / native launches whose tensor arguments include KV caches, by argument position.
CACHE_ARGS = {"_tree_attention_kernel": (1, 2), "_rope_write_kv_kernel": (4, 5), "_rmsnorm_qkv_rope_kernel": (7, 8),
              "eagle_kernels::compact_kv": (0, 1)}
# Triton kernels with a GEMM inside: (rows argument [M, K], weight argument [N, K]); FLOPs 2 M N K.
TRITON_GEMMS = {"_rmsnorm_linear_kernel": (0, 2), "_rmsnorm_qkv_rope_kernel": (0, 2), "_q8_0_linear_kernel": (0, 1),
                "_fp8_linear_kernel": (0, 2)}
# Triton kernels whose programs hand phases to each other inside the launch, per phase: its GEMM (rows argument,
# weight argument) for the FLOPs and the arguments it moves (read or written) for the bytes. Each phase is priced
# as a launch of its own would be, the phases after the first at a hand-off's floor instead (see Cost.seconds).
PHASED_KERNELS = {"_o_proj_mlp_kernel": (  # attention, residual, o, norm, gate_up, down, mid, act, out
    {"gemm": (0, 2), "moves": (0, 1, 2, 6)}, {"gemm": (6, 4), "moves": (6, 3, 4, 7)},
    {"gemm": (7, 5), "moves": (7, 5, 6, 8)})}
# q8_0_linear's scales [N, K / 32] (argument 2): charged from its quants' real shape (K / 32 of a cut width is no
# multiple of the real one's).
Q8_SCALES_ARG = {"_q8_0_linear_kernel": (1, 2)}


def dim_map(name: str) -> dict:
    """Counted dimension -> real dimension (the tree's nodes; multiples 1..4 of the hidden and MLP widths)."""
    mapping = {COUNT_TREE.num_nodes: TREE.num_nodes}
    if name not in CUT:
        return mapping
    cut, (hidden, mlp) = CUT[name], REAL_WIDTHS[name]
    for k in range(1, 5):
        mapping[k * cut.hidden_size] = k * hidden
        mapping[k * cut.intermediate_size] = k * mlp
    return mapping


def real_shape(shape: tuple, mapping: dict) -> tuple:
    return tuple(mapping.get(d, d) for d in shape)


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclasses.dataclass
class Cost:
    name: str
    owner: str | None
    layer: int
    bytes: int
    flops: int
    floor: float = 0.0  # a device time from elsewhere (the calibrated kernel model), s
    tail: float = 0.0  # work after the launch's waves (a folded merge's last programs), s
    pdl: bool = False  # a PDL edge: launched with PDL after a Triton launch (LaunchCount.pdl_edges)
    rows: int = 0  # draft_expand: the frontier rows of its logits [B, M, V] as counted (M); tree_attention: N
    phases: tuple = ()  # (bytes, FLOPs) of each phase of a phased launch (PHASED_KERNELS)

    @property
    def handoffs(self) -> int:
        """Phases after the first inside the launch."""
        return max(len(self.phases) - 1, 0)

    def seconds(self, t_min: float, pdl_saving: float = 0.0, handoff: float | None = None) -> float:
        """The launch's time at a floor of ``t_min`` a launch, ``pdl_saving`` less where it is a PDL edge. A phased
        launch is the sum of its phases, each ``max(bytes / bandwidth, FLOPs / peak, floor)`` with the launch's floor
        for the first and ``handoff`` for the others: the wait for the phase before it inside the launch. ``handoff``
        None prices a hand-off as the floor of a launch of its own (a phased launch then costs what its phases as
        separate launches would: no gain claimed)."""
        floor = t_min - pdl_saving if self.pdl else t_min
        if self.phases:
            later = floor if handoff is None else handoff
            return sum(max(b / HBM_BYTES_PER_S, f / BF16_FLOPS_PER_S, floor if i == 0 else later)
                       for i, (b, f) in enumerate(self.phases)) + self.tail
        return max(self.bytes / HBM_BYTES_PER_S, self.flops / BF16_FLOPS_PER_S, floor, self.floor) + self.tail


def gemm_flops(shapes: list, x: int, w: int) -> int:
    """2 M N K of a GEMM whose rows [..., K] and weight [N, K] are arguments ``x`` and ``w`` of
    ``shapes`` ((shape, itemsize) per argument)."""
    rows, weight = shapes[x][0], shapes[w][0]
    return 2 * (numel(rows) // rows[-1]) * weight[0] * weight[1]


def launch_cost(launch: Launch, mapping: dict, prefix: int, vocab: int) -> Cost:
    """Bytes and FLOPs of one launch at the real sizes (see the module docstring)."""
    shapes = [(real_shape(t.shape, mapping), t.itemsize) for t in launch.tensors]
    flops = launch.flops
    if flops and launch.kind == "aten":
        a, b = shapes[1 if launch.name.startswith("addmm") else 0], shapes[2 if launch.name.startswith("addmm") else 1]
        k = a[0][-1]
        n = b[0][0] if launch.name == "linear" else b[0][-1]
        flops = 2 * (numel(a[0]) // k) * n * k
    if launch.name in TRITON_GEMMS:
        flops = gemm_flops(shapes, *TRITON_GEMMS[launch.name])
    phases = ()
    if launch.name in PHASED_KERNELS:
        phases = tuple((sum(numel(shapes[i][0]) * shapes[i][1] for i in phase["moves"]),
                        gemm_flops(shapes, *phase["gemm"])) for phase in PHASED_KERNELS[launch.name])
        flops = sum(f for _, f in phases)
    caches = CACHE_ARGS.get(launch.name, ())
    total = 0
    quants, scales = Q8_SCALES_ARG.get(launch.name, (None, None))
    for i, (shape, itemsize) in enumerate(shapes):
        if i in caches:
            continue
        if i == scales:  # one fp16 scale per 32 quants
            total += numel(shapes[quants][0]) // 32 * 2
            continue
        if launch.kind != "aten" and len(shape) == 2 and shape[0] == vocab:
            width = shape[1]  # an embedding table: the rows gathered, as many as the widest other argument holds
            rows = max((numel(s) // width for j, (s, _) in enumerate(shapes) if j != i and s and s[-1] == width),
                       default=1)
            total += rows * width * itemsize
            continue
        total += numel(shape) * itemsize
    if caches:
        cache_shape, itemsize = shapes[caches[0]]
        heads, dim = cache_shape[-2], cache_shape[-1]
        if launch.name == "_tree_attention_kernel":
            q = shapes[0][0]  # (B, N, Hq, D)
            total += 2 * q[0] * (prefix + q[1]) * heads * dim * itemsize
        elif launch.name == "_rope_write_kv_kernel":
            qkv = shapes[0][0]  # (B, N, q + 2 kv): N rows written, K and V
            total += 2 * qkv[0] * qkv[1] * heads * dim * itemsize
        elif launch.name == "_rmsnorm_qkv_rope_kernel":
            x = shapes[0][0]  # (B N, K): a row written per token, K and V
            total += 2 * (numel(x) // x[-1]) * heads * dim * itemsize
        else:  # compact_kv: (layers, B, capacity, Hkv, D) caches, the accepted rows moved (read + write)
            layers, batch = cache_shape[0], cache_shape[1]
            accepted = shapes[3][0][-1]
            total += 2 * 2 * layers * batch * accepted * heads * dim * itemsize
    rows = 0
    if launch.name == "_draft_expand_kernel":
        rows = launch.tensors[0].shape[1]
    elif launch.name == "_tree_attention_kernel":
        rows = shapes[0][0][1]  # the pass's query rows (nodes) at the real sizes
    return Cost(launch.name, launch.owner, launch.layer, total, flops, rows=rows, phases=phases)


def merge_cost(launch: Launch, mapping: dict, prefix: int) -> tuple[Cost, bool] | None:
    """The merge of a tree_attention launch that splits the prefix on a GPU (the GPU launcher's
    rules; capacity taken as the prefix and the pass's rows): its cost as a launch (partials
    read, output written) and whether the launcher folds it into the attention launch; or None."""
    from eagle_kernels.triton.tree_attention_config import (
        fold_chunk,
        folds_merge,
        gpu_config,
        partial_dtype,
        split_layout,
    )

    q = real_shape(launch.tensors[0].shape, mapping)  # (B, N, Hq, D)
    cache = launch.tensors[1].shape
    B, N, Hq, D = q
    group = Hq // cache[-2]
    causal = launch.tensors[4].shape == launch.tensors[3].shape  # the seqlens stand in for a mask
    config = gpu_config(N, group, D, torch.bfloat16, causal, False, heads=B * cache[-2], sms=SMS, capacity=prefix + N)
    block_m, rows, _, splits = split_layout(N, group, B * cache[-2], prefix + N, config, SMS)
    if splits <= 1:
        return None
    # bf16 inputs: partial outputs in partial_dtype (fp16), fp32 log-sum-exps and scales
    value_bytes = partial_dtype(torch.bfloat16).itemsize
    partials = splits * B * N * Hq * (D * value_bytes + 8)
    folded = folds_merge(splits, rows, D, value_bytes)
    cost = Cost("_tree_attention_merge_kernel", launch.owner, launch.layer, partials + B * N * Hq * D * 2, 0)
    if folded:  # one program a block reads its splits' partials after the waves, in dependent rounds
        rounds = -(-splits // fold_chunk(splits, block_m, max(16, 1 << (D - 1).bit_length()), config.num_warps))
        cost.tail = splits * rows * (D * value_bytes + 8) / SM_L2_BYTES_PER_S + rounds * L2_ROUND_S
    return cost, folded


def count(name: str, tree: TreeConfig = COUNT_TREE, coupled: bool = False, head_weights: str | None = None) -> dict:
    """The steady-state launch lists (plain, speculative; with ``coupled`` also the speculative step of
    ``StaticPolicy(coupled_sampling=True)`` at T 1, top-p 0.9) of ``name``, counted at the cut widths; the head's
    matrices as ``head_weights`` (``EagleHead``'s ``weight_dtype``: None as stored, "q8_0")."""
    config = CUT.get(name, SHAPES[name])
    target = random_model(config)
    head = EagleHead.random(target, "eagle3", draft_vocab_size=DRAFT_VOCAB[name], weight_dtype=head_weights)
    decoder = SpeculativeDecoder(target, head, tree, policy=StaticPolicy(), cuda_graph=False)
    prompt = [list(range(1, 17))]
    with real_fusion(name):
        counts = {mode: count_steps(decoder, prompt, steps=2, speculative=mode == "speculative")[-1]
                  for mode in ("plain", "speculative")}
        if coupled:
            decoder = SpeculativeDecoder(target, head, tree, policy=StaticPolicy(coupled_sampling=True),
                                         cuda_graph=False)
            counts["coupled"] = count_steps(decoder, prompt, steps=2, speculative=True, temperature=1.0, top_p=0.9,
                                            seed=1)[-1]
    return counts


def weight_bytes(name: str) -> int:
    """Bytes of the real model's weights a plain step reads (every matrix once, the embedding
    table for one row; SmolLM2's LM head is the tied embedding)."""
    c = SHAPES[name]
    hidden, mlp = REAL_WIDTHS.get(name, (c.hidden_size, c.intermediate_size))
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * mlp + 2 * hidden
    return 2 * (c.num_layers * layer + c.vocab_size * hidden + hidden)


def step_seconds(costs: list, t_min: float, pdl_saving: float = 0.0, handoff: float | None = None) -> float:
    return sum(c.seconds(t_min, pdl_saving, handoff) for c in costs)


def first_on_grid(meets, top: float, step_us: float = 0.01, largest: bool = False) -> float | None:
    """The least (``largest``: the greatest) value, us, on a grid from 0 to ``top`` (s) in steps of
    ``step_us`` for which ``meets(value in s)`` holds; None when none does."""
    grid = range(int(round(top * 1e6 / step_us)) + 1)
    for i in reversed(grid) if largest else grid:
        if meets(i * step_us * 1e-6):
            return round(i * step_us, 2)
    return None


def handoff_allowed(meets, t_min: float, step_us: float = 0.01) -> float | None:
    """The largest hand-off time (us, 0 to ``t_min``) for which ``meets(handoff in s)`` holds at ``t_min``; None
    when none does."""
    return first_on_grid(meets, t_min, step_us, largest=True)


def pdl_saving_needed(meets, t_min: float, step_us: float = 0.01) -> float | None:
    """The least saving per PDL edge (us, 0 to ``t_min``) for which ``meets(pdl_saving in s)`` holds at
    ``t_min``; None when none does."""
    return first_on_grid(meets, t_min, step_us)


def breakdown(costs: list, t_min: float) -> dict:
    """Per kernel name: launches, bytes, FLOPs, seconds; for one target layer, the layers and the rest."""
    parts = defaultdict(lambda: {"launches": 0, "bytes": 0, "flops": 0, "seconds": 0.0})
    for c in costs:
        where = "target layers" if c.owner == "target" else "head layers" if c.owner == "head" else "outside"
        p = parts[f"{where}: {c.name}"]
        p["launches"] += 1
        p["bytes"] += c.bytes
        p["flops"] += c.flops
        p["seconds"] += c.seconds(t_min)
    return dict(sorted(parts.items(), key=lambda kv: -kv[1]["seconds"]))


def t_min_range(meets, top_us: float = 10.0, step_us: float = 0.01) -> str:
    """The t_min values (us, on a grid from 0 to ``top_us``) for which ``meets(t_min in s)`` holds, as
    intervals ("none" when it holds for none)."""
    grid = [i * step_us for i in range(int(round(top_us / step_us)) + 1)]
    ok = [meets(t * 1e-6) for t in grid]
    spans, begin = [], None
    for i, good in enumerate(ok + [False]):
        if good and begin is None:
            begin = i
        elif not good and begin is not None:
            spans.append(f"{grid[begin]:.2f}-{grid[i - 1]:.2f}")
            begin = None
    return ", ".join(spans) if spans else "none"


def model(name: str, counts: dict, prefix: int, tau: float) -> dict:
    mapping, vocab = dim_map(name), SHAPES[name].vocab_size
    costs, gemm_8bit_launches = {}, []
    for mode, c in counts.items():
        costs[mode] = []
        for launch, edge in zip(c.launches, c.pdl_edge_flags):
            cost = launch_cost(launch, mapping, prefix, vocab)
            cost.pdl = edge
            costs[mode].append(cost)
            if mode == "speculative" and launch.name in KERNEL_MODELS:
                weight = launch.tensors[TRITON_GEMMS[launch.name][1]]  # [N, K]
                gemm_8bit_launches.append((cost, real_shape(weight.shape, mapping)))
            if launch.name == "_tree_attention_kernel":
                merged = merge_cost(launch, mapping, prefix)
                if merged is not None:
                    merge, folded = merged
                    out = numel(real_shape(launch.tensors[0].shape, mapping)) * 2
                    cost.bytes += merge.bytes - 2 * out  # the partials written instead of the output
                    if folded:  # the last programs read the partials and write the output
                        cost.bytes += merge.bytes
                        cost.tail = merge.tail
                    else:
                        costs[mode].append(merge)
    result = {"prefix": prefix, "tau": tau, "weight_bytes": weight_bytes(name),
              "weight_read_us": weight_bytes(name) / HBM_BYTES_PER_S * 1e6, "modes": {}}
    for mode, cs in costs.items():
        # Coupled sampling at T 1: no tau measured on the GPU tree (tok/s left out).
        tokens = tau if mode == "speculative" else float("nan") if mode == "coupled" else 1.0
        rows = {}
        for t_us in T_MIN_SWEEP_US:
            s = step_seconds(cs, t_us * 1e-6)
            # tok/s needs tau, measured for the depth-6 tree only (NaN otherwise: None).
            rows[str(t_us)] = {"step_us": round(s * 1e6, 1),
                               "tok_per_s": round(tokens / s) if tokens == tokens else None}
        floor_free = step_seconds(cs, 0.0)
        result["modes"][mode] = {
            "launches": len(cs), "pdl_edges": sum(c.pdl for c in cs), "bytes": sum(c.bytes for c in cs),
            "flops": sum(c.flops for c in cs),
            "step_us_without_floor": round(floor_free * 1e6, 1), "by_t_min_us": rows,
            "breakdown_t_min_2us": {k: {**v, "seconds": round(v["seconds"] * 1e6, 1)}
                                    for k, v in list(breakdown(cs, 2e-6).items())[:12]}}
        result["modes"][mode]["costs"] = cs
    # At the floor the H200 run measured (before PDL), what each PDL edge must save for the plain goals.
    t = MEASURED_T_MIN_US * 1e-6
    if name == "smollm2-135m":
        result["pdl_saving_for_2000_tok_s_us"] = pdl_saving_needed(
            lambda saving: step_seconds(costs["plain"], t, saving) <= 1 / 2000, t)
    result["plain_step_us_at_measured_t_min_by_pdl_saving_us"] = {
        str(saving): round(step_seconds(costs["plain"], t, saving * 1e-6) * 1e6, 1) for saving in (0.0, 0.5, 1.0, 1.5)}
    # The phased launches (o_proj_mlp) at the measured floor, no PDL saving, by what a hand-off costs.
    handoffs = sum(c.handoffs for c in costs["plain"])
    if handoffs:
        result["plain_handoffs"] = handoffs
        result["plain_step_us_at_measured_t_min_by_handoff_us"] = {
            str(h): round(step_seconds(costs["plain"], t, 0.0, h * 1e-6) * 1e6, 1) for h in (0.5, 1.0, 2.0, 3.0)}
        if name == "smollm2-135m":
            result["handoff_for_2000_tok_s_us"] = handoff_allowed(
                lambda h: step_seconds(costs["plain"], t, 0.0, h) <= 1 / 2000, t)
    if gemm_8bit_launches and os.path.exists(KERNEL_MODELS[gemm_8bit_launches[0][0].name]):
        result["kernel_model_8bit"] = kernel_model_cross_check(costs, gemm_8bit_launches)
    kernels = {c.name for c in costs.get("speculative", ())}
    full_walk, expand_s = verify_device_time(name, None, kernels), draft_expand_device_times(name)
    # tau's walk; without walk-length rows, or without tau, the walk that accepts at every depth
    verify = verify_device_time(name, tau, kernels)
    if verify is None:
        verify = full_walk
    if full_walk is None:
        full_walk = verify
    if verify is not None and "speculative" in costs:
        verify_us = {"verify_us": round(sum(verify.values()) * 1e6, 1),
                     "verify_full_walk_us": round(sum(full_walk.values()) * 1e6, 1),
                     "verify_launches_us": {kernel: round(s * 1e6, 1) for kernel, s in verify.items()}}
        result["speculative_modeled_verify"] = modeled_step(name, costs, tau, verify)
        result["speculative_modeled_verify"].update(verify_us)
        if expand_s is not None:
            floors = {**verify, "_draft_expand_kernel": lambda cost: expand_s[1 if cost.rows == 1 else 8]}
            both = modeled_step(name, costs, tau, floors)
            both.update(verify_us)
            both["draft_expand_us"] = {str(m): round(s * 1e6, 1) for m, s in expand_s.items()}
            result["speculative_modeled_verify_draft_expand"] = both
            attention = attention_device_times(name, prefix)
            if attention is not None and tau == tau:
                result["attention_modeled"] = attention_cross_check(name, costs, tau, attention, floors)
    calibrated = CALIBRATED_VERIFY_ATTENTION.get((name, prefix))
    if calibrated:
        verify_layers = {c.layer for c in costs["speculative"] if c.owner == "target"}
        cs = [dataclasses.replace(c, floor=calibrated.get(c.name, 0.0) if c.layer in verify_layers else 0.0)
              for c in costs["speculative"]]
        result["speculative_calibrated_attention"] = {
            str(t): round(step_seconds(cs, t * 1e-6) * 1e6, 1) for t in T_MIN_SWEEP_US}
        result["speculative_calibrated_attention_goal"] = t_min_range(
            lambda t: step_seconds(cs, t) <= 1.3 * step_seconds(costs["plain"], t))
        result["verify_attention_budget_us"] = {
            str(t): attention_budget(costs["speculative"], costs["plain"], verify_layers, calibrated, t * 1e-6)
            for t in T_MIN_SWEEP_US}
    return result


@functools.cache
def _model_rows(path: str) -> dict:
    """{case: row} of the kernel model's results at ``path`` ({} where there are none), read once."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {row["case"]: row for row in json.load(f)}


def modeled_device_time(path: str, case: str | None, kernel: str | None = None) -> float | None:
    """The kernel model's device time (s) of ``case`` in its results at ``path`` (each launch's
    time less the fitted launch constant; only ``kernel``'s launches if given), or None."""
    rows = _model_rows(path)
    if case is None or case not in rows:
        return None
    return sum(launch["time_s"] - FITTED_LAUNCH_S for launch in rows[case]["launches"]
               if kernel is None or launch["kernel"] == kernel)


def verify_device_time(name: str, tau: float | None = None, kernels: set = frozenset(VERIFY_KERNELS)) -> dict | None:
    """{kernel: the kernel model's device time (s)} of the step's verify launches for ``name``, or None: a walk
    that accepts at every depth, or with ``tau`` (tokens a step) the mean walk of tau - 1 accepted drafts, linear
    between the modeled walks of 2 and 3 (and beyond them). ``kernels``: the step's kernels; a step without the
    all-rows kernel has the walk's launch alone (``WALK_ALONE_MODEL``)."""
    if "_verify_temperature_kernel" in kernels:
        full, lengths, launches = VERIFY_MODEL, VERIFY_MODEL, VERIFY_KERNELS
    else:
        full, lengths, launches = WALK_ALONE_MODEL, WALK_ALONE_LENGTHS, ("_verify_kernel",)
    out = {}
    for kernel in launches:
        if tau is None or tau != tau:  # no tau (nan: not measured for the tree)
            out[kernel] = modeled_device_time(full, VERIFY_CASES.get(name), kernel)
        else:
            cases = VERIFY_WALK_CASES.get(name, {})
            times = {accepted: modeled_device_time(lengths, case, kernel) for accepted, case in cases.items()}
            out[kernel] = None if not times or None in times.values() else \
                times[2] + (tau - 1 - 2) * (times[3] - times[2])
    return None if None in out.values() else out


def draft_expand_device_times(name: str) -> dict | None:
    """{frontier rows (1, 8): the kernel model's device time (s) of a draft_expand launch} for ``name``,
    or None."""
    times = {m: modeled_device_time(DRAFT_EXPAND_MODEL, case) for m, case in DRAFT_EXPAND_CASES.get(name, {}).items()}
    return times if times and None not in times.values() else None


def attention_device_times(name: str, prefix: int) -> dict | None:
    """{query rows N: the kernel model's device time (s) of a tree_attention launch at ``prefix``} for
    ``name``, or None."""
    cases = {N: case for (N, at), case in ATTENTION_CASES.get(name, {}).items() if at == prefix}
    # the attention launch alone: a merge launch, where one follows, stays a launch of the step
    times = {N: modeled_device_time(ATTENTION_MODEL, case, "_tree_attention_kernel") for N, case in cases.items()}
    return times if times and None not in times.values() else None


def attention_cross_check(name: str, costs: dict, tau: float, attention: dict, floors: dict) -> dict:
    """Both steps with every tree_attention launch at the kernel model's device time for its query rows
    (``attention``; no fold tail of this model's own on top) and the speculative step's launches named in
    ``floors`` at theirs: step us by t_min (plain tok/s; speculative / plain tok/s) and the t_min meeting each
    goal."""
    at_rows = {"_tree_attention_kernel": lambda c: attention[min(attention, key=lambda n: abs(n - c.rows))]}

    def at_model(cs, named):  # the attention's own fold tail is inside the modeled time
        return [dataclasses.replace(c, tail=0.0) if c.name == "_tree_attention_kernel" else c
                for c in with_floors(cs, {**named, **at_rows})]

    plain, spec = at_model(costs["plain"], {}), at_model(costs["speculative"], floors)
    by_t = {}
    for t in T_MIN_SWEEP_US:
        p, sp = step_seconds(plain, t * 1e-6), step_seconds(spec, t * 1e-6)
        by_t[str(t)] = {"plain_us": round(p * 1e6, 1), "plain_tok_s": round(1 / p),
                        "speculative_us": round(sp * 1e6, 1), "ratio": round(tau * p / sp, 3)}
    return {"attention_us": {str(n): round(v * 1e6, 1) for n, v in attention.items()}, "by_t_min_us": by_t,
            "plain_goal_t_min_us": t_min_range(lambda t: step_seconds(plain, t) <= 1 / 2000),
            "speculative_goal_t_min_us": t_min_range(
                lambda t: tau / step_seconds(spec, t) >= 2 / step_seconds(plain, t))}


def with_floors(costs: list, floors: dict) -> list:
    """``costs`` with the launches named in ``floors`` at a device time (s, or a function of the launch's Cost)."""
    out = []
    for c in costs:
        floor = floors.get(c.name)
        if callable(floor):
            floor = floor(c)
        out.append(c if floor is None else dataclasses.replace(c, floor=floor))
    return out


def modeled_step(name: str, costs: dict, tau: float, floors: dict) -> dict:
    """The speculative step with the launches named in ``floors`` at a device time (``with_floors``): step us
    and its ratio to plain by t_min (SmolLM2: speculative / plain tok/s at ``tau``; else speculative / plain
    step) and the t_min meeting the goal."""
    plain = costs["plain"]
    spec = with_floors(costs["speculative"], floors)
    tok_ratio = name == "smollm2-135m"
    _, goal = speculative_goal(name, spec, plain, tau)

    def ratio(t):
        s, p = step_seconds(spec, t), step_seconds(plain, t)
        return round(tau * p / s, 3) if tok_ratio and tau == tau else round(s / p, 3)

    return {"goal_t_min_us": goal, "ratio_of": "tok/s" if tok_ratio and tau == tau else "step",
            "by_t_min_us": {str(t): {"step_us": round(step_seconds(spec, t * 1e-6) * 1e6, 1), "ratio": ratio(t * 1e-6)}
                            for t in T_MIN_SWEEP_US}}


def kernel_model_cross_check(costs: dict, gemm_8bit_launches: list) -> dict:
    """The speculative step / plain step with each 8-bit GEMM launch (q8_0_linear, fp8_linear) at the kernel
    model's device time instead of its bytes: at the fitted issue rate, and the issue rate (warp instructions a
    cycle per SM) from which the step is <= 1.3x plain (a launch then takes max(bytes, fitted time x 1.25 /
    rate)), by t_min."""
    with open(KERNEL_MODELS[gemm_8bit_launches[0][0].name]) as f:
        rows = json.load(f)
    device = {}
    for row in rows:  # the GEMM's own launch (fp8_linear's rounding launch is charged in the step as counted)
        k, n = (int(part[1:]) for part in row["case"].split()[2:4])
        gemm = [launch for launch in row["launches"] if launch["kernel"] == gemm_8bit_launches[0][0].name]
        device[(k, n)] = sum(launch["time_s"] - FITTED_LAUNCH_S for launch in gemm)
    spec = costs["speculative"]
    fitted = {id(cost): device[(k, n)] for cost, (n, k) in gemm_8bit_launches}

    def step(rate: float, t_min: float) -> float:
        return step_seconds([dataclasses.replace(c, floor=fitted[id(c)] * FITTED_ISSUE_RATE / rate)
                             if id(c) in fitted else c for c in spec], t_min)

    out = {}
    for t in T_MIN_SWEEP_US:
        plain = step_seconds(costs["plain"], t * 1e-6)
        rates = [r / 100 for r in range(100, 401, 5)]
        meets = [r for r in rates if step(r, t * 1e-6) <= 1.3 * plain]
        out[str(t)] = {"ratio_at_fitted_rate": round(step(FITTED_ISSUE_RATE, t * 1e-6) / plain, 3),
                       "ratio_at_rate_4": round(step(4.0, t * 1e-6) / plain, 3),
                       "rate_meeting_1_3x": meets[0] if meets else None}
    return out


def attention_budget(spec: list, plain: list, verify_layers: set, calibrated: dict, t_min: float) -> float | None:
    """The longest device time (us, 0.1 us steps) of the verify pass's tree_attention launch a layer,
    with its merge at the calibrated model's time, for which the speculative step stays <= 1.3x the
    plain step at ``t_min``; None if none does (the other launches alone exceed it)."""
    budget = 1.3 * step_seconds(plain, t_min)

    def step(x):
        return step_seconds([dataclasses.replace(
            c, floor=(x if c.name == "_tree_attention_kernel" else calibrated.get(c.name, 0.0))
            if c.layer in verify_layers else 0.0) for c in spec], t_min)

    if step(0.0) > budget:
        return None
    lo, hi = 0.0, 100e-6
    while hi - lo > 0.05e-6:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) <= budget else (lo, mid)
    return round(lo * 1e6, 1)


def speculative_goal(name: str, spec: list, plain: list, tau: float) -> tuple[str, str | None]:
    """Issue #29's speculative goal for ``name`` and the t_min values (us, 0 to 10) that meet it: SmolLM2
    speculative >= 2x plain tok/s (None without a measured tau), else a speculative step <= 1.3x a plain one."""
    if name == "smollm2-135m":
        met = t_min_range(lambda t: tau / step_seconds(spec, t) >= 2 / step_seconds(plain, t)) if tau == tau else None
        return "speculative >= 2x plain tok/s", met
    return "speculative step <= 1.3x plain step", t_min_range(
        lambda t: step_seconds(spec, t) <= 1.3 * step_seconds(plain, t))


def goals(name: str, result: dict) -> dict:
    """Each goal of issue #29: the t_min values (us, 0 to 10) that meet it."""
    plain, spec = result["modes"]["plain"]["costs"], result["modes"]["speculative"]["costs"]
    if name == "smollm2-135m":
        met = {"plain >= 2000 tok/s": t_min_range(lambda t: step_seconds(plain, t) <= 1 / 2000)}
    else:
        budget = 1.15 * result["weight_bytes"] / HBM_BYTES_PER_S
        met = {"plain step <= 1.15x one weight read": t_min_range(lambda t: step_seconds(plain, t) <= budget)}
    goal, at = speculative_goal(name, spec, plain, result["tau"])
    if at is not None:  # a measured tau (not NaN) where the goal needs one
        met[goal] = at
    return met


def render(results: dict) -> str:
    tree = f"({TREE.depth}, {TREE.top_k}, {TREE.num_nodes})"
    lines = [f"Modeled H200 step (bf16, B 1, tree {tree}): t = max(bytes / {HBM_BYTES_PER_S / 1e12:.1f} TB/s, "
             f"FLOPs / {BF16_FLOPS_PER_S / 1e12:.0f} TFLOP/s, t_min) per launch, summed.", "",
             "| model | prefix | step | launches (PDL edges) | MB moved | GFLOP | no floor (us) | "
             + " | ".join(f"t_min {t} us: step us (tok/s)" for t in T_MIN_SWEEP_US) + " |",
             "|---|---:|---|---:|---:|---:|---:|" + "---:|" * len(T_MIN_SWEEP_US)]
    for name, by_prefix in results.items():
        for prefix, r in by_prefix["prefixes"].items():
            for mode, m in r["modes"].items():
                cells = " | ".join(f"{m['by_t_min_us'][str(t)]['step_us']} ({m['by_t_min_us'][str(t)]['tok_per_s']})"
                                   for t in T_MIN_SWEEP_US)
                tau = r["tau"] if mode == "speculative" else "-" if mode == "coupled" else 1
                lines.append(f"| {name} | {prefix} | {mode} (tau {tau}) | "
                             f"{m['launches']} ({m['pdl_edges']}) | {m['bytes'] / 1e6:.1f} | {m['flops'] / 1e9:.2f} | "
                             f"{m['step_us_without_floor']} | {cells} |")
    lines += ["", "Goals: the t_min values (us, searched 0 to 10 in steps of 0.01) that meet each.", "",
              "| model | prefix | goal | t_min meeting it (us) |", "|---|---:|---|---:|"]
    for name, by_prefix in results.items():
        for prefix, r in by_prefix["prefixes"].items():
            for goal, value in r["goals"].items():
                lines.append(f"| {name} | {prefix} | {goal} | {value} |")
    for name, by_prefix in results.items():
        for prefix, r in by_prefix["prefixes"].items():
            if "speculative_calibrated_attention" in r:
                lines += ["", f"{name}, prefix {prefix}, speculative with the verify pass's tree_attention at the "
                          "calibrated model's device time (11.7 us + 1.1 us merge a layer): step us by t_min "
                          + ", ".join(f"{t}: {v}" for t, v in r["speculative_calibrated_attention"].items())
                          + f"; <= 1.3x plain for t_min (us) {r['speculative_calibrated_attention_goal']}. "
                          "The longest verify-pass tree_attention launch a layer (merge 1.1 us) that keeps the "
                          "speculative step <= 1.3x plain, us by t_min: "
                          + ", ".join(f"{t}: {'none' if v is None else v}"
                                      for t, v in r["verify_attention_budget_us"].items())]
            goal = "speculative >= 2x plain tok/s" if name == "smollm2-135m" else "speculative step <= 1.3x plain"
            for key in ("speculative_modeled_verify", "speculative_modeled_verify_draft_expand"):
                if key not in r:
                    continue
                m = r[key]
                # a step ratio where no tau was measured for the tree (SmolLM2's goal then not evaluated)
                what = "speculative / plain tok/s" if m["ratio_of"] == "tok/s" else "speculative / plain step"
                met = "not evaluated (no tau)" if m["goal_t_min_us"] is None else m["goal_t_min_us"]
                if "draft_expand_us" in m:
                    expand = " / ".join(f"{v} us" for v in m["draft_expand_us"].values())
                    which = (f"the same with its draft_expand launches too at the kernel model's device time ({expand} "
                             "for the root's row / 8 frontier rows)")
                else:
                    walk = ("a full-depth walk" if m["verify_us"] == m["verify_full_walk_us"] else
                            f"the walk of tau - 1 accepted drafts; {m['verify_full_walk_us']} us for a full-depth walk")
                    per = m["verify_launches_us"]
                    launches = ("its two verify launches" if len(per) == 2 else "its verify launch (the walk alone)")
                    split = "" if len(per) == 1 else " = " + " + ".join(f"{v} us" for v in per.values())
                    which = (f"speculative with {launches} at the kernel model's device time ({m['verify_us']} us"
                             f"{split}, greedy, {walk}; bench/gpu_model.py, not calibrated)")
                lines += ["", f"{name}, prefix {prefix}, {which}: step us ({what}) by t_min "
                          + ", ".join(f"{t}: {v['step_us']} ({v['ratio']}x)" for t, v in m["by_t_min_us"].items())
                          + f"; {goal} for t_min (us) {met}"]
            if "attention_modeled" in r:
                a = r["attention_modeled"]
                rows_us = " / ".join(f"{v} us" for v in a["attention_us"].values())
                lines += ["", f"{name}, prefix {prefix}, both steps with every tree_attention launch at the kernel "
                          f"model's device time ({rows_us} for {' / '.join(a['attention_us'])} query rows, folds "
                          "included) and verify and draft_expand as above: plain us (tok/s), speculative us "
                          "(speculative / plain tok/s) by t_min "
                          + ", ".join(f"{t}: {v['plain_us']} ({v['plain_tok_s']}), {v['speculative_us']} "
                                      f"({v['ratio']}x)" for t, v in a["by_t_min_us"].items())
                          + f"; plain >= 2000 tok/s for t_min (us) {a['plain_goal_t_min_us']}, speculative >= 2x "
                          f"plain tok/s for t_min (us) {a['speculative_goal_t_min_us']}"]
            by_saving = r["plain_step_us_at_measured_t_min_by_pdl_saving_us"]
            lines += ["", f"{name}, prefix {prefix}, plain step at the measured t_min {MEASURED_T_MIN_US} us "
                      f"({r['modes']['plain']['pdl_edges']} of {r['modes']['plain']['launches']} launches PDL edges), "
                      "us by the time each PDL edge saves (us): "
                      + ", ".join(f"{k}: {v}" for k, v in by_saving.items())
                      + ("" if "pdl_saving_for_2000_tok_s_us" not in r else
                         "; >= 2000 tok/s from a saving of "
                         + ("none" if r["pdl_saving_for_2000_tok_s_us"] is None
                            else f"{r['pdl_saving_for_2000_tok_s_us']} us") + " an edge")]
            if "plain_step_us_at_measured_t_min_by_handoff_us" in r:
                by_handoff = r["plain_step_us_at_measured_t_min_by_handoff_us"]
                lines += ["", f"{name}, prefix {prefix}, plain step at the measured t_min {MEASURED_T_MIN_US} us, no "
                          f"PDL saving, its {r['plain_handoffs']} phase hand-offs inside o_proj_mlp launches priced "
                          "at h us each (elsewhere a hand-off is priced as the floor of the launch it replaces): "
                          "us by h: " + ", ".join(f"{k}: {v}" for k, v in by_handoff.items())
                          + ("" if "handoff_for_2000_tok_s_us" not in r else
                             "; >= 2000 tok/s for h up to "
                             + ("none" if r["handoff_for_2000_tok_s_us"] is None
                                else f"{r['handoff_for_2000_tok_s_us']} us"))]
            if "kernel_model_8bit" in r:
                lines += ["", f"{name}, prefix {prefix}, the 8-bit head's GEMM launches at the kernel model's "
                          "device time (bench/results/sm90-compile/*_linear_model.json) instead of their bytes: "
                          "speculative / plain step at the fitted issue rate (1.25 warp instructions a cycle per SM) "
                          "and at 4; the issue rate from which it is <= 1.3x; by t_min (us): "
                          + "; ".join(f"{t}: {v['ratio_at_fitted_rate']}x / {v['ratio_at_rate_4']}x, "
                                      f"{'none' if v['rate_meeting_1_3x'] is None else v['rate_meeting_1_3x']}"
                                      for t, v in r["kernel_model_8bit"].items())]
    for name, by_prefix in results.items():
        prefix = max(by_prefix["prefixes"])
        r = by_prefix["prefixes"][prefix]
        for mode, m in r["modes"].items():
            lines += ["", f"{name}, {mode}, prefix {prefix}, t_min 2 us: where the time goes (largest 12)", "",
                      "| part: kernel | launches | MB | GFLOP | us |", "|---|---:|---:|---:|---:|"]
            for part, v in m["breakdown_t_min_2us"].items():
                lines.append(f"| {part} | {v['launches']} | {v['bytes'] / 1e6:.2f} | {v['flops'] / 1e9:.3f} | "
                             f"{v['seconds']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    global TREE, COUNT_TREE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "launch-count"))
    parser.add_argument("--quick", action="store_true", help="the 3-layer model only")
    parser.add_argument("--counts", help="a pickle of the launch lists: read if it exists, else written")
    parser.add_argument("--coupled", action="store_true",
                        help="also the coupled-sampling speculative step (StaticPolicy(coupled_sampling=True), T 1)")
    parser.add_argument("--models", nargs="+", choices=("smollm2-135m", "llama3-8b-shape"),
                        default=["smollm2-135m", "llama3-8b-shape"])
    parser.add_argument("--head-weights", choices=("q8_0", "fp8"),
                        help="the EAGLE-3 head's matrices as Q8_0 blocks (q8_0_linear on the GPU path) or multiplied "
                             "as fp8 copies (fp8_linear); default bf16")
    parser.add_argument("--depth", type=int, default=TREE.depth,
                        help="the tree's depth (head passes) at top_k 8 and 60 nodes; tau is measured for 6 only")
    args = parser.parse_args()
    if args.depth != TREE.depth:
        TREE, COUNT_TREE = TreeConfig(args.depth, 8, 60), TreeConfig(args.depth, 2, 13)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    tau = json.load(open(TAU_FILE))["tau"] if os.path.exists(TAU_FILE) and TREE.depth == 6 else None
    names = ["tiny-3-layers"] if args.quick else args.models
    results = {}
    cached = {}
    if args.counts and os.path.exists(args.counts):
        with open(args.counts, "rb") as f:
            cached = pickle.load(f)
    for name in names:
        start = time.perf_counter()
        counts = cached.get(name)
        if counts is None or (args.coupled and "coupled" not in counts):
            counts = count(name, COUNT_TREE, args.coupled, args.head_weights)
        cached[name] = counts
        if args.counts:
            with open(args.counts, "wb") as f:
                pickle.dump(cached, f)
        print(f"{name}: counted in {time.perf_counter() - start:.0f} s "
              f"(plain {counts['plain'].total}, speculative {counts['speculative'].total} launches)", flush=True)
        results[name] = {"prefixes": {}}
        for prefix in PREFIXES:
            r = model(name, counts, prefix, tau if tau is not None else float("nan"))
            r["goals"] = goals(name, r)
            results[name]["prefixes"][prefix] = r
    table = render(results)
    for by_prefix in results.values():
        for r in by_prefix["prefixes"].values():
            for m in r["modes"].values():
                del m["costs"]
    os.makedirs(args.out, exist_ok=True)
    meta = {"tree": [TREE.depth, TREE.top_k, TREE.num_nodes], "batch": 1, "dtype": "bfloat16",
            "head_weights": args.head_weights or "bfloat16",
            "hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops_per_s": BF16_FLOPS_PER_S,
            "t_min_sweep_us": T_MIN_SWEEP_US, "tau_source": os.path.relpath(TAU_FILE, ROOT)}
    stem = ("gpu_step_model_quick" if args.quick else "gpu_step_model") \
        + ("" if TREE.depth == 6 else f"_d{TREE.depth}") + ("_coupled" if args.coupled else "") \
        + (f"_{args.head_weights}head" if args.head_weights else "")
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump({**meta, "models": results}, f, indent=1)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
