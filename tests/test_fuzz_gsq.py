"""Hostile GSQ-RCO files (issue 47): seeded variants of a small GSQ3 model (truncated, bytes flipped in the header,
the metadata and the tensor index, the gsq.* metadata rewritten with wrong types, absurd values and missing
fields). Each either loads and verifies, or fails with a ninfer error: one line of at most 300 printable
characters, exit 2 from `ninfer inspect` / `gsq-rco verify|inspect` (1 from verify for a checksum mismatch), never
a traceback. Most variants run in-process through the commands' main functions, a few as real processes."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from ninfer import _core, cli, gsq_cli, gsq_file
from ninfer.errors import ModelFileError, UnsupportedModelError
from ninfer.gsq_file import METADATA_CHECKSUM_KEY, metadata_checksum
from ninfer.model_file import ModelFile
from ninfer.synth import random_blocks, random_gsq_records

Q = GGMLQuantizationType
E, FF, VOCAB = 128, 256, 64  # rows are whole 128-weight records
# name: (rows, cols, type): (bits, slots) for GSQ-RCO records, else a GGML type
TENSORS: dict[str, tuple[int, int, Any]] = {
    "token_embd.weight": (VOCAB, E, Q.F32),
    "output_norm.weight": (1, E, Q.F32),
    "blk.0.attn_norm.weight": (1, E, Q.F32),
    "blk.0.attn_q.weight": (E, E, (3, 2)),
    "blk.0.attn_k.weight": (E // 2, E, (3, 2)),
    "blk.0.attn_v.weight": (E // 2, E, (4, 0)),
    "blk.0.attn_output.weight": (E, E, (3, 6)),
    "blk.0.ffn_norm.weight": (1, E, Q.F32),
    "blk.0.ffn_gate.weight": (FF, E, (3, 2)),
    "blk.0.ffn_up.weight": (FF, E, Q.Q8_0),
    "blk.0.ffn_down.weight": (E, FF, (3, 2)),
}
GSQ_T, KEPT_T, NORM_T = "blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.0.attn_norm.weight"
MAX_MESSAGE = 300


def write_tiny_gsq(path: Path) -> Path:
    """A one-layer llama-shaped model whose layer matrices are GSQ-RCO records (3- and 4-bit, 0-6 slots), one
    kept Q8_0 and the rest F32, in the converter's container (gsq_file.add_container_metadata, fill_tensor_infos)."""
    rng = np.random.default_rng(7)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(E)
    w.add_feed_forward_length(FF)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([chr(0x41 + i) for i in range(VOCAB - 2)] + ["AB", "<eos>"])
    w.add_token_types([1] * (VOCAB - 1) + [3])
    w.add_token_merges(["A B"])
    w.add_eos_token_id(VOCAB - 1)
    gsq_file.add_container_metadata(w, list(TENSORS), residual_bits=8, steps=0, seed=0, calibration="none (fuzz test)")
    datas, infos = [], []
    for name, (rows, cols, ty) in TENSORS.items():
        dims = [cols] if rows == 1 else [cols, rows]
        if isinstance(ty, tuple):
            data = random_gsq_records(*ty, rows, cols, cols**-0.5, rng)
            info = {"shape": dims, "type": "GSQ-RCO", "bits": ty[0], "slots": ty[1],
                    "bpw": round(8 * data.size / (rows * cols), 4), "err": None, "err_rtn": None}
            w.add_tensor_info(name, data.shape, np.dtype(np.int8), data.size, Q.I8)
        else:
            data = (1.0 + 0.1 * rng.standard_normal(cols, dtype=np.float32)).view(np.uint8) if rows == 1 else \
                random_blocks(ty, rows, cols, cols**-0.5, rng)
            info = {"shape": dims, "type": ty.name, "bpw": round(8 * data.size / (rows * cols), 4)}
            w.add_tensor_info(name, data.shape if rows > 1 else (data.size,), np.dtype(np.uint8), data.size, ty)
        datas.append(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
        infos.append(gsq_file.tensor_info(data, **info))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for data in datas:
        w.write_tensor_data(data)
    w.close()
    gsq_file.fill_tensor_infos(path, infos)
    return path


# ---- rewriting the metadata -----------------------------------------------------------------------------------
DROP = object()


@dataclass(frozen=True)
class Typed:
    """A metadata value written with an explicit GGUF type (to retype a key)."""

    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


_PLACEHOLDER = "@fuzz-metadata-checksum@".ljust(32, "~")


def rewrite(base: GGUFReader, out: Path, changes: dict[str, Any], checksum: str = "recompute") -> None:
    """`base` with some metadata keys changed (a str: a string; a Typed: that type; DROP: removed; a new key
    appended) and the tensors as they were. checksum: 'recompute' writes gsq.metadata_checksum over the new
    gsq.* keys (a consistent tampering: only validation can catch it), 'keep' leaves the base's, 'drop' none."""
    changes = dict(changes)
    if checksum == "recompute":
        changes[METADATA_CHECKSUM_KEY] = _PLACEHOLDER
    elif checksum == "drop":
        changes[METADATA_CHECKSUM_KEY] = DROP
    w = GGUFWriter(str(out), "llama")
    for f in base.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in changes:
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub)
    for key, value in changes.items():
        if value is DROP:
            continue
        v = value if isinstance(value, Typed) else Typed(value, GGUFValueType.STRING)
        w.add_key_value(key, v.value, v.vtype, v.sub_type)
    for t in base.tensors:
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        dims = [int(d) for d in t.shape]
        byte_shape = tuple(reversed(dims[1:])) + (dims[0] // block * size,)
        w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(t.n_bytes), t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in base.tensors:
        w.write_tensor_data(np.frombuffer(t.data.tobytes(), np.uint8))
    w.close()
    if checksum == "recompute":
        data = out.read_bytes()
        digest = metadata_checksum(_core.GgufFile(str(out)).metadata())
        out.write_bytes(data.replace(_PLACEHOLDER.encode(), digest.encode(), 1))


def entry_of(base: GGUFReader, name: str) -> dict[str, Any]:
    return json.loads(base.fields[f"gsq.tensor.{name}"].contents())


def edited(base: GGUFReader, name: str, **fields: Any) -> dict[str, str]:
    """The change setting (or, with DROP, removing) fields of a tensor's entry."""
    entry = entry_of(base, name)
    for k, v in fields.items():
        if v is DROP:
            entry.pop(k)
        else:
            entry[k] = v
    return {f"gsq.tensor.{name}": json.dumps(entry)}


# ---- the variants ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    label: str
    make: Callable[[Path], None]
    verify_rc: int | None = None  # the exit code `gsq-rco verify` must give, where it is known
    expect: str = ""  # text the error (or verify's line) must hold


def regions(path: Path) -> tuple[int, int, int]:
    """(end of the metadata, start of the data, file size): the header and key-values, then the tensor index."""
    r = GGUFReader(path)
    last = max(r.fields.values(), key=lambda f: f.offset)
    return last.offset + sum(p.nbytes for p in last.parts), r.data_offset, path.stat().st_size


def byte_variants(base_path: Path, rng: np.random.Generator) -> list[Variant]:
    raw = base_path.read_bytes()
    kv_end, data_start, size = regions(base_path)

    def cut(n: int) -> Callable[[Path], None]:
        return lambda p: p.write_bytes(raw[:n])

    def flip(at: int, mask: int) -> Callable[[Path], None]:
        def make(p: Path) -> None:
            b = bytearray(raw)
            b[at] ^= mask
            p.write_bytes(bytes(b))
        return make

    out = []
    cuts = {0, 3, 4, 8, 16, 23, 24, kv_end // 2, kv_end - 1, kv_end, kv_end + 5, data_start - 1, data_start,
            data_start + 33, size - 1} | {int(x) for x in rng.integers(1, size, 10)}
    out += [Variant(f"truncated at {n} of {size}", cut(n)) for n in sorted(cuts)]
    gsq_values = [i for i in range(24, kv_end) if raw.startswith(b"gsq.", i)]
    spots = ([("header", int(x)) for x in rng.integers(0, 24, 8)]
             + [("metadata", int(x)) for x in rng.integers(24, kv_end, 30)]
             + [("gsq key", int(x) + int(rng.integers(0, 60))) for x in rng.choice(gsq_values, 16)]
             + [("tensor index", int(x)) for x in rng.integers(kv_end, data_start, 24)])
    for where, at in spots:
        mask = int(rng.integers(1, 256))
        out.append(Variant(f"{where} byte {at} ^= {mask:#04x}", flip(at, mask)))
    # In a tensor's bytes (not the padding between tensors): the checksum names it, exit 1.
    r = GGUFReader(base_path)
    for t in (r.tensors[int(i)] for i in rng.choice(len(r.tensors), 4, replace=False)):
        at = int(t.data_offset) + int(rng.integers(0, int(t.n_bytes)))
        out.append(Variant(f"data byte {at} of {t.name}", flip(at, 0x10), 1, f"checksum mismatch: tensor {t.name}"))
    return out


def metadata_variants(base: GGUFReader) -> list[Variant]:
    U32 = GGUFValueType.UINT32
    gt = f"gsq.tensor.{GSQ_T}"
    kv: list[tuple[str, dict[str, Any], str]] = [  # (label, changes, text the error must hold)
        ("version a string", {"gsq.version": "2"}, "gsq.version"),
        ("version a float", {"gsq.version": Typed(2.0, GGUFValueType.FLOAT32)}, "gsq.version"),
        ("version NaN", {"gsq.version": Typed(math.nan, GGUFValueType.FLOAT32)}, "gsq.version"),
        ("version a bool", {"gsq.version": Typed(True, GGUFValueType.BOOL)}, "gsq.version"),
        ("version 1", {"gsq.version": Typed(1, U32)}, "format version 1"),
        ("version 3", {"gsq.version": Typed(3, U32)}, "format version 3"),
        ("version 2**40", {"gsq.version": Typed(2**40, GGUFValueType.UINT64)}, "format version 1099511627776"),
        ("version -2", {"gsq.version": Typed(-2, GGUFValueType.INT32)}, "format version -2"),
        ("version an array", {"gsq.version": Typed([2], GGUFValueType.ARRAY, U32)}, "gsq.version"),
        ("group size 64", {"gsq.group_size": Typed(64, U32)}, "gsq.group_size"),
        ("group size a string", {"gsq.group_size": "128"}, "gsq.group_size"),
        ("group size missing", {"gsq.group_size": DROP}, "gsq.group_size"),
        ("residual bits 4", {"gsq.residual_bits": Typed(4, U32)}, "gsq.residual_bits"),
        ("calibration steps -1", {"gsq.calibration_steps": Typed(-1, GGUFValueType.INT32)}, "gsq.calibration_steps"),
        ("seed a string", {"gsq.seed": "x"}, "gsq.seed"),
        ("calibration a number", {"gsq.calibration": Typed(5, U32)}, "gsq.calibration"),
        ("entry a number key", {gt: Typed(7, U32)}, gt),
        ("entry a list", {gt: "[1, 2]"}, gt),
        ("entry a string", {gt: '"x"'}, gt),
        ("entry a number", {gt: "5"}, gt),
        ("entry null", {gt: "null"}, gt),
        ("entry true", {gt: "true"}, gt),
        ("entry not JSON", {gt: "{"}, gt),
        ("entry Python syntax", {gt: "{'shape': [128, 128]}"}, gt),
        ("entry nested 100000 deep", {gt: "[" * 100000}, gt),
        ("entry \\x1b in it", {gt: "\x1b[31m{"}, gt),
        ("entry for no tensor", {"gsq.tensor.nope": json.dumps(entry_of(base, GSQ_T))}, "gsq.tensor.nope"),
        ("entry with escapes for no tensor", {"gsq.tensor.\x1b[2Jevil\n": "{}"}, "gsq.tensor.\\x1b[2Jevil\\n"),
        ("entry missing", {gt: DROP}, GSQ_T),
    ]
    fields: list[tuple[str, str, Any]] = [  # (tensor, field, value: DROP removes it)
        *((GSQ_T, f, DROP) for f in ("shape", "type", "blake2b", "bits", "slots", "bpw")),
        *((GSQ_T, "bits", v) for v in (99, "three", 3.0, True, -3, 2, 8, None, 2**64, [3])),
        *((GSQ_T, "slots", v) for v in (10**9, 2**64, 3, -2, 18, "2", 2.0, None)),
        *((GSQ_T, "shape", v) for v in ([640, 10**12], [-128, 128], [0, 128], [128], [128, 128, 1], "128x128",
                                        [128.0, 128], [True, 128], [2**64, 1], [256, 64], [128, 129], [100, 128],
                                        [], None, {"a": 1}, [10**400, 1])),
        *((GSQ_T, "blake2b", v) for v in (5, "xyz", "", "A" * 32, "a" * 31, None)),
        *((GSQ_T, "type", v) for v in ("Q4_K", 7, None, "", "gsq-rco")),
        *((GSQ_T, "bpw", v) for v in ("4", math.nan, -1, None, math.inf)),
        *((GSQ_T, "err", v) for v in ("x", [1])),
        (NORM_T, "type", "GSQ-RCO"),
        (NORM_T, "shape", [128, 1]),
        (NORM_T, "shape", [-1]),
        (KEPT_T, "type", "Q4_0"),
        (KEPT_T, "shape", [256, 127]),
        (KEPT_T, "shape", [128.0, 256]),
    ]
    out = [Variant(f"{label} (metadata checksum recomputed)", lambda p, c=c: rewrite(base, p, c), 2, expect)
           for label, c, expect in kv]
    for name, field, value in fields:
        c = edited(base, name, **{field: value})
        shown_value = "missing" if value is DROP else repr(value)[:40]
        out.append(Variant(f"{name} {field} {shown_value}", lambda p, c=c: rewrite(base, p, c), 2,
                           f"gsq.tensor.{name}"))
    # Consistent but wrong: a well-formed checksum of other bytes is a damaged tensor (1); unknown fields are fine.
    out.append(Variant("blake2b of other bytes", lambda p: rewrite(base, p, edited(base, GSQ_T, blake2b="0" * 32)),
                       1, f"checksum mismatch: tensor {GSQ_T}"))
    out.append(Variant("an unknown field", lambda p: rewrite(base, p, edited(base, GSQ_T, note="hi")), 0, "ok"))
    out.append(Variant("an unknown gsq key", lambda p: rewrite(base, p, {"gsq.future": Typed(1, U32)}), 0, "ok"))
    # Tampered with and the metadata checksum left as it was: verify calls the file damaged (1), the loader refuses.
    stale = (("bits 99", edited(base, GSQ_T, bits=99)), ("shape 10**12", edited(base, GSQ_T, shape=[640, 10**12])),
             ("calibration text", {"gsq.calibration": "other"}), ("entry dropped", {gt: DROP}))
    for label, c in stale:
        out.append(Variant(f"{label}, stale metadata checksum", lambda p, c=c: rewrite(base, p, c, "keep"), 1,
                           "checksum mismatch: the gsq.* metadata"))
    # Without gsq.metadata_checksum (files written before it): validated, said to be unchecked.
    out.append(Variant("no metadata checksum", lambda p: rewrite(base, p, {}, "drop"), 0, "no gsq.metadata_checksum"))
    out.append(Variant("no metadata checksum, bits 99",
                       lambda p: rewrite(base, p, edited(base, GSQ_T, bits=99), "drop"), 2,
                       f"gsq.tensor.{GSQ_T}: bits is 99"))
    out.append(Variant("metadata checksum a number", lambda p: rewrite(base, p, {METADATA_CHECKSUM_KEY: Typed(5, U32)},
                                                                      "keep"), 2, METADATA_CHECKSUM_KEY))
    out.append(Variant("metadata checksum not hex", lambda p: rewrite(base, p, {METADATA_CHECKSUM_KEY: "zz"}, "keep"),
                       2, METADATA_CHECKSUM_KEY))
    return out


# ---- running them ---------------------------------------------------------------------------------------------
def run_main(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def check_line(text: str, prefix: str, where: str) -> str:
    """`text` is one line starting with `prefix`, at most MAX_MESSAGE printable characters; returns it."""
    line = text.removesuffix("\n")
    assert line.startswith(prefix), (where, text)
    assert "\n" not in line and line.isprintable() and len(line) <= MAX_MESSAGE, (where, len(line), line)
    return line


def check_variant(path: Path, v: Variant) -> None:
    where = f"{v.label} ({path.name})"
    rc, out, err = run_main(gsq_cli.main, ["verify", "--model", str(path)])
    if rc == 2:
        assert out == "", (where, out)
        line = check_line(err, "gsq-rco: error: ", where)
    else:
        assert rc in (0, 1) and err == "", (where, rc, err)
        line = check_line(out, "ok" if rc == 0 else "checksum mismatch: ", where)
    if v.verify_rc is not None:
        assert rc == v.verify_rc and v.expect in line, (where, rc, line)
    # The loader: its metadata checks (what `ninfer run` reads before the engine) end in a ninfer error or pass.
    try:
        mf = ModelFile(path)
        mf.tensors
        mf.spec
    except (ModelFileError, UnsupportedModelError) as e:
        check_line(str(e), "", where)
        loads = False
    else:
        loads = True
    for main, argv, prefix in ((cli.main, ["inspect", str(path)], "ninfer: error: "),
                               (gsq_cli.main, ["inspect", str(path)], "gsq-rco: error: ")):
        irc, iout, ierr = run_main(main, argv)
        assert irc in (0, 2), (where, argv, irc, ierr)
        if irc == 2:
            check_line(ierr, prefix, where)
        elif main is cli.main:  # the table names the model; the loader's view of it must agree
            assert "tensors" in iout, (where, iout)
    if rc == 0:  # whatever verify passes, the loader accepts
        assert loads and v.verify_rc in (None, 0), (where, line)


@pytest.fixture(scope="module")
def base_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gsq(tmp_path_factory.mktemp("fuzz") / "base.gguf")


def test_the_small_gsq_model_verifies_and_loads(base_path: Path) -> None:
    assert gsq_file.verify(base_path) == (True, "ok")
    mf = ModelFile(base_path)
    assert len(mf.gsq_layouts()) == 6 and mf.spec["gsq"]
    assert run_main(cli.main, ["inspect", str(base_path)])[0] == 0


def test_fuzzed_gsq_files_fail_with_one_line_ninfer_errors(base_path: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(47)
    base = GGUFReader(base_path)
    variants = byte_variants(base_path, rng) + metadata_variants(base)
    assert 150 <= len(variants) <= 250, len(variants)
    t_all = time.perf_counter()
    for i, v in enumerate(variants):
        path = tmp_path / f"v{i}.gguf"
        t0 = time.perf_counter()
        v.make(path)
        check_variant(path, v)
        dt = time.perf_counter() - t0
        assert dt < 10, (v.label, dt)
        path.unlink()
    assert time.perf_counter() - t_all < 60


def test_exit_codes_end_to_end(base_path: Path, tmp_path: Path) -> None:
    """Real processes: verify 0 / 1 / 2, and `ninfer inspect` and `ninfer run` exit 2 with one line, on a malformed
    entry (consistent metadata checksum) and a truncated file; the intact model runs."""
    base = GGUFReader(base_path)
    bad = tmp_path / "bits99.gguf"
    rewrite(base, bad, edited(base, GSQ_T, bits=99))
    flipped = tmp_path / "flipped.gguf"
    raw = bytearray(base_path.read_bytes())
    t = next(t for t in base.tensors if t.name == GSQ_T)
    raw[int(t.data_offset) + 5] ^= 1
    flipped.write_bytes(bytes(raw))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(bytes(raw[: len(raw) // 2]))
    runs = [  # (argv, exit code, stream, text)
        (["-m", "ninfer.gsq_cli", "verify", "--model", str(base_path)], 0, "stdout", "ok"),
        (["-m", "ninfer.gsq_cli", "verify", "--model", str(flipped)], 1, "stdout",
         f"checksum mismatch: tensor {GSQ_T}"),
        (["-m", "ninfer.gsq_cli", "verify", "--model", str(bad)], 2, "stderr", f"gsq.tensor.{GSQ_T}: bits is 99"),
        (["-m", "ninfer.gsq_cli", "verify", "--model", str(cut)], 2, "stderr", "runs past the end of the file"),
        (["-m", "ninfer.gsq_cli", "inspect", str(bad)], 2, "stderr", "bits is 99"),
        (["-m", "ninfer.cli", "inspect", str(bad)], 2, "stderr", "bits is 99"),
        (["-m", "ninfer.cli", "run", "-m", str(bad), "-p", "A", "-n", "1"], 2, "stderr", "bits is 99"),
        (["-m", "ninfer.cli", "run", "-m", str(base_path), "-p", "AB", "-n", "2", "-t", "1"], 0, "", ""),
    ]
    procs = [(subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
              argv, rc, stream, text) for argv, rc, stream, text in runs]
    for p, argv, rc, stream, text in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == rc, (argv, out, err)
        assert "Traceback" not in err, (argv, err)
        if rc == 2:
            check_line(err, "gsq-rco: error: " if "ninfer.gsq_cli" in argv else "ninfer: error: ", " ".join(argv))
        if stream:
            assert text in (out if stream == "stdout" else err), (argv, out, err)
