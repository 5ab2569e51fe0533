#!/usr/bin/env python3
"""dev/gsq-importance-compare.py SRC.gguf IMP_REF.npz IMP_TEST.npz NAME[,NAME...]: h_ref-weighted error of GSQ-RCO 3-bit quantized with
h_ref and with h_test (do fewer calibration tokens lose quality?)."""
import sys
import numpy as np
from ninfer import _core
from ninfer.model_file import ModelFile
mf = ModelFile(sys.argv[1]); ref = np.load(sys.argv[2]); test = np.load(sys.argv[3])
for n in sys.argv[4].split(","):
    t = next(t for t in mf.tensors if t.name == n)
    cols, rows = t.dims
    w = mf.dequantized(t)
    h = ref[n].astype(np.float64)
    out = []
    for name, hq in (("ref", ref[n]), ("test", test[n]), ("ones", np.ones(cols, np.float32))):
        d, _ = _core.gsq_quantize(w, hq.astype(np.float32), bits=3, slots=0, steps=30, threads=2)
        q = _core.gsq_dequantize(d.tobytes(), rows, cols, bits=3, slots=0)
        out.append(f"{name} {float((h * (q - w) ** 2).sum() / (h * w * w).sum()):.3e}")
    print(n, " | ".join(out), flush=True)
