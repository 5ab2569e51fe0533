"""`EngineThread`: the engine loop on a thread of its own, for callers that submit from elsewhere (the server's
handlers, `AsyncLLM`'s coroutines). Requests are counted against the slots and a waiting queue at submission;
everything else is the loop's (core.py)."""

from __future__ import annotations

import logging
import math
import threading

from ninfer.engine.core import EngineCore
from ninfer.engine.request import QueueFullError, Request
from ninfer.errors import InvalidArgumentError

log = logging.getLogger("ninfer.engine")


def check_serving_args(n_parallel: int, queue_size: int, timeout_s: float) -> None:
    """The serving knobs a caller of AsyncLLM or create_app sets (the CLI's flags are checked by argparse)."""
    if not isinstance(n_parallel, int) or n_parallel < 1:
        raise InvalidArgumentError(f"n_parallel must be a positive integer, got {n_parallel!r}")
    if not isinstance(queue_size, int) or queue_size < 0:
        raise InvalidArgumentError(f"queue_size must be an integer >= 0, got {queue_size!r}")
    if not isinstance(timeout_s, (int, float)) or not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise InvalidArgumentError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")


class EngineThread:
    def __init__(self, core: EngineCore, *, queue_size: int, timeout_s: float):
        self.core = core
        self.n_parallel = len(core.slots)
        self.queue_size = queue_size
        self.timeout_s = timeout_s  # a request's deadline, from its submission (the caller sets it)
        self.stats = core.stats
        if core.on_thread:
            raise InvalidArgumentError("this engine loop is already served by another EngineThread")
        core.on_thread = True
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> None:
        """Take `req`, or raise QueueFullError when the slots and the queue are all taken. Counted under the lock,
        at once: requests submitted before the engine thread has admitted any (a burst from idle) count too."""
        core = self.core
        with core.cv:
            running = core.running()
            waiting = sum(not r.cancelled for r in core.waiting)
            if running + waiting >= self.n_parallel + self.queue_size:
                core.stats["rejected"] += 1
                raise QueueFullError(f"{self.n_parallel} slots and a queue of {self.queue_size} are all taken "
                                     f"({running + waiting} requests running or waiting)")
            core.waiting.append(req)
            core.cv.notify()

    def cancel(self, req: Request) -> None:
        self.core.abort(req)

    def processing(self) -> int:
        return self.core.running()

    def deferred(self) -> int:
        return len(self.core.waiting)

    def kv_usage(self) -> tuple[int, float]:
        return self.core.kv_usage()

    def close(self) -> None:
        with self.core.cv:
            self._stop = True
            self.core.cv.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        core = self.core
        while True:
            with core.cv:
                while not self._stop and not core.has_work():
                    core.cv.wait()
                if self._stop:
                    break
            core.step()
        core.close()
        core.on_thread = False
