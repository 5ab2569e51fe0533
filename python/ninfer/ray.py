"""Replicas on Ray Serve: `ninfer serve --replicas N`, or your own application (`pip install 'ninfer[ray]'`).

    from ray import serve
    import ninfer.ray
    from ninfer.server import ServerSettings

    app = ninfer.ray.build_app("model.gguf", settings=ServerSettings(n_parallel=2), num_replicas=2,
                               n_ctx=2048, n_seq_max=2, threads=1)
    serve.run(app, name="ninfer", route_prefix="/")

Each replica is a Ray actor that loads the model (on its own node: the path is read there, the default model is
fetched there) and serves the app `ninfer serve` serves (ninfer.server.create_app) behind Ray's HTTP proxy, which
routes each request to a replica. A replica is ready once its model is loaded, so Ray routes nothing to a replica
still loading; Ray's health check calls the app's /health. Each response names the replica that made it in the
X-Ninfer-Replica header.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    from ray import serve
    from ray.serve.config import AutoscalingConfig
except ImportError as e:  # (the extra is optional: say which package brings it)
    raise ImportError(f"ninfer.ray needs Ray Serve: pip install 'ninfer[ray]' (the ray[serve] package): {e}") from e

from ninfer.errors import InvalidArgumentError
from ninfer.server.app import SHUTDOWN_GRACE_S, ServerSettings, create_app

# Ray Serve sends this logger to the replica's log file and the driver's stderr (a replica's own, per its docs).
log = logging.getLogger("ray.serve")

REPLICA_HEADER = "x-ninfer-replica"
# Ray calls check_health this often; a replica whose /health fails (or takes longer than the timeout) is replaced.
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Scaling:
    """How many replicas: `num_replicas` fixed, or autoscaled between min and max by ongoing requests a replica."""

    num_replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # default: the settings' slots (n_parallel)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise InvalidArgumentError(f"num_replicas must be at least 1, got {self.num_replicas}")
        lo, hi = self.bounds
        if lo < 1:  # (0 would leave no replica to answer the request that should scale it up)
            raise InvalidArgumentError(f"min_replicas must be at least 1, got {lo}")
        if hi < lo:
            raise InvalidArgumentError(f"max_replicas ({hi}) is less than min_replicas ({lo})")
        if not lo <= self.num_replicas <= hi:
            raise InvalidArgumentError(f"num_replicas ({self.num_replicas}) is outside [{lo}, {hi}]")
        t = self.target_ongoing_requests
        if t is not None and not (t > 0 and math.isfinite(t)):
            raise InvalidArgumentError(f"target_ongoing_requests must be a finite number > 0, got {t}")

    @property
    def bounds(self) -> tuple[int, int]:
        """(min, max) replicas; one not given defaults to num_replicas (within the other)."""
        lo, hi = self.min_replicas, self.max_replicas
        if lo is None:
            lo = self.num_replicas if hi is None else min(self.num_replicas, hi)
        return lo, max(self.num_replicas, lo) if hi is None else hi

    @property
    def autoscaled(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def deployment_options(self, n_parallel: int) -> dict[str, Any]:
        target = self.target_ongoing_requests or n_parallel
        # A replica takes its slots' worth and as many again waiting (their prompts start as soon as a slot frees);
        # the rest wait in Ray's proxy, where a replica started meanwhile can take them.
        options: dict[str, Any] = {"max_ongoing_requests": max(2 * n_parallel, math.ceil(target))}
        if self.autoscaled:
            lo, hi = self.bounds
            options["autoscaling_config"] = AutoscalingConfig(
                min_replicas=lo, max_replicas=hi, initial_replicas=self.num_replicas, target_ongoing_requests=target)
        else:
            options["num_replicas"] = self.num_replicas
        return options


class _NamedReplica:
    """ASGI middleware: every HTTP response carries the replica's id (which replica served what, for clients and
    for the tests that count it)."""

    def __init__(self, app: Any, name: str):
        self.app, self.replica_name = app, name.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica_name)]
                message = dict(message, headers=headers)
            await send(message)

        await self.app(scope, receive, named)


async def _status_of(app: Any, path: str) -> tuple[int, bytes]:
    """GET `path` from the ASGI app in this process: the status and body it answers."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    sent = False
    status, body = 0, b""

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # (no disconnect: the handler finishes first)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, body
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            body += message.get("body", b"")

    await app(scope, receive, send)
    return status, body


