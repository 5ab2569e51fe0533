"""The CUDA engine's memory: the weights uploaded from the memory map (layouts.to_gpu pads the blocks for aligned
loads; a Q6_K output head the streamed kernel reads goes in planar rows instead, _head_type), the activation and
scratch buffers sized for a batch, the KV pools, and the step's inputs and outputs in mapped pinned host memory."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

from ninfer import _core
from ninfer.backends import cuda_attention as att_ops
from ninfer.backends import cuda_ops as ops
from ninfer.backends import launch
from ninfer.backends.layouts import (
    T_Q6_K,
    T_Q6_K_PLANAR,
    gpu_row_bytes,
    gpu_type,
    layout,
    to_gpu,
)
from ninfer.errors import InvalidArgumentError

H2D, D2H = 1, 2  # cudaMemcpyKind


class Pinned:
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



class Matrix:
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


class WeightsAndBuffers:
    """CudaEngine's upload and allocation (a mixin: the engine's state is CudaEngine's)."""

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
        # A cache with q4_0 keys (a quantized one's, or the tiered cache's L3) stores keys times the CPU's key scales
        # and reads them with queries divided by them (rust kv/key_scales.rs; the kernels' rope_load_head).
        q4_keys = (self.quant_kv is not None and self.quant_kv[0] == 4) or self.kv_tiers is not None
        # (the GPU layers' alone: a split model's CPU tail makes its own layers' scales)
        gpu_spec = dict(s, layers=s["layers"][: self.n_gpu])
        scales = _core.key_scales(self.mf.gguf, gpu_spec, threads=self.threads) if q4_keys else [None] * self.n_gpu
        for ls, sc in zip(s["layers"][: self.n_gpu], scales):
            lw = {k: Matrix(self.tensors[ls[k]], self._raw(ls[k])) for k in
                  ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
            for k in ("attn_norm", "ffn_norm", "bq", "bk", "bv", "q_norm", "k_norm", "post_attn_norm",
                      "post_ffn_norm"):
                lw[k] = self._vec(ls.get(k))
            lw["k_scales"] = None if sc is None else self.cp.asarray(sc)
            lw["q_unscales"] = None if sc is None else self.cp.asarray(np.float32(1.0) / sc)
            lw["ptr"] = {k: (lw[k].data.ptr if lw[k] is not None else 0) for k in
                         ("attn_norm", "ffn_norm", "bq", "bk", "bv", "q_norm", "k_norm", "post_attn_norm",
                          "post_ffn_norm", "k_scales", "q_unscales")}
            self.layers.append(lw)
        self.output = self.output_norm = None
        if self.plan.head_on_gpu:
            self.output = Matrix(self.tensors[s["output"]], self._raw(s["output"]), self._head_type())
            self.output_norm = self._vec(s["output_norm"])
        te = self.tensors[s["token_embd"]]
        self.embd_type, self.embd_row_bytes = te.type_id, te.n_bytes // te.dims[1]
        self.embd_gpu = None  # the table the decode step embeds its token from (budget.py embd_on_gpu)
        if self.plan.embd_on_gpu:
            tied = s["token_embd"] == s["output"]
            self.embd_gpu = self.output if tied else Matrix(te, self._raw(s["token_embd"]))
        # RoPE's per-pair factor, computed as the CPU computes it (f32 powf on the host).
        self.theta_scale = [float(np.float32(ls["rope_base"]) ** (np.float32(-2.0) / np.float32(s["rope_dims"])))
                            for ls in s["layers"]]
        # Each layer's other RoPE factors, the launches' `layer` entries: its position scale and YaRN's ramp and
        # magnitude, derived by the CPU's code (cpu/rope.rs RopeParams; without YaRN: ext_factor 0, mscale 1).
        self.rope_layers = []
        for ls in s["layers"]:
            (lo, hi), mscale = _core.rope_layer_params(ls["rope_base"], ls["rope_freq_scale"], s["rope_dims"],
                                                       s["rope_yarn"])
            self.rope_layers.append({"rope_freq_scale": ls["rope_freq_scale"],
                                     "rope_ext_factor": s["rope_yarn"]["ext_factor"], "rope_corr_lo": lo,
                                     "rope_corr_hi": hi, "rope_mscale": mscale})

    def _head_type(self) -> int:
        """The output head's GPU type: T_Q6_K_PLANAR, the rows gemv_q6k_stream reads, for a Q6_K head it can stream
        (cuda_ops.q6k_stream) and that is not tied to the embeddings (which the embedding kernel reads in padded
        blocks), else the tensor's own."""
        s = self.spec
        t = self.tensors[s["output"]]
        ty = gpu_type(t)
        if s["token_embd"] != s["output"] and ty == T_Q6_K \
                and ops.q6k_stream(ty, t.dims[1], t.dims[0], ops.MODE_ARGMAX):
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
        biggest = max(m.rows * m.cols for lw in self.layers for m in lw.values() if isinstance(m, Matrix)) \
            if self.layers else 0
        self.w16 = cp.zeros(max(biggest, 1 << 20), cp.uint16)
        self.pos = cp.zeros(T, cp.int32)
        self.row_seq = cp.zeros(T, cp.int32)  # every row reads the one page table it is given
        self.logits_dev = cp.zeros((4, s["n_vocab"]), f32)
        self.best = cp.zeros(1, cp.uint64)
        self.sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self._alloc_page_tables()  # (cuda_paging.py)
        if self.quant_kv:
            self._alloc_quant_kv(T)  # (cuda_kv_quant.py)
        elif self.kv_tiers is not None:
            self._alloc_tiers(T)  # (cuda_kv_tiers.py)
        else:
            kv_shape = (self.n_pages, s["n_head_kv"], self.page_size, s["head_dim"])
            self.k_pools = [cp.zeros(kv_shape, cp.uint16) for _ in range(self.n_gpu)]
            self.v_pools = [cp.zeros(kv_shape, cp.uint16) for _ in range(self.n_gpu)]
        group = s["n_head"] // s["n_head_kv"]
        self.pdl = launch.supported()  # decode kernels overlap their predecessors (backends/launch.py)
        # Key splits of decode attention: as many blocks as the GPU holds at once, over the KV heads
        # (NINFER_CUDA_ATT_SPLIT overrides, for measuring other choices).
        n_split = (env_count("NINFER_CUDA_ATT_SPLIT")
                   or att_ops.attention_resident(s["head_dim"], group) // s["n_head_kv"])
        self.n_split = max(1, min(-(-self.n_ctx // 256), n_split, att_ops.attention_max_split(s["head_dim"], group)))
        self.part_ml = cp.zeros(2 * s["n_head"] * self.n_split, f32)
        self.part_acc = cp.zeros(s["n_head"] * self.n_split * s["head_dim_v"], f32)
        self.tickets = cp.zeros(T * s["n_head_kv"], cp.int32)  # attention's split merges (each resets its own)
        # Step inputs and outputs in mapped pinned memory. Decode steps alternate between two slots of position
        # and token (parity p: position in_pos[p], token read from tok[p], greedy result written to tok[1 - p]), so
        # a step can be queued while the previous one runs (step()).
        self.in_x = Pinned(np.float32, e)
        self.in_pos = Pinned(np.int32, 2)
        self.tok = Pinned(np.int32, 2)
        self.out_logits = Pinned(np.float32, s["n_vocab"])
        self.out_x = Pinned(np.float32, e)
        self._keep: list[Any] = []
        self._op_lists: dict[tuple[int, bool, int], list[Any]] = {}
