#!/usr/bin/env python3
"""Trial: incoherence processing (a random orthogonal rotation of a matrix's input space, QuIP#/QuaRot style) before
3-bit GSQ-RCO, against none: each matrix's relative output error tr(E H E^T)/tr(W H W^T) on the Gram matrix of
held-out calibration chunks, with and without GPTQ feedback."""
import numpy as np, time, sys
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1] / 'python'))
from ninfer.model_file import ModelFile
from ninfer.gsq_sequential import SequentialCalibration
from ninfer.tokenizer import Tokenizer
from ninfer.gsq_calibration import quantize_with_feedback, calibration_chunks, BUILTIN_CALIBRATION
from ninfer import _core

import os
mf = ModelFile(os.path.join(os.environ.get('NINFER_MODELS', os.path.expanduser('~/.cache/ninfer-models')), 'qwen2.5-coder-1.5b.gguf'))
toks = Tokenizer.from_metadata(mf.metadata).encode(BUILTIN_CALIBRATION.read_text())
chunks = calibration_chunks(toks, 512, 12)
fit, held = chunks[0::2], chunks[1::2]
L = int(sys.argv[1]) if len(sys.argv) > 1 else 8
names = [f'blk.{L}.attn_q.weight', f'blk.{L}.ffn_up.weight', f'blk.{L}.ffn_gate.weight', f'blk.{L}.attn_output.weight']
def grams(cs):
    seq = SequentialCalibration(mf, cs, gram_max_cols=4096)
    out = {}
    for n in seq.order():
        if n in names or not seq.reads(n):
            pass
        if seq.reads(n):
            st = seq.stats(n)
            if n in names:
                out[n] = st.grams[0].astype(np.float64)
        if len(out) == len(names):
            return out
g_fit, g_held = grams(fit), grams(held)
rng = np.random.default_rng(0)
def rel(w, q, h):
    e = (w - q).astype(np.float64)
    return float(np.einsum('ij,jk,ik->', e, h, e) / np.einsum('ij,jk,ik->', w.astype(np.float64), h, w.astype(np.float64)))
for n in names:
    t = next(t for t in mf.tensors if t.name == n)
    w = mf.dequantized(t)
    cols = w.shape[1]
    r, _ = np.linalg.qr(rng.standard_normal((cols, cols)))
    for label, W, Hf, Hh in (('plain', w, g_fit[n], g_held[n]),
                             ('rotated', (w @ r).astype(np.float32), r.T @ g_fit[n] @ r, r.T @ g_held[n] @ r)):
        h = np.ascontiguousarray(np.diag(Hf)).astype(np.float32)
        rec, _ = _core.gsq_quantize(np.ascontiguousarray(W), h, bits=3, slots=0, steps=16, threads=2)
        q = _core.gsq_dequantize(rec.tobytes(), W.shape[0], cols, bits=3, slots=0)
        rec2, _ = quantize_with_feedback(W, Hf.astype(np.float32), bits=3, slots=0, steps=16, threads=2, damp=0.1)
        q2 = _core.gsq_dequantize(rec2.tobytes(), W.shape[0], cols, bits=3, slots=0)
        print(f'{n:28s} {label:8s} RCO {rel(W, q, Hh):.3e}  GPTQ {rel(W, q2, Hh):.3e}', flush=True)
