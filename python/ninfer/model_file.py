"""A GGUF model file: the Rust parser's header (metadata, tensor index) plus what Python derives from it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ninfer import _core
from ninfer.config import RopeConfig
from ninfer.errors import ModelFileError
from ninfer.models import build_spec


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type_id: int
    type_name: str
    dims: tuple[int, ...]  # GGML order: row length first
    offset: int
    n_bytes: int
    gsq: tuple[int, int] | None = None  # a GSQ-RCO matrix's (code bits, residual slots per record)

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


class ModelFile:
    """Opens and validates a GGUF file. Weights stay memory-mapped; nothing is copied here. `rope`: RoPE flags
    that override the file's keys in the spec."""

    def __init__(self, path: str | os.PathLike[str], rope: RopeConfig = RopeConfig()):
        self.path = Path(path)
        self.rope = rope
        if not self.path.exists():
            raise ModelFileError(f"{self.path}: no such model file")
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: not a regular file")
        self.gguf = _core.GgufFile(str(self.path))

    @cached_property
    def metadata(self) -> dict[str, Any]:
        return self.gguf.metadata()

    @cached_property
    def map(self) -> np.ndarray:
        """The whole file, memory-mapped read-only (bytes)."""
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    def raw(self, t: TensorEntry) -> np.ndarray:
        """A tensor's bytes as stored (a view of the map, nothing copied)."""
        return self.map[t.offset : t.offset + t.n_bytes]

    def dequantized(self, t: TensorEntry) -> np.ndarray:
        """A GGML-typed tensor's values as f32, [rows, row length] (not for GSQ-RCO records: gsq_dequantize)."""
        return _core.dequantize(t.type_id, bytes(self.raw(t)), t.n_elements).reshape(-1, t.dims[0])

    @cached_property
    def tensors(self) -> list[TensorEntry]:
        """The tensor index. GSQ-RCO matrices (stored as I8 records) appear with their logical shape and the type
        name "GSQ-RCO", a split embedding with its logical shape and "Q2_K+<hot rows' type>" (docs/gsq-rco.md)."""
        out = []
        for n, t, tn, d, o, b in self.gguf.tensors():
            g = self.gsq_infos.get(n)
            gsq = None
            if g is not None and g["type"] == "GSQ-RCO":
                tn, d, gsq = "GSQ-RCO", g["shape"], (g["bits"], g["slots"])
            elif g is not None and "hot_rows" in g:  # a split embedding: its logical shape (model/embedding.rs)
                tn, d = "Q2_K+" + g["hot_type"], g["shape"]
            out.append(TensorEntry(n, t, tn, tuple(d), o, b, gsq))
        return out

    @cached_property
    def gsq_infos(self) -> dict[str, dict[str, Any]]:
        """The per-tensor JSON of a GSQ-RCO file (`gsq.tensor.<name>`), parsed and validated once (format version,
        metadata checksum, every entry against its stored tensor: ninfer/gsq_file.py); empty for other files."""
        from ninfer.gsq_file import tensor_infos_of

        return tensor_infos_of(self.path, self.metadata, self.gguf.tensors())

    def gsq_layouts(self) -> list[tuple[str, int, int]]:
        """(name, code bits, slots) of every GSQ-RCO tensor (format version 2)."""
        return [(name, g["bits"], g["slots"]) for name, g in self.gsq_infos.items() if g["type"] == "GSQ-RCO"]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    @cached_property
    def spec(self) -> dict[str, Any]:
        """The executor spec (raises UnsupportedModelError for architectures ninfer cannot run)."""
        spec = build_spec(self.metadata, {t.name: t.dims for t in self.tensors}, str(self.path), self.rope)
        spec["gsq"] = self.gsq_layouts()
        split = self.gsq_infos.get(spec["token_embd"], {})
        if "hot_rows" in split:
            spec["embd_split"] = (int(GGMLQuantizationType[split["hot_type"]]), split["hot_rows"],
                                  int(GGMLQuantizationType.Q2_K))
        return spec

    def type_name(self, type_id: int) -> str:
        try:
            return GGMLQuantizationType(type_id).name
        except ValueError:
            return f"type{type_id}"

    def weight_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    def bytes_by_type(self) -> Counter[str]:
        """Bytes of the tensors of each type, by type name."""
        out: Counter[str] = Counter()
        for t in self.tensors:
            out[t.type_name] += t.n_bytes
        return out

    def kv_bytes_per_token(self, k_type_bytes: float = 2.0, v_type_bytes: float = 2.0) -> float:
        s = self.spec
        n_layer = len(s["layers"])
        return n_layer * s["n_head_kv"] * (s["head_dim"] * k_type_bytes + s["head_dim_v"] * v_type_bytes)
