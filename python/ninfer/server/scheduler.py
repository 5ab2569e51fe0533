"""The server's engine loop: `--parallel` slots, one thread, continuous batching.

Each slot is a KV-cache sequence (seq id = slot index) with its own sampler on the Rust sampler thread. The loop
turns once per decode step:

1. admit waiting requests into free slots (the slot whose cached tokens share the longest prefix with the prompt
   when `cache_prompt` is on);
2. retire requests that were cancelled (client gone) or passed their deadline, freeing their KV blocks at once;
3. evaluate one `n_batch` chunk of one prompt (a prompt never stalls the others for more than one chunk);
4. run one decode step for every generating slot as ONE batch (`Engine.decode`: forward + sampling in Rust).

Prompts are evaluated exactly as `LLM.generate` evaluates them (same chunks, their own forward calls), so a greedy
answer through the server equals `LLM.generate`'s: decode batches of 1-4 rows sum each dot product as one row does
(rust/core/src/quant/simd/mod.rs, `MatmulPos`), except for repacked Q4_0/Q4_K matrices with 4 rows in flight.

Events go back to the asyncio side through `loop.call_soon_threadsafe` onto the request's asyncio.Queue.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ninfer import _core
from ninfer.errors import InvalidArgumentError
from ninfer.llm import LLM, _stop_holdback
from ninfer.tokenizer import IncrementalDecoder

log = logging.getLogger("ninfer.server")

# A token's log-probability and the most likely tokens with theirs: (logprob, [(token, logprob), ...]).
Probs = tuple[float, list[tuple[int, float]]]


class QueueFullError(Exception):
    """Every slot is busy and the waiting queue holds --queue-size requests."""


class DeadlineError(Exception):
    """The request waited in the queue past its deadline."""


@dataclass
class GenParams:
    """One request's generation settings, already validated (see schemas.py)."""

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


class Request:
    _ids = itertools.count()

    def __init__(self, prompt: list[int], params: GenParams, loop: asyncio.AbstractEventLoop, deadline: float,
                 stream: bool = True):
        self.id = next(self._ids)
        self.prompt = prompt
        self.params = params
        self.stream = stream  # False: no "piece" events, only the closing "done" or "error"
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.deadline = deadline
        self.cancelled = False  # set from the asyncio side; the engine loop reads it once per step
        self.tokens_at_cancel = -1  # how many tokens it had when cancelled (-1: not cancelled)

    def emit(self, kind: str, value: Any) -> None:
        """("piece", (text, tokens so far, new token ids, their Probs)) | ("done", Result) | ("error", Exception),
        from the engine thread."""
        if kind == "piece" and not self.stream:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class _Slot:
    def __init__(self, index: int):
        self.index = index
        self.kv_tokens: list[int] = []  # what the KV cache holds for this sequence
        self.req: Request | None = None
        self.pending: list[int] = []  # prompt tokens still to evaluate
        self.next_input = 0  # the token the next decode step feeds
        self.out: list[int] = []
        self.probs: list[Probs] = []  # aligned with out when the request asked for n_probs
        self.text = ""
        self.emitted = 0  # characters of text sent
        self.sent = 0  # tokens of out sent
        self.budget = 0
        self.decoder: IncrementalDecoder | None = None
        self.cached_n = 0
        self.t_start = self.t_first = 0.0
        self.predict_deadline = 0.0  # monotonic time after which generation stops (0: none)


def check_scheduler_args(n_parallel: int, queue_size: int, timeout_s: float) -> None:
    """The serving knobs a caller of AsyncLLM or create_app sets (the CLI's flags are checked by argparse)."""
    if not isinstance(n_parallel, int) or n_parallel < 1:
        raise InvalidArgumentError(f"n_parallel must be a positive integer, got {n_parallel!r}")
    if not isinstance(queue_size, int) or queue_size < 0:
        raise InvalidArgumentError(f"queue_size must be an integer >= 0, got {queue_size!r}")
    if not isinstance(timeout_s, (int, float)) or not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise InvalidArgumentError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")


