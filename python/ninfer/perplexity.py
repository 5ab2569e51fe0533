"""Perplexity the way llama-perplexity computes it, so the numbers are comparable.

The text is tokenized whole (with BOS if the model adds one), cut into chunks of n_ctx tokens, and each chunk is
evaluated from an empty context with its first token replaced by BOS (if the model adds one). Only the second
half of each chunk is scored: the log-probability of token j+1 given logits at j, for j in [n_ctx/2, n_ctx - 2].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ninfer.errors import InvalidArgumentError
from ninfer.llm import LLM


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    uncertainty: float
    n_chunks: int
    n_scored: int
    chunk_ppl: list[float]


def _token_logprobs(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log softmax(logits)[target] per row, in float64 (llama.cpp sums the exponentials in double)."""
    logits = logits.astype(np.float64)
    mx = logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(logits - mx).sum(axis=1)) + mx[:, 0]
    return logits[np.arange(len(targets)), targets] - lse


def perplexity(
    llm: LLM,
    text: str,
    n_ctx: int = 512,
    n_chunks: int | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> PerplexityResult:
    if n_ctx < 4 or n_ctx > llm.n_ctx:
        raise InvalidArgumentError(f"perplexity context {n_ctx} must be in [4, {llm.n_ctx}] (the model's n_ctx)")
    tokens = llm.tokenize(text, add_special=True)
    if len(tokens) < 2 * n_ctx:
        raise InvalidArgumentError(
            f"the text has {len(tokens)} tokens; at least {2 * n_ctx} are needed for a context of {n_ctx}"
        )
    add_bos = llm.tokenizer.add_bos
    total = len(tokens) // n_ctx if n_chunks is None else min(n_chunks, len(tokens) // n_ctx)
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    chunk_ppl = []
    for i in range(total):
        chunk = tokens[i * n_ctx : (i + 1) * n_ctx]
        if add_bos:
            chunk = [llm.tokenizer.bos_id, *chunk[1:]]
        logits = llm.eval_logits(chunk, rows=range(first, n_ctx - 1))
        targets = np.asarray(tokens[i * n_ctx + first + 1 : (i + 1) * n_ctx], dtype=np.int64)
        lp = _token_logprobs(logits, targets)
        nll -= float(lp.sum())
        nll2 += float((lp * lp).sum())
        count += len(lp)
        chunk_ppl.append(math.exp(-float(lp.mean())))
        if progress is not None:
            progress(i + 1, total, math.exp(nll / count))
    mean = nll / count
    var = nll2 / count - mean * mean
    unc = math.exp(mean) * math.sqrt(var / (count - 1)) if count > 1 and var > 0 else 0.0
    return PerplexityResult(math.exp(mean), unc, total, count, chunk_ppl)
