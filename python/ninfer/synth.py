"""Synthetic GGUF models: random weights in the shapes of real models, for speed tests and backend parity where
real weights cannot be shipped (`ninfer synth --shape qwen2.5-1.5b --type Q4_K -o model.gguf`).

Every quantized block is valid and its scales are centred: a block's weights average to zero and have a standard
deviation of about 1/sqrt(fan-in), so activations stay finite through any number of layers. Blocks are built
directly from random bytes (no quantizer runs), and tensors are streamed to disk, so a 32B-shape file needs
little memory beyond one tensor. The vocabulary is the 256 byte tokens of byte-level BPE plus placeholder tokens
up to the real vocabulary size, so the file loads in ninfer and in llama.cpp alike; the text it produces is
meaningless by design.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from ninfer import _core, gsq_file
from ninfer.errors import InvalidArgumentError
from ninfer.quant_mix import FALLBACK, MIX_BASE, mix_type
from ninfer.tokenizer import bytes_to_unicode

Q = GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    tied: bool  # output head shares the token embedding
    arch: str = "qwen2"
    head_dim: int = 0  # 0: n_embd / n_head (gemma3's differ)
    sliding_window: int = 0  # gemma3's local layers (five of every six)


# Qwen2.5 (and Qwen2.5-Coder) and Gemma 3 configurations, from their published config.json files.
SHAPES: dict[str, Shape] = {
    "qwen2.5-0.5b": Shape(896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": Shape(1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-7b": Shape(3584, 28, 28, 4, 18944, 152064, False),
    "qwen2.5-32b": Shape(5120, 64, 40, 8, 27648, 152064, False),
    "gemma3-270m": Shape(640, 18, 4, 1, 2048, 262144, True, "gemma3", 256, 512),
    "gemma3-27b": Shape(5376, 62, 32, 16, 21504, 262208, True, "gemma3", 128, 1024),
}

TYPES: dict[str, GGMLQuantizationType] = {t.name: t for t in (
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)}

# GSQ-RCO models (docs/gsq-rco.md): every layer matrix as version-2 records of 3- or 4-bit codes with two residual
# slots, the token embedding Q4_K and the output head Q6_K (the converter's default policy keeps those two in their
# source types).
GSQ_TYPES = {"GSQ3": 3, "GSQ4": 4}
GSQ_SLOTS = 2



def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _pack_k4_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins ([..., 8] uint8 each)."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    return out


def random_blocks(ty: GGMLQuantizationType, rows: int, cols: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """[rows, row_bytes] of valid, centred blocks of `ty` whose weights have a standard deviation near `sigma`."""
    if ty in (Q.F32, Q.F16, Q.BF16):
        w = rng.standard_normal((rows, cols), dtype=np.float32) * sigma
        if ty == Q.F32:
            return w.view(np.uint8)
        if ty == Q.F16:
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # BF16: truncate
    block, size = GGML_QUANT_SIZES[ty]
    nb = rows * cols // block
    b = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    jitter = rng.uniform(0.75, 1.25, size=nb).astype(np.float32)  # scales vary from block to block
    # Code spread (standard deviation of the integer codes) per type, so that d * spread ~ sigma.
    if ty == Q.Q4_0:  # w = d (q - 8)
        b[:, 0:2] = _f16(sigma / 4.6 * jitter)
    elif ty == Q.Q4_1:  # w = d q + m, q in 0..15
        d = sigma / 4.6 * jitter
        b[:, 0:2], b[:, 2:4] = _f16(d), _f16(-7.5 * d)
    elif ty == Q.Q5_0:  # w = d (q - 16)
        b[:, 0:2] = _f16(sigma / 9.2 * jitter)
    elif ty == Q.Q5_1:  # q in 0..31
        d = sigma / 9.2 * jitter
        b[:, 0:2], b[:, 2:4] = _f16(d), _f16(-15.5 * d)
    elif ty == Q.Q8_0:  # int8 codes
        b[:, 0:2] = _f16(sigma / 73.0 * jitter)
    elif ty == Q.Q2_K:  # w = d sc q - dmin m, q in 0..3, 4-bit sc and m: m = 1.5 sc centres every sub-block
        sc = rng.integers(1, 11, size=(nb, 16), dtype=np.uint8)
        m = np.minimum(np.rint(1.5 * sc), 15).astype(np.uint8)
        b[:, 0:16] = sc | (m << 4)
        d = sigma / (5.5 * 1.12) * jitter
        b[:, 80:82], b[:, 82:84] = _f16(d), _f16(d)
    elif ty == Q.Q3_K:  # w = d (sc - 32) q, q in -4..3; random 6-bit scales are symmetric around 32
        b[:, 108:110] = _f16(sigma / (18.5 * 2.3) * jitter)
    elif ty in (Q.Q4_K, Q.Q5_K):  # w = d sc q - dmin m with m = sc: dmin = mean code * d centres them
        sc = rng.integers(8, 64, size=(nb, 8), dtype=np.uint8)
        spread, mean = (4.6, 7.5) if ty == Q.Q4_K else (9.2, 15.5)
        d = sigma / (spread * 36.0) * jitter
        b[:, 0:2], b[:, 2:4] = _f16(d), _f16(mean * d)
        b[:, 4:16] = _pack_k4_scales(sc, sc)
    elif ty == Q.Q6_K:  # w = d sc (q - 32), int8 scales symmetric around 0
        b[:, 192:208] = rng.integers(-64, 64, size=(nb, 16), dtype=np.int8).view(np.uint8)
        b[:, 208:210] = _f16(sigma / (18.5 * 37.0) * jitter)
    else:
        raise InvalidArgumentError(f"synthetic blocks of type {ty.name} are not supported")
    return b.reshape(rows, cols // block * size)


def random_gsq_records(bits: int, slots: int, rows: int, cols: int, sigma: float,
                       rng: np.random.Generator) -> np.ndarray:
    """[rows, row_bytes] of GSQ-RCO version-2 records (3- or 4-bit codes) whose weights are centred with a standard
    deviation near `sigma`: random codes, sub-block scales 8..15, mins that cancel the codes' mean (dmin a fixed
    multiple of d), random slots with small values. Built from random bytes; no quantizer runs."""
    n = rows * (cols // 128)
    rb = _core.gsq_row_bytes(128, bits=bits, slots=slots)
    rec = rng.integers(0, 256, size=(n, rb), dtype=np.uint8)
    levels = 1 << bits
    mean_c, std_c = (levels - 1) / 2, ((levels * levels - 1) / 12) ** 0.5
    ratio = 4.0 if bits == 3 else 8.0  # dmin / d, so that the mins (< 16) reach sc * mean_c / ratio
    sc = rng.integers(8, 16, size=(n, 8), dtype=np.uint8)
    mn = np.clip(np.rint(sc * mean_c / ratio), 0, 15).astype(np.uint8)
    d = (sigma / (11.5 * std_c) * rng.uniform(0.75, 1.25, size=n)).astype(np.float32)
    rec[:, 0:2] = _f16(d)
    rec[:, 2:4] = _f16(d * ratio)
    rec[:, 4:12] = sc | (mn << 4)
    off = rb - 2 * slots
    if slots:
        rec[:, off::2] = rng.integers(0, 128, size=(n, slots), dtype=np.uint8)
        rec[:, off + 1::2] = rng.integers(-32, 33, size=(n, slots)).astype(np.int8).view(np.uint8)
    return rec.reshape(rows, -1)


# Mixtures named as llama-quantize names them: a base type, with some tensors raised (ninfer/quant_mix.py).
MIXES = tuple(MIX_BASE)


def tensor_type(ty: GGMLQuantizationType, cols: int) -> GGMLQuantizationType:
    block = GGML_QUANT_SIZES[ty][0]
    return ty if cols % block == 0 else FALLBACK.get(ty, Q.Q8_0)


def write_synthetic(path: str | os.PathLike[str], shape: str | Shape, ty: str | GGMLQuantizationType, *,
                    seed: int = 0, n_layer: int | None = None, n_ctx: int = 32768, uneven_keys: bool = False) -> Path:
    """Write a GGUF of `shape` (its architecture: qwen2 or gemma3) with every matrix in `ty` (norms F32); returns
    the path. uneven_keys (F32 only): attn_k's rows of head channel c times 4^(c % 3 - 1), so that a q4_0 or tiered
    KV cache's key scales (rust kv/key_scales.rs) are not all 1 as random rows give them.
    Written to a temporary name and renamed, so an interrupted run leaves no partial file."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise InvalidArgumentError(f"unknown shape '{shape}' (one of {', '.join(SHAPES)})")
        shape = SHAPES[shape]
    mix, gsq_bits = None, 0
    if isinstance(ty, str):
        if ty.upper() in MIXES:
            mix, ty = ty.upper(), Q.Q4_K
        elif ty.upper() in GSQ_TYPES:
            gsq_bits, ty = GSQ_TYPES[ty.upper()], Q.Q4_K
        elif ty.upper() not in TYPES:
            raise InvalidArgumentError(
                f"unknown type '{ty}' (one of {', '.join(list(TYPES) + list(MIXES) + list(GSQ_TYPES))})")
        else:
            ty = TYPES[ty.upper()]
    layers = shape.n_layer if n_layer is None else n_layer
    if uneven_keys and ty != Q.F32:
        raise InvalidArgumentError("uneven_keys takes F32 matrices")
    if layers < 1:
        raise InvalidArgumentError(f"n_layer must be >= 1, got {layers}")
    rng = np.random.default_rng(seed)
    gemma = shape.arch == "gemma3"
    e, hd = shape.n_embd, shape.head_dim or shape.n_embd // shape.n_head
    q, kv = hd * shape.n_head, hd * shape.n_head_kv
    plan: list[tuple[str, int, int, str]] = [("token_embd.weight", shape.n_vocab, e, "w"), ("output_norm.weight", 1, e, "norm")]
    if not shape.tied:
        plan.append(("output.weight", shape.n_vocab, e, "w"))
    for il in range(layers):
        p = f"blk.{il}."
        plan.append((p + "attn_norm.weight", 1, e, "norm"))
        if gemma:  # q and k normed per head; the block's outputs normed before each residual add
            plan += [(p + "attn_q.weight", q, e, "w"), (p + "attn_k.weight", kv, e, "w"),
                     (p + "attn_v.weight", kv, e, "w"), (p + "attn_q_norm.weight", 1, hd, "norm"),
                     (p + "attn_k_norm.weight", 1, hd, "norm"), (p + "post_attention_norm.weight", 1, e, "norm"),
                     (p + "post_ffw_norm.weight", 1, e, "norm")]
        else:  # (each bias after its matrix: the order the random values are drawn in, so qwen2 files stay as they
            # were before the gemma3 shapes, the GPU tests' flip counts included)
            plan += [(p + "attn_q.weight", q, e, "w"), (p + "attn_q.bias", 1, q, "bias"),
                     (p + "attn_k.weight", kv, e, "w"), (p + "attn_k.bias", 1, kv, "bias"),
                     (p + "attn_v.weight", kv, e, "w"), (p + "attn_v.bias", 1, kv, "bias")]
        plan += [(p + "attn_output.weight", e, q, "w"), (p + "ffn_norm.weight", 1, e, "norm"),
                 (p + "ffn_gate.weight", shape.n_ff, e, "w"), (p + "ffn_up.weight", shape.n_ff, e, "w"),
                 (p + "ffn_down.weight", e, shape.n_ff, "w")]

    out = Path(path)
    tmp = out.with_name(out.name + ".partial")
    w = GGUFWriter(str(tmp), shape.arch)
    w.add_name(f"ninfer synthetic {shape.n_embd}x{layers} {mix or (f'GSQ{gsq_bits}' if gsq_bits else ty.name)}")

    def type_of(name: str, cols: int) -> GGMLQuantizationType:
        if gsq_bits:
            return tensor_type(Q.Q6_K if name == "output.weight" else Q.Q4_K, cols)
        if mix:
            return mix_type(mix, name, (cols, 1), layers, shape.tied) or Q.F32
        return tensor_type(ty, cols)

    def is_gsq(name: str, kind: str, cols: int) -> bool:
        return bool(gsq_bits) and kind == "w" and name.startswith("blk.") and cols % 128 == 0

    w.add_block_count(layers)
    w.add_context_length(n_ctx)
    w.add_embedding_length(e)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    if gemma:
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_sliding_window(shape.sliding_window)
    # Byte-level BPE for every shape (gemma3's own vocabulary is SentencePiece): the text is meaningless anyway.
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    # The byte tokens, one merge (tokenizers need at least one) and placeholders up to the vocabulary size.
    chars = bytes_to_unicode()  # (GPT-2's byte-level alphabet)
    tokens = [chars[b] for b in range(256)] + ["ab"] + [f"<synth_{i}>" for i in range(shape.n_vocab - 257)]
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * (shape.n_vocab - 257))
    w.add_token_merges(["a b"])
    w.add_eos_token_id(shape.n_vocab - 1)
    w.add_add_bos_token(False)
    if gsq_bits:  # the GSQ-RCO container: its metadata and a checksummed JSON entry per tensor (ninfer/gsq_file.py)
        gsq_file.add_container_metadata(w, [p[0] for p in plan], residual_bits=8, steps=0, seed=seed,
                                   calibration="none (synthetic records)")
    for name, rows, cols, kind in plan:
        if is_gsq(name, kind, cols):
            row_bytes = _core.gsq_row_bytes(cols, bits=gsq_bits, slots=GSQ_SLOTS)
            w.add_tensor_info(name, (rows, row_bytes), np.dtype(np.int8), rows * row_bytes, Q.I8)
            continue
        t = type_of(name, cols) if kind == "w" else Q.F32
        block, size = GGML_QUANT_SIZES[t]
        row_bytes = cols // block * size  # the writer takes byte shapes for raw types
        w.add_tensor_info(name, (rows, row_bytes) if rows > 1 else (row_bytes,), np.dtype(np.uint8), rows * row_bytes, t)
    infos = []
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, rows, cols, kind in plan:
            dims = [cols] if rows == 1 else [cols, rows]
            if kind == "norm":
                data = (1.0 + 0.1 * rng.standard_normal(cols, dtype=np.float32)).view(np.uint8)
                info = {"shape": dims, "type": "F32", "bpw": 32.0}
            elif kind == "bias":
                data = (0.1 * rng.standard_normal(cols, dtype=np.float32)).view(np.uint8)
                info = {"shape": dims, "type": "F32", "bpw": 32.0}
            elif is_gsq(name, kind, cols):
                data = random_gsq_records(gsq_bits, GSQ_SLOTS, rows, cols, cols ** -0.5, rng)
                info = {"shape": dims, "type": "GSQ-RCO", "bits": gsq_bits, "slots": GSQ_SLOTS,
                        "bpw": round(8 * data.size / (rows * cols), 4), "err": None, "err_rtn": None}
            else:
                t = type_of(name, cols)
                data = random_blocks(t, rows, cols, cols ** -0.5, rng)
                if uneven_keys and name.endswith("attn_k.weight"):
                    m = data.view(np.float32).reshape(rows, cols)
                    m *= (4.0 ** (np.arange(rows) % hd % 3 - 1)).astype(np.float32)[:, None]
                info = {"shape": dims, "type": t.name, "bpw": round(8 * data.size / (rows * cols), 4)}
            if gsq_bits:
                infos.append(gsq_file.tensor_info(data, **info))
            w.write_tensor_data(data)
        w.close()
        if gsq_bits:
            gsq_file.fill_tensor_infos(tmp, infos)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out
