"""Hostile variants of a real GGUF file, for the hardening tests: keys set, retyped or resized, counts made absurd.

`Header.read` takes a file's header apart into raw metadata records and the tensor index; `Header.write` puts a
variant together (the tensor data copied by the kernel, re-aligned so that it stays valid), so one metadata key can
change type or size while everything else stays as the real file has it.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FIXED = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
          I64: "<q", F64: "<d"}


def enc(vtype: int, value: object, elem_type: int | None = None) -> bytes:
    """The bytes of a value of `vtype` (an array's elements of `elem_type`), as a GGUF file stores them."""
    if vtype == STR:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return struct.pack("<Q", len(raw)) + raw
    if vtype == ARR:
        items = list(value)
        return struct.pack("<IQ", elem_type, len(items)) + b"".join(enc(elem_type, v) for v in items)
    return struct.pack(_FIXED[vtype], value)


class _Cursor:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> int:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def skip_value(self, vtype: int) -> None:
        if vtype == STR:
            n = self.take("<Q")
            self.pos += n
        elif vtype == ARR:
            elem, count = self.take("<I"), self.take("<Q")
            for _ in range(count):
                self.skip_value(elem)
        else:
            self.pos += struct.calcsize(_FIXED[vtype])


@dataclass
class Header:
    source: Path
    version: int
    kvs: list[tuple[str, int, bytes]]  # (key, value type, value bytes)
    tensor_infos: bytes  # the tensor index, as stored
    n_tensors: int
    data_offset: int
    alignment: int = 32

    @classmethod
    def read(cls, path: Path) -> Header:
        with open(path, "rb") as f:
            buf = f.read(64 << 20)
        c = _Cursor(buf)
        assert buf[:4] == b"GGUF"
        c.pos = 4
        version, n_tensors, n_kv = c.take("<I"), c.take("<Q"), c.take("<Q")
        kvs = []
        for _ in range(n_kv):
            n = c.take("<Q")
            key = buf[c.pos : c.pos + n].decode()
            c.pos += n
            vtype = c.take("<I")
            start = c.pos
            c.skip_value(vtype)
            kvs.append((key, vtype, buf[start : c.pos]))
        start = c.pos
        for _ in range(n_tensors):
            n = c.take("<Q")
            c.pos += n
            n_dims = c.take("<I")
            c.pos += 8 * n_dims + 4 + 8
        alignment = 32
        data_offset = (c.pos + alignment - 1) // alignment * alignment
        return cls(path, version, kvs, buf[start : c.pos], n_tensors, data_offset)

    def get(self, key: str) -> tuple[int, bytes]:
        return next((t, v) for k, t, v in self.kvs if k == key)

    def with_key(self, key: str, vtype: int, raw: bytes) -> Header:
        """A copy with `key` set to the raw value bytes of `vtype` (added at the end if absent)."""
        kvs = [(k, t, v) for k, t, v in self.kvs if k != key]
        at = next((i for i, (k, _, _) in enumerate(self.kvs) if k == key), len(kvs))
        kvs.insert(at, (key, vtype, raw))
        return Header(self.source, self.version, kvs, self.tensor_infos, self.n_tensors, self.data_offset)

    def set(self, key: str, vtype: int, value: object, elem_type: int | None = None) -> Header:
        return self.with_key(key, vtype, enc(vtype, value, elem_type))

    def without(self, key: str) -> Header:
        return Header(self.source, self.version, [kv for kv in self.kvs if kv[0] != key], self.tensor_infos,
                      self.n_tensors, self.data_offset)

    def header_bytes(self) -> bytes:
        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version, self.n_tensors, len(self.kvs)))
        for k, t, v in self.kvs:
            out += struct.pack("<Q", len(k.encode())) + k.encode() + struct.pack("<I", t) + v
        out += self.tensor_infos
        out += b"\0" * (-len(out) % self.alignment)
        return bytes(out)

    def write(self, out: Path, sparse: bool = False) -> Path:
        """The variant: this header, then the source's tensor data (copied in the kernel, not through Python), or
        with `sparse` a hole of the data's size (zero weights: a model that loads and runs, written at once)."""
        head = self.header_bytes()
        size = os.path.getsize(self.source) - self.data_offset
        with open(self.source, "rb") as src, open(out, "wb") as dst:
            dst.write(head)
            dst.flush()
            if sparse:
                dst.truncate(len(head) + size)
            else:
                copy_range(src.fileno(), self.data_offset, dst.fileno(), len(head), size)
        return out


def copy_range(src: int, src_off: int, dst: int, dst_off: int, n: int) -> None:
    while n > 0:
        done = os.copy_file_range(src, dst, n, src_off, dst_off)
        if done <= 0:
            raise OSError("copy_file_range copied nothing")
        src_off, dst_off, n = src_off + done, dst_off + done, n - done


def truncated(source: Path, out: Path, n: int) -> Path:
    with open(source, "rb") as src, open(out, "wb") as dst:
        copy_range(src.fileno(), 0, dst.fileno(), 0, n)
    return out
