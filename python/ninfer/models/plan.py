"""Build the executor's model spec from GGUF metadata.

The spec is plain data (a dict the Rust binding parses into `ModelSpec`): hyperparameters, which tensor plays
which role in each layer, and the switches in which the supported architectures differ. Key and tensor names come
from the `gguf` package's tables, so this file holds only what is particular to each architecture.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from ninfer.config import RopeConfig
from ninfer.errors import ModelFileError, UnsupportedModelError, shown
from ninfer.models.metadata import (MAX_CONTEXT, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH,
                                    MetadataReader)
from ninfer.models.rope import resolve_rope

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")

# Gemma 3 alternates five sliding-window layers with one global layer; the local layers use their own RoPE base.
GEMMA3_SWA_PERIOD = 6
GEMMA3_ROPE_BASE_LOCAL = 10_000.0


def _tensor(kind: MODEL_TENSOR, layer: int | None = None) -> str:
    name = TENSOR_NAMES[kind]
    return (name.format(bid=layer) if layer is not None else name) + ".weight"


def _bias(kind: MODEL_TENSOR, layer: int) -> str:
    return TENSOR_NAMES[kind].format(bid=layer) + ".bias"


def blocks_present(names: Iterable[str]) -> set[int]:
    """The layer indices that have at least one tensor among `names` (`blk.N.*`)."""
    out = set()
    for name in names:
        head, _, rest = name.partition(".")
        index = rest.partition(".")[0]
        if head == "blk" and index.isdigit() and len(index) < 8:
            out.add(int(index))
    return out


def build_spec(metadata: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]], path: str,
               rope_config: RopeConfig = RopeConfig()) -> dict[str, Any]:
    """The executor spec of a model. `tensors` maps tensor names to GGML dims (row length first); `rope_config`:
    the caller's RoPE flags over the file's keys (models/rope.py)."""
    arch = MetadataReader(metadata, path).text(Keys.General.ARCHITECTURE)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architecture {shown(arch)} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    m = MetadataReader(metadata, path, arch)
    # The layer count sizes everything below: check it against the tensors that exist before building anything.
    n_layer = m.integer(Keys.LLM.BLOCK_COUNT, hi=MAX_LAYERS)
    present = blocks_present(tensors)
    if len(present) != n_layer or (present and max(present) != n_layer - 1):
        raise m.fail(Keys.LLM.BLOCK_COUNT, f"= {n_layer}, but the file has tensors for {len(present)} blocks"
                     + (f" (blk.0 to blk.{max(present)})" if present else ""))
    n_embd = m.integer(Keys.LLM.EMBEDDING_LENGTH, hi=MAX_WIDTH)
    n_head = m.integer(Keys.Attention.HEAD_COUNT, hi=MAX_HEADS, per_layer=True)
    n_head_kv = m.integer(Keys.Attention.HEAD_COUNT_KV, n_head, hi=n_head, per_layer=True)
    if n_head % n_head_kv:
        raise m.fail(Keys.Attention.HEAD_COUNT_KV, f"= {n_head_kv} does not divide the {n_head} query heads")
    head_dim = m.integer(Keys.Attention.KEY_LENGTH, max(n_embd // n_head, 1), hi=MAX_HEAD_DIM)
    head_dim_v = m.integer(Keys.Attention.VALUE_LENGTH, head_dim, hi=MAX_HEAD_DIM)
    rope_dims = m.integer(Keys.Rope.DIMENSION_COUNT, head_dim, hi=head_dim)
    rms_eps = m.number(Keys.Attention.LAYERNORM_RMS_EPS, lo=0.0, hi=1.0)
    n_ctx_train = m.integer(Keys.LLM.CONTEXT_LENGTH, 4096, hi=MAX_CONTEXT)
    rope = resolve_rope(m, rope_config)
    window = m.integer(Keys.Attention.SLIDING_WINDOW, hi=MAX_CONTEXT) if arch == "gemma3" else None

    token_embd = _tensor(MODEL_TENSOR.TOKEN_EMBD)
    if token_embd not in tensors:
        raise ModelFileError(f"{path}: tensor {token_embd} is missing")
    embd_dims = tuple(tensors[token_embd])
    if len(embd_dims) != 2 or embd_dims[0] != n_embd or not 0 < embd_dims[1] <= MAX_VOCAB:
        raise ModelFileError(f"{path}: tensor {token_embd} has shape {list(embd_dims)}, expected [{n_embd}, n_vocab] "
                             f"with n_vocab up to {MAX_VOCAB}")
    n_vocab = int(embd_dims[1])
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > n_vocab:
        raise ModelFileError(f"{path}: metadata key tokenizer.ggml.tokens has {len(tokens)} entries, more than the "
                             f"{n_vocab} rows of {token_embd}")
    output = _tensor(MODEL_TENSOR.OUTPUT)
    is_gemma = arch == "gemma3"
    has_bias = arch == "qwen2"

    layers = []
    for il in range(n_layer):
        swa = is_gemma and (il + 1) % GEMMA3_SWA_PERIOD != 0
        layer: dict[str, Any] = {
            "attn_norm": _tensor(MODEL_TENSOR.ATTN_NORM, il),
            "wq": _tensor(MODEL_TENSOR.ATTN_Q, il),
            "wk": _tensor(MODEL_TENSOR.ATTN_K, il),
            "wv": _tensor(MODEL_TENSOR.ATTN_V, il),
            "wo": _tensor(MODEL_TENSOR.ATTN_OUT, il),
            "ffn_norm": _tensor(MODEL_TENSOR.FFN_NORM, il),
            "w_gate": _tensor(MODEL_TENSOR.FFN_GATE, il),
            "w_up": _tensor(MODEL_TENSOR.FFN_UP, il),
            "w_down": _tensor(MODEL_TENSOR.FFN_DOWN, il),
            "sliding_window": window if swa else None,
            "rope_base": GEMMA3_ROPE_BASE_LOCAL if swa else rope.freq_base,
            "rope_freq_scale": 1.0 if swa else rope.freq_scale,
        }
        if has_bias:
            layer |= {
                "bq": _bias(MODEL_TENSOR.ATTN_Q, il),
                "bk": _bias(MODEL_TENSOR.ATTN_K, il),
                "bv": _bias(MODEL_TENSOR.ATTN_V, il),
            }
        if is_gemma:
            layer |= {
                "q_norm": _tensor(MODEL_TENSOR.ATTN_Q_NORM, il),
                "k_norm": _tensor(MODEL_TENSOR.ATTN_K_NORM, il),
                "post_attn_norm": _tensor(MODEL_TENSOR.ATTN_POST_NORM, il),
                "post_ffn_norm": _tensor(MODEL_TENSOR.FFN_POST_NORM, il),
            }
        layers.append(layer)

    return {
        "arch": arch,
        "n_embd": n_embd,
        "n_head": n_head,
        "n_head_kv": n_head_kv,
        "head_dim": head_dim,
        "head_dim_v": head_dim_v,
        "n_vocab": n_vocab,
        "rms_eps": rms_eps,
        "rope_dims": rope_dims,
        # llama keeps the original interleaved RoPE layout (its converter permutes q/k); the others use NeoX's.
        "rope_neox": arch != "llama",
        "rope_yarn": rope.yarn,
        "activation": "gelu_tanh" if is_gemma else "silu",
        "embd_scale": math.sqrt(n_embd) if is_gemma else 1.0,
        # Gemma 3 scales q by 1/sqrt(head_dim) itself and calls attention with scale 1.
        "q_scale": 1.0 / math.sqrt(head_dim) if is_gemma else 1.0,
        "attn_scale": 1.0 if is_gemma else 1.0 / math.sqrt(head_dim),
        "token_embd": token_embd,
        "output_norm": _tensor(MODEL_TENSOR.OUTPUT_NORM),
        "output": output if output in tensors else token_embd,
        "layers": layers,
        "n_ctx_train": rope.n_ctx_train or n_ctx_train,
    }
