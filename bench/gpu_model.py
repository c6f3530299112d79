"""A cost model of the Triton launches on an H200, from the CPU: ``python bench/gpu_model.py MODE``.

Modes
-----
``goals``      the goal shapes of the GPU kernel issue: modeled time beside the roofline bound.
``calibrate``  the kernels of the one H200 run (``--package`` points at that commit's
               ``eagle_kernels``), the run's benchmark shapes, predicted beside measured.
``smoke``      one small shape per op (CI: python_tests/ops/test_gpu_model.py).
``decode``     tree_attention at the decoding step's shapes with few (request, KV head) pairs
               (SmolLM2-135M's verify pass and a head tree, a Llama-3-8B-headed tree at a 1k
               cache): the launcher's configuration and split count beside the 128-row blocks
               they replace (``gpu_config`` without the capacity).
``calibrate --bench-json OUT/bench.json`` models the current package beside the times of a
pytest-benchmark JSON (bench/gpu_check.sh's), e.g. after a GPU check.

Per launch (the launchers are driven as in bench/compile_audit.py: a modeled H200, launches
recorded, not run):

1. compile as the JIT would (compile_audit.compile_launch): registers, shared memory, blocks per
   SM, and the SASS with its source lines (``nvdisasm -gi``);
2. run a sample of the launch's programs in Triton's interpreter (the other program ids are
   skipped; ``tl.num_programs`` still answers the full grid) with counters on the interpreter's
   builder: bytes each load and store requests and the distinct 32-byte sectors they touch,
   ``tl.dot`` FLOPs, block reductions, the serial memory latencies of an in-order warp (a load
   issues when its address is ready; an operation using a loaded value waits for it), and how
   often each statement of the kernel runs;
3. dynamic warp instructions of a program = sum over SASS instructions of the runs of the kernel
   line each comes from (its outermost inlined call site), times the warps of a block;
4. time = launch overhead + waves x max(issue, latency chain, bytes / 4.3 TB/s,
   FLOPs / 790 TFLOP/s, warpgroup chain), where a wave is the programs resident at once (blocks
   per SM x 132), issue = resident blocks x warp instructions / (issue rate x 1.98 GHz) per SM,
   and the chain is the serial latencies x the memory latency (divided by num_stages in kernels
   with ``tl.dot``, whose loops the compiler pipelines). The warpgroup chain (kernels with
   ``tl.dot``): a warp waits for its own MMA results before the instructions that use them, so
   one warpgroup's time is its share of the FLOPs at the SM's tensor rate plus its own
   instructions at a scheduler's share of the issue rate; MMAs overlap other instructions only
   across warpgroups (several per block, or several blocks per SM). A launch of one wave or less
   is also bounded below by its slowest sampled program (its own instructions at the SM's issue
   rate, and its chain).
5. a cooperative kernel (``COOPERATIVE_KERNELS``: verify's walk, whose programs share each phase's
   chunks through atomic counters) is counted in segments between its protocol's atomics and
   composed in parallel: per request, its phases in rounds over the request's resident programs,
   each then merged by one program (``LaunchModel._finish_cooperative``).

Constants: bandwidth, FLOP rate, clock and SM count are the modeled card's (the H200's unless
``--device`` or ``--device-limits`` picks another: bench/compile_audit.py ``DEVICES``, or the
figures a GPU check measured on its card); memory latency 0.8 us
(a dependent HBM load under load); the launch overhead (host time per Triton launch, as the benchmarks
measure wall time) and the issue rate (warp instructions per clock per SM) are fitted on the
H200 run (``calibrate``), see docs/gpu_model.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import time
import typing
from collections import Counter

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compile_audit  # noqa: E402
from compile_audit import DEVICE  # noqa: E402

# ``--package DIR`` (an older commit's eagle_kernels) goes first on the path before this module
# imports the package: imported from elsewhere first, every later import would get that one.
if __name__ == "__main__" and "--package" in sys.argv[:-1]:
    sys.path.insert(0, sys.argv[sys.argv.index("--package") + 1])
try:  # a package from before programmatic dependent launch (--package f836145, the calibration's) has no _pdl
    from eagle_kernels.triton import _pdl  # noqa: E402
except ImportError:
    _pdl = None

# Fitted on the H200 run (docs/gpu_model.md, "Calibration"); --fit refits them.
LAUNCH_OVERHEAD_S = 58e-6
ISSUE_RATE = 1.25  # warp instructions per clock per SM (4 schedulers at most)
MEMORY_LATENCY_S = 0.8e-6
# COOPERATIVE_KERNELS and GROUP_TAIL_KERNELS only (their programs wait on each other's results
# through L2 and re-read small tables): a dependent load of sectors read or written before in the
# same segment (one program's claimed chunk or merge; for a group-tail kernel, the same program;
# not volatile) hits the SM's L1; an atomic, a volatile load or a load of sectors the launch
# touched before (another segment or program, maybe another SM) goes to L2; the rest to DRAM
# (MEMORY_LATENCY_S). Public microbenchmarks put Hopper's L1 hit near 40 cycles and
# an L2 hit at 260-480; not calibrated here.
L1_LATENCY_S = 0.02e-6
L2_LATENCY_S = 0.2e-6
SECTOR = 32
ANNOTATION = re.compile(r'//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')


# --------------------------------------------------------------------------------------------
# Counting in the interpreter.


@dataclasses.dataclass
class Counts:
    """What one program did."""

    load_bytes: int = 0
    load_sectors: int = 0
    store_bytes: int = 0
    store_sectors: int = 0
    flops: int = 0
    reductions: int = 0
    chain: int = 0  # memory latencies the program waits for in sequence (in-order warp)
    lines: Counter = dataclasses.field(default_factory=Counter)
    # Bytes each statement (keyed as ``lines``) loaded over all its runs: a loop's unroll factor (``unroll_factor``).
    line_loads: Counter = dataclasses.field(default_factory=Counter)
    # A helper statement's key (see ``sass_by_line``): the calls of its helper in which it ran (``runs``).
    entered: Counter = dataclasses.field(default_factory=Counter)
    # COOPERATIVE_KERNELS: the program's work cut at its claim and done atomics, in order.
    segments: list = dataclasses.field(default_factory=list)

    @property
    def dram_bytes(self) -> int:
        return (self.load_sectors + self.store_sectors) * SECTOR


def _ready(*values) -> int:
    """When the latest of ``values`` is ready, in memory latencies since the program began."""
    ready = 0
    for v in values:
        attr = getattr(v, "attr", None)
        if isinstance(attr, dict):
            ready = max(ready, attr.get("ready", 0))
    return ready


def statement_lines(kernel_fn) -> dict[int, int]:
    """File line -> first line of the statement it belongs to (for a compound statement, its
    header lines only): Python reports a multi-line statement's lines several times per run,
    the SASS attributes instructions to any of them."""
    import ast
    import inspect
    import textwrap

    lines, first = inspect.getsourcelines(kernel_fn)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        end = node.end_lineno
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            end = body[0].lineno - 1
        for line in range(node.lineno, end + 1):
            out.setdefault(line + first - 1, node.lineno + first - 1)
    # ast.walk visits outer statements first: inner simple statements must win.
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not isinstance(getattr(node, "body", None), list):
            for line in range(node.lineno, node.end_lineno + 1):
                out[line + first - 1] = node.lineno + first - 1
    return out


class Unrolled(typing.NamedTuple):
    """A statement in the body of a ``tl.static_range`` loop, as ``sass_by_line`` keys it: the
    compiler unrolls the loop, so the SASS holds one copy of the statement per iteration, all
    attributed to its line, while the interpreter runs the statement once per iteration too. Its
    copies run once per run of the whole loop: ``header``'s count less the iterations (the count of
    ``first``, the body's first statement: Python reports a ``for`` header once more than its body)."""

    statement: int
    header: int
    first: int


def static_range_bodies(kernel_fn) -> dict[int, Unrolled]:
    """File line of each statement inside a ``static_range`` loop of ``kernel_fn`` -> its key."""
    import ast
    import inspect
    import textwrap

    lines, first = inspect.getsourcelines(kernel_fn)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    out = {}
    for node in ast.walk(tree):
        call = getattr(node, "iter", None) if isinstance(node, ast.For) else None
        name = getattr(getattr(call, "func", None), "attr", getattr(getattr(call, "func", None), "id", None))
        if name != "static_range":
            continue
        header, body_first = node.lineno + first - 1, node.body[0].lineno + first - 1
        for inner in node.body:
            for stmt in ast.walk(inner):
                if isinstance(stmt, ast.stmt):
                    line = stmt.lineno + first - 1
                    out[line] = Unrolled(line, header, body_first)
    return out


def helper_statements(kernel_fn) -> dict[tuple[str, str], dict]:
    """{(real file, name): {file line: statement key}} of the ``@triton.jit`` helpers the kernel can
    call: those in its module's namespace and, transitively, in the namespaces of the modules
    they come from (verify's kernel calls verify_rows.py's passes, which call its reductions).
    Their bodies are inlined into the kernel; a loop or branch inside one (a pass over a chunk's
    tiles, a conditional rescale) runs as often as it is entered or taken, so its statements are
    counted per call site (see ``sass_by_line``). A statement key is its first line in the kernel's
    own file, (file name, first line) in another file."""
    import inspect

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    file = os.path.realpath(kernel_fn.__code__.co_filename)
    out = {}
    modules, seen = [inspect.getmodule(kernel_fn)], set()
    while modules:
        module = modules.pop()
        if module is None or module.__name__ in seen:
            continue
        seen.add(module.__name__)
        for value in vars(module).values():
            fn = getattr(value, "fn", None) if isinstance(value, (JITFunction, InterpretedFunction)) else None
            if fn is None or fn is kernel_fn:
                continue
            where = os.path.realpath(fn.__code__.co_filename)
            if (where, fn.__name__) in out:
                continue
            lines = statement_lines(fn)
            if where != file:
                name = os.path.basename(where)
                lines = {line: (name, first) for line, first in lines.items()}
            out[(where, fn.__name__)] = lines
            modules.append(inspect.getmodule(fn))
    return out


