"""The backend interface: what the engine loop, `LLM`, perplexity and the benchmarks ask of a place where a
model's layers run. Implementations: the CPU engine (Rust, `ninfer._core.Engine`), the CUDA engine
(`ninfer.backends.cuda_engine.CudaEngine`, which runs its last layers on a CPU engine when the GPU cannot hold
them all). Sequences are small integers (the engine loop's slots); each backend keeps its KV blocks' books in
the Rust core's block manager and holds only their storage."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from ninfer.engine.request import Probs


@runtime_checkable
class Backend(Protocol):
    @property
    def n_vocab(self) -> int: ...

    def forward(self, batch: list[tuple[int, list[int]]], logit_rows: list[int]) -> np.ndarray:
        """Append each (seq, tokens) of `batch` to its sequence and run the model once over all of them;
        float32 logits [len(logit_rows), n_vocab] for the rows asked (indices into the batch's tokens, in order)."""
        ...

    def prefill(self, seq: int, tokens: list[int], n_batch: int) -> np.ndarray:
        """Append `tokens` to `seq` in forward calls of at most n_batch tokens; the last token's logits [n_vocab]."""
        ...

    def step(self, seq: int, token: int, sampler: Any) -> int:
        """One decode step of one sequence, sampled by a `ninfer._core.Sampler`; a backend may take a plain argmax
        (`sampler.is_greedy`) on its own side (the GPU) and overlap the next step with the caller's work."""
        ...

    def decode(self, batch: list[tuple[int, int]], sampler: Any) -> list[tuple[int, Probs | None]]:
        """One token in for each of several distinct sequences, one out each, drawn on the
        `ninfer._core.SamplerThread` by the sequence's slot: (token, None or its log-probabilities)."""
        ...

    def truncate(self, seq: int, n: int) -> None:
        """Keep the first n positions of `seq` (rollback, prompt reuse); the blocks past them are freed."""
        ...

    def remove(self, seq: int) -> None: ...

    def fork(self, src: int, dst: int, n: int) -> None:
        """`dst` becomes the first n positions of `src` (what it held is dropped): whole blocks are shared by
        reference, a partial last block is copied."""
        ...

    def seq_len(self, seq: int) -> int: ...

    def kv_usage(self) -> tuple[int, int]:
        """(KV blocks in use, bytes the cache holds)."""
        ...

    def set_profiling(self, on: bool) -> None: ...

    def reset_profile(self) -> None: ...

    def profile(self) -> dict[str, float]: ...
