"""benchmarks/sass_report.py's loop count on cuobjdump-style SASS text: each branch back to an earlier address
closes a loop of the instructions from its target to the branch; forward branches and a branch to itself (the
trap after EXIT) are not loops."""
import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "benchmarks_sass_report", Path(__file__).resolve().parents[1] / "benchmarks" / "sass_report.py")
sass_report = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sass_report)


def _sass(lines):
    """cuobjdump's layout: an address comment, the instruction, its encoding."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {text} ;   /* 0x000000000000 */"
                     for i, text in enumerate(lines))


def test_loop_sizes_counts_each_backward_branch_body():
    sass = _sass(["MOV R1, c[0x0][0x28]", "ISETP.GE.AND P0, PT, R2, 0x1, PT",   # 0x00, 0x10
                  "@P0 BRA 0x80", "LDS.128 R4, [R0]",                           # 0x20 (forward), 0x30
                  "HMMA.16816.F32.BF16 R8, R4, R6, R8", "IADD3 R2, R2, -0x1, RZ",  # 0x40, 0x50
                  "@P1 BRA 0x30",                                               # loop 1: 0x30..0x60, 4
                  "LOP3.LUT R3, R3, 0xf, RZ, 0xc0, !PT", "@!P2 BRA 0x10",      # loop 2: 0x10..0x80, 8
                  "EXIT", "BRA 0xa0"])                                          # the trap: to itself
    assert sass_report.loop_sizes(sass) == [4, 8]
    assert sass_report.loop_sizes(_sass(["MOV R1, R2", "EXIT"])) == []
