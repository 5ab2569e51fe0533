"""The GSQ-RCO container in a GGUF file (docs/gsq-rco.md "In a GGUF file"): writing its gsq.* metadata, reading
it back validated, and `gsq-rco verify` / `gsq-rco inspect`.

`tensor_infos_of` is the one check of a file's gsq.* metadata: the loader (ModelFile.gsq_infos), verify and
inspect all read the per-tensor entries through it, so whatever verify passes the loader accepts. Every way the
metadata can be wrong is a ModelFileError naming the key, with the value quoted by `errors.shown`.

Checksums: each tensor's bytes (`blake2b` in its entry) and, since `gsq.metadata_checksum`, the gsq.* metadata
itself (`metadata_checksum`); files written before that key still load, and verify says their metadata is
unchecked.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ninfer import _core
from ninfer.errors import SHOWN_CHARS, ModelFileError, shown
from ninfer.model_file import ModelFile

FORMAT_VERSION = 2
GROUP = 128  # weights per record (format version 2)
CODE_BITS = (3, 4)
MAX_SLOTS = 16  # residual slots per record: even, 0..16
RESIDUAL_BITS = 8
VERSION_KEY = "gsq.version"
TENSOR_PREFIX = "gsq.tensor."
METADATA_CHECKSUM_KEY = "gsq.metadata_checksum"
_HEX32 = re.compile(r"[0-9a-f]{32}")  # a 16-byte BLAKE2b digest as written
_INFO_WIDTH = 320  # bytes reserved for each tensor's JSON in the header
_CHECKSUM_PLACEHOLDER = "@gsq-metadata-checksum@".ljust(32, "~")
_CHUNK = 1 << 24
MAX_DIMS = 4  # a GGML tensor's dimensions


# ---- writing ------------------------------------------------------------------------------------------------
def checksum(data: Any) -> str:
    """16-byte BLAKE2b of a buffer's bytes, as hex (a tensor entry's `blake2b`)."""
    h = hashlib.blake2b(digest_size=16)
    mv = memoryview(data).cast("B")
    for i in range(0, len(mv), _CHUNK):
        h.update(mv[i : i + _CHUNK])
    return h.hexdigest()


def metadata_checksum(md: dict[str, Any]) -> str:
    """The `gsq.metadata_checksum` of a file's metadata: BLAKE2b (16 bytes) of its canonical serialization, the
    JSON array of [key, value] of every other gsq.* key, sorted by key, values as the reader parses them, no
    whitespace, non-ASCII escaped (docs/gsq-rco.md "In a GGUF file")."""
    pairs = [[k, md[k]] for k in sorted(md) if k.startswith("gsq.") and k != METADATA_CHECKSUM_KEY]
    text = json.dumps(pairs, ensure_ascii=True, separators=(",", ":"), allow_nan=True,
                      default=lambda a: a.tolist())  # (the parser gives numeric arrays as numpy arrays)
    return hashlib.blake2b(text.encode("ascii"), digest_size=16).hexdigest()


def _placeholder(i: int) -> str:
    return f"@gsq-info-{i:06d}@".ljust(_INFO_WIDTH, "~")


def add_container_metadata(w: Any, names: list[str], *, residual_bits: int, steps: int, seed: int,
                           calibration: str) -> None:
    """The gsq.* keys of a GSQ-RCO file (docs/gsq-rco.md "In a GGUF file"), with a fixed-width placeholder for
    each tensor's JSON, in tensor order, and one for the metadata checksum: fill_tensor_infos writes them once the
    data is written and checksummed. (The converter and the synthetic-model generator write files the same way.)"""
    w.add_uint32(VERSION_KEY, FORMAT_VERSION)
    w.add_uint32("gsq.group_size", GROUP)
    w.add_uint32("gsq.residual_bits", residual_bits)
    w.add_uint32("gsq.calibration_steps", steps)
    w.add_uint32("gsq.seed", seed)
    w.add_string("gsq.calibration", calibration)
    w.add_string(METADATA_CHECKSUM_KEY, _CHECKSUM_PLACEHOLDER)
    for i, name in enumerate(names):
        w.add_string(f"{TENSOR_PREFIX}{name}", _placeholder(i))


def tensor_info(data: Any, **fields: Any) -> dict[str, Any]:
    """A tensor's `gsq.tensor.<name>` entry: `fields` (shape, type, bpw, ...) and the checksum of its bytes."""
    return {**fields, "blake2b": checksum(data)}


