"""dev/ncu-source-summary: Nsight Compute's source page (PC sampling per SASS instruction) summed over a region."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "dev" / "ncu-source-summary"

PAGE = '''"Kernel Name","gemv_gsq8_stream"
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb"
"0x7f00","LDG.E R7, desc[UR20][R2.64+0x18]","5","4","3"
"0x7f10","ACQBULK","100","100","0"
"0x7f20","LDG.E.128.STRONG.GPU R8, desc[UR20][R8.64]","40","38","30"
"0x7f30","SHFL.BFLY PT, R8, R15, 0x10, 0x1f","25","20","0"
"0x7f40","BAR.SYNC.DEFER_BLOCKING 0x0","30","30","0"
"0x7f50","BAR.SYNC.DEFER_BLOCKING 0x0","1,000","10","0"
'''


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_region_from_the_wait_to_the_next_barrier(tmp_path: Path) -> None:
    page = tmp_path / "page.csv"
    page.write_text(PAGE + PAGE)  # two kernels' tables
    r = run(str(page), "--top", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("6 instructions, 1200 samples; ACQBULK .. BAR.SYNC (rows 1-4): 195 (16.2%)") == 2
    assert "stall_long_sb" in r.stdout and " 188\n" in r.stdout  # the region's not-issued samples
    lines = r.stdout.splitlines()
    top = lines[lines.index("the region's top 2 instructions (row, samples, source):") + 1:][:2]
    assert [t.split()[:2] for t in top] == [["1", "100"], ["2", "40"]]


def test_a_page_without_a_source_table_is_an_error(tmp_path: Path) -> None:
    page = tmp_path / "page.csv"
    page.write_text('"==PROF== no kernels were profiled"\n')
    r = run(str(page))
    assert r.returncode == 1 and "no source table" in r.stderr
