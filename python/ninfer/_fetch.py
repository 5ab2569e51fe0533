"""Assemble model files safely: write to a temporary file in the target folder, check the sha256, rename.

An interrupted or failed assembly never leaves a partial file under the final name.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from ninfer.errors import ModelFileError

_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def assemble(parts: Iterable[Path], target: Path, sha256: str) -> Path:
    """Concatenate `parts` into `target` atomically, checking the result's sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with Path(part).open("rb") as f:
                    while block := f.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise ModelFileError(f"{target}: assembled file has sha256 {digest.hexdigest()}, expected {sha256}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
