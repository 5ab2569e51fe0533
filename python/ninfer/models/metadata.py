"""Typed, range-checked reads of GGUF metadata: every key the engine reads goes through `MetadataReader`.

A model file is untrusted input. A key of the wrong type (a string where a float belongs, an array where a count
belongs) or out of range (a NaN epsilon, a negative context, a billion layers) is refused here with one line that
names the key and shows the value (`ninfer.errors.shown`: quoted, escaped, cut), never a traceback and never a
model that loads and then generates garbage.

The Rust binding gives scalars as Python values, string arrays as lists of str and numeric arrays as numpy arrays
(ninfer._core.GgufFile.metadata), so "an array of integers" means a numpy array of an integer dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ninfer.errors import ModelFileError, NinferError, shown

_MISSING: Any = object()

# Bounds no real model comes near, so that no count read from a file can size an allocation or a loop on its own.
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20  # embedding length, feed-forward length
MAX_HEADS = 1 << 14
MAX_HEAD_DIM = 1 << 14
MAX_CONTEXT = 1 << 30
MAX_VOCAB = 1 << 24


def _kind(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of {value.size} {value.dtype}"
    if isinstance(value, list):
        return f"an array of {len(value)} strings"
    return f"{type(value).__name__} {shown(value)}"


class MetadataReader:
    """Reads `{arch}.*`-templated keys of one file's metadata; `error` is the class raised (ModelFileError for the
    model's hyperparameters, TokenizerError for the vocabulary)."""

    def __init__(self, metadata: Mapping[str, Any], path: str, arch: str = "",
                 error: type[NinferError] = ModelFileError) -> None:
        self.md, self.path, self.arch, self.error = metadata, path, arch, error

    def key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def fail(self, template: str, what: str) -> NinferError:
        prefix = f"{self.path}: " if self.path else ""
        return self.error(f"{prefix}metadata key {self.key(template)} {what}")

    def has(self, template: str) -> bool:
        return self.key(template) in self.md

    def _value(self, template: str, default: Any) -> Any:
        key = self.key(template)
        if key in self.md:
            return self.md[key]
        if default is _MISSING:
            raise self.fail(template, "is missing")
        return default

    def integer(self, template: str, default: Any = _MISSING, *, lo: int = 1, hi: int = MAX_CONTEXT,
            per_layer: bool = False) -> int:
        """An integer in lo..hi. per_layer: a per-layer array is accepted when all its entries are equal (every
        supported architecture uses one value for all layers)."""
        value = self._value(template, default)
        if per_layer and isinstance(value, np.ndarray) and value.ndim == 1 and value.size \
                and np.issubdtype(value.dtype, np.integer) and (value == value[0]).all():
            value = int(value[0])
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise self.fail(template, f"must be an integer, not {_kind(value)}")
        if not lo <= value <= hi:
            raise self.fail(template, f"= {value} is out of range ({lo} to {hi})")
        return int(value)

    def number(self, template: str, default: Any = _MISSING, *, lo: float, hi: float, lo_open: bool = True) -> float:
        """A finite number in (lo, hi] (lo_open) or [lo, hi]; integers are accepted as numbers."""
        value = self._value(template, default)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise self.fail(template, f"must be a number, not {_kind(value)}")
        value = float(value)
        if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
            bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
            raise self.fail(template, f"= {value:.7g} is out of range {bound}")
        return value

    def text(self, template: str, default: Any = _MISSING, choices: tuple[str, ...] | None = None) -> str:
        value = self._value(template, default)
        if not isinstance(value, str):
            raise self.fail(template, f"must be a string, not {_kind(value)}")
        if choices is not None and value not in choices:
            raise self.fail(template, f"= {shown(value)} is not one of {', '.join(choices)}")
        return value

    def flag(self, template: str, default: bool) -> bool:
        value = self._value(template, default)
        if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
            return bool(value)
        raise self.fail(template, f"must be a bool, not {_kind(value)}")

    def str_array(self, template: str, default: Any = _MISSING, *, max_len: int = MAX_VOCAB) -> list[str]:
        value = self._value(template, default)
        if not isinstance(value, list):
            raise self.fail(template, f"must be an array of strings, not {_kind(value)}")
        if len(value) > max_len:
            raise self.fail(template, f"has {len(value)} entries (at most {max_len})")
        return value

    def num_array(self, template: str, n: int, *, integer: bool) -> np.ndarray | None:
        """An array of at least n numbers (integers if `integer`), its first n entries; None when absent."""
        value = self._value(template, None)
        if value is None:
            return None
        kind = np.integer if integer else np.number
        if isinstance(value, (list, tuple)) and len(value) <= MAX_VOCAB:  # (plain Python values, from tests or tools)
            value = np.asarray(value) if all(isinstance(v, (int, float)) for v in value) else value
        if not isinstance(value, np.ndarray) or value.ndim != 1 or not np.issubdtype(value.dtype, kind) \
                or np.issubdtype(value.dtype, np.bool_):
            raise self.fail(template, f"must be an array of {'integers' if integer else 'numbers'}, "
                                      f"not {_kind(value)}")
        if value.size < n:
            raise self.fail(template, f"has {value.size} entries for {n} tokens")
        return value[:n]