class Cooperative(typing.NamedTuple):
    """How the programs of a group (one request) share a kernel's work: a sequence of phases,
    each cut into ``groups_kwarg`` chunks. A program takes a chunk with the atomic at ``claim``
    (statement source text), reports it done with the atomic at ``done``; the program whose done
    returns the chunk count less one merges the phase's results and opens the next phase
    (verify's walk: verify_walk.py)."""

    claim: str
    done: str
    groups_kwarg: str


# The interpreter runs one program at a time, so the first program of a group claims every
# chunk of every phase and the others find the work done: counted per program, that is one
# program holding all the work (the figures of docs/gpu_model.md before this). These kernels'
# programs are counted in segments cut at the claims and dones, and ``cooperative_time`` puts
# them back in parallel: a phase's chunks run on the group's resident programs at once.
COOPERATIVE_KERNELS = {
    "_verify_kernel": Cooperative(claim="claim = tl.atomic_add(claims + phase, 1)",
                                  done="if tl.atomic_add(dones + phase, 1) == SPLITS - 1:",
                                  groups_kwarg="SPLITS"),
}


@dataclasses.dataclass
class Segment:
    """A stretch of one program's work between two atomics of its group's protocol: ``role`` is
    ``chunk`` (a claimed chunk, up to and with its done), ``merge`` (after the phase's last
    done, up to the next claim: the merge, the walk's next step, the next claim's wait) or
    ``other`` (before the first claim, and after a done that was not the last one).
    ``chain`` is counted from the segment's start."""

    role: str
    counts: Counts
    start_clock: int = 0
    done: bool = False  # a chunk that reported done (a claim past the last chunk does not)


def cooperative_statements(kernel_fn, protocol: Cooperative) -> tuple[int, int]:
    """The file lines of the claim and done statements of ``kernel_fn``."""
    import inspect

    lines, first = inspect.getsourcelines(kernel_fn)
    found = {}
    for i, text in enumerate(lines):
        for role, statement in (("claim", protocol.claim), ("done", protocol.done)):
            if text.strip() == statement:
                found.setdefault(role, i + first)
    if set(found) != {"claim", "done"}:
        raise RuntimeError(f"{kernel_fn.__name__}: the cooperative protocol's statements were not found "
                           f"(looked for {protocol.claim!r} and {protocol.done!r})")
    return found["claim"], found["done"]