def fill_tensor_infos(path: Path, infos: list[dict[str, Any]]) -> None:
    """Write each tensor's JSON over its placeholder, then the metadata checksum over the gsq.* keys as a reader
    parses them from the finished header (the same fixed lengths: the file's layout stays)."""
    _fill_placeholders(path, [(_placeholder(i), json.dumps(info, separators=(",", ":")))
                              for i, info in enumerate(infos)])
    _fill_placeholders(path, [(_CHECKSUM_PLACEHOLDER, metadata_checksum(_core.GgufFile(str(path)).metadata()))])


def _fill_placeholders(path: Path, texts: list[tuple[str, str]]) -> None:
    """Write each (placeholder, text) text over its fixed-width placeholder in the header."""
    with open(path, "r+b") as f:
        head = f.read(64 << 20)
        for placeholder, text in texts:
            ph = placeholder.encode()
            pos = head.find(ph)
            if pos < 0:
                raise ModelFileError(f"{path}: placeholder {placeholder.rstrip('~')} not found in the header")
            body = text.encode()
            if len(body) > len(ph):
                raise ModelFileError(f"{path}: {body[:40]!r}... is longer than its {len(ph)}-byte slot")
            f.seek(pos)
            f.write(body.ljust(len(ph)))


# ---- reading: the one validation ----------------------------------------------------------------------------
def _named(name: str) -> str:
    """A key or tensor name from the file as a message shows it: as it is when plain, else quoted by shown()."""
    plain = len(name) <= SHOWN_CHARS and name.isascii() and name.isprintable() and " " not in name
    return name if plain else shown(name)


def _is_int(v: Any) -> bool:
    return type(v) is int  # (True is no integer here)


def _is_number(v: Any) -> bool:
    return type(v) in (int, float)


def _check_version(path: Any, md: dict[str, Any]) -> None:
    v = md[VERSION_KEY]
    if not _is_int(v):
        raise ModelFileError(f"{path}: {VERSION_KEY} is {shown(v)}, not an integer (this ninfer reads format "
                             f"version {FORMAT_VERSION})")
    if v != FORMAT_VERSION:
        raise ModelFileError(f"{path}: GSQ-RCO format version {shown(v)} (this ninfer reads {FORMAT_VERSION}; "
                             "convert the source again)")


def metadata_checksum_matches(path: Any, md: dict[str, Any]) -> bool | None:
    """Whether `gsq.metadata_checksum` matches the gsq.* metadata; None for a file without one."""
    stored = md.get(METADATA_CHECKSUM_KEY)
    if stored is None:
        return None
    if not (isinstance(stored, str) and _HEX32.fullmatch(stored)):
        raise ModelFileError(f"{path}: {METADATA_CHECKSUM_KEY} is {shown(stored)}, not 32 lowercase hex digits")
    return stored == metadata_checksum(md)


def _check_container(path: Any, md: dict[str, Any]) -> None:
    """The file-wide gsq.* keys: the record layout's constants, and the informational ones' types."""
    for key, value in (("gsq.group_size", GROUP), ("gsq.residual_bits", RESIDUAL_BITS)):
        if key not in md:
            raise ModelFileError(f"{path}: no {key} in the metadata (format version {FORMAT_VERSION} has {value})")
        v = md[key]
        if not _is_int(v) or v != value:
            raise ModelFileError(f"{path}: {key} is {shown(v)}; format version {FORMAT_VERSION} has {value}")
    for key in ("gsq.calibration_steps", "gsq.seed"):
        if key in md and not (_is_int(md[key]) and md[key] >= 0):
            raise ModelFileError(f"{path}: {key} is {shown(md[key])}, not a count")
    if "gsq.calibration" in md and not isinstance(md["gsq.calibration"], str):
        raise ModelFileError(f"{path}: gsq.calibration is {shown(md['gsq.calibration'])}, not a string")


def _parse_entry(path: Any, key: str, raw: Any) -> dict[str, Any]:
    where = f"{path}: {_named(key)}"
    if not isinstance(raw, str):
        raise ModelFileError(f"{where} is {shown(raw)}, not a JSON string")
    try:
        entry = json.loads(raw)
    except (ValueError, RecursionError):
        raise ModelFileError(f"{where} is not valid JSON: {shown(raw.rstrip())}") from None
    if not isinstance(entry, dict):
        raise ModelFileError(f"{where} is {shown(entry)}, not a JSON object")
    return entry


