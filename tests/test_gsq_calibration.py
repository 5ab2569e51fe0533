"""GSQ-RCO calibration: the text's chunks, each matrix's input statistics (mean squares, Gram matrices), and GPTQ
error feedback in the quantizer and the converter."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ninfer import _core
from ninfer.errors import InvalidArgumentError
from ninfer.gsq import convert
from ninfer.gsq_file import tensor_infos, verify


def test_calibration_chunks_are_spread_over_the_whole_text() -> None:
    from ninfer.gsq_calibration import calibration_chunks

    tokens = list(range(10 * 4 + 3))  # ten whole chunks of 4 tokens and a partial one (never used)
    assert calibration_chunks(tokens, 4, 3) == [tokens[0:4], tokens[12:16], tokens[24:28]]  # chunks 0, 3, 6
    assert calibration_chunks(tokens, 4, 10) == calibration_chunks(tokens, 4, 50) == [
        tokens[i : i + 4] for i in range(0, 40, 4)]
    assert calibration_chunks(tokens[:3], 4, 5) == []


def test_calibration_collects_each_matrix_inputs_mean_square(gsq_source: Path, tmp_path: Path) -> None:
    from ninfer.gsq_calibration import collect_importances

    text = "def f(x):\n    return x * 2 + 1\n" * 80  # byte-level tokens: well over one 512-token chunk
    imp, n_tokens = collect_importances(gsq_source, text, max_chunks=2, threads=2)
    assert n_tokens == 1024
    widths = {"attn_q": 896, "attn_k": 896, "attn_v": 896, "attn_output": 896, "ffn_gate": 896, "ffn_up": 896,
              "ffn_down": 4864}
    assert set(imp) == {f"blk.0.{k}.weight" for k in widths}
    for k, cols in widths.items():
        h = imp[f"blk.0.{k}.weight"]
        assert h.shape == (cols,) and (h >= 0).all() and h.mean() > 0
    # q, k and v read the same normed input.
    assert (imp["blk.0.attn_q.weight"] == imp["blk.0.attn_v.weight"]).all()
    out = tmp_path / "calibrated.gguf"
    calib = tmp_path / "calib.txt"
    calib.write_text(text)
    saved = tmp_path / "imp.npz"
    convert(gsq_source, out, steps=2, threads=2, calib_file=calib, calib_chunks=2, save_importances=saved, size=None,
            feedback=False)
    mf, infos = tensor_infos(out)
    assert mf.metadata["gsq.calibration"] == "calib.txt, 1024 tokens"
    assert verify(out) == (True, "ok")
    # Saved importances reproduce the calibrated conversion without running the model: the same tensor bytes.
    again = tmp_path / "again.gguf"
    convert(gsq_source, again, steps=2, threads=2, importances_file=saved, size=None)
    assert tensor_infos(again)[0].metadata["gsq.calibration"] == "importances from imp.npz"
    a, b = tensor_infos(out)[1], tensor_infos(again)[1]
    assert all(a[n]["blake2b"] == b[n]["blake2b"] for n in a)
    with pytest.raises(InvalidArgumentError, match=r"calib.txt: not an .npz of importances \(what --save-importan"):
        convert(gsq_source, tmp_path / "y.gguf", steps=1, importances_file=calib, size=None)
    # Importances that do not fit the model are named before any work (they were ignored, or quantized with).
    q = "blk.0.attn_q.weight"
    for bad, msg in (({q: np.ones(7, np.float32)}, f"importances for {q} have shape (7,), the matrix has 896"),
                     ({q: np.full(896, np.nan, np.float32)}, f"importances for {q} hold negative, NaN or infinite"),
                     ({q: -np.ones(896, np.float32)}, f"importances for {q} hold negative, NaN or infinite"),
                     ({"foo.weight": np.ones(3, np.float32)}, "no importances for any matrix of this model")):
        np.savez(tmp_path / "bad.npz", **bad)
        with pytest.raises(InvalidArgumentError, match=re.escape(msg)):
            convert(gsq_source, tmp_path / "y.gguf", steps=1, importances_file=tmp_path / "bad.npz", size=None)
    (tmp_path / "bin.txt").write_bytes(b"\x87\x00\xff" * 100)
    with pytest.raises(InvalidArgumentError, match="bin.txt: the calibration text is not UTF-8 \\(byte 0\\)"):
        convert(gsq_source, tmp_path / "y.gguf", steps=1, calib_file=tmp_path / "bin.txt", size=None, feedback=False)
    np.save(tmp_path / "one.npy", np.ones(3))
    with pytest.raises(InvalidArgumentError, match="one.npy: not an .npz of importances"):
        convert(gsq_source, tmp_path / "y.gguf", steps=1, importances_file=tmp_path / "one.npy", size=None)
    assert not (tmp_path / "y.gguf").exists()
    with pytest.raises(InvalidArgumentError, match="cannot read the calibration text"):
        convert(gsq_source, tmp_path / "x.gguf", steps=1, calib_file=tmp_path / "missing.txt", size=None,
                feedback=False)


def test_calibration_collects_each_input_gram_matrix(gsq_source: Path) -> None:
    from ninfer.gsq_calibration import GRAM_MAX_COLS, collect_importances

    text = "def f(x):\n    return x * 2 + 1\n" * 80
    grams: dict[str, list[np.ndarray]] = {}
    imp, _ = collect_importances(gsq_source, text, max_chunks=1, threads=2, grams=grams)
    # Every input up to GRAM_MAX_COLS wide (not ffn_down's 4864), one list per input (q, k and v share it).
    assert 4864 > GRAM_MAX_COLS
    assert set(grams) == {f"blk.0.{k}.weight" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                        "ffn_up")}
    assert grams["blk.0.attn_q.weight"] is grams["blk.0.attn_v.weight"]
    for name, (g,) in grams.items():
        assert g.shape == (896, 896) and np.array_equal(g, g.T)
        np.testing.assert_allclose(np.diag(g), imp[name], rtol=1e-4, atol=1e-7)  # diag(X^T X) / n = mean x^2
        assert np.linalg.eigvalsh(g.astype(np.float64)).min() > -1e-4 * np.abs(g).max()  # a Gram matrix


def test_wide_inputs_get_the_diagonal_blocks_of_their_gram_matrix(gsq_source: Path) -> None:
    from ninfer import gsq_calibration

    assert gsq_calibration.GRAM_BLOCK_COLS == 1792
    text = "def f(x):\n    return x * 2 + 1\n" * 80
    grams: dict[str, list[np.ndarray]] = {}
    imp, _ = gsq_calibration.collect_importances(gsq_source, text, max_chunks=1, threads=2, grams=grams, wide=True)
    # ffn_down's 4864 columns (38 groups): three blocks of 13, 13 and 12 groups, each the Gram matrix of its columns.
    blocks = grams["blk.0.ffn_down.weight"]
    assert [b.shape for b in blocks] == [(1664, 1664), (1664, 1664), (1536, 1536)]
    np.testing.assert_allclose(np.concatenate([np.diag(b) for b in blocks]), imp["blk.0.ffn_down.weight"],
                               rtol=1e-4, atol=1e-7)
    assert all(np.array_equal(b, b.T) for b in blocks)


def test_gptq_conversion_writes_a_valid_file_and_needs_a_calibration_text(gsq_source: Path, tmp_path: Path) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text("def f(x):\n    return x * 2 + 1\n" * 40)
    out = tmp_path / "fed.gguf"
    convert(gsq_source, out, steps=2, threads=2, calib_file=calib, calib_chunks=1, feedback=True, size=None,
            sequential=False)
    assert verify(out) == (True, "ok")
    plain = tmp_path / "plain.gguf"
    convert(gsq_source, plain, steps=2, threads=2, calib_file=calib, calib_chunks=1, size=None, feedback=False)
    a, b = tensor_infos(out)[1], tensor_infos(plain)[1]
    assert a["blk.0.attn_q.weight"]["blake2b"] != b["blk.0.attn_q.weight"]["blake2b"]  # fed back
    assert a["blk.0.ffn_down.weight"]["blake2b"] == b["blk.0.ffn_down.weight"]["blake2b"]  # too wide: as before
    wide = tmp_path / "wide.gguf"
    convert(gsq_source, wide, steps=2, threads=2, calib_file=calib, calib_chunks=1, feedback=True,
            feedback_wide=True, size=None, sequential=False)
    assert verify(wide) == (True, "ok")
    c = tensor_infos(wide)[1]
    assert c["blk.0.ffn_down.weight"]["blake2b"] != b["blk.0.ffn_down.weight"]["blake2b"]  # its diagonal blocks
    assert c["blk.0.attn_q.weight"]["blake2b"] == a["blk.0.attn_q.weight"]["blake2b"]
    with pytest.raises(InvalidArgumentError, match="--gptq needs a calibration text"):
        convert(gsq_source, tmp_path / "x.gguf", steps=1, feedback=True, size=None, calib_file=None, sequential=False)


def test_error_feedback_lowers_the_output_error_on_correlated_inputs() -> None:
    """GPTQ-style feedback (gsq_calibration.quantize_with_feedback) against quantizing with the inputs' mean squares
    alone: with correlated inputs, the later groups compensate the earlier ones' error in the layer's output."""
    from ninfer.gsq_calibration import quantize_with_feedback

    rng = np.random.default_rng(1)
    rows, cols, n = 64, 512, 2048
    mix = rng.standard_normal((cols, cols)).astype(np.float32) * 0.15 + np.eye(cols, dtype=np.float32)
    x = (rng.standard_normal((n, cols)).astype(np.float32) @ mix).astype(np.float32)
    gram = (x.T @ x / n).astype(np.float32)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)

    def out_err(rec: np.ndarray) -> float:
        q = _core.gsq_dequantize(rec.tobytes(), rows, cols, bits=3, slots=2)
        return float(np.sum(((w - q) @ x.T) ** 2) / np.sum((w @ x.T) ** 2))

    plain, _ = _core.gsq_quantize(w, np.diag(gram).copy(), bits=3, slots=2, steps=8, threads=2)
    fed, st = quantize_with_feedback(w, gram, bits=3, slots=2, steps=8, threads=2, damp=0.3)
    assert fed.shape == plain.shape and st["weight"] > 0
    assert out_err(fed) < 0.8 * out_err(plain), (out_err(fed), out_err(plain))
    # Diagonal blocks only (two of 256 columns): feedback within each block, still below the plain error.
    halves = [np.ascontiguousarray(gram[:256, :256]), np.ascontiguousarray(gram[256:, 256:])]
    fed2, _ = quantize_with_feedback(w, halves, bits=3, slots=2, steps=8, threads=2, damp=0.3)
    assert fed2.shape == plain.shape
    assert out_err(fed) <= out_err(fed2) < 0.9 * out_err(plain), (out_err(fed), out_err(fed2), out_err(plain))


def test_act_order_feedback_quantizes_the_strongest_groups_first_and_keeps_records_in_place() -> None:
    """order="act": the 128-column groups go through feedback by decreasing input energy (diag X^T X), each
    record stored at its own group's place. Without correlations there is nothing to feed back, so the records
    equal column order's byte for byte; with the energy in the last group, quantizing it first lowers the output
    error (the weaker groups then absorb its error)."""
    from ninfer.gsq_calibration import quantize_with_feedback

    rng = np.random.default_rng(2)
    rows, cols, n = 64, 512, 2048
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    diag = np.diag(np.repeat(np.array([1.0, 2.0, 0.5, 9.0], np.float32), 128))
    kw = dict(bits=3, slots=0, steps=8, threads=2, damp=0.1)
    a, _ = quantize_with_feedback(w, diag, order="act", **kw)
    b, _ = quantize_with_feedback(w, diag, order="in", **kw)
    assert (a == b).all()

    scale = np.repeat(np.array([1.0, 1.0, 1.0, 3.0], np.float32), 128)
    mix = rng.standard_normal((cols, cols)).astype(np.float32) * 0.15 + np.eye(cols, dtype=np.float32)
    x = ((rng.standard_normal((n, cols)).astype(np.float32) @ mix) * scale).astype(np.float32)
    gram = (x.T @ x / n).astype(np.float32)

    def out_err(rec: np.ndarray) -> float:
        q = _core.gsq_dequantize(rec.tobytes(), rows, cols, bits=3, slots=0)
        return float(np.sum(((w - q) @ x.T) ** 2) / np.sum((w @ x.T) ** 2))

    act, _ = quantize_with_feedback(w, gram, order="act", **kw)
    col, _ = quantize_with_feedback(w, gram, order="in", **kw)
    assert out_err(act) < 0.8 * out_err(col), (out_err(act), out_err(col))
