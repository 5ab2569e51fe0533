"""The CUDA kernel registry: kernels/*.cu compiled once per process by CuPy (NVRTC) for the device's
architecture, as one module (every file sees common.cuh and quant.cuh, prepended here). CuPy caches the binary
on disk keyed by the source text, options and architecture, so a second process starts without compiling.

The sources live in python/ninfer/kernels/, so the wheel ships them as package data. NINFER_KERNELS_DIR overrides
them (for trying a kernel edit against an installed package, or A/B runs of another tree's kernels, as
scripts/gpu-check does)."""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

HEADERS = ("common.cuh", "quant.cuh")
# in dependency order
SOURCES = ("norm.cu", "rope_kv.cu", "kv_quant.cu", "gemv_dot.cu", "gemv_gsq3_pairs.cu", "gemv.cu", "gemv_stream.cu",
           "gemv_stream_q6k.cu", "attention_keys.cu", "attention.cu", "misc.cu")


def kernels_dir() -> Path:
    env = os.environ.get("NINFER_KERNELS_DIR")
    here = Path(__file__).resolve().parent
    candidates = ([Path(env)] if env else []) + [here.parent / "kernels"]
    for c in candidates:
        if (c / "common.cuh").is_file():
            return c
    raise FileNotFoundError("CUDA kernel sources not found (looked in " + ", ".join(map(str, candidates)) + ")")


def source_of(*files: str) -> str:
    """Headers + the given .cu files (all of them when none given) as one translation unit."""
    d = kernels_dir()
    parts = []
    for name in HEADERS + (files or SOURCES):
        text = (d / name).read_text()
        parts.append(f"// ---- {name}\n" + text.replace("#pragma once", ""))
    return "\n".join(parts)


# The compiler options every module takes, before its own (dev/cubin builds with them too, so that its CUBINs are
# the engine's).
BASE_OPTIONS = ("-std=c++17",)
# An attention module's sources, and the switches that pick its head size and group size.
ATTENTION_SOURCES = ("norm.cu", "rope_kv.cu", "attention_keys.cu", "attention.cu")


# Attention over the quantized KV cache: its sources, and the switches for head size and group size.
QUANT_ATTENTION_SOURCES = ("norm.cu", "rope_kv.cu", "kv_quant.cu", "attention_quant.cu")
# The tiered KV cache's kernels (selection, attention, moves between tiers), built on the quantized cache's.
TIERED_SOURCES = (*QUANT_ATTENTION_SOURCES, "attention_tiered.cu", "tier_select.cu", "kv_tiers.cu")


def attention_options(hd: int, group: int) -> tuple[str, ...]:
    return (f"-DATT_HD={hd}", f"-DATT_NG={group}")


def _options(*extra: str) -> tuple[str, ...]:
    return (*BASE_OPTIONS, *extra)


@lru_cache(maxsize=None)
def module():
    import cupy

    return cupy.RawModule(code=source_of(), options=_options())


@lru_cache(maxsize=None)
def _attention_module(hd: int, group: int):
    """TinyFlash for one head size and group size (kernels/attention.cu): compiled when a model needs it."""
    import cupy

    return cupy.RawModule(code=source_of(*ATTENTION_SOURCES), options=_options(*attention_options(hd, group)))


@lru_cache(maxsize=None)
def _quant_attention_module(hd: int, group: int):
    """Attention over the quantized KV cache for one head size and group size (kernels/attention_quant.cu)."""
    import cupy

    return cupy.RawModule(code=source_of(*QUANT_ATTENTION_SOURCES),
                          options=_options(f"-DQATT_HD={hd}", f"-DQATT_NG={group}"))


@lru_cache(maxsize=None)
def _tiered_module(hd: int, group: int):
    """The tiered KV cache's kernels for one head size and group size (kernels/attention_tiered.cu)."""
    import cupy

    return cupy.RawModule(code=source_of(*TIERED_SOURCES), options=_options(f"-DQATT_HD={hd}", f"-DQATT_NG={group}"))


@lru_cache(maxsize=None)
def function(name: str):
    m = re.fullmatch(r"attention(?:_step)?_hd(\d+)_g(\d+)", name)
    if m:
        return _attention_module(int(m[1]), int(m[2])).get_function(name)
    m = re.fullmatch(r"(attention_quant_k\dv\d)_hd(\d+)_g(\d+)", name)
    if m:
        return _quant_attention_module(int(m[2]), int(m[3])).get_function(m[1])
    m = re.fullmatch(r"(attention_tiered|tier_[a-z0-9_]+?)_hd(\d+)_g(\d+)", name)
    if m:
        return _tiered_module(int(m[2]), int(m[3])).get_function(m[1])
    return module().get_function(name)
