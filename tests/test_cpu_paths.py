"""NINFER_CPU: forcing a CPU kernel set, and the errors for a value that names none or a set the CPU lacks.

The variable is read once per process, so each case runs in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ninfer



def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


FLAGS = _cpu_flags()
HAS_AVX2 = {"avx2", "fma", "f16c"} <= FLAGS
HAS_AVX512 = HAS_AVX2 and {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= FLAGS


def _run(code: str, cpu: str) -> subprocess.CompletedProcess:
    # The ninfer this test imported (the checkout's python/ or the installed package, as CI installs it).
    env = dict(os.environ, NINFER_CPU=cpu, PYTHONPATH=str(Path(ninfer.__file__).parents[1]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


LOAD = """
import ninfer, sys
try:
    ninfer.LLM(sys.argv[1] if len(sys.argv) > 1 else {path!r}, n_ctx=64, threads=1)
except ninfer.errors.InvalidArgumentError as e:
    print("InvalidArgumentError:", e)
else:
    print("loaded", ninfer._core.simd_isa())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/cpuinfo")
@pytest.mark.parametrize(
    ("cpu", "expected"),
    [
        ("scalar", "scalar"),
        pytest.param("avx2", "avx2", marks=pytest.mark.skipif(not HAS_AVX2, reason="this CPU lacks AVX2/FMA/F16C")),
        pytest.param("avx512", "avx512", marks=pytest.mark.skipif(not HAS_AVX512, reason="this CPU lacks AVX-512")),
        pytest.param("AVX2 ", "avx2", marks=pytest.mark.skipif(not HAS_AVX2, reason="this CPU lacks AVX2/FMA/F16C")),
    ],
)
def test_ninfer_cpu_forces_the_kernel_set(smollm2_path: Path, cpu: str, expected: str) -> None:
    out = _run(LOAD.format(path=str(smollm2_path)), cpu)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("loaded "), line
    isa = line.split()[1]
    # On a CPU with AVX512-FP16 the AVX-512 set is named for it (its f16 attention rounds in half precision).
    assert isa == expected or (expected == "avx512" and isa == "avx512fp16" and "avx512_fp16" in FLAGS), line


def test_unknown_ninfer_cpu_is_an_error_at_load(smollm2_path: Path) -> None:
    out = _run(LOAD.format(path=str(smollm2_path)), "avx1024")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "InvalidArgumentError: NINFER_CPU=\"avx1024\" names no CPU path: use avx512, avx2 or scalar, or leave it unset"
    )


@pytest.mark.skipif(HAS_AVX512 or sys.platform != "linux", reason="this CPU has AVX-512 (or no /proc/cpuinfo)")
def test_a_path_the_cpu_lacks_is_an_error_at_load(smollm2_path: Path) -> None:
    out = _run(LOAD.format(path=str(smollm2_path)), "avx512")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("InvalidArgumentError: NINFER_CPU=avx512 but this CPU lacks it"), out.stdout
