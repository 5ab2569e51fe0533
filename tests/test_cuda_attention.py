"""The CUDA backend's RoPE, KV-cache write and attention kernels against the CPU's (NMSE), prompt and decode step.
These need CuPy and a GPU and are skipped elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_helpers import needs_cuda, nmse


def _rope_ref(v: np.ndarray, pos: int, dims: int, base: float, neox: bool) -> np.ndarray:
    """The CPU's rope_row (f32, the same running product of angles)."""
    v = v.astype(np.float32).copy()
    ts = np.float32(base) ** (np.float32(-2.0) / np.float32(dims))
    theta = np.float32(pos)
    half = dims // 2
    for i in range(half):
        c, s = np.float32(np.cos(theta)), np.float32(np.sin(theta))
        a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
        x0, x1 = v[a], v[b]
        v[a] = x0 * c - x1 * s
        v[b] = x0 * s + x1 * c
        theta = np.float32(theta * ts)
    return v


def _rope_yarn_ref(v: np.ndarray, pos: int, dims: int, base: float, layer: dict, neox: bool) -> np.ndarray:
    """The CPU's YaRN angles (rust/core/src/cpu/rope.rs rope_angles) in f32, its FMA emulated in f64, then
    rope_row; `layer` holds the factors CudaMemory.rope_layers gives a launch."""
    v = v.astype(np.float32).copy()
    f32 = np.float32
    ts = f32(base) ** (f32(-2.0) / f32(dims))
    fs, ext, lo, hi, mscale = (f32(layer[k]) for k in ("rope_freq_scale", "rope_ext_factor", "rope_corr_lo",
                                                      "rope_corr_hi", "rope_mscale"))
    theta = f32(pos)
    half = dims // 2
    for i in range(half):
        t = f32(fs * theta)
        y = f32(f32(f32(i) - lo) / max(f32(0.001), f32(hi - lo)))
        mix = f32(f32(1.0) - min(f32(1.0), max(f32(0.0), y))) * ext
        t = f32(np.float64(t) * np.float64(f32(1.0) - mix) + np.float64(f32(theta * mix)))
        c, s = f32(f32(np.cos(t)) * mscale), f32(f32(np.sin(t)) * mscale)
        a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
        x0, x1 = v[a], v[b]
        v[a] = x0 * c - x1 * s
        v[b] = x0 * s + x1 * c
        theta = f32(theta * ts)
    return v


def _yarn_layer(base: float, freq_scale: float, dims: int, n_ctx_orig: int) -> dict:
    """A layer's RoPE entries with YaRN on, derived by the CPU's code as CudaMemory derives them."""
    from ninfer import _core

    yarn = {"ext_factor": 1.0, "attn_factor": _core.rope_yarn_attn_factor(freq_scale, 1.0, 1.0, 1.0),
            "beta_fast": 32.0, "beta_slow": 1.0, "n_ctx_orig": n_ctx_orig}
    (lo, hi), mscale = _core.rope_layer_params(base, freq_scale, dims, yarn)
    return {"rope_freq_scale": freq_scale, "rope_ext_factor": 1.0, "rope_corr_lo": lo, "rope_corr_hi": hi,
            "rope_mscale": mscale}


def _attention_ref(q, keys, vals, scale):
    s = (q.astype(np.float64) @ keys.astype(np.float64).T) * scale
    p = np.exp(s - s.max())
    return (p / p.sum()) @ vals.astype(np.float64)


@needs_cuda
@pytest.mark.parametrize("hd,n_head,n_kv,length,n_split,window", [
    (64, 9, 3, 37, 1, 0), (128, 12, 2, 700, 4, 0), (128, 40, 8, 1500, 7, 0), (64, 14, 2, 300, 3, 128),
    (256, 4, 1, 260, 2, 0), (128, 12, 2, 100, 16, 0),
    # many tiles a warp (the online softmax across tiles), eight and one query heads per KV head
    (128, 16, 2, 2100, 2, 0), (64, 8, 8, 600, 1, 0)])
