"""Hand-made GGUF files for error-path tests, written with the `gguf` package's writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

TINY = dict(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128, n_vocab=64)


def write_tiny_model(
    path: Path,
    arch: str = "llama",
    q_type: GGMLQuantizationType | None = None,
    n_layer: int = TINY["n_layer"],
) -> Path:
    """A two-layer model with random F32 weights and a byte-level vocabulary of 64 tokens."""
    rng = np.random.default_rng(0)
    e, ff, v = TINY["n_embd"], TINY["n_ff"], TINY["n_vocab"]
    kv_dim = e // TINY["n_head"] * TINY["n_head_kv"]
    w = GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(e)
    w.add_feed_forward_length(ff)
    w.add_head_count(TINY["n_head"])
    w.add_head_count_kv(TINY["n_head_kv"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = [chr(0x41 + i) for i in range(v - 2)] + ["AB", "<eos>"]
    w.add_token_list(tokens)
    w.add_token_types([1] * (v - 1) + [3])
    w.add_token_merges(["A B"])
    w.add_eos_token_id(v - 1)

    def mat(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32))

    mat("token_embd.weight", v, e)
    w.add_tensor("output_norm.weight", np.ones(e, dtype=np.float32))
    for il in range(n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", np.ones(e, dtype=np.float32))
        if q_type is not None and il == 0:
            # Raw bytes of the right size for the type, so only the type itself is unsupported.
            from gguf import GGML_QUANT_SIZES

            block, size = GGML_QUANT_SIZES[q_type]
            raw = np.zeros((e, e // block * size), dtype=np.uint8)
            w.add_tensor(p + "attn_q.weight", raw, raw_dtype=q_type)
        else:
            mat(p + "attn_q.weight", e, e)
        mat(p + "attn_k.weight", kv_dim, e)
        mat(p + "attn_v.weight", kv_dim, e)
        mat(p + "attn_output.weight", e, e)
        w.add_tensor(p + "ffn_norm.weight", np.ones(e, dtype=np.float32))
        mat(p + "ffn_gate.weight", ff, e)
        mat(p + "ffn_up.weight", ff, e)
        mat(p + "ffn_down.weight", e, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
