"""Test helpers for the tokenizer/chat tests: GGUF metadata as a plain dict, and the llama.cpp reference data."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"


@functools.lru_cache(maxsize=None)
def _load(path: str) -> dict[str, Any]:
    from ninfer.model_file import ModelFile

    return ModelFile(path).metadata


def load_metadata(path: str | Path) -> dict[str, Any]:
    """GGUF key -> plain Python value (str, int, float, bool or list of those). A fresh copy per call."""
    return dict(_load(str(Path(path).resolve())))


def load_corpus() -> list[str]:
    return json.loads((DATA / "tokenizer_corpus.json").read_text(encoding="utf-8"))


def load_reference() -> dict[str, list[dict[str, Any]]]:
    """{model file: [{"text", "ids", "pieces", "ids_no_special"}]}, written by scripts/make_tokenizer_reference.py."""
    path = DATA / "tokenizer_reference.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