class Scheduler:
    def __init__(self, llm: LLM, *, n_parallel: int, queue_size: int, timeout_s: float,
                 sampler_core: int | None = None, sampler_rt: bool = False):
        check_scheduler_args(n_parallel, queue_size, timeout_s)
        self.llm = llm
        self.engine = llm._engine
        self.n_parallel = max(1, min(n_parallel, llm.n_seq_max))
        if self.n_parallel < n_parallel:
            log.warning("%d slots asked for, but the model was loaded for %d sequences (LLM(n_seq_max=)): "
                        "serving %d", n_parallel, llm.n_seq_max, self.n_parallel)
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self.sampler = _core.SamplerThread(core=sampler_core, realtime=sampler_rt)
        for w in self.sampler.warnings:
            log.warning("%s", w)
        self.slots = [_Slot(i) for i in range(self.n_parallel)]
        self.waiting: collections.deque[Request] = collections.deque()
        self.cv = threading.Condition()
        self.stats = collections.Counter()  # prompt_tokens, predicted_tokens, prompt_s, predicted_s, ...
        self.max_blocks = -(-llm.n_ctx // llm.config.kv_block_size) * llm.n_seq_max
        self._stop = False
        self._kv_blocks = 0
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
        self._thread.start()

    # ---- asyncio side ---------------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Take `req`, or raise QueueFullError when the slots and the queue are all taken. Counted under the lock,
        at once: requests submitted before the engine thread has admitted any (a burst from idle) count too."""
        with self.cv:
            running = sum(s.req is not None for s in self.slots)
            waiting = sum(not r.cancelled for r in self.waiting)
            if running + waiting >= len(self.slots) + self.queue_size:
                self.stats["rejected"] += 1
                raise QueueFullError(f"{len(self.slots)} slots and a queue of {self.queue_size} are all taken "
                                     f"({running + waiting} requests running or waiting)")
            self.waiting.append(req)
            self.cv.notify()

    def cancel(self, req: Request) -> None:
        with self.cv:
            req.cancelled = True
            slot = next((s for s in self.slots if s.req is req), None)
            req.tokens_at_cancel = len(slot.out) if slot is not None else 0
            self.cv.notify()

    def processing(self) -> int:
        return sum(s.req is not None for s in self.slots)

    def deferred(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> tuple[int, float]:
        """(blocks in use, their share of the pool) as of the engine thread's last change. The engine itself is
        only ever touched from the engine thread (a call from here would collide with a running step)."""
        blocks = self._kv_blocks
        return blocks, blocks / self.max_blocks

    def _note_kv(self) -> None:
        self._kv_blocks = int(self.engine.kv_usage()[0])

    def close(self) -> None:
        with self.cv:
            self._stop = True
            self.cv.notify()
        self._thread.join(timeout=30)

    # ---- engine thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cv:
                while not self._stop and not self.waiting and all(s.req is None for s in self.slots):
                    self.cv.wait()
                if self._stop:
                    break
                admitted = self._admit()
            try:
                for slot, req in admitted:
                    self._start(slot, req)
                self._retire_cancelled()
                prefilling = next((s for s in self.slots if s.req is not None and s.pending), None)
                if prefilling is not None:
                    try:
                        self._prefill_chunk(prefilling)
                    except Exception as e:  # this prompt's failure is this request's alone
                        log.warning("prompt evaluation failed: %s", e)
                        self._finish(prefilling, error=e)
                self._decode_step([s for s in self.slots if s.req is not None and not s.pending])
                self._note_kv()
            except Exception as e:  # an engine error fails the requests in flight, never the loop
                log.exception("engine step failed")
                for s in self.slots:
                    if s.req is not None:
                        self._finish(s, error=e)
                self._note_kv()
        for s in self.slots:
            if s.req is not None:
                self._finish(s, error=RuntimeError("the server is shutting down"))

    def _admit(self) -> list[tuple[_Slot, Request]]:
        """Pair waiting requests with free slots (under the lock). Expired ones are answered with an error."""
        out = []
        now = time.monotonic()
        while self.waiting:
            free = [s for s in self.slots if s.req is None]
            if not free:
                break
            req = self.waiting.popleft()
            if req.cancelled:
                continue
            if now > req.deadline:
                req.emit("error", DeadlineError("the request waited in the queue past its deadline"))
                continue

            def shared(s: _Slot, req: Request = req) -> int:
                n = 0
                for a, b in zip(s.kv_tokens, req.prompt[:-1]):
                    if a != b:
                        break
                    n += 1
                return n

            if req.params.cache_prompt:
                slot = max(free, key=lambda s: (shared(s), -len(s.kv_tokens)))
            else:
                slot = min(free, key=lambda s: len(s.kv_tokens))
            slot.req = req
            out.append((slot, req))
        return out

    def _start(self, slot: _Slot, req: Request) -> None:
        p = req.params
        keep = 0
        if p.cache_prompt:
            for a, b in zip(slot.kv_tokens, req.prompt[:-1]):
                if a != b:
                    break
                keep += 1
        self.engine.truncate(slot.index, keep)
        if keep == 0:
            self.engine.remove(slot.index)
        self._note_kv()
        slot.kv_tokens = slot.kv_tokens[:keep]
        slot.pending = req.prompt[keep:]
        slot.cached_n = keep
        slot.out, slot.probs, slot.text, slot.emitted, slot.sent = [], [], "", 0, 0
        slot.decoder = IncrementalDecoder(self.llm.tokenizer)
        limit = self.llm.n_ctx - len(req.prompt)
        slot.budget = limit if p.max_tokens < 0 else min(p.max_tokens, limit)
        slot.t_start = time.perf_counter()
        slot.t_first = slot.predict_deadline = 0.0
        seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little")
        try:
            self.sampler.configure(
                slot.index, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=seed,
                typical_p=p.typical_p, repeat_penalty=p.repeat_penalty, repeat_last_n=p.repeat_last_n,
                presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty, logit_bias=p.logit_bias,
                n_probs=p.n_probs,
            )
            self.sampler.accept(slot.index, req.prompt)
        except Exception as e:
            self._finish(slot, error=e)

    def _retire_cancelled(self) -> None:
        now = time.monotonic()
        for s in self.slots:
            if s.req is None:
                continue
            if s.req.cancelled:
                self.stats["cancelled"] += 1
                # Tokens generated after the cancel arrived: at most the step that was running then.
                self.stats["tokens_after_cancel"] += len(s.out) - max(s.req.tokens_at_cancel, 0)
                self._finish(s, cancelled=True)
            elif now > s.req.deadline or (s.predict_deadline and now > s.predict_deadline):
                self.stats["timed_out"] += 1
                self._finish(s, reason=("length", "limit"))

    def _prefill_chunk(self, s: _Slot) -> None:
        chunk = s.pending[: self.llm.config.n_batch]
        logits = self.engine.prefill(s.index, chunk, self.llm.config.n_batch)
        s.kv_tokens.extend(chunk)
        s.pending = s.pending[len(chunk):]
        if s.pending:
            return
        s.t_first = time.perf_counter()
        assert s.req is not None
        ms = s.req.params.t_max_predict_ms
        s.predict_deadline = time.monotonic() + ms / 1e3 if ms > 0 else 0.0
        self.stats["prompt_tokens"] += len(s.req.prompt) - s.cached_n
        self.stats["prompt_s"] += s.t_first - s.t_start
        self._on_token(s, *self.sampler.sample(s.index, logits))

    def _decode_step(self, slots: list[_Slot]) -> None:
        if not slots:
            return
        t0 = time.perf_counter()
        batch = [(s.index, s.next_input) for s in slots]
        draws = self.engine.decode(batch, self.sampler)
        self.stats["predicted_s"] += time.perf_counter() - t0
        self.stats["decode_steps"] += 1
        for s, (_, fed), (tok, probs) in zip(slots, batch, draws):
            s.kv_tokens.append(fed)
            self._on_token(s, tok, probs)

    def _on_token(self, s: _Slot, token: int, probs: Probs | None) -> None:
        """What LLM._run does with each sampled token: EOG, stop strings, held-back text, the length budget."""
        req = s.req
        assert req is not None and s.decoder is not None
        p = req.params
        if self.llm.tokenizer.is_eog(token) and not p.ignore_eos:
            return self._finish(s, reason=("stop", "eos"))
        s.out.append(token)
        if probs is not None:
            s.probs.append(probs)
        self.stats["predicted_tokens"] += 1
        s.text += s.decoder.push(token)
        stops = [x for x in p.stop if x]
        hit = min(((s.text.find(x, max(0, s.emitted - len(x) + 1)), x) for x in stops if x in s.text), default=None)
        if hit is not None:
            s.text = s.text[: hit[0]]
            return self._finish(s, reason=("stop", "word"), word=hit[1])
        safe = len(s.text) - _stop_holdback(s.text, stops)
        if safe > s.emitted:
            req.emit("piece", (s.text[s.emitted:safe], len(s.out), s.out[s.sent:], s.probs[s.sent:]))
            s.emitted, s.sent = safe, len(s.out)
        if len(s.out) >= s.budget:
            return self._finish(s, reason=("length", "limit"))
        s.next_input = token

    def _finish(self, s: _Slot, *, reason: tuple[str, str] = ("length", "limit"), word: str = "",
                cancelled: bool = False, error: Exception | None = None) -> None:
        req = s.req
        s.req, s.pending = None, []
        if req is None:
            return
        keep_kv = req.params.cache_prompt and not cancelled and error is None
        if not keep_kv:
            self.engine.remove(s.index)
            s.kv_tokens = []
            self._note_kv()
        self.stats["requests_done"] += 1
        if error is not None:
            req.emit("error", error)
            return
        if cancelled:
            return
        if reason[1] == "limit" and s.decoder is not None:
            s.text += s.decoder.flush()
        if len(s.text) > s.emitted:
            req.emit("piece", (s.text[s.emitted:], len(s.out), s.out[s.sent:], s.probs[s.sent:]))
        t_end = time.perf_counter()
        t_first = s.t_first or t_end
        req.emit("done", Result(
            text=s.text, tokens=list(s.out), prompt_n=len(req.prompt), cached_n=s.cached_n,
            finish_reason=reason[0], stop_type=reason[1], stopping_word=word,
            prompt_ms=(t_first - s.t_start) * 1e3, predicted_ms=(t_end - t_first) * 1e3, slot=s.index,
            probs=list(s.probs),
        ))
