"""GSQ-RCO conversion (`gsq-rco convert`, `ninfer convert`) and the `gsq-rco` command line (verify and inspect are
ninfer/gsq_file.py's, with the container's metadata).

The converter streams: one tensor at a time is read from the memory-mapped input, dequantized (Rust), quantized
to GSQ-RCO (Rust, multithreaded) and written, so peak memory is a small multiple of the largest tensor, never the
model. It writes `OUT.partial` and renames it to OUT only when complete; the input is only read.

A GSQ-RCO tensor is stored as a raw I8 tensor of its records ([rows, row_bytes]); its logical shape, layout,
statistics and a BLAKE2b checksum sit in the metadata key `gsq.tensor.<name>` (JSON). Tensors kept in their source
type get a checksum too. The metadata is written before the data, so each JSON is first a fixed-width placeholder
and is filled in place once its tensor is written (before the rename), then the checksum of the gsq.* metadata
(gsq_file.py writes and reads the container). docs/gsq-rco.md specifies the format.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType

from ninfer import _core
from ninfer.config import MAX_THREADS
from ninfer.cli import EXIT_USAGE
from ninfer.errors import InvalidArgumentError, ModelFileError, NinferError, read_text_file
from ninfer.gsq_file import GROUP, add_container_metadata, checksum, fill_tensor_infos, inspect_table, verify
from ninfer.gsq_plan import (DEFAULT_SIZE, SIZE_PRESETS, Policy, allocate, budget_bytes,
                             default_policy, fixed_policy, measure, parse_size, parse_tensor_types, policy_bytes,
                             quick_importances, target_bytes)
from ninfer.quant_mix import aligned

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


def _calibration_chunks_of(tokens: list[int], n_ctx: int, max_chunks: int) -> list[list[int]]:
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
    chunks = _calibration_chunks_of(llm.tokenize(text), n_ctx, max_chunks)
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


def _read_calib_text(path: str | os.PathLike[str]) -> str:
    return read_text_file(path, "calibration text", InvalidArgumentError)


def convert(inp: str | os.PathLike[str], out: str | os.PathLike[str], *, size: str | float | None = DEFAULT_SIZE,
            group: int = 128, residual_bits: int = 8, steps: int = 100, threads: int = 0, seed: int = 0,
            tensor_types: Sequence[str] = (),
            calib_file: str | os.PathLike[str] | None = BUILTIN_CALIBRATION, calib_chunks: int = CALIB_CHUNKS,
            importances_file: str | os.PathLike[str] | None = None,
            save_importances: str | os.PathLike[str] | None = None, feedback: bool | None = None,
            feedback_damp: float = 0.1, feedback_wide: bool = False, feedback_order: str = "in",
            sequential: bool | None = None, asymmetric: bool = False, log: Callable[[str], None] | None = None,
            verbose: bool = False) -> dict[str, Any]:
    """Convert a GGUF model to GSQ-RCO.

    `size` (a preset of SIZE_PRESETS, llama-quantize's mixture names, or bits per weight; None: the per-kind
    default policy) sets the byte budget, and each tensor's treatment is chosen by measured error within it
    (gsq_plan.py); `tensor_types` overrides (REGEX=TYPE) fix the tensors they match. With `calib_file` (the
    built-in text by default; None: no calibration, every weight counts alike), each weight's error is weighted by
    its input column's mean squared activation over that text, and with `feedback` (default: on when there is a
    text) quantized with GPTQ-style error feedback from each input's X^T X. With `sequential` (default: with
    `feedback`), each matrix's statistics come from the text run through the model with every matrix before it
    already quantized (gsq_sequential.py), and the tensors are written in that order; with `asymmetric` too, each
    matrix is fitted to the source model's outputs from those inputs (gsq_sequential.asymmetric_target).
    `importances_file` (from `save_importances`) replaces the text's mean squares (and so the feedback).
    Returns totals (bytes, bpw, weighted errors, seconds)."""
    import gguf

    from ninfer.gsq_sequential import asymmetric_target
    from ninfer.model_file import ModelFile

    if residual_bits != 8:
        raise InvalidArgumentError(f"--residual-bits {residual_bits} is not supported (format version 2 stores 8)")
    if group != GROUP:
        raise InvalidArgumentError(f"--group-size {group}: format version 2 has {GROUP}-weight records "
                                   "(16-weight sub-blocks inside)")
    if steps < 0:
        raise InvalidArgumentError(f"--calibration-steps must be >= 0, got {steps}")
    if not 0 <= threads <= MAX_THREADS:
        raise InvalidArgumentError(f"--threads must be in 0..{MAX_THREADS} (0: all cores), got {threads}")
    if not 0 <= seed < 2**32:  # (stored as gsq.seed, a u32)
        raise InvalidArgumentError(f"--seed must be in 0..{2**32 - 1}, got {seed}")
    if calib_chunks < 1:
        raise InvalidArgumentError(f"--calib-chunks must be >= 1, got {calib_chunks}")
    size = None if size is None else parse_size(size)
    if importances_file is not None:
        calib_file = None  # (saved importances stand for the text)
    if feedback is None:
        feedback = calib_file is not None
    if sequential is None:
        sequential = feedback
    src, dst = Path(inp), Path(out)
    if src.resolve() == dst.resolve():
        raise InvalidArgumentError("the output would overwrite the input")
    # Before any work (calibration can take minutes): the output's folder must exist and take new files.
    folder = dst.parent  # (Path("o.gguf").parent is Path("."))
    if not folder.is_dir():
        raise InvalidArgumentError(f"{dst}: the output's folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"{dst}: the output's folder {folder} is not writable")
    if dst.is_dir():  # (the rename at the end would fail after all the work)
        raise InvalidArgumentError(f"{dst}: the output is a folder; give a file name")
    threads = threads or max(1, len(os.sched_getaffinity(0)))
    overrides = parse_tensor_types(list(tensor_types))
    mf = ModelFile(src)
    md = mf.metadata
    arch = md.get("general.architecture", "llama")
    n_layer = int(md.get(f"{arch}.block_count", 0))
    log = log or (lambda s: None)
    importances: dict[str, np.ndarray] = {}
    grams: dict[str, list[np.ndarray]] = {}
    calib_tokens = 0
    if feedback and calib_file is None:
        raise InvalidArgumentError("--gptq needs a calibration text (the inputs' X^T X comes from running the model)")
    if sequential and not feedback:
        raise InvalidArgumentError("--gptq-sequential needs --gptq")
    if asymmetric and not sequential:
        raise InvalidArgumentError("--gptq-asymmetric needs --gptq-sequential")
    chunks: list[list[int]] = []
    if calib_file is not None:
        from ninfer.tokenizer import Tokenizer

        text = _read_calib_text(calib_file)
        chunks = _calibration_chunks_of(Tokenizer.from_metadata(md).encode(text), CALIB_CTX, calib_chunks)
        calib_tokens = sum(map(len, chunks))
    elif importances_file is not None:
        importances = _load_importances(importances_file, mf)
        calib_file = importances_file
    calibration = ("none" if calib_file is None else f"{Path(calib_file).name}, {calib_tokens} tokens"
                   if calib_tokens else f"importances from {Path(calib_file).name}")

    def begin(path: Path, plans: list[tuple[Any, Policy]]) -> Any:
        """A writer of `path` with the header of `plans` written."""
        w = gguf.GGUFWriter(str(path), arch)
        for key, value in md.items():
            if not key.startswith(("GGUF.", "general.architecture", "gsq.")):
                _copy_kv(w, key, value)
        add_container_metadata(w, [t.name for t, _ in plans], residual_bits=residual_bits, steps=steps, seed=seed,
                               calibration=calibration)
        for t, pol in plans:
            if pol.kind != "keep":
                cols, rows = t.dims
                row_bytes = target_bytes(cols, pol)
                w.add_tensor_info(t.name, (rows, row_bytes), np.dtype(np.int8 if pol.kind == "gsq" else np.uint8),
                                  rows * row_bytes, raw_dtype=gguf.GGMLQuantizationType.I8 if pol.kind == "gsq"
                                  else gguf.GGMLQuantizationType.Q2_K)
            else:
                outer = tuple(reversed(t.dims[1:]))  # the writer takes byte shapes for raw types: rows x row bytes
                shape = outer + (t.n_bytes // max(int(np.prod(outer)), 1),)
                w.add_tensor_info(t.name, shape, np.dtype(np.uint8), t.n_bytes,
                                  raw_dtype=gguf.GGMLQuantizationType(t.type_id))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        return w

    if chunks and not sequential:  # the one-pass statistics, before the plan: a size preset measures with them
        importances, _ = collect_importances(src, text, max_chunks=calib_chunks, threads=threads, log=log,
                                             grams=grams if feedback else None, wide=feedback_wide)
        if save_importances is not None:
            np.savez(save_importances, **importances)
    tmp = dst.with_name(dst.name + ".partial")
    plans = _plan(mf, overrides, size, n_layer, chunks, importances, threads=threads, log=log, verbose=verbose,
                  header_bytes=lambda: _header_bytes(begin, mf))
    seq = None
    if sequential:
        from ninfer.gsq_sequential import SequentialCalibration

        seq = SequentialCalibration(mf, chunks, gram_max_cols=GRAM_MAX_COLS,
                                    gram_block_cols=GRAM_BLOCK_COLS if feedback_wide else 0,
                                    source_stream=asymmetric, log=log)
        # the order in which the forward pass makes each matrix's statistics
        rank = {name: i for i, name in enumerate(seq.order())}
        plans.sort(key=lambda tp: rank.get(tp[0].name, len(rank)))

    infos: list[dict[str, Any]] = []
    totals = {"bytes": 0, "weights": 0, "weight": 0.0, "err": 0.0, "err_rtn": 0.0, "gsq_weights": 0}
    t0 = time.perf_counter()
    try:
        w = begin(tmp, plans)
        done_bytes, all_bytes = 0, sum(t.n_bytes for t, _ in plans)
        for t, pol in plans:
            info: dict[str, Any] = {"shape": list(t.dims)}
            if pol.kind != "keep":
                cols, rows = t.dims
                wf = mf.dequantized(t)
                if seq is not None and seq.reads(t.name):
                    importances[t.name], gram, cross = seq.stats(t.name)
                    if cross is not None:  # fit W* (source outputs from quantized inputs), then quantize that
                        wf = asymmetric_target(wf, gram, cross, feedback_damp)
                else:
                    gram = grams.pop(t.name, None)
                h = importances.get(t.name)
                if h is None or h.shape != (cols,):
                    h = np.ones(cols, np.float32)
                if pol.kind == "q2_k":  # importances only: the error feedback is written for GSQ-RCO records
                    data, st = _core.q2_k_quantize(wf, h, steps=steps, threads=threads)
                elif gram is not None:
                    data, st = quantize_with_feedback(wf, gram, bits=pol.bits, slots=pol.slots,
                                                      steps=steps, threads=threads, damp=feedback_damp,
                                                      order=feedback_order)
                else:
                    data, st = _core.gsq_quantize(wf, h, bits=pol.bits, slots=pol.slots, steps=steps,
                                                  threads=threads)
                del wf
                if seq is not None:
                    seq.set_weight(t.name, _dequantize_target(data, rows, cols, pol))
                bpw = 8 * data.size / (rows * cols)
                errs = dict(err=st["err"] / max(st["weight"], 1e-30), err_rtn=st["err_rtn"] / max(st["weight"], 1e-30))
                if pol.kind == "gsq":
                    info.update(type="GSQ-RCO", bits=pol.bits, slots=pol.slots, bpw=round(bpw, 4), **errs)
                else:
                    info.update(type="Q2_K", bpw=round(bpw, 4), **errs)
                for k in ("weight", "err", "err_rtn"):
                    totals[k] += st[k]
                totals["gsq_weights"] += rows * cols
            else:
                data = np.asarray(mf.raw(t))
                info.update(type=t.type_name, bpw=round(8 * t.n_bytes / max(t.n_elements, 1), 4))
            info["blake2b"] = checksum(data)
            w.write_tensor_data(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
            totals["bytes"] += data.size
            totals["weights"] += t.n_elements
            infos.append(info)
            done_bytes += t.n_bytes
            el = time.perf_counter() - t0
            if verbose and pol.kind != "keep":
                kind = f"{pol.bits}-bit  slots {pol.slots}" if pol.kind == "gsq" else "Q2_K"
                log(f"{t.name:32s} {info['bpw']:.3f} bpw  {kind}  "
                    f"weighted error {info['err_rtn']:.3e} -> {info['err']:.3e}")
            elif not verbose:
                eta = el / max(done_bytes, 1) * (all_bytes - done_bytes)
                log(f"[{done_bytes / all_bytes:6.1%}] {t.name}  {el:.1f} s elapsed, ETA {eta:.0f} s"
                    + (f" (forward pass {seq.seconds:.1f} s)" if seq is not None else ""))
        w.close()
        if seq is not None and save_importances is not None:
            np.savez(save_importances, **importances)
        fill_tensor_infos(tmp, infos)
        os.replace(tmp, dst)
    except OSError as e:  # a full disk, a vanished folder: the partial file goes, the input is untouched
        raise ModelFileError(f"{dst}: conversion stopped, nothing written: {e}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    totals["seconds"] = time.perf_counter() - t0
    totals["bpw"] = 8 * totals["bytes"] / max(totals["weights"], 1)
    return totals


def _header_bytes(begin: Callable[[Path, list[tuple[Any, Policy]]], Any], mf: Any) -> int:
    """The bytes before the tensor data of the file the converter writes (its header does not depend on the
    tensors' treatments: every matrix has two dims and a fixed-width JSON placeholder), by writing it once to a
    scratch folder (not beside the output, where a stopped conversion would leave it)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gsq-header-") as d:
        w = begin(Path(d) / "header.gguf", [(t, Policy("keep")) for t in mf.tensors])
        n = w.fout[0].tell()
        w.close()
    return aligned(n) + 64  # (+64: the calibration's token count may grow a digit)


def _plan(mf: Any, overrides: list[tuple[Any, Policy]], size: str | float | None, n_layer: int,
          chunks: list[list[int]], importances: dict[str, np.ndarray], *, threads: int,
          log: Callable[[str], None], verbose: bool, header_bytes: Callable[[], int]) -> list[tuple[Any, Policy]]:
    """Every tensor's treatment: an override's where one matches, else the size preset's choice by measured error
    within its budget (gsq_plan.allocate), or the per-kind default policy without a size."""
    fixed: dict[str, Policy] = {}
    free = []
    for t in mf.tensors:
        pol = next((p for rx, p in overrides if rx.search(t.name)), None)
        if pol is None and size is None:
            pol = default_policy(t.name, t.dims, n_layer)
        if pol is None:
            free.append(t)
        else:
            fixed[t.name] = fixed_policy(t, pol)
    if free:
        names = {t.name for t in mf.tensors}
        tied = "output.weight" not in names
        budget = budget_bytes(mf, size, header_bytes()) - sum(
            aligned(policy_bytes(t, fixed[t.name])) for t in mf.tensors if t.name in fixed)
        if chunks and not importances:
            importances = quick_importances(mf, chunks[:: max(1, len(chunks) // MEASURE_CHUNKS)][:MEASURE_CHUNKS],
                                            log)
        chosen = allocate(measure(mf, free, tied, importances, threads=threads, log=log), budget)
        for t in free:
            c = chosen[t.name]
            fixed[t.name] = c.policy
            if verbose:
                log(f"size {size}: {t.name:32s} {c.policy!s:8s} {8 * c.bytes / t.n_elements:.3f} bpw  "
                    f"measured error {c.err:.3e}")
    return [(t, fixed[t.name]) for t in mf.tensors]


def _dequantize_target(data: np.ndarray, rows: int, cols: int, pol: Policy) -> np.ndarray:
    """What the engine will read back from a converted tensor, [rows, cols] f32."""
    if pol.kind == "q2_k":
        return _core.dequantize(int(GGMLQuantizationType.Q2_K), data.tobytes(), rows * cols).reshape(rows, cols)
    return _core.gsq_dequantize(data.tobytes(), rows, cols, bits=pol.bits, slots=pol.slots)


def _copy_kv(w: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        if -(2**31) <= value < 2**32:
            (w.add_int32 if value < 0 else w.add_uint32)(key, value)
        else:
            (w.add_int64 if value < 0 else w.add_uint64)(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    elif isinstance(value, np.ndarray) and value.size:  # (numeric arrays come as numpy arrays: keep their type)
        from gguf import GGUFValueType

        w.add_key_value(key, value.tolist(), GGUFValueType.ARRAY,
                        sub_type=GGUFValueType[_GGUF_ARRAY_TYPES[value.dtype.name]])
    else:
        raise ModelFileError(f"cannot copy metadata {key} of type {type(value).__name__}")


# numpy dtype -> GGUF value type of a copied metadata array.
_GGUF_ARRAY_TYPES = {"uint8": "UINT8", "int8": "INT8", "uint16": "UINT16", "int16": "INT16", "uint32": "UINT32",
                     "int32": "INT32", "uint64": "UINT64", "int64": "INT64", "float32": "FLOAT32",
                     "float64": "FLOAT64", "bool": "BOOL"}


def _load_importances(path: str | os.PathLike[str], mf: Any) -> dict[str, np.ndarray]:
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


# ---- command line ------------------------------------------------------------------------------------------
def add_convert_args(p: Any) -> None:
    import argparse

    p.add_argument("--input", required=True, help="source GGUF (any supported type)")
    p.add_argument("--output", required=True, help="GSQ-RCO GGUF to write")
    p.add_argument("--group-size", type=int, default=GROUP, help=f"weights per record (format v2: {GROUP})")
    p.add_argument("--residual-bits", type=int, default=8, help="bits of a residual value (format v2: 8)")
    p.add_argument("--calibration-steps", type=int, default=100, help="RCO refinement steps per group (default 100)")
    p.add_argument("--threads", type=int, default=0, help="worker threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="recorded in the metadata; the quantizer is deterministic")
    p.add_argument("--size", default=DEFAULT_SIZE, metavar="SIZE",
                   help=f"the file's size: a llama-quantize mixture of this model ({', '.join(SIZE_PRESETS)}; default "
                        f"{DEFAULT_SIZE}) or bits per weight (e.g. 3.9); each tensor's treatment is chosen by measured "
                        "error within it. 'none': the per-kind default policy, no budget")
    p.add_argument("--tensor-type", action="append", default=[], metavar="REGEX=TYPE",
                   help="override a tensor's treatment: keep, q2_k or gsq[3|4][:SLOTS] (first match wins)")
    p.add_argument("--calib-file", default=None, metavar="TEXT",
                   help="calibration text: weigh errors by each input's mean squared activation over it (imatrix); "
                        "default: the built-in text (code, prose and other languages)")
    p.add_argument("--no-calib", action="store_true",
                   help="no calibration text: every weight counts alike (and no --gptq)")
    p.add_argument("--calib-chunks", type=int, default=CALIB_CHUNKS,
                   help=f"at most this many 512-token chunks of it, spread evenly over the text ({CALIB_CHUNKS})")
    p.add_argument("--save-importances", default=None, metavar="NPZ", help="keep --calib-file's importances here")
    p.add_argument("--importances", default=None, metavar="NPZ",
                   help="importances saved by --save-importances, instead of a calibration text (no --gptq)")
    p.add_argument("--gptq", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ-style error feedback from each input's X^T X over the calibration text (inputs up to "
                        f"{GRAM_MAX_COLS} wide; default: on with a calibration text)")
    p.add_argument("--gptq-damp", type=float, default=0.1,
                   help="--gptq: add this fraction of the mean diagonal to X^T X's diagonal (default 0.1, the best "
                        "measured with 4 and 16 calibration chunks; docs/gsq-rco.md)")
    p.add_argument("--gptq-wide", action="store_true",
                   help=f"--gptq also for wider inputs (ffn_down), within diagonal blocks of X^T X at most "
                        f"{GRAM_BLOCK_COLS} columns wide")
    p.add_argument("--gptq-order", choices=("in", "act"), default="in",
                   help="--gptq: the order the 128-column groups are quantized and fed back in: in (column order) or "
                        "act (the groups with the largest X^T X diagonal first, GPTQ's act-order by whole records)")
    p.add_argument("--gptq-sequential", action=argparse.BooleanOptionalAction, default=None,
                   help="--gptq: take each matrix's X^T X from the calibration text run through the model with the "
                        "matrices before it already quantized (GPTQ's order), not from the source model (default: "
                        "on with --gptq)")
    p.add_argument("--gptq-asymmetric", action="store_true",
                   help="--gptq-sequential: fit each matrix to the source model's outputs from the quantized model's "
                        "inputs (runs the source model alongside: twice the forward work)")
    p.add_argument("--verbose", action="store_true", help="a line per tensor: bpw, sparsity, weighted error")


def run_convert(args: Any) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through convert(), whose cleanup removes OUT.partial

    # A terminated conversion (kill, a batch system's time limit) leaves neither OUT nor OUT.partial behind.
    signal.signal(signal.SIGTERM, stop)

    if args.no_calib and args.calib_file:
        raise InvalidArgumentError("--no-calib and --calib-file contradict each other")
    calib_file = None if args.no_calib else args.calib_file or BUILTIN_CALIBRATION
    r = convert(args.input, args.output, size=None if args.size.lower() == "none" else args.size,
                group=args.group_size, residual_bits=args.residual_bits,
                steps=args.calibration_steps, threads=args.threads, seed=args.seed, tensor_types=args.tensor_type,
                calib_file=calib_file, calib_chunks=args.calib_chunks, importances_file=args.importances,
                save_importances=args.save_importances, feedback=args.gptq,
                feedback_damp=args.gptq_damp, feedback_wide=args.gptq_wide, feedback_order=args.gptq_order,
                sequential=args.gptq_sequential, asymmetric=args.gptq_asymmetric, log=log,
                verbose=args.verbose)
    rel = r["err"] / max(r["weight"], 1e-30)
    rel_rtn = r["err_rtn"] / max(r["weight"], 1e-30)
    log(f"gsq-rco: wrote {args.output}: {r['bytes'] / 2**20:.1f} MiB, {r['bpw']:.3f} bits per weight, "
        f"GSQ-RCO weighted error {rel_rtn:.3e} (round to nearest) -> {rel:.3e}, {r['seconds']:.1f} s")
    return 0


EXIT_DAMAGED = 1  # gsq-rco verify: the file parses, but a checksum (tensor data or gsq.* metadata) does not match

VERIFY_HELP = """Recompute every checksum of a GSQ-RCO file: each tensor's bytes against its entry's blake2b, and the
gsq.* metadata against gsq.metadata_checksum (files written before that key: validated, not checksummed); every
entry is validated as the loader does (format version, bits, slots, shape against the stored records).

exit status:
  0  ok (printed on stdout)
  1  damaged: the first tensor, or the metadata, whose checksum does not match (printed on stdout)
  2  not a GSQ-RCO file, unreadable or malformed (a truncated file, a bad entry: one line on stderr naming the key),
     or a bad argument"""


def main(argv: list[str] | None = None) -> int:
    """`gsq-rco`: exit 0 done, 1 `verify` found a checksum mismatch, 2 a bad file or argument (as `ninfer`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="gsq-rco", description="GSQ-RCO 3-bit quantization of GGUF models.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="convert a GGUF model to GSQ-RCO")
    add_convert_args(c)
    v = sub.add_parser("verify", help="recompute the checksums: 'ok' (exit 0), a mismatch (1), a bad file (2)",
                       description=VERIFY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("--model", required=True)
    i = sub.add_parser("inspect", help="per-tensor table: type, bpw, code bits, slots, weighted error")
    i.add_argument("model")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "convert":
            return run_convert(args)
        if args.cmd == "verify":
            ok, msg = verify(args.model)
            print(msg)
            return 0 if ok else EXIT_DAMAGED
        print(inspect_table(args.model))
        return 0
    except (NinferError, OSError) as e:
        print(f"gsq-rco: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