@contextlib.contextmanager
def counting(kernel_fn, counts_of_program: list[Counts], groups: int = 0):
    """Counters on the interpreter's builder for the duration of the block; each program
    appends its Counts. ``kernel_fn`` is the kernel's Python function (its lines are traced).
    ``groups``: a COOPERATIVE_KERNELS kernel's chunk count a phase; its programs' work is also
    recorded in segments (``Counts.segments``), and an atomic's result costs a memory latency."""
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    saved = {}
    current = [Counts()]
    protocol = COOPERATIVE_KERNELS.get(kernel_fn.__name__) if groups else None
    claim_line, done_line = cooperative_statements(kernel_fn, protocol) if protocol else (None, None)
    segment: list[Segment | None] = [Segment("other", Counts()) if protocol else None]

    def targets():
        """The Counts an operation adds to: the program's, and its open segment's."""
        return (current[0],) if segment[0] is None else (current[0], segment[0].counts)

    def cut(role):
        """Close the open segment (its chain from its start) and open one of ``role``."""
        closed = segment[0]
        closed.counts.chain = max(0, closed.counts.chain - closed.start_clock)
        if closed.counts.lines or closed.counts.load_bytes or closed.role != "other":
            current[0].segments.append(closed)
        segment[0] = Segment(role, Counts(), clock[0])
        segment[0].counts.chain = clock[0]
        in_segment.clear()

    # An in-order warp: a load issues when its address and mask are ready and its result is
    # ready one memory latency later; any other operation waits for its inputs. ``clock`` is
    # the program's time in memory latencies: loads in flight together overlap, a load whose
    # result is used before the next load is issued costs a whole latency. The operations of a
    # ``tl.static_range`` body issue as soon as their inputs are ready, from the start of the loop's
    # run (``issue_base``): the compiler unrolls it and issues its loads ahead of their first use
    # (q8_0_linear's blocks: 16 LDGSTS an iteration), so its blocks' loads overlap.
    clock = [0]
    issue_base = [None]

    # The interpreter's create_load / create_store call create_masked_load / create_masked_store:
    # a memory operation inside another is the same access and is not counted again (counting
    # both doubled every unmasked load's bytes and sectors).
    depth = [0]
    memory_ops = ("create_masked_load", "create_load", "create_masked_store", "create_store")
    atomics = ("create_atomic_rmw", "create_atomic_cas")
    # Cooperative and group-tail kernels: sectors the open segment (or program) has read or written,
    # and the launch.
    cached = protocol is not None or kernel_fn.__name__ in GROUP_TAIL_KERNELS
    in_segment: set = set()
    in_launch: set = set()

    def load_latency(sectors: set, volatile: bool) -> float:
        """A cooperative or group-tail kernel's dependent load of ``sectors``, in memory latencies (see
        L1_LATENCY_S)."""
        cost = 1.0
        if not volatile and sectors <= in_segment:
            cost = L1_LATENCY_S / MEMORY_LATENCY_S
        elif volatile or sectors <= in_launch:
            cost = L2_LATENCY_S / MEMORY_LATENCY_S
        in_segment.update(sectors)
        in_launch.update(sectors)
        return cost
    code_name, code_file = kernel_fn.__name__, kernel_fn.__code__.co_filename

    def kernel_statement():
        """The kernel statement running now (the caller's frames up to the kernel's)."""
        frame = sys._getframe(2)
        while frame is not None and not (frame.f_code.co_name == code_name and frame.f_code.co_filename == code_file):
            frame = frame.f_back
        return None if frame is None else statement.get(frame.f_lineno, frame.f_lineno)

    def wrap(name, fn):
        def wrapped(self, *args, **kwargs):
            if name in memory_ops:
                depth[0] += 1
                try:
                    result = fn(self, *args, **kwargs)
                finally:
                    depth[0] -= 1
                if depth[0]:  # nested: counted by the outer call
                    return result
            else:
                result = fn(self, *args, **kwargs)
            loads = name in ("create_masked_load", "create_load")
            stores = name in ("create_masked_store", "create_store")
            if issue_base[0] is not None:  # in an unrolled body: as soon as its inputs are (from the run's start)
                ready = max(issue_base[0], _ready(*args, *kwargs.values()))
                clock[0] = max(clock[0], ready)
            else:
                ready = max(clock[0], _ready(*args, *kwargs.values()))
                clock[0] = ready
            if loads or stores:
                ptrs = args[0]
                mask = args[1] if name == "create_masked_load" else args[2] if name == "create_masked_store" else None
                active = ptrs.data if mask is None else ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]
                sectors = np.unique(active // SECTOR)
                nbytes = active.size * (ptrs.get_element_ty().primitive_bitwidth // 8)
                key = statement_key() if loads else None
                for c in targets():
                    if loads:
                        c.load_bytes += nbytes
                        c.load_sectors += sectors.size
                        if key is not None:
                            c.line_loads[key] += nbytes
                    else:
                        c.store_bytes += nbytes
                        c.store_sectors += sectors.size
            elif name == "create_dot":
                a, b = args[0].data, args[1].data
                for c in targets():
                    c.flops += 2 * a.shape[-2] * a.shape[-1] * b.shape[-1]
            if loads and active.size:  # a load with every lane masked off reads nothing
                if not cached:
                    ready += 1
                else:
                    volatile = kwargs.get("is_volatile", args[4] if name == "create_masked_load" else args[2])
                    ready += load_latency(set(sectors.tolist()), bool(volatile))
            elif cached and name in atomics:
                ready += L2_LATENCY_S / MEMORY_LATENCY_S  # a round trip to L2 the program waits for
            elif cached and stores:
                in_segment.update(sectors.tolist())
                in_launch.update(sectors.tolist())
            for c in targets():
                c.chain = max(c.chain, ready)
            if ready and isinstance(result, ti.TensorHandle):
                result.attr["ready"] = ready
            if protocol is not None and name in atomics and kernel_statement() == done_line:
                clock[0] = max(clock[0], ready)
                segment[0].done = True
                cut("merge" if int(np.asarray(result.data).flat[0]) == groups - 1 else "other")
            return result

        return wrapped

    for name, fn in list(vars(builder).items()):
        if name.startswith("create_") and callable(fn):
            saved[name] = fn
            setattr(builder, name, wrap(name, fn))

    apply = ti.ReduceScanOpInterface.apply

    def apply_counted(self, input):
        result = apply(self, input)
        if isinstance(self, ti.ReduceOps):
            for c in targets():
                c.reductions += 1
        inputs = input if isinstance(input, tuple) else (input,)
        clock[0] = max(clock[0], _ready(*(getattr(t, "handle", None) for t in inputs)))
        if clock[0]:
            for t in result if isinstance(result, tuple) else (result,):
                handle = getattr(t, "handle", None)
                if handle is not None:
                    handle.attr["ready"] = clock[0]
        return result

    ti.ReduceScanOpInterface.apply = apply_counted

    statement = statement_lines(kernel_fn)
    last = [None]
    unrolled = static_range_bodies(kernel_fn)
    headers = {u.header for u in unrolled.values()}

    def local(frame, event, arg):
        if event == "line":
            s = statement.get(frame.f_lineno, frame.f_lineno)
            if s != last[0]:  # a statement spanning lines reports each of them, some repeatedly
                if s == claim_line:  # a claim opens a chunk (its atomic and wait included)
                    cut("chunk")
                for c in targets():
                    c.lines[s] += 1
                last[0] = s
            if s in headers:
                if issue_base[0] is None:  # a run of an unrolled loop begins
                    issue_base[0] = clock[0]
            elif s not in unrolled:
                issue_base[0] = None
        return local

    helpers = helper_statements(kernel_fn)
    helper_last = [None]
    real_files: dict = {}

    def helper_of(code):
        """The statement map of the helper running ``code``, or None."""
        if code.co_filename not in real_files:
            real_files[code.co_filename] = os.path.realpath(code.co_filename)
        return helpers.get((real_files[code.co_filename], code.co_name))

    def helper_key(frame):
        """(statement of each helper frame, innermost first, ..., the kernel's statement): the
        key ``sass_by_line`` gives the instructions inlined along that chain."""
        key = []
        while frame is not None:
            if frame.f_code.co_name == code_name and frame.f_code.co_filename == code_file:
                return tuple(key) + (statement.get(frame.f_lineno, frame.f_lineno),)
            lines = helper_of(frame.f_code)
            if lines is not None:
                key.append(lines.get(frame.f_lineno, frame.f_lineno))
            frame = frame.f_back
        return None

    def statement_key():
        """The key (as ``sass_by_line`` keys instructions) of the statement running now."""
        key = helper_key(sys._getframe(2))
        return key[0] if key is not None and len(key) == 1 else key

    def helper_call():
        """The tracer of one call of a helper: its statements' runs, and once each the call."""
        seen = set()

        def helper_local(frame, event, arg):
            if event == "line":
                key = helper_key(frame)
                if key is not None and key != helper_last[0]:
                    for c in targets():
                        c.lines[key] += 1
                        if key not in seen:
                            c.entered[key] += 1
                    seen.add(key)
                    helper_last[0] = key
            return helper_local

        return helper_local

    def global_trace(frame, event, arg):
        if frame.f_code.co_name == code_name and frame.f_code.co_filename == code_file:
            return local
        if helper_of(frame.f_code) is not None:
            helper_last[0] = None  # a new call: its first statement counts again
            return helper_call()
        return None

    set_grid_idx = builder.set_grid_idx

    def end_program():
        if segment[0] is not None:
            cut("other")
        if current[0].lines or current[0].load_bytes:
            counts_of_program.append(current[0])

    def next_program(self, x, y, z):
        end_program()
        current[0] = Counts()
        in_segment.clear()
        if segment[0] is not None:
            segment[0] = Segment("other", Counts())
        return set_grid_idx(self, x, y, z)

    def next_program_reset(self, x, y, z):
        last[0] = None
        clock[0] = 0
        issue_base[0] = None
        return next_program(self, x, y, z)

    builder.set_grid_idx = next_program_reset
    sys.settrace(global_trace)
    try:
        yield
    finally:
        sys.settrace(None)
        end_program()
        builder.set_grid_idx = set_grid_idx
        ti.ReduceScanOpInterface.apply = apply
        for name, fn in saved.items():
            setattr(builder, name, fn)


# Kernels whose last program of a group (the programs sharing the last grid axis: a request)
# does more work once every other program of the group has finished (an atomic ticket):
# draft_expand's merge. The model interprets one whole group (so the ticket reaches its last
# value), charges the launch's waves with the ordinary programs and adds the last group's
# extra work, which runs after every other program, as a tail.
GROUP_TAIL_KERNELS = {"_draft_expand_kernel", "_verify_greedy_kernel", "_verify_temperature_kernel"}


def sample_programs(grid: tuple, samples: int, whole_group: bool = False,
                    group: int | None = None) -> list[tuple[int, int, int]]:
    """Every program of up to ``samples`` values of the first grid axis, at the midpoints of
    equal slices of it (the first and last are often special: a root row, a partial chunk).
    The other axes (splits, chunks of a row) are run whole, and a launch over the same first
    axis as the one before it (verify's rows) samples the same indices, so it reads what the
    sampled programs before it wrote; after a group-tail launch, whose middle group (``group``)
    alone ran, the one index ``group`` (verify's walk after its all-rows kernel reads the flags
    that group wrote)."""
    grid = tuple(grid) + (1,) * (3 - len(grid))
    if whole_group:  # every program of the middle group of the last axis
        return [(x, y, grid[2] // 2) for x in range(grid[0]) for y in range(grid[1])]
    n = min(samples, grid[0])
    xs = sorted({int((i + 0.5) * grid[0] / n) for i in range(n)})
    if group is not None and group < grid[0]:
        xs = [group]
    return [(x, y, z) for x in xs for y in range(grid[1]) for z in range(grid[2])]


def interpret(launches: list[compile_audit.Launch], samples: int) -> list[list[Counts]]:
    """Run the sampled programs of a call's launches, in order, in Triton's interpreter with the
    counters, in one forked process (the interpreter patches triton.language for good, which
    would break later compiles; the launches' outputs feed the next ones)."""
    import pickle
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".pkl") as f:
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                counts, group = [], None
                for launch in launches:
                    counts.append(_interpret(launch, samples, group))
                    # A group-tail launch ran its middle group alone: the next launch samples that request.
                    grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
                    group = grid[2] // 2 if launch.kernel.fn.__name__ in GROUP_TAIL_KERNELS else None
                with open(f.name, "wb") as out:
                    pickle.dump(counts, out)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"interpreting {launches[0].case or launches[0].kernel.fn.__name__} failed")
        with open(f.name, "rb") as result:
            return pickle.load(result)


# Constexprs set for the interpreted run only. Triton's interpreter computes a 16-bit tl.dot
# wrongly (the reason the tests interpret tree_attention with UPCAST), and the values steer
# tree_attention's conditional rescale: its 16-bit launches are interpreted with fp32 dots, as
# the tests run them. The statements this adds (the upcasts) have no instruction in the SASS of
# the real launch, so they add nothing to the counts; every other statement runs as it would.
INTERPRETER_OVERRIDES = {"_tree_attention_kernel": {"UPCAST": True, "DOT_PRECISION": "ieee"}}


# Helpers whose compiled form is inline PTX the interpreter cannot run, and what runs in their place: PDL's
# wait (nothing to wait for, one launch at a time) and the L2 prefetch of a GEMM's weights (no data returned).
STAND_INS = {} if _pdl is None else {_pdl._wait_and_release.fn: _pdl._nothing_before.fn,
                                       _pdl._bulk_prefetch_l2.fn: _pdl._no_prefetch.fn}


def _sixteen_bit(launch: compile_audit.Launch) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype in (torch.float16, torch.bfloat16) for a in launch.args)


def _interpret(launch: compile_audit.Launch, samples: int, group: int | None = None) -> list[Counts]:
    from triton.runtime import interpreter as ti

    counts: list[Counts] = []
    programs = sample_programs(launch.grid, samples, launch.kernel.fn.__name__ in GROUP_TAIL_KERNELS, group)
    executor = ti.GridExecutor(ti.InterpretedFunction(launch.kernel.fn).rewrite(), launch.kernel.arg_names,
                               tuple(launch.grid))
    grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
    builder = ti.interpreter_builder
    def fake_call(*args_dev, **kwargs):
        import inspect

        argspec = inspect.getfullargspec(executor.fn)
        kwargs = {k: v for k, v in kwargs.items() if k in argspec.args or k in argspec.kwonlyargs}
        args_hst, kwargs_hst = executor._init_args_hst(args_dev, kwargs)
        scope = ti._patch_lang(executor.fn)
        try:
            args = inspect.getcallargs(executor.fn, *args_hst, **kwargs_hst)
            args = {n: a if n in executor.constexprs else ti._implicit_cvt(a) for n, a in args.items()}
            builder.set_grid_dim(*grid)
            for x, y, z in programs:
                builder.set_grid_idx(x, y, z)
                executor.fn(**args)
        finally:
            scope.restore()
        executor._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)  # outputs feed the next launch

    kwargs = {k: v for k, v in launch.kwargs.items() if k not in ("num_warps", "num_stages")}
    kwargs.update(INTERPRETER_OVERRIDES.get(launch.kernel.fn.__name__, {}) if _sixteen_bit(launch) else {})
    # Jit functions the kernel calls (its helpers, tl.cdiv, tl.max, ...) were defined compiled:
    # inside the interpreted kernel, they run interpreted.
    interpreted = {}

    def call_interpreted(self, *a, **k):
        if self.fn not in interpreted:
            interpreted[self.fn] = ti.InterpretedFunction(STAND_INS.get(self.fn, self.fn))
        return interpreted[self.fn](*a, **k)

    saved = compile_audit.triton_jit.JITFunction.__call__
    compile_audit.triton_jit.JITFunction.__call__ = call_interpreted
    try:
        protocol = COOPERATIVE_KERNELS.get(launch.kernel.fn.__name__)
        with counting(launch.kernel.fn, counts, int(launch.kwargs[protocol.groups_kwarg]) if protocol else 0):
            fake_call(*launch.args, **kwargs)
    finally:
        compile_audit.triton_jit.JITFunction.__call__ = saved
    return counts


