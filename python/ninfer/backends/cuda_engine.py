"""The CUDA backend: a model's first `n_gpu_layers` layers (and the output head when everything fits) on an NVIDIA
GPU, the rest on the Rust CPU engine, with only activations crossing between them.

- Weights are uploaded tensor by tensor from the memory map (layouts.to_gpu pads the blocks for aligned loads; a
  Q6_K output head the streamed kernel reads goes in planar rows instead, _head_type).
- The KV cache is paged like the CPU's: f16 pools [page][kv_head][PAGE][head_dim] per layer, a page table per
  sequence in device memory.
- Decode (`step`) replays a CUDA graph of the whole token: fused norm+quantize, GEMVs reading quantized blocks,
  RoPE + KV write, TinyFlash attention, and either the argmax (greedy: only the token id comes back, through
  mapped pinned memory) or the logits written straight into mapped pinned host memory for the Rust sampler.
  The graph's first node embeds the token on the GPU (its id in mapped pinned memory) and copies the position in
  (where the table does not fit, the host embeds it and two copy nodes bring both in). Greedy steps are chained:
  the next step is queued to embed the token this one chooses before the host has read it (`step`).
- Prompts (`forward`, `prefill`) run a batch per layer: weights dequantized to f16 and multiplied by cuBLAS
  with f32 accumulation, activations quantized and dequantized exactly as the CPU quantizes them.
- With profiling on, a step runs the same launches one by one between CUDA events, per layer and per kind.

The engine's parts, by concern: cuda_memory.py (upload, buffers), cuda_paging.py (the KV page books),
cuda_decode.py (the captured decode step, profiling), cuda_prefill.py (prompts on cuBLAS).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ninfer import _core
from ninfer.config import CACHE_TYPES
from ninfer.backends import budget as budget_mod
from ninfer.backends import cuda_attention as att_ops
from ninfer.backends.cuda_decode import DecodeGraphs
from ninfer.backends.cuda_kv_quant import BYTES_PER_VALUE, QUANT_KINDS, QuantKv, check_cache_types
from ninfer.backends.cuda_kv_tiers import TieredKv, plan_tiers
from ninfer.config import TIERED_BLOCK_SIZE
from ninfer.backends.cuda_memory import WeightsAndBuffers, env_count
from ninfer.backends.cuda_paging import KvPages
from ninfer.backends.cuda_prefill import PromptLayers
from ninfer.errors import ContextOverflowError, InvalidArgumentError

__all__ = ["CudaEngine", "env_count"]


@dataclass
class _Pending:
    """A decode step already on the GPU: for `seq` at position `start`, embedding the token the step before it
    chose (expected by the caller as `token`), slot pair `parity`, done when `event` is."""

    seq: int
    token: int
    start: int
    parity: int
    event: Any



class CudaEngine(WeightsAndBuffers, KvPages, DecodeGraphs, PromptLayers, QuantKv, TieredKv):
    """The CUDA backend's engine: the engine protocol (forward, prefill, step, decode; truncate, remove, kv_usage
    in cuda_paging.py) over the mixins of the modules above."""

    def __init__(self, model_file: Any, *, n_ctx: int, threads: int, n_batch: int = 512, n_gpu_layers: int = -1,
                 gpu_mem_budget: int | None = None, page_size: int = 256, n_seq_max: int = 1,
                 cache_type_k: str = "f16", cache_type_v: str = "f16", log: Callable[[str], None] | None = None,
                 kv_tiers: dict[str, int] | None = None, host_mem_budget: int | None = None):
        """kv_tiers: the tiered KV cache's kv_l1, kv_l2, kv_select (cuda_kv_tiers.py); with a gpu_mem_budget and
        kv_l2 0, L2 takes what the budget leaves. host_mem_budget: the most host memory L3 may take."""
        import cupy as cp

        self.cp = cp
        self.mf, self.spec = model_file, model_file.spec
        s = self.spec
        if s["head_dim"] != s["head_dim_v"] or s["head_dim"] not in (64, 128, 256):
            raise InvalidArgumentError(f"the CUDA attention kernel needs head_dim == head_dim_v in (64, 128, 256); "
                                       f"this model has {s['head_dim']} / {s['head_dim_v']}")
        if s["n_head"] % s["n_head_kv"] or s["n_head"] // s["n_head_kv"] > att_ops.MAX_GROUP:
            raise InvalidArgumentError(f"the CUDA attention kernel serves up to {att_ops.MAX_GROUP} query heads per KV "
                                       f"head; this model has {s['n_head']} / {s['n_head_kv']}")
        self.quant_kv = ((QUANT_KINDS[cache_type_k], QUANT_KINDS[cache_type_v])
                         if check_cache_types(cache_type_k, cache_type_v, s["head_dim"]) else None)
        self.cache_types = (cache_type_k, cache_type_v)
        self.kv_tiers = None
        if kv_tiers:
            if self.quant_kv:
                raise InvalidArgumentError("the tiered KV cache sets its own precisions: leave the cache types at f16")
            if any(ls.get("sliding_window") for ls in s["layers"]):
                raise InvalidArgumentError("the tiered KV cache on the GPU does not serve sliding-window layers")
            page_size = TIERED_BLOCK_SIZE
        self.n_ctx, self.n_batch, self.page_size, self.n_seq_max = n_ctx, n_batch, page_size, n_seq_max
        self.tensors = {t.name: t for t in model_file.tensors}
        if kv_tiers:
            bare = budget_mod.plan(self.tensors, s, n_ctx, n_batch, page_size, len(s["layers"]), None, n_seq_max,
                                   kv_total=0)
            room = None if gpu_mem_budget is None else gpu_mem_budget - bare.total
            self.kv_tiers = plan_tiers(s, n_ctx, n_batch, n_seq_max, kv_tiers["kv_l1"],
                                       kv_tiers.get("kv_l2") or (None if gpu_mem_budget is not None else 0),
                                       kv_tiers.get("kv_select", 0), room, host_mem_budget,
                                       kv_tiers.get("kv_scorer", "keys"), kv_tiers.get("kv_rescan", 1))
            self.plan = budget_mod.plan(self.tensors, s, n_ctx, n_batch, page_size, len(s["layers"]), gpu_mem_budget,
                                        n_seq_max, kv_total=self.kv_tiers.device_bytes)
        else:
            self.plan = budget_mod.plan(self.tensors, s, n_ctx, n_batch, page_size, n_gpu_layers, gpu_mem_budget,
                                        n_seq_max, kv_bytes=(BYTES_PER_VALUE[cache_type_k],
                                                             BYTES_PER_VALUE[cache_type_v]))
        if self.kv_tiers is not None and not self.plan.head_on_gpu:
            raise InvalidArgumentError("the tiered KV cache on the GPU needs every layer and the output head on it; "
                                       "they do not fit the GPU memory budget")
        if log:
            log(self.plan.table(n_ctx * n_seq_max, threads))
            if self.kv_tiers is not None:
                log(self.kv_tiers.table(len(s["layers"])))
        self.n_gpu = self.plan.n_gpu_layers
        self.L = len(s["layers"])
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._map = model_file.map
        self.threads = threads
        with self.stream:
            self._upload()
            self._alloc()
        self.stream.synchronize()
        # The CPU engine runs the layers past n_gpu and, unless it is on the GPU, the output head.
        self.tail = None
        if not self.plan.head_on_gpu:
            tail_spec = dict(s, layers=s["layers"][self.n_gpu:])
            self.tail = _core.Engine(model_file.gguf, tail_spec, threads=threads, n_ctx=n_ctx, n_seq_max=n_seq_max,
                                     block_size=page_size, k_type=CACHE_TYPES[cache_type_k][0],
                                     v_type=CACHE_TYPES[cache_type_v][0])
            try:  # the CPU layers are read every token: keep them out of the page cache's eviction
                self.tail.lock_weights()
            except OSError as e:
                if log:
                    log(f"warning: could not pin the CPU layers in RAM ({e}); they may be re-read from disk")
        self._init_page_books()  # (cuda_paging.py)
        self.graphs: dict[tuple[int, bool, int], Any] = {}
        self._parity = 0  # the slot pair of the next decode step
        # A greedy step queued behind the one whose token step() last returned (chained: it embeds that token on
        # the GPU), or None. NINFER_CUDA_CHAIN=0 turns chaining off (A/B runs).
        self._pending: _Pending | None = None
        self.chain = self.embd_gpu is not None and self.tail is None and os.environ.get("NINFER_CUDA_CHAIN") != "0"
        self.profiling = False
        self.prof: dict[str, float] = defaultdict(float)
        self.prof_layers = np.zeros(self.n_gpu + 1)
        self.forward_calls = 0
        # Greedy steps take the argmax on the GPU; NINFER_CUDA_SAMPLING=host sends the logits to the CPU sampler
        # instead (through mapped pinned memory), to measure one against the other.
        self.host_sampling = os.environ.get("NINFER_CUDA_SAMPLING") == "host"

    def close(self) -> None:
        self._drain()
        for p in ("in_x", "in_pos", "tok", "out_logits", "out_x"):
            if getattr(self, p, None) is not None:
                getattr(self, p).free()
                setattr(self, p, None)
        if getattr(self, "kv_tiers", None) is not None:
            self._free_tiers()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- the engine protocol -----------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return int(self.spec["n_vocab"])

    def _embed_host(self, tokens: list[int]) -> np.ndarray:
        s = self.spec
        e = s["n_embd"]
        out = np.empty((len(tokens), e), np.float32)
        for i, t in enumerate(tokens):
            if not 0 <= t < s["n_vocab"]:
                raise InvalidArgumentError(f"token id {t} is out of range for a vocabulary of {s['n_vocab']}")
            ty, a, n = self._embd_row(t)
            out[i] = _core.dequantize(ty, bytes(self._map[a : a + n]), e)
        if s["embd_scale"] != 1.0:
            out *= np.float32(s["embd_scale"])
        return out

    def _embd_row(self, t: int) -> tuple[int, int, int]:
        """(type id, offset in the file, bytes) of token t's embedding row; a split embedding (model/embedding.rs)
        holds the hot ids, their rows, then the other rows in token order."""
        base = self.tensors[self.spec["token_embd"]].offset
        split = self.spec.get("embd_split")
        if not split:
            return self.embd_type, base + t * self.embd_row_bytes, self.embd_row_bytes
        hot_type, n_hot, cold_type = split
        e = int(self.spec["n_embd"])
        hot_rb, cold_rb = (e // GGML_QUANT_SIZES[ty][0] * GGML_QUANT_SIZES[ty][1]
                           for ty in map(GGMLQuantizationType, (hot_type, cold_type)))
        ids = np.frombuffer(self._map, dtype="<u4", count=n_hot, offset=base)
        i = int(np.searchsorted(ids, t))
        if i < n_hot and int(ids[i]) == t:
            return hot_type, base + 4 * n_hot + i * hot_rb, hot_rb
        return cold_type, base + 4 * n_hot + n_hot * hot_rb + (t - i) * cold_rb, cold_rb

    def forward(self, batch: list[tuple[int, list[int]]], logit_rows: list[int]) -> np.ndarray:
        self._drain()
        n = sum(len(t) for _, t in batch)
        if n == 0:
            raise InvalidArgumentError("forward called with no tokens")
        bad = [r for r in logit_rows if not 0 <= r < n]
        if bad:
            raise InvalidArgumentError(f"logits requested for row {bad[0]} of a {n}-token batch")
        out = np.zeros((len(logit_rows), self.n_vocab), np.float32)
        base = 0
        for seq, tokens in batch:
            want = [(i, r - base) for i, r in enumerate(logit_rows) if base <= r < base + len(tokens)]
            for c0 in range(0, len(tokens), self.n_batch):
                chunk = list(tokens[c0 : c0 + self.n_batch])
                sub = [(i, r - c0) for i, r in want if c0 <= r < c0 + len(chunk)]
                logits = self._forward_seq(seq, chunk, [r for _, r in sub])
                for k, (i, _) in enumerate(sub):
                    out[i] = logits[k]
            base += len(tokens)
        self.forward_calls += 1
        return out

    def prefill(self, seq: int, tokens: list[int], n_batch: int) -> np.ndarray:
        self._drain()
        if not tokens or n_batch <= 0:
            raise InvalidArgumentError("prefill needs at least one token and n_batch >= 1")
        start = self.seq_len(seq)
        if start + len(tokens) > self.n_ctx:
            raise ContextOverflowError(f"the prompt needs {start + len(tokens)} positions, the context holds "
                                       f"{self.n_ctx}")
        step = min(n_batch, self.n_batch)
        try:
            for c0 in range(0, len(tokens), step):
                chunk = list(tokens[c0 : c0 + step])
                final = c0 + step >= len(tokens)
                logits = self._forward_seq(seq, chunk, [len(chunk) - 1] if final else [])
        except Exception:
            self.truncate(seq, start)
            raise
        return logits[0]

    def _launch_step(self, seq: int, start: int, greedy: bool, token: int | None) -> int:
        """Queue one decode step of `seq` at position `start` (a graph replay, or the profiled launches) and return
        its slot parity. token: the input token, or None to embed the one the previous step chose (it is in this
        step's token slot already)."""
        p = self._parity
        if token is not None:
            if not 0 <= token < self.spec["n_vocab"]:
                raise InvalidArgumentError(f"token id {token} is out of range for a vocabulary of "
                                           f"{self.spec['n_vocab']}")
            if self.embd_gpu is not None:
                self.tok.array[p] = token
            else:
                self.in_x.array[:] = self._embed_host([token])[0]
        self.in_pos.array[p] = start
        if self.profiling:
            self._run_profiled(self._ops(seq, greedy, p))
        else:
            key = (seq, greedy, p)
            if key not in self.graphs:
                self.graphs[key] = self._capture(seq, greedy, p)
            self.graphs[key].launch(self.stream)
        self._parity ^= 1
        return p

    def _drain(self) -> None:
        """Wait for a queued step nobody will take and give back its position (and a page it may have opened)."""
        pend = getattr(self, "_pending", None)
        if pend is None:
            return
        self._pending = None
        pend.event.synchronize()
        self._release_pages(pend.seq)

    def step(self, seq: int, token: int, sampler: Any) -> int:
        """One decode step: `token` in at the next position of `seq`, the next token out. Greedy steps with the
        head and the embeddings on the GPU are chained: before waiting for this step's token the next step is queued
        to embed it on the GPU, so the host's work between tokens (reading the token, the caller's loop, launching)
        overlaps the GPU's; if the next call brings that token, its step is already done or running."""
        greedy = bool(sampler.is_greedy) and not self.host_sampling and self.plan.head_on_gpu
        chain = greedy and self.chain and not self.profiling
        pend = self._pending
        if pend is not None and not (chain and pend.seq == seq and pend.token == token):
            self._drain()
            pend = None
        if pend is not None:  # the step for this token is on the GPU already
            self._pending = None
            start, p, done = pend.start, pend.parity, pend.event
        else:
            start = self._reserve(seq, 1)
            try:
                p = self._launch_step(seq, start, greedy, token)
            except Exception:
                self._release_pages(seq)
                raise
            done = self.stream.record()
        self.seq_len_[seq] = start + 1
        self.forward_calls += 1
        if chain:
            try:
                nxt = self._reserve(seq, 1)
            except ContextOverflowError:  # no room for another token: nothing to queue
                nxt = None
            if nxt is not None:
                try:
                    q = self._launch_step(seq, nxt, greedy, None)
                except Exception:
                    self.truncate(seq, start)  # this step's position and the pages reserved past it
                    raise
                self._pending = _Pending(seq, -1, nxt, q, self.stream.record())
        try:
            done.synchronize()
            if self.tail is not None:
                t0 = time.perf_counter()
                token = int(self.tail.step_hidden(seq, self.out_x.array.reshape(1, -1), sampler))
                if self.profiling:
                    self.prof["cpu_layers"] += time.perf_counter() - t0
                return token
            if greedy:
                token = int(self.tok.array[1 - p])
                if self._pending is not None:
                    self._pending.token = token
                return token
            return int(sampler.sample(self.out_logits.array))
        except Exception:
            self.truncate(seq, start)  # (waits for the queued step first)
            raise

    def decode(self, batch: list[tuple[int, int]], sampler: Any) -> list[Any]:
        """One token for each of several distinct sequences (the server's slots), each drawn by
        `sampler.sample(seq, logits)` (the Rust sampler thread). The GPU runs the sequences one after another, a
        graph replay each, with the logits going to the host through mapped pinned memory."""
        self._drain()
        if not batch or len({s for s, _ in batch}) != len(batch):
            raise InvalidArgumentError("decode needs one token for each of one or more distinct sequences")
        out = []
        for seq, token in batch:
            start = self._reserve(seq, 1)
            try:
                self._launch_step(seq, start, False, token)
                self.stream.synchronize()
            except Exception:
                self._release_pages(seq)
                raise
            self.seq_len_[seq] = start + 1
            self.forward_calls += 1
            try:
                if self.tail is not None:
                    logits = self.tail.forward_hidden(seq, self.out_x.array.reshape(1, -1).copy(), [0])[0]
                else:
                    logits = self.out_logits.array.copy()
                out.append(sampler.sample(seq, logits))
            except Exception:
                self.truncate(seq, start)
                raise
        return out
