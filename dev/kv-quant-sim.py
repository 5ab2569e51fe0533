#!/usr/bin/env python3
"""Where a 4-bit KV cache's perplexity goes, simulated: the calibration forward pass of gsq_sequential.py (numpy,
f32) with each layer's keys and values passed through a quantizer before attention, perplexity over the first
chunks of a text (the second half of each 512-token chunk scored, as `ninfer perplexity` does).

    python3 dev/kv-quant-sim.py MODEL TEXT [--chunks 4] [--variants f16,cache,kbias,kchan,konly,vonly]

Variants (keys and values of every position, the chunk's own included, as a prefill over a quantized cache reads):
- f16: keys and values rounded to f16 (the reference)
- cache: the q4_0 cache as stored (kv/cache.rs): rows Hadamard-rotated per head, keys less their block's mean
  (32 positions, position 0 left out), 32-element q4_0 blocks with least-squares scales (kv/fitted_q4.rs)
- kbias: as cache, but the keys' bias term rope(b_k, pos) taken out exactly before (and added back after)
- kchan: as cache, but each key block quantized per channel (KIVI): a 32-position column of one rotated dimension
  per q4_0 block
- konly / vonly: the cache's keys / values alone quantized
- l0k16: as cache, the first layer's keys unquantized (k16atN: layer N's); l0bias: as cache, kbias in the first layer only
- sinkN, sinkNk, sinkNv: as cache, the first N positions' keys and values (k: keys only, v: values only) kept
- qawP (e.g. qaw, qaw0.25): as cache, each key channel scaled by (rms q / rms k)^P (default 0.5) before quantizing and
  back after (the queries' view: q/s . k*s), the scales from the chunk's own queries and keys (an oracle); qawkbias
  (qawPkbias): the same after the key bias is taken out as kbias does
- off0 (also off0-konly, off0-vonly): as cache (konly, vonly), the first block's offset being position 0's key
- any variant with "mid" in its name: offsets at each channel's mid-range; with "signs": random signs before the
  rotation; with "iq4": IQ4_NL's 16 non-uniform levels (same 4.5 bits) instead of q4_0's uniform ones; with "c8":
  q8_0 rows (the q8_0 cache, e.g. c8+s); with "p2": the query-aware scales rounded to powers of two; ending in "+s" (cache+s, kbias+s): position 0's key kept exact (the
  engine's k_sink); then "+q8q" (cache+s+q8q): the queries rotated and through q8_0, as the CPU engine's integer dots
  with a quantized cache read them (f16 is the reference for every variant, its queries f32)
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from ninfer.gsq_sequential import SequentialCalibration, rope
from ninfer.model_file import ModelFile
from ninfer.tokenizer import Tokenizer

BLOCK = 32
VALUE_OFFSETS = [False]  # values less their block's mean too (attention adds the block's probability mass x mean)
OFFSET_BLOCK = [256]
POW2 = [False]  # query-aware scales rounded to powers of two  # positions a key offset covers (the plain cache's block: kv_block_size; a tiered cache: 64)
DIVISORS = np.array([-8.0, -7.75, -7.5, -7.25, -7.0, -6.75, -6.5, -6.25, -6.0], np.float32)


def hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(math.sqrt(n))


def least_error(x: np.ndarray, trials) -> np.ndarray:
    """Of the read-back blocks `trials` yields (each [..., 32], as x), each block's closest to x."""
    best, best_err = None, None
    for y in trials:
        err = np.sum((x - y) ** 2, axis=-1, keepdims=True)
        if best is None:
            best, best_err = y, err
        else:
            take = err < best_err
            best = np.where(take, y, best)
            best_err = np.where(take, err, best_err)
    return best


def signed_amax(x: np.ndarray) -> np.ndarray:
    i = np.argmax(np.abs(x), axis=-1)[..., None]
    return np.take_along_axis(x, i, axis=-1)


def q4_fitted(x: np.ndarray) -> np.ndarray:
    """x [..., 32] through q4_0 with the least-squares scale among DIVISORS (f16 scales), read back."""
    amax = signed_amax(x)

    def trials():
        for div in DIVISORS:
            d = (amax / div).astype(np.float16).astype(np.float32)
            inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0)
            yield d * (np.clip(np.round(x * inv + 8), 0, 15) - 8)

    return least_error(x, trials())


