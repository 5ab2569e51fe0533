"""Speculative decoding: a proposer guesses the next tokens of a sequence, the target verifies them all in one
forward pass over their positions, and the engine loop keeps the longest prefix the target itself would have
produced (engine/core.py, `_speculate`).

Proposers:
- `NgramProposer` (no second model): the tokens that followed the most recent earlier occurrence of the sequence's
  last n tokens in its own prompt and output (prompt lookup), else in what every sequence of this engine has
  produced so far (a shared cache, so repeated requests in a server learn from each other).
- `DraftProposer`: a smaller model with the target's vocabulary decodes greedily ahead, stopping when its top
  probability falls under p_min.

At temperature 0 the output is the target's plain greedy output: each verify row is computed as a single decode step
computes it (the CPU engine's `forward(..., as_steps=True)`), and the greedy token of each row is taken by the same
argmax as a plain step. At temperature > 0 the drafts are verified by rejection sampling on the request's sampler
(`SamplerThread.verify`: accept a draft with the probability the sampler chain gives it, else draw from that
distribution without it), so the output has the distribution plain sampling has.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ninfer.engine.request import reusable_prefix
from ninfer.errors import InvalidArgumentError

SPEC_TYPES = ("draft", "ngram")


@dataclass(frozen=True)
class SpecConfig:
    """llama.cpp's knobs, with its defaults: at most n_max tokens drafted a step (adapted down per sequence when they
    are rejected), none when fewer than n_min would be; a draft model stops at a token whose probability is under
    p_min. ngram_min..ngram_max: the lengths of the suffix looked up (longest first)."""

    n_max: int = 16
    n_min: int = 0
    p_min: float = 0.75
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.n_max, int) or self.n_max < 1:
            raise InvalidArgumentError(f"draft_max must be an integer >= 1, got {self.n_max!r}")
        if not isinstance(self.n_min, int) or not 0 <= self.n_min <= self.n_max:
            raise InvalidArgumentError(f"draft_min must be an integer in 0..draft_max ({self.n_max}), got "
                                       f"{self.n_min!r}")
        if not 0.0 <= self.p_min <= 1.0:
            raise InvalidArgumentError(f"draft_p_min must be in [0, 1], got {self.p_min!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidArgumentError(f"n-gram sizes must satisfy 1 <= min <= max, got {self.ngram_min}.."
                                       f"{self.ngram_max}")


class Proposer(Protocol):
    def propose(self, slot: int, history: list[int], n: int, p_min: float | None = None) -> list[int]:
        """Up to n tokens that might follow `history` (the sequence's prompt and output so far; p_min: a draft
        model's cut-off for this request, None: the configured one)."""
        ...

    def sync(self, slot: int, history: list[int]) -> int:
        """Catch up with `history` before proposing (a draft model evaluates the tokens it has not seen); returns
        how many tokens that took."""
        ...

    def finished(self, slot: int, history: list[int]) -> None:
        """The slot's request is done; `history` is everything it held."""
        ...


class NgramProposer:
    # Sequences remembered by the shared cache, and the tokens it keeps of each (the most recent).
    SHARED_SEQUENCES = 64
    SHARED_TOKENS = 16384

    def __init__(self, config: SpecConfig):
        self.config = config
        self._shared: collections.deque[list[int]] = collections.deque(maxlen=self.SHARED_SEQUENCES)

    def propose(self, slot: int, history: list[int], n: int, p_min: float | None = None) -> list[int]:
        c = self.config
        for size in range(min(c.ngram_max, len(history) - 1), c.ngram_min - 1, -1):
            key = history[-size:]
            found = _follow(history[:-1], key, n)  # (the suffix itself is not an earlier occurrence)
            if found:
                return found
            for seq in reversed(self._shared):
                found = _follow(seq, key, n)
                if found:
                    return found
        return []

    def sync(self, slot: int, history: list[int]) -> int:
        return 0

    def finished(self, slot: int, history: list[int]) -> None:
        self._shared.append(history[-self.SHARED_TOKENS:])


def _follow(tokens: list[int], key: list[int], n: int) -> list[int]:
    """The n tokens after the last occurrence of `key` in `tokens` (fewer at the end), or [] if it does not occur."""
    k = len(key)
    first = key[0]
    for i in range(len(tokens) - k, -1, -1):
        if tokens[i] == first and tokens[i : i + k] == key:
            return tokens[i + k : i + k + n]
    return []


class DraftProposer:
    """A draft model decoding ahead on its own backend: slot i is sequence i of the draft's KV cache too."""

    def __init__(self, draft: Any, config: SpecConfig, *, n_batch: int):
        self.draft = draft  # the draft's Backend
        self.config = config
        self.n_batch = n_batch
        self._cached: dict[int, list[int]] = {}  # what the draft's KV cache holds, per slot
        self._logits: dict[int, np.ndarray] = {}  # the draft's logits after its cache, where sync left them

    def sync(self, slot: int, history: list[int]) -> int:
        cached = self._cached.get(slot, [])
        keep = reusable_prefix(cached, history)
        if keep == len(history) - 1 and len(cached) == len(history) and slot in self._logits:
            return 0  # (the draft evaluated exactly this history last time: its logits are at hand)
        self.draft.truncate(slot, keep)
        self._logits[slot] = self.draft.prefill(slot, history[keep:], self.n_batch)
        self._cached[slot] = list(history)
        return len(history) - keep

    def propose(self, slot: int, history: list[int], n: int, p_min: float | None = None) -> list[int]:
        p_min = self.config.p_min if p_min is None else p_min
        self.sync(slot, history)
        logits = self._logits.pop(slot)
        cached = self._cached[slot]
        out: list[int] = []
        while True:
            tok, p = _top(logits)
            if p < p_min:
                break
            out.append(tok)
            if len(out) >= n:
                break
            logits = self.draft.forward([(slot, [tok])], [0])[0]
            cached.append(tok)
        return out

    def finished(self, slot: int, history: list[int]) -> None:
        self.draft.remove(slot)
        self._cached.pop(slot, None)
        self._logits.pop(slot, None)


def _top(logits: np.ndarray) -> tuple[int, float]:
    """The most likely token and its probability under softmax."""
    i = int(np.argmax(logits))
    z = logits - logits[i]
    return i, float(1.0 / np.exp(z, dtype=np.float64).sum())


def check_vocab(target: Any, draft: Any) -> None:
    """A draft must speak the target's vocabulary: same tokenizer type, same BOS/EOS, sizes within 128, equal token
    texts where both have them. Raises InvalidArgumentError naming the first difference."""
    tm, dm = target.model_file.metadata, draft.model_file.metadata
    for key in ("tokenizer.ggml.model",):
        if tm.get(key) != dm.get(key):
            raise InvalidArgumentError(f"the draft model's tokenizer differs from the target's: {key} "
                                       f"{dm.get(key)!r} against {tm.get(key)!r}")
    tt, dt = target.tokenizer, draft.tokenizer
    for what in ("bos_id", "eos_id"):
        if getattr(tt, what) != getattr(dt, what):
            raise InvalidArgumentError(f"the draft model's {what} is {getattr(dt, what)}, the target's "
                                       f"{getattr(tt, what)}: they do not share a vocabulary")
    if abs(tt.vocab_size - dt.vocab_size) > 128:
        raise InvalidArgumentError(f"the draft model's vocabulary has {dt.vocab_size} tokens, the target's "
                                   f"{tt.vocab_size} (more than 128 apart)")
    for i in range(min(tt.vocab_size, dt.vocab_size)):
        if tt.token_text(i) != dt.token_text(i):
            raise InvalidArgumentError(f"token {i} is {dt.token_text(i)!r} in the draft model and "
                                       f"{tt.token_text(i)!r} in the target: they do not share a vocabulary")


class Speculator:
    """What the engine loop needs to speculate: a proposer, its settings, and per slot how many tokens to draft.

    The draft length adapts per sequence: it doubles (up to n_max) after a step whose drafts were all accepted and
    falls to one more than the accepted count otherwise. And speculation must pay: each slot's tokens per second
    while speculating are compared with the plain decode rate; when they fall below it, the slot decodes plainly for
    a while (PAUSE steps, doubling with each retry that fails, up to 16 times, and remembered across requests) and
    then tries again."""

    PAUSE = 32  # steps a draft model sits out after speculation did not pay (n-gram lookup: a quarter)
    EMA = 0.3  # weight of the newest measurement: a few slow steps in a row are enough to stop

    def __init__(self, proposer: Proposer, config: SpecConfig):
        self.proposer = proposer
        self.config = config
        # A draft model costs the same every step on a given machine, so what it did for earlier requests says what
        # it will do for the next; n-gram proposals cost nothing and their worth depends on the text.
        self.remember = isinstance(proposer, DraftProposer)
        # A retry costs a draft model its catch-up with the tokens decoded meanwhile; n-gram lookup, nothing.
        self.pause_steps = self.PAUSE if self.remember else self.PAUSE // 4
        self.plain_s = 0.0  # seconds of a plain single-row decode step (moving average)
        self._k: dict[int, int] = {}
        self._rate: dict[int, float] = {}  # tokens per second while speculating (moving average)
        self._pause: dict[int, int] = {}
        # Retries in a row that did not pay (across requests for a draft model): a model pair that does not pay on
        # this machine (a 0.5B drafting for a 1.5B on two cores) soon drafts rarely, and a new request starts paused.
        self.fails = 0

    def start(self, slot: int) -> None:
        self._k[slot] = self.config.n_max
        self._rate.pop(slot, None)
        if not self.remember:
            self.fails = 0
        self._pause[slot] = self.pause_steps << min(self.fails - 1, 4) if self.fails else 0

    def draft_len(self, slot: int, room: int, config: SpecConfig | None) -> int:
        """How many tokens to draft for `slot` now (0: decode plainly), at most `room`."""
        c = config or self.config
        if self._pause.get(slot, 0) > 0:
            self._pause[slot] -= 1
            return 0
        n = min(self._k.get(slot, c.n_max), c.n_max, room)
        return n if n >= max(1, c.n_min) else 0

    def note_plain(self, seconds: float) -> None:
        self.plain_s = seconds if not self.plain_s else (1 - self.EMA) * self.plain_s + self.EMA * seconds

    def note_verify(self, slot: int, drafted: int, accepted: int, seconds: float) -> None:
        k = self._k.get(slot, self.config.n_max)
        self._k[slot] = min(self.config.n_max, 2 * k) if accepted == drafted else max(1, accepted + 1)
        rate = (accepted + 1) / max(seconds, 1e-9)
        old = self._rate.get(slot)
        self._rate[slot] = rate if old is None else (1 - self.EMA) * old + self.EMA * rate
        if old is not None and self.plain_s and self._rate[slot] < 1.0 / self.plain_s:  # (two steps at least)
            self._pause[slot] = self.pause_steps << min(self.fails, 4)
            self.fails += 1
            self._rate.pop(slot)
        elif old is not None:  # (a second step in a row that pays: the retry worked)
            self.fails = 0
