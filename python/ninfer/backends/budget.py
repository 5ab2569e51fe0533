"""GPU memory planning: bytes of weights, KV cache and work buffers per layer, the number of layers that fit a
budget (`--gpu-mem-budget`), and the table printed at load, written the way a person would note it down."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ninfer.backends.layouts import gpu_row_bytes, gpu_type
from ninfer.errors import InvalidArgumentError

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'12GiB', '12G', '11.5 GB', '800MiB' -> bytes (K/M/G alone are binary, as llama.cpp's tools read them)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidArgumentError(f"cannot read memory size {text!r} (examples: 12GiB, 800MiB, 11.5GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class MemoryPlan:
    n_layer: int
    n_gpu_layers: int
    head_on_gpu: bool
    weights: int
    kv: int
    buffers: int
    budget: int | None
    # The token embedding table on the GPU too (the decode step embeds its token there, so steps can be queued
    # before the previous token is read back): free when the output head shares it, else where it fits.
    embd_on_gpu: bool = False
    kv_label: str = "f16"

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.buffers

    def table(self, n_ctx: int, threads: int) -> str:
        lines = ["GPU memory plan" + (f" (budget {gib(self.budget)})" if self.budget else "") + ":",
                 f"  weights   {self.n_gpu_layers}/{self.n_layer} layers"
                 + (" + output head" if self.head_on_gpu else "") + (" + embeddings" if self.embd_on_gpu else "")
                 + f"  {gib(self.weights):>11}",
                 f"  KV cache  {self.n_gpu_layers} layers x {n_ctx} tokens, {self.kv_label}  {gib(self.kv):>11}",
                 f"  buffers   activations, f16 matmul scratch  {gib(self.buffers):>11}",
                 f"  total     {gib(self.total):>11}"]
        if self.n_gpu_layers < self.n_layer:
            lines.append(f"  CPU: layers {self.n_gpu_layers}-{self.n_layer - 1} and the output head "
                         f"({threads} threads)")
        return "\n".join(lines)


def matrix_gpu_bytes(dims: tuple[int, ...], type_id: int) -> int:
    cols, rows = dims[0], (dims[1] if len(dims) > 1 else 1)
    return rows * gpu_row_bytes(type_id, cols)


def plan(tensors: dict, spec: dict, n_ctx: int, n_batch: int, page_size: int, n_gpu_layers: int,
         budget: int | None, n_seq: int = 1, kv_bytes: tuple[float, float] = (2.0, 2.0),
         kv_total: int | None = None) -> MemoryPlan:
    """tensors: name -> TensorEntry. n_gpu_layers < 0 means as many as fit (all without a budget). The KV cache
    holds n_seq sequences of up to n_ctx tokens, at kv_bytes (K, V) bytes a value (a quantized cache also keeps
    an f32 key offset a page); or (kv_total) takes that many bytes over every layer (the tiered cache's plan,
    cuda_kv_tiers.plan_tiers)."""
    L = len(spec["layers"])

    def mat(name: str) -> int:
        t = tensors[name]
        return matrix_gpu_bytes(t.dims, gpu_type(t))

    def vec(name: str | None) -> int:
        return 4 * tensors[name].n_elements if name else 0

    per_layer = []
    biggest = 0
    for ls in spec["layers"]:
        mats = [ls[k] for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
        biggest = max(biggest, *(tensors[m].n_elements for m in mats))
        per_layer.append(sum(mat(m) for m in mats) + sum(vec(ls.get(k)) for k in (
            "attn_norm", "ffn_norm", "bq", "bk", "bv", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")))
    head = mat(spec["output"]) + vec(spec["output_norm"])
    pages = -(-n_ctx // page_size) * n_seq
    kv_layer = int(pages * page_size * spec["n_head_kv"] * (spec["head_dim"] * kv_bytes[0]
                                                             + spec["head_dim_v"] * kv_bytes[1]))
    widened = 0
    if kv_total is not None:
        kv_layer = -(-kv_total // L)
    elif kv_bytes != (2.0, 2.0):  # a quantized cache: a key offset a page, and one layer widened to f16 for prompts
        kv_layer += pages * spec["n_head_kv"] * spec["head_dim"] * 4
        widened = pages * page_size * spec["n_head_kv"] * (spec["head_dim"] + spec["head_dim_v"]) * 2
    e, n_ff = spec["n_embd"], tensors[spec["layers"][0]["w_gate"]].dims[1]
    width = max(e, n_ff, spec["n_head"] * spec["head_dim_v"])
    qkv = (spec["n_head"] + 2 * spec["n_head_kv"]) * spec["head_dim"]
    # f32 activations of one prompt batch, f16/int8 copies of the widest one, the f16 weight scratch of the
    # prefill GEMM, logits, attention partials; plus cuBLAS's workspace.
    buffers = (4 * n_batch * (3 * e + qkv + 2 * spec["n_head"] * spec["head_dim"] + 3 * n_ff + 2 * width)
               + 2 * n_batch * width + 2 * biggest + 8 * spec["n_vocab"] + (64 << 20) + widened)

    def fits(n: int, with_head: bool, extra: int = 0) -> bool:
        w = sum(per_layer[:n]) + (head if with_head else 0) + extra
        return budget is None or w + n * kv_layer + buffers <= budget

    if 0 <= n_gpu_layers <= L:
        n = n_gpu_layers
    else:
        n = max(k for k in range(L + 1) if k == 0 or fits(k, False))
    with_head = n == L and fits(L, True)
    weights = sum(per_layer[:n]) + (head if with_head else 0)
    # (a split embedding, model/embedding.rs, is looked up on the host: the device table has one type per tensor)
    split = bool(spec.get("embd_split"))
    embd = 0 if spec["token_embd"] == spec["output"] or split else mat(spec["token_embd"])
    with_embd = with_head and fits(L, True, embd) and not split
    weights += embd if with_embd else 0
    return MemoryPlan(L, n, with_head, weights, n * kv_layer, buffers, budget, with_embd,
                      "tiered (device part)" if kv_total is not None else "f16")
