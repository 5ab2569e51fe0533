"""The GGML block formats of ninfer._core against gguf-py's numpy implementation and numpy references.

- dequantize: every weight type, random valid blocks, equal to gguf.quants.dequantize;
- quantize_act / quantize_row: byte-exact with gguf's (llama.cpp-exact) quantizers and numpy references of
  llama.cpp's quantize_row_q8_1_ref / quantize_row_q8_K_ref;
- vec_dot: every weight type against numpy's dot product of the dequantized rows;
- argument errors raise ValueError.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from ninfer import _core

WEIGHT_TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
ALL_TYPES = WEIGHT_TYPES + [T.Q8_1, T.Q8_K]

# llama.cpp's CPU vec_dot_type of each weight type.
ACT_TYPE = {
    T.F32: T.F32,
    T.F16: T.F16,
    T.BF16: T.BF16,
    T.Q4_0: T.Q8_0,
    T.Q5_0: T.Q8_0,
    T.Q8_0: T.Q8_0,
    T.Q4_1: T.Q8_1,
    T.Q5_1: T.Q8_1,
    T.Q2_K: T.Q8_K,
    T.Q3_K: T.Q8_K,
    T.Q4_K: T.Q8_K,
    T.Q5_K: T.Q8_K,
    T.Q6_K: T.Q8_K,
}

# Byte offsets of the f16 scale fields (d, dmin, m, s) in one block.
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q5_0: [0],
    T.Q8_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_1: [0, 2],
    T.Q8_1: [0, 2],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}

ROW_COUNTS = [1, 3, 5]


def random_rows(qtype: T, rows: int, blocks_per_row: int, rng: np.random.Generator) -> np.ndarray:
    """`rows` rows of random valid blocks, shape (rows, bytes per row): random bits with sane scales."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n = block_size * blocks_per_row
    if qtype in (T.F32, T.F16, T.BF16):
        x = rng.standard_normal((rows, n)).astype(np.float32)
        if qtype == T.F32:
            return x.view(np.uint8)
        if qtype == T.F16:
            return x.astype(np.float16).view(np.uint8)
        return gguf_quantize(x, T.BF16).view(np.uint8)
    nb = rows * blocks_per_row
    blocks = rng.integers(0, 256, size=(nb, type_size), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, []):
        sign = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=nb)
        vals = (rng.uniform(0.01, 0.1, size=nb).astype(np.float32) * sign).astype(np.float16)
        blocks[:, off : off + 2] = vals.view(np.uint8).reshape(nb, 2)
    if qtype == T.Q8_K:
        blocks[:, 0:4] = rng.uniform(0.01, 0.1, size=nb).astype(np.float32).view(np.uint8).reshape(nb, 4)
    return blocks.reshape(rows, blocks_per_row * type_size)


def blocks_per_row_for(qtype: T) -> int:
    block_size = GGML_QUANT_SIZES[qtype][0]
    return {1: 64, 32: 12, 256: 3}[block_size]


# ---------------------------------------------------------------------------------------------------------------
# numpy references for the activation formats gguf-py does not implement
# ---------------------------------------------------------------------------------------------------------------


def ref_quantize_q8_0(x: np.ndarray) -> bytes:
    """llama.cpp's x86 (AVX2) quantize_row_q8_0, the code that runs for activations and q8_0 KV on such machines:
    d = amax / 127, q = round_half_even(x * (127 / amax)). (gguf-py implements the scalar reference, which
    multiplies by 1 / d and rounds halves away from zero.)"""
    blocks = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    qs = np.rint((blocks * inv[:, None]).astype(np.float32)).astype(np.int8)
    out = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), qs.view(np.uint8)], axis=1)
    return out.tobytes()