# --------------------------------------------------------------------------------------------
# SASS: instructions per source line.


def _keyed_sass(sass: str, kernel_fn):
    """(offset, statement key or None, instruction text) of each SASS instruction, keyed as
    ``sass_by_line`` describes."""
    import inspect

    file = os.path.realpath(kernel_fn.__code__.co_filename)
    lines, first = inspect.getsourcelines(kernel_fn)
    span = range(first, first + len(lines))
    statement = statement_lines(kernel_fn)
    helper_lines = {}  # (real file, line) -> statement key
    for (where, _), helper in helper_statements(kernel_fn).items():
        helper_lines.update({(where, line): key for line, key in helper.items()})
    line = None
    chain = []
    for text in sass.splitlines():
        if m := ANNOTATION.search(text):
            chain.append((os.path.realpath(m.group(1)), int(m.group(2)), m.group(3), m.group(4)))
            continue
        m = compile_audit.INSTRUCTION.match(text)
        if not m:
            continue
        if chain:  # a new location: the outermost entry is the kernel statement
            f, n = chain[-1][:2]
            line = statement.get(n, n) if f == file and n in span else None
            if line is not None:  # (innermost helper statement, ..., the kernel statement) for helpers
                helpers_in = tuple(helper_lines[(f, n)] for f, n, _f_at, _n_at in chain[:-1]
                                   if (f, n) in helper_lines)
                if helpers_in:
                    line = helpers_in + (line,)
            chain = []
        yield int(m.group(1), 16), line, text


def sass_by_line(sass: str, kernel_fn) -> tuple[Counter, Counter, int]:
    """Instructions per kernel statement inside a SASS loop, the same outside any loop, and the
    instructions with no kernel statement (prologue). An instruction inside a loop runs once per
    run of its statement; one outside runs at most once (a pipelined loop's peeled prologue and
    epilogue, a fully unrolled copy). A loop the compiler unrolled holds several copies of its
    statements: ``unrolled_loops`` and ``per_run`` count those once.

    ``nvdisasm -gi`` prints an instruction's inlining chain innermost first, the kernel statement
    last. An instruction of a helper the kernel can call (``helper_statements``) is keyed
    by the statements of its chain of such helpers, innermost first, then the kernel statement of
    the call (helpers nested in helpers included), which the interpreter counts the same way: so a
    branch inside a helper counts as often as it is taken at that call site, not once per call."""
    unrolled = static_range_bodies(kernel_fn)
    _, loops = compile_audit.sass_loops(sass)
    in_loop, out_loop, outside = Counter(), Counter(), 0
    for offset, line, _text in _keyed_sass(sass, kernel_fn):
        if line is None:
            outside += 1
        elif any(loop.start <= offset <= loop.end for loop in loops):
            in_loop[unrolled.get(line, line)] += 1
        else:
            out_loop[line] += 1
    return in_loop, out_loop, outside


# Bytes a thread's global load moves, by the opcode's width suffix (none: 32 bits).
LOAD = re.compile(r"\bLDG\.E((?:\.[A-Z0-9_]+)*)")
LOAD_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


def load_width(text: str) -> int:
    """Bytes a thread's global load (``LDG``) in SASS instruction ``text`` moves; 0 for any other."""
    m = LOAD.search(text)
    if not m:
        return 0
    return next((LOAD_WIDTH[part] for part in m.group(1).split(".") if part in LOAD_WIDTH), 4)


@dataclasses.dataclass
class LoopCopies:
    """An innermost SASS loop's instructions per statement key, and the bytes its global loads
    move per warp and pass of its body."""

    instructions: Counter
    load_bytes: int = 0


def unrolled_loops(sass: str, kernel_fn) -> list[LoopCopies]:
    """The innermost loops of a disassembly (``sass_loops``) that load from global memory, with
    their statements' instructions (``static_range`` bodies excluded: ``Unrolled`` counts their
    copies). Loads are not told apart by statement: the compiler may file an unrolled loop's
    loads under another statement of the same load (a masked copy of it after the loop)."""
    unrolled = static_range_bodies(kernel_fn)
    _, loops = compile_audit.sass_loops(sass)
    inner = [loop for loop in loops if loop.innermost]
    out = [LoopCopies(Counter()) for _ in inner]
    for offset, line, text in _keyed_sass(sass, kernel_fn):
        if line is None or line in unrolled:
            continue
        for loop, copies in zip(inner, out):
            if loop.start <= offset <= loop.end:
                copies.instructions[line] += 1
                copies.load_bytes += load_width(text) * 32
                break
    return [c for c in out if c.load_bytes]


def _main_load(loop: LoopCopies, counts: list[Counts]):
    """(key, runs, bytes a run) of the loop statement that loaded the most bytes a run in the
    interpreter (over the sampled programs), or None."""
    best = None
    for key in loop.instructions:
        runs_ = sum(c.lines.get(key, 0) for c in counts)
        loaded = sum(c.line_loads.get(key, 0) for c in counts)
        if runs_ and loaded and (best is None or loaded / runs_ > best[2]):
            best = (key, runs_, loaded / runs_)
    return best


def unroll_factor(loop: LoopCopies, counts: list[Counts], num_warps: int) -> int:
    """How many copies of its body a compiled loop holds: the bytes its loads move a pass (every
    warp of the program) over the bytes a run of its main load statement (``_main_load``) loaded
    in the interpreter, rounded; 1 when no statement of it loaded or the ratio is under 1.5.
    LLVM unrolls simple loops of a runtime trip count (4 copies of verify_greedy.py's tile loop,
    the rest of the trip count in straight code after it)."""
    main = _main_load(loop, counts)
    if main is None:
        return 1
    ratio = loop.load_bytes * num_warps / main[2]
    return round(ratio) if ratio >= 1.5 else 1


def per_run(in_loop: Counter, loops: list[LoopCopies], factors: list[int]) -> Counter:
    """``in_loop`` with each unrolled loop's statements counted once a run (``unroll_factor``)."""
    adjusted = Counter(in_loop)
    for loop, factor in zip(loops, factors):
        if factor > 1:
            for key, n in loop.instructions.items():
                adjusted[key] -= n * (1 - 1 / factor)
    return adjusted


def chain_per_pass(counts: Counts, loops: list[LoopCopies], factors: list[int]) -> Counts:
    """``counts`` with the loads of an unrolled loop waited for once a pass of its body: the
    interpreter runs one copy at a time, and each run of a load whose result is used before the
    next load costs a latency; the compiled body issues its ``factor`` copies' loads together.
    Each run of the main load is taken to have cost one latency (streaming loads from DRAM)."""
    saved = 0.0
    for loop, factor in zip(loops, factors):
        main = _main_load(loop, [counts]) if factor > 1 else None
        if main is not None:
            saved += main[1] * (1 - 1 / factor)
    return dataclasses.replace(counts, chain=max(0.0, counts.chain - saved)) if saved else counts


def dynamic_instructions(counts: Counts, in_loop: Counter, out_loop: Counter, outside: int) -> int:
    """Instructions one warp of a program issues."""
    return (outside + sum(n * runs(counts, s) for s, n in in_loop.items())
            + sum(n * min(counts.lines.get(s, 0), 1) for s, n in out_loop.items()))


def runs(counts: Counts, key) -> float:
    """How often the SASS of a statement keyed ``key`` runs in one program, per instruction: its
    count, or for an unrolled statement (``Unrolled``) the runs of its whole ``static_range`` loop.
    A helper statement's SASS holds one copy per inlined call along its chain of call statements,
    and calls on one line share a key (two ``_max1`` calls in one statement): its count is divided
    by its ``copies``."""
    if isinstance(key, Unrolled):
        return max(0, counts.lines.get(key.header, 0) - counts.lines.get(key.first, 0))
    n = counts.lines.get(key, 0)
    return n / copies(counts, key) if n and isinstance(key, tuple) else n


def copies(counts: Counts, key) -> int:
    """The inlined copies of helper statement ``key`` (innermost statement first, the kernel's
    last): the calls of its helper per run of the calling statement, times that statement's
    copies (one for a kernel statement)."""
    if not isinstance(key, tuple) or len(key) < 2:
        return 1
    parent = key[1:] if len(key) > 2 else key[1]
    parent_runs = counts.lines.get(parent, 0)
    if not parent_runs:
        return 1
    return max(1, round(counts.entered.get(key, 0) / parent_runs)) * copies(counts, parent)


# --------------------------------------------------------------------------------------------
# The model.


