"""tree_attention's GPU launches without a GPU: ``python bench/tree_attention_audit.py [audit|counts]``.

- ``audit``: compiles every configuration ``gpu_config`` can return (head dims 64 / 128 / 256,
  fp16 / bf16 / fp32, contiguous and paged caches, with and without a tree mask) for sm_90 as the
  JIT would launch it, through ``compile_audit.compile_launch`` (``compile_specialised``: the
  launcher's constexprs and options, and the JIT's alignment / divisibility specialisation of
  the real argument tensors), and prints per configuration the registers, ptxas spill bytes,
  spill instructions (all, and inside a loop), shared memory beside ``shared_bytes()``'s figure,
  and the blocks per SM they allow. Exit status 1 if a block needs more shared memory than an
  H200 allows or spills inside a loop.
- ``counts``: per goal shape (Llama-3-8B heads 32 / 8 / 128, N 64, bf16, 16-token pages,
  prefix 4k / 16k, B 1 / 8 / 32), what a launch requests: programs, waves, K/V bytes
  requested (every program reads its split of the prefix and the tree slots once), fp32
  partial-result bytes written and read back, FLOPs of the two matrix products, and a simple
  time estimate: waves x max(per-program FLOPs at the SM's share of 790 TFLOP/s, per-program
  bytes at its share of 4.8 TB/s) + the partials at 4.8 TB/s + 3 us per launch.

- ``programs B PREFIX``: the flash-decoding split programs of one goal shape (the cost model's
  goal case, bench/gpu_model.py: compiled SASS counted per statement run in the interpreter, 2
  sampled (KV head, node block) groups): each sampled program's prefix tiles and warp
  instructions, the cost of a prefix tile and of the per-program work (Q load, pipeline
  prologue, the partials' epilogue) fitted over the programs without tree tiles, the tree
  tiles' cost from the last split, and the issue floors of the launch beside its bytes and the
  60% goal (docs/gpu_kernels.md, "B 1 at a 4k prefix").

Run without ``TRITON_INTERPRET`` for ``audit`` and ``programs`` (they compile); ``counts`` needs
nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile_audit  # noqa: E402

HEADS = (32, 8, 128)
LOCAL_MEMORY = re.compile(r"^(@!?U?P\w+\s+)?(LDL|STL)\b")


def compile_launch(launch: compile_audit.Launch, arch: int = 90) -> dict:
    """Compile one recorded launch for sm_``arch`` through ``compile_audit.compile_launch`` (the
    JIT's own binder and option parsing, ``compile_audit.compile_specialised``): registers, the
    ptxas spill bytes (``compile_audit.ptxas_spills``), the spill instructions of the SASS (all,
    and inside a loop), static and dynamic shared bytes of a block, blocks per SM."""
    audit = compile_audit.compile_launch(launch, compile_audit.GPUTarget("cuda", arch, 32))
    spill_instructions = loop_spills = 0
    for line in audit.sass.splitlines():
        m = compile_audit.INSTRUCTION.match(line)
        if m and LOCAL_MEMORY.match(m.group(2)):
            spill_instructions += 1
            offset = int(m.group(1), 16)
            loop_spills += any(loop.start <= offset <= loop.end for loop in audit.loops)
    return dict(kernel=audit.kernel, registers=audit.registers, stack_bytes=audit.stack_bytes,
                spill_stores=audit.spill_stores, spill_loads=audit.spill_loads,
                spill_instructions=spill_instructions, loop_spills=loop_spills,
                static_shared=audit.shared_static, shared=audit.shared_dynamic, blocks_per_sm=audit.blocks_per_sm,
                hot_loop_instructions=audit.hot_loop_instructions)


def case_tensors(D, dtype, causal, paged, N=64, heads=(32, 8), B=1, prefix=100, page=16):
    """Small tensors of the goal layout (the JIT specialises on alignment and divisibility,
    not on sizes)."""
    Hq, Hkv = heads
    capacity = prefix + N + 2 * page
    q = torch.randn(B, N, Hq, D).to(dtype)
    seqlens = torch.full((B,), prefix, dtype=torch.int32)
    if paged:
        pages = triton.cdiv(capacity, page)
        k = torch.randn(B * pages, page, Hkv, D).to(dtype)
        table = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
    else:
        k, table = torch.randn(B, capacity, Hkv, D).to(dtype), None
    mask = None if causal else torch.ones(B, N, triton.cdiv(N, 64), dtype=torch.int64)
    return q, k, k.clone(), seqlens, mask, table


def compile_config(config, D, dtype, causal, paged, num_splits=1) -> dict:
    """Compile the attention kernel of one launch with ``config`` (the merge kernel is left out)."""
    from eagle_kernels.triton import tree_attention as tta

    q, k, v, seqlens, mask, table = case_tensors(D, dtype, causal, paged)
    launches: list[compile_audit.Launch] = []
    with compile_audit.modeled_gpu(launches, [f"tree_attention D{D} {dtype} causal={causal} paged={paged}"]):
        tta._launch(q, k, v, seqlens, mask, block_table=table, num_splits=num_splits, config=config)
    return compile_launch(next(launch for launch in launches if launch.kernel.fn.__name__ == "_tree_attention_kernel"))


def audit() -> int:
    from eagle_kernels.triton import tree_attention as tac

    failures = 0
    for config, layouts in tac.every_gpu_config().items():
        # fp16 compiles as bf16 does (same tiles, same shared memory): bf16 stands for both.
        layouts = {(D, torch.bfloat16 if dtype == torch.float16 else dtype, causal, paged)
                   for D, dtype, causal, paged in layouts}
        for D, dtype, causal, paged in sorted(layouts, key=str):
            element_size = dtype.itemsize
            result = compile_config(config, D, dtype, causal, paged)
            estimate = config.shared_bytes(D, element_size, causal, paged)
            total = result["shared"] + result["static_shared"]
            occupancy = tac.blocks_per_sm(result["shared"], result["registers"], config.num_warps)
            ok = total <= tac.SHARED_MEMORY_BUDGET and result["loop_spills"] == 0
            failures += not ok
            print(json.dumps(dict(config=f"m{config.block_m}k{config.block_k}w{config.num_warps}s{config.num_stages}"
                                  f"r{config.max_registers}", D=D, dtype=str(dtype)[6:], causal=causal, paged=paged,
                                  registers=result["registers"], stack_bytes=result["stack_bytes"],
                                  spill_bytes=[result["spill_stores"], result["spill_loads"]],
                                  spills=result["spill_instructions"], loop_spills=result["loop_spills"],
                                  shared=result["shared"], estimate=estimate, blocks_per_sm=occupancy,
                                  target_blocks_per_sm=config.blocks_per_sm, ok=ok)), flush=True)
    return 1 if failures else 0


def check(cases) -> None:
    """Compile each (D, dtype name, causal, paged[, heads]) case with the configuration the
    launcher picks for the goal shape (N 64, 32 / 8 heads; ``heads`` (request, KV head) pairs, 132
    for the wide blocks of B 8 and up) and print one JSON line per case (the tests' few)."""
    from eagle_kernels.triton import tree_attention as tta

    for D, dtype_name, causal, paged, *heads in cases:
        dtype = getattr(torch, dtype_name)
        config = tta.gpu_config(64, HEADS[0] // HEADS[1], D, dtype, causal, paged, heads=heads[0] if heads else None)
        result = compile_config(config, D, dtype, causal, paged)
        element_size = dtype.itemsize
        result.update(case=[D, dtype_name, causal, paged, *heads], config=dataclasses.asdict(config),
                      estimate=config.shared_bytes(D, element_size, causal, paged))
        print(json.dumps(result), flush=True)


# The H200 figures the estimate uses: SMs, dense bf16 tensor-core peak, HBM bandwidth, and a
# launch's cost inside a CUDA graph (an assumption, not a measurement).
SMS, PEAK_FLOPS, HBM_BYTES_PER_S, LAUNCH_S = 132, 790e12, 4.8e12, 2e-6
GOAL_SHAPES = [(B, 64, prefix) for B in (1, 8, 32) for prefix in (4096, 16384)]
# The launcher before the rewrite (commit 700a43c), bf16 D 128 paged tree launches as the bench
# runs them: 128-row blocks (8 warps, 2 stages) unless 64-row ones (4 warps, 3 stages) fill one
# wave where 128-row ones do not; splits while programs < SMs, for 2 waves. Registers and
# shared memory compiled from that commit here (triton 3.9, sm_90, the JIT's specialisation).
BEFORE_COMPILED = {128: dict(registers=194, shared=163_840, num_warps=8, block_k=64),
                   64: dict(registers=232, shared=114_944, num_warps=4, block_k=64)}
# Graph-replay times of that kernel measured on an H200 (the launcher's default in the sweep
# recorded in commit f062674's GPU_CONFIG comment), ms: the calibration of the estimate.
BEFORE_MEASURED_MS = {(1, 16384): 0.105, (8, 4096): 0.193, (32, 16384): 2.43}


def _before_plan(B, N, prefix, Hq, Hkv):
    group = Hq // Hkv
    programs = lambda rows: B * Hkv * triton.cdiv(N, rows // group)  # noqa: E731
    rows = 64 if programs(128) < SMS <= programs(64) else 128
    figures = BEFORE_COMPILED[rows]
    capacity = prefix + N
    splits = 1 if programs(rows) >= SMS else max(1, min(32, triton.cdiv(2 * SMS, programs(rows)),
                                                         capacity // (4 * figures["block_k"])))
    return rows, splits, figures


def _after_plan(B, N, prefix, Hq, Hkv, D, compiled):
    from eagle_kernels.triton import tree_attention_config as tac

    group = Hq // Hkv
    config = tac.gpu_config(N, group, D, torch.bfloat16, False, True, heads=B * Hkv, sms=SMS, capacity=prefix + N)
    splits = tac.split_layout(N, group, B * Hkv, prefix + N, config, SMS).splits
    if compiled:
        result = compile_config(config, D, torch.bfloat16, False, True)
        figures = dict(registers=result["registers"], shared=result["shared"])
    else:
        figures = dict(registers=config.max_registers or tac.DEFAULT_REGISTERS,
                       shared=config.shared_bytes(D, 2, False, True))
    figures.update(num_warps=config.num_warps, block_k=config.block_k)
    return config.block_m, splits, figures


def plan_counts(B, N, prefix, heads, rows, splits, figures) -> dict:
    """What one launch requests at bf16: programs, waves, K/V bytes (each program reads its
    split of the prefix and the tree slots up to its block's last node, once per tile), fp32
    partial bytes (written and read back), FLOPs of both products over the padded rows (the
    dots compute them all), and the estimate."""
    from eagle_kernels.triton import tree_attention_config as tac

    Hq, Hkv, D = heads
    group = Hq // Hkv
    nodes = rows // group
    node_blocks = triton.cdiv(N, nodes)
    programs = B * Hkv * node_blocks * splits
    occupancy = tac.blocks_per_sm(figures["shared"], figures["registers"], figures["num_warps"])
    waves = triton.cdiv(programs, SMS * occupancy)
    row_bytes = Hkv * D * 2 * 2  # K and V of one position, all KV heads
    tree_keys = sum(min(N, (n + 1) * nodes) for n in range(node_blocks))
    kv_bytes = B * (node_blocks * prefix + tree_keys) * row_bytes
    partial_bytes = 0 if splits == 1 else 2 * splits * B * N * Hq * (D + 1) * 4
    program_keys = triton.cdiv(prefix, splits) + N
    program_flops = 4 * rows * program_keys * D
    useful_flops = 4 * B * Hq * N * (prefix + (N + 1) / 2) * D
    compute_s = waves * occupancy * program_flops / (PEAK_FLOPS / SMS)
    memory_s = (kv_bytes + partial_bytes) / HBM_BYTES_PER_S
    launches = 1 + (splits > 1)
    estimate_s = max(compute_s, memory_s) + launches * LAUNCH_S
    return dict(rows=rows, splits=splits, programs=programs, blocks_per_sm=occupancy, waves=waves,
                kv_MB=kv_bytes / 1e6, partial_MB=partial_bytes / 1e6, useful_GFLOP=useful_flops / 1e9,
                estimate_us=estimate_s * 1e6, estimate_TFLOPs=useful_flops / estimate_s / 1e12)


def counts(compiled: bool) -> None:
    """Before / after per goal shape, and the calibration: the before-estimate over the measured
    time, applied to the after-estimate (the share of its model a Triton kernel of this
    structure reached on the H200)."""
    Hq, Hkv, D = HEADS
    efficiency = []
    rows_out = []
    for B, N, prefix in GOAL_SHAPES:
        before = plan_counts(B, N, prefix, HEADS, *_before_plan(B, N, prefix, Hq, Hkv))
        after = plan_counts(B, N, prefix, HEADS, *_after_plan(B, N, prefix, Hq, Hkv, D, compiled))
        measured = BEFORE_MEASURED_MS.get((B, prefix))
        if measured:
            before["measured_us"] = measured * 1e3
            before["measured_TFLOPs"] = before["useful_GFLOP"] / measured  # GFLOP / ms = TFLOP/s
            efficiency.append(before["estimate_us"] / before["measured_us"])
        rows_out.append((f"B{B}-N{N}-prefix{prefix}", before, after))
    share = sum(efficiency) / len(efficiency)
    for shape, before, after in rows_out:
        after["calibrated_TFLOPs"] = after["estimate_TFLOPs"] * share
        after["calibrated_share_of_peak"] = after["calibrated_TFLOPs"] * 1e12 / PEAK_FLOPS
        print(json.dumps(dict(shape=shape, before=before, after=after,
                              model_share_reached_before=round(share, 3)), default=lambda x: round(x, 3)))


OPCODE_CLASSES = [  # (class, opcodes): the instruction mix of a loop
    ("MMA", ("HGMMA", "HMMA")), ("MMA fences/waits", ("WARPGROUP",)), ("MUFU", ("MUFU",)),
    ("FP32", ("FMUL", "FADD", "FFMA", "FMNMX", "FSEL", "FSETP", "FCHK")), ("convert", ("F2FP", "F2F", "I2F", "F2I")),
    ("shuffle", ("SHFL",)), ("memory", ("LDG", "LDGSTS", "LDS", "STS", "LDSM", "STG", "LDGDEPBAR", "DEPBAR")),
    ("barrier", ("BAR", "MEMBAR", "FENCE")), ("branch", ("BRA", "BSSY", "BSYNC")),
]


def loop_mix(sass: str, loop) -> dict:
    """Instruction classes of one SASS loop, and the overlap its MMAs get within a warp: for each
    wgmma group (its last HGMMA carries ``gsb0``), the other instructions the warp issues before
    the ``WARPGROUP.DEPBAR`` that waits for it, around the loop's back edge (0: the warp waits at
    once, nothing of its own runs under that MMA)."""
    mix = dict.fromkeys([name for name, _ in OPCODE_CLASSES] + ["integer/address/other"], 0)
    texts = []
    for line in sass.splitlines():
        m = compile_audit.INSTRUCTION.match(line)
        if m and loop.start <= int(m.group(1), 16) <= loop.end:
            texts.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(2)))
    opcodes = [text.split()[0].split(".")[0] for text in texts]
    for opcode in opcodes:
        mix[next((name for name, ops in OPCODE_CLASSES if opcode in ops), "integer/address/other")] += 1
    under_mma = []
    for i, text in enumerate(texts):
        if opcodes[i] == "HGMMA" and "gsb0" in text:
            issued = 0
            for j in range(1, len(texts)):
                k = (i + j) % len(texts)
                if texts[k].startswith("WARPGROUP.DEPBAR"):
                    break
                issued += opcodes[k] not in ("HGMMA", "WARPGROUP")
            under_mma.append(issued)
    return dict(instructions=loop.instructions, mix=mix, issued_under_mma=under_mma)


def mix(cases) -> None:
    """Per (D, dtype name, causal, paged) case at the goal shape's configuration: each innermost
    loop's instruction mix (one JSON line per case)."""
    from eagle_kernels.triton import tree_attention as tta

    for D, dtype_name, causal, paged in cases:
        dtype = getattr(torch, dtype_name)
        config = tta.gpu_config(64, HEADS[0] // HEADS[1], D, dtype, causal, paged)
        q, k, v, seqlens, mask, table = case_tensors(D, dtype, causal, paged)
        launches: list[compile_audit.Launch] = []
        with compile_audit.modeled_gpu(launches, ["mix"]):
            tta._launch(q, k, v, seqlens, mask, block_table=table, num_splits=1, config=config)
        audit = compile_audit.compile_launch(launches[0], compile_audit.GPUTarget("cuda", 90, 32))
        loops = [loop_mix(audit.sass, loop) for loop in audit.loops if loop.innermost]
        print(json.dumps(dict(case=[D, dtype_name, causal, paged], config=dataclasses.asdict(config),
                              registers=audit.registers, loops=loops)), flush=True)


def programs(B: int, prefix: int) -> None:
    """The split programs of the goal shape (B, N 64, ``prefix``): see the module docstring."""
    import inspect

    import gpu_model as gm
    import numpy as np

    launches: list[compile_audit.Launch] = []
    with compile_audit.modeled_gpu(launches, ["programs"]):
        gm._tree_attention(B, 64, prefix)()
    launch = launches[0]
    counts = gm.interpret(launches[:1], 2)[0]
    audit = compile_audit.compile_launch(launch, compile_audit.GPUTarget("cuda", 90, 32))
    in_loop, out_loop, outside = gm.sass_by_line(audit.sass, launch.kernel.fn)
    # The prefix loop's tile statement: the first _attend_tile call of the kernel.
    src, first = inspect.getsourcelines(launch.kernel.fn)
    tile_line = next(first + i for i, text in enumerate(src) if "_attend_tile(" in text)
    tree_line = max(first + i for i, text in enumerate(src) if "_attend_tile(" in text)
    splits = launch.grid[1] if len(launch.grid) > 1 else 1
    rows = []
    for c in counts:
        rows.append(dict(instructions=gm.dynamic_instructions(c, in_loop, out_loop, outside),
                         prefix_tiles=c.lines.get(tile_line, 0), tree_tiles=c.lines.get(tree_line, 0)))
    for i, row in enumerate(rows):
        print(json.dumps(dict(split=i % splits, **row)))
    plain = [r for r in rows if not r["tree_tiles"]]
    warps = audit.num_warps
    rate = gm.ISSUE_RATE * compile_audit.H200.clock_hz
    us = lambda warp_instructions: warp_instructions * warps / rate * 1e6  # noqa: E731
    programs_total = launch.grid[0] * splits
    mean = sum(r["instructions"] for r in rows) / len(rows)
    summary = dict(case=f"B{B} N64 prefix{prefix}", programs=programs_total, splits=splits, warps=warps,
                   registers=audit.registers, slowest_us=us(max(r["instructions"] for r in rows)),
                   mean_us=us(mean), balanced_132_us=us(mean) * programs_total / compile_audit.H200.sms)
    if len({r["prefix_tiles"] for r in plain}) > 1:
        slope, intercept = np.polyfit([r["prefix_tiles"] for r in plain], [r["instructions"] for r in plain], 1)
        tree = [r for r in rows if r["tree_tiles"]]
        tree_cost = (sum(r["instructions"] - intercept - slope * r["prefix_tiles"] for r in tree) / len(tree)
                     if tree else 0.0)
        work = mean - intercept  # the tiles' share of a mean program
        summary.update(per_tile=round(float(slope), 1), per_program=round(float(intercept), 1),
                       tree_tiles_cost=round(float(tree_cost), 1),
                       tiles_only_balanced_132_us=us(work) * programs_total / compile_audit.H200.sms)
    flops = 4 * B * 64 * 32 * (prefix + 32) * 128
    summary["goal_60pct_us"] = flops / (0.6 * compile_audit.H200.dense_bf16_flops) * 1e6
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in summary.items()}))


def main(argv) -> int:
    what = argv[0] if argv else "audit"
    if what in ("audit", "check", "mix", "programs") and os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: interpreted kernels cannot be compiled")
    if what == "audit":
        return audit()
    if what == "check":
        check(json.loads(argv[1]))
        return 0
    if what == "mix":
        mix(json.loads(argv[1]) if len(argv) > 1 else [[128, "bfloat16", False, False], [128, "bfloat16", False, True]])
        return 0
    if what == "counts":
        counts(compiled="--compile" in argv)
        return 0
    if what == "programs":
        programs(int(argv[1]), int(argv[2]))
        return 0
    raise SystemExit(f"unknown command {what!r}: audit, check CASES_JSON, mix [CASES_JSON], counts [--compile], "
                     "programs B PREFIX")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
