"""Validated settings objects: built once, checked when built (ValueError subclasses, never assert)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from ninfer.errors import InvalidArgumentError

# Cache storage types by their llama.cpp spelling, with GGML type ids and bytes per element.
CACHE_TYPES: dict[str, tuple[int, float]] = {
    "f32": (0, 4.0),
    "f16": (1, 2.0),
    "q8_0": (8, 34 / 32),
    "q4_0": (2, 18 / 32),
}


KV_SCORERS = ("keys", "bound")
# Decode steps one ranking of every older block serves (kv_rescan, both backends): the steps between rank its
# shortlist of 4x the budget's blocks. At 8, the 0.5B's teacher-forced KL and top-1 at 4K are those of ranking every
# step, a CPU step at depth 16K costs two thirds and the GPU's 32B-shape step at 160K three quarters (BENCHMARKS.md,
# "Ranking every older block every few steps").
DEFAULT_KV_RESCAN = 8


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05. temperature 0 is greedy."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and self.temperature != float("inf")):
            raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgumentError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise InvalidArgumentError(f"seed must be an integer in 0..2^64-1, got {self.seed!r}")


# Worker threads at most (ggml's GGML_MAX_N_THREADS): a million asked for used to hang while they were spawned.
MAX_THREADS = 512


def stop_strings(stop: str | Sequence[str]) -> list[str]:
    """A generate call's `stop` as a list: one string is one stop string (not its characters), empty ones are
    dropped (as llama-server does); anything but strings is an InvalidArgumentError."""
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, Sequence) or any(not isinstance(s, str) for s in stop):
        raise InvalidArgumentError(f"stop must be a string or a sequence of strings, got {stop!r}")
    return [s for s in stop if s]


# Tokens per block of a tiered KV cache: the unit of sparse selection (Quest picks pages of 16; larger blocks
# cost fewer summaries and less scoring per step).
TIERED_BLOCK_SIZE = 64
# Tokens per block of a cache with q4_0 keys: each block's keys are stored less their mean (the K offset), and Qwen2's
# key bias, turned by RoPE with the position, is taken out far better by a mean every 32 positions than every 256
# (Qwen2.5-Coder-0.5B prose, 4 chunks: +9.8% perplexity against f16 with 256, +2.6% with 32; the offsets cost
# 4 bytes a key dimension a block, 12% of a q4_0 K and V cache; docs/journal/kv-q4-keys.md).
Q4_KEY_BLOCK_SIZE = 32


@dataclass(frozen=True)
class EngineConfig:
    n_ctx: int = 4096
    threads: int = 0  # 0: every core the process may use
    n_batch: int = 512
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    kv_block_size: int = 256
    # The tiered KV cache (kv_l1 > 0): the newest kv_l1 tokens in f16, the next kv_l2 in q8_0, older ones in q4_0
    # in an L3 ring (anonymous memory, or the file kv_l3_file); a decode step reads kv_select tokens of the older
    # tiers, the blocks kv_scorer ranks highest (0: all). no_l3_cache: no L3 (every older block stays
    # in L2, in device memory on cuda).
    kv_l1: int = 0
    kv_l2: int = 0
    kv_select: int = 0
    kv_l3_file: str | None = None
    no_l3_cache: bool = False
    # How selection ranks older blocks: "keys" (the largest q·k over a block's stored keys) or "bound" (Quest's bound
    # from its key summary); None: "keys" (both backends).
    kv_scorer: str | None = None
    # Decode steps one ranking of every older block serves; the steps between rank its shortlist (4x the budget's
    # best blocks) and the blocks that became older since. None: DEFAULT_KV_RESCAN.
    kv_rescan: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_ctx", "n_batch", "kv_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
        for name in ("kv_l1", "kv_l2", "kv_select"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"{name} must be an integer >= 0, got {value!r}")
        if self.kv_l3_file is not None and not isinstance(self.kv_l3_file, str):
            raise InvalidArgumentError(f"kv_l3_file must be a path, got {self.kv_l3_file!r}")
        if not self.tiered and (self.kv_l2 or self.kv_select or self.kv_l3_file or self.no_l3_cache):
            raise InvalidArgumentError("kv_l2, kv_select, kv_l3_file and no_l3_cache set up the tiered KV cache: "
                                       "give kv_l1 too")
        if self.kv_scorer not in (None, *KV_SCORERS):
            raise InvalidArgumentError(f"kv_scorer '{self.kv_scorer}' is not one of {', '.join(KV_SCORERS)}")
        if self.kv_scorer is not None and not self.kv_select:
            raise InvalidArgumentError("kv_scorer ranks blocks for selection: give kv_select too")
        if self.kv_rescan is not None:
            if not isinstance(self.kv_rescan, int) or isinstance(self.kv_rescan, bool) or self.kv_rescan < 1:
                raise InvalidArgumentError(f"kv_rescan must be an integer >= 1, got {self.kv_rescan!r}")
            if not self.kv_select:
                raise InvalidArgumentError("kv_rescan paces the ranking of blocks for selection: give kv_select too")
        if self.no_l3_cache and (self.kv_l2 or self.kv_l3_file):
            raise InvalidArgumentError("no_l3_cache keeps every older token in L2: leave kv_l2 and kv_l3_file unset")
        if self.tiered:
            if self.kv_l1 < TIERED_BLOCK_SIZE:
                raise InvalidArgumentError(f"kv_l1 must be at least one block of {TIERED_BLOCK_SIZE} tokens, "
                                           f"got {self.kv_l1}")
            if (self.cache_type_k, self.cache_type_v) != ("f16", "f16"):
                raise InvalidArgumentError("the tiered KV cache sets its own precisions (f16, q8_0, q4_0): leave "
                                           "the cache types at f16")
        if not isinstance(self.threads, int) or not 0 <= self.threads <= MAX_THREADS:
            raise InvalidArgumentError(f"threads must be an integer in 0..{MAX_THREADS} (0: every core), "
                                       f"got {self.threads!r}")
        for name in ("cache_type_k", "cache_type_v"):
            if getattr(self, name) not in CACHE_TYPES:
                raise InvalidArgumentError(
                    f"{name} '{getattr(self, name)}' is not supported (one of {', '.join(CACHE_TYPES)})"
                )

    @property
    def tiered(self) -> bool:
        return self.kv_l1 > 0

    @property
    def l2_tokens(self) -> int:
        """L2's size in tokens as the engines take it: with no L3, every position of the context."""
        return self.n_ctx if self.no_l3_cache else self.kv_l2

    @property
    def resolved_kv_scorer(self) -> str:
        return self.kv_scorer or "keys"

    @property
    def resolved_kv_rescan(self) -> int:
        return self.kv_rescan or DEFAULT_KV_RESCAN

    @property
    def block_size(self) -> int:
        """Tokens per KV block: a tiered cache's blocks are what selection picks from, so they are smaller; a cache
        with q4_0 keys takes a key offset every Q4_KEY_BLOCK_SIZE positions."""
        if self.tiered:
            return TIERED_BLOCK_SIZE
        return Q4_KEY_BLOCK_SIZE if self.cache_type_k == "q4_0" else self.kv_block_size

    @property
    def resolved_threads(self) -> int:
        if self.threads:
            return self.threads
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not on Linux
            return max(1, os.cpu_count() or 1)


