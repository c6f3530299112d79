"""Audit of the CPU kernels' compiled hot loops: does any loop that does vector arithmetic store a
vector register to a stack slot that the loop never reads?

That is the signature of a tile whose accumulator array the compiler kept in memory: every k step
updates the accumulators in registers and then writes each one back to its array slot, a store per
accumulator per step that nothing reads until the loop ends. GCC 12 did this to the AVX2 tiles of
the packed cpu_linear kernel (12 such 256-bit stores beside 12 FMAs a k step) until their loops over
the tile's rows were marked for complete unrolling (``EAGLE_UNROLL``, csrc/cpu/simd.h;
docs/cpu_kernels.md, "Accumulators kept in registers"). A spill (a store the loop reads back) is
register pressure, a different matter, and is not reported.

Loops are read off the disassembly (``objdump -d``): a backward branch inside a function closes a
loop from its target to the branch; ranges that contain a ``ret`` are branches to a shared epilogue,
not loops. Checked are the innermost of the loops with at least one multiply-add or dot-product
instruction (the kernels' arithmetic; a loop without any inside one, as the prefetch pacing's, does
not count), of at most ``TIGHT_LOOP_INSTRUCTIONS`` instructions: a tile's k step. A longer range is
a loop around whole tiles whose own k loop the compiler laid out elsewhere (one such, around the
AVX-512 row-major tiles' K tail, keeps a stack slot across its tiles).

    python bench/cpu_loop_audit.py [EXTENSION.so]   # lists the loops with dead stores; exit 1 if any
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

TIGHT_LOOP_INSTRUCTIONS = 200  # the longest loop checked: a tile's k step (see above)
_FUNCTION = re.compile(r"^([0-9a-f]+) <(.*)>:$")
_INSTRUCTION = re.compile(r"^\s+([0-9a-f]+):\s+(.*)$")
_BRANCH = re.compile(r"^j\w*\s+([0-9a-f]+)\s")
# The kernels' arithmetic: FMAs (vfmadd / vfnmadd / vfmsub ...), bf16 and int8 dot products.
_ARITHMETIC = re.compile(r"^v(f\w*madd|f\w*msub|dpbf16ps|pdpbusd|pmaddubsw|pmaddwd)")
# A frame slot: an offset from %rsp or %rbp with no index register.
_SLOT = re.compile(r"(-?0x[0-9a-f]+)?\(%(rsp|rbp)\)")
_VECTOR_STORE = re.compile(r"^v\w*mov\w*\s+%[xyz]mm\d+,\s*(-?0x[0-9a-f]+)?\(%(rsp|rbp)\)$")


@dataclass(frozen=True)
class Loop:
    function: str
    start: int  # address of the branch target
    end: int  # address of the backward branch
    instructions: int
    arithmetic: int  # multiply-add / dot-product instructions
    dead_stores: tuple[str, ...]  # frame slots stored from a vector register and never read in the loop


def disassemble(path: str) -> str:
    """``objdump -d`` of ``path`` (demangled, no raw bytes). Raises RuntimeError without objdump."""
    tool = shutil.which("objdump")
    if tool is None:
        raise RuntimeError("objdump (binutils) is not installed")
    return subprocess.run([tool, "-d", "--no-show-raw-insn", "-C", path], capture_output=True, text=True,
                          check=True).stdout


def functions(text: str) -> dict[str, list[tuple[int, str]]]:
    """Function name -> [(address, instruction text)] from objdump's output (PLT stubs left out)."""
    found: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = None if "@plt" in m.group(2) else m.group(2)
            if current is not None:
                found[current] = []
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            found[current].append((int(m.group(1), 16), m.group(2).strip()))
    return found


def _slot(match) -> str:
    """A frame slot as offset(%register), the offset 0x0 where the operand has none."""
    return f"{match.group(1) or '0x0'}(%{match.group(2)})"


def arithmetic_loops(name: str, code: list[tuple[int, str]]) -> list[Loop]:
    """The innermost loops of one function among those that contain multiply-adds or dot products."""
    if not code:
        return []
    first = code[0][0]
    ranges = []
    for address, text in code:
        m = _BRANCH.match(text)
        if m and first <= int(m.group(1), 16) <= address:
            ranges.append((int(m.group(1), 16), address))
    bodies = {}
    for lo, hi in ranges:
        body = [text for address, text in code if lo <= address <= hi]
        if not any(text.startswith("ret") for text in body):
            bodies[(lo, hi)] = body
    counts = {key: sum(1 for text in body if _ARITHMETIC.match(text)) for key, body in bodies.items()}
    loops = []
    for (lo, hi), body in bodies.items():
        arithmetic = counts[(lo, hi)]
        # Innermost among the arithmetic loops: a loop without arithmetic inside (the prefetch pacing's) does not count.
        if not arithmetic or any(other != (lo, hi) and lo <= other[0] and other[1] <= hi and counts[other]
                                 for other in bodies):
            continue
        stored, read = [], set()
        for text in body:
            m = _VECTOR_STORE.match(text)
            if m:
                stored.append(_slot(m))
                continue
            read.update(_slot(s) for s in _SLOT.finditer(text))
        dead = tuple(sorted({slot for slot in stored if slot not in read}))
        loops.append(Loop(name, lo, hi, len(body), arithmetic, dead))
    return loops


def audit(text: str, max_instructions: int = TIGHT_LOOP_INSTRUCTIONS) -> list[Loop]:
    """Every innermost arithmetic loop of a disassembly of at most ``max_instructions`` instructions, in address
    order."""
    return sorted((loop for name, code in functions(text).items() for loop in arithmetic_loops(name, code)
                   if loop.instructions <= max_instructions), key=lambda loop: loop.start)


def extension_path() -> str:
    from eagle_kernels import _C  # the built extension (ImportError when it is not built)

    return _C.__file__


def main(argv: list[str]) -> int:
    path = argv[0] if argv else extension_path()
    loops = audit(disassemble(path))
    dead = [loop for loop in loops if loop.dead_stores]
    print(f"{path}: {len(loops)} innermost loops of at most {TIGHT_LOOP_INSTRUCTIONS} instructions with "
          "multiply-adds or dot products, "
          f"{len(dead)} of them storing vector registers to stack slots they never read")
    for loop in dead:
        print(f"  {loop.function[:140]} @ {loop.start:#x}: {len(loop.dead_stores)} dead slot(s), "
              f"{loop.arithmetic} arithmetic of {loop.instructions} instructions")
    return 1 if dead else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
