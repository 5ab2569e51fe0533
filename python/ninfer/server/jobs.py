"""Awaiting work that the engine loop runs between steps on a sequence of its own (`ninfer.engine.Job`): the
embeddings, and the prompt's log-probabilities that `echo` reports."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ninfer.engine import EngineThread, Job
from ninfer.errors import NinferError
from ninfer.server.errors import from_ninfer


async def run_job(sched: EngineThread, fn: Callable[[Any, int], Any]) -> Any:
    """fn(backend, seq)'s result, computed on the engine thread; a NinferError is the client's 400."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def deliver(result: Any, error: Exception | None) -> None:
        def settle() -> None:
            if done.cancelled():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)
        loop.call_soon_threadsafe(settle)

    sched.core.add_job(Job(fn, deliver))
    try:
        return await done
    except NinferError as e:
        raise from_ninfer(e) from None