def ref_quantize_q8_1(x: np.ndarray) -> bytes:
    """The x86 quantize_row_q8_1: Q8_0's quants plus s = f16(d * sum(q)) with the f32 d."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    q8_0 = np.frombuffer(ref_quantize_q8_0(blocks), dtype=np.uint8).reshape(-1, 34)
    d = (np.abs(blocks).max(axis=1) / np.float32(127)).astype(np.float32)
    qs = q8_0[:, 2:].view(np.int8)
    s = (qs.astype(np.int32).sum(axis=1).astype(np.float32) * d).astype(np.float16)
    out = np.concatenate([q8_0[:, :2], s.view(np.uint8).reshape(-1, 2), q8_0[:, 2:]], axis=1)
    return out.tobytes()


def ref_quantize_q8_k(x: np.ndarray) -> bytes:
    """llama.cpp quantize_row_q8_K_ref: iscale = -127 / (signed absmax), nearest_int = round half to even."""
    out = []
    for blk in x.astype(np.float32).reshape(-1, 256):
        amax_i = int(np.argmax(np.abs(blk)))  # first index of the largest magnitude
        vmax = blk[amax_i]
        if vmax == 0:
            out.append(np.zeros(292, dtype=np.uint8))
            continue
        iscale = np.float32(-127.0) / vmax
        q = np.minimum(127, np.rint(iscale * blk)).astype(np.int8)
        bsums = q.reshape(16, 16).astype(np.int32).sum(axis=1).astype(np.int16)
        d = np.float32(1.0) / iscale
        out.append(np.concatenate([np.array([d], np.float32).view(np.uint8), q.view(np.uint8), bsums.view(np.uint8)]))
    return np.concatenate(out).tobytes()


def ref_dequantize(qtype: T, data: bytes) -> np.ndarray:
    """Decode an activation (or any gguf-supported) row with numpy / gguf-py only."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if qtype == T.Q8_1:
        blocks = raw.reshape(-1, 36)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        return (blocks[:, 4:].view(np.int8).astype(np.float32) * d).reshape(-1)
    if qtype == T.Q8_K:
        blocks = raw.reshape(-1, 292)
        d = blocks[:, 0:4].copy().view(np.float32)
        return (blocks[:, 4:260].view(np.int8).astype(np.float32) * d).reshape(-1)
    return np.asarray(gguf_dequantize(raw.reshape(1, -1).copy(), qtype), dtype=np.float32).reshape(-1)


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_type_info_matches_gguf(qtype: T) -> None:
    name, block_size, type_size = _core.type_info(int(qtype))
    assert name == qtype.name
    # gguf-py's table still has the old Q8_1 with f32 d and s (40 bytes); today's ggml-common.h has two f16s.
    expected = (32, 36) if qtype == T.Q8_1 else GGML_QUANT_SIZES[qtype]
    assert (block_size, type_size) == expected


