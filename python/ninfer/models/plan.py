"""Build the executor's model spec from GGUF metadata.

The spec is plain data (a dict the Rust binding parses into `ModelSpec`): hyperparameters, which tensor plays
which role in each layer, and the switches in which the supported architectures differ. Key and tensor names come
from the `gguf` package's tables, so this file holds only what is particular to each architecture.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from ninfer.errors import ModelFileError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")

# Gemma 3 alternates five sliding-window layers with one global layer; the local layers use their own RoPE base.
GEMMA3_SWA_PERIOD = 6
GEMMA3_ROPE_BASE_LOCAL = 10_000.0


def _tensor(kind: MODEL_TENSOR, layer: int | None = None) -> str:
    name = TENSOR_NAMES[kind]
    return (name.format(bid=layer) if layer is not None else name) + ".weight"


def _bias(kind: MODEL_TENSOR, layer: int) -> str:
    return TENSOR_NAMES[kind].format(bid=layer) + ".bias"


class _Meta:
    """Typed access to `{arch}.*` keys with errors that name the key and the file."""

    def __init__(self, metadata: Mapping[str, Any], arch: str, path: str):
        self.md, self.arch, self.path = metadata, arch, path

    def get(self, key_template: str, default: Any = None) -> Any:
        return self.md.get(key_template.format(arch=self.arch), default)

    def require(self, key_template: str) -> Any:
        key = key_template.format(arch=self.arch)
        if key not in self.md:
            raise ModelFileError(f"{self.path}: metadata key {key} is missing")
        return self.md[key]

    def positive_int(self, key_template: str, default: int | None = None) -> int:
        value = self.get(key_template, default) if default is not None else self.require(key_template)
        if isinstance(value, list):  # per-layer arrays: all supported models use one value
            value = value[0] if value and all(v == value[0] for v in value) else None
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelFileError(f"{self.path}: {key_template.format(arch=self.arch)} = {value!r} is not a positive integer")
        return value


def build_spec(metadata: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]], path: str) -> dict[str, Any]:
    """The executor spec of a model. `tensors` maps tensor names to GGML dims (row length first)."""
    arch = metadata.get(Keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: metadata key {Keys.General.ARCHITECTURE} is missing")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    m = _Meta(metadata, arch, path)
    n_layer = m.positive_int(Keys.LLM.BLOCK_COUNT)
    n_embd = m.positive_int(Keys.LLM.EMBEDDING_LENGTH)
    n_head = m.positive_int(Keys.Attention.HEAD_COUNT)
    n_head_kv = m.positive_int(Keys.Attention.HEAD_COUNT_KV, n_head)
    head_dim = m.positive_int(Keys.Attention.KEY_LENGTH, n_embd // n_head)
    head_dim_v = m.positive_int(Keys.Attention.VALUE_LENGTH, head_dim)
    rope_dims = m.positive_int(Keys.Rope.DIMENSION_COUNT, head_dim)
    rms_eps = float(m.require(Keys.Attention.LAYERNORM_RMS_EPS))
    rope_base = float(m.get(Keys.Rope.FREQ_BASE, 10_000.0))

    scaling = m.get(Keys.Rope.SCALING_TYPE, "none")
    factor = float(m.get(Keys.Rope.SCALING_FACTOR, 1.0) or 1.0)
    if scaling not in ("none", "linear"):
        raise UnsupportedModelError(f"{path}: RoPE scaling '{scaling}' is not supported (none, linear are)")
    freq_scale = 1.0 / factor if scaling == "linear" else 1.0

    token_embd = _tensor(MODEL_TENSOR.TOKEN_EMBD)
    if token_embd not in tensors:
        raise ModelFileError(f"{path}: tensor {token_embd} is missing")
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
            "sliding_window": m.positive_int(Keys.Attention.SLIDING_WINDOW) if swa else None,
            "rope_base": GEMMA3_ROPE_BASE_LOCAL if swa else rope_base,
            "rope_freq_scale": 1.0 if swa else freq_scale,
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
        "n_vocab": int(tensors[token_embd][1]) if len(tensors[token_embd]) > 1 else 0,
        "rms_eps": rms_eps,
        "rope_dims": rope_dims,
        # llama keeps the original interleaved RoPE layout (its converter permutes q/k); the others use NeoX's.
        "rope_neox": arch != "llama",
        "activation": "gelu_tanh" if is_gemma else "silu",
        "embd_scale": math.sqrt(n_embd) if is_gemma else 1.0,
        # Gemma 3 scales q by 1/sqrt(head_dim) itself and calls attention with scale 1.
        "q_scale": 1.0 / math.sqrt(head_dim) if is_gemma else 1.0,
        "attn_scale": 1.0 if is_gemma else 1.0 / math.sqrt(head_dim),
        "token_embd": token_embd,
        "output_norm": _tensor(MODEL_TENSOR.OUTPUT_NORM),
        "output": output if output in tensors else token_embd,
        "layers": layers,
        "n_ctx_train": int(m.get(Keys.LLM.CONTEXT_LENGTH, 4096)),
    }