@serve.ingress()
class NinferReplica:
    """One replica: the model, loaded when the replica starts, and ninfer's app around it."""

    async def __init__(self, model: str | None, settings: ServerSettings, llm_kwargs: dict[str, Any]):
        from ninfer.llm import LLM

        started = time.monotonic()
        if model is None:  # the default model: joined from its package on this node, once (later replicas find it)
            from ninfer.default_model import default_model_path

            model = str(await asyncio.to_thread(default_model_path))
        context = serve.get_replica_context()
        self.replica_name = context.replica_id.unique_id
        self.settings = settings
        # (on a thread: Ray's calls into this replica, its health checks among them, go on meanwhile)
        self.llm = await asyncio.to_thread(LLM, model, **llm_kwargs, log=log.info)
        log.info("replica %s: %s loaded in %.1f s", self.replica_name, Path(model).name, time.monotonic() - started)

    def __serve_build_asgi_app__(self) -> Any:
        self.served_app = create_app(self.llm, settings=self.settings)
        self.served_app.add_middleware(_NamedReplica, name=self.replica_name)
        return self.served_app

    async def check_health(self) -> None:
        """Ray's health check is the app's /health: a replica it fails is replaced."""
        status, body = await _status_of(self.served_app, "/health")
        if status != 200:
            raise RuntimeError(f"/health answered {status}: {body.decode(errors='replace')[:200]}")


def build_app(model: str | Path | None = None, *, settings: ServerSettings | None = None, num_replicas: int = 1,
              min_replicas: int | None = None, max_replicas: int | None = None,
              target_ongoing_requests: float | None = None, num_gpus: float = 0,
              **llm_kwargs: Any) -> serve.Application:
    """The Ray Serve application of `ninfer serve`: replicas of `create_app(LLM(model, **llm_kwargs), settings)`.

    num_replicas replicas, or, with min_replicas/max_replicas, as many as keep about target_ongoing_requests
    (default: settings.n_parallel) requests on each. Each replica reserves `threads` CPUs (1 when threads is 0,
    all of a node's cores) and num_gpus GPUs. model None: the default model (`ninfer[demo]` on every node); a path
    is read on each replica's node, so it must exist there."""
    settings = settings or ServerSettings()
    scaling = Scaling(num_replicas, min_replicas, max_replicas, target_ongoing_requests)
    if "log" in llm_kwargs:
        raise InvalidArgumentError("build_app: log= is not sent to replicas (each logs to Ray's replica log)")
    threads = llm_kwargs.get("threads", 0)
    deployment = serve.deployment(
        NinferReplica, name="ninfer", ray_actor_options={"num_cpus": threads or 1, "num_gpus": num_gpus},
        health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        # (Ray's default grace, 20 s, would also hold up removing a replica that never started)
        graceful_shutdown_timeout_s=SHUTDOWN_GRACE_S, **scaling.deployment_options(settings.n_parallel))
    path = None if model is None else str(Path(model).expanduser().absolute())
    return deployment.bind(path, settings, llm_kwargs)


def replica_counts(app_name: str) -> dict[str, int]:
    """The replicas of the app's ninfer deployment by state (RUNNING, STARTING, ...), from Ray Serve's status."""
    app = serve.status().applications.get(app_name)
    if app is None or "ninfer" not in app.deployments:
        return {}
    return {str(getattr(k, "value", k)): n for k, n in app.deployments["ninfer"].replica_states.items() if n}


def wait_running(app_name: str, timeout_s: float, on_change: Callable[[str], None],
                 failed: Callable[[], BaseException | None] = lambda: None) -> None:
    """Wait until the app is RUNNING, for at most timeout_s; on_change gets each new line of status. Raises
    TimeoutError naming what is still pending (a replica that cannot be placed waits forever in Ray), or
    RuntimeError when the deployment failed (or `failed` returns the error that stopped it)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        error = failed()
        if error is not None:
            raise RuntimeError(f"the deployment failed: {error}")
        app = serve.status().applications.get(app_name)
        status = str(getattr(app.status, "value", app.status)) if app else "NOT_STARTED"
        line = f"{status.lower()}, replicas {replica_counts(app_name) or '-'}"
        message = app.deployments["ninfer"].message if app is not None and "ninfer" in app.deployments else ""
        if message:  # (its first line: a replica's error comes with its whole traceback, in Ray's replica log)
            line += f": {message.strip().splitlines()[0][:300]}"
        if line != last:
            on_change(line)
            last = line
        if status == "RUNNING":
            return
        if status == "DEPLOY_FAILED":
            raise RuntimeError(f"the deployment failed: {app.message if app else ''} {line}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the replicas were not running after {timeout_s:.0f} s ({line})")
        time.sleep(1.0)
