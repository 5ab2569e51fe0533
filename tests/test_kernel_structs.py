"""The launch descriptors' numpy mirrors (ATTN_PARAMS, QATTN_PARAMS, TATTN_PARAMS) against the C structs they are
passed as, read from the kernel sources: the same fields in the same order with the same widths, so a field added
on one side only fails here, without a GPU, instead of shifting every later field of a launch. Pure text and numpy:
runs without CuPy."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ninfer.backends.cuda_attention import ATTN_PARAMS
from ninfer.backends.cuda_kv_quant import QATTN_PARAMS
from ninfer.backends.cuda_kv_tiers import TATTN_PARAMS

KERNELS = Path(__file__).resolve().parent.parent / "python" / "ninfer" / "kernels"


def c_struct_fields(source: str, name: str) -> list[tuple[str, str]]:
    """(field, numpy format) of `struct name { ... };` in C source: a pointer is "<u8", int "<i4", float "<f4"."""
    m = re.search(r"struct\s+" + name + r"\s*\{(.*?)\n\};", source, re.S)
    if m is None:
        raise AssertionError(f"struct {name} not found")
    body = re.sub(r"//[^\n]*", "", m.group(1))
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        names = [n.strip() for n in decl.split(",")]
        # the type is the first declarator's words before its name ("const float* q", "int a, b")
        first = names[0]
        type_part, first_name = first.rsplit(" ", 1)
        if first_name.startswith("*"):
            type_part, first_name = type_part + "*", first_name.lstrip("*")
        names[0] = first_name
        for n in names:
            pointer = "*" in type_part or n.startswith("*")
            base = type_part.replace("const", "").replace("*", "").strip()
            if pointer:
                fmt = "<u8"
            elif base in ("int", "int32_t"):
                fmt = "<i4"
            elif base == "float":
                fmt = "<f4"
            else:
                raise AssertionError(f"struct {name}: field {n} of type {base!r} has no mirror rule here")
            fields.append((n.lstrip("*"), fmt))
    return fields


def c_layout_size(fields: list[tuple[str, str]]) -> int:
    """The struct's size by C's rules (each field at a multiple of its width, the whole a multiple of the widest)."""
    at = 0
    for _, fmt in fields:
        w = int(fmt[-1])
        at = -(-at // w) * w + w
    widest = max(int(f[-1]) for _, f in fields)
    return -(-at // widest) * widest


@pytest.mark.parametrize("struct, source, mirror", [
    ("AttnParams", "attention_keys.cu", ATTN_PARAMS),
    ("QAttnParams", "attention_quant.cu", QATTN_PARAMS),
    ("TAttnParams", "attention_tiered.cu", TATTN_PARAMS),
])
def test_each_launch_struct_mirror_matches_its_c_struct(struct: str, source: str, mirror: np.dtype) -> None:
    fields = c_struct_fields((KERNELS / source).read_text(), struct)
    assert [n for n, _ in fields] == list(mirror.names)
    assert [f for _, f in fields] == [mirror.fields[n][0].str for n in mirror.names]
    assert mirror.itemsize == c_layout_size(fields)


def test_the_struct_reader_reads_declarations_and_refuses_types_it_has_no_rule_for() -> None:
    src = "struct P {\n    const float* a;  // a comment, b\n    int n, m;\n    float s;\n};\n"
    fields = c_struct_fields(src, "P")
    assert fields == [("a", "<u8"), ("n", "<i4"), ("m", "<i4"), ("s", "<f4")]
    assert c_layout_size(fields) == 24  # 8 + 4 + 4 + 4, padded to a multiple of 8
    with pytest.raises(AssertionError, match="field d of type 'double' has no mirror rule"):
        c_struct_fields("struct Q {\n    double d;\n};\n", "Q")