def _check_entry(where: str, entry: dict[str, Any], stored: tuple) -> dict[str, Any]:
    """One tensor's entry against the tensor as stored (name, type id, type name, dims, offset, bytes)."""
    _, type_id, type_name, dims, _, n_bytes = stored

    def field(name: str, ok: Any, expected: str, *, required: bool = True) -> Any:
        if name not in entry:
            if required:
                raise ModelFileError(f"{where} has no {name}")
            return None
        v = entry[name]
        if not ok(v):
            raise ModelFileError(f"{where}: {name} is {shown(v, 60)}; {expected}")
        return v

    kind = field("type", lambda v: isinstance(v, str), "expected a type name")
    field("blake2b", lambda v: isinstance(v, str) and _HEX32.fullmatch(v), "expected 32 lowercase hex digits")
    field("bpw", lambda v: _is_number(v) and 0 <= v < math.inf, "expected bits per weight")
    for name in ("err", "err_rtn"):
        field(name, lambda v: v is None or _is_number(v), "expected a number or null", required=False)
    if kind == "Q2_K" and "hot_rows" in entry:
        return _check_split_embedding(where, entry, field, type_id, type_name, dims, n_bytes)
    if kind != "GSQ-RCO":
        if kind != type_name:
            raise ModelFileError(f"{where}: type is {shown(kind, 60)}; the tensor is stored as {type_name}")
        field("shape", lambda v: isinstance(v, list) and all(_is_int(d) for d in v) and v == list(dims),
              f"the tensor is stored with dims {shown(list(dims), 40)}")
        return entry
    bits = field("bits", lambda v: _is_int(v) and v in CODE_BITS, "the format has 3- or 4-bit codes")
    slots = field("slots", lambda v: _is_int(v) and 0 <= v <= MAX_SLOTS and v % 2 == 0,
                  f"the format has an even count in 0..{MAX_SLOTS}")
    cols, rows = field("shape", lambda v: isinstance(v, list) and len(v) == 2 and all(_is_int(d) and d > 0 for d in v),
                       "expected [row length, rows], two positive integers")
    if cols % GROUP:
        raise ModelFileError(f"{where}: shape is {shown([cols, rows], 60)}; rows are not whole {GROUP}-weight records")
    if type_id != GGMLQuantizationType.I8:
        raise ModelFileError(f"{where}: a GSQ-RCO tensor stored as {type_name}, not as I8 records")
    row_bytes = cols // GROUP * _core.gsq_row_bytes(GROUP, bits=bits, slots=slots)
    if [row_bytes, rows] != list(dims) or rows * row_bytes != n_bytes:
        raise ModelFileError(f"{where}: shape {shown([cols, rows], 40)} ({bits}-bit codes, {slots} slots) does not "
                             f"match the stored I8 records, dims {shown(list(dims), 40)}")
    return entry


