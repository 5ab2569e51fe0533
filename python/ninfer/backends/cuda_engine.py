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
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ninfer import _core
from ninfer.backends import budget as budget_mod
from ninfer.backends import cuda_ops as ops
from ninfer.backends import launch
from ninfer.backends.layouts import (
    ACT_GSQ8,
    ACT_GSQ8_PAIRS,
    QUANTIZED_ACTS,
    T_Q6_K,
    T_Q6_K_PLANAR,
    gpu_row_bytes,
    gpu_type,
    gsq_pairs_type,
    layout,
    to_gpu,
)
from ninfer.errors import ContextOverflowError, InvalidArgumentError

_CUBLAS_OP_N, _CUBLAS_OP_T, _R_16F, _R_32F, _COMPUTE_32F, _GEMM_DEFAULT = 0, 1, 2, 0, 68, -1
_H2D, _D2H = 1, 2


class _Pinned:
    """Mapped pinned host memory: a numpy view for the host, a device pointer the GPU reads and writes directly."""

    def __init__(self, dtype: Any, n: int):
        import cupy as cp

        self.nbytes = np.dtype(dtype).itemsize * n
        self.host_ptr = cp.cuda.runtime.hostAlloc(self.nbytes, 2)  # cudaHostAllocMapped
        # With unified virtual addressing (every 64-bit CUDA platform) a mapped allocation has the same address
        # on the device as on the host.
        self.dev_ptr = self.host_ptr
        buf = (ctypes.c_byte * self.nbytes).from_address(self.host_ptr)
        self.array = np.frombuffer(buf, dtype=dtype, count=n)

    def free(self) -> None:
        import cupy as cp

        if self.host_ptr:
            self.array = None
            cp.cuda.runtime.freeHost(self.host_ptr)
            self.host_ptr = 0


@dataclass
class _Pending:
    """A decode step already on the GPU: for `seq` at position `start`, embedding the token the step before it
    chose (expected by the caller as `token`), slot pair `parity`, done when `event` is."""

    seq: int
    token: int
    start: int
    parity: int
    event: Any


class _Matrix:
    def __init__(self, entry: Any, raw: np.ndarray, type_id: int | None = None):
        """entry's matrix uploaded in its GPU type's layout (type_id: another GPU type of the same weights,
        T_Q6_K_PLANAR for a streamed head)."""
        self.name, self.type = entry.name, gpu_type(entry) if type_id is None else type_id
        self.cols, self.rows = entry.dims[0], (entry.dims[1] if len(entry.dims) > 1 else 1)
        self.data = to_gpu(raw, self.type, self.rows, self.cols, self.name)
        self.ptr = self.data.data.ptr
        self.row_bytes = gpu_row_bytes(self.type, self.cols)
        self.act = layout(self.type, self.name).act


