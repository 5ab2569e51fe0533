"""What a generation request is, as the engine loop sees it: the prompt's token ids, validated settings, where its
events go, and what it finished with."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A token's log-probability and the most likely tokens with theirs: (logprob, [(token, logprob), ...]).
Probs = tuple[float, list[tuple[int, float]]]


class QueueFullError(Exception):
    """Every slot is busy and the waiting queue holds as many requests as it may."""


class DeadlineError(Exception):
    """The request waited in the queue past its deadline."""


@dataclass
class GenParams:
    """One request's generation settings, already validated (LLM's arguments, or the server's schemas)."""

    max_tokens: int  # -1: until the context is full
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    cache_prompt: bool = True
    n_probs: int = 0  # > 0: report each token's log-probability and the n_probs most likely tokens
    t_max_predict_ms: float = 0.0  # > 0: stop generating this long after the first token (llama.cpp's field)
    # Speculative decoding, where the engine has a proposer: True its settings, False none for this request, or a
    # SpecConfig of this request's own (draft_max, draft_min, p_min).
    speculative: Any = True
    # Constrained decoding: a `ninfer.structured.Grammar` the output must match (None: free text).
    grammar: Any = None

    def sampler_args(self) -> dict[str, Any]:
        """The sampling chain's settings, as `_core.Sampler` and `SamplerThread.configure` take them (no seed)."""
        return dict(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            typical_p=self.typical_p, repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
        )


@dataclass
class Result:
    text: str
    tokens: list[int]
    prompt_n: int
    cached_n: int
    finish_reason: str  # "stop" | "length"
    stop_type: str  # llama.cpp's: "eos" | "word" | "limit"
    stopping_word: str
    prompt_ms: float
    predicted_ms: float
    slot: int
    probs: list[Probs] = field(default_factory=list)  # per token of `tokens`, when n_probs > 0
    draft_n: int = 0  # tokens drafted by speculative decoding (llama-server's timings.draft_n)
    draft_n_accepted: int = 0  # of them, accepted


# What a request hears, from the thread that runs the engine:
#   ("piece", (text, tokens so far, new token ids, their Probs))  text that is final, as it completes;
#   ("done", Result)  once, at the end;  ("error", Exception)  instead of "done" when it failed.
EventSink = Callable[[str, Any], None]


class Request:
    _ids = itertools.count()

    def __init__(self, prompt: list[int], params: GenParams, on_event: EventSink, *, deadline: float = math.inf,
                 stream: bool = True):
        self.id = next(self._ids)
        self.prompt = prompt
        self.params = params
        self.stream = stream  # False: no "piece" events, only the closing "done" or "error"
        self.on_event = on_event
        self.deadline = deadline  # time.monotonic() past which it is not started, or stopped
        self.cancelled = False  # set by abort(); the engine reads it once per step
        self.tokens_at_cancel = -1  # how many tokens it had when cancelled (-1: not cancelled)
        self.finished = False  # "done" or "error" was sent
        # More answers to the same prompt (OpenAI's n > 1): requests with this prompt that the engine starts as
        # forks of this one's sequence once its prompt is evaluated (until then they are in no queue).
        self.siblings: list[Request] = []

    def emit(self, kind: str, value: Any) -> None:
        if kind == "piece" and not self.stream:
            return
        if kind in ("done", "error"):
            self.finished = True
        self.on_event(kind, value)


class AsyncRequest(Request):
    """A request whose events land on an asyncio queue (`events`) of the loop that made it."""

    def __init__(self, prompt: list[int], params: GenParams, loop: asyncio.AbstractEventLoop, *,
                 deadline: float = math.inf, stream: bool = True):
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def deliver(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        super().__init__(prompt, params, deliver, deadline=deadline, stream=stream)


class Job:
    """Work that needs a KV sequence of its own for a moment (embeddings): run by the engine loop between steps on
    a free slot's sequence, emptied before and after. `fn(backend, seq)` runs on the loop's thread; its result or
    exception goes to `on_done(result, error)` on that thread."""

    def __init__(self, fn: Callable[[Any, int], Any], on_done: Callable[[Any, Exception | None], None]):
        self.fn = fn
        self.on_done = on_done


def reusable_prefix(cached: list[int], prompt: list[int]) -> int:
    """How many of the prompt's tokens, all but its last (whose logits the step needs), the cache holds already."""
    n = 0
    for a, b in zip(cached, prompt[:-1]):
        if a != b:
            break
        n += 1
    return n
