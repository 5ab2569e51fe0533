"""Response bodies: llama.cpp's /completion object and OpenAI's completion / chat objects and stream chunks."""

from __future__ import annotations

import copy
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from ninfer.engine import GenParams, Probs, Result

Piece = Callable[[int], bytes]  # a token's bytes (Tokenizer.token_to_piece)


def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf; OpenAI writes -9999 for "impossible"


def _tok(piece: Piece, t: int) -> dict[str, Any]:
    b = piece(t)
    return {"id": t, "token": b.decode("utf-8", errors="replace"), "bytes": list(b)}


def llama_probs(piece: Piece, tokens: list[int], probs: list[Probs]) -> list[dict[str, Any]]:
    """llama-server's `completion_probabilities` (n_probs): per token, its log-probability and the top tokens'."""
    return [{**_tok(piece, t), "logprob": _lp(lp),
             "top_logprobs": [{**_tok(piece, u), "logprob": _lp(ulp)} for u, ulp in top]}
            for t, (lp, top) in zip(tokens, probs)]


def openai_chat_logprobs(piece: Piece, tokens: list[int], probs: list[Probs], k: int) -> dict[str, Any]:
    def entry(t: int, lp: float) -> dict[str, Any]:
        d = _tok(piece, t)
        return {"token": d["token"], "logprob": _lp(lp), "bytes": d["bytes"]}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(u, ulp) for u, ulp in top[:k]]}
                        for t, (lp, top) in zip(tokens, probs)]}


def openai_text_logprobs(piece: Piece, tokens: list[int], probs: list[Probs], k: int, offset: int = 0
                         ) -> dict[str, Any]:
    texts = [piece(t).decode("utf-8", errors="replace") for t in tokens]
    offsets = [offset + sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [_lp(lp) for lp, _ in probs],
            "top_logprobs": [{piece(u).decode("utf-8", errors="replace"): _lp(ulp) for u, ulp in top[:k]}
                             for _, top in probs],
            "text_offset": offsets}


def _timings(r: Result) -> dict[str, float]:
    prompt_n = r.prompt_n - r.cached_n
    predicted_n = len(r.tokens)
    return {
        "prompt_n": prompt_n,
        "prompt_ms": r.prompt_ms,
        "prompt_per_token_ms": r.prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 * prompt_n / r.prompt_ms if r.prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": r.predicted_ms,
        "predicted_per_token_ms": r.predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1e3 * predicted_n / r.predicted_ms if r.predicted_ms > 0 else 0.0,
        **({"draft_n": r.draft_n, "draft_n_accepted": r.draft_n_accepted} if r.draft_n else {}),
    }


def llama_final(r: Result, model: str, p: GenParams, prompt: str, piece: Piece) -> dict[str, Any]:
    """llama-server's /completion answer (and the last object of its stream)."""
    out = {
        "content": r.text,
        "id_slot": r.slot,
        "stop": True,
        "model": model,
        "tokens_predicted": len(r.tokens),
        "tokens_evaluated": r.prompt_n,
        "tokens_cached": r.cached_n,
        "tokens": r.tokens,
        "generation_settings": {
            "n_predict": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
            "min_p": p.min_p, "typical_p": p.typical_p, "repeat_penalty": p.repeat_penalty,
            "repeat_last_n": p.repeat_last_n, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty, "seed": p.seed if p.seed is not None else -1,
            "stop": p.stop, "ignore_eos": p.ignore_eos,
        },
        "prompt": prompt,
        "has_new_line": "\n" in r.text,
        "truncated": False,
        "stop_type": r.stop_type,
        "stopping_word": r.stopping_word,
        "timings": _timings(r),
    }
    if p.n_probs:
        out["completion_probabilities"] = llama_probs(piece, r.tokens, r.probs)
    return out


def _usage(r: Result) -> dict[str, int]:
    return {"prompt_tokens": r.prompt_n, "completion_tokens": len(r.tokens),
            "total_tokens": r.prompt_n + len(r.tokens)}


class OpenAI:
    """One response's id, timestamp and shape: chat (`chat.completion[.chunk]`) or text (`text_completion`)."""

    def __init__(self, model: str, chat: bool, piece: Piece, logprobs: int | None = None):
        """logprobs: None, or how many top tokens to list with each token's log-probability."""
        self.model, self.chat, self.piece, self.logprobs = model, chat, piece, logprobs
        self.text_offset = 0
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def sibling(self) -> OpenAI:
        """The formatter of another answer (n > 1) of the same response: same id and time, its own offsets."""
        other = copy.copy(self)
        other.text_offset = 0
        return other

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, tokens: list[int], probs: list[Probs]) -> dict[str, Any] | None:
        if self.logprobs is None or not tokens:
            return None
        if self.chat:
            return openai_chat_logprobs(self.piece, tokens, probs, self.logprobs)
        out = openai_text_logprobs(self.piece, tokens, probs, self.logprobs, self.text_offset)
        self.text_offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def final(self, r: Result) -> dict[str, Any]:
        lp = self._logprobs(r.tokens, r.probs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": r.text}, "logprobs": lp,
                      "finish_reason": r.finish_reason}
            out = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": r.text, "logprobs": lp, "finish_reason": r.finish_reason}
            out = self._envelope("text_completion", [choice])
        out["usage"] = _usage(r)
        out["timings"] = _timings(r)
        return out

    def chunk(self, content: str | dict[str, str] | None, finish_reason: str | None, tokens: list[int] | None = None,
              probs: list[Probs] | None = None) -> dict[str, Any]:
        """A stream chunk: `content` is the new text (a dict: the whole delta), None for the closing chunk;
        `tokens` and `probs` the chunk's tokens, for logprobs."""
        lp = self._logprobs(tokens or [], probs or [])
        if self.chat:
            delta = content if isinstance(content, dict) else ({} if content is None else {"content": content})
            return self._envelope("chat.completion.chunk",
                                  [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}])
        return self._envelope("text_completion", [{"index": 0, "text": content or "", "logprobs": lp,
                                                    "finish_reason": finish_reason}])

    def usage_chunk(self, r: Result) -> dict[str, Any]:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = _usage(r)
        return out
