"""The CPU kernels' compiled hot loops keep their accumulators in registers (bench/cpu_loop_audit.py).

A tile loop that writes every accumulator back to a stack slot at every k step, a slot nothing in the
loop reads, runs at a fraction of its FMA rate: GCC 12 compiled the packed cpu_linear kernel's AVX2
tiles that way (about 30 against 85 GFLOP/s at 8-16 rows, one thread, Zen AVX2) until their loops
over the tile's rows were marked ``EAGLE_UNROLL``. The first tests check the audit's reading of
hand-written disassembly (a dead store is flagged, a spill the loop reads back is not, nor a branch
to a shared epilogue); the last runs it over the built extension."""

from __future__ import annotations

import os
import platform
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench"))
import cpu_loop_audit  # noqa: E402

# A tight loop whose two FMA results are also stored to the frame every step (the dead-store
# pattern, as GCC emitted it for tile256<1>) and a second one that spills and reloads a register.
DISASSEMBLY = """
0000000000001000 <tile_with_dead_stores>:
    1000:	push   %rbp
    1004:	vbroadcastss (%rcx),%ymm14
    1009:	vmovups (%rsi),%ymm1
    100d:	vmovups 0x20(%rsi),%ymm0
    1012:	vfmadd231ps %ymm14,%ymm1,%ymm2
    1017:	vfmadd231ps %ymm14,%ymm0,%ymm3
    101c:	vmovaps %ymm2,-0x78(%rsp)
    1022:	vmovaps %ymm3,0x48(%rsp)
    1028:	add    $0x40,%rsi
    102c:	cmp    %rdi,%r11
    102f:	jne    1004 <tile_with_dead_stores+0x4>
    1031:	ret

0000000000002000 <tile_with_a_spill>:
    2000:	vmovups (%rsi),%ymm1
    2004:	vfmadd231ps %ymm14,%ymm1,%ymm2
    2009:	vmovaps %ymm2,0x20(%rsp)
    200f:	vfmadd213ps 0x20(%rsp),%ymm1,%ymm3
    2015:	vmovaps %ymm3,-0x40(%rbp)
    201b:	vaddps -0x40(%rbp),%ymm3,%ymm4
    2020:	cmp    %rdi,%r11
    2023:	jne    2000 <tile_with_a_spill>
    2025:	ret

0000000000003000 <branch_to_epilogue>:
    3000:	vfmadd231ps %ymm14,%ymm1,%ymm2
    3005:	vmovaps %ymm2,0x20(%rsp)
    300b:	vzeroupper
    300e:	ret
    300f:	vmovaps %ymm3,-0x60(%rsp)
    3015:	jne    3000 <branch_to_epilogue>

0000000000004000 <tile@plt>:
    4000:	jmp    *0x0(%rip)
"""


def test_audit_flags_dead_stores_only():
    loops = cpu_loop_audit.audit(DISASSEMBLY)
    by_name = {loop.function: loop for loop in loops}
    assert set(by_name) == {"tile_with_dead_stores", "tile_with_a_spill"}  # the epilogue branch is no loop
    dead = by_name["tile_with_dead_stores"]
    assert (dead.arithmetic, dead.instructions) == (2, 10)
    assert dead.dead_stores == ("-0x78(%rsp)", "0x48(%rsp)")
    assert by_name["tile_with_a_spill"].dead_stores == ()


def test_audit_takes_innermost_loops():
    nested = """
0000000000001000 <nested>:
    1000:	mov    %rax,%rbx
    1003:	vfmadd231ps %ymm14,%ymm1,%ymm2
    1008:	vmovaps %ymm2,0x20(%rsp)
    100e:	jne    1003 <nested+0x3>
    1010:	vmovaps %ymm5,0x60(%rsp)
    1016:	jne    1000 <nested>
    1018:	ret
"""
    (loop,) = cpu_loop_audit.audit(nested)
    assert (loop.start, loop.end, loop.dead_stores) == (0x1003, 0x100E, ("0x20(%rsp)",))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 disassembly")
def test_extension_tile_loops_keep_accumulators_in_registers():
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    try:
        path = cpu_loop_audit.extension_path()
    except ImportError:
        pytest.skip("the native extension is not built")
    tight = cpu_loop_audit.audit(cpu_loop_audit.disassemble(path))
    # The audit found the kernels' loops (it cannot pass by finding none): the packed kernel's AVX2
    # and AVX-512 tiles and the row-major tiles among them.
    names = " ".join(loop.function for loop in tight)
    assert len(tight) > 100
    for tile in ("tile256<6, float>", "tile512<1, 12, float>", "avx2::QuadTiles, float>"):
        assert tile in names, tile
    dead = [f"{loop.function} @ {loop.start:#x}: {loop.dead_stores}" for loop in tight if loop.dead_stores]
    assert not dead, "loops storing accumulators to stack slots they never read:\n" + "\n".join(dead)