ROPE_SCALING_TYPES = ("none", "linear", "yarn")


def _f32(value: float) -> float:
    """A flag's number as llama.cpp holds it (std::stof: a float)."""
    return float(np.float32(value))


@dataclass(frozen=True)
class RopeConfig:
    """RoPE settings given by the caller, with llama.cpp's flags' meanings (common/arg.cpp); None takes the model
    file's value or llama.cpp's default (models/rope.py resolves them against the file's keys).

    rope_scaling: none, linear or yarn. rope_scale N: the context stretched N times (freq_scale 1/N);
    rope_freq_scale: the same given as 1/N. yarn_orig_ctx: the context the model was trained at (default: the
    file's rope.scaling.original_context_length, else its context_length). yarn_ext_factor: how much of the
    extrapolated angles YaRN mixes in (default 1 with yarn, else 0); yarn_attn_factor: cos/sin magnitude (replaced
    by YaRN's own when ext_factor != 0, as in llama.cpp); yarn_beta_fast / yarn_beta_slow: turns over the original
    context where YaRN's ramp starts and ends (default 32 / 1)."""

    rope_scaling: str | None = None
    rope_scale: float | None = None
    rope_freq_base: float | None = None
    rope_freq_scale: float | None = None
    yarn_orig_ctx: int | None = None
    yarn_ext_factor: float | None = None
    yarn_attn_factor: float | None = None
    yarn_beta_fast: float | None = None
    yarn_beta_slow: float | None = None

    def __post_init__(self) -> None:
        def flag(name: str) -> str:
            return f"{name} (--{name.replace('_', '-')})"

        if self.rope_scaling is not None and self.rope_scaling not in ROPE_SCALING_TYPES:
            raise InvalidArgumentError(f"{flag('rope_scaling')} must be one of {', '.join(ROPE_SCALING_TYPES)}, "
                                       f"got {self.rope_scaling!r}")
        for name in ("rope_scale", "rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor",
                     "yarn_beta_fast", "yarn_beta_slow"):
            value = getattr(self, name)
            if value is None:
                continue
            zero_ok = name == "yarn_ext_factor"  # (0: no extrapolation mixed in)
            # (a number within a float's range, compared as the float llama.cpp would hold: 1e-50 is 0 there)
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and -3.4e38 < value < 3.4e38
            if not number or not (_f32(value) >= 0 if zero_ok else _f32(value) > 0):
                raise InvalidArgumentError(f"{flag(name)} must be a finite number {'>= 0' if zero_ok else '> 0'}, "
                                           f"got {value!r}")
        if self.yarn_orig_ctx is not None and (not isinstance(self.yarn_orig_ctx, int)
                                               or isinstance(self.yarn_orig_ctx, bool)
                                               or not 0 < self.yarn_orig_ctx < 2**31):
            raise InvalidArgumentError(f"{flag('yarn_orig_ctx')} must be an integer in 1..2^31-1, got "
                                       f"{self.yarn_orig_ctx!r}")
        if self.rope_scale is not None and self.rope_freq_scale is not None:
            raise InvalidArgumentError(f"{flag('rope_scale')} and {flag('rope_freq_scale')} both set the scale "
                                       "(N and 1/N): give one")

    @property
    def freq_scale(self) -> float | None:
        """The position scale as llama.cpp computes it from the flag (1.0f / N, or the value), None if not given."""
        if self.rope_scale is not None:
            return float(np.float32(1.0) / np.float32(self.rope_scale))
        return None if self.rope_freq_scale is None else _f32(self.rope_freq_scale)

    def llama_cpp_kwargs(self) -> dict[str, float | int]:
        """The same settings as llama-cpp-python's `Llama` arguments (bench --vs-llama-cpp)."""
        out: dict[str, float | int] = {f.name: getattr(self, f.name) for f in fields(self)
                                       if f.name.startswith("yarn_") and getattr(self, f.name) is not None}
        if self.rope_scaling is not None:
            out["rope_scaling_type"] = ROPE_SCALING_TYPES.index(self.rope_scaling)  # (llama.h's enum values)
        if self.rope_freq_base is not None:
            out["rope_freq_base"] = self.rope_freq_base
        if self.freq_scale is not None:
            out["rope_freq_scale"] = self.freq_scale
        return out
