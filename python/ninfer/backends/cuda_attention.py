"""Typed launchers of the attention kernels (kernels/rope_kv.cu, attention_keys.cu, attention.cu: TinyFlash over the
paged f16 cache), as cuda_ops.py is for the others: device pointers and sizes in, every scalar in its kernel type.
(The quantized cache's attention: cuda_kv_quant.py.)"""

from __future__ import annotations

import numpy as np

from ninfer.backends import launch
from ninfer.backends.cuda_ops import allow_smem, resident_blocks, struct_value
from ninfer.backends.kernels import function

u64, i32, f32 = np.uint64, np.int32, np.float32  # the kernels' parameter types

ATT_WARPS, MAX_GROUP = 8, 8  # kernels/attention.cu

# struct AttnParams in kernels/attention_keys.cu (C layout: align=True).
ATTN_PARAMS = np.dtype(
    [(k, "<u8") for k in ("q", "qkv", "bias_q", "bias_k", "bias_v", "q_norm", "k_norm", "k_pool", "v_pool",
                          "page_tables", "row_seq", "pos", "part_ml", "part_acc", "tickets", "out")]
    + [(k, "<i4") for k in ("table_stride", "window", "n_head", "n_head_kv", "page_size", "qkv_stride",
                            "rope_dims", "neox")]
    + [(k, "<f4") for k in ("scale", "eps", "theta_scale", "freq_scale", "q_scale", "ext_factor", "corr_lo",
                            "corr_hi", "mscale")] + [("pad", "<i4")]
    + [(k, "<u8") for k in ("out_q", "out_d")], align=True)



def _yarn_args(layer: dict) -> tuple:
    """YaRN's factors of a layer (CudaMemory.rope_layers; absent: none, plain or linear RoPE) as kernel arguments."""
    return (f32(layer.get("rope_ext_factor", 0.0)), f32(layer.get("rope_corr_lo", 0.0)),
            f32(layer.get("rope_corr_hi", 0.0)), f32(layer.get("rope_mscale", 1.0)))


def rope_kv(rows: int, qkv: int, qkv_stride: int, pos: int, s: dict, layer: dict, q_out: int, k_pool: int,
            v_pool: int, page_table: int, page_size: int, theta_scale: float, k_rows: int = 0,
            v_rows: int = 0) -> None:
    """q roped to q_out; K and V into the f16 pools, or (k_rows set: a quantized cache) rotated to k_rows/v_rows."""
    warps = 4
    heads = s["n_head"] + s["n_head_kv"]
    hd = max(s["head_dim"], s["head_dim_v"])
    launch.kernel(function("rope_kv"), (rows, (heads + warps - 1) // warps), (32 * warps,), (
        u64(qkv), i32(qkv_stride), u64(pos), i32(s["n_head"]), i32(s["n_head_kv"]), i32(s["head_dim"]),
        i32(s["head_dim_v"]),
        u64(layer["bq"]), u64(layer["bk"]), u64(layer["bv"]), u64(layer["q_norm"]), u64(layer["k_norm"]),
        f32(s["rms_eps"]),
        i32(s["rope_dims"]), f32(theta_scale), f32(layer["rope_freq_scale"]), *_yarn_args(layer),
        i32(int(s["rope_neox"])), f32(s["q_scale"]),
        u64(q_out), u64(k_pool), u64(v_pool), u64(page_table), i32(page_size), u64(k_rows), u64(v_rows),
        u64(layer.get("k_scales", 0)), u64(layer.get("q_unscales", 0))),
        shared_mem=4 * warps * hd, dependent=True)


def attention_smem(hd: int) -> int:
    return 4 * (MAX_GROUP * hd + ATT_WARPS * MAX_GROUP * 32 + ATT_WARPS * MAX_GROUP * 2 + ATT_WARPS * MAX_GROUP * hd)


def attn_params(s: dict, *, k_pool: int, v_pool: int, page_tables: int, table_stride: int, row_seq: int, pos: int,
                window: int, page_size: int, out: int, q: int = 0, qkv: int = 0, qkv_stride: int = 0,
                layer: dict | None = None, theta_scale: float = 0.0, part_ml: int = 0, part_acc: int = 0,
                tickets: int = 0, out_q: int = 0, out_d: int = 0) -> np.void:
    """The AttnParams struct of one attention launch (layer: the decode form's biases, norms, RoPE factors; out_q,
    out_d: with head size 128, `out` quantized for the output projection too, as quant_act(ACT_GSQ8_PAIRS))."""
    lw = layer or {}
    return struct_value(
        ATTN_PARAMS, q=q, qkv=qkv, bias_q=lw.get("bq", 0), bias_k=lw.get("bk", 0), bias_v=lw.get("bv", 0),
        q_norm=lw.get("q_norm", 0), k_norm=lw.get("k_norm", 0), k_pool=k_pool, v_pool=v_pool,
        page_tables=page_tables, row_seq=row_seq, pos=pos, part_ml=part_ml, part_acc=part_acc, tickets=tickets,
        out=out, table_stride=table_stride,
        window=window, n_head=s["n_head"], n_head_kv=s["n_head_kv"], page_size=page_size, qkv_stride=qkv_stride,
        rope_dims=s["rope_dims"], neox=int(s["rope_neox"]), scale=s["attn_scale"], eps=s["rms_eps"],
        theta_scale=theta_scale, freq_scale=lw.get("rope_freq_scale", 1.0), q_scale=s["q_scale"],
        ext_factor=lw.get("rope_ext_factor", 0.0), corr_lo=lw.get("rope_corr_lo", 0.0),
        corr_hi=lw.get("rope_corr_hi", 0.0), mscale=lw.get("rope_mscale", 1.0), out_q=out_q,
        out_d=out_d)


def attention_max_split(hd: int, group: int) -> int:
    """The most key splits the last block's merge holds in shared memory (kernels/attention.cu: (m, l) pairs of
    every split and query head of a group in the warps' merge area, ATT_WARPS * MAX_GROUP * hd floats)."""
    return ATT_WARPS * MAX_GROUP * hd // (2 * group)


def attention_resident(hd: int, group: int) -> int:
    """Blocks of the decode attention kernel the GPU holds at once (its key splits fill them)."""
    fn = function(f"attention_step_hd{hd}_g{group}")
    return resident_blocks(fn, 32 * ATT_WARPS, attention_smem(hd))


def attention(params, rows: int, n_split: int, n_head_kv: int, hd: int, step: bool, group: int) -> None:
    """TinyFlash over `rows` query rows; step=True is the decode form (RoPE + KV write fused); group: query heads
    per KV head (1..MAX_GROUP, a kernel each)."""
    name = f"attention_step_hd{hd}_g{group}" if step else f"attention_hd{hd}_g{group}"
    fn, smem = function(name), attention_smem(hd)
    allow_smem(fn, smem)  # head dim 256: 82 KB
    launch.kernel(fn, (n_split, n_head_kv, rows), (32 * ATT_WARPS,), (params,),
                  shared_mem=smem, dependent=True)
