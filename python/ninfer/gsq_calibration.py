"""GSQ-RCO's calibration (`gsq-rco convert`'s --calib-file, --importances and --gptq): the calibration text's
chunks, each matrix's input statistics over them (mean squares, the importances, and X^T X for error feedback,
collected by the CPU engine in one pass of the source model; gsq_sequential.py takes them pass by pass instead),
a saved importances file checked against the model, and the GPTQ-style error-feedback quantization of a matrix
from its inputs' X^T X. gsq.py's converter uses them; docs/journal/gsq-rco-trials.md ("Error feedback") measures
the method.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ninfer import _core
from ninfer.errors import InvalidArgumentError, read_text_file
from ninfer.gsq_file import GROUP

# The built-in calibration text (mixed code, prose and other languages; scripts/make-calib-text wrote it), used
# when no --calib-file is given.
BUILTIN_CALIBRATION = Path(__file__).parent / "data" / "calibration.txt"
CALIB_CHUNKS = 36  # 512-token chunks: the most whose sequential pass fits the 1.5B's 15 minutes (docs/gsq-rco.md)
MEASURE_CHUNKS = 4  # of them, spread, give the size presets' input statistics

GRAM_MAX_COLS = 4096  # inputs up to this wide get their X^T X for error feedback (8960-wide: 321 MB each)
# With --gptq-wide, wider inputs get the diagonal blocks of X^T X, at most GRAM_BLOCK_COLS wide, and feedback
# within each block (ffn_down's 8960: five blocks of 1792, 64 MB a layer instead of 321 MB).
GRAM_BLOCK_COLS = 1792


CALIB_CTX = 512  # tokens a calibration chunk holds (llama-imatrix's default context)


def calibration_chunks(tokens: list[int], n_ctx: int, max_chunks: int) -> list[list[int]]:
    """The whole n_ctx-token chunks of a calibration text, at most max_chunks of them spread evenly over it: a
    text made of several files (code, then prose) is sampled from all of them, not only from its first file."""
    chunks = [tokens[i : i + n_ctx] for i in range(0, len(tokens) - n_ctx + 1, n_ctx)]
    if len(chunks) <= max_chunks:
        return chunks
    return [chunks[i * len(chunks) // max_chunks] for i in range(max_chunks)]


def calibration_chunks_of(tokens: list[int], n_ctx: int, max_chunks: int) -> list[list[int]]:
    """calibration_chunks, refusing a text shorter than one chunk."""
    chunks = calibration_chunks(tokens, n_ctx, max_chunks)
    if not chunks:
        raise InvalidArgumentError(f"the calibration text has {len(tokens)} tokens, fewer than one chunk of {n_ctx}")
    return chunks


def collect_importances(model: str | os.PathLike[str], text: str, *, n_ctx: int = CALIB_CTX, max_chunks: int = 32,
                        threads: int = 0, log: Callable[[str], None] | None = None,
                        grams: dict[str, list[np.ndarray]] | None = None,
                        wide: bool = False) -> tuple[dict[str, np.ndarray], int]:
    """Mean squared input of every matrix of `model` over `text` (chunks of n_ctx tokens, as llama-imatrix):
    GSQ-RCO's importances. Returns ({tensor name: per-column means}, tokens evaluated). With `grams` (a dict to
    fill), also each input's X^T X / rows as a list of its diagonal blocks (one for inputs up to GRAM_MAX_COLS
    wide, blocks of at most GRAM_BLOCK_COLS for wider ones with `wide`; matrices reading one input share the
    list)."""
    from ninfer.llm import LLM

    llm = LLM(model, n_ctx=n_ctx, threads=threads)
    chunks = calibration_chunks_of(llm.tokenize(text), n_ctx, max_chunks)
    eng = llm.backend  # (the CPU engine: it collects the statistics)
    eng.set_collect_act_stats(True)
    if grams is not None:
        eng.set_collect_grams(GRAM_MAX_COLS, GRAM_BLOCK_COLS if wide else 0)
    t0 = time.perf_counter()
    for i, chunk in enumerate(chunks):
        llm.eval_logits(chunk, rows=[])
        if log:
            log(f"calibration: chunk {i + 1}/{len(chunks)}, {time.perf_counter() - t0:.1f} s")
    eng.set_collect_act_stats(False)
    if grams is not None:
        eng.set_collect_grams(0)
        grams.update(eng.act_grams())
    return {name: np.asarray(means, np.float32) for name, (means, _) in eng.act_stats().items()}, \
        sum(len(c) for c in chunks)


def quantize_with_feedback(w: np.ndarray, gram: np.ndarray | list[np.ndarray], *, bits: int, slots: int, steps: int,
                           threads: int, damp: float, order: str = "in") -> tuple[np.ndarray, dict[str, float]]:
    """GSQ-RCO records of w [rows, cols] with GPTQ-style error feedback: the 128-column groups are quantized in
    order, and each group's error, through the Cholesky factor U of the inverse input Gram matrix (H^-1 = U^T U),
    is taken out of the columns not yet quantized (W_rest -= (W_g - Q_g) U_gg^-1 U_g,rest), so the layer's output
    error over the calibration inputs, not each weight's own error, is what the later groups compensate. A
    group's own quantization weighs its columns by diag((U_gg^T U_gg)^-1). Returns (records [rows, row bytes],
    summed quantizer statistics). `gram` may be a list of diagonal blocks in column order (the columns of each
    block fed back among themselves). order="act" takes the groups by decreasing input energy (X^T X's diagonal
    summed over the group) instead of left to right: GPTQ's act-order, by whole records, so the file's layout
    is unchanged; the strong inputs' groups are fitted first and the weak ones absorb their error."""
    if isinstance(gram, list):
        parts, stats, c0 = [], {"weight": 0.0, "err": 0.0, "err_rtn": 0.0}, 0
        for g in gram:
            rec, st = quantize_with_feedback(w[:, c0 : c0 + g.shape[0]], g, bits=bits, slots=slots, steps=steps,
                                             threads=threads, damp=damp, order=order)
            parts.append(rec)
            stats = {k: stats[k] + st[k] for k in stats}
            c0 += g.shape[0]
        if c0 != w.shape[1]:
            raise ValueError(f"Gram blocks cover {c0} of {w.shape[1]} columns")
        return np.concatenate(parts, axis=1), stats
    rows, cols = w.shape
    h = gram.astype(np.float64)
    dead = np.diag(h) <= 0
    w = np.array(w, np.float32)
    w[:, dead] = 0.0
    h[dead, dead] = 1.0
    h[np.diag_indices(cols)] += damp * float(np.mean(np.diag(h)))
    n_groups = cols // GROUP
    groups = np.arange(n_groups)  # groups[k]: the group quantized k-th
    if order == "act":  # groups with the most input energy first: the columns permuted group by group
        groups = np.argsort(-np.diag(h).reshape(n_groups, GROUP).sum(1), kind="stable")
        perm = (groups[:, None] * GROUP + np.arange(GROUP)).reshape(-1)
        h = h[np.ix_(perm, perm)]
        w = np.ascontiguousarray(w[:, perm])
    l_inv = np.linalg.inv(np.linalg.cholesky(h))
    u = np.linalg.cholesky(l_inv.T @ l_inv).T  # H^-1 = U^T U, U upper triangular
    rb = _core.gsq_row_bytes(GROUP, bits=bits, slots=slots)
    out = np.empty((rows, cols // GROUP * rb), np.uint8)
    stats = {"weight": 0.0, "err": 0.0, "err_rtn": 0.0}
    for k, g0 in enumerate(range(0, cols, GROUP)):
        g = slice(g0, g0 + GROUP)
        ug_inv = np.linalg.inv(u[g, g])
        imp = np.diag(ug_inv @ ug_inv.T).astype(np.float32)
        wg = np.ascontiguousarray(w[:, g])
        rec, st = _core.gsq_quantize(wg, imp, bits=bits, slots=slots, steps=steps, threads=threads)
        out[:, groups[k] * rb : (groups[k] + 1) * rb] = rec
        for key in stats:
            stats[key] += st[key]
        if g0 + GROUP < cols:
            q = _core.gsq_dequantize(rec.tobytes(), rows, GROUP, bits=bits, slots=slots)
            e = ((wg - q) @ ug_inv).astype(np.float32)
            w[:, g0 + GROUP :] -= e @ u[g, g0 + GROUP :].astype(np.float32)
    return out, stats


def read_calib_text(path: str | os.PathLike[str]) -> str:
    """A --calib-file's text (a missing or undecodable file: InvalidArgumentError naming it)."""
    return read_text_file(path, "calibration text", InvalidArgumentError)


def load_importances(path: str | os.PathLike[str], mf: Any) -> dict[str, np.ndarray]:
    """An importances .npz (tensor name -> mean squared activation per column), checked against the model before
    any work: a file for another model, wrong shapes or non-finite values used to be ignored or quantized with
    (a NaN gave NaN errors and a written file)."""
    not_npz = f"{path}: not an .npz of importances (what --save-importances writes)"
    try:
        z = np.load(path)
    except OSError as e:
        raise InvalidArgumentError(f"{path}: cannot read importances: {e.strerror or e}") from None
    except ValueError:  # (numpy's word for a file that is neither .npy nor .npz)
        raise InvalidArgumentError(not_npz) from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise InvalidArgumentError(not_npz)
    with z:
        importances = {k: np.asarray(z[k], np.float32) for k in z.files}
    cols = {t.name: t.dims[0] for t in mf.tensors if len(t.dims) == 2}
    matched = [k for k in importances if k in cols]
    if not matched:
        raise InvalidArgumentError(f"{path}: no importances for any matrix of this model (another model's file?)")
    for k in matched:
        v = importances[k]
        if v.shape != (cols[k],):
            raise InvalidArgumentError(f"{path}: importances for {k} have shape {v.shape}, the matrix has "
                                       f"{cols[k]} columns (another model's file?)")
        if not np.isfinite(v).all() or (v < 0).any():
            raise InvalidArgumentError(f"{path}: importances for {k} hold negative, NaN or infinite values")
    return importances