def _check_split_embedding(where: str, entry: dict[str, Any], field: Any, type_id: int, type_name: str,
                           dims: Any, n_bytes: int) -> dict[str, Any]:
    """A token embedding split by rows (model/embedding.rs): `hot_rows` rows of `hot_type`, the others Q2_K, all in
    one I8 tensor of exactly their bytes."""
    cols, rows = field("shape", lambda v: isinstance(v, list) and len(v) == 2 and all(_is_int(d) and d > 0 for d in v),
                       "expected [row length, rows], two positive integers")
    hot_type = field("hot_type", lambda v: isinstance(v, str) and v in GGMLQuantizationType.__members__,
                     "expected a GGML type name")
    hot = field("hot_rows", lambda v: _is_int(v) and 0 < v < rows, f"expected 1..{rows - 1} rows")
    sizes = [GGML_QUANT_SIZES[GGMLQuantizationType[t]] for t in (hot_type, "Q2_K")]
    if any(cols % block for block, _ in sizes):
        raise ModelFileError(f"{where}: rows of {cols} are not whole {hot_type} and Q2_K blocks")
    (hb, hs), (cb, cs) = sizes
    want = 4 * hot + hot * (cols // hb * hs) + (rows - hot) * (cols // cb * cs)
    if type_id != GGMLQuantizationType.I8 or n_bytes != want:
        raise ModelFileError(f"{where}: a split embedding stored as {type_name} of {n_bytes} bytes, not I8 of {want} "
                             f"({hot} ids and {hot_type} rows, {rows - hot} Q2_K rows)")
    return entry


def tensor_infos_of(path: Any, md: dict[str, Any], stored: list[tuple]) -> dict[str, dict[str, Any]]:
    """The validated `gsq.tensor.<name>` entries of a file ({} without gsq.version: not a GSQ-RCO file), given its
    metadata and its tensor index as the parser lists it (name, type id, type name, dims, offset, bytes).
    Checks, in order: the format version (an integer, 2), the metadata checksum where the file has one, the
    file-wide keys, then every entry (a JSON object naming a stored tensor, its fields' types and ranges, its
    shape against the stored records' bytes), and that every tensor has one. Raises ModelFileError."""
    if VERSION_KEY not in md:
        return {}
    _check_version(path, md)
    if metadata_checksum_matches(path, md) is False:
        raise ModelFileError(f"{path}: {METADATA_CHECKSUM_KEY} does not match the gsq.* metadata: the file is "
                             "damaged (gsq-rco verify)")
    _check_container(path, md)
    by_name = {t[0]: t for t in stored}
    infos = {}
    for key, raw in md.items():
        if not key.startswith(TENSOR_PREFIX):
            continue
        name = key[len(TENSOR_PREFIX) :]
        entry = _parse_entry(path, key, raw)
        if name not in by_name:
            raise ModelFileError(f"{path}: {_named(key)} names no tensor of the file")
        infos[name] = _check_entry(f"{path}: {_named(key)}", entry, by_name[name])
    missing = next((name for name in by_name if name not in infos), None)
    if missing is not None:
        raise ModelFileError(f"{path}: tensor {_named(missing)} has no {TENSOR_PREFIX}{_named(missing)} entry")
    return infos


# ---- verify, inspect ----------------------------------------------------------------------------------------
def tensor_infos(path: str | os.PathLike[str]) -> tuple[ModelFile, dict[str, dict[str, Any]]]:
    """(the model file, its validated entries), or ModelFileError for a file that is not GSQ-RCO."""
    mf = ModelFile(path)
    if VERSION_KEY not in mf.metadata:
        raise ModelFileError(f"{path}: not a GSQ-RCO file (no {VERSION_KEY} in its metadata)")
    return mf, mf.gsq_infos


def verify(path: str | os.PathLike[str]) -> tuple[bool, str]:
    """(True, 'ok') or (False, what does not match its checksum: the metadata, or the first tensor and its layer).
    A file that is not GSQ-RCO, unreadable or malformed raises ModelFileError (the loader's check, the same)."""
    mf = ModelFile(path)
    md = mf.metadata
    if VERSION_KEY not in md:
        raise ModelFileError(f"{path}: not a GSQ-RCO file (no {VERSION_KEY} in its metadata)")
    _check_version(path, md)
    meta_ok = metadata_checksum_matches(path, md)
    if meta_ok is False:
        return False, "checksum mismatch: the gsq.* metadata (tensor entries, layouts, format keys)"
    infos = mf.gsq_infos
    for t in mf.tensors:
        if checksum(mf.raw(t)) != infos[t.name]["blake2b"]:
            m = re.match(r"blk\.(\d+)\.", t.name)
            where = f"layer {m.group(1)}" if m else "not in a layer"
            return False, f"checksum mismatch: tensor {_named(t.name)} ({where})"
    if meta_ok is None:
        return True, f"ok (tensor data; the metadata was validated but has no {METADATA_CHECKSUM_KEY} to check)"
    return True, "ok"


def inspect_table(path: str | os.PathLike[str]) -> str:
    mf, infos = tensor_infos(path)
    md = mf.metadata
    rows = [f"GSQ-RCO v{md[VERSION_KEY]}  group {md['gsq.group_size']}  residual bits {md['gsq.residual_bits']}  "
            f"calibration steps {md.get('gsq.calibration_steps', '-')}  "
            f"calibration text: {shown(md.get('gsq.calibration', 'none'))}",
            f"{'tensor':34s} {'type':9s} {'bpw':>6s} {'bits':>4s} {'slots':>5s} {'w.err RTN':>10s} {'w.err':>10s}"]
    for t in mf.tensors:
        i = infos[t.name]
        errs = " ".join(f"{v:10.3e}" if v is not None else f"{'-' if 'err' in i else '':>10s}"
                        for v in (i.get("err_rtn"), i.get("err")))
        if i["type"] == "GSQ-RCO":
            rows.append(f"{_named(t.name):34s} {'GSQ-RCO':9s} {i['bpw']:6.3f} {i['bits']:4d} {i['slots']:5d} {errs}")
        else:  # a kept source tensor, or one the converter wrote as Q2_K (with its errors)
            rows.append(f"{_named(t.name):34s} {i['type']:9s} {i['bpw']:6.3f} {'':4s} {'':5s} {errs}")
    total_bits = 8 * sum(t.n_bytes for t in mf.tensors)
    total_w = sum(math.prod(infos[t.name]["shape"]) for t in mf.tensors)
    rows.append(f"total {mf.gguf.file_size / 2**20:.1f} MiB, {total_bits / max(total_w, 1):.3f} bits per weight")
    return "\n".join(rows)
