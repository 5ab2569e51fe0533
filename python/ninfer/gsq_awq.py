"""Activation-aware scaling (AWQ) of the feed-forward down projections, folded into the up projections' rows.

A down projection reads silu(gate x) * (up x). Scaling its input column j by 1/s_j and its weight column j by s_j
changes nothing in exact arithmetic, but the quantizer then sees W diag(s): the columns fed by large activations are
stored larger within their 128-weight groups, so their relative rounding error shrinks, at the cost of the quiet
columns' (AWQ, Lin et al. 2023). The 1/s_j goes into row j of the up projection, which is linear in x: where that
matrix is kept in its source type (k-quants and the other block types store one f16 scale, and a minimum, per block
of one row), its rows are rescaled by multiplying those fields, exact up to their f16 rounding (2^-11 relative), so
no bits are spent and nothing is requantized.

s = E[x_j^2]^(alpha / 2), normalised to a geometric mean of 1, with alpha from ALPHAS chosen per matrix by the
importance-weighted error of quantizing W diag(s) on sampled rows (measured in W's own space: quantizing W diag(s)
with importances E[x^2] / s^2); alpha 0 (no scaling) where nothing beats it.
"""

from __future__ import annotations

import numpy as np

from ninfer import _core

ALPHAS = (0.0, 0.25, 0.5, 0.75)
SAMPLE_ROWS = 96  # rows of the matrix the choice of alpha is measured on (every row alike)
MEASURE_STEPS = 4  # RCO steps per measurement (the size presets' measurement uses as many)
MAX_SCALE = 16.0  # s within [1 / MAX_SCALE, MAX_SCALE]: the rescaled f16 block scales stay normal numbers

# Types whose rows can be rescaled in place: (block bytes, weights a block, byte offsets of the f16 fields every
# weight of the block is proportional to: the scale, and the minimum where there is one).
F16_FIELDS = {
    "Q4_0": (18, 32, (0,)), "Q4_1": (20, 32, (0, 2)), "Q5_0": (22, 32, (0,)), "Q5_1": (24, 32, (0, 2)),
    "Q8_0": (34, 32, (0,)), "Q4_K": (144, 256, (0, 2)), "Q5_K": (176, 256, (0, 2)), "Q6_K": (210, 256, (208,)),
}
ROW_SCALABLE = frozenset(F16_FIELDS) | {"F32", "F16"}


def scales_for(means: np.ndarray, alpha: float) -> np.ndarray:
    m = np.asarray(means, np.float64)
    m = np.maximum(m, 1e-12 * max(float(m.max()), 1e-30))
    s = m ** (alpha / 2)
    s /= np.exp(np.mean(np.log(s)))
    return np.clip(s, 1 / MAX_SCALE, MAX_SCALE).astype(np.float32)


def choose_scales(w: np.ndarray, means: np.ndarray, *, bits: int, slots: int,
                  threads: int) -> tuple[float, np.ndarray | None, dict[float, float]]:
    """(alpha, column scales or None for alpha 0, relative error per alpha) for w [rows, cols] whose input columns
    have mean squares `means`."""
    rows = np.unique(np.linspace(0, w.shape[0] - 1, min(SAMPLE_ROWS, w.shape[0])).astype(np.int64))
    sample = np.ascontiguousarray(w[rows], np.float32)
    h = np.asarray(means, np.float32)
    errs: dict[float, float] = {}
    best = (0.0, None)
    for alpha in ALPHAS:
        s = scales_for(means, alpha) if alpha else np.ones(w.shape[1], np.float32)
        _, st = _core.gsq_quantize(sample * s, h / (s * s), bits=bits, slots=slots, steps=MEASURE_STEPS,
                                   threads=threads)
        errs[alpha] = st["err"] / max(st["weight"], 1e-30)
        if errs[alpha] < errs[best[0]]:
            best = (alpha, s)
    return best[0], best[1], errs


def scale_grams(grams: list[np.ndarray], s: np.ndarray) -> list[np.ndarray]:
    """The diagonal blocks of X^T X for the inputs x / s."""
    out, c0 = [], 0
    for g in grams:
        n = g.shape[0]
        inv = 1.0 / s[c0 : c0 + n]
        out.append((g * inv[:, None] * inv[None, :]).astype(np.float32))
        c0 += n
    return out


def scale_rows(raw: np.ndarray, type_name: str, rows: int, cols: int, factors: np.ndarray) -> np.ndarray:
    """A tensor's stored bytes ([rows] x [cols] weights of `type_name`) with row r multiplied by factors[r]."""
    f = np.asarray(factors, np.float32)
    data = np.asarray(raw).view(np.uint8).reshape(-1)
    if type_name in ("F32", "F16"):
        dt = np.float32 if type_name == "F32" else np.float16
        w = data.view(dt).reshape(rows, cols).astype(np.float32) * f[:, None]
        return w.astype(dt).view(np.uint8).reshape(-1)
    if type_name not in F16_FIELDS:
        raise ValueError(f"rows of {type_name} cannot be rescaled in place")
    block_bytes, block_len, offsets = F16_FIELDS[type_name]
    blocks = data.reshape(rows, cols // block_len, block_bytes).copy()
    for o in offsets:
        d = np.ascontiguousarray(blocks[:, :, o : o + 2]).view(np.float16)[:, :, 0].astype(np.float32)
        scaled = (d * f[:, None]).astype(np.float16)
        if not np.all(np.isfinite(scaled)):
            raise ValueError(f"rescaling {type_name} rows overflows an f16 block scale")
        blocks[:, :, o : o + 2] = scaled[:, :, None].view(np.uint8)
    return blocks.reshape(-1)
