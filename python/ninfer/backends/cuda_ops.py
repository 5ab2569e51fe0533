"""Typed launchers for the kernels in kernels/: one Python function per kernel, taking device pointers (ints) and
sizes, so the engine never packs kernel arguments by hand. Every launch goes to CuPy's current stream (the engine
enters its own stream, which is what a CUDA graph captures).

CuPy passes a Python int as a 64-bit integer and a float as a double, so every scalar is wrapped in the numpy
type of the kernel's parameter here."""

from __future__ import annotations

import numpy as np

from ninfer.backends.kernels import function
from ninfer.backends.layouts import ACT_BF16, ACT_F16, ACT_F32, ACT_Q8_0, ACT_Q8_1, ACT_Q8_K

MODE_STORE, MODE_ADD, MODE_GLU, MODE_ARGMAX = range(4)
GEMV_WARPS = 8
ATT_WARPS, MAX_GROUP = 4, 8  # kernels/attention.cu

_GEMV_KERNEL = {ACT_F32: "gemv_f32act", ACT_F16: "gemv_f32act", ACT_BF16: "gemv_f32act",
                ACT_Q8_0: "gemv_q8_0", ACT_Q8_1: "gemv_q8_1", ACT_Q8_K: "gemv_q8_k"}

# struct MatDesc in kernels/gemv.cu (48 bytes).
MAT_DESC = np.dtype([("w", "<u8"), ("bias", "<u8"), ("out", "<u8"), ("row_bytes", "<i8"), ("type", "<i4"),
                     ("rows", "<i4"), ("row0", "<i4"), ("pad", "<i4")])


# struct Tail in kernels/norm.cu and struct AttnParams in kernels/attention.cu (C layout: align=True).
TAIL = np.dtype([("counter", "<u8"), ("x", "<u8"), ("w", "<u8"), ("eps", "<f4"), ("n", "<i4"), ("act", "<i4"),
                 ("out_q", "<u8"), ("out_d", "<u8"), ("out_s", "<u8"), ("out_f", "<u8")], align=True)
ATTN_PARAMS = np.dtype(
    [(k, "<u8") for k in ("q", "qkv", "bias_q", "bias_k", "bias_v", "q_norm", "k_norm", "k_pool", "v_pool",
                          "page_tables", "row_seq", "pos", "part_ml", "part_acc", "tickets", "out", "tail", "done")]
    + [(k, "<i4") for k in ("table_stride", "window", "n_head", "n_head_kv", "page_size", "qkv_stride",
                            "rope_dims", "neox")]
    + [(k, "<f4") for k in ("scale", "eps", "theta_scale", "freq_scale", "q_scale")] + [("pad", "<i4")], align=True)


def device_struct(dtype: np.dtype, **fields):
    """One C struct in device memory (a kernel reads its parameters from it)."""
    import cupy as cp

    a = np.zeros(1, dtype=dtype)
    for k, v in fields.items():
        a[0][k] = v
    return cp.asarray(a.view(np.uint8))


def tail(counter: int, x: int, w: int, eps: float, n: int, act: int, out_q: int, out_d: int, out_s: int,
         out_f: int = 0):
    return device_struct(TAIL, counter=counter, x=x, w=w, eps=eps, n=n, act=act, out_q=out_q, out_d=out_d,
                         out_s=out_s, out_f=out_f)


def P(ptr: int) -> np.uint64:
    return np.uint64(ptr)


def I(v: int) -> np.int32:  # noqa: E743 (a one-letter name for the commonest wrapper)
    return np.int32(v)


def F(v: float) -> np.float32:
    return np.float32(v)


def mat_descs(entries: list[tuple[int, int, int, int, int, int]]):
    """A device array of MatDesc from (w, bias, out, row_bytes, type, rows) tuples, rows numbered in order."""
    import cupy as cp

    d = np.zeros(len(entries), dtype=MAT_DESC)
    row0 = 0
    for i, (w, bias, out, row_bytes, ty, rows) in enumerate(entries):
        d[i] = (w, bias, out, row_bytes, ty, rows, row0, 0)
        row0 += rows
    return cp.asarray(d.view(np.uint8))


def gemv(act: int, descs, n_mats: int, total_rows: int, n_cols: int, act_q: int, act_d: int, act_s: int,
         mode: int, glu_act: int = 0, best: int = 0, tail_struct=None) -> None:
    threads = 32 * GEMV_WARPS
    warps = total_rows if mode == MODE_GLU else (total_rows + 1) // 2  # a warp: gate+up of a row, or two rows
    grid = (warps + GEMV_WARPS - 1) // GEMV_WARPS
    function(_GEMV_KERNEL[act])((grid,), (threads,), (
        descs, I(n_mats), I(total_rows), I(n_cols), P(act_q), P(act_d), P(act_s), I(mode), I(glu_act), P(best),
        tail_struct if tail_struct is not None else P(0)))


def norm_quant(rows: int, x: int, w: int, eps: float, n: int, act: int, out_q: int = 0, out_d: int = 0,
               out_s: int = 0, out_h: int = 0, out_f: int = 0) -> None:
    function("norm_quant")((rows,), (256,), (
        P(x), P(w), F(eps), I(n), I(act), P(out_q), P(out_d), P(out_s), P(out_h), P(out_f)))


