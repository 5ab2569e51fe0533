"""OpenAI's `echo` on /v1/completions: the prompt comes back before each answer, and with `logprobs` its tokens
come with theirs (the first token has none), from a forward pass over the prompt that the engine loop runs on a
sequence of its own (logits a chunk of rows at a time, never the whole prompt's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ninfer.engine import EngineThread, Probs
from ninfer.server.formats import Piece, _lp
from ninfer.server.jobs import run_job

ROWS = 64  # logits rows computed at once: [ROWS, n_vocab] floats


def prompt_probs_job(ids: list[int], k: int) -> Callable[[Any, int], list[Probs]]:
    """For each prompt token after the first: its log-probability given the tokens before it and the k most
    likely tokens there with theirs (log-softmax of the logits, in float64)."""

    def run(backend: Any, seq: int) -> list[Probs]:
        out: list[Probs] = []
        for start in range(0, len(ids) - 1, ROWS):
            chunk = ids[start : start + ROWS]
            logits = np.asarray(backend.forward([(seq, chunk)], list(range(len(chunk)))), dtype=np.float64)
            top = logits.max(axis=1, keepdims=True)
            lp = logits - (top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True)))
            for j in range(len(chunk)):
                nxt = start + j + 1
                if nxt >= len(ids):
                    break
                best = np.argpartition(-lp[j], k - 1)[:k] if k else np.array([], dtype=np.int64)
                best = sorted(best.tolist(), key=lambda t: (-lp[j, t], t))
                out.append((float(lp[j, ids[nxt]]), [(t, float(lp[j, t])) for t in best]))
        return out

    return run


class Echo:
    """The prompt's text, and with logprobs its tokens' entries, to put before each answer."""

    def __init__(self, text: str, ids: list[int], probs: list[Probs] | None, k: int, piece: Piece):
        self.text, self.ids, self.probs, self.k, self.piece = text, ids, probs, k, piece

    @classmethod
    async def of(cls, sched: EngineThread, text: str, ids: list[int], logprobs: int | None, piece: Piece) -> Echo:
        probs = None if logprobs is None else await run_job(sched, prompt_probs_job(ids, max(logprobs, 1)))
        return cls(text, ids, probs, logprobs or 0, piece)

    def logprobs(self) -> dict[str, Any] | None:
        """OpenAI's text-completion logprobs object of the prompt's tokens."""
        if self.probs is None:
            return None
        texts = [self.piece(t).decode("utf-8", errors="replace") for t in self.ids]
        offsets = [sum(len(x) for x in texts[:i]) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": [None] + [_lp(lp) for lp, _ in self.probs],
                "top_logprobs": [None] + [{self.piece(u).decode("utf-8", errors="replace"): _lp(ulp)
                                           for u, ulp in top[: self.k]} for _, top in self.probs],
                "text_offset": offsets}

    def prepend(self, choice: dict[str, Any]) -> None:
        """Put the prompt before a choice's text (and its logprobs before the answer's)."""
        choice["text"] = self.text + (choice.get("text") or "")
        mine = self.logprobs()
        if mine is not None:
            theirs = choice.get("logprobs") or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                "text_offset": []}
            choice["logprobs"] = {key: mine[key] + theirs[key] for key in mine}

    def text_offset(self) -> int:
        """Where the answer's characters start in the echoed text (for its tokens' text_offset)."""
        return len(self.text)
