"""GSQ-RCO conversion (`gsq-rco convert`, `ninfer convert`; the command line is gsq_cli.py's, the calibration
gsq_calibration.py's).

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
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType

from ninfer import _core
from ninfer.config import MAX_THREADS
from ninfer.errors import InvalidArgumentError, ModelFileError
from ninfer.gsq_calibration import (BUILTIN_CALIBRATION, CALIB_CHUNKS, CALIB_CTX, GRAM_BLOCK_COLS, GRAM_MAX_COLS,
                                    MEASURE_CHUNKS, calibration_chunks_of, collect_importances, load_importances,
                                    quantize_with_feedback, read_calib_text)
from ninfer.gsq_awq import ROW_SCALABLE, choose_scales, scale_grams, scale_rows
from ninfer.gsq_file import GROUP, add_container_metadata, checksum, fill_tensor_infos
from ninfer.gsq_plan import (DEFAULT_SIZE, Policy, allocate, budget_bytes, counts_of, default_policy, fixed_policy,
                             hot_ids, measure, parse_size, parse_tensor_types, policy_bytes, quick_importances,
                             target_bytes)
from ninfer.quant_mix import aligned


def convert(inp: str | os.PathLike[str], out: str | os.PathLike[str], *, size: str | float | None = DEFAULT_SIZE,
            group: int = 128, residual_bits: int = 8, steps: int = 100, threads: int = 0, seed: int = 0,
            tensor_types: Sequence[str] = (),
            calib_file: str | os.PathLike[str] | None = BUILTIN_CALIBRATION, calib_chunks: int = CALIB_CHUNKS,
            importances_file: str | os.PathLike[str] | None = None,
            save_importances: str | os.PathLike[str] | None = None, feedback: bool | None = None,
            feedback_damp: float = 0.1, feedback_wide: bool = False, feedback_order: str = "in",
            sequential: bool | None = None, asymmetric: bool = False, act_scale: bool = False,
            log: Callable[[str], None] | None = None, verbose: bool = False) -> dict[str, Any]:
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
    With `act_scale` (and a text), a 3- or 4-bit down projection whose up projection is kept gets activation-aware
    column scales folded into that up projection's rows (gsq_awq.py).
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
    token_counts = None  # per token id over the whole calibration text: which embedding rows it looks up most
    if calib_file is not None:
        from ninfer.tokenizer import Tokenizer

        text = read_calib_text(calib_file)
        tokens = Tokenizer.from_metadata(md).encode(text)
        chunks = calibration_chunks_of(tokens, CALIB_CTX, calib_chunks)
        token_counts = np.bincount(np.asarray(tokens, np.int64), minlength=1)
        calib_tokens = sum(map(len, chunks))
    elif importances_file is not None:
        importances = load_importances(importances_file, mf)
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
            if pol.hot:  # a split embedding: one I8 tensor of ids and rows (model/embedding.rs)
                n = policy_bytes(t, pol)
                w.add_tensor_info(t.name, (n,), np.dtype(np.int8), n, raw_dtype=gguf.GGMLQuantizationType.I8)
            elif pol.kind != "keep":
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
                  header_bytes=lambda: _header_bytes(begin, mf), token_counts=token_counts)
    seq = None
    if sequential:
        from ninfer.gsq_sequential import SequentialCalibration

        seq = SequentialCalibration(mf, chunks, gram_max_cols=GRAM_MAX_COLS,
                                    gram_block_cols=GRAM_BLOCK_COLS if feedback_wide else 0,
                                    source_stream=asymmetric, log=log)
        # the order in which the forward pass makes each matrix's statistics
        rank = {name: i for i, name in enumerate(seq.order())}
        plans.sort(key=lambda tp: rank.get(tp[0].name, len(rank)))
    scaled_ups = _act_scale_pairs(mf, plans) if act_scale and chunks else {}
    if scaled_ups:  # each such up projection is written after its down projection, whose scales it takes
        ups = set(scaled_ups.values())
        by_name = {t.name: (t, pol) for t, pol in plans}
        plans = [tp for t, pol in plans if t.name not in ups
                 for tp in [(t, pol)] + ([by_name[scaled_ups[t.name]]] if t.name in scaled_ups else [])]
    up_factors: dict[str, np.ndarray] = {}

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
                s_cols = None
                if t.name in scaled_ups and t.name in importances:
                    info["awq_alpha"], s_cols, errs = choose_scales(wf, h, bits=pol.bits, slots=pol.slots,
                                                                    threads=threads)
                    if verbose:
                        log(f"{t.name:32s} activation-aware scales: error by alpha "
                            + ", ".join(f"{a:g} {e:.3e}" for a, e in errs.items()))
                if s_cols is not None:
                    wf = wf * s_cols
                    h = h / (s_cols * s_cols)
                    if gram is not None:
                        gram = scale_grams(gram, s_cols) if isinstance(gram, list) else \
                            scale_grams([gram], s_cols)[0]
                    up_factors[scaled_ups[t.name]] = 1.0 / s_cols
                if pol.hot:
                    data, st, wf_read = _split_embedding(mf, t, wf, h, pol.hot, token_counts, steps, threads)
                elif pol.kind == "q2_k":  # importances only: the error feedback is written for GSQ-RCO records
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
                    deq = wf_read if pol.hot else _dequantize_target(data, rows, cols, pol)
                    seq.set_weight(t.name, deq if s_cols is None else deq / s_cols)
                if pol.hot:
                    del wf_read
                bpw = 8 * data.size / (rows * cols)
                errs = dict(err=st["err"] / max(st["weight"], 1e-30), err_rtn=st["err_rtn"] / max(st["weight"], 1e-30))
                if pol.kind == "gsq":
                    info.update(type="GSQ-RCO", bits=pol.bits, slots=pol.slots, bpw=round(bpw, 4), **errs)
                elif pol.hot:
                    info.update(type="Q2_K", hot_rows=pol.hot, hot_type=t.type_name, bpw=round(bpw, 4), **errs)
                else:
                    info.update(type="Q2_K", bpw=round(bpw, 4), **errs)
                for k in ("weight", "err", "err_rtn"):
                    totals[k] += st[k]
                totals["gsq_weights"] += rows * cols
            else:
                data = np.asarray(mf.raw(t))
                if t.name in up_factors:  # (its down projection's activation-aware scales, folded in)
                    data = scale_rows(data, t.type_name, t.dims[1], t.dims[0], up_factors.pop(t.name))
                    info["rows_scaled"] = True
                info.update(type=t.type_name, bpw=round(8 * t.n_bytes / max(t.n_elements, 1), 4))
            info["blake2b"] = checksum(data)
            w.write_tensor_data(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
            totals["bytes"] += data.size
            totals["weights"] += t.n_elements
            infos.append(info)
            done_bytes += t.n_bytes
            el = time.perf_counter() - t0
            if verbose and pol.kind != "keep":
                kind = f"{pol.bits}-bit  slots {pol.slots}" if pol.kind == "gsq" else \
                    f"Q2_K, {pol.hot} rows {t.type_name}" if pol.hot else "Q2_K"
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
          log: Callable[[str], None], verbose: bool, header_bytes: Callable[[], int],
          token_counts: np.ndarray | None = None) -> list[tuple[Any, Policy]]:
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
            if pol.hot and not (t.name == "token_embd.weight" and "output.weight" in {u.name for u in mf.tensors}
                                and 0 < pol.hot < t.dims[1]):
                raise InvalidArgumentError(f"--tensor-type {t.name}=q2_k:{pol.hot}: hot rows are for an untied token "
                                           f"embedding, fewer than its {t.dims[-1]} rows")
            fixed[t.name] = fixed_policy(t, pol)
    if free:
        names = {t.name for t in mf.tensors}
        tied = "output.weight" not in names
        budget = budget_bytes(mf, size, header_bytes()) - sum(
            aligned(policy_bytes(t, fixed[t.name])) for t in mf.tensors if t.name in fixed)
        if chunks and not importances:
            importances = quick_importances(mf, chunks[:: max(1, len(chunks) // MEASURE_CHUNKS)][:MEASURE_CHUNKS],
                                            log)
        chosen = allocate(measure(mf, free, tied, importances, threads=threads, log=log, token_counts=token_counts),
                          budget)
        for t in free:
            c = chosen[t.name]
            fixed[t.name] = c.policy
            if verbose:
                log(f"size {size}: {t.name:32s} {c.policy!s:8s} {8 * c.bytes / t.n_elements:.3f} bpw  "
                    f"measured error {c.err:.3e}")
    return [(t, fixed[t.name]) for t in mf.tensors]


def _act_scale_pairs(mf: Any, plans: list[tuple[Any, Policy]]) -> dict[str, str]:
    """{down projection: up projection} where the down projection is quantized and the up projection kept in a
    type whose rows can be rescaled in place (gsq_awq.py)."""
    pol = {t.name: p for t, p in plans}
    types = {t.name: t.type_name for t, _ in plans}
    out = {}
    for ly in mf.spec["layers"]:
        down, up = ly.get("w_down"), ly.get("w_up")
        if down in pol and up in pol and pol[down].kind == "gsq" and pol[up].kind == "keep" \
                and types[up] in ROW_SCALABLE:
            out[down] = up
    return out


def _split_embedding(mf: Any, t: Any, wf: np.ndarray, h: np.ndarray, n_hot: int, token_counts: np.ndarray | None,
                     steps: int, threads: int) -> tuple[np.ndarray, dict[str, float], np.ndarray]:
    """A split embedding's bytes (model/embedding.rs: the hot ids, their rows as the source stores them, the other
    rows as Q2_K), its statistics over the whole table (hot rows exact) and its values as the engine reads them."""
    cols, rows = t.dims
    ids = hot_ids(counts_of(token_counts, rows), n_hot)
    cold = np.ones(rows, bool)
    cold[ids] = False
    cold_data, st = _core.q2_k_quantize(np.ascontiguousarray(wf[cold]), h, steps=steps, threads=threads)
    hot_raw = np.asarray(mf.raw(t)).reshape(rows, -1)[ids]
    data = np.concatenate([ids.astype("<u4").view(np.uint8), hot_raw.reshape(-1).view(np.uint8),
                           cold_data.reshape(-1).view(np.uint8)]).view(np.int8)
    hot_weight = float((wf[ids].astype(np.float64) ** 2 * h).sum())
    st = {k: float(v) for k, v in st.items()}
    st["weight"] += hot_weight
    read = wf.copy()
    read[cold] = _core.dequantize(int(GGMLQuantizationType.Q2_K), cold_data.tobytes(),
                                  int(cold.sum()) * cols).reshape(-1, cols)
    return data, st, read


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
