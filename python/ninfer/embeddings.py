"""Embeddings from a generative model, as llama.cpp's `--embeddings` makes them: every token's final hidden state
after the output norm (no logits computed), pooled over the text -- the mean of all tokens, or the last token's --
and scaled to unit length (llama-server's default, Euclidean normalization)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ninfer.errors import InvalidArgumentError

POOLINGS = ("mean", "last")


def check_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise InvalidArgumentError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    return pooling


def pool(hidden: np.ndarray, pooling: str, normalize: bool = True) -> np.ndarray:
    """hidden: [n_tokens, n_embd] -> [n_embd] (float32; summed in float64)."""
    v = hidden.astype(np.float64).mean(axis=0) if pooling == "mean" else hidden[-1].astype(np.float64)
    if normalize:
        norm = np.sqrt((v * v).sum())
        v = v / norm if norm > 0 else v
    return v.astype(np.float32)


def embed_job(tokens: list[int], n_batch: int, pooling: str, normalize: bool) -> Callable[[Any, int], np.ndarray]:
    """The work of one embedding, for the engine loop's `Job`: run `tokens` on sequence `seq` of `backend`."""
    check_pooling(pooling)

    def run(backend: Any, seq: int) -> np.ndarray:
        if not hasattr(backend, "embeddings"):
            raise InvalidArgumentError("embeddings are computed by the CPU backend only so far (--device cpu)")
        return pool(np.asarray(backend.embeddings(seq, tokens, n_batch)), pooling, normalize)

    return run
