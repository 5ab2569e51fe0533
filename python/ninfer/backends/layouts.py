"""Weight block layouts on the GPU: GGML's blocks with padding inserted so every int-loaded field is 4-byte
aligned (kernels/quant.cuh reads these offsets), and the activation kind each weight type multiplies with (the
CPU backend's act_type, so the GPU's integer dot products see the CPU's activation quants)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

# Activation kinds (kernels/common.cuh ACT_*).
ACT_F32, ACT_F16, ACT_BF16, ACT_Q8_0, ACT_Q8_1, ACT_Q8_K, ACT_GSQ8 = range(7)
ACT_GSQ8_PAIRS = 7  # ACT_GSQ8's codes padded to 144 bytes a record, for the lane-pair kernel (common.cuh)
T_GSQ = 256  # GPU type ids of GSQ-RCO matrices: T_GSQ + 32 * (bits - 3) + slots (kernels/common.cuh)
T_Q6_K = 14  # (LAYOUTS' key: the streamed head's rule and its planar rows name it)
T_Q6_K_PLANAR = 240  # a Q6_K output head re-laid by row for the streamed head (q6k_planar; kernels/common.cuh)


@dataclass(frozen=True)
class Layout:
    block_elems: int  # elements per GGML block
    raw_bytes: int  # bytes per block in the file
    gpu_bytes: int  # bytes per block on the GPU
    moves: tuple[tuple[int, int, int], ...]  # (file offset, GPU offset, length) of each span
    act: int
    gsq3: bool = False  # 3-bit GSQ-RCO codes: their bits re-ordered too (gsq3_gpu_order)
    rotated: bool = False  # 64-byte 3-bit GSQ-RCO records: each rotated by gsq3_rotation of its index in the row


def _same(elems: int, size: int, act: int) -> Layout:
    return Layout(elems, size, size, ((0, 0, size),), act)


# By GGML type id. F32/F16/BF16 are rows of plain numbers; their "block" is one 32-element unit.
LAYOUTS: dict[int, Layout] = {
    0: _same(32, 128, ACT_F32),
    1: _same(32, 64, ACT_F16),
    30: _same(32, 64, ACT_BF16),
    2: Layout(32, 18, 20, ((0, 0, 2), (2, 4, 16)), ACT_Q8_0),  # Q4_0: d | pad | qs
    3: _same(32, 20, ACT_Q8_1),  # Q4_1
    6: Layout(32, 22, 24, ((0, 0, 2), (2, 4, 20)), ACT_Q8_0),  # Q5_0: d | pad | qh | qs
    7: _same(32, 24, ACT_Q8_1),  # Q5_1
    8: Layout(32, 34, 36, ((0, 0, 2), (2, 4, 32)), ACT_Q8_0),  # Q8_0: d | pad | qs
    10: _same(256, 84, ACT_Q8_K),  # Q2_K
    11: Layout(256, 110, 112, ((0, 0, 110),), ACT_Q8_K),  # Q3_K (+2 at the end)
    12: _same(256, 144, ACT_Q8_K),  # Q4_K
    13: _same(256, 176, ACT_Q8_K),  # Q5_K
    T_Q6_K: Layout(256, 210, 224, ((0, 0, 210),), ACT_Q8_K),  # Q6_K (+14 at the end: 16-byte aligned blocks)
}

# How each activation kind is stored: bytes per element of the quants/values, and whether it has unit scales.
QUANTIZED_ACTS = (ACT_Q8_0, ACT_Q8_1, ACT_Q8_K, ACT_GSQ8)


def gsq_type(bits: int, slots: int) -> int:
    return T_GSQ + 32 * (bits - 3) + slots


def gsq_pairs_type(type_id: int) -> bool:
    """3-bit GSQ-RCO with at most two slots (64-byte records): the GEMV takes these by lane pairs."""
    return T_GSQ <= type_id <= T_GSQ + 2


def _gsq_layout(type_id: int) -> Layout:
    """A GSQ-RCO record (docs/gsq-rco.md, version 2) re-laid for the GPU (kernels/quant.cuh): codes first, then
    d, dmin, the scale bytes and the slots, padded to 16 bytes, so the header is one aligned 16-byte vector.
    3-bit codes are also re-ordered bit by bit (gsq3_gpu_order)."""
    bits, slots = (4 if type_id - T_GSQ >= 32 else 3), (type_id - T_GSQ) % 32
    codes = 16 * bits  # bytes of codes: 48 or 64, at offset 12 in the file's record
    raw = 12 + codes + 2 * slots
    moves = ((12, 0, codes), (0, codes, 12)) + (((12 + codes, 12 + codes, 2 * slots),) if slots else ())
    gpu = (raw + 15) // 16 * 16
    return Layout(128, raw, gpu, moves, ACT_GSQ8, gsq3=bits == 3, rotated=bits == 3 and gpu == 64)


def gpu_type(t) -> int:
    """The GPU's type id of a tensor (a TensorEntry): its GGML type, or a GSQ-RCO layout's own id."""
    return gsq_type(*t.gsq) if t.gsq else t.type_id


def layout(type_id: int, name: str) -> Layout:
    """A GPU type's block layout (T_Q6_K_PLANAR: Q6_K's blocks and activation; its rows are q6k_planar's)."""
    from ninfer.errors import UnsupportedModelError

    if type_id == T_Q6_K_PLANAR:
        type_id = T_Q6_K
    if type_id >= T_GSQ:
        return _gsq_layout(type_id)
    try:
        return LAYOUTS[type_id]
    except KeyError:
        raise UnsupportedModelError(f"tensor {name}: GGML type {type_id} has no CUDA kernel") from None


