"""GSQ-RCO: the format's round trip through the converter, checksums (verify), atomic writes, determinism, and the
Python bindings of the Rust quantizer."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from ninfer import _core
from ninfer.errors import InvalidArgumentError, ModelFileError
from ninfer.gsq import convert
from ninfer.gsq_file import inspect_table, tensor_infos, verify
from ninfer.model_file import ModelFile
from ninfer.synth import write_synthetic


@pytest.fixture(scope="module")
def source(gsq_source: Path) -> Path:
    return gsq_source  # (conftest's, shared with test_gsq_calibration.py)


@pytest.fixture(scope="module")
def converted(gsq_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gsq") / "out.gguf"
    convert(gsq_source, out, steps=4, threads=2, size=None, calib_file=None)
    return out


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_records_round_trip_and_dot_reference() -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 512)) * 0.02).astype(np.float32)
    h = rng.uniform(0.5, 1.5, 512).astype(np.float32)
    data, st = _core.gsq_quantize(w, h, bits=3, slots=2, steps=20, threads=2)
    assert data.shape == (16, 4 * 64) and data.dtype == np.uint8  # 64-byte records: 4 bits per weight
    back = _core.gsq_dequantize(data.tobytes(), 16, 512, bits=3, slots=2)
    err = float((h * (back - w) ** 2).sum())
    assert err == pytest.approx(st["err"], rel=1e-5)
    assert st["err"] < 0.5 * st["err_rtn"], st  # sub-block scales, RCO and the slots beat round-to-nearest
    x = rng.standard_normal(512).astype(np.float32)
    row = data[3].tobytes()
    assert _core.gsq_dot(row, x, bits=3, slots=2) == pytest.approx(float(back[3] @ x), rel=1e-4)
    # int8 activations, as the engine runs them: the kernel equals the scalar reference and is near the f32 dot
    simd, scalar = (_core.gsq_dot_q8(row, x, bits=3, slots=2, simd=s) for s in (True, False))
    assert simd == pytest.approx(scalar, rel=1e-5)
    assert simd == pytest.approx(float(back[3] @ x), abs=0.02 * float(np.abs(back[3] * x).sum()))


def test_quantizer_does_not_depend_on_thread_count() -> None:
    w = (np.random.default_rng(1).standard_normal((64, 256)) * 0.05).astype(np.float32)
    h = np.ones(256, np.float32)
    a, _ = _core.gsq_quantize(w, h, bits=4, slots=4, steps=10, threads=1)
    b, _ = _core.gsq_quantize(w, h, bits=4, slots=4, steps=10, threads=2)
    assert (a == b).all()


def test_bad_layouts_are_argument_errors() -> None:
    w = np.zeros((2, 256), np.float32)
    with pytest.raises(InvalidArgumentError, match="codes have 3 or 4 bits, got 2"):
        _core.gsq_quantize(w, np.ones(256, np.float32), bits=2, slots=2, steps=1, threads=1)
    with pytest.raises(InvalidArgumentError, match="must be even and at most 16, got 3"):
        _core.gsq_quantize(w, np.ones(256, np.float32), bits=3, slots=3, steps=1, threads=1)
    with pytest.raises(InvalidArgumentError, match="not a whole number of 128-weight"):
        _core.gsq_quantize(np.zeros((2, 200), np.float32), np.ones(200, np.float32), bits=3, slots=2, steps=1,
                           threads=1)
    with pytest.raises(ValueError, match="row bytes do not match"):
        _core.gsq_dot_q8(b"\0" * 10, np.ones(128, np.float32), bits=3, slots=2)


def test_converted_file_is_gguf_with_records_and_metadata(source: Path, converted: Path) -> None:
    r = gguf.GGUFReader(converted)
    by_name = {t.name: t for t in r.tensors}
    q = by_name["blk.0.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.I8
    assert list(q.shape) == [896 // 128 * (60 + 2 * 6), 896]  # layer 0: first layer, 6 slots
    assert by_name["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0  # kept
    _, infos = tensor_infos(converted)
    qi = infos["blk.0.attn_q.weight"]
    assert qi["type"] == "GSQ-RCO" and qi["shape"] == [896, 896] and qi["bits"] == 3 and qi["slots"] == 6
    assert mf_version(converted) == 2
    assert qi["err"] < qi["err_rtn"]
    # The records dequantize to the source weights within 3-bit error.
    src = ModelFile(source)
    ref = src.dequantized({t.name: t for t in src.tensors}["blk.0.attn_q.weight"])
    back = _core.gsq_dequantize(np.asarray(q.data).tobytes(), 896, 896, bits=3, slots=6)
    rel = float(((back - ref) ** 2).sum() / (ref**2).sum())
    assert rel == pytest.approx(qi["err"], rel=1e-3)
    assert 1e-3 < rel < 0.02
    assert "GSQ-RCO" in inspect_table(converted)


def test_verify_ok_then_names_a_flipped_byte_and_a_cut_file(converted: Path, tmp_path: Path) -> None:
    assert verify(converted) == (True, "ok")
    flipped = tmp_path / "flipped.gguf"
    data = bytearray(converted.read_bytes())
    t = {x.name: x for x in ModelFile(converted).tensors}["blk.0.ffn_down.weight"]
    data[t.offset + 100] ^= 0x40
    flipped.write_bytes(bytes(data))
    assert verify(flipped) == (False, "checksum mismatch: tensor blk.0.ffn_down.weight (layer 0)")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(converted.read_bytes()[: len(data) // 2])
    r = subprocess.run([sys.executable, "-m", "ninfer.gsq_cli", "verify", "--model", str(cut)], capture_output=True,
                       text=True)
    # A file too broken to parse is a bad file (2, as everywhere in ninfer); a parsed one that fails its checksums
    # is damaged (1).
    assert r.returncode == 2 and "runs past the end of the file" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "ninfer.gsq_cli", "verify", "--model", str(flipped)], capture_output=True,
                       text=True)
    assert r.returncode == 1 and r.stdout.strip() == "checksum mismatch: tensor blk.0.ffn_down.weight (layer 0)"


def test_metadata_checksum_is_written_and_checked(converted: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The converter writes gsq.metadata_checksum over the gsq.* keys; an entry changed afterwards (bits 3 -> 4,
    which a valid file could hold) is a damaged file to verify (exit 1) and refused by the loader; `verify --help`
    documents the exit codes."""
    from ninfer import gsq_cli
    from ninfer.gsq_file import metadata_checksum

    md = ModelFile(converted).metadata
    assert md["gsq.metadata_checksum"] == metadata_checksum(md)
    data = bytearray(converted.read_bytes())
    at = data.find(b'"bits":3')
    data[at + 7] = ord("4")
    edited = tmp_path / "edited.gguf"
    edited.write_bytes(bytes(data))
    assert verify(edited) == (False, "checksum mismatch: the gsq.* metadata (tensor entries, layouts, format keys)")
    assert gsq_cli.main(["verify", "--model", str(edited)]) == 1
    with pytest.raises(ModelFileError, match="gsq.metadata_checksum does not match the gsq.* metadata"):
        ModelFile(edited).tensors
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        gsq_cli.main(["verify", "--help"])
    assert e.value.code == 0
    assert re.search(r"exit status:\n  0  ok.*\n  1  damaged.*\n  2  not a GSQ-RCO file", capsys.readouterr().out)