@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("qtype", WEIGHT_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype: T, rows: int) -> None:
    rng = np.random.default_rng(1000 * int(qtype) + rows)
    nbr = blocks_per_row_for(qtype)
    n = GGML_QUANT_SIZES[qtype][0] * nbr
    data = random_rows(qtype, rows, nbr, rng)
    expected = np.asarray(gguf_dequantize(data, qtype), dtype=np.float32).reshape(rows, n)
    assert np.isfinite(expected).all()
    for r in range(rows):
        got = _core.dequantize(int(qtype), data[r].tobytes(), n)
        assert got.dtype == np.float32 and got.shape == (n,)
        np.testing.assert_allclose(got, expected[r], rtol=1e-6, atol=1e-7)
    # The whole buffer as one long row gives the same numbers.
    whole = _core.dequantize(int(qtype), data.tobytes(), rows * n)
    np.testing.assert_allclose(whole, expected.reshape(-1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_dequantize_q8_k(rows: int) -> None:
    rng = np.random.default_rng(rows)
    data = random_rows(T.Q8_K, rows, 2, rng)
    for r in range(rows):
        got = _core.dequantize(int(T.Q8_K), data[r].tobytes(), 512)
        np.testing.assert_allclose(got, ref_dequantize(T.Q8_K, data[r].tobytes()), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_quantize_act_q8_0_is_bit_exact(rows: int) -> None:
    rng = np.random.default_rng(7 + rows)
    x = (rng.standard_normal((rows, 32 * 9)) * rng.uniform(0.01, 10.0, size=(rows, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    x[0, 32:64] = 0.0  # a block with scale exactly 1 and halves to round (to even)
    x[0, 32:36] = [127.0, 2.5, -2.5, 0.5]
    for r in range(rows):
        expected = ref_quantize_q8_0(x[r])
        assert _core.quantize_act(int(T.Q8_0), x[r]) == expected
        assert _core.quantize_row(int(T.Q8_0), x[r]) == expected


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_quantize_row_legacy_is_bit_exact(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    for r in range(5):
        x = (rng.standard_normal(32 * 7) * (r + 0.5)).astype(np.float32)
        assert _core.quantize_row(int(qtype), x) == gguf_quantize(x, qtype).tobytes()


def test_quantize_act_q8_1_and_q8_k_are_bit_exact() -> None:
    rng = np.random.default_rng(3)
    for r in range(3):
        x = (rng.standard_normal(256 * 3) * (r + 0.1)).astype(np.float32)
        if r == 1:
            x[256:512] = 0.0
        if r == 2:
            x[0] = -x[np.argmax(np.abs(x[:256]))] * 2  # a negative extreme
        assert _core.quantize_act(int(T.Q8_1), x) == ref_quantize_q8_1(x)
        assert _core.quantize_act(int(T.Q8_K), x) == ref_quantize_q8_k(x)


def test_quantize_float_types_are_bit_exact() -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(333) * 100).astype(np.float32)
    x[:4] = [1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 65520.0, 1e-8]  # f16 ties and overflow
    with np.errstate(over="ignore"):  # 65520 rounds to +inf, as it should
        x16 = x.astype(np.float16).tobytes()
    assert _core.quantize_act(int(T.F32), x) == x.tobytes()
    assert _core.quantize_act(int(T.F16), x) == x16
    assert _core.quantize_act(int(T.BF16), x) == gguf_quantize(x, T.BF16).tobytes()
    assert _core.quantize_row(int(T.F16), x) == x16


def test_quantize_row_rejects_k_quants() -> None:
    # ninfer.errors.UnsupportedModelError, a ValueError.
    with pytest.raises(ValueError, match="Q4_K"):
        _core.quantize_row(int(T.Q4_K), np.zeros(256, dtype=np.float32))


@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("qtype", WEIGHT_TYPES, ids=lambda t: t.name)
def test_vec_dot_matches_numpy(qtype: T, rows: int) -> None:
    rng = np.random.default_rng(77 * int(qtype) + rows)
    nbr = blocks_per_row_for(qtype)
    n = GGML_QUANT_SIZES[qtype][0] * nbr
    act_type = ACT_TYPE[qtype]
    w = random_rows(qtype, rows, nbr, rng)
    w_deq = np.asarray(gguf_dequantize(w, qtype), dtype=np.float64).reshape(rows, n)
    x = rng.standard_normal(n).astype(np.float32)
    act = _core.quantize_act(int(act_type), x)
    a_deq = ref_dequantize(act_type, act).astype(np.float64)
    for r in range(rows):
        got = _core.vec_dot(int(qtype), n, w[r].tobytes(), act)
        expected = float(w_deq[r] @ a_deq)
        scale = float(np.abs(w_deq[r]) @ np.abs(a_deq))
        assert abs(got - expected) <= 1e-4 * scale + 1e-6, (got, expected, scale)
        # Activation quantization error only: close to the float dot product too.
        assert abs(got - float(w_deq[r] @ x.astype(np.float64))) <= 0.02 * scale + 1e-6


def test_argument_errors_raise_value_error() -> None:
    x = np.zeros(32, dtype=np.float32)
    q8 = _core.quantize_act(int(T.Q8_0), x)
    for bad_id in (4, 5, 16, 99, -1, 2**40):
        with pytest.raises(ValueError):
            _core.type_info(bad_id)
        with pytest.raises(ValueError):
            _core.dequantize(bad_id, b"\0" * 18, 32)
        with pytest.raises(ValueError):
            _core.vec_dot(bad_id, 32, b"\0" * 18, q8)
        with pytest.raises(ValueError):
            _core.quantize_act(bad_id, x)
        with pytest.raises(ValueError):
            _core.quantize_row(bad_id, x)
    with pytest.raises(ValueError):
        _core.dequantize(int(T.Q4_0), b"\0" * 17, 32)  # short
    with pytest.raises(ValueError):
        _core.dequantize(int(T.Q4_0), b"\0" * 36, 33)  # not whole blocks
    with pytest.raises(ValueError):
        _core.dequantize(int(T.Q4_0), b"\0" * 18, -32)
    with pytest.raises(ValueError):
        _core.vec_dot(int(T.Q4_0), 32, b"\0" * 18, q8[:-1])  # short activations
    with pytest.raises(ValueError):
        _core.vec_dot(int(T.Q4_0), 32, b"\0" * 20, q8)  # long weights
    with pytest.raises(ValueError):
        _core.quantize_act(int(T.Q4_0), x)  # not an activation type
    with pytest.raises(ValueError):
        _core.quantize_act(int(T.Q8_0), np.zeros(31, dtype=np.float32))
    with pytest.raises(ValueError):
        _core.quantize_row(int(T.Q8_0), np.zeros(33, dtype=np.float32))


def test_non_contiguous_input() -> None:
    x = np.arange(64, dtype=np.float32)[::2] / 7
    assert _core.quantize_act(int(T.Q8_0), x) == ref_quantize_q8_0(np.ascontiguousarray(x))
