#!/usr/bin/env python3
"""dev/gsq-sparsity.py SRC.gguf IMP.npz NAME[,NAME...]: what dynamic group sparsity would give in format v2.

Each tensor is quantized as the converter does (3-bit codes, no slots, 100 RCO steps, the calibrated importances
h), its records parsed, and every 16-weight sub-block's grid (levels d sc c - dmin m, c = 0..7) changed so that the
level nearest zero is exactly zero: weights then take the nearest level of that grid. Printed per tensor: the
h-weighted relative error as stored, with every weight on its grid's nearest level, with the zero level, and the share of weights that land on exactly zero (the
sparsity a zero level would give: weights a kernel could skip, for the price the error column shows).
"""
import sys

import numpy as np

from ninfer import _core
from ninfer.model_file import ModelFile

REC = 60  # bytes of a 3-bit record without slots (docs/gsq-rco.md, format v2)


def grids(rec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block (records x 8): scale step a = d sc and offset b = dmin m of the levels a c - b."""
    d = rec[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = rec[:, 2:4].copy().view(np.float16).astype(np.float32)
    sb = rec[:, 4:12].astype(np.float32)
    return d * (sb % 16), dmin * (sb // 16)


def main() -> int:
    mf = ModelFile(sys.argv[1])
    imp = np.load(sys.argv[2])
    print(f"{'tensor':28s} {'stored':>10s} {'nearest':>10s} {'zero level':>10s} {'sparsity':>9s}")
    for name in sys.argv[3].split(","):
        t = next(t for t in mf.tensors if t.name == name)
        cols, rows = t.dims
        w = mf.dequantized(t)
        h = imp[name].astype(np.float32)
        data, _ = _core.gsq_quantize(w, h, bits=3, slots=0, steps=100, threads=2)
        q = _core.gsq_dequantize(data.tobytes(), rows, cols, bits=3, slots=0)
        a, b = grids(data.reshape(-1, REC))  # [rows * cols / 128, 8]
        ws = w.reshape(-1, 8, 16)
        levels = a[..., None] * np.arange(8, dtype=np.float32) - b[..., None]  # [records, 8, 8]
        pick = np.argmin(np.abs(ws[..., None] - levels[:, :, None, :]), axis=-1)
        qn = np.take_along_axis(levels, pick, axis=-1).reshape(rows, cols)
        near0 = np.argmin(np.abs(levels), axis=-1)
        np.put_along_axis(levels, near0[..., None], 0.0, axis=-1)
        pick = np.argmin(np.abs(ws[..., None] - levels[:, :, None, :]), axis=-1)
        qz = np.take_along_axis(levels, pick, axis=-1).reshape(rows, cols)
        hw = (h * w * w).sum()
        e_stored = float((h * (q - w) ** 2).sum() / hw)
        e_near = float((h * (qn - w) ** 2).sum() / hw)
        e_zero = float((h * (qz - w) ** 2).sum() / hw)
        print(f"{name:28s} {e_stored:10.3e} {e_near:10.3e} {e_zero:10.3e} {float(np.mean(qz == 0.0)):9.2%}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
