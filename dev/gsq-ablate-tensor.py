#!/usr/bin/env python3
"""dev/gsq-ablate-tensor.py SRC.gguf IMP.npz NAME[,NAME...]: h-weighted error of v2 components: sub-block fit only (0 steps), + RCO (100 steps),
+ 2 slots, calibrated vs importances 1 (error always weighted by the calibrated h), and plain RTN."""
import sys
import numpy as np
from ninfer import _core
from ninfer.model_file import ModelFile
mf = ModelFile(sys.argv[1]); imp = np.load(sys.argv[2])
for n in sys.argv[3].split(","):
    t = next(t for t in mf.tensors if t.name == n)
    cols, rows = t.dims
    w = mf.dequantized(t)
    h = imp[n].astype(np.float32)
    def err(hq, slots, steps):
        d, st = _core.gsq_quantize(w, hq, bits=3, slots=slots, steps=steps, threads=1)
        q = _core.gsq_dequantize(d.tobytes(), rows, cols, bits=3, slots=slots)
        return float((h * (q - w) ** 2).sum() / (h * w * w).sum()), st["err_rtn"] / st["weight"]
    ones = np.ones(cols, np.float32)
    e0 = err(ones, 0, 0)[0]
    rtn = err(h, 0, 0)[1]
    out = [f"RTN g128 {rtn:.2e}", f"fit, h=1 {e0:.2e}", f"+RCO {err(ones, 0, 100)[0]:.2e}",
           f"+2 slots {err(ones, 2, 100)[0]:.2e}", f"+calibration {err(h, 2, 100)[0]:.2e}", f"calibrated, 0 slots {err(h, 0, 100)[0]:.2e}"]
    print(n, " | ".join(out), flush=True)
