"""An OpenAI response of one or more answers (`n`): the final object of all of them, or their stream chunks as the
answers' events come, each with its answer's index, its tool calls (server/tools.py) and the echoed prompt
(server/echo.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from ninfer.engine import Result
from ninfer.server import tools
from ninfer.server.echo import Echo
from ninfer.server.errors import sse
from ninfer.server.formats import OpenAI


class Answers:
    def __init__(self, fmt: OpenAI, n: int, offered: tools.Tools | None, echoed: Echo | None):
        if echoed is not None:
            fmt.text_offset = echoed.text_offset()
        self.fmts = [fmt] + [fmt.sibling() for _ in range(n - 1)]  # (each answer keeps its own text offsets)
        self.offered, self.echoed = offered, echoed

    def final(self, results: list[Result]) -> dict[str, Any]:
        out = self.fmts[0].final(results[0])
        for i, (f, r) in enumerate(zip(self.fmts[1:], results[1:]), 1):
            out["choices"].append({**f.final(r)["choices"][0], "index": i})
            out["usage"]["completion_tokens"] += len(r.tokens)
            out["usage"]["total_tokens"] += len(r.tokens)
        for choice, r in zip(out["choices"], results):
            if self.offered is not None:
                tools.final_choice(choice, r.text, self.offered)
            if self.echoed is not None:
                self.echoed.prepend(choice)
        return out

    async def stream(self, events: AsyncIterator[tuple[int, str, Any]], error: Callable[[Exception], dict[str, Any]],
                     usage: bool) -> AsyncIterator[str]:
        """SSE lines of (answer index, kind, value) events; `error` gives an error's body."""
        fmts = self.fmts
        calls = [self.offered.stream() if self.offered is not None else None for _ in fmts]

        def indexed(chunk: dict[str, Any], i: int) -> str:
            chunk["choices"][0]["index"] = i
            return sse(chunk)

        for i, f in enumerate(fmts):
            if f.chat:
                yield indexed(f.chunk({"role": "assistant", "content": ""}, None), i)
            if self.echoed is not None:  # the prompt first, in each answer
                chunk = f.chunk("", None)
                self.echoed.prepend(chunk["choices"][0])
                yield indexed(chunk, i)
        done: list[Result] = []
        async for i, kind, value in events:
            f, held = fmts[i], calls[i]
            if kind == "piece":
                text = value[0] if held is None else held.feed(value[0])
                if text or held is None or f.logprobs is not None:
                    yield indexed(f.chunk(text, None, value[2], value[3]), i)
            elif kind == "done":
                finish = value.finish_reason
                if held is not None:  # what was held back: the rest of the text, or the calls
                    rest, found = held.finish()
                    if rest:
                        yield indexed(f.chunk(rest, None), i)
                    if found:
                        yield indexed(f.chunk({"tool_calls": [c.as_openai(k) for k, c in enumerate(found)]}, None), i)
                        finish = "tool_calls"
                yield indexed(f.chunk(None, finish), i)
                done.append(value)
            else:
                yield sse(error(value))
        if usage and done:
            last = fmts[0].usage_chunk(done[0])
            extra = sum(len(r.tokens) for r in done[1:])
            last["usage"]["completion_tokens"] += extra
            last["usage"]["total_tokens"] += extra
            yield sse(last)
        yield "data: [DONE]\n\n"
