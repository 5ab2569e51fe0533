"""llama-quantize's type mixtures (llama.cpp src/llama-quant.cpp, llama_tensor_get_type) for the architectures ninfer
runs (dense: no experts, not Falcon): the type each tensor gets in a Q3_K_S, Q3_K_M, Q4_K_M, ... file, and so the
size of that file for a given model. GSQ-RCO's size presets aim at these budgets; `ninfer synth` writes the
mixtures.
"""

from __future__ import annotations

from collections.abc import Sequence

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ninfer.errors import InvalidArgumentError
from ninfer.models.plan import blocks_present

# The mixture's base type: what every quantizable matrix gets unless a rule below raises it.
MIX_BASE = {"Q3_K_S": Q.Q3_K, "Q3_K_M": Q.Q3_K, "Q3_K_L": Q.Q3_K, "Q4_K_S": Q.Q4_K, "Q4_K_M": Q.Q4_K,
            "Q5_K_S": Q.Q5_K, "Q5_K_M": Q.Q5_K, "Q6_K": Q.Q6_K}
# A type whose block does not divide a row's length falls back to one of 32-weight blocks (tensor_type_fallback).
FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
GGUF_ALIGNMENT = 32


def aligned(n: int) -> int:
    """`n` bytes padded to GGUF's data alignment, as every tensor's data (and the header before them) is."""
    return -(-n // GGUF_ALIGNMENT) * GGUF_ALIGNMENT


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in the _M mixtures: the first and last eighths and every
    third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _quantizable(name: str, dims: Sequence[int]) -> bool:
    return len(dims) >= 2 and name.endswith("weight") and "_norm.weight" not in name


def _layer(name: str) -> int:
    return int(name.split(".")[1])


def mix_type(mix: str, name: str, dims: Sequence[int], n_layer: int, tied: bool) -> Q | None:
    """The type llama-quantize gives tensor `name` (GGML dims, row length first) in a `mix` file, or None where it
    keeps the source's type (vectors, norms). `tied`: the model has no output.weight (the embedding serves as the
    head). Layer counters are the layer index: each of these models has one attn_v and one ffn_down a layer."""
    if mix not in MIX_BASE:
        raise InvalidArgumentError(f"unknown mixture {mix!r} (one of {', '.join(MIX_BASE)})")
    if not _quantizable(name, dims):
        return None
    base = MIX_BASE[mix]
    t = base
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        t = Q.Q8_0 if dims[0] % GGML_QUANT_SIZES[base][0] else Q.Q6_K
    elif name.endswith("attn_v.weight"):
        i = _layer(name)
        if mix == "Q3_K_M":
            t = Q.Q5_K if i < 2 else Q.Q4_K
        elif mix == "Q3_K_L":
            t = Q.Q5_K
        elif mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n_layer):
            t = Q.Q6_K
        elif mix == "Q4_K_S" and i < 4:
            t = Q.Q5_K
    elif name.endswith("ffn_down.weight"):
        i = _layer(name)
        if mix == "Q3_K_M":
            t = Q.Q5_K if i < n_layer // 16 else Q.Q4_K
        elif mix == "Q3_K_L":
            t = Q.Q5_K
        elif mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n_layer):
            t = Q.Q6_K
        elif mix == "Q4_K_S" and i < n_layer // 8:
            t = Q.Q5_K
    elif name.endswith("attn_output.weight"):
        t = {"Q3_K_M": Q.Q4_K, "Q3_K_L": Q.Q5_K}.get(mix, base)
    if dims[0] % GGML_QUANT_SIZES[t][0]:
        t = FALLBACK.get(t, Q.F16)
        if dims[0] % GGML_QUANT_SIZES[t][0]:
            t = Q.F16
    return t


def tensor_bytes(t: Q, dims: Sequence[int]) -> int:
    block, size = GGML_QUANT_SIZES[t]
    n = 1
    for d in dims:
        n *= d
    return n // block * size


def mix_file_bytes(mf: object, mix: str) -> int:
    """The size of llama-quantize's `mix` file made from the model file `mf` (a ninfer.model_file.ModelFile): its
    header as the source has it, then every tensor in its mixture type (or the source's), each padded to 32."""
    tensors = mf.tensors  # type: ignore[attr-defined]
    names = {t.name for t in tensors}
    n_layer = len(blocks_present(names))
    tied = "output.weight" not in names
    total = mf.gguf.data_offset  # type: ignore[attr-defined]
    for t in tensors:
        ty = mix_type(mix, t.name, t.dims, n_layer, tied)
        n = t.n_bytes if ty is None else tensor_bytes(ty, t.dims)
        total += aligned(n)
    return total
