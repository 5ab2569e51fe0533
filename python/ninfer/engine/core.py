"""The engine loop: requests in, one step at a time, text out. `LLM`, `AsyncLLM` and the server all drive this
one loop (the LLM methods step it on the caller's thread, the others through `EngineThread`).

A step is schedule -> run -> sample -> post-process:
1. admit waiting requests into free slots (a slot is a KV-cache sequence, seq id = slot index; with
   `cache_prompt` the slot whose cached tokens share the longest prefix with the prompt);
2. retire requests that were aborted or passed their deadline, freeing their KV blocks at once;
3. run what the batch policy plans (policy.py): prompt chunks alone, then one decode batch of every slot past its
   prompt (`Backend.decode`: forward and sampling in one call; a lone greedy row goes through `Backend.step`, where
   the backend takes the argmax on its own side, e.g. on the GPU); or prompt chunks and the decode rows together
   in one `Backend.forward`;
4. post-process each sampled token (`OutputText`: end-of-generation, stop strings, hold-back, budget) and emit
   the request's events.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from ninfer import _core
from ninfer.engine.backend import Backend
from ninfer.engine.output import EOS, LIMIT, Finish, OutputText
from ninfer.engine.policy import MixedChunks, PromptsAlone, SlotView
from ninfer.engine.request import DeadlineError, Job, Probs, Request, Result, reusable_prefix
from ninfer.engine.speculative import SpecConfig, Speculator
from ninfer.errors import NinferError
from ninfer.structured import Constraint
from ninfer.tokenizer import Tokenizer

log = logging.getLogger("ninfer.engine")

# Fewest prompt positions worth taking from another slot's cache (a fork copies a partial block of up to 256).
SHARE_MIN_TOKENS = 32


class _Slot:
    def __init__(self, index: int):
        self.index = index
        self.kv_tokens: list[int] = []  # what the KV cache holds for this sequence
        self.req: Request | None = None
        self.pending: list[int] = []  # prompt tokens still to evaluate
        self.next_input = 0  # the token the next decode step feeds
        self.output: OutputText | None = None
        self.argmax = False  # the request's sampler is a plain argmax (the backend may take it itself)
        self.probs: list[Probs] = []  # aligned with output.tokens when the request asked for n_probs
        self.sent = 0  # tokens of the output sent in "piece" events
        self.cached_n = 0
        self.draft_n = self.draft_accepted = 0  # tokens drafted for this request, and of them accepted
        self.t_start = self.t_first = 0.0
        self.predict_deadline = 0.0  # monotonic time after which generation stops (0: none)
        self.constraint: Constraint | None = None  # the request's grammar state (constrained decoding)

    @property
    def busy(self) -> bool:
        return self.req is not None

    @property
    def prefilling(self) -> bool:
        return self.req is not None and bool(self.pending)


@dataclass(frozen=True)
class Limits:
    n_ctx: int  # tokens one sequence holds
    n_batch: int  # prompt tokens one forward call takes
    max_blocks: int  # KV blocks of the whole pool (for kv_usage's share)


class EngineCore:
    def __init__(self, backend: Backend, tokenizer: Tokenizer, limits: Limits, *, n_slots: int,
                 sampler: _core.SamplerThread | None = None, policy: PromptsAlone | MixedChunks | None = None,
                 speculator: Speculator | None = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.limits = limits
        self.sampler = sampler if sampler is not None else _core.SamplerThread()
        self.policy = policy or PromptsAlone()
        self.speculator = speculator  # None: plain decoding only
        self.slots = [_Slot(i) for i in range(n_slots)]
        self.waiting: collections.deque[Request] = collections.deque()
        self.jobs: collections.deque[Job] = collections.deque()  # guarded by cv, as `waiting`
        # Guards `waiting` and the requests' `cancelled` flags: requests arrive and are aborted from other threads.
        self.cv = threading.Condition()
        self.stats: collections.Counter[str] = collections.Counter()
        self._argmax = _core.Sampler(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
        self._kv_blocks = 0
        self.on_thread = False  # an EngineThread steps this loop (nobody else may)

    def configure(self, *, n_slots: int | None = None, sampler: _core.SamplerThread | None = None,
                  policy: PromptsAlone | MixedChunks | None = None) -> None:
        """Before the first request: use only the first n_slots sequences, sample on another thread (e.g. one
        pinned to a core), or plan the steps with another batch policy."""
        assert not self.has_work(), "configure while requests are in flight"
        if n_slots is not None:
            self.slots = self.slots[: max(1, n_slots)]
        if sampler is not None:
            self.sampler = sampler
        if policy is not None:
            self.policy = policy

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        with self.cv:
            self.waiting.append(req)
            self.cv.notify()

    def add_job(self, job: Job) -> None:
        with self.cv:
            self.jobs.append(job)
            self.cv.notify()

    def abort(self, req: Request) -> None:
        """Stop `req` at the next step (its KV blocks freed, no "done" event); a request still waiting is dropped."""
        with self.cv:
            req.cancelled = True
            slot = next((s for s in self.slots if s.req is req), None)
            req.tokens_at_cancel = len(slot.output.tokens) if slot is not None and slot.output else 0
            self.cv.notify()

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.jobs) or any(s.busy for s in self.slots)

    def running(self) -> int:
        return sum(s.busy for s in self.slots)

    def kv_usage(self) -> tuple[int, float]:
        """(blocks in use, their share of the pool) as of the last step: safe to read from any thread (the backend
        itself is only touched by the thread that steps)."""
        return self._kv_blocks, self._kv_blocks / self.limits.max_blocks

    def release(self, seq: int) -> None:
        """Empty an idle slot's sequence (its cached prompt too), for a caller that uses the backend directly."""
        slot = self.slots[seq]
        assert not slot.busy, "release of a busy slot"
        self.backend.remove(seq)
        slot.kv_tokens = []
        self._note_kv()

    # ---- one step ---------------------------------------------------------------------------------------------
    def step(self) -> None:
        """One turn of the loop. An error that belongs to one request fails that request; an error of the step
        itself fails every request in flight, never the loop."""
        self._run_jobs()
        with self.cv:
            admitted = self._admit()
        try:
            for slot, req in admitted:
                self._start(slot, req)
            self._retire()
            plan = self.policy.plan([SlotView(s.index, s.busy, len(s.pending), s.req.id if s.req else 0)
                                     for s in self.slots])
            for i in plan.prefill:
                self._prefill_alone(self.slots[i], self.limits.n_batch)
            decoding = [self.slots[i] for i in plan.decode if self.slots[i].busy and not self.slots[i].pending]
            if plan.mixed:
                self._mixed([(self.slots[i], n) for i, n in plan.mixed], decoding)
            else:
                self._decode(decoding)
        except Exception as e:
            _log_failure("engine step failed", e)
            for s in self.slots:
                if s.busy:
                    self._finish(s, error=e)
        self._note_kv()

    def close(self) -> None:
        for s in self.slots:
            if s.busy:
                self._finish(s, error=RuntimeError("the engine is shutting down"))

    def _run_jobs(self) -> None:
        """Run waiting jobs, each on a free slot's sequence (its cached prompt dropped), while free slots last."""
        while True:
            with self.cv:
                free = [s for s in self.slots if not s.busy]
                if not self.jobs or not free:
                    return
                job = self.jobs.popleft()
            slot = min(free, key=lambda s: len(s.kv_tokens))
            self.release(slot.index)
            result, error = None, None
            try:
                result = job.fn(self.backend, slot.index)
            except Exception as e:  # the job's failure is its caller's alone
                _log_failure("job failed", e)
                error = e
            finally:
                self.release(slot.index)
            job.on_done(result, error)

    def _note_kv(self) -> None:
        self._kv_blocks = int(self.backend.kv_usage()[0])
        # (the tiered cache's prefetch counts, read here on the stepping thread for /metrics)
        prefetch = getattr(self.backend, "kv_prefetch_stats", None)
        counts = prefetch() if prefetch is not None else None
        for k, v in (counts or {}).items():
            self.stats[f"kv_prefetch_{k}"] = int(v)

    def _admit(self) -> list[tuple[_Slot, Request]]:
        """Pair waiting requests with free slots (under the lock). Expired ones are answered with an error."""
        out = []
        now = time.monotonic()
        while self.waiting:
            free = [s for s in self.slots if not s.busy]
            if not free:
                break
            req = self.waiting.popleft()
            if req.cancelled:
                continue
            if now > req.deadline:
                for r in (req, *req.siblings):
                    r.emit("error", DeadlineError("the request waited in the queue past its deadline"))
                continue
            if req.params.cache_prompt:
                slot = max(free, key=lambda s: (reusable_prefix(s.kv_tokens, req.prompt), -len(s.kv_tokens)))
            else:
                slot = min(free, key=lambda s: len(s.kv_tokens))
            slot.req = req
            out.append((slot, req))
        return out

    def _start(self, slot: _Slot, req: Request) -> None:
        p = req.params
        keep = reusable_prefix(slot.kv_tokens, req.prompt) if p.cache_prompt else 0
        self.backend.truncate(slot.index, keep)
        if keep == 0:
            self.backend.remove(slot.index)
        slot.kv_tokens = slot.kv_tokens[:keep]
        if p.cache_prompt:
            keep = self._share_prefix(slot, req.prompt, keep)
        slot.pending = req.prompt[keep:]
        slot.cached_n = keep
        limit = self.limits.n_ctx - len(req.prompt)
        slot.output = OutputText(self.tokenizer, stop=p.stop, budget=limit if p.max_tokens < 0 else
                                 min(p.max_tokens, limit), ignore_eos=p.ignore_eos)
        slot.probs, slot.sent = [], 0
        slot.draft_n = slot.draft_accepted = 0
        if self.speculator is not None:
            self.speculator.start(slot.index)
        slot.t_start = time.perf_counter()
        slot.t_first = slot.predict_deadline = 0.0
        seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little")
        try:
            args = p.sampler_args()
            slot.constraint = p.grammar.start() if p.grammar is not None else None
            slot.argmax = (p.n_probs == 0 and slot.constraint is None
                           and _core.Sampler(seed=seed, **args).is_greedy)
            self.sampler.configure(slot.index, seed=seed, n_probs=p.n_probs, **args)
            self.sampler.accept(slot.index, req.prompt)
        except Exception as e:
            self._finish(slot, error=e)

    def _share_prefix(self, slot: _Slot, prompt: list[int], keep: int) -> int:
        """Where another slot's cache holds a longer prefix of `prompt` than this slot keeps (a system prompt or a
        document that several conversations share), fork it into this slot: its whole blocks are shared, the
        partial last one copied, and only the rest of the prompt is evaluated. Returns the positions now held."""
        best, src = keep, None
        for other in self.slots:
            n = reusable_prefix(other.kv_tokens, prompt) if other is not slot else 0
            if n > best:
                best, src = n, other
        if src is None or best - keep < SHARE_MIN_TOKENS:
            return keep
        self.backend.fork(src.index, slot.index, best)
        slot.kv_tokens = prompt[:best]
        self.stats["prefix_shared_tokens"] += best - keep
        return best

    def _retire(self) -> None:
        now = time.monotonic()
        for s in self.slots:
            req = s.req
            if req is None:
                continue
            if req.cancelled:
                self.stats["cancelled"] += 1
                # Tokens generated after the abort arrived: at most the step that was running then.
                assert s.output is not None
                self.stats["tokens_after_cancel"] += len(s.output.tokens) - max(req.tokens_at_cancel, 0)
                self._finish(s, cancelled=True)
            elif now > req.deadline or (s.predict_deadline and now > s.predict_deadline):
                self.stats["timed_out"] += 1
                assert s.output is not None
                s.output.stop(LIMIT)
                self._finish(s)

    def _prefill_alone(self, s: _Slot, n: int) -> None:
        """The slot's next n prompt tokens in a forward call of their own; its failure is this request's alone."""
        chunk = s.pending[:n]
        try:
            logits = self.backend.prefill(s.index, chunk, self.limits.n_batch)
        except Exception as e:
            _log_failure("prompt evaluation failed", e)
            return self._finish(s, error=e)
        s.kv_tokens.extend(chunk)
        s.pending = s.pending[len(chunk):]
        if s.pending:
            return
        self._first_token(s, logits)

    def _first_token(self, s: _Slot, logits: np.ndarray) -> None:
        """The prompt is in the cache: draw the first token from its last logits (siblings first, see _fork)."""
        s.t_first = time.perf_counter()
        req = s.req
        assert req is not None
        ms = req.params.t_max_predict_ms
        s.predict_deadline = time.monotonic() + ms / 1e3 if ms > 0 else 0.0
        self.stats["prompt_tokens"] += len(req.prompt) - s.cached_n
        self.stats["prompt_s"] += s.t_first - s.t_start
        if req.siblings:
            self._fork(s, logits)
        if self._set_mask(s):
            self._on_token(s, *self.sampler.sample(s.index, logits))

    def _fork(self, s: _Slot, logits: np.ndarray) -> None:
        """Start the request's siblings (n > 1) on free slots: each slot's sequence becomes a fork of this one (the
        prompt's whole KV blocks shared, not recomputed) and its first token is drawn by its own sampler from the
        same logits. A sibling that finds no free slot waits in the queue and evaluates the prompt itself."""
        assert s.req is not None
        siblings, s.req.siblings = s.req.siblings, []
        for sib in siblings:
            if sib.cancelled:
                continue
            free = [x for x in self.slots if not x.busy]
            if not free:
                self.add_request(sib)
                continue
            c = min(free, key=lambda x: len(x.kv_tokens))
            c.req = sib
            self._start(c, sib)
            if c.req is not sib:  # (its settings failed: it has its error)
                continue
            try:
                self.backend.fork(s.index, c.index, len(s.kv_tokens))
            except NinferError as e:
                self._finish(c, error=e)
                continue
            c.kv_tokens, c.pending, c.cached_n = list(s.kv_tokens), [], len(s.kv_tokens)
            self._first_token(c, logits)

    def _mixed(self, chunks: list[tuple[_Slot, int]], decoding: list[_Slot]) -> None:
        """Prompt chunks and one decode row of every generating slot in one forward pass (the throughput policy):
        logits only for the rows that give a token, each sampled by its slot's chain. Should the pass fail (a full
        KV cache: nothing was appended), the step runs again the deterministic way, where a prompt's failure is
        its request's alone."""
        decoding = [s for s in decoding if self._set_mask(s)]  # (a constrained slot's grammar: its next token)
        batch: list[tuple[int, list[int]]] = []
        rows: list[int] = []
        sampled: list[tuple[_Slot, bool]] = []  # (slot, whether this row ends its prompt) for each logits row
        n_rows = 0
        for s, n in chunks:
            batch.append((s.index, s.pending[:n]))
            n_rows += n
            if n == len(s.pending):
                rows.append(n_rows - 1)
                sampled.append((s, True))
        for s in decoding:
            batch.append((s.index, [s.next_input]))
            rows.append(n_rows)
            sampled.append((s, False))
            n_rows += 1
        t0 = time.perf_counter()
        try:
            logits = self.backend.forward(batch, rows)
        except Exception as e:
            _log_failure("a mixed prompt and decode pass failed; running its parts apart", e)
            for s, n in chunks:
                self._prefill_alone(s, n)
            return self._decode(decoding)
        if decoding:
            self.stats["predicted_s"] += time.perf_counter() - t0
            self.stats["decode_steps"] += 1
        for (s, n), (_, tokens) in zip(chunks, batch):
            s.kv_tokens.extend(tokens)
            s.pending = s.pending[n:]
        for (s, prompt_end), row in zip(sampled, logits):
            if prompt_end:
                self._first_token(s, row)
            else:
                s.kv_tokens.append(s.next_input)
                self._on_token(s, *self.sampler.sample(s.index, row))

    def _decode(self, slots: list[_Slot]) -> None:
        if not slots:
            return
        drafts: dict[int, list[int]] = {}
        propose_s: dict[int, float] = {}  # seconds each slot's proposal took (speculation must pay for it too)
        if self.speculator is not None:
            for s in slots:
                n = self._draft_len(s)
                if n <= 0:
                    continue
                assert s.req is not None and s.output is not None
                history = s.req.prompt + s.output.tokens
                proposer = self.speculator.proposer
                t0 = time.perf_counter()
                if proposer.sync(s.index, history) > n + 1:  # a prompt, or the tokens of a pause: not what a
                    t0 = time.perf_counter()  # step of speculation costs (the token after a verify is)
                p_min = s.req.params.speculative.p_min if isinstance(s.req.params.speculative, SpecConfig) else None
                drafts[s.index] = proposer.propose(s.index, history, n, p_min)[:n]
                propose_s[s.index] = time.perf_counter() - t0
        plain = [s for s in slots if not drafts.get(s.index) and self._set_mask(s)]
        if plain:
            t0 = time.perf_counter()
            batch = [(s.index, s.next_input) for s in plain]
            if len(plain) == 1 and plain[0].argmax:
                draws: list[tuple[int, Probs | None]] = [(self.backend.step(*batch[0], self._argmax), None)]
            else:
                draws = self.backend.decode(batch, self.sampler)
            dt = time.perf_counter() - t0
            self.stats["predicted_s"] += dt
            self.stats["decode_steps"] += 1
            if self.speculator is not None and len(plain) == 1:
                self.speculator.note_plain(dt)
            for s, (_, fed), (tok, probs) in zip(plain, batch, draws):
                s.kv_tokens.append(fed)
                self._on_token(s, tok, probs)
        speculating = [s for s in slots if drafts.get(s.index)]
        if speculating:
            self._verify(speculating, drafts, propose_s)

    def _draft_len(self, s: _Slot) -> int:
        """How many tokens to draft for a slot now: 0 for sampled requests, within its budget and the context."""
        assert self.speculator is not None and s.req is not None and s.output is not None
        spec = s.req.params.speculative
        # (log-probabilities are reported by plain steps only; a grammar's mask is for one token at a time)
        if spec is False or s.req.params.n_probs > 0 or s.constraint is not None:
            return 0
        out = s.output
        room = min(out.budget - len(out.tokens), self.limits.n_ctx - len(s.kv_tokens) - 1) - 1
        return self.speculator.draft_len(s.index, room, spec if isinstance(spec, SpecConfig) else None)

    def _verify(self, slots: list[_Slot], drafts: dict[int, list[int]], propose_s: dict[int, float]) -> None:
        """One target forward over each slot's input token and drafts, every row computed as a single decode step
        computes it. Greedy slots take each row's token as a plain step takes it and keep the drafts up to the
        first one the target disagrees with (its token replaces it; when all pass, the last row gives one more);
        sampled slots accept each draft with the probability their sampler chain gives it, and on a rejection draw
        the replacement from that distribution without the draft (Leviathan et al.; `SamplerThread.verify`)."""
        assert self.speculator is not None
        t0 = time.perf_counter()
        batch = [(s.index, [s.next_input, *drafts[s.index]]) for s in slots]
        n_rows = sum(len(t) for _, t in batch)
        logits = self.backend.forward(batch, list(range(n_rows)), as_steps=True)
        dt = time.perf_counter() - t0
        self.stats["predicted_s"] += dt
        self.stats["decode_steps"] += 1
        base = 0
        for s, (_, tokens) in zip(slots, batch):
            d = drafts[s.index]
            rows = logits[base : base + len(tokens)]
            base += len(tokens)
            if s.argmax:
                out: list[int] = []
                for i in range(len(d) + 1):
                    out.append(self._argmax.sample(rows[i]))
                    if i == len(d) or out[-1] != d[i]:
                        break
            else:  # rejection sampling against the slot's sampler chain (its penalties see the accepted drafts)
                out = self.sampler.verify(s.index, rows, d)
            accepted = len(out) - 1
            # The cache holds the input token and every draft; keep the input and the accepted drafts.
            self.backend.truncate(s.index, self.backend.seq_len(s.index) - (len(d) - accepted))
            s.kv_tokens.extend(tokens[: 1 + accepted])
            s.draft_n += len(d)
            s.draft_accepted += accepted
            self.stats["draft_steps"] += 1
            self.stats["draft_tokens"] += len(d)
            self.stats["draft_accepted"] += accepted
            self.speculator.note_verify(s.index, len(d), accepted,
                                        propose_s[s.index] + dt * len(tokens) / n_rows)
            for tok in out:
                self._on_token(s, tok, None)
                if s.req is None:  # finished (end of generation, a stop string, the budget)
                    break

    def _set_mask(self, s: _Slot) -> bool:
        """Hand a constrained slot's allowed tokens to its sampler for the next draw; False (the request failed)
        if its grammar could not say."""
        if s.constraint is not None:
            try:
                self.sampler.set_mask(s.index, s.constraint.mask())
            except NinferError as e:
                self._finish(s, error=e)
                return False
        return True

    def _on_token(self, s: _Slot, token: int, probs: Probs | None) -> None:
        req, out = s.req, s.output
        assert req is not None and out is not None
        finish = out.push(token)
        if finish is not None and finish.kind == "eos":
            return self._finish(s)
        if finish is None and s.constraint is not None:
            try:
                if s.constraint.consume(token):  # the grammar is complete: it ends as at end-of-generation
                    out.stop(EOS)
                    finish = out.finish
            except NinferError as e:
                return self._finish(s, error=e)
        if probs is not None:
            s.probs.append(probs)
        self.stats["predicted_tokens"] += 1
        if finish is not None:
            return self._finish(s)
        self._send(s)
        s.next_input = token

    def _send(self, s: _Slot) -> None:
        assert s.req is not None and s.output is not None
        piece = s.output.take()
        if piece:
            tokens = s.output.tokens
            s.req.emit("piece", (piece, len(tokens), tokens[s.sent:], s.probs[s.sent:]))
            s.sent = len(tokens)

    def _finish(self, s: _Slot, *, cancelled: bool = False, error: Exception | None = None) -> None:
        req = s.req
        if req is None:
            return
        if self.speculator is not None and s.output is not None:
            self.speculator.proposer.finished(s.index, req.prompt + s.output.tokens)
        keep_kv = req.params.cache_prompt and not cancelled and error is None
        if not keep_kv:
            self.backend.remove(s.index)
            s.kv_tokens = []
        self.stats["requests_done"] += 1
        if error is not None:
            s.req, s.pending = None, []
            for r in (req, *req.siblings):  # (siblings not started yet share the failure of the prompt)
                r.emit("error", error)
            req.siblings = []
            return
        if cancelled:
            s.req, s.pending = None, []
            return
        out = s.output
        assert out is not None and out.finish is not None
        self._send(s)
        s.req, s.pending = None, []
        t_end = time.perf_counter()
        t_first = s.t_first or t_end
        finish: Finish = out.finish
        req.emit("done", Result(
            text=out.text, tokens=list(out.tokens), prompt_n=len(req.prompt), cached_n=s.cached_n,
            finish_reason=finish.reason, stop_type=finish.kind, stopping_word=finish.word,
            prompt_ms=(t_first - s.t_start) * 1e3, predicted_ms=(t_end - t_first) * 1e3, slot=s.index,
            probs=list(s.probs), draft_n=s.draft_n, draft_n_accepted=s.draft_accepted,
        ))


def _log_failure(what: str, e: Exception) -> None:
    """A NinferError is the request's (a full cache, a bad token): its message goes to the caller, the log gets a
    line; anything else is a bug, logged with its traceback."""
    if isinstance(e, NinferError):
        log.info("%s: %s", what, e)
    else:
        log.exception(what)
