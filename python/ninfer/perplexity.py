"""Perplexity the way llama-perplexity computes it, so the numbers are comparable.

The text is tokenized whole (with BOS if the model adds one), cut into chunks of n_ctx tokens, and each chunk is
evaluated from an empty context with its first token replaced by BOS (if the model adds one). Only the second
half of each chunk is scored: the log-probability of token j+1 given logits at j, for j in [n_ctx/2, n_ctx - 2].

Against a reference model (llama-perplexity's --kl-divergence-base / --kl-divergence): one run saves the scored
rows' log-probabilities (float32 .npy, [scored tokens, n_vocab]); a run of another model on the same text then
reports the mean KL divergence KL(reference || model) over those tokens and how often both put the same token first.
"""

from __future__ import annotations

import math
import os
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
    kl: float | None = None  # mean KL(reference || model), nats per token
    kl_uncertainty: float | None = None
    top1_agreement: float | None = None  # fraction of scored tokens with the same most likely token


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    mx = logits.max(axis=1, keepdims=True)
    return logits - (np.log(np.exp(logits - mx).sum(axis=1, keepdims=True)) + mx)


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
    kl_base_out: str | os.PathLike[str] | None = None,
    kl_base: str | os.PathLike[str] | None = None,
) -> PerplexityResult:
    """Perplexity of `text`; with `kl_base_out`, also save the scored log-probabilities there; with `kl_base`,
    compare with ones saved so (same text, n_ctx and chunks) for KL divergence and top-1 agreement."""
    if n_ctx < 4:
        raise InvalidArgumentError(f"perplexity context {n_ctx} is too small (at least 4 tokens)")
    if n_ctx > llm.n_ctx:
        raise InvalidArgumentError(f"perplexity context {n_ctx} is larger than the model's n_ctx {llm.n_ctx}")
    if n_chunks is not None and n_chunks < 0:
        n_chunks = None  # (llama-perplexity's --chunks -1: all)
    if n_chunks == 0:
        raise InvalidArgumentError("the number of chunks must be >= 1 (or -1: all of them), got 0")
    tokens = llm.tokenize(text, add_special=True)
    if len(tokens) < 2 * n_ctx:
        raise InvalidArgumentError(
            f"the text has {len(tokens)} tokens; at least {2 * n_ctx} are needed for a context of {n_ctx}"
        )
    add_bos = llm.tokenizer.add_bos
    total = len(tokens) // n_ctx if n_chunks is None else min(n_chunks, len(tokens) // n_ctx)
    first = n_ctx // 2
    per_chunk = n_ctx - 1 - first
    save = ref = None
    if kl_base is not None:
        not_npy = f"{kl_base}: not a .npy file of log-probabilities (what --kl-divergence-base writes)"
        try:
            ref = np.load(kl_base, mmap_mode="r")
        except OSError as e:
            raise InvalidArgumentError(f"{kl_base}: cannot read the reference log-probabilities: "
                                       f"{e.strerror or e}") from None
        except ValueError:  # (numpy's word for a file that is neither .npy nor .npz)
            raise InvalidArgumentError(not_npy) from None
        if not isinstance(ref, np.ndarray):
            raise InvalidArgumentError(not_npy)
        # A reference of the whole text serves a run of its first chunks (--chunks N), as llama-perplexity's does.
        if ref.ndim != 2 or ref.shape[1] != llm.n_vocab or ref.shape[0] < total * per_chunk:
            raise InvalidArgumentError(f"{kl_base}: reference log-probabilities of shape {ref.shape}, this run scores "
                                       f"{(total * per_chunk, llm.n_vocab)} (same text, context and chunks?)")
    if kl_base_out is not None:  # (created before any chunk runs, so a bad path fails at once)
        try:
            save = np.lib.format.open_memmap(kl_base_out, mode="w+", dtype=np.float32,
                                             shape=(total * per_chunk, llm.n_vocab))
        except OSError as e:
            raise InvalidArgumentError(f"{kl_base_out}: cannot write the reference log-probabilities: "
                                       f"{e.strerror or e}") from None
    kls: list[np.ndarray] = []
    same = 0
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
        if save is not None or ref is not None:
            lsm = _log_softmax(logits)
            rows = slice(i * per_chunk, (i + 1) * per_chunk)
            if save is not None:
                save[rows] = lsm
            if ref is not None:
                base = np.asarray(ref[rows], np.float64)
                kls.append((np.exp(base) * (base - lsm)).sum(axis=1))
                same += int((base.argmax(axis=1) == lsm.argmax(axis=1)).sum())
        if progress is not None:
            progress(i + 1, total, math.exp(nll / count))
    mean = nll / count
    var = nll2 / count - mean * mean
    unc = math.exp(mean) * math.sqrt(var / (count - 1)) if count > 1 and var > 0 else 0.0
    if save is not None:
        save.flush()
    if ref is None:
        return PerplexityResult(math.exp(mean), unc, total, count, chunk_ppl)
    kl = np.concatenate(kls)
    kl_unc = float(kl.std(ddof=1) / math.sqrt(len(kl))) if len(kl) > 1 else 0.0
    return PerplexityResult(math.exp(mean), unc, total, count, chunk_ppl, float(kl.mean()), kl_unc, same / len(kl))