@dataclasses.dataclass
class LaunchModel:
    kernel: str
    grid: tuple
    programs: int
    num_warps: int
    num_stages: int
    blocks_per_sm: int
    waves: int
    warp_instructions: float  # per program, mean of the sampled
    warp_instructions_max: float
    dram_bytes: float  # all programs
    requested_bytes: float
    flops: float
    reductions: float  # per program
    chain: int
    tail_warp_instructions: float = 0.0  # the group's last program: its extra work after the waves
    tail_chain: int = 0
    tail_s: float = 0.0
    issue_s: float = 0.0
    memory_s: float = 0.0
    compute_s: float = 0.0
    latency_s: float = 0.0
    serial_s: float = 0.0
    time_s: float = 0.0
    bound: str = ""
    # COOPERATIVE_KERNELS: each sampled group's phases (``cooperative_groups``), the programs of a
    # group resident at once, the idle programs' work; the group's time, and the slowest's phases.
    groups: list = dataclasses.field(default_factory=list)
    group_size: int = 0
    group_programs: int = 0
    idle: dict = dataclasses.field(default_factory=dict)
    group_s: float = 0.0
    phases: int = 0

    def finish(self, overhead=None, issue_rate=None) -> LaunchModel:
        overhead = LAUNCH_OVERHEAD_S if overhead is None else overhead
        rate = (ISSUE_RATE if issue_rate is None else issue_rate) * DEVICE.clock_hz
        if self.groups:
            return self._finish_cooperative(overhead, rate)
        resident = max(1, min(self.blocks_per_sm, math.ceil(self.programs / DEVICE.sms)))
        self.issue_s = resident * self.warp_instructions / rate
        self.memory_s = self.dram_bytes / self.waves / DEVICE.hbm_bytes_per_s
        self.compute_s = self.flops / self.waves / DEVICE.dense_bf16_flops
        # Loops feeding tl.dot are software-pipelined num_stages deep by the compiler.
        self.latency_s = self.chain * MEMORY_LATENCY_S / (self.num_stages if self.flops else 1)
        # A warp does not overlap its own MMAs with its other instructions (Triton's loops wait for
        # the QK^T result before the softmax: WARPGROUP.DEPBAR / HMMA results used in order); the
        # SM overlaps them only across warps. One warpgroup's chain: its share of the program's
        # FLOPs at the SM's tensor rate (a wgmma uses all four sub-partitions), then its own
        # instructions at one scheduler's share of the issue rate. It bounds the wave from below
        # where one warpgroup is alone on an SM; with several resident it is below the others.
        if self.flops:
            per_program = self.flops / self.programs
            warps = max(self.num_warps, 1)
            self.serial_s = (per_program * 4 / warps / (DEVICE.dense_bf16_flops / DEVICE.sms)
                             + self.warp_instructions / warps / (rate / 4))
        parts = {"issue": self.issue_s, "memory": self.memory_s, "compute": self.compute_s, "latency": self.latency_s,
                 "serial": self.serial_s}
        self.bound = max(parts, key=lambda k: parts[k])
        wave = parts[self.bound]
        if self.waves == 1:  # the slowest program bounds a single wave
            slowest = self.warp_instructions_max / rate
            if slowest > wave:
                wave, self.bound = slowest, "slowest program"
        # The last group's extra work (GROUP_TAIL_KERNELS) starts when its last ordinary program
        # ends, after the waves: its own instructions at the SM's issue rate, or its latency chain.
        self.tail_s = max(self.tail_warp_instructions / rate, self.tail_chain * MEMORY_LATENCY_S)
        self.time_s = overhead + self.waves * wave + self.tail_s
        return self

    def _finish_cooperative(self, overhead: float, rate: float) -> LaunchModel:
        """A group's programs in parallel, phase by phase: the group's resident programs take a
        phase's chunks in rounds (a round: the slowest chunk, with the wait and claim before it),
        then one program merges; groups run side by side, so the launch takes the slowest
        sampled group's time, and the programs that were not resident start when a group ends
        (they find it finished and leave: the idle work, once per further wave)."""
        groups = max(1, self.programs // self.group_size)
        resident = max(1, self.blocks_per_sm * DEVICE.sms)
        per_group = min(self.group_size, max(1, resident // groups))  # a group's programs running at once
        active = max(1, min(self.blocks_per_sm, math.ceil(groups * per_group / DEVICE.sms)))  # sharing an SM

        def seconds(part, share=1):
            """A stretch's time: its warp instructions on its SM (``share`` programs issuing
            there), or its chain of dependent memory latencies."""
            return max(part["warp_instructions"] * share / rate, part["chain"] * MEMORY_LATENCY_S)

        slowest = None
        for group in self.groups:
            total, issue, latency, memory = seconds(group["prologue"]), 0.0, 0.0, 0.0
            for phase in group["phases"]:
                rounds = math.ceil(phase["chunks"] / per_group)
                # the chunks of a round of every group read at once: those bytes over the whole GPU
                round_bytes = phase["chunk"]["dram_bytes"] * min(phase["chunks"], per_group) * groups
                round_s = max(seconds(phase["chunk"], active) + seconds(phase["between"], active),
                              round_bytes / DEVICE.hbm_bytes_per_s)
                total += rounds * round_s + seconds(phase["merge"])
                issue += rounds * (phase["chunk"]["warp_instructions"] + phase["between"]["warp_instructions"]) \
                    * active / rate + phase["merge"]["warp_instructions"] / rate
                latency += rounds * (phase["chunk"]["chain"] + phase["between"]["chain"]) * MEMORY_LATENCY_S \
                    + phase["merge"]["chain"] * MEMORY_LATENCY_S
                memory += rounds * round_bytes / DEVICE.hbm_bytes_per_s
            if slowest is None or total > slowest[0]:
                slowest = (total, len(group["phases"]), issue, latency, memory)
        self.group_s, self.phases, self.issue_s, self.latency_s, self.memory_s = slowest
        self.group_programs = per_group
        waves = math.ceil(self.programs / resident)
        self.tail_s = (waves - 1) * seconds(self.idle) if self.idle else 0.0
        self.bound = f"{self.phases} phases, {per_group} programs a group"
        self.time_s = overhead + self.group_s + self.tail_s
        return self


def cooperative_groups(counts: list[Counts], group_size: int, in_loop, out_loop, outside, num_warps):
    """The sampled groups of a COOPERATIVE_KERNELS launch (``counts`` in program order, a group's
    ``group_size`` programs consecutive) as phases of warp instructions, latency chains and bytes:
    per group its prologue (before the first claim) and per phase the slowest chunk, the longest
    wait before a claim, and the merge; and the idle programs' work (those that did no chunk)."""
    def part(items):
        return {"warp_instructions": max((i for i, _, _ in items), default=0) * num_warps,
                "chain": max((c for _, c, _ in items), default=0),
                "dram_bytes": max((b for _, _, b in items), default=0)}

    groups, idle = [], []
    for start in range(0, len(counts), group_size):
        prologue, phases, chunks, between = [], [], [], []
        worked = False
        for program in counts[start:start + group_size]:
            seen: set = set()
            if not any(seg.role == "chunk" and seg.done for seg in program.segments):
                idle.append((dynamic_instructions(program, in_loop, out_loop, outside), program.chain,
                             program.dram_bytes))
                continue
            worked = True
            for k, seg in enumerate(program.segments):
                c = seg.counts
                # out-of-loop instructions run once a program: in the first segment that reaches them
                firsts = {key for key in out_loop if c.lines.get(key, 0) and key not in seen}
                seen |= firsts
                instructions = (sum(n * runs(c, key) for key, n in in_loop.items())
                                + sum(out_loop[key] for key in firsts) + (outside if k == 0 else 0))
                item = (instructions, c.chain, c.dram_bytes)
                if seg.role == "chunk" and seg.done:
                    chunks.append(item)
                elif seg.role == "merge":
                    phases.append({"chunks": len(chunks), "chunk": part(chunks), "between": part(between),
                                   "merge": part([item])})
                    chunks, between = [], []
                elif not phases and not chunks:
                    prologue.append(item)
                else:
                    between.append(item)
        if worked:
            groups.append({"prologue": part(prologue), "phases": phases})
    return groups, (part(idle) if idle else {})


def model_launch(launch: compile_audit.Launch, counts: list[Counts], cache: dict) -> LaunchModel:
    target = compile_audit.GPUTarget("cuda", DEVICE.arch, 32)
    key = compile_audit.specialisation_key(launch, target)
    if key not in cache:
        cache[key] = compile_audit.compile_launch(launch, target)
    audit = cache[key]
    in_loop, out_loop, outside = sass_by_line(audit.sass, launch.kernel.fn)
    loops = unrolled_loops(audit.sass, launch.kernel.fn)
    factors = [unroll_factor(loop, counts, audit.num_warps) for loop in loops]
    in_loop = per_run(in_loop, loops, factors)
    counts = [chain_per_pass(c, loops, factors) for c in counts]
    instructions = [dynamic_instructions(c, in_loop, out_loop, outside) for c in counts]
    tail_instructions, tail_chain, slowest = 0.0, 0, instructions
    if audit.kernel in GROUP_TAIL_KERNELS and len(counts) > 1:
        last = max(range(len(counts)), key=lambda i: instructions[i])  # the program that did the group's work
        others = [i for i in range(len(counts)) if i != last]
        typical = sum(instructions[i] for i in others) / len(others)
        tail_instructions = (instructions[last] - typical) * audit.num_warps
        chain = max(counts[i].chain for i in others)
        tail_chain = max(counts[last].chain - chain, 0)
        counts = [counts[i] for i in others] + [dataclasses.replace(counts[last], chain=chain)]
        slowest = [instructions[i] for i in others]  # the tail is added after the waves
    grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
    programs = grid[0] * grid[1] * grid[2]
    blocks = max(audit.blocks_per_sm, 1)
    waves = math.ceil(programs / (blocks * DEVICE.sms))
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    cooperative = {}
    if audit.kernel in COOPERATIVE_KERNELS:
        group_size = int(launch.kwargs[COOPERATIVE_KERNELS[audit.kernel].groups_kwarg])
        groups, idle = cooperative_groups(counts, group_size, in_loop, out_loop, outside, audit.num_warps)
        cooperative = dict(groups=groups, idle=idle, group_size=group_size)
    return LaunchModel(
        kernel=audit.kernel, grid=grid, programs=programs, num_warps=audit.num_warps, num_stages=audit.num_stages,
        blocks_per_sm=audit.blocks_per_sm,
        waves=waves, warp_instructions=mean(instructions) * audit.num_warps,
        warp_instructions_max=max(slowest, default=0) * audit.num_warps,
        dram_bytes=mean([c.dram_bytes for c in counts]) * programs,
        requested_bytes=mean([c.load_bytes + c.store_bytes for c in counts]) * programs,
        flops=mean([c.flops for c in counts]) * programs, reductions=mean([c.reductions for c in counts]),
        chain=max((c.chain for c in counts), default=0),
        tail_warp_instructions=tail_instructions, tail_chain=tail_chain, **cooperative,
    ).finish()


def model_call(call, samples: int, cache: dict) -> list[LaunchModel]:
    """Model every launch one launcher call makes."""
    launches: list[compile_audit.Launch] = []
    with compile_audit.modeled_gpu(launches, [""]):
        call()
    counts = interpret(launches, samples)
    return [model_launch(launch, c, cache) for launch, c in zip(launches, counts)]


# --------------------------------------------------------------------------------------------
# Shapes: goals, the H200 run's benchmarks, smoke.


def _tree_attention(B, N, prefix, dtype=torch.bfloat16, Hq=32, Hkv=8, D=128, page=16):
    """bench/bench_tree_attention.py's GPU case (pages of 16, its random tree mask) with
    standard-normal q, K and V: the values steer the kernel's conditional rescale (the running
    maxima move when a row's grew by more than its slack), so the cache is written."""
    import bench_tree_attention

    from eagle_kernels.triton import tree_attention as ta

    g = torch.Generator().manual_seed(0)
    cap = prefix + N
    q = torch.randn(B, N, Hq, D, generator=g).to(dtype)
    if page:
        pages = -(-cap // page)
        k = torch.empty(B * pages, page, Hkv, D, dtype=dtype).normal_(generator=g)
        table = torch.randperm(B * pages, generator=g).view(B, pages).to(torch.int32)
    else:
        k, table = torch.empty(B, cap, Hkv, D, dtype=dtype).normal_(generator=g), None
    v = torch.empty_like(k).normal_(generator=g)
    mask = bench_tree_attention.random_mask(B, N, prefix)
    seqlens = torch.full((B,), prefix, dtype=torch.int32)
    return lambda: ta.tree_attention(q, k, v, seqlens, mask, block_table=table)


def _verify(B, N, V, mode, dtype=torch.bfloat16, accepted: int | None = None, walk: bool = False):
    """verify over ``_verify_inputs``; ``walk``: the walk kernel alone (the all-rows kernels' byte
    limits at 0)."""
    import bench_verify

    from eagle_kernels.triton import verify as tv

    tokens, parents, logits, sampling = _verify_inputs(B, N, V, mode, dtype, accepted)
    if walk:  # (an older package's verify, --package, takes no _config)
        sampling["_config"] = dataclasses.replace(tv.GPU_CONFIG, greedy_max_bytes=0, temperature_max_bytes=0)
    return lambda: tv.verify(tokens, parents, logits, max_depth=bench_verify.MAX_DEPTH, **sampling)


def _verify_inputs(B, N, V, mode, dtype=torch.bfloat16, accepted: int | None = None):
    """bench/bench_verify.py's inputs (its EAGLE-2 shaped trees, spiked logits); ``top-k``, ``top-p``
    and ``top-k-p`` are its ``temp`` inputs with top-k 50, top-p 0.9 or both. Its greedy walks accept a draft at every
    depth; with ``accepted`` each request's greedy walk stops after that many (the next node's
    children lose the token its row ranks first), as a step's walk of that length would."""
    import bench_verify

    base = {"temperature": "temp", "top-k": "temp", "top-k-p": "temp", "top-p": "temp", "greedy-rows": "greedyrows",
            "temperature-rows": "temprows"}.get(mode, mode)
    # greedyrows: no temperature; temprows: no filter arguments (the all-rows kernels)
    tokens, parents, logits, sampling = bench_verify.make_inputs(B, N, V, base, dtype)
    if accepted is not None:
        top = logits.float().argmax(-1)
        for b in range(B):
            node = 0
            for depth in range(accepted + 1):
                children = [i for i in range(1, N) if int(parents[b, i]) == node]
                hit = [i for i in children if int(tokens[b, i]) == int(top[b, node])]
                if depth == accepted:  # stop here: no child carries the row's first token
                    for i in hit:
                        tokens[b, i] = (int(top[b, node]) + 1) % V
                    break
                if not hit:
                    raise ValueError(f"the planted walk of request {b} stops before {accepted} drafts")
                node = hit[0]
    if mode in ("top-k", "top-k-p"):
        sampling["top_k"] = torch.full((B,), 50, dtype=torch.int32)
    if mode in ("top-p", "top-k-p"):
        sampling["top_p"] = torch.full((B,), 0.9)
    return tokens, parents, logits, sampling


def _chain_verify(op, B, N, V, Vd):
    """A sampled chain verified draft by draft (``verify``) or as one block (``block_verify``)."""
    import bench_block_verify

    from eagle_kernels.triton import block_verify as tb
    from eagle_kernels.triton import verify as tv

    tokens, logits, q, d2t, sampling = bench_block_verify.chain_inputs(B, N - 1, V, Vd, torch.bfloat16)
    if op == "block_verify":
        return lambda: tb.block_verify(tokens, logits, q, d2t=d2t, **sampling)
    parents = torch.arange(-1, N - 1, dtype=torch.int32).expand(B, N).contiguous()
    return lambda: tv.verify(tokens, parents, logits, max_depth=N - 1, draft_probs=q, d2t=d2t, **sampling)


def _sampled_tree_verify(B, V, Vd, k=6, frontier=3, depth=4):
    """A sampled tree at T 1 as the decoder drafts one (``sampled_tree(depth, k, frontier)``: the
    root's k children, then k children of each of the ``frontier`` first nodes of a level; 61
    nodes at (4, 6, 3)), every child drawn without replacement from its parent's draft row (8192
    draft ids mapped by d2t), random target logits (most children rejected: a residual phase
    each)."""
    from eagle_kernels.triton import verify as tv

    g = torch.Generator().manual_seed(7)
    parents, level = [-1], [0]
    for _ in range(depth):
        nxt = []
        for u in level[:frontier]:
            for _ in range(k):
                parents.append(u)
                nxt.append(len(parents) - 1)
        level = nxt
    N = len(parents)
    logits = (torch.randn(B, N, V, generator=g) * 3).to(torch.bfloat16)
    q = torch.softmax(torch.randn(B, N, Vd, generator=g) * 3, -1)
    d2t = torch.randperm(V, generator=g)[:Vd].sort().values - torch.arange(Vd)
    tokens = torch.zeros(B, N, dtype=torch.int64)
    for b in range(B):
        for u in range(N):
            children = [c for c in range(N) if parents[c] == u]
            if children:
                draws = torch.multinomial(q[b, u], len(children), replacement=False, generator=g)
                tokens[b, children] = draws + d2t[draws]
    parents = torch.tensor(parents, dtype=torch.int32).expand(B, N).contiguous()
    sampling = dict(temperature=torch.ones(B), seed=torch.arange(B), offset=torch.zeros(B, dtype=torch.int64))
    return lambda: tv.verify(tokens, parents, logits, max_depth=depth, draft_probs=q, d2t=d2t, **sampling)


def _draft_expand(B, M, V, top_k, dtype=torch.bfloat16):
    import bench_draft_expand

    from eagle_kernels.triton import draft_expand as de

    logits, frontier_scores = bench_draft_expand.make_inputs(B, M, V, dtype, "cpu")
    return lambda: de.draft_expand(logits, frontier_scores, top_k)


def goal_cases():
    for mode in ("greedy", "greedy-rows", "temperature", "temperature-rows", "top-k", "top-k-p", "top-p"):
        # visited rows: at most depth + 1 = 7 per request (the "-rows" modes read all 64)
        yield (f"verify B8 N64 V128256 {mode}", lambda m=mode: _verify(8, 64, 128256, m),
               dict(bytes=8 * 7 * 128256 * 2))
    yield "draft_expand B8 M8 V128256 top_k8", lambda: _draft_expand(8, 8, 128256, 8), dict(bytes=8 * 8 * 128256 * 2)
    for prefix in (4096, 16384):
        for B in (1, 8, 32):
            # FLOPs: QK^T and PV over the prefix and about half the tree; bytes: K and V once.
            yield (f"tree_attention B{B} N64 prefix{prefix} paged16", lambda B=B, p=prefix: _tree_attention(B, 64, p),
                   dict(flops=4 * B * 64 * 32 * (prefix + 32) * 128, bytes=2 * B * (prefix + 64) * 8 * 128 * 2))


# The H200 run (bench/results/nvidia-h200/gpu_check.md, kernels of commit f836145): mean ms per
# call of the per-op benchmarks (pytest-benchmark wall time with a device sync).
H200_RUN_MS = {
    ("tree_attention", 1, 1024): 0.1390, ("tree_attention", 1, 4096): 0.1600,
    ("tree_attention", 1, 16384): 0.2527, ("tree_attention", 8, 1024): 0.2260,
    ("tree_attention", 8, 4096): 0.3697, ("tree_attention", 8, 16384): 0.9470,
    ("tree_attention", 32, 1024): 0.3676, ("tree_attention", 32, 4096): 0.8485,
    ("tree_attention", 32, 16384): 2.6204,
    ("verify", 1, "greedy"): 0.2340, ("verify", 1, "temp"): 0.6728, ("verify", 1, "topkp"): 11.6421,
    ("verify", 8, "greedy"): 0.3375, ("verify", 8, "temp"): 1.1454, ("verify", 8, "topkp"): 32.4633,
    ("verify", 32, "greedy"): 1.0151, ("verify", 32, "temp"): 3.2891, ("verify", 32, "topkp"): 192.5434,
    ("draft_expand", 1, 32000, 8): 0.1768, ("draft_expand", 1, 32000, 10): 0.1296,
    ("draft_expand", 1, 128256, 8): 0.1466, ("draft_expand", 1, 128256, 10): 0.1559,
    ("draft_expand", 8, 32000, 8): 0.1488, ("draft_expand", 8, 32000, 10): 0.1522,
    ("draft_expand", 8, 128256, 8): 0.1613, ("draft_expand", 8, 128256, 10): 0.1796,
    ("draft_expand", 32, 32000, 8): 0.1753, ("draft_expand", 32, 32000, 10): 0.2210,
    ("draft_expand", 32, 128256, 8): 0.3961, ("draft_expand", 32, 128256, 10): 0.3730,
}


def benchmark_json_ms(path: str) -> dict:
    """Mean ms of the eagle entries of a pytest-benchmark JSON (bench/gpu_check.sh's bench.json),
    keyed as H200_RUN_MS."""
    with open(path) as f:
        benchmarks = json.load(f)["benchmarks"]
    out = {}
    for b in benchmarks:
        name, ms = b["name"], b["stats"]["mean"] * 1e3
        if "eagle" not in name:
            continue
        if m := re.match(r"test_tree_attention_gpu\[B(\d+)-N64-prefix(\d+)-eagle\]", name):
            out[("tree_attention", int(m.group(1)), int(m.group(2)))] = ms
        elif m := re.match(r"test_verify_gpu\[B(\d+)-(\w+)-eagle\]", name):
            out[("verify", int(m.group(1)), m.group(2))] = ms
        elif m := re.match(r"test_draft_expand_cuda\[eagle-B(\d+)-V(\d+)-k(\d+)\]", name):
            out[("draft_expand", int(m.group(1)), int(m.group(2)), int(m.group(3)))] = ms
    return out


def calibration_cases(measured: dict = H200_RUN_MS):
    """The benchmark shapes of ``measured`` (ms per call), modeled on the imported package."""
    order = {"draft_expand": 0, "verify": 1, "tree_attention": 2}  # cheapest to interpret first
    for key, ms in sorted(measured.items(), key=lambda item: order[item[0][0]]):
        if key[0] == "tree_attention":
            _, B, prefix = key
            yield f"tree_attention B{B} N64 prefix{prefix} paged16", lambda B=B, p=prefix: _tree_attention(B, 64, p), ms
        elif key[0] == "verify":
            _, B, mode = key
            yield f"verify B{B} N64 V128256 {mode}", lambda B=B, m=mode: _verify(B, 64, 128256, m), ms
        else:
            _, B, V, k = key
            yield f"draft_expand B{B} M8 V{V} top_k{k}", lambda B=B, V=V, k=k: _draft_expand(B, 8, V, k), ms


def _decode_attention(B, N, prefix, heads, D, fill: bool, rows: int | None = None, fold: bool | None = None):
    """A contiguous bf16 cache of prefix + N entries, bench_tree_attention's random tree; the
    launcher's configuration (``fill``) or ``gpu_config`` without the capacity, each with the split
    count the launcher gives it; or blocks of ``rows`` rows, their partials folded or not (``fold``)."""
    import bench_tree_attention

    from eagle_kernels.triton import tree_attention as ta

    Hq, Hkv = heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, N, Hq, D, generator=g).to(torch.bfloat16)
    k = torch.empty(B, prefix + N, Hkv, D, dtype=torch.bfloat16).normal_(generator=g)
    v = torch.empty_like(k).normal_(generator=g)
    mask = bench_tree_attention.random_mask(B, N, prefix)
    seqlens = torch.full((B,), prefix, dtype=torch.int32)
    group = Hq // Hkv
    if rows is None:
        config = ta.gpu_config(N, group, D, torch.bfloat16, False, False, heads=B * Hkv,
                               capacity=prefix + N if fill else None)
    else:
        from eagle_kernels.triton.tree_attention_config import _config

        config = _config(N, group, D, torch.bfloat16, False, False, False, rows=rows)
    return lambda: ta._launch(q, k, v, seqlens, mask, config=config, fold_merge=fold)


def _q8_0_linear(M, K, N, residual: bool):
    """q8_0_linear over bf16 rows at one matrix's shape (random quants and scales)."""
    from eagle_kernels.triton import q8_0_linear as q8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    quants = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scales = (torch.rand(N, K // 32, generator=g) * 1e-3).to(torch.float16)
    add = torch.randn(M, N, generator=g).to(torch.bfloat16) if residual else None
    return lambda: q8.q8_0_linear(x, quants, scales, residual=add)


# A Llama-3-8B-sized EAGLE-3 head's matrices (K, N, residual) at a draft pass's 8 rows: q/k/v over 2 x 4096,
# o and down into the residual, gate/up, the 32,000-row draft LM head, fc over the three features.
Q8_HEAD_MATRICES = [(8192, 6144, False), (4096, 4096, True), (4096, 28672, False), (14336, 4096, True),
                    (4096, 32000, False), (12288, 4096, False)]


def _fp8_linear(M, K, N, residual: bool):
    """fp8_linear over bf16 rows at one matrix's shape (random weights and scales)."""
    from eagle_kernels.triton import fp8_linear as fp8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    weight = torch.randn(N, K, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(N, generator=g) * 1e-3
    add = torch.randn(M, N, generator=g).to(torch.bfloat16) if residual else None
    return lambda: fp8.fp8_linear(x, weight, scale, residual=add)


def decode_cases():
    # verify at a decoding step's shapes: SmolLM2-135M's (6, 8, 60) tree (61 rows) and the
    # Llama-3-8B shape's vocabulary, batch 1, greedy and temperature
    for V in (49152, 128256):
        for mode in ("greedy", "greedy-rows", "temperature", "temperature-rows", "top-k"):
            yield (f"verify B1 N61 V{V} {mode}", lambda a=(1, 61, V, mode): _verify(*a), dict(bytes=7 * V * 2))
        # a decoding step's walk is as long as its accepted drafts plus one (tau 3.1 at T 0: 2.1 on average)
        for accepted in (2, 3):
            yield (f"verify B1 N61 V{V} greedy, {accepted} accepted",
                   lambda a=(1, 61, V, "greedy", torch.bfloat16, accepted): _verify(*a),
                   dict(bytes=(accepted + 1) * V * 2))
    # A sampled chain of 5 drafts at T 1, verified draft by draft or as one block (docs/ops.md §21):
    # SmolLM2-135M's vocabulary and draft vocabulary at batch 1, the Llama-3-8B shape's at batch 8;
    # the block reads all 6 rows of each chain.
    for B, V, Vd in ((1, 49152, 8192), (8, 128256, 32000)):
        for op in ("verify", "block_verify"):
            yield (f"{op} chain B{B} N6 V{V} temperature sampled-drafts", lambda a=(op, B, 6, V, Vd): _chain_verify(*a),
                   dict(bytes=B * 6 * V * 2))
    # The decoder's sampled tree at T 1 with the (6, 8, 60) tree's 61 verify rows (sampled_tree(4, 6, 3)):
    # SmolLM2-135M's vocabulary and draft vocabulary, batch 1.
    yield ("verify tree B1 N61 V49152 temperature sampled-drafts", lambda: _sampled_tree_verify(1, 49152, 8192),
           dict(bytes=49152 * 2))
    # draft_expand at a decoding step's head passes: the root's row, then the 8 frontier rows of
    # the (6, 8, 60) tree, in SmolLM2-135M's and the Llama-3-8B-shaped head's draft vocabularies
    for V in (6144, 32000):
        for M in (1, 8):
            yield (f"draft_expand B1 M{M} V{V} top_k8", lambda a=(1, M, V, 8): _draft_expand(*a),
                   dict(bytes=M * V * 2))
    for K, N, residual in Q8_HEAD_MATRICES:
        yield (f"fp8_linear M8 K{K} N{N}{' residual' if residual else ''}",
               lambda a=(8, K, N, residual): _fp8_linear(*a),
               dict(bytes=N * K + N * 4 + 8 * K * 2 + 8 * N * 2 * (2 if residual else 1)))
        yield (f"q8_0_linear M8 K{K} N{N}{' residual' if residual else ''}",
               lambda a=(8, K, N, residual): _q8_0_linear(*a),
               dict(bytes=N * K * 17 // 16 + 8 * K * 2 + 8 * N * 2 * (2 if residual else 1)))
    for B, N, prefix, heads, D in [(1, 61, 256, (9, 3), 64), (1, 61, 1024, (9, 3), 64), (1, 61, 4096, (9, 3), 64),
                                   (8, 61, 256, (9, 3), 64),
                                   (1, 8, 256, (9, 3), 64), (1, 64, 1024, (32, 8), 128)]:
        for fill in (False, True):
            yield (f"tree_attention B{B} N{N} Hq{heads[0]}/Hkv{heads[1]} D{D} prefix{prefix} "
                   f"{'launcher' if fill else '128-row'}",
                   lambda a=(B, N, prefix, heads, D, fill): _decode_attention(*a),
                   dict(flops=4 * B * N * heads[0] * (prefix + N // 2) * D,
                        bytes=2 * B * (prefix + N) * heads[1] * D * 2))
    # SmolLM2-135M's attention launches of a decoding step at the decoding-step model's prefixes
    # (bench/gpu_step_model.py's cross-check): a decoded token, a head pass's 8 frontier rows, the
    # verify pass's 61 nodes (at 4096 above)
    for N, prefix in ((1, 512), (1, 4096), (8, 512), (8, 4096), (61, 512)):
        yield (f"tree_attention B1 N{N} Hq9/Hkv3 D64 prefix{prefix} launcher",
               lambda a=(1, N, prefix, (9, 3), 64, True): _decode_attention(*a),
               dict(flops=4 * N * 9 * (prefix + N // 2) * 64, bytes=2 * (prefix + N) * 3 * 64 * 2))
    # The blocks tree_attention_config._folding_config chooses between at a 4k cache, merged by a
    # launch or folded into the split programs (docs/gpu_kernels.md, "Row blocks whose partials fold";
    # 32 rows here in 4 warps, the launcher's 32-row blocks there in 2: "Two warps for 32-row blocks").
    for N, heads, D, variants in [(61, (9, 3), 64, [(128, True), (64, True), (32, True), (16, True)]),
                                  (64, (32, 8), 128, [(128, False), (128, True), (32, True)])]:
        for rows, fold in variants:
            yield (f"tree_attention B1 N{N} Hq{heads[0]}/Hkv{heads[1]} D{D} prefix4096 {rows} rows "
                   f"{'folded' if fold else 'merge launch'}",
                   lambda a=(1, N, 4096, heads, D, True, rows, fold): _decode_attention(*a),
                   dict(flops=4 * N * heads[0] * (4096 + N // 2) * D, bytes=2 * (4096 + N) * heads[1] * D * 2))


def smoke_cases():
    """Small shapes (CI): the useful work each must at least count, in ``extra``."""
    # verify's cooperative phases: a row in chunks as the launcher splits it on an H200 (32 of 1024 entries)
    yield ("verify B2 N8 V32768 temperature walk", lambda: _verify(2, 8, 32768, "temperature", walk=True),
           dict(bytes=2 * 32768 * 2))
    B, N, Hq, Hkv, D, prefix = 1, 8, 4, 2, 64, 256
    yield ("tree_attention B1 N8 Hq4/Hkv2 D64 prefix256", lambda: _tree_attention(B, N, prefix, Hq=Hq, Hkv=Hkv, D=D,
                                                                                 page=None),
           dict(flops=4 * B * N * Hq * prefix * D, bytes=2 * B * prefix * Hkv * D * 2))
    yield ("draft_expand B1 M2 V4096 top_k4", lambda: _draft_expand(1, 2, 4096, 4), dict(bytes=1 * 2 * 4096 * 2))


def fmt_us(s: float) -> str:
    return f"{s * 1e6:,.1f}"


def run(cases, samples: int, out=sys.stdout, json_path=None):
    cache: dict = {}
    rows = []
    for name, make, extra in cases:
        start = time.time()
        launches = model_call(make(), samples, cache)
        total = sum(m.time_s for m in launches)
        row = dict(case=name, modeled_us=total * 1e6, launches=[dataclasses.asdict(m) for m in launches],
                   model_s=time.time() - start)
        if isinstance(extra, dict):
            bound = max(extra.get("bytes", 0) / DEVICE.hbm_bytes_per_s, extra.get("flops", 0) / DEVICE.dense_bf16_flops)
            row["roofline_us"] = bound * 1e6 + LAUNCH_OVERHEAD_S * 1e6
            row["minimal"] = extra
        else:
            row["measured_us"] = extra * 1e3
        rows.append(row)
        detail = "; ".join(f"{m.kernel} {m.programs}p {m.waves}w {m.blocks_per_sm}b/SM {fmt_us(m.time_s)} us "
                           f"({m.bound})" for m in launches)
        other = (f"roofline {row['roofline_us']:,.1f} us" if "roofline_us" in row
                 else f"measured {row['measured_us']:,.1f} us ({row['modeled_us'] / row['measured_us']:.2f}x)")
        print(f"{name:45s} modeled {row['modeled_us']:10,.1f} us  {other}  [{detail}]", file=out, flush=True)
        if json_path:  # after every case: a long run leaves what it has modeled
            with open(json_path, "w") as f:
                json.dump(rows, f, indent=1)
    return rows


def fit(rows) -> tuple[float, float, float]:
    """Least squares in log space over (launch overhead, issue rate): returns (overhead, rate, rms log error)."""
    best = None
    for overhead in np.linspace(0e-6, 150e-6, 76):
        for rate in (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0):
            err = []
            for row in rows:
                total = 0.0
                for m in row["launches"]:
                    lm = LaunchModel(**{k: v for k, v in m.items() if k in LaunchModel.__dataclass_fields__})
                    total += lm.finish(overhead, rate).time_s
                err.append(math.log(total / (row["measured_us"] * 1e-6)))
            rms = math.sqrt(sum(e * e for e in err) / len(err))
            if best is None or rms < best[2]:
                best = (overhead, rate, rms)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("goals", "calibrate", "smoke", "decode", "fit"),
                        help="fit: refit the constants on a calibrate --json output (--rows)")
    parser.add_argument("--rows", help="fit: the rows of an earlier calibrate --json run")
    parser.add_argument("--samples", type=int, default=4, help="program ids interpreted per launch")
    parser.add_argument("--package", help="import eagle_kernels from this directory (an older commit)")
    parser.add_argument("--only", help="cases whose name contains this")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--fit", action="store_true", help="calibrate: fit launch overhead and issue rate")
    parser.add_argument("--bench-json", help="calibrate against this pytest-benchmark JSON (bench/gpu_check.sh's "
                        "bench.json) instead of the H200 run")
    parser.add_argument("--device", default="h200", help=f"the modeled card: {', '.join(compile_audit.DEVICES)} "
                        "or a name as CUDA reports it (default h200)")
    parser.add_argument("--device-limits", help="the modeled card as measured: a gpu_goals.json (bench/gpu_goals.py: "
                        "the card's name, SM count, copy bandwidth and bf16 GEMM rate); overrides --device")
    args = parser.parse_args()
    try:
        if args.device_limits:
            with open(args.device_limits) as f:
                profile = compile_audit.measured_device(json.load(f))
        else:
            profile = compile_audit.device_named(args.device)
    except (ValueError, KeyError) as error:
        parser.error(f"--device / --device-limits: {error}")
    if args.mode == "calibrate" and not args.bench_json and profile.name != compile_audit.H200.name:
        parser.error("calibrate without --bench-json compares with the H200 run: model the H200 (--device h200)")
    compile_audit.use_device(profile)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1 (the model compiles and interprets each launch itself)")
    from eagle_kernels.triton._interpreter import speed_up_interpreter

    speed_up_interpreter(vectorise_reductions=False)
    if args.mode == "fit":
        with open(args.rows) as f:
            rows = json.load(f)
        overhead, rate, rms = fit(rows)
        print(f"fit: launch overhead {overhead * 1e6:.1f} us, issue rate {rate} warp instr/clk/SM, "
              f"rms log error {rms:.3f} ({math.exp(rms):.2f}x)")
        for row in rows:
            total = sum(LaunchModel(**{k: v for k, v in m.items() if k in LaunchModel.__dataclass_fields__})
                        .finish(overhead, rate).time_s for m in row["launches"])
            print(f"{row['case']:45s} modeled {total * 1e6:10,.1f} us  measured {row['measured_us']:10,.1f} us  "
                  f"({total * 1e6 / row['measured_us']:.2f}x)")
        return
    import eagle_kernels  # from --package where given (see the imports above)

    print(f"eagle_kernels from {os.path.dirname(eagle_kernels.__file__)}; {DEVICE.name}: {DEVICE.sms} SMs, "
          f"{DEVICE.clock_hz / 1e9:.2f} GHz, copy {DEVICE.hbm_bytes_per_s / 1e12:.2f} TB/s, bf16 "
          f"{DEVICE.dense_bf16_flops / 1e12:.0f} TFLOP/s; launch overhead "
          f"{LAUNCH_OVERHEAD_S * 1e6:.0f} us, issue rate {ISSUE_RATE} warp instr/clk/SM", flush=True)
    if args.mode == "calibrate":
        cases = list(calibration_cases(benchmark_json_ms(args.bench_json) if args.bench_json else H200_RUN_MS))
    else:
        cases = list({"goals": goal_cases, "smoke": smoke_cases, "decode": decode_cases}[args.mode]())
    if args.only:
        cases = [c for c in cases if args.only in c[0]]
    rows = run(cases, args.samples, json_path=args.json)
    if args.fit and args.mode == "calibrate":
        overhead, rate, rms = fit(rows)
        print(f"fit: launch overhead {overhead * 1e6:.1f} us, issue rate {rate} warp instr/clk/SM, "
              f"rms log error {rms:.3f} ({math.exp(rms):.2f}x)")


if __name__ == "__main__":
    main()