def env_count(name: str) -> int:
    """A measuring switch from the environment: a count >= 0, 0 where unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidArgumentError(f"{name} must be a whole number >= 0, got '{raw}'")
    return value


class CudaEngine:
    def __init__(self, model_file: Any, *, n_ctx: int, threads: int, n_batch: int = 512, n_gpu_layers: int = -1,
                 gpu_mem_budget: int | None = None, page_size: int = 256, n_seq_max: int = 1,
                 log: Callable[[str], None] | None = None):
        import cupy as cp

        self.cp = cp
        self.mf, self.spec = model_file, model_file.spec
        s = self.spec
        if s["head_dim"] != s["head_dim_v"] or s["head_dim"] not in (64, 128, 256):
            raise InvalidArgumentError(f"the CUDA attention kernel needs head_dim == head_dim_v in (64, 128, 256); "
                                       f"this model has {s['head_dim']} / {s['head_dim_v']}")
        if s["n_head"] % s["n_head_kv"] or s["n_head"] // s["n_head_kv"] > ops.MAX_GROUP:
            raise InvalidArgumentError(f"the CUDA attention kernel serves up to {ops.MAX_GROUP} query heads per KV "
                                       f"head; this model has {s['n_head']} / {s['n_head_kv']}")
        self.n_ctx, self.n_batch, self.page_size, self.n_seq_max = n_ctx, n_batch, page_size, n_seq_max
        self.tensors = {t.name: t for t in model_file.tensors}
        self.plan = budget_mod.plan(self.tensors, s, n_ctx, n_batch, page_size, n_gpu_layers, gpu_mem_budget,
                                    n_seq_max)
        if log:
            log(self.plan.table(n_ctx * n_seq_max, threads))
        self.n_gpu = self.plan.n_gpu_layers
        self.L = len(s["layers"])
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._map = model_file.map
        with self.stream:
            self._upload()
            self._alloc()
        self.stream.synchronize()
        # The CPU engine runs the layers past n_gpu and, unless it is on the GPU, the output head.
        self.tail = None
        if not self.plan.head_on_gpu:
            tail_spec = dict(s, layers=s["layers"][self.n_gpu:])
            self.tail = _core.Engine(model_file.gguf, tail_spec, threads=threads, n_ctx=n_ctx, n_seq_max=n_seq_max,
                                     block_size=page_size)
            try:  # the CPU layers are read every token: keep them out of the page cache's eviction
                self.tail.lock_weights()
            except OSError as e:
                if log:
                    log(f"warning: could not pin the CPU layers in RAM ({e}); they may be re-read from disk")
        self.seq_len_: dict[int, int] = {}
        self.pages: dict[int, list[int]] = {}
        self.free_pages = list(range(self.n_pages - 1, -1, -1))
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

    # ---- loading ---------------------------------------------------------------------------------------------
    def _raw(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return self._map[t.offset : t.offset + t.n_bytes]

    def _vec(self, name: str | None):
        if not name:
            return None
        t = self.tensors[name]
        v = _core.dequantize(t.type_id, bytes(self._raw(name)), t.n_elements)
        return self.cp.asarray(v.astype(np.float32))

    def _upload(self) -> None:
        s = self.spec
        self.layers = []
        for ls in s["layers"][: self.n_gpu]:
            lw = {k: _Matrix(self.tensors[ls[k]], self._raw(ls[k])) for k in
                  ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
            for k in ("attn_norm", "ffn_norm", "bq", "bk", "bv", "q_norm", "k_norm", "post_attn_norm",
                      "post_ffn_norm"):
                lw[k] = self._vec(ls.get(k))
            lw["ptr"] = {k: (lw[k].data.ptr if lw[k] is not None else 0) for k in
                         ("attn_norm", "ffn_norm", "bq", "bk", "bv", "q_norm", "k_norm", "post_attn_norm",
                          "post_ffn_norm")}
            self.layers.append(lw)
        self.output = self.output_norm = None
        if self.plan.head_on_gpu:
            self.output = _Matrix(self.tensors[s["output"]], self._raw(s["output"]), self._head_type())
            self.output_norm = self._vec(s["output_norm"])
        te = self.tensors[s["token_embd"]]
        self.embd_type, self.embd_row_bytes = te.type_id, te.n_bytes // te.dims[1]
        self.embd_gpu = None  # the table the decode step embeds its token from (budget.py embd_on_gpu)
        if self.plan.embd_on_gpu:
            tied = s["token_embd"] == s["output"]
            self.embd_gpu = self.output if tied else _Matrix(te, self._raw(s["token_embd"]))
        # RoPE's per-pair factor, computed as the CPU computes it (f32 powf on the host).
        self.theta_scale = [float(np.float32(ls["rope_base"]) ** (np.float32(-2.0) / np.float32(s["rope_dims"])))
                            for ls in s["layers"]]

    def _head_type(self) -> int:
        """The output head's GPU type: T_Q6_K_PLANAR, the rows gemv_q6k_stream reads, for a Q6_K head it can stream
        (cuda_ops.q6k_stream) and that is not tied to the embeddings (which the embedding kernel reads in padded
        blocks), else the tensor's own."""
        s = self.spec
        t = self.tensors[s["output"]]
        ty = gpu_type(t)
        if s["token_embd"] != s["output"] and ty == T_Q6_K and ops.q6k_stream(ty, t.dims[1], t.dims[0], ops.MODE_ARGMAX):
            return T_Q6_K_PLANAR
        return ty

    def _alloc(self) -> None:
        cp, s = self.cp, self.spec
        e, T = s["n_embd"], self.n_batch
        self.n_ff = self.tensors[s["layers"][0]["w_gate"]].dims[1]
        self.qkv_dim = (s["n_head"] + 2 * s["n_head_kv"]) * s["head_dim"]
        self.att_dim = s["n_head"] * s["head_dim_v"]
        width = max(e, self.n_ff, self.att_dim)
        f32 = cp.float32
        self.x = cp.zeros((T, e), f32)
        self.o = cp.zeros((T, e), f32)
        self.qkv = cp.zeros((T, self.qkv_dim), f32)
        self.q_rot = cp.zeros((T, s["n_head"] * s["head_dim"]), f32)
        self.att = cp.zeros((T, self.att_dim), f32)
        self.gate_up = cp.zeros((T, 2 * self.n_ff), f32)
        self.act = cp.zeros((T, self.n_ff), f32)
        self.act_codes = cp.zeros(T * width + width // 8, cp.int8)  # (+: one vector's padded ACT_GSQ8_PAIRS codes)
        self.act_scales = cp.zeros(T * width // 32, f32)
        self.act_sums = cp.zeros(2 * T * width // 32, f32)
        self.ah = cp.zeros(T * width, cp.uint16)
        biggest = max(m.rows * m.cols for lw in self.layers for m in lw.values() if isinstance(m, _Matrix)) \
            if self.layers else 0
        self.w16 = cp.zeros(max(biggest, 1 << 20), cp.uint16)
        self.pos = cp.zeros(T, cp.int32)
        self.row_seq = cp.zeros(T, cp.int32)  # every row reads the one page table it is given
        self.logits_dev = cp.zeros((4, s["n_vocab"]), f32)
        self.best = cp.zeros(1, cp.uint64)
        self.n_pages = -(-self.n_ctx // self.page_size) * self.n_seq_max
        self.max_pages = -(-self.n_ctx // self.page_size)
        self.tables = cp.zeros((self.n_seq_max, self.max_pages), cp.int32)
        kv_shape = (self.n_pages, s["n_head_kv"], self.page_size, s["head_dim"])
        self.k_pools = [cp.zeros(kv_shape, cp.uint16) for _ in range(self.n_gpu)]
        self.v_pools = [cp.zeros(kv_shape, cp.uint16) for _ in range(self.n_gpu)]
        group = s["n_head"] // s["n_head_kv"]
        self.sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.pdl = launch.supported()  # decode kernels overlap their predecessors (backends/launch.py)
        # Key splits of decode attention: as many blocks as the GPU holds at once, over the KV heads
        # (NINFER_CUDA_ATT_SPLIT overrides, for measuring other choices).
        n_split = (env_count("NINFER_CUDA_ATT_SPLIT")
                   or ops.attention_resident(s["head_dim"], group) // s["n_head_kv"])
        self.n_split = max(1, min(-(-self.n_ctx // 256), n_split, ops.attention_max_split(s["head_dim"], group)))
        self.part_ml = cp.zeros(2 * s["n_head"] * self.n_split, f32)
        self.part_acc = cp.zeros(s["n_head"] * self.n_split * s["head_dim_v"], f32)
        self.tickets = cp.zeros(T * s["n_head_kv"], cp.int32)  # attention's split merges (each resets its own)
        # Step inputs and outputs in mapped pinned memory. Decode steps alternate between two slots of position
        # and token (parity p: position in_pos[p], token read from tok[p], greedy result written to tok[1 - p]), so
        # a step can be queued while the previous one runs (step()).
        self.in_x = _Pinned(np.float32, e)
        self.in_pos = _Pinned(np.int32, 2)
        self.tok = _Pinned(np.int32, 2)
        self.out_logits = _Pinned(np.float32, s["n_vocab"])
        self.out_x = _Pinned(np.float32, e)
        self._keep: list[Any] = []
        self._op_lists: dict[tuple[int, bool, int], list[Any]] = {}

    def close(self) -> None:
        self._drain()
        for p in ("in_x", "in_pos", "tok", "out_logits", "out_x"):
            if getattr(self, p, None) is not None:
                getattr(self, p).free()
                setattr(self, p, None)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- the engine protocol -----------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return int(self.spec["n_vocab"])

    def seq_len(self, seq: int) -> int:
        return self.seq_len_.get(seq, 0)

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq_max:
            raise InvalidArgumentError(f"sequence id {seq} is out of range (n_seq_max = {self.n_seq_max})")

    def truncate(self, seq: int, n: int) -> None:
        self._drain()
        if n >= self.seq_len(seq):
            return
        self.seq_len_[seq] = n
        self._release_pages(seq)
        if self.tail is not None:
            self.tail.truncate(seq, n)

    def remove(self, seq: int) -> None:
        self.truncate(seq, 0)
        self.seq_len_.pop(seq, None)
        if self.tail is not None:
            self.tail.remove(seq)

    def kv_usage(self) -> tuple[int, int]:
        self._drain()
        used = sum(len(p) for p in self.pages.values())
        return used, sum(p.nbytes for p in self.k_pools + self.v_pools)

    def _reserve(self, seq: int, n_new: int) -> int:
        """Pages for n_new more positions; returns the start position. Raises before changing anything."""
        self._check_seq(seq)
        start = self.seq_len(seq)
        end = start + n_new
        if end > self.n_ctx:
            raise ContextOverflowError(f"sequence {seq} would hold {end} tokens, but the context holds {self.n_ctx}")
        pages = self.pages.setdefault(seq, [])
        need = -(-end // self.page_size) - len(pages)
        if need > len(self.free_pages):
            raise ContextOverflowError(f"the KV cache has no free pages for {n_new} more tokens of sequence {seq}")
        for _ in range(need):
            page = self.free_pages.pop()
            with self.stream:  # ordered before the launches that read the table
                self.tables[seq, len(pages)] = page
            pages.append(page)
        return start

    def _embed_host(self, tokens: list[int]) -> np.ndarray:
        s = self.spec
        e = s["n_embd"]
        out = np.empty((len(tokens), e), np.float32)
        for i, t in enumerate(tokens):
            if not 0 <= t < s["n_vocab"]:
                raise InvalidArgumentError(f"token id {t} is out of range for a vocabulary of {s['n_vocab']}")
            a = self.tensors[s["token_embd"]].offset + t * self.embd_row_bytes
            out[i] = _core.dequantize(self.embd_type, bytes(self._map[a : a + self.embd_row_bytes]), e)
        if s["embd_scale"] != 1.0:
            out *= np.float32(s["embd_scale"])
        return out

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

    def _release_pages(self, seq: int) -> None:
        """Give back the pages past seq's length (after a truncation, or reserved for a step that did not
        happen)."""
        pages = self.pages.get(seq, [])
        keep = -(-self.seq_len(seq) // self.page_size)
        self.free_pages.extend(reversed(pages[keep:]))
        self.pages[seq] = pages[:keep]

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

    # ---- profiling ---------------------------------------------------------------------------------------
    def set_profiling(self, on: bool) -> None:
        self.profiling = bool(on)

    def reset_profile(self) -> None:
        self.prof = defaultdict(float)
        self.prof_layers = np.zeros(self.n_gpu + 1)
        self.forward_calls = 0
        if self.tail is not None:
            self.tail.reset_profile()

    def profile(self) -> dict[str, float]:
        out = dict(self.prof)
        out["forward_calls"] = self.forward_calls
        return out

    def layer_profile(self) -> list[float]:
        """Seconds per GPU layer (the last entry: the output head and glue), summed over profiled steps."""
        return list(self.prof_layers)

    def _run_profiled(self, launches: list[tuple[str, int, Callable[[], None]]]) -> None:
        cp = self.cp
        with self.stream:
            # Hold the stream for ~50 ms so every launch below is queued before the first runs: the events then
            # time the kernels, not Python's launch gaps.
            ops.function("spin")((1,), (1,), (np.int64(100_000_000),))
            events = [cp.cuda.Event()]
            events[0].record()
            for _, _, fn in launches:
                fn()
                ev = cp.cuda.Event()
                ev.record()
                events.append(ev)
        events[-1].synchronize()
        self.last_op_times = []
        for (kind, layer, _), a, b in zip(ops, events, events[1:]):
            dt = cp.cuda.get_elapsed_time(a, b) / 1e3
            self.prof[kind] += dt
            self.prof_layers[layer if layer >= 0 else self.n_gpu] += dt
            self.last_op_times.append((layer, kind, dt))

    # ---- decode: the captured token step -----------------------------------------------------------------
    def _capture(self, seq: int, greedy: bool, parity: int):
        launches = self._ops(seq, greedy, parity)
        with self.stream:
            for _, _, fn in launches:  # run once uncaptured: compiles and loads every kernel first
                fn()
        self.stream.synchronize()
        with self.stream, launch.dependent_launches(self.pdl):
            self.stream.begin_capture()
            try:
                for _, _, fn in launches:
                    fn()
            finally:
                graph = self.stream.end_capture()
        return graph

    def _matmul_vec(self, mats: list[_Matrix], outs: list[int], x: int, norm: int, mode: int,
                    glu_act: int = 0, best: int = 0, keep: list[Any] | None = None,
                    prequantize: bool = False, prefetch: list[tuple[int, int]] | None = None,
                    prefetch_cap: int = 0, quantized: bool = False, max_grid: int = 0) -> list[Callable[[], None]]:
        """Launches for one activation vector x (f32, device; normed by `norm` unless 0) times matrices that read
        it: one GEMV per activation kind, which quantizes x itself, or with `prequantize` (a long vector without a
        norm: the down projection's input) a quant_act launch first. Descriptor arrays are appended to `keep`
        (they must live as long as a graph that launches them). `prefetch`: (address, bytes) regions of a later
        launch's weights for a streamed GEMV to ask L2 for at its end (each block its share of each, its first
        prefetch_cap bytes if > 0; _prefetch_regions). `quantized`: x is already in act_codes / act_scales as ACT_GSQ8_PAIRS (the
        attention kernel wrote it; only for a launch _att_quantizes_o accepts). max_grid: at most that many blocks
        for a streamed launch (cuda_ops.gemv)."""
        keep = self._keep if keep is None else keep
        pf = None
        if prefetch:
            regions = ops.prefetch_regions(prefetch)
            keep.append(regions)
            pf = (regions.data.ptr, len(prefetch), prefetch_cap)
        fns: list[Callable[[], None]] = []
        n = mats[0].cols
        if mats[0].type == T_Q6_K_PLANAR:  # the streamed Q6_K head (_head_type), its only reader
            m = mats[0]
            desc = ops.mat_descs([(m.ptr, 0, outs[0], m.row_bytes, m.type, m.rows)])
            keep.append(desc)
            eps = self.spec["rms_eps"]
            return [lambda: ops.gemv_q6k_stream(desc, m.rows, n, x, norm, eps, mode, best)]
        kinds = sorted({m.act for m in mats})
        if mode == ops.MODE_GLU and len(kinds) > 1:
            raise AssertionError("GLU fusion needs gate and up of one activation kind")
        eps = self.spec["rms_eps"]
        for kind in kinds:
            group = [(m, o) for m, o in zip(mats, outs) if m.act == kind]
            descs = ops.mat_descs([(m.ptr, 0, o, m.row_bytes, m.type, m.rows) for m, o in group])
            keep.append(descs)
            total = group[0][0].rows if mode == ops.MODE_GLU else sum(m.rows for m, _ in group)
            pairs = ops.gsq_pairs(n, total) and all(gsq_pairs_type(m.type) for m, _ in group)
            staged = (self.act_codes.data.ptr, self.act_scales.data.ptr, self.act_sums.data.ptr)  # (codes, scales, sums)
            pre = None
            if quantized:
                pre = staged
            elif prequantize and not norm and kind in QUANTIZED_ACTS:
                pre = staged
                q_kind = ACT_GSQ8_PAIRS if pairs else kind
                fns.append(lambda q_kind=q_kind, pre=pre: ops.quant_act(x, n, q_kind, *pre))
            fns.append(lambda kind=kind, descs=descs, g=group, total=total, pre=pre, pairs=pairs: ops.gemv(
                kind, descs, len(g), total, n, x, norm, eps, mode, glu_act, best, pre, gsq_pairs=pairs, prefetch=pf,
                max_grid=max_grid))
        return fns

    @staticmethod
    def _prefetch_regions(lw: dict, cap: int) -> dict[str, dict[str, Any]]:
        """What each of a layer's streamed launches asks L2 for at its end, as _matmul_vec's `prefetch` (regions)
        and `prefetch_cap` (bytes a block of each: kernels/gemv_stream.cu has each block ask for the first that
        many bytes of its 1/grid share of each region): the output projection gate/up's weights, gate/up the down
        projection's. The shares' lines are read all through the next launch, so what comes in while the memory
        idles at the boundary is read from L2 later (H200, 32B GSQ3 tg128 +1.9%; docs/journal/gsq-rco-gpu.md)."""
        def ask(mats: list, n: int) -> dict[str, Any]:
            return {"prefetch": [(m.ptr, m.rows * m.row_bytes) for m in mats], "prefetch_cap": n}

        return {"qkv": {}, "o": ask([lw["w_gate"], lw["w_up"]], cap),
                "gate_up": ask([lw["w_down"]], cap), "down": {}}

    def _att_quantizes_o(self, lw: dict) -> bool:
        """Whether the attention kernel writes the output projection's input quantized (AttnParams.out_q), so the
        projection's launch copies it in instead of every block quantizing it: head size 128 (a head is one
        activation group) and an output projection that reads ACT_GSQ8_PAIRS (3-bit GSQ-RCO by lane pairs or
        streamed). H200, 32B GSQ3 tg128 173.3 / 173.7 against 172.5 / 172.1 t/s (2026-12-02)."""
        wo = lw["wo"]
        return (self.spec["head_dim"] == 128 and wo.act == ACT_GSQ8 and gsq_pairs_type(wo.type)
                and ops.gsq_pairs(wo.cols, wo.rows))

    def _room_grid(self) -> int:
        """Blocks for the streamed launches on either side of attention, q/k/v and the output projection
        (cuda_ops.gemv max_grid; 0: one an SM): the SMs less those attention's blocks take (at a short depth one
        block a KV head) and ops.STREAM_ATT_SLACK more. The output projection's blocks, one an SM, then all start
        together instead of some waiting for an attention block to leave its SM; and attention's blocks start on
        their free SMs under q/k/v and run their code once before its results land (kernels/attention.cu, the dry
        pass). The slack: q/k/v's blocks take the first SMs the previous down projection's blocks leave and
        attention's the next, so attention no longer waits for the down projection's slowest blocks (each measured
        faster on the H200, docs/journal/gsq-rco-gpu.md). Not where that would take more than a quarter of the SMs
        (the slack goes first)."""
        n_kv = self.spec["n_head_kv"]
        for slack in (ops.STREAM_ATT_SLACK, 0):
            if 4 * (n_kv + slack) <= self.sms:
                return self.sms - n_kv - slack
        return 0

    def _ops(self, seq: int, greedy: bool, parity: int) -> list[tuple[str, int, Callable[[], None]]]:
        key = (seq, greedy, parity)
        if key not in self._op_lists:
            self._op_lists[key] = self._decode_ops(seq, greedy, parity)
        return self._op_lists[key]

    def _decode_ops(self, seq: int, greedy: bool, parity: int = 0) -> list[tuple[str, int, Callable[[], None]]]:
        """The launches of one decode step: per layer the q/k/v GEMV, attention (RoPE and the KV write inside),
        the output projection + residual, gate/up + GLU, down + residual (five launches; gemma's post-norms add
        two). Each GEMV norms and quantizes its own input."""
        s = self.spec
        e = s["n_embd"]
        x, o, act, att, qkv = (self.x.data.ptr, self.o.data.ptr, self.act.data.ptr, self.att.data.ptr,
                               self.qkv.data.ptr)
        launches: list[tuple[str, int, Callable[[], None]]] = []

        def add(kind: str, layer: int, fns: list[Callable[[], None]]) -> None:
            launches.extend((kind, layer, f) for f in fns)

        tok_in, tok_out = self.tok.dev_ptr + 4 * parity, self.tok.dev_ptr + 4 * (1 - parity)
        pos_in = self.in_pos.dev_ptr + 4 * parity
        if self.embd_gpu is not None:  # the token's embedding row, dequantized on the GPU, and the position
            m = self.embd_gpu
            add("other", -1, [lambda: ops.embed(m.type, m.ptr, m.row_bytes, tok_in, 1, e, s["embd_scale"], x, pos_in,
                                              self.pos.data.ptr)])
        else:
            add("other", -1, [lambda: launch.copy(x, self.in_x.host_ptr, 4 * e, _H2D)])
            add("other", -1, [lambda: launch.copy(self.pos.data.ptr, pos_in, 4, _H2D)])
        table = self.tables.data.ptr + 4 * self.max_pages * seq
        glu_act = 0 if s["activation"] == "silu" else 1
        q_dim, k_dim = s["n_head"] * s["head_dim"], s["n_head_kv"] * s["head_dim"]
        group = s["n_head"] // s["n_head_kv"]
        # what the streamed launches ask L2 for on a later one's behalf (_prefetch_regions)
        pf_cap = ops.STREAM_PREFETCH_CAP
        room = self._room_grid()
        for il, lw in enumerate(self.layers):
            ls = s["layers"][il]
            post_a, post_f = lw["ptr"]["post_attn_norm"], lw["ptr"]["post_ffn_norm"]
            gate_up = [lw["w_gate"], lw["w_up"]]
            pf = self._prefetch_regions(lw, pf_cap)
            att_quant = self._att_quantizes_o(lw)
            add("matmul", il, self._matmul_vec([lw["wq"], lw["wk"], lw["wv"]], [qkv, qkv + 4 * q_dim,
                                               qkv + 4 * (q_dim + k_dim)], x, lw["ptr"]["attn_norm"],
                                               ops.MODE_STORE, max_grid=room, **pf["qkv"]))
            params = ops.attn_params(
                s, qkv=qkv, qkv_stride=self.qkv_dim, layer=lw["ptr"] | {"rope_freq_scale": ls["rope_freq_scale"]},
                theta_scale=self.theta_scale[il], k_pool=self.k_pools[il].data.ptr, v_pool=self.v_pools[il].data.ptr,
                page_tables=table, table_stride=self.max_pages, row_seq=self.row_seq.data.ptr, pos=self.pos.data.ptr,
                window=ls.get("sliding_window") or 0, page_size=self.page_size, part_ml=self.part_ml.data.ptr,
                part_acc=self.part_acc.data.ptr, tickets=self.tickets.data.ptr, out=att,
                **({"out_q": self.act_codes.data.ptr, "out_d": self.act_scales.data.ptr} if att_quant else {}))
            add("attention", il, [lambda params=params: ops.attention(params, 1, self.n_split, s["n_head_kv"],
                                                                    s["head_dim"], True, group)])
            # output projection + residual (or into o for gemma's post-attention norm)
            add("matmul", il, self._matmul_vec([lw["wo"]], [o if post_a else x], att, 0,
                                               ops.MODE_STORE if post_a else ops.MODE_ADD, quantized=att_quant,
                                               max_grid=room, **pf["o"]))
            if post_a:
                add("other", il, [lambda w=post_a: ops.rms_norm_rows(1, o, w, s["rms_eps"], e, x, True)])
            if lw["w_gate"].act == lw["w_up"].act:  # gate/up with the GLU fused
                add("matmul", il, self._matmul_vec(gate_up, [act, act], x, lw["ptr"]["ffn_norm"], ops.MODE_GLU,
                                                   glu_act, **pf["gate_up"]))
            else:
                gate_up_ptr = self.gate_up.data.ptr
                add("matmul", il, self._matmul_vec(gate_up, [gate_up_ptr, gate_up_ptr + 4 * self.n_ff], x, lw["ptr"]["ffn_norm"],
                                                   ops.MODE_STORE))
                add("other", il, [lambda gate_up_ptr=gate_up_ptr: ops.glu_rows(gate_up_ptr, self.n_ff, 1, glu_act, act)])
            add("matmul", il, self._matmul_vec([lw["w_down"]], [o if post_f else x], act, 0,
                                               ops.MODE_STORE if post_f else ops.MODE_ADD, prequantize=True, **pf["down"]))
            if post_f:
                add("other", il, [lambda w=post_f: ops.rms_norm_rows(1, o, w, s["rms_eps"], e, x, True)])
        if not self.plan.head_on_gpu:
            add("other", -1, [lambda: launch.copy(self.out_x.host_ptr, x, 4 * e, _D2H)])
            return launches
        norm = self.output_norm.data.ptr
        best = self.best.data.ptr
        if greedy:  # (best is zero: allocated so, and argmax_finish resets it)
            add("matmul", -1, self._matmul_vec([self.output], [self.logits_dev.data.ptr], x, norm, ops.MODE_ARGMAX,
                                               best=best))
            add("other", -1, [lambda: ops.argmax_finish(best, tok_out)])
        else:
            add("matmul", -1, self._matmul_vec([self.output], [self.out_logits.dev_ptr], x, norm, ops.MODE_STORE))
        return launches

    # ---- prompts: batched layers on cuBLAS -------------------------------------------------------------
    def _gemm(self, m: _Matrix, x16: int, T: int, out: int, ldc: int, beta: float) -> None:
        """out[T, m.rows] (row stride ldc, f32) = x16[T, cols] @ W^T (+ beta * out), W dequantized to f16 in
        slices of rows that fit the scratch buffer."""
        from cupy.cuda import cublas

        handle = self.cp.cuda.device.get_cublas_handle()
        alpha = np.array([1.0], np.float32)
        b = np.array([beta], np.float32)
        rows_per = max(1, min(m.rows, self.w16.size // m.cols))
        for r0 in range(0, m.rows, rows_per):
            n = min(rows_per, m.rows - r0)
            ops.dequant_f16(m.type, m.ptr + r0 * m.row_bytes, m.row_bytes, n, m.cols, self.w16.data.ptr)
            cublas.gemmEx(handle, _CUBLAS_OP_T, _CUBLAS_OP_N, n, T, m.cols, alpha.ctypes.data, self.w16.data.ptr,
                          _R_16F, m.cols, x16, _R_16F, m.cols, b.ctypes.data, out + 4 * r0, _R_32F, ldc,
                          _COMPUTE_32F, _GEMM_DEFAULT)

    def _act16(self, T: int, x: int, norm: int, n: int, kind: int) -> int:
        """The activation rows as the CPU would quantize them, dequantized to f16 for the GEMM."""
        ops.norm_quant(T, x, norm, self.spec["rms_eps"], n, kind, out_h=self.ah.data.ptr)
        return self.ah.data.ptr

    def _matmul_rows(self, T: int, mats: list[_Matrix], outs: list[int], ldc: int, x: int, norm: int,
                     beta: float) -> None:
        done: dict[int, int] = {}
        for m, o in zip(mats, outs):
            if m.act not in done:
                done.clear()  # one f16 activation buffer: re-quantize when the kind changes
                done[m.act] = self._act16(T, x, norm, m.cols, m.act)
            self._gemm(m, done[m.act], T, o, ldc, beta)

    def _forward_seq(self, seq: int, tokens: list[int], rows: list[int]) -> np.ndarray:
        T = len(tokens)
        xs = self._embed_host(tokens)
        start = self._reserve(seq, T)
        try:
            with self.stream:
                self.x[:T].set(xs)
                self.pos[:T].set(np.arange(start, start + T, dtype=np.int32))
                for il in range(self.n_gpu):
                    self._layer_rows(il, T, seq)
                if self.tail is not None:
                    hidden = self.x[:T].get()
            if self.tail is not None:
                self.stream.synchronize()
                logits = self.tail.forward_hidden(seq, hidden, list(rows))
            else:
                with self.stream:
                    logits = self._head_rows(T, rows)
        except Exception:
            self.truncate(seq, start)
            raise
        self.seq_len_[seq] = start + T
        return logits

    def _layer_rows(self, il: int, T: int, seq: int) -> None:
        s, lw, ls = self.spec, self.layers[il], self.spec["layers"][il]
        e, hd = s["n_embd"], s["head_dim"]
        q_dim, k_dim = s["n_head"] * hd, s["n_head_kv"] * hd
        x, qkv, o = self.x.data.ptr, self.qkv.data.ptr, self.o.data.ptr
        self._matmul_rows(T, [lw["wq"], lw["wk"], lw["wv"]], [qkv, qkv + 4 * q_dim, qkv + 4 * (q_dim + k_dim)],
                          self.qkv_dim, x, lw["ptr"]["attn_norm"], 0.0)
        ops.rope_kv(T, qkv, self.qkv_dim, self.pos.data.ptr, s, lw["ptr"] | {"rope_freq_scale": ls["rope_freq_scale"]},
                  self.q_rot.data.ptr, self.k_pools[il].data.ptr, self.v_pools[il].data.ptr,
                  self.tables.data.ptr + 4 * self.max_pages * seq, self.page_size,
                  self.theta_scale[il])
        params = ops.attn_params(s, q=self.q_rot.data.ptr, k_pool=self.k_pools[il].data.ptr,
                               v_pool=self.v_pools[il].data.ptr, page_tables=self.tables.data.ptr + 4 * self.max_pages * seq,
                               table_stride=self.max_pages, row_seq=self.row_seq.data.ptr, pos=self.pos.data.ptr,
                               window=ls.get("sliding_window") or 0, page_size=self.page_size, out=self.att.data.ptr)
        ops.attention(params, T, 1, s["n_head_kv"], s["head_dim"], False, s["n_head"] // s["n_head_kv"])
        post_a, post_f = lw["ptr"]["post_attn_norm"], lw["ptr"]["post_ffn_norm"]
        self._matmul_rows(T, [lw["wo"]], [o if post_a else x], e, self.att.data.ptr, 0, 0.0 if post_a else 1.0)
        if post_a:
            ops.rms_norm_rows(T, o, post_a, s["rms_eps"], e, x, True)
        gate_up_ptr, act, nff = self.gate_up.data.ptr, self.act.data.ptr, self.n_ff
        self._matmul_rows(T, [lw["w_gate"], lw["w_up"]], [gate_up_ptr, gate_up_ptr + 4 * nff], 2 * nff, x, lw["ptr"]["ffn_norm"], 0.0)
        ops.glu_rows(gate_up_ptr, nff, T, 0 if s["activation"] == "silu" else 1, act)
        self._matmul_rows(T, [lw["w_down"]], [o if post_f else x], e, act, 0, 0.0 if post_f else 1.0)
        if post_f:
            ops.rms_norm_rows(T, o, post_f, s["rms_eps"], e, x, True)

    def _head_rows(self, T: int, rows: list[int]) -> np.ndarray:
        cp, s = self.cp, self.spec
        m = len(rows)
        out = np.zeros((m, self.n_vocab), np.float32)
        if m == 0:
            return out
        e = s["n_embd"]
        idx = cp.asarray(np.array(rows, np.int32))
        sel = cp.empty((m, e), cp.float32)
        ops.gather_rows(self.x.data.ptr, idx.data.ptr, m, e, sel.data.ptr)
        norm = self.output_norm.data.ptr
        if m <= 4:  # a few rows: the decode GEMV, one row at a time
            keep: list[Any] = []
            for i in range(m):
                for fn in self._matmul_vec([self.output], [self.logits_dev.data.ptr], sel.data.ptr + 4 * e * i,
                                           norm, ops.MODE_STORE, keep=keep):
                    fn()
                out[i] = self.logits_dev[0].get()
            return out
        logits = cp.empty((m, self.n_vocab), cp.float32)
        self._matmul_rows(m, [self.output], [logits.data.ptr], self.n_vocab, sel.data.ptr, norm, 0.0)
        return logits.get()