def gpu_row_bytes(type_id: int, cols: int) -> int:
    if type_id == T_Q6_K_PLANAR:  # the file's bytes, the row padded to 16
        return -(-cols // 256 * 210 // 16) * 16
    lay = layout(type_id, f"of type {type_id}")
    return cols // lay.block_elems * lay.gpu_bytes


def _gsq3_bit_sources() -> tuple[np.ndarray, np.ndarray]:
    """Which weight of a record, and which bit of its 3-bit code, each bit of the GPU's 48 code bytes holds
    (kernels/quant.cuh gsq3_unit_words): [384] weight and [384] code bit, GPU bit 8 B + b = bit b of byte B.

    Each 32-weight unit j (half h = j // 2 of the record, v = j % 2) owns three words: W0 at byte 32 h + 8 v, W1
    at 32 h + 8 v + 4, W2 at 16 + 8 h + 4 v, so half h is the 16-byte vector at 32 h and the 8 bytes at 16 + 8 h.
    Quad k of the unit (weights 32 j + 4 k + i, i = 0..3) sits in byte i of the words: k = 0, 1, 2 whole at bits
    0-2 of W_k; k = 3, 4, 5 whole at bits 3-5 of W_(k-3); k = 6, 7 with code bits 0-1 at bits 6-7 of W_(k-6) and
    bit 2 at bit k of W2. A kernel masks four codes out of a word with one AND (times 1, 8 or 64 for its dot)."""
    weight = np.full(384, -1, dtype=np.int64)
    code_bit = np.zeros(384, dtype=np.int64)

    def put(byte: int, bit: int, w: int, cb: int) -> None:
        assert weight[8 * byte + bit] < 0
        weight[8 * byte + bit], code_bit[8 * byte + bit] = w, cb

    for j in range(4):
        h, v = divmod(j, 2)
        words = (32 * h + 8 * v, 32 * h + 8 * v + 4, 16 + 8 * h + 4 * v)
        for k in range(8):
            for i in range(4):
                w = 32 * j + 4 * k + i
                if k < 6:
                    for cb in range(3):
                        put(words[k % 3] + i, 3 * (k // 3) + cb, w, cb)
                else:
                    put(words[k - 6] + i, 6, w, 0)
                    put(words[k - 6] + i, 7, w, 1)
                    put(words[2] + i, k, w, 2)
    assert (weight >= 0).all()
    return weight, code_bit


GSQ3_BIT_WEIGHT, GSQ3_BIT_CODE_BIT = _gsq3_bit_sources()


@functools.cache
def _gsq3_gathers(xp) -> tuple:
    """gsq3_gpu_order's index arrays, made once per array module (on the device for cupy), not per chunk."""
    w = GSQ3_BIT_WEIGHT
    # the file's planes (docs/gsq-rco.md): bits 0-1 of weight w at bits 2 (w // 32) of byte w % 32, bit 2 at bit
    # w // 16 of byte 32 + w % 16
    src_byte = np.where(GSQ3_BIT_CODE_BIT < 2, w % 32, 32 + w % 16)
    src_shift = np.where(GSQ3_BIT_CODE_BIT < 2, 2 * (w // 32) + GSQ3_BIT_CODE_BIT, w // 16)
    weights = (1 << np.arange(8)).astype(np.uint8)
    return xp.asarray(src_byte), xp.asarray(src_shift.astype(np.uint8)), xp.asarray(weights)


def gsq3_gpu_order(codes48, xp=np):
    """[n, 48] 3-bit code bytes as the file has them (plane 0: byte j bits 2t..2t + 1 = bits 0-1 of weight 32t + j;
    plane 1: byte j bit b = bit 2 of weight 16b + j) -> [n, 48] in the GPU's order (_gsq3_bit_sources)."""
    src_byte, src_shift, weights = _gsq3_gathers(xp)
    bits = (codes48[:, src_byte] >> src_shift) & np.uint8(1)  # [n, 384]: GPU bit 8 B + b
    return (bits.reshape(-1, 48, 8) * weights).sum(axis=2, dtype=np.uint8)


def gsq3_rotation(rec):
    """Bytes a 64-byte 3-bit record is rotated by on the GPU, by its index in its row (kernels/quant.cuh
    gsq3_rot): 16 times bits 1-2 of it. A kernel's lanes read consecutive records at one offset each; 64-byte
    records put that offset at only two bank positions of shared memory, rotated at eight (kernels/gemv_stream.cu)."""
    return (rec & 6) << 3


def relayout(blocks, lay: Layout, xp=np, chunk: int = 1 << 16, per_row: int = 0):
    """[n_blocks, raw_bytes] file blocks -> [n_blocks, gpu_bytes] in the GPU layout (xp: numpy or cupy). 3-bit
    GSQ-RCO codes are re-ordered `chunk` records at a time (temporaries under 1 KB a record: ~50 MB); 64-byte
    records are also rotated (gsq3_rotation of their index in the row: per_row records a row)."""
    if lay.moves == ((0, 0, lay.raw_bytes),) and lay.gpu_bytes == lay.raw_bytes:
        return blocks
    if lay.rotated and per_row <= 0:
        raise ValueError("relayout: rotated records need per_row, the records of a row")
    dst = xp.zeros((blocks.shape[0], lay.gpu_bytes), dtype=xp.uint8)
    for a, b, n in lay.moves:
        dst[:, b : b + n] = blocks[:, a : a + n]
    if lay.gsq3:
        for r in range(0, dst.shape[0], chunk):
            part = dst[r : r + chunk]
            part[:, :48] = gsq3_gpu_order(part[:, :48], xp)
            if lay.rotated:
                rotate_gsq3(part, r, per_row, xp)
    return dst


def rotate_gsq3(records, first: int, per_row: int, xp=np) -> None:
    """Rotate [n, 64] records in place, the i-th being record first + i of rows of per_row records: byte o to
    (o + gsq3_rotation(its index in the row)) % 64."""
    rot = gsq3_rotation(xp.arange(first, first + records.shape[0]) % per_row)
    for k in (16, 32, 48):
        sel = xp.nonzero(rot == k)[0]
        records[sel] = xp.roll(records[sel], k, axis=1)


def q6k_planar(blocks, rows: int, cols: int, xp=np):
    """[rows * cols / 256, 210] Q6_K file blocks -> [rows, gpu_row_bytes(T_Q6_K_PLANAR, cols)] rows in the planar
    layout (kernels/common.cuh T_Q6_K_PLANAR): each row's ql bytes (128 a block), then its qh (64), its scales (16)
    and its d's (2), zeros to the row's end."""
    nb = cols // 256
    b = blocks.reshape(rows, nb, 210)
    dst = xp.zeros((rows, gpu_row_bytes(T_Q6_K_PLANAR, cols)), dtype=xp.uint8)
    at = 0
    for start, size in ((0, 128), (128, 64), (192, 16), (208, 2)):  # ql, qh, scales, d
        dst[:, at : at + nb * size] = b[:, :, start : start + size].reshape(rows, nb * size)
        at += nb * size
    return dst


def to_gpu(raw: np.ndarray, type_id: int, rows: int, cols: int, name: str):
    """Upload one matrix's file bytes (rows x cols elements of type_id) as a GPU array in the padded layout (or
    T_Q6_K_PLANAR's, a Q6_K matrix's rows re-laid by q6k_planar, 8,192 rows at a time)."""
    import cupy as cp

    if type_id == T_Q6_K_PLANAR:
        if cols % 256:
            from ninfer.errors import UnsupportedModelError

            raise UnsupportedModelError(f"tensor {name}: {cols} columns is not a whole number of 256-element blocks")
        raw = np.ascontiguousarray(raw).reshape(rows, -1)
        out = cp.empty((rows, gpu_row_bytes(type_id, cols)), dtype=cp.uint8)
        for r in range(0, rows, 8192):
            out[r : r + 8192] = q6k_planar(cp.asarray(raw[r : r + 8192]), min(8192, rows - r), cols, cp)
        return out.reshape(-1)
    lay = layout(type_id, name)
    if cols % lay.block_elems or (lay.block_elems == 32 and cols % 32):
        from ninfer.errors import UnsupportedModelError

        raise UnsupportedModelError(f"tensor {name}: {cols} columns is not a whole number of "
                                    f"{lay.block_elems}-element blocks")
    n_blocks = rows * cols // lay.block_elems
    src = cp.asarray(np.ascontiguousarray(raw).reshape(n_blocks, lay.raw_bytes))
    return relayout(src, lay, cp, per_row=cols // lay.block_elems).reshape(-1)
