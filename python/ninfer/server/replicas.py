"""`ninfer serve --replicas N`: the driver that deploys ninfer.ray's application on Ray Serve and watches it.

It starts a local Ray cluster (or joins --ray-address), starts Serve's HTTP proxy on --host/--port, deploys the
replicas and waits, for at most --ray-startup-timeout, until all are running. Then it prints each change in the
replicas' states (a replica that died and its replacement starting, autoscaling) until Ctrl-C or SIGTERM, when it
removes the application (and the cluster it started).
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
import time
from typing import Any

from ninfer.errors import NinferError
from ninfer.server.app import ServerSettings

APP_NAME = "ninfer"
EXIT_USAGE = 2
WATCH_PERIOD_S = 2.0


def _say(line: str) -> None:
    print(f"ninfer serve: {line}", file=sys.stderr, flush=True)


def serve_on_ray(args: argparse.Namespace, model: Any, settings: ServerSettings, llm_kwargs: dict[str, Any],
                 num_gpus: float) -> int:
    import ray
    from ray import serve

    from ninfer.ray import build_app, replica_counts, wait_running

    replicas = args.replicas or args.min_replicas or 1
    try:
        app = build_app(model, settings=settings, num_replicas=replicas, min_replicas=args.min_replicas,
                        max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
                        num_gpus=num_gpus, **llm_kwargs)
    except NinferError as e:
        print(f"ninfer: error: {e}", file=sys.stderr)
        return EXIT_USAGE

    def stop(signum: int, _: Any) -> None:  # SIGTERM cleans up as Ctrl-C does (else Ray's processes outlive us)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    own_cluster = args.ray_address is None
    _say("starting a local Ray cluster" if own_cluster else f"joining the Ray cluster at {args.ray_address}")
    try:
        try:
            # ("local": a cluster of our own even where `ray start` left one running, which ray.init() would join)
            ray.init(address=args.ray_address or "local", include_dashboard=False,
                     logging_level=args.log_level.upper())
        except ConnectionError as e:  # (a cluster with token authentication: Ray's clients need RAY_AUTH_MODE=token)
            print(f"ninfer: error: cannot join the Ray cluster at {args.ray_address}: {e} (if it was started with "
                  "token authentication, set RAY_AUTH_MODE=token)", file=sys.stderr)
            return EXIT_USAGE
        serve.start(http_options={"host": args.host, "port": args.port,
                                  "keep_alive_timeout_s": max(1, math.ceil(args.keep_alive_timeout))})
        # serve.run waits for the replicas without a bound (a replica Ray cannot place waits forever): it runs on
        # a thread, and the wait that gives up is wait_running's.
        deploy_error: list[BaseException] = []

        def deploy() -> None:
            try:
                serve.run(app, name=APP_NAME, route_prefix="/")
            except BaseException as e:  # (reported below, by the thread that waits)
                deploy_error.append(e)

        threading.Thread(target=deploy, name="ninfer-ray-deploy", daemon=True).start()
        _say(f"deploying {replicas} replica(s), {llm_kwargs.get('threads') or 'all'} thread(s) each")
        try:
            wait_running(APP_NAME, args.ray_startup_timeout, lambda line: _say(f"application {line}"),
                         failed=lambda: deploy_error[0] if deploy_error else None)
        except (TimeoutError, RuntimeError) as e:
            print(f"ninfer: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        _say(f"listening on http://{args.host}:{args.port} through Ray Serve's proxy")
        last = replica_counts(APP_NAME)
        while True:
            time.sleep(WATCH_PERIOD_S)
            counts = replica_counts(APP_NAME)
            if counts != last:
                _say(f"replicas {counts or '-'}")
                last = counts
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if ray.is_initialized():
            _say("removing the application" + (" and the local Ray cluster" if own_cluster else ""))
            if own_cluster:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
            ray.shutdown()