def rms_norm_rows(rows: int, x: int, w: int, eps: float, n: int, out: int, add: bool) -> None:
    function("rms_norm_rows")((rows,), (256,), (P(x), P(w), F(eps), I(n), P(out), I(int(add))))


def rope_kv(rows: int, qkv: int, qkv_stride: int, pos: int, s: dict, layer: dict, q_out: int, k_pool: int,
            v_pool: int, page_table: int, page_size: int, theta_scale: float) -> None:
    warps = 4
    heads = s["n_head"] + s["n_head_kv"]
    hd = max(s["head_dim"], s["head_dim_v"])
    function("rope_kv")((rows, (heads + warps - 1) // warps), (32 * warps,), (
        P(qkv), I(qkv_stride), P(pos), I(s["n_head"]), I(s["n_head_kv"]), I(s["head_dim"]), I(s["head_dim_v"]),
        P(layer["bq"]), P(layer["bk"]), P(layer["bv"]), P(layer["q_norm"]), P(layer["k_norm"]), F(s["rms_eps"]),
        I(s["rope_dims"]), F(theta_scale), F(layer["rope_freq_scale"]), I(int(s["rope_neox"])), F(s["q_scale"]),
        P(q_out), P(k_pool), P(v_pool), P(page_table), I(page_size)), shared_mem=4 * warps * hd)


def attention_smem(hd: int) -> int:
    return 4 * (MAX_GROUP * hd + ATT_WARPS * MAX_GROUP * 32 + ATT_WARPS * MAX_GROUP * 2 + ATT_WARPS * MAX_GROUP * hd)


def attn_params(s: dict, *, k_pool: int, v_pool: int, page_tables: int, table_stride: int, row_seq: int, pos: int,
                window: int, page_size: int, out: int, q: int = 0, qkv: int = 0, qkv_stride: int = 0,
                layer: dict | None = None, theta_scale: float = 0.0, part_ml: int = 0, part_acc: int = 0,
                tickets: int = 0, tail_struct=None, done: int = 0):
    """The AttnParams struct of one attention launch (layer: the decode form's biases, norms, RoPE factors)."""
    lw = layer or {}
    return device_struct(
        ATTN_PARAMS, q=q, qkv=qkv, bias_q=lw.get("bq", 0), bias_k=lw.get("bk", 0), bias_v=lw.get("bv", 0),
        q_norm=lw.get("q_norm", 0), k_norm=lw.get("k_norm", 0), k_pool=k_pool, v_pool=v_pool,
        page_tables=page_tables, row_seq=row_seq, pos=pos, part_ml=part_ml, part_acc=part_acc, tickets=tickets,
        out=out, tail=tail_struct.data.ptr if tail_struct is not None else 0, done=done, table_stride=table_stride,
        window=window, n_head=s["n_head"], n_head_kv=s["n_head_kv"], page_size=page_size, qkv_stride=qkv_stride,
        rope_dims=s["rope_dims"], neox=int(s["rope_neox"]), scale=s["attn_scale"], eps=s["rms_eps"],
        theta_scale=theta_scale, freq_scale=lw.get("rope_freq_scale", 1.0), q_scale=s["q_scale"])


def attention(params, rows: int, n_split: int, n_head_kv: int, hd: int, step: bool) -> None:
    """TinyFlash over `rows` query rows; step=True is the decode form (RoPE + KV write fused, tail)."""
    name = f"attention_step_hd{hd}" if step else f"attention_hd{hd}"
    function(name)((n_split, n_head_kv, rows), (32 * ATT_WARPS,), (params,), shared_mem=attention_smem(hd))


def embed(type_id: int, table: int, row_bytes: int, tokens: int, rows: int, n: int, scale: float, out: int) -> None:
    units = n // 32
    function("embed")(((units + 127) // 128, rows), (128,), (
        I(type_id), P(table), np.int64(row_bytes), P(tokens), I(n), F(scale), P(out)))


def dequant_f16(type_id: int, w: int, row_bytes: int, rows: int, cols: int, out: int) -> None:
    total = rows * (cols // 32)
    function("dequant_f16")(((total + 255) // 256,), (256,), (
        I(type_id), P(w), np.int64(row_bytes), I(rows), I(cols), P(out)))


def glu_rows(gu: int, n: int, rows: int, act: int, out: int) -> None:
    total = n * rows
    function("glu_rows")(((total + 255) // 256,), (256,), (P(gu), I(n), I(rows), I(act), P(out)))


def gather_rows(x: int, rows_idx: int, n_rows: int, n: int, out: int) -> None:
    function("gather_rows")((max(1, min(64, (n + 255) // 256)), n_rows), (256,), (P(x), P(rows_idx), I(n), P(out)))


def argmax_reset(best: int) -> None:
    function("argmax_reset")((1,), (1,), (P(best),))


def argmax_finish(best: int, token: int) -> None:
    function("argmax_finish")((1,), (1,), (P(best), P(token)))
