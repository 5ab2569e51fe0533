"""`AsyncLLM`: ninfer inside an asyncio program, on the engine loop run by an EngineThread (continuous batching
over slots), as the server runs it.

    llm = ninfer.AsyncLLM("model.gguf", n_parallel=4)
    async for piece in llm.stream("Once upon a time", max_tokens=64):
        print(piece, end="")
    out = await llm.generate("def f(x):", max_tokens=32, temperature=0)
    await llm.aclose()

Concurrent `stream`/`generate` calls share one engine thread; each takes a slot (or waits in the queue).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ninfer.config import SamplingParams, stop_strings
from ninfer.engine import AsyncRequest, EngineThread, GenParams, Result, check_serving_args
from ninfer.errors import InvalidArgumentError
from ninfer.llm import LLM, Completion, Timings
from ninfer.structured import Grammar


class AsyncLLM:
    def __init__(self, model: Any = None, *, n_parallel: int = 1, queue_size: int = 64, timeout_s: float = 600.0,
                 **llm_kwargs: Any):
        """`llm_kwargs` go to `LLM` (n_ctx is per slot); the model runs on the CPU engine."""
        check_serving_args(n_parallel, queue_size, timeout_s)  # (before the model loads)
        self.llm = LLM(model, n_seq_max=n_parallel, **llm_kwargs)
        self._sched = EngineThread(self.llm.engine, queue_size=queue_size, timeout_s=timeout_s)

    async def _submit(self, prompt: str | Sequence[int], max_tokens: int, sampling: dict[str, Any],
                      stop: str | Sequence[str], add_special: bool, cache_prompt: bool,
                      ignore_eos: bool) -> AsyncRequest:
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            raise InvalidArgumentError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        SamplingParams(**{k: sampling[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed")})
        asked = {k: sampling.pop(k) for k in ("json_schema", "grammar", "regex") if sampling.get(k) is not None}
        if asked and not isinstance(asked.get("grammar"), Grammar):  # (compiled on a thread: a schema takes a while)
            asked = {"grammar": await asyncio.to_thread(lambda: self.llm.compile_grammar(**asked))}
        ids = await asyncio.to_thread(self.llm.encode_prompt, prompt, add_special)
        params = GenParams(max_tokens=max_tokens, stop=stop_strings(stop), cache_prompt=cache_prompt,
                           ignore_eos=ignore_eos, **sampling, **asked)
        req = AsyncRequest(ids, params, asyncio.get_running_loop(),
                           deadline=time.monotonic() + self._sched.timeout_s)
        self._sched.submit(req)
        return req

    async def _events(self, req: AsyncRequest) -> AsyncIterator[tuple[str, Any]]:
        finished = False
        try:
            while True:
                kind, value = await req.events.get()
                if kind == "error":
                    finished = True
                    raise value
                finished = kind == "done"
                yield kind, value
                if finished:
                    return
        finally:
            if not finished:
                self._sched.cancel(req)

    async def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.8,
                     top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, seed: int | None = None,
                     stop: str | Sequence[str] = (), add_special: bool = True, cache_prompt: bool = False,
                     ignore_eos: bool = False, **more: Any) -> AsyncIterator[str]:
        """Text pieces as they are generated. `more`: typical_p, repeat_penalty, repeat_last_n,
        presence_penalty, frequency_penalty, logit_bias [(token, bias)], and constrained decoding's json_schema,
        grammar, regex (as `LLM.generate`). Leaving the loop early frees the slot."""
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, **more)
        req = await self._submit(prompt, max_tokens, sampling, stop, add_special, cache_prompt, ignore_eos)
        async for kind, value in self._events(req):
            if kind == "piece":
                yield value[0]

    async def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.8,
                       top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, seed: int | None = None,
                       stop: str | Sequence[str] = (), add_special: bool = True, cache_prompt: bool = False,
                       ignore_eos: bool = False, **more: Any) -> Completion:
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, **more)
        req = await self._submit(prompt, max_tokens, sampling, stop, add_special, cache_prompt, ignore_eos)
        result: Result | None = None
        async for kind, value in self._events(req):
            if kind == "done":
                result = value
        assert result is not None  # _events ends with "done" or raises
        return Completion(
            text=result.text, tokens=result.tokens, prompt_tokens=result.prompt_n,
            completion_tokens=len(result.tokens), finish_reason=result.finish_reason,
            timings=Timings(result.prompt_n - result.cached_n, result.prompt_ms, len(result.tokens),
                            result.predicted_ms),
            stopping_word=result.stopping_word,
        )

    async def chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> Completion:
        return await self.generate(self.llm.apply_chat_template(messages), add_special=False, **kwargs)

    def chat_stream(self, messages: list[dict[str, Any]], **kwargs: Any) -> AsyncIterator[str]:
        return self.stream(self.llm.apply_chat_template(messages), add_special=False, **kwargs)

    def close(self) -> None:
        self._sched.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self._sched.close)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