def test_rope_kv_write_and_tinyflash_attention(hd: int, n_head: int, n_kv: int, length: int, n_split: int,
                                               window: int) -> None:
    import cupy as cp
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends import cuda_attention as att_ops

    rng = np.random.default_rng(hd + length)
    page, rows = 256, 3  # three query rows at the last three positions (a batch of decode rows)
    n_pages = -(-length // page) + 1
    spec = {"n_head": n_head, "n_head_kv": n_kv, "head_dim": hd, "head_dim_v": hd, "rms_eps": 1e-6,
            "rope_dims": hd, "rope_neox": True, "q_scale": 1.0, "attn_scale": hd**-0.5}
    layer = {"bq": 0, "bk": 0, "bv": 0, "q_norm": 0, "k_norm": 0, "rope_freq_scale": 1.0}
    qkv_dim = (n_head + 2 * n_kv) * hd
    qkv = rng.standard_normal((length, qkv_dim)).astype(np.float32)
    table = cp.asarray(rng.permutation(n_pages).astype(np.int32))  # pages in a scrambled order
    kp = cp.zeros((n_pages, n_kv, page, hd), cp.uint16)
    vp = cp.zeros_like(kp)
    q_rot = cp.zeros((length, n_head * hd), cp.float32)
    base = 1e4
    theta_scale = float(np.float32(base) ** (np.float32(-2.0) / np.float32(hd)))
    # Device arrays stay bound to names while kernels use them: a temporary's memory returns to CuPy's pool as
    # soon as only its pointer is left.
    qkv_d, pos_all = cp.asarray(qkv), cp.arange(length, dtype=cp.int32)
    att_ops.rope_kv(length, qkv_d.data.ptr, qkv_dim, pos_all.data.ptr, spec, layer, q_rot.data.ptr, kp.data.ptr,
              vp.data.ptr, table.data.ptr, page, theta_scale)
    q_all = q_rot.get().reshape(length, n_head, hd)
    for t in (0, length - 1):
        for h in (0, n_head - 1):
            ref = _rope_ref(qkv[t, h * hd : (h + 1) * hd], t, hd, base, True)
            assert nmse(q_all[t, h], ref) < 1e-10
    # Read the cache back in position order.
    tab = table.get()
    k_cache = np.stack([kp.get()[tab[p // page], :, p % page] for p in range(length)]).view(np.float16)
    v_cache = np.stack([vp.get()[tab[p // page], :, p % page] for p in range(length)]).view(np.float16)
    ref_k = _rope_ref(qkv[5, n_head * hd : (n_head + 1) * hd], 5, hd, base, True)
    assert nmse(k_cache[5, 0].astype(np.float32), ref_k) < 1e-6
    assert (v_cache[9, n_kv - 1] == qkv[9, (n_head + 2 * n_kv - 1) * hd :].astype(np.float16)).all()

    positions = np.arange(length - rows, length, dtype=np.int32)
    q = cp.asarray(q_all[positions].reshape(rows, -1))
    out = cp.zeros((rows, n_head * hd), cp.float32)
    part_ml = cp.zeros(rows * 2 * n_head * n_split, cp.float32)
    part_acc = cp.zeros(rows * n_head * n_split * hd, cp.float32)
    tickets = cp.zeros(rows * n_kv, cp.int32)
    row_seq, pos_d = cp.zeros(rows, cp.int32), cp.asarray(positions)
    params = att_ops.attn_params(spec, q=q.data.ptr, k_pool=kp.data.ptr, v_pool=vp.data.ptr, page_tables=table.data.ptr,
                           table_stride=0, row_seq=row_seq.data.ptr, pos=pos_d.data.ptr, window=window,
                           page_size=page, out=out.data.ptr, part_ml=part_ml.data.ptr, part_acc=part_acc.data.ptr,
                           tickets=tickets.data.ptr)
    for rep in range(2):  # the tickets reset themselves: a second launch gives the same result
        att_ops.attention(params, rows, n_split, n_kv, hd, False, n_head // n_kv)
        got = out.get().reshape(rows, n_head, hd)
        g = n_head // n_kv
        for i, p in enumerate(positions):
            lo = max(0, p + 1 - window) if window else 0
            for h in range(n_head):
                qh = q_all[p, h].astype(np.float16).astype(np.float64)
                ref = _attention_ref(qh, k_cache[lo : p + 1, h // g], v_cache[lo : p + 1, h // g], hd**-0.5)
                assert nmse(got[i, h], ref) < 1e-6, (rep, i, h, nmse(got[i, h], ref))
    assert (tickets.get() == 0).all()
    if hd != 128:
        return
    # With out_q / out_d (head size 128) the output is also quantized for the output projection: the codes, int16
    # sums and scales quant_act(ACT_GSQ8_PAIRS) writes from it, byte for byte, and the same f32 output.
    from ninfer.backends.layouts import ACT_GSQ8_PAIRS

    n = rows * n_head * hd
    q_att, d_att = cp.full(ops.act_code_bytes(n, True), 99, cp.int8), cp.full(n // 32, -1, cp.float32)
    out2 = cp.zeros_like(out)
    params_q = att_ops.attn_params(spec, q=q.data.ptr, k_pool=kp.data.ptr, v_pool=vp.data.ptr, page_tables=table.data.ptr,
                             table_stride=0, row_seq=row_seq.data.ptr, pos=pos_d.data.ptr, window=window,
                             page_size=page, out=out2.data.ptr, part_ml=part_ml.data.ptr, part_acc=part_acc.data.ptr,
                             tickets=tickets.data.ptr, out_q=q_att.data.ptr, out_d=d_att.data.ptr)
    att_ops.attention(params_q, rows, n_split, n_kv, hd, False, n_head // n_kv)
    q_ref, d_ref, s_ref = cp.full_like(q_att, 99), cp.full_like(d_att, -1), cp.zeros(n // 16, cp.float32)
    ops.quant_act(out2.data.ptr, n, ACT_GSQ8_PAIRS, q_ref.data.ptr, d_ref.data.ptr, s_ref.data.ptr)
    assert (out2.get() == out.get()).all()
    assert (q_att.get() == q_ref.get()).all() and (d_att.get() == d_ref.get()).all()
    assert (d_att.get() > 0).all() and (tickets.get() == 0).all()


@needs_cuda
@pytest.mark.parametrize("hd,neox", [(64, True), (128, False), (128, True)])
def test_rope_kv_with_yarn_equals_the_cpus_angles(hd: int, neox: bool) -> None:
    """rope_kv with YaRN's factors (Qwen2.5's scale 4 over a 4,096-token original context, so the ramp falls inside
    the head) against the CPU's formula, queries and keys, at every position's first and last heads."""
    import cupy as cp
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends import cuda_attention as att_ops

    rng = np.random.default_rng(hd)
    n_head, n_kv, length, page, base = 4, 2, 1200, 256, 1e4
    n_pages = -(-length // page)
    spec = {"n_head": n_head, "n_head_kv": n_kv, "head_dim": hd, "head_dim_v": hd, "rms_eps": 1e-6,
            "rope_dims": hd, "rope_neox": neox, "q_scale": 1.0, "attn_scale": hd**-0.5}
    layer = {"bq": 0, "bk": 0, "bv": 0, "q_norm": 0, "k_norm": 0} | _yarn_layer(base, 0.25, hd, 4096)
    assert 0 < layer["rope_corr_lo"] < layer["rope_corr_hi"] < hd // 2 - 1 and layer["rope_mscale"] > 1.1
    qkv_dim = (n_head + 2 * n_kv) * hd
    qkv = rng.standard_normal((length, qkv_dim)).astype(np.float32)
    table = cp.arange(n_pages, dtype=cp.int32)
    kp = cp.zeros((n_pages, n_kv, page, hd), cp.uint16)
    vp = cp.zeros_like(kp)
    q_rot = cp.zeros((length, n_head * hd), cp.float32)
    theta_scale = float(np.float32(base) ** (np.float32(-2.0) / np.float32(hd)))
    qkv_d, pos_all = cp.asarray(qkv), cp.arange(length, dtype=cp.int32)
    att_ops.rope_kv(length, qkv_d.data.ptr, qkv_dim, pos_all.data.ptr, spec, layer, q_rot.data.ptr, kp.data.ptr,
                vp.data.ptr, table.data.ptr, page, theta_scale)
    q_all = q_rot.get().reshape(length, n_head, hd)
    k_all = kp.get().view(np.float16)
    for t in (1, 100, length - 1):
        for h in (0, n_head - 1):
            ref = _rope_yarn_ref(qkv[t, h * hd : (h + 1) * hd], t, hd, base, layer, neox)
            assert nmse(q_all[t, h], ref) < 1e-10, (t, h)
        ref_k = _rope_yarn_ref(qkv[t, n_head * hd : (n_head + 1) * hd], t, hd, base, layer, neox)
        assert nmse(k_all[t // page, 0, t % page].astype(np.float32), ref_k) < 1e-6
    # Not the plain angles: YaRN's factors reached the kernel.
    plain = _rope_ref(qkv[length - 1, :hd], length - 1, hd, base, neox)
    assert nmse(q_all[length - 1, 0], plain) > 1e-3


@needs_cuda
@pytest.mark.parametrize("hd,rope,n_head,n_kv,neox,norms,biases,length,n_split,yarn", [
    (64, 64, 9, 3, False, False, True, 37, 1, False), (128, 128, 40, 8, True, False, True, 100, 1, False),
    (128, 128, 12, 2, False, True, True, 700, 3, False), (256, 256, 4, 1, True, True, False, 260, 2, False),
    (128, 64, 8, 2, True, False, True, 50, 1, False), (128, 128, 12, 2, True, False, True, 900, 3, True)])
def test_decode_step_attention_equals_rope_kv_then_prompt_attention(hd: int, rope: int, n_head: int, n_kv: int,
                                                                     neox: bool, norms: bool, biases: bool,
                                                                     length: int, n_split: int, yarn: bool) -> None:
    """The decode form (attention_step_*: RoPE of the query heads and the new key, its K / V write and attention in
    one launch) against rope_kv for that row and then the prompt form: the same cache bytes and the same output, bit
    for bit, with and without biases and per-head norms, both RoPE layouts (neox and adjacent pairs), RoPE over the
    whole head and over half of it, one key split (a warp a head merges) and several (the last block merges), and
    with YaRN's factors."""
    import cupy as cp
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends import cuda_attention as att_ops

    rng = np.random.default_rng(hd + length + n_head)
    page = 256
    n_pages = -(-length // page) + 1
    spec = {"n_head": n_head, "n_head_kv": n_kv, "head_dim": hd, "head_dim_v": hd, "rms_eps": 1e-6,
            "rope_dims": rope, "rope_neox": neox, "q_scale": 0.5 if norms else 1.0, "attn_scale": hd**-0.5}
    qkv_dim = (n_head + 2 * n_kv) * hd
    keep = []  # device arrays bound while kernels use them

    def dev(a: np.ndarray) -> int:
        keep.append(cp.asarray(a.astype(np.float32)))
        return keep[-1].data.ptr

    layer = {"bq": 0, "bk": 0, "bv": 0, "q_norm": 0, "k_norm": 0, "rope_freq_scale": 0.75}
    if yarn:
        layer |= _yarn_layer(1e4, 0.25, rope, 4096)
    if biases:
        layer |= {"bq": dev(rng.standard_normal(n_head * hd)), "bk": dev(rng.standard_normal(n_kv * hd)),
                  "bv": dev(rng.standard_normal(n_kv * hd))}
    if norms:
        layer |= {"q_norm": dev(1 + 0.3 * rng.standard_normal(hd)), "k_norm": dev(1 + 0.3 * rng.standard_normal(hd))}
    qkv = cp.asarray(rng.standard_normal((length, qkv_dim)).astype(np.float32))
    table = cp.asarray(rng.permutation(n_pages).astype(np.int32))
    theta_scale = float(np.float32(1e4) ** (np.float32(-2.0) / np.float32(rope)))
    pos_all = cp.arange(length, dtype=cp.int32)
    last = length - 1
    pos_last, row_seq = cp.asarray([last], cp.int32), cp.zeros(1, cp.int32)
    outs, caches = [], []
    for step in (False, True):
        kp = cp.zeros((n_pages, n_kv, page, hd), cp.uint16)
        vp = cp.zeros_like(kp)
        q_rot = cp.zeros((length, n_head * hd), cp.float32)
        out = cp.zeros(n_head * hd, cp.float32)
        part_ml = cp.zeros(2 * n_head * n_split, cp.float32)
        part_acc = cp.zeros(n_head * n_split * hd, cp.float32)
        tickets = cp.zeros(n_kv, cp.int32)
        rows = last if step else length  # (the decode form writes the last row's K and V itself)
        att_ops.rope_kv(rows, qkv.data.ptr, qkv_dim, pos_all.data.ptr, spec, layer, q_rot.data.ptr, kp.data.ptr,
                  vp.data.ptr, table.data.ptr, page, theta_scale)
        common = dict(k_pool=kp.data.ptr, v_pool=vp.data.ptr, page_tables=table.data.ptr, table_stride=0,
                      row_seq=row_seq.data.ptr, pos=pos_last.data.ptr, window=0, page_size=page, out=out.data.ptr,
                      part_ml=part_ml.data.ptr, part_acc=part_acc.data.ptr, tickets=tickets.data.ptr)
        if step:
            params = att_ops.attn_params(spec, qkv=qkv.data.ptr + 4 * last * qkv_dim, qkv_stride=qkv_dim, layer=layer,
                                   theta_scale=theta_scale, **common)
        else:
            params = att_ops.attn_params(spec, q=q_rot.data.ptr + 4 * last * n_head * hd, **common)
        att_ops.attention(params, 1, n_split, n_kv, hd, step, n_head // n_kv)
        outs.append(out.get())
        caches.append((kp.get(), vp.get()))
        assert (tickets.get() == 0).all()
    assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
    assert (caches[1][0] == caches[0][0]).all() and (caches[1][1] == caches[0][1]).all()
    assert (outs[1] == outs[0]).all(), float(np.abs(outs[1] - outs[0]).max())
