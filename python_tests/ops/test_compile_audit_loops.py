"""The compile audit's SASS loop finder (bench/compile_audit.py ``sass_loops``) on hand-written
SASS: natural loops of the control-flow graph, not every backward branch. No compile, no GPU."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench"))
import compile_audit  # noqa: E402


def test_sass_loops_plain_loop_and_local_memory():
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDL R2, [R1] ;
        /*0020*/                   FADD R3, R2, R2 ;
        /*0030*/               @P0 BRA `(.L_x_0) ;
        /*0040*/                   STL [R1], R3 ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
.L_x_1:
        /*0060*/                   EXIT ;
.L_x_2:
        /*0070*/                   BRA `(.L_x_2);
"""
    count, loops = compile_audit.sass_loops(sass)
    assert count == 8
    assert [(loop.instructions, loop.innermost, loop.local_memory) for loop in loops] == [(3, True, 1)]


def _loops(sass):
    return [(loop.start, loop.end, loop.instructions, loop.innermost, loop.local_memory)
            for loop in compile_audit.sass_loops(sass)[1]]


def test_sass_loops_nested():
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   MOV R4, RZ ;
.L_x_1:
        /*0020*/                   LDL R2, [R1] ;
        /*0030*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0040*/                   ISETP.GE.AND P1, PT, R4, 0x8, PT ;
        /*0050*/              @!P1 BRA `(.L_x_1) ;
        /*0060*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0070*/                   BRA.U !UP0, `(.L_x_0) ;
        /*0080*/                   STL [R1], R5 ;
        /*0090*/                   EXIT ;
"""
    # BRA.U with a predicate operand is conditional: the STL after it is reachable, outside the loops.
    assert _loops(sass) == [(0x20, 0x50, 4, True, 1), (0x10, 0x70, 7, False, 1)]


def test_sass_loops_divergence_code_after_exit_is_no_loop():
    # ptxas places the non-converged path of a shuffle after EXIT and jumps back into the body: a
    # backward branch whose target does not dominate it, not a loop (the local load there neither).
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   BSSY B0, `(.L_x_1) ;
        /*0020*/                   BRA.DIV UR4, `(.L_x_2) ;
        /*0030*/                   SHFL.BFLY PT, R3, R2, 0x10, 0x1f ;
.L_x_3:
        /*0040*/                   BSYNC B0 ;
.L_x_1:
        /*0050*/                   STG.E [R6.64], R3 ;
        /*0060*/                   EXIT ;
.L_x_2:
        /*0070*/                   LDL R2, [R1] ;
        /*0080*/                   WARPSYNC.ALL ;
        /*0090*/                   SHFL.BFLY P0, R3, R2, 0x10, 0x1f ;
        /*00a0*/                   BRA `(.L_x_3) ;
.L_x_4:
        /*00b0*/                   BRA `(.L_x_4);
"""
    count, loops = compile_audit.sass_loops(sass)
    assert count == 12 and loops == []


def test_sass_loops_divergence_code_of_a_loop():
    # Inside a real loop the out-of-line code belongs to it (its local memory counts), but the
    # loop's extent and instruction count are those of the in-line body.
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   BRA.DIV UR4, `(.L_x_2) ;
        /*0020*/                   SHFL.BFLY PT, R3, R2, 0x10, 0x1f ;
.L_x_1:
        /*0030*/                   ISETP.GE.AND P1, PT, R3, 0x8, PT ;
        /*0040*/              @!P1 BRA `(.L_x_0) ;
        /*0050*/                   EXIT ;
.L_x_2:
        /*0060*/                   STL [R1], R2 ;
        /*0070*/                   SHFL.BFLY P0, R3, R2, 0x10, 0x1f ;
        /*0080*/                   BRA `(.L_x_1) ;
"""
    assert _loops(sass) == [(0x10, 0x40, 4, True, 1)]


def test_sass_loops_predicated_branches():
    # A predicated forward branch (if-then) is no loop; a backward jump into code its source is
    # not dominated by (two blocks laid out in reverse order) is no loop either.
    sass = """
        /*0000*/                   ISETP.GE.AND P0, PT, R0, 0x8, PT ;
        /*0010*/               @P0 BRA `(.L_x_2) ;
.L_x_1:
        /*0020*/                   LDL R2, [R1] ;
        /*0030*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*0040*/               @P1 BRA `(.L_x_3) ;
        /*0050*/                   FADD R3, R2, R2 ;
        /*0060*/                   BRA `(.L_x_1) ;
.L_x_3:
        /*0070*/               @P2 EXIT ;
        /*0080*/                   STL [R1], R3 ;
        /*0090*/               @P3 BRA `(.L_x_3) ;
        /*00a0*/                   EXIT ;
"""
    # The only loop: the predicated EXIT falls through to the STL, whose predicated branch goes back.
    assert _loops(sass) == [(0x70, 0x90, 3, True, 1)]
