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


@dataclass(frozen=True)
class Layout:
    block_elems: int  # elements per GGML block
    raw_bytes: int  # bytes per block in the file
    gpu_bytes: int  # bytes per block on the GPU
    moves: tuple[tuple[int, int, int], ...]  # (file offset, GPU offset, length) of each span
    act: int
    gsq3: bool = False  # 3-bit GSQ-RCO codes: their bits re-ordered too (gsq3_gpu_planes)


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
    14: Layout(256, 210, 224, ((0, 0, 210),), ACT_Q8_K),  # Q6_K (+14 at the end: 16-byte aligned blocks)
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
    3-bit codes are also re-ordered bit by bit (gsq3_gpu_planes)."""
    bits, slots = (4 if type_id - T_GSQ >= 32 else 3), (type_id - T_GSQ) % 32
    codes = 16 * bits  # bytes of codes: 48 or 64, at offset 12 in the file's record
    raw = 12 + codes + 2 * slots
    moves = ((12, 0, codes), (0, codes, 12)) + (((12 + codes, 12 + codes, 2 * slots),) if slots else ())
    return Layout(128, raw, (raw + 15) // 16 * 16, moves, ACT_GSQ8, gsq3=bits == 3)


def gpu_type(t) -> int:
    """The GPU's type id of a tensor (a TensorEntry): its GGML type, or a GSQ-RCO layout's own id."""
    return gsq_type(*t.gsq) if t.gsq else t.type_id


def layout(type_id: int, name: str) -> Layout:
    from ninfer.errors import UnsupportedModelError

    if type_id >= T_GSQ:
        return _gsq_layout(type_id)
    try:
        return LAYOUTS[type_id]
    except KeyError:
        raise UnsupportedModelError(f"tensor {name}: GGML type {type_id} has no CUDA kernel") from None


def gpu_row_bytes(type_id: int, cols: int) -> int:
    lay = layout(type_id, f"of type {type_id}")
    return cols // lay.block_elems * lay.gpu_bytes


def _gsq3_plane_indices() -> tuple[np.ndarray, np.ndarray]:
    """Which weight of a record each bit of the GPU's 3-bit code bytes holds (kernels/quant.cuh gsq_codes): half h
    of a record (weights 64h..64h + 63), its sub-block t (16 weights), quad k of that (4 weights), byte i of a
    quad: weight w = 64h + 16t + 4k + i. Code bits 0-1 of w are bits 2t, 2t + 1 of byte 16h + 4k + i; bit 2 is bit
    4 (k % 2) + t of byte 32 + 8h + 4 (k // 2) + i. So a lane that takes half h loads its 16 bytes of low bits and
    8 bytes of high bits and nothing of the other half's."""
    lo = np.zeros((32, 4), dtype=np.int64)  # [byte, t] -> weight
    hi = np.zeros((16, 8), dtype=np.int64)  # [byte - 32, bit] -> weight
    for h in range(2):
        for t in range(4):
            for k in range(4):
                for i in range(4):
                    w = 64 * h + 16 * t + 4 * k + i
                    lo[16 * h + 4 * k + i, t] = w
                    hi[8 * h + 4 * (k // 2) + i, 4 * (k % 2) + t] = w
    return lo, hi


GSQ3_LO_WEIGHTS, GSQ3_HI_WEIGHTS = _gsq3_plane_indices()


@functools.cache
def _gsq3_plane_gathers(xp) -> tuple:
    """gsq3_gpu_planes' index arrays, made once per array module (on the device for cupy), not per chunk."""
    w = np.arange(128)
    return (xp.asarray(w % 32), xp.asarray(32 + w % 16), xp.asarray((2 * (w // 32)).astype(np.uint8)),
            xp.asarray((w // 16).astype(np.uint8)), [xp.asarray(GSQ3_LO_WEIGHTS[:, t]) for t in range(4)],
            [xp.asarray(GSQ3_HI_WEIGHTS[:, b]) for b in range(8)])


def gsq3_gpu_planes(codes48, xp=np):
    """[n, 48] 3-bit code bytes as the file has them (plane 0: byte j bits 2t..2t + 1 = bits 0-1 of weight 32t + j;
    plane 1: byte j bit b = bit 2 of weight 16b + j) -> [n, 48] in the GPU's order (_gsq3_plane_indices)."""
    byte0, byte1, shift0, shift1, lo_of, hi_of = _gsq3_plane_gathers(xp)
    lo = (codes48[:, byte0] >> shift0) & np.uint8(3)  # [n, 128]: weight w's bits 0-1
    hi = (codes48[:, byte1] >> shift1) & np.uint8(1)  # bit 2
    out = xp.zeros_like(codes48)
    for t in range(4):
        out[:, :32] |= lo[:, lo_of[t]] << np.uint8(2 * t)
    for b in range(8):
        out[:, 32:] |= hi[:, hi_of[b]] << np.uint8(b)
    return out


def relayout(blocks, lay: Layout, xp=np, chunk: int = 1 << 16):
    """[n_blocks, raw_bytes] file blocks -> [n_blocks, gpu_bytes] in the GPU layout (xp: numpy or cupy). 3-bit
    GSQ-RCO codes are re-ordered `chunk` records at a time (temporaries under 1 KB a record: ~50 MB)."""
    if lay.moves == ((0, 0, lay.raw_bytes),) and lay.gpu_bytes == lay.raw_bytes:
        return blocks
    dst = xp.zeros((blocks.shape[0], lay.gpu_bytes), dtype=xp.uint8)
    for a, b, n in lay.moves:
        dst[:, b : b + n] = blocks[:, a : a + n]
    if lay.gsq3:
        for r in range(0, dst.shape[0], chunk):
            dst[r : r + chunk, :48] = gsq3_gpu_planes(dst[r : r + chunk, :48], xp)
    return dst


def to_gpu(raw: np.ndarray, type_id: int, rows: int, cols: int, name: str):
    """Upload one matrix's file bytes (rows x cols elements of type_id) as a GPU array in the padded layout."""
    import cupy as cp

    lay = layout(type_id, name)
    if cols % lay.block_elems or (lay.block_elems == 32 and cols % 32):
        from ninfer.errors import UnsupportedModelError

        raise UnsupportedModelError(f"tensor {name}: {cols} columns is not a whole number of "
                                    f"{lay.block_elems}-element blocks")
    n_blocks = rows * cols // lay.block_elems
    src = cp.asarray(np.ascontiguousarray(raw).reshape(n_blocks, lay.raw_bytes))
    return relayout(src, lay, cp).reshape(-1)