# ggml's IQ4_NL levels: 16 non-uniform steps, denser near zero (a Gaussian's shape, as rotated rows are)
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def iq4_fitted(x: np.ndarray) -> np.ndarray:
    """x [..., 32] through IQ4_NL's levels with an f16 scale: for each trial inverse scale (ggml's search around
    -127 / amax), every element to its nearest level, then the least-squares scale for those levels; the best kept."""
    amax = signed_amax(x)
    safe = np.where(amax != 0, amax, 1)
    mid = (IQ4_LEVELS[1:] + IQ4_LEVELS[:-1]) / 2

    def trials():
        for t in range(-7, 8):
            lv = IQ4_LEVELS[np.searchsorted(mid, x * (IQ4_LEVELS[0] + t) / safe)]
            d = np.sum(x * lv, axis=-1, keepdims=True) / np.sum(lv * lv, axis=-1, keepdims=True)
            yield d.astype(np.float16).astype(np.float32) * lv

    return np.where(amax != 0, least_error(x, trials()), 0)


IQ4 = [False]  # IQ4_NL's levels instead of q4_0's
Q8 = [False]  # q8_0 rows instead of 4-bit ones (the q8_0 cache)


def q8(x: np.ndarray) -> np.ndarray:
    """x [..., 32] through q8_0 (ggml's quantize_row_q8_0: d = amax / 127 in f16, codes rounded), read back."""
    d = (np.abs(x).max(axis=-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0)
    return d * np.round(x * inv)


def quant_rows(x: np.ndarray, fn=None) -> np.ndarray:
    """[n, H, d] rows through `fn`'s blocks along d: by default q4_0 (or IQ4_NL, or q8_0, as the variant says)."""
    n, h, d = x.shape
    fn = fn or (q8 if Q8[0] else iq4_fitted if IQ4[0] else q4_fitted)
    return fn(x.reshape(n, h, d // BLOCK, BLOCK)).reshape(n, h, d)


def quant_queries(q: np.ndarray) -> np.ndarray:
    """[n, H, d] queries as the CPU engine's quantized-cache dots read them: rotated, q8_0 rows, rotated back."""
    h = rotation(q.shape[-1])
    return quant_rows(q @ h.T, q8) @ h


MIDRANGE = [False]  # offsets at each channel's mid-range instead of its mean
SIGNS = [False]  # random signs before the Hadamard rotation (a randomized Hadamard), per head size
SINK_OFFSET = [False]  # the first block's offset is position 0's key itself (the sink stored exactly)
SINK_KEY = [False]  # position 0's key read back exactly (the engine's k_sink: what quantization lost, added back)


def block_means(k: np.ndarray) -> np.ndarray:
    """Each cache block's mean key (position 0 left out of the first), per position: [n, H, d]."""
    out, B = np.empty_like(k), OFFSET_BLOCK[0]
    for b0 in range(0, k.shape[0], B):
        a = 1 if b0 == 0 and k.shape[0] > 1 else b0
        blk = k[a : b0 + B]
        if MIDRANGE[0]:
            out[b0 : b0 + B] = (blk.max(axis=0, keepdims=True) + blk.min(axis=0, keepdims=True)) / 2
        else:
            out[b0 : b0 + B] = blk.mean(axis=0, keepdims=True)
    if SINK_OFFSET[0]:
        out[0:B] = k[0:1]
    return out


def rotation(hd: int) -> np.ndarray:
    h = hadamard(hd)
    if SIGNS[0]:
        h = h * np.random.default_rng(hd).choice([-1.0, 1.0], hd).astype(np.float32)[None, :]
    return h


def quant_keys(k: np.ndarray, per_channel: bool) -> np.ndarray:
    hd = k.shape[-1]
    h = rotation(hd)
    r = k @ h.T
    off = block_means(r)
    x = r - off
    if per_channel:
        n = x.shape[0]
        pad = (-n) % BLOCK
        xp = np.concatenate([x, np.zeros((pad, *x.shape[1:]), np.float32)]) if pad else x
        cols = xp.reshape(-1, BLOCK, *x.shape[1:]).transpose(0, 2, 3, 1)  # [blocks, H, d, 32]
        y = q4_fitted(cols).transpose(0, 3, 1, 2).reshape(-1, *x.shape[1:])[:n]
    else:
        y = quant_rows(x)
    out = (y + off) @ h
    if SINK_KEY[0]:
        out[:1] = k[:1]
    return out


def quant_values(v: np.ndarray) -> np.ndarray:
    h = rotation(v.shape[-1])
    r = v @ h.T
    off = block_means(r) if VALUE_OFFSETS[0] else 0.0
    return (quant_rows(r - off) + off) @ h


def query_aware_scales(q: np.ndarray, k: np.ndarray, power: float) -> np.ndarray:
    """Per KV head and channel (after RoPE), (rms(q) / rms(k)) ** power, geometric mean 1:
    the weighted error sum(q_i^2 dk_i^2) is least for isotropic noise on k * s with s^2 ~ |q_i| / |k_i| (power
    0.5)."""
    n_kv, hd = k.shape[1], k.shape[2]
    qg = q.reshape(q.shape[0], n_kv, -1, hd)
    wq = np.sqrt(np.mean(qg.astype(np.float64) ** 2, axis=(0, 2)))  # [n_kv, hd]
    wk = np.sqrt(np.mean(k.astype(np.float64) ** 2, axis=0)) + 1e-6
    return unit_geomean((wq / wk) ** power)


def unit_geomean(s: np.ndarray) -> np.ndarray:
    """Scales [n_kv, hd] divided by each KV head's geometric mean, as [1, n_kv, hd] f32."""
    return (s / np.exp(np.mean(np.log(s), axis=1, keepdims=True)))[None].astype(np.float32)


class SimCalibration(SequentialCalibration):
    variant = "f16"

    def _attention(self, st, il):  # (the parent's, with the keys' bias term at hand for kbias)
        self._il = il
        return super()._attention(st, il)

    def _weight_scales(self, power: float, unbiased: bool) -> np.ndarray:
        """query_aware_scales from the weights alone, as an engine could make them at load: each q and k channel's
        RMS for an isotropic normed input (the row norms of W * attn_norm, with the bias), the query heads of a
        group pooled and each RoPE pair's two channels pooled (RoPE turns their energy between them)."""
        s, ly = self.spec, self.spec["layers"][self._il]
        n_kv, hd = s["n_head_kv"], s["head_dim"]
        g = self._w(ly["attn_norm"])

        def energy(wn: str, bn: str | None, heads: int) -> np.ndarray:
            w = self._w(ly[wn]).astype(np.float64) * g[None, :]
            e = np.sum(w * w, axis=1)
            if bn and ly.get(bn):
                e = e + self._w(ly[bn]).astype(np.float64) ** 2
            e = e.reshape(n_kv, heads // n_kv, hd).mean(axis=1)
            rd = s["rope_dims"]
            if s["rope_neox"]:
                a, b = e[:, : rd // 2], e[:, rd // 2 : rd]
                e[:, : rd // 2] = e[:, rd // 2 : rd] = (a + b) / 2
            else:
                e[:, 0:rd:2] = e[:, 1:rd:2] = (e[:, 0:rd:2] + e[:, 1:rd:2]) / 2
            return np.sqrt(e)

        return unit_geomean((energy("wq", "bq", s["n_head"]) / (energy("wk", None if unbiased else "bk", n_kv) + 1e-12))
                            ** power)

    def _roped_key_bias(self, k: np.ndarray) -> np.ndarray | float:
        """The layer's key bias roped to each position (as k [n, Hkv, d]), or 0.0 for a layer without one."""
        ly = self.spec["layers"][self._il]
        if not ly.get("bk"):
            return 0.0
        b = self._w(ly["bk"]).reshape(1, k.shape[1], k.shape[2])
        pos = np.arange(k.shape[0], dtype=np.float64)
        return rope(np.broadcast_to(b, k.shape).copy(), pos, base=ly["rope_base"], freq_scale=ly["rope_freq_scale"],
                    dims=self.spec["rope_dims"], neox=self.spec["rope_neox"])

    def _causal_attention(self, q, k, v, window):
        var = self.variant
        if var.endswith("+q8q"):  # the queries as the CPU engine's integer dots read them
            var = var.removesuffix("+q8q")
            q = quant_queries(q.astype(np.float32))
        SINK_KEY[0] = var.endswith("+s")
        MIDRANGE[0], SIGNS[0], IQ4[0], Q8[0] = "mid" in var, "signs" in var, "iq4" in var, "c8" in var
        POW2[0] = "p2" in var
        var = var.removesuffix("+s")
        for mod in ("mid", "signs", "iq4", "c8", "p2"):
            var = var.replace(mod, "")
        var = var or "cache"
        SINK_OFFSET[0] = var.startswith("off0")
        if SINK_OFFSET[0]:
            var = var[5:] or "cache"  # off0 / off0-konly / off0-vonly
        k16, v16 = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
        if var.startswith("qaw"):  # keys scaled per channel by the queries' and keys' RMS before quantizing
            unbias = var.endswith("kbias")  # (qawkbias: the key bias out first, as kbias)
            rb = self._roped_key_bias(k16) if unbias else 0.0
            weights = var[3:].startswith("W")  # (qawW...: the scales from the weights alone)
            power = float(var[3:].removesuffix("kbias").lstrip("W") or "0.5")
            s = self._weight_scales(power, unbias) if weights else query_aware_scales(q, k16 - rb, power)
            if POW2[0]:  # (scales a power of two: exact when folded into the weights' block scales)
                s = np.exp2(np.round(np.log2(s))).astype(np.float32)
            kq = quant_keys((k16 - rb) * s, False) / s + rb
            if SINK_KEY[0]:
                kq[:1] = k16[:1]
            return super()._causal_attention(q, kq, quant_values(v16), window)
        if var == "f16":
            return super()._causal_attention(q, k16, v16, window)
        if var == "l0k16" or var.startswith("k16at"):  # one layer's keys kept (the first; k16atN: layer N)
            keep = 0 if var == "l0k16" else int(var[5:])
            kq = k16 if self._il == keep else quant_keys(k16, False)
            if SINK_KEY[0]:
                kq[:1] = k16[:1]
            return super()._causal_attention(q, kq, quant_values(v16), window)
        if var == "kbias" or (var == "l0bias" and self._il == 0):
            rb = self._roped_key_bias(k16)
            kq = quant_keys(k16 - rb, False) + rb
            return super()._causal_attention(q, kq, quant_values(v16), window)
        if var.startswith("sink"):  # the first N positions (the attention sink) kept f16, the rest as the cache
            n = int(var[4:].rstrip("kv"))
            kq, vq = quant_keys(k16, False), quant_values(v16)
            if not var.endswith("v"):
                kq[:n] = k16[:n]
            if not var.endswith("k"):
                vq[:n] = v16[:n]
            return super()._causal_attention(q, kq, vq, window)
        kq = quant_keys(k16, var == "kchan") if var != "vonly" else k16  # (l0bias past layer 0: the cache)
        vq = quant_values(v16) if var != "konly" else v16
        return super()._causal_attention(q, kq, vq, window)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--variants", default="f16,cache,kbias,kchan,konly,vonly")
    ap.add_argument("--offset-block", type=int, default=256, help="positions a key offset covers")
    ap.add_argument("--value-offsets", action="store_true", help="values less their block's mean as well")
    a = ap.parse_args()
    OFFSET_BLOCK[0] = a.offset_block
    VALUE_OFFSETS[0] = a.value_offsets
    mf = ModelFile(a.model)
    tokens = Tokenizer.from_metadata(mf.metadata).encode(open(a.text, encoding="utf-8").read())
    chunks = [tokens[i * a.ctx : (i + 1) * a.ctx] for i in range(a.chunks)]
    ref, ref_logp = None, None
    for var in a.variants.split(","):
        SimCalibration.variant = var
        cal = SimCalibration(mf, chunks, gram_max_cols=0)
        logits = cal.logits().astype(np.float64)
        rows = np.concatenate([logits[c * a.ctx + a.ctx // 2 - 1 : (c + 1) * a.ctx - 1] for c in range(len(chunks))])
        nxt = np.concatenate([chunks[c][a.ctx // 2 : a.ctx] for c in range(len(chunks))])
        logp = rows - rows.max(axis=1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
        ppl = math.exp(-float(np.mean(logp[np.arange(len(nxt)), nxt])))
        if ref is None:  # (llama-perplexity scores the second half; KL and top-1 against the first variant)
            ref, ref_logp = ppl, logp
        kl = float(np.mean(np.sum(np.exp(ref_logp) * (ref_logp - logp), axis=1)))
        top1 = float(np.mean(ref_logp.argmax(axis=1) == logp.argmax(axis=1)))
        print(f"{var:6s} PPL {ppl:.4f} ({100 * (ppl / ref - 1):+.2f}%)  KL {kl:.5f}  top-1 {100 * top1:.1f}%", flush=True)


if __name__ == "__main__":
    main()