def mf_version(path: Path) -> int:
    return int(tensor_infos(path)[0].metadata["gsq.version"])


def test_tensor_types_choose_bits_and_slots(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "mixed.gguf"
    convert(source, out, steps=2, threads=2, tensor_types=[r"ffn_down=gsq4:2", r"attn_q=gsq3:0", r"attn_k=keep"],
            size=None, calib_file=None)
    _, infos = tensor_infos(out)
    assert (infos["blk.0.ffn_down.weight"]["bits"], infos["blk.0.ffn_down.weight"]["slots"]) == (4, 2)
    assert infos["blk.0.ffn_down.weight"]["bpw"] == 5.0
    assert (infos["blk.0.attn_q.weight"]["bits"], infos["blk.0.attn_q.weight"]["bpw"]) == (3, 3.75)
    assert infos["blk.0.attn_k.weight"]["type"] == "Q8_0"
    assert infos["blk.0.ffn_down.weight"]["err"] < 0.5 * infos["blk.0.ffn_gate.weight"]["err"]
    assert verify(out) == (True, "ok")
    for bad in ("ffn_down=gsq5", "ffn_down=gsq:3", "ffn_down=keep:2", "ffn_down=q2_k:2", "(=gsq"):
        with pytest.raises(InvalidArgumentError, match="--tensor-type"):
            convert(source, tmp_path / "bad.gguf", steps=1, tensor_types=[bad], size=None, calib_file=None)
    with pytest.raises(InvalidArgumentError, match="128-weight records"):
        convert(source, tmp_path / "bad.gguf", steps=1, group=64, size=None, calib_file=None)


def test_version_1_files_are_refused(converted: Path, tmp_path: Path) -> None:
    data = bytearray(converted.read_bytes())
    key = b"gsq.version"
    at = data.find(key) + len(key) + 4  # then the u32 value type (4 bytes) and the value
    assert int.from_bytes(data[at : at + 4], "little") == 2
    data[at : at + 4] = (1).to_bytes(4, "little")
    old = tmp_path / "v1.gguf"
    old.write_bytes(bytes(data))
    from ninfer.errors import ModelFileError

    with pytest.raises(ModelFileError, match="format version 1 .this ninfer reads 2"):
        verify(old)


def test_conversion_is_deterministic(source: Path, converted: Path, tmp_path: Path) -> None:
    again = tmp_path / "again.gguf"
    convert(source, again, steps=4, threads=1, size=None, calib_file=None)
    assert sha256(again) == sha256(converted)


def test_failed_conversion_leaves_no_output_and_the_input_untouched(source: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    before = sha256(source)
    calls = {"n": 0}
    real = _core.gsq_quantize

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # the third matrix: two tensors are already written
            raise OSError("disk full (simulated)")
        return real(*a, **k)

    monkeypatch.setattr(_core, "gsq_quantize", failing)
    out = tmp_path / "out.gguf"
    with pytest.raises(ModelFileError, match=r"out\.gguf: conversion stopped, nothing written: disk full \(simulated\)"):
        convert(source, out, steps=2, threads=1, size=None, calib_file=None)
    assert not out.exists() and not (tmp_path / "out.gguf.partial").exists()
    assert sha256(source) == before


def test_cli_errors_name_the_problem(source: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "ninfer.gsq_cli", "convert", "--input", str(source), "--output",
                        str(tmp_path / "o.gguf"), "--residual-bits", "4"], capture_output=True, text=True)
    assert r.returncode == 2 and "--residual-bits 4 is not supported" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ninfer.gsq_cli", "verify", "--model", str(source)], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "not a GSQ-RCO file" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ninfer.cli", "convert", "--input", str(source), "--output",
                        str(source), "--threads", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "the output would overwrite the input" in r.stderr
    for flag, value, msg in (("--threads", "-3", "--threads must be in 0..512 (0: all cores), got -3"),
                             ("--threads", "1000000", "--threads must be in 0..512 (0: all cores), got 1000000"),
                             ("--calib-chunks", "0", "--calib-chunks must be >= 1, got 0"),
                             ("--seed", "-1", "--seed must be in 0..4294967295, got -1"),
                             ("--seed", str(2**32), f"--seed must be in 0..4294967295, got {2**32}")):
        r = subprocess.run([sys.executable, "-m", "ninfer.gsq_cli", "convert", "--input", str(source), "--output",
                            str(tmp_path / "o.gguf"), flag, value], capture_output=True, text=True)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
    # A missing output folder is named before any work, by both commands, without a traceback.
    missing = tmp_path / "no-such-folder" / "o.gguf"
    for mod in ("ninfer.cli", "ninfer.gsq_cli"):
        r = subprocess.run([sys.executable, "-m", mod, "convert", "--input", str(source), "--output", str(missing)],
                           capture_output=True, text=True)
        assert r.returncode == 2, (mod, r.stderr)
        assert f"the output's folder {missing.parent} does not exist" in r.stderr and "Traceback" not in r.stderr
    assert not missing.parent.exists()
    # An output that is a folder is named before any work too (it used to fail at the final rename).
    r = subprocess.run([sys.executable, "-m", "ninfer.gsq_cli", "convert", "--input", str(source), "--output",
                        str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and f"{tmp_path}: the output is a folder; give a file name" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "%" not in r.stderr  # (no progress bar: no work was done)


def test_gsq_model_runs_in_the_engine_close_to_its_source(source: Path, converted: Path) -> None:
    import ninfer

    tokens = [5, 77, 300, 1000, 20000]
    ref = ninfer.LLM(source, n_ctx=64, threads=1).eval_logits(tokens, rows=[4])
    llm = ninfer.LLM(converted, n_ctx=64, threads=1)
    assert {t.type_name for t in llm.model_file.tensors} >= {"GSQ-RCO", "Q8_0", "F32"}
    got = llm.eval_logits(tokens, rows=[4])
    nmse = float(((got - ref) ** 2).sum() / (ref**2).sum())
    # 3.75-4.5-bit weights of a random-weight model, int8 activations; a broken product is uncorrelated (NMSE ~2).
    assert nmse < 0.3, nmse
    assert llm.generate(tokens, max_tokens=4, temperature=0).completion_tokens >= 1


def test_kl_divergence_against_saved_reference(source: Path, converted: Path, tmp_path: Path) -> None:
    from ninfer.llm import LLM
    from ninfer.perplexity import perplexity

    text = "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n" * 3
    base = tmp_path / "base.npy"
    ref = perplexity(LLM(source, n_ctx=32, threads=2), text, n_ctx=16, n_chunks=2, kl_base_out=base)
    assert np.load(base, mmap_mode="r").shape == (2 * 7, 151936)
    same = perplexity(LLM(source, n_ctx=32, threads=2), text, n_ctx=16, n_chunks=2, kl_base=base)
    assert same.ppl == ref.ppl and same.kl == pytest.approx(0.0, abs=1e-6) and same.top1_agreement == 1.0
    q = perplexity(LLM(converted, n_ctx=32, threads=2), text, n_ctx=16, n_chunks=2, kl_base=base)
    assert q.kl is not None and q.kl > 1e-6 and 0.0 <= q.top1_agreement <= 1.0
    first = perplexity(LLM(source, n_ctx=32, threads=2), text, n_ctx=16, n_chunks=1, kl_base=base)
    assert first.kl == pytest.approx(0.0, abs=1e-6)  # the first chunks of a whole-text reference
    short = tmp_path / "short.npy"
    perplexity(LLM(source, n_ctx=32, threads=2), text, n_ctx=16, n_chunks=1, kl_base_out=short)
    with pytest.raises(InvalidArgumentError, match=r"short.npy: reference log-probabilities of shape \(7, 151936\), "
                                                   r"this run scores \(14, 151936\)"):
        perplexity(LLM(source, n_ctx=32, threads=2), text, n_ctx=16, n_chunks=2, kl_base=short)
    # Bad arguments are named before any chunk runs (they were tracebacks: numpy's, a division by zero).
    llm = LLM(source, n_ctx=32, threads=2)
    (tmp_path / "text.txt").write_text("not an array")
    np.savez(tmp_path / "z.npz", a=np.zeros(3))
    for kw, msg in ((dict(kl_base=tmp_path / "text.txt"), "text.txt: not a .npy file of log-probabilities"),
                    (dict(kl_base=tmp_path / "z.npz"), "z.npz: not a .npy file of log-probabilities"),
                    (dict(kl_base=tmp_path / "none.npy"), "cannot read the reference log-probabilities: No such"),
                    (dict(kl_base_out=tmp_path / "no" / "x.npy"), "cannot write the reference log-probabilities"),
                    (dict(n_chunks=0), "the number of chunks must be >= 1 (or -1: all of them), got 0"),
                    (dict(n_ctx=2), "perplexity context 2 is too small (at least 4 tokens)"),
                    (dict(n_ctx=64), "perplexity context 64 is larger than the model's n_ctx 32")):
        with pytest.raises(InvalidArgumentError, match=re.escape(msg)):
            perplexity(llm, text, **{"n_ctx": 16, **kw})
    assert perplexity(llm, text, n_ctx=16, n_chunks=-1).ppl == perplexity(llm, text, n_ctx=16).ppl  # -1: all


def test_q2_k_tensors_are_written_by_the_optimiser_and_run(source: Path, tmp_path: Path) -> None:
    """`--tensor-type REGEX=q2_k`: llama.cpp's Q2_K blocks from the GSQ-RCO optimiser (for a token embedding that
    tolerates 2.625 bits); a row that is no whole number of 256-weight blocks (the 0.5B shape's 896) stays as it is."""
    import ninfer
    from ninfer.model_file import ModelFile

    out = tmp_path / "q2k.gguf"
    convert(source, out, steps=4, threads=2, tensor_types=[r"ffn_down=q2_k", r"token_embd\.weight=q2_k"], size=None,
            calib_file=None)
    _, infos = tensor_infos(out)
    down = infos["blk.0.ffn_down.weight"]
    assert (down["type"], down["bpw"], down["shape"]) == ("Q2_K", 2.625, [4864, 896])
    assert infos["token_embd.weight"]["type"] == "Q8_0"  # 896 wide: kept
    assert verify(out) == (True, "ok")
    assert "Q2_K" in inspect_table(out)
    src, got = ModelFile(source), ModelFile(out)
    name = "blk.0.ffn_down.weight"
    t = next(t for t in got.tensors if t.name == name)
    assert t.type_name == "Q2_K"
    w = src.dequantized(next(t for t in src.tensors if t.name == name))
    q = got.dequantized(t)
    rel = float(((w - q) ** 2).sum() / (w**2).sum())
    assert rel == pytest.approx(down["err"], rel=1e-4)  # no calibration: the reported error is the plain one
    assert 0.02 < rel < 0.12, rel  # 2-bit codes on 16-weight sub-blocks; a wrong block layout reads back as noise
    llm = ninfer.LLM(out, n_ctx=64, threads=1)
    assert llm.generate([5, 77, 300], max_tokens=3, temperature=0).completion_tokens >= 1


def test_a_source_tensor_no_larger_than_its_layout_is_kept(tmp_path: Path) -> None:
    # Q4_0 takes 4.5 bits per weight: under 4-bit GSQ-RCO (4.75) it stays as it is (exact and smaller); under
    # 3-bit (3.75) it is converted.
    src = write_synthetic(tmp_path / "q4.gguf", "qwen2.5-0.5b", "Q4_0", n_layer=1, seed=5)
    out = tmp_path / "o.gguf"
    convert(src, out, steps=1, threads=2, tensor_types=[r"attn_q=gsq4:0", r"blk\..*=gsq3:0"], size=None,
            calib_file=None)
    _, infos = tensor_infos(out)
    assert infos["blk.0.attn_q.weight"]["type"] == "Q4_0"
    assert infos["blk.0.attn_k.weight"]["type"] == "GSQ-RCO" and infos["blk.0.attn_k.weight"]["bits"] == 3


def test_terminated_conversion_leaves_no_partial_file(source: Path, tmp_path: Path) -> None:
    import signal
    import time

    out = tmp_path / "t.gguf"
    partial = tmp_path / "t.gguf.partial"
    p = subprocess.Popen([sys.executable, "-m", "ninfer.gsq_cli", "convert", "--input", str(source), "--output",
                          str(out), "--threads", "1", "--calibration-steps", "100"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not partial.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert partial.exists(), "the conversion never started writing"
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=120)
    assert p.returncode != 0
    assert not out.exists() and not partial.exists()


@pytest.mark.parametrize("bits", [3, 4])
def test_synthetic_gsq_model_verifies_loads_and_decodes(tmp_path: Path, bits: int) -> None:
    """`ninfer synth --type GSQ3|GSQ4`: random version-2 records for every layer matrix, in the converter's
    container (checksums, per-tensor JSON), with centred weights of standard deviation about 1/sqrt(fan-in)."""
    import ninfer
    from ninfer.model_file import ModelFile

    path = write_synthetic(tmp_path / f"g{bits}.gguf", "qwen2.5-0.5b", f"GSQ{bits}", n_layer=2, seed=1)
    assert verify(path) == (True, "ok")
    mf = ModelFile(path)
    layouts = mf.gsq_layouts()
    assert len(layouts) == 14 and {(b, s) for _, b, s in layouts} == {(bits, 2)}
    assert "GSQ-RCO" in inspect_table(path)
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        t = next(t for t in mf.tensors if t.name == name)
        cols, rows = t.dims
        w = _core.gsq_dequantize(bytes(mf.raw(t)), rows, cols, bits=bits, slots=2)
        sigma = cols ** -0.5
        assert abs(float(w.mean())) < 0.1 * sigma and 0.8 * sigma < float(w.std()) < 1.25 * sigma
    logits = ninfer.LLM(path, n_ctx=64, threads=2).eval_logits([1, 2, 3, 4], rows=[3])
    assert np.isfinite(logits).all() and float(logits.std()) > 0.1


def _decode_gpu_records(recs: np.ndarray, bits: int, slots: int, per_row: int) -> np.ndarray:
    """Weights of records in the GPU layout, read the way kernels/quant.cuh reads them (codes at 0, the header
    at 48 or 64, slots after it; byte o of a 64-byte 3-bit record at (o + gsq3_rot(its index in the row)) % 64),
    in numpy: [n_records, 128]."""
    if recs.shape[1] == 64 and bits == 3:
        rot = (np.arange(len(recs)) % per_row & 6) << 3
        recs = recs[np.arange(len(recs))[:, None], (np.arange(64)[None, :] + rot[:, None]) % 64]
    hdr = 16 * bits
    d = recs[:, hdr : hdr + 2].copy().view(np.float16).astype(np.float32)[:, 0]
    dmin = recs[:, hdr + 2 : hdr + 4].copy().view(np.float16).astype(np.float32)[:, 0]
    sm = recs[:, hdr + 4 : hdr + 12]
    i = np.arange(128)
    if bits == 3:  # weight i = 32j + 4k + e (unit j, quad k): byte e of unit j's words W0, W1, W2 (quant.cuh)
        j, k, e = i // 32, (i // 4) % 8, i % 4
        word = np.stack([32 * (j // 2) + 8 * (j % 2), 32 * (j // 2) + 8 * (j % 2) + 4, 16 + 8 * (j // 2) + 4 * (j % 2)])
        whole = recs[:, word[k % 3, i] + e] >> np.where(k < 3, 0, 3)  # k < 6: bits 0-2 or 3-5 of W_(k % 3)
        low2 = recs[:, word[k % 2, i] + e] >> 6  # k = 6, 7: bits 6-7 of W_(k - 6) ...
        high = (recs[:, word[2, i] + e] >> np.where(k == 7, 7, 6)) & 1  # ... and bit 2 at bit k of W2
        codes = np.where(k < 6, whole & 7, (low2 & 3) | (high << 2))
    else:  # unit j: nibble j // 2 of byte 32 (j % 2) + i % 32
        j = i // 32
        codes = (recs[:, 32 * (j % 2) + i % 32] >> (4 * (j // 2))) & 15
    sc, mn = (sm[:, i // 16] & 15).astype(np.float32), (sm[:, i // 16] >> 4).astype(np.float32)
    w = (d[:, None] * sc) * codes.astype(np.float32) - dmin[:, None] * mn
    for s in range(slots):
        pos = recs[:, hdr + 12 + 2 * s] & 127
        val = recs[:, hdr + 13 + 2 * s].view(np.int8).astype(np.float32)
        r = np.arange(len(recs))
        w[r, pos] += val * d * sc[r, pos] * np.float32(1 / 16)
    return w


@pytest.mark.parametrize("bits,slots", [(3, 0), (3, 2), (3, 6), (4, 2), (4, 4)])
def test_gpu_record_layout_holds_the_same_weights(bits: int, slots: int) -> None:
    """The CUDA backend re-lays GSQ-RCO records on upload (backends/layouts.py): the re-laid bytes, decoded as the
    kernels decode them, give the CPU dequantizer's weights; records stay 16-byte multiples."""
    from ninfer.backends.layouts import gsq_type, layout, relayout
    from ninfer.synth import random_gsq_records

    rng = np.random.default_rng(bits * 10 + slots)
    rows, cols = 6, 896  # (seven records a row: a record's rotation follows its index in its row, not the file)
    raw = random_gsq_records(bits, slots, rows, cols, 0.05, rng)
    lay = layout(gsq_type(bits, slots), "w")
    assert lay.gpu_bytes % 16 == 0 and lay.gpu_bytes - lay.raw_bytes < 16
    assert lay.gpu_bytes == {(3, 0): 64, (3, 2): 64, (3, 6): 80, (4, 2): 80, (4, 4): 96}[(bits, slots)]
    assert lay.rotated == (lay.gpu_bytes == 64)
    gpu = relayout(raw.reshape(-1, lay.raw_bytes), lay, per_row=7)
    ref = _core.gsq_dequantize(raw.tobytes(), rows, cols, bits=bits, slots=slots)
    got = _decode_gpu_records(gpu, bits, slots, 7).reshape(rows, cols)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    if lay.rotated:  # record 6 of a row (rotated by 48): its header at byte 32, the codes' first vector at 48
        unrotated = relayout(raw.reshape(-1, lay.raw_bytes), replace(lay, rotated=False))
        np.testing.assert_array_equal(gpu[7 + 6, 32:48], unrotated[7 + 6, 48:])
        np.testing.assert_array_equal(gpu[7 + 6, 48:], unrotated[7 + 6, :16])
        np.testing.assert_array_equal(gpu[7 + 1], unrotated[7 + 1])
        with pytest.raises(ValueError, match="per_row"):
            relayout(raw.reshape(-1, lay.raw_bytes), lay)
    # 3-bit codes are re-ordered a chunk of records at a time: chunk edges change nothing (42 records, chunks of 5)
    np.testing.assert_array_equal(relayout(raw.reshape(-1, lay.raw_bytes), lay, chunk=5, per_row=7), gpu)


EVAL_DIR = Path(__file__).resolve().parents[2] / "shared" / "eval"


@pytest.mark.skipif(not (EVAL_DIR / "code.txt").is_file(), reason="../shared/eval not beside the checkout")
def test_builtin_calibration_text_shares_no_lines_with_the_evaluation_texts() -> None:
    from ninfer.gsq_calibration import BUILTIN_CALIBRATION

    text = BUILTIN_CALIBRATION.read_text()
    assert 250_000 < len(text) < 500_000  # a few hundred KB, shipped in the wheel
    # Lines of some length with letters or digits in them (a row of '#' is in both, and is no text).
    calib = [line for line in text.splitlines() if len(line.strip()) > 40 and any(map(str.isalnum, line))]
    assert len(calib) > 2000
    assert any("\u3002" in line for line in calib) and any("Paket" in line for line in calib)  # CJK and German
    for name in ("code.txt", "prose.txt"):
        evaluation = (EVAL_DIR / name).read_text()
        shared = [line for line in calib if line in evaluation]
        assert shared == [], (name, shared[:3])
