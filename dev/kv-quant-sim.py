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
- l0k16: as cache, the first layer's keys unquantized; l0bias: as cache, kbias in the first layer only
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
OFFSET_BLOCK = [256]  # positions a key offset covers (the plain cache's block: kv_block_size; a tiered cache: 64)
DIVISORS = np.array([-8.0, -7.75, -7.5, -7.25, -7.0, -6.75, -6.5, -6.25, -6.0], np.float32)


def hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(math.sqrt(n))


def q4_fitted(x: np.ndarray) -> np.ndarray:
    """x [..., 32] through q4_0 with the least-squares scale among DIVISORS (f16 scales), read back."""
    i = np.argmax(np.abs(x), axis=-1)[..., None]
    amax = np.take_along_axis(x, i, axis=-1)  # signed
    best, best_err = None, None
    for div in DIVISORS:
        d = (amax / div).astype(np.float16).astype(np.float32)
        inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0)
        q = np.clip(np.round(x * inv + 8), 0, 15)
        y = d * (q - 8)
        err = np.sum((x - y) ** 2, axis=-1, keepdims=True)
        if best is None:
            best, best_err = y, err
        else:
            take = err < best_err
            best = np.where(take, y, best)
            best_err = np.where(take, err, best_err)
    return best


def quant_rows(x: np.ndarray) -> np.ndarray:
    """[n, H, d] rows in q4_0 blocks along d."""
    n, h, d = x.shape
    return q4_fitted(x.reshape(n, h, d // BLOCK, BLOCK)).reshape(n, h, d)


def block_means(k: np.ndarray) -> np.ndarray:
    """Each cache block's mean key (position 0 left out of the first), per position: [n, H, d]."""
    out, B = np.empty_like(k), OFFSET_BLOCK[0]
    for b0 in range(0, k.shape[0], B):
        a = 1 if b0 == 0 and k.shape[0] > 1 else b0
        out[b0 : b0 + B] = k[a : b0 + B].mean(axis=0, keepdims=True)
    return out


def quant_keys(k: np.ndarray, per_channel: bool) -> np.ndarray:
    hd = k.shape[-1]
    h = hadamard(hd)
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
    return (y + off) @ h


def quant_values(v: np.ndarray) -> np.ndarray:
    h = hadamard(v.shape[-1])
    r = v @ h.T
    off = block_means(r) if VALUE_OFFSETS[0] else 0.0
    return (quant_rows(r - off) + off) @ h


class SimCalibration(SequentialCalibration):
    variant = "f16"

    def _attention(self, st, il):  # (the parent's, with the keys' bias term at hand for kbias)
        self._il = il
        return super()._attention(st, il)

    def _causal_attention(self, q, k, v, window):
        var = self.variant
        k16, v16 = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
        if var == "f16":
            return super()._causal_attention(q, k16, v16, window)
        if var == "l0k16":  # the first layer's keys kept, the rest as the cache
            kq = k16 if self._il == 0 else quant_keys(k16, False)
            return super()._causal_attention(q, kq, quant_values(v16), window)
        if var == "kbias" or (var == "l0bias" and self._il == 0):
            ly = self.spec["layers"][self._il]
            b = self._w(ly["bk"]).reshape(1, k.shape[1], k.shape[2]) if ly.get("bk") else None
            if b is not None:
                pos = np.arange(k.shape[0], dtype=np.float64)
                rb = rope(np.broadcast_to(b, k.shape).copy(), pos, base=ly["rope_base"],
                          freq_scale=ly["rope_freq_scale"], dims=self.spec["rope_dims"], neox=self.spec["rope_neox"])
                kq = quant_keys(k16 - rb, False) + rb
            else:
                kq = quant_keys(k16, False)
            return super()._causal_attention(q, kq, quant_values(v16), window)
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
    ref = None
    for var in a.variants.split(","):
        SimCalibration.variant = var
        cal = SimCalibration(mf, chunks, gram_max_cols=0)
        logits = cal.logits().astype(np.float64)
        nll = []
        for c, ids in enumerate(chunks):
            lg = logits[c * a.ctx : (c + 1) * a.ctx]
            for t in range(a.ctx // 2 - 1, a.ctx - 1):  # (llama-perplexity scores the second half)
                row = lg[t]
                m = row.max()
                nll.append(m + math.log(np.exp(row - m).sum()) - row[ids[t + 1]])
        ppl = math.exp(float(np.mean(nll)))
        ref = ref or ppl
        print(f"{var:6s} PPL {ppl:.4f} ({100 * (ppl / ref - 1):+.2f}%)", flush=True)


if __name__ == "__main__":
    main()
