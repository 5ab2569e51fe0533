#!/usr/bin/env python3
"""Per-tensor importance-weighted relative error, sum h (w - q)^2 / sum h w^2, of (1) a llama.cpp quantization of
the same source (REF.gguf: its tensor against the source's, dequantized), (2) GSQ-RCO layouts BITS/SLOTS
(format version 2, 30 RCO steps, the converter's quantizer), (3) a simulation of k-quant-like sub-scales for 3-bit codes: sub-blocks
of S weights with their own (scale, min), fitted by weighted least squares, both rounded to B bits against the
128-weight super-block's largest (kept in f16): SxB in the output. Importances from an .npz saved by
`gsq-rco convert --save-importances` (columns without one count 1).

Usage: dev/gsq-tensor-errors.py SRC.gguf REF.gguf IMPORTANCES.npz NAME[,NAME...] [BITS/SLOTS,...]
"""
import sys

import numpy as np

from ninfer import _core
from ninfer.model_file import ModelFile


def load(mf, name):
    t = next(t for t in mf.tensors if t.name == name)
    return t, mf.dequantized(t)


def sim(w, h, S, B, iters=6):
    rows, cols = w.shape
    sig2 = 2 * (w * w).mean(axis=1, keepdims=True)
    e = (h[None, :] * np.sqrt(sig2 + w * w)).reshape(-1, S)
    x = w.reshape(-1, S).astype(np.float64)
    lo, hi = x.min(1), x.max(1)
    mn, sc = lo, np.maximum((hi - lo) / 7, 1e-12)
    def assign(mn, sc):
        return np.clip(np.rint((x - mn[:, None]) / sc[:, None]), 0, 7)
    for _ in range(iters):
        q = assign(mn, sc)
        s0, s1, s2 = e.sum(1), (e*q).sum(1), (e*q*q).sum(1)
        t0, t1 = (e*x).sum(1), (e*q*x).sum(1)
        det = s0*s2 - s1*s1
        ok = det > 1e-20
        nsc = np.where(ok, (s0*t1 - s1*t0) / np.where(ok, det, 1), sc)
        nmn = np.where(ok, (t0 - nsc*s1) / s0, mn)
        good = nsc > 0
        sc, mn = np.where(good, nsc, sc), np.where(good, nmn, mn)
    # quantize sub-block scales / mins (min <= 0 as k-quants, stored as -min) to B bits per super-block of 128
    per = 128 // S
    scs, mns = sc.reshape(-1, per), np.minimum(mn, 0).reshape(-1, per)
    L = 2**B - 1
    dsc = scs.max(1, keepdims=True) / L; dmn = (-mns).max(1, keepdims=True) / L
    dsc = dsc.astype(np.float16).astype(np.float64); dmn = dmn.astype(np.float16).astype(np.float64)
    qsc = np.clip(np.rint(scs / np.where(dsc > 0, dsc, 1)), 1, L) * dsc
    qmn = -np.clip(np.rint(-mns / np.where(dmn > 0, dmn, 1)), 0, L) * dmn
    sc, mn = qsc.reshape(-1), qmn.reshape(-1)
    q = assign(mn, sc)
    deq = (mn[:, None] + q * sc[:, None]).reshape(rows, cols)
    bpw = 3 + 2 * B / S + 32 / 128
    return bpw, float((h * (deq - w) ** 2).sum() / (h * w * w).sum())

def main() -> None:
    src, ref, imp = ModelFile(sys.argv[1]), ModelFile(sys.argv[2]), np.load(sys.argv[3])
    layouts = [tuple(map(int, s.split("/"))) for s in (sys.argv[5] if len(sys.argv) > 5 else "3/0,3/2,3/6,4/2").split(",")]
    for n in sys.argv[4].split(","):
        t, w = load(src, n)
        r, q = load(ref, n)
        h = (imp[n] if n in imp.files else np.ones(w.shape[1], np.float32)).astype(np.float64)
        out = [f"{r.type_name} {8 * r.n_bytes / w.size:.2f}b {float((h * (q - w) ** 2).sum() / (h * w * w).sum()):.2e}"]
        for b, s in layouts:
            d, st = _core.gsq_quantize(w, h.astype(np.float32), bits=b, slots=s, steps=30, threads=2)
            out.append(f"{b}/{s} {8 * d.size / w.size:.2f}b {st['err'] / st['weight']:.2e}")
        for S, B in [(16, 4)] if "--sim" in sys.argv else []:
            bpw, err = sim(w, h, S, B)
            out.append(f"{S}x{B} {bpw:.2f}b {err:.2e}")
        print(n, t.type_name, " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
