"""From sampled tokens to the text a caller sees, in one place: end-of-generation tokens, stop strings, the text
held back while it could still become a stop string, incremental detokenization (never half a UTF-8 character),
and the length budget. `LLM`, `AsyncLLM` and the server all get their text through `OutputText`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ninfer.tokenizer import IncrementalDecoder, Tokenizer


@dataclass(frozen=True)
class Finish:
    reason: str  # OpenAI's finish_reason: "stop" | "length"
    kind: str  # llama.cpp's stop_type: "eos" | "word" | "limit"
    word: str = ""  # the stop string that ended it (kind "word")


EOS = Finish("stop", "eos")
LIMIT = Finish("length", "limit")


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that could still grow into a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class OutputText:
    """One request's output. `push` each sampled token; `take` the text that has become final since the last
    call. Once `finish` is set, nothing more is pushed and `take` gives everything that is left."""

    def __init__(self, tokenizer: Tokenizer, *, stop: Sequence[str] = (), budget: int, ignore_eos: bool = False):
        self._tokenizer = tokenizer
        self._decoder = IncrementalDecoder(tokenizer)
        self.stops = [s for s in stop if s]
        self.budget = budget
        self.ignore_eos = ignore_eos
        self.tokens: list[int] = []
        self.text = ""
        self.finish: Finish | None = None
        self._emitted = 0  # characters of text handed out by take()
        self._flushed = False

    def push(self, token: int) -> Finish | None:
        """Take one sampled token; returns how the output finished, if this token finished it. An
        end-of-generation token ends it without being part of it; a stop string ends the text before it."""
        assert self.finish is None, "push after the output finished"
        if self._tokenizer.is_eog(token) and not self.ignore_eos:
            self.finish = EOS
            return self.finish
        self.tokens.append(token)
        self.text += self._decoder.push(token)
        # (a stop string can only newly appear in the characters this token added, plus its length before them)
        hit = min(
            ((self.text.find(s, max(0, self._emitted - len(s) + 1)), s) for s in self.stops if s in self.text),
            default=None,
        )
        if hit is not None:
            self.text = self.text[: hit[0]]
            self.finish = Finish("stop", "word", hit[1])
        elif len(self.tokens) >= self.budget:
            self.finish = LIMIT
        return self.finish

    def stop(self, finish: Finish = LIMIT) -> None:
        """End the output from outside (a deadline, a cancellation) as `finish`."""
        if self.finish is None:
            self.finish = finish

    def take(self) -> str:
        """The text that became final since the last call: while generating, all but what could still become a
        stop string; once finished, the rest (with the decoder's held-back bytes when it ran out of budget)."""
        if self.finish is None:
            safe = len(self.text) - stop_holdback(self.text, self.stops)
        else:
            if self.finish.kind == "limit" and not self._flushed:
                self._flushed = True
                self.text += self._decoder.flush()
            safe = len(self.text)
        if safe <= self._emitted:
            return ""
        piece = self.text[self._emitted : safe]
        self._emitted = safe
        return piece
