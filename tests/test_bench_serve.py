"""scripts/bench-serve end to end on SmolLM2: two ninfer servers (one a --variant with its own flags), two client
counts, every row of the table filled with measured figures and the exact token count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ninfer

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench-serve"


def test_bench_serve_table(smollm2_path: Path) -> None:
    # The ninfer this test imported (the checkout's python/ or the installed package, as CI installs it).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(ninfer.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "-m", str(smollm2_path), "--servers", "ninfer,one", "--variant", "one=-t 1",
         "--clients", "1,2", "--requests", "1", "-n", "5", "-c", "1024", "-np", "2", "-t", "2"],
        capture_output=True, text=True, timeout=300, env=env, check=True).stdout
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()[2:]]
    # Client counts in order; the servers' order reversed for the second count.
    assert [(r[0], r[1]) for r in rows] == [("ninfer", "1"), ("one", "1"), ("one", "2"), ("ninfer", "2")]
    for r in rows:
        ttft, tps, p50, p95, p99 = map(float, r[2:7])
        assert ttft > 0 and tps > 0 and 0 < p50 <= p95 <= p99
        assert int(r[7]) == 5 * int(r[1])
