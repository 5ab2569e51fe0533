"""`ninfer serve` / `ninfer-cli`: the HTTP server, with llama-server's flag spellings.

    ninfer-cli --model M --ctx-size 160000 --n-gpu-layers 45 --threads 8 --batch-size 512 --port 8080 --host 0.0.0.0

An unknown or malformed flag ends with argparse's one line naming it and exit code 2. The model loads on a thread
after the socket is open, so /health answers 503 until it is ready; if loading fails the server stops (exit 2).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from ninfer.config import CACHE_TYPES

if TYPE_CHECKING:
    from ninfer.server import ServerSettings

EXIT_USAGE = 2
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def build_parser(prog: str = "ninfer serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Serve a GGUF model over HTTP: llama.cpp's /completion and the OpenAI API (/v1/...).")
    p.add_argument("-m", "--model", help="GGUF file (default: the embedded Gemma-3-270M, `ninfer[demo]`)")
    p.add_argument("-a", "--alias", default=None, help="model name clients use (default: the file name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096,
                   help="context size shared by the slots, as llama-server: each slot gets ctx-size / parallel")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=None,
                   help="layers on the GPU (-1: all, or what --gpu-mem-budget allows); 0 (the default, as "
                        "llama-server, unless --gpu-mem-budget is given) serves from the CPU. Without CuPy or a GPU "
                        "a warning says so and every layer runs on the CPU")
    p.add_argument("--gpu-mem-budget", default=None, metavar="SIZE", type=_size,
                   help="GPU memory to plan for, e.g. 12GiB: as many layers as fit it (weights, KV cache, "
                        "buffers), the rest on the CPU (-ngl defaults to -1 then)")
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's (for a GGUF without one)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto (default): the GPU when -ngl asks for layers and CuPy sees one; cpu: never")
    p.add_argument("-t", "--threads", type=int, default=0, help="worker threads (default: all cores)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="prompt tokens per batch (default 512)")
    p.add_argument("-ub", "--ubatch-size", "--max-num-batched-tokens", dest="ubatch_size", type=int, default=512,
                   help="rows of a forward pass that mixes prompts into the decode step (--batch-policy "
                        "throughput): the generating slots' tokens plus the waiting prompts' next chunks. Smaller "
                        "bounds how long a long prompt holds up the running streams; default 512, at most "
                        "--batch-size")
    p.add_argument("--batch-policy", choices=["throughput", "deterministic"], default="throughput",
                   help="throughput (default): new prompts, in chunks, share the forward pass of the other slots' "
                        "decode step; deterministic: each prompt chunk runs alone, so that greedy answers equal "
                        "LLM.generate's whatever else runs")
    p.add_argument("-np", "--parallel", type=int, default=1, help="slots: requests generated at once (default 1)")
    p.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="tokens to generate when a request says nothing (default -1: until the context is full)")
    p.add_argument("--temp", type=float, default=0.8, help="default temperature (default 0.8)")
    from ninfer.cli import add_kv_tier_args, add_rope_args, add_spec_args

    add_spec_args(p)
    add_kv_tier_args(p)
    add_rope_args(p)
    p.add_argument("-ctk", "--cache-type-k", choices=list(CACHE_TYPES), default="f16", help="K cache type")
    p.add_argument("-ctv", "--cache-type-v", choices=list(CACHE_TYPES), default="f16", help="V cache type")
    p.add_argument("-fa", "--flash-attn", nargs="?", const="on", choices=["on", "off", "auto"], default="auto",
                   help="accepted for compatibility: attention is always fused here (one pass, online softmax)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (not on /health, /metrics)")
    p.add_argument("--no-webui", action="store_true", help="do not serve the chat page at /")
    p.add_argument("--metrics", action="store_true", help="serve /metrics (Prometheus text format)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.add_argument("--queue-size", type=int, default=64,
                   help="requests that may wait for a slot; more get 503 with Retry-After (default 64)")
    p.add_argument("-to", "--timeout", type=float, default=600.0,
                   help="per-request deadline in seconds, queue wait included (default 600)")
    p.add_argument("--max-body-size", type=_size, default=4 * 2**20, metavar="SIZE",
                   help="largest request body accepted, e.g. 16MiB; a larger one is a 413, refused before it is "
                        "read (default 4MiB)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request's line and headers must arrive within this long, else the connection is "
                        "closed; then its whole body within as long again, else 408 and the connection is closed "
                        "(default 30)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="an idle keep-alive connection is closed after this long (default 5)")
    p.add_argument("--sampler-core", type=int, default=None, metavar="N",
                   help="pin the sampler thread to CPU core N")
    p.add_argument("--sampler-rt", action="store_true",
                   help="run the sampler thread under SCHED_FIFO (needs CAP_SYS_NICE; else one warning)")
    p.add_argument("--pooling", choices=["mean", "last"], default="mean",
                   help="how /embedding and /v1/embeddings pool the tokens' hidden states (default mean)")
    p.add_argument("--embeddings", "--embedding", action="store_true",
                   help="accepted for llama-server's command lines: the embedding endpoints are always served")
    r = p.add_argument_group("replicas on Ray Serve (`pip install 'ninfer[ray]'`; docs/replicas.md)")
    r.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N replicas of the model (one model each, --threads each) behind Ray Serve's HTTP "
                        "proxy on --host/--port; with --min/--max-replicas, the number to start with")
    r.add_argument("--min-replicas", type=int, default=None, metavar="N",
                   help="autoscale: never fewer replicas than this (default: --replicas)")
    r.add_argument("--max-replicas", type=int, default=None, metavar="N",
                   help="autoscale: never more replicas than this (default: --replicas)")
    r.add_argument("--target-ongoing-requests", type=float, default=None, metavar="N",
                   help="autoscale: add or remove replicas to keep about N requests on each (default: --parallel)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (as `ray start --address`, or 'auto'); default: start a local one")
    r.add_argument("--ray-startup-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="give up (exit 2) if the replicas are not all running after this long (default 600)")
    return p


def _check(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    for flag, value, low in (("--port", args.port, 0), ("--ctx-size", args.ctx_size, 1),
                             ("--batch-size", args.batch_size, 1), ("--ubatch-size", args.ubatch_size, 1),
                             ("--parallel", args.parallel, 1),
                             ("--threads", args.threads, 0), ("--queue-size", args.queue_size, 0)):
        if value < low:
            p.error(f"argument {flag}: must be >= {low}, got {value}")
    if args.port > 65535:
        p.error(f"argument --port: must be <= 65535, got {args.port}")
    if args.ctx_size // args.parallel < 2:
        p.error(f"argument --ctx-size: {args.ctx_size} leaves fewer than 2 tokens per slot for {args.parallel} slots")
    for flag, seconds in (("--timeout", args.timeout), ("--body-timeout", args.body_timeout),
                          ("--keep-alive-timeout", args.keep_alive_timeout)):
        if not (seconds > 0 and math.isfinite(seconds)):
            p.error(f"argument {flag}: must be a finite number of seconds > 0, got {seconds}")
    if args.max_body_size < 1:
        p.error(f"argument --max-body-size: must be at least 1 byte, got {args.max_body_size}")
    if args.sampler_core is not None and args.sampler_core < 0:
        p.error(f"argument --sampler-core: must be >= 0, got {args.sampler_core}")
    for flag, value in (("--replicas", args.replicas), ("--min-replicas", args.min_replicas),
                        ("--max-replicas", args.max_replicas)):
        if value is not None and value < 1:
            p.error(f"argument {flag}: must be >= 1, got {value}")
    if not (args.ray_startup_timeout > 0 and math.isfinite(args.ray_startup_timeout)):
        p.error("argument --ray-startup-timeout: must be a finite number of seconds > 0, got "
                f"{args.ray_startup_timeout}")


def _on_ray(args: argparse.Namespace) -> bool:
    return any(v is not None for v in (args.replicas, args.min_replicas, args.max_replicas,
                                       args.target_ongoing_requests, args.ray_address))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None, prog: str = "ninfer-cli") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.n_gpu_layers is None:  # (a budget is a request for the GPU)
        args.n_gpu_layers = -1 if args.gpu_mem_budget is not None else 0
    _check(args, parser)
    on_ray = _on_ray(args)
    if on_ray:
        try:
            import ray.serve  # noqa: F401
        except ImportError:
            print("ninfer: error: --replicas needs Ray Serve: pip install 'ninfer[ray]' (the ray[serve] package)",
                  file=sys.stderr)
            return EXIT_USAGE
    logging.basicConfig(level=args.log_level.upper(), format="ninfer: %(levelname)s: %(message)s", stream=sys.stderr)
    log = logging.getLogger("ninfer.server")

    from ninfer.backends import cuda_unavailable_reason
    from ninfer.chat import ChatTemplate, read_chat_template
    from ninfer.default_model import default_model_path
    from ninfer.errors import NinferError
    from ninfer.model_file import ModelFile

    model = args.model
    try:
        from ninfer.cli import rope_kwargs
        from ninfer.config import RopeConfig

        rope = rope_kwargs(args)
        if model is None and not on_ray:  # (replicas fetch the default model on their own nodes)
            model = default_model_path()
        mf = ModelFile(default_model_path() if model is None else model, rope=RopeConfig(**rope))
        spec = mf.spec
    except NinferError as e:
        print(f"ninfer: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    device = "cpu"
    if on_ray and args.device == "cuda":
        device = "cuda"  # (the replicas' nodes have the GPUs, not necessarily this one)
    elif args.n_gpu_layers != 0 and args.device != "cpu":
        reason = cuda_unavailable_reason()
        if reason is None:
            device = "cuda"
        elif args.device == "cuda":
            print(f"ninfer: error: device 'cuda' is not available: {reason}", file=sys.stderr)
            return EXIT_USAGE
        else:
            log.warning("--n-gpu-layers %d ignored: no GPU (%s); all %d layers run on the CPU", args.n_gpu_layers,
                        reason, len(spec["layers"]))
    try:  # (read and compiled before the banner: a bad file is named at once)
        from ninfer.cli import kv_tier_kwargs, spec_kwargs
        from ninfer.config import EngineConfig

        speculation = spec_kwargs(args)
        kv_tiers = kv_tier_kwargs(args)
        EngineConfig(cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,  # (checked now)
                     **{k: v for k, v in kv_tiers.items() if k != "host_mem_budget"})
        chat_template = read_chat_template(args.chat_template_file)
        if chat_template is not None:
            ChatTemplate.from_metadata(mf.metadata, template=chat_template)
        settings = _settings(args)
    except NinferError as e:
        print(f"ninfer: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.ray_address is None:  # (on a cluster of its own, Ray's proxy listens on this machine)
        bind_error = _bind_error(args.host, args.port)
        if bind_error:
            print(f"ninfer: error: {bind_error}", file=sys.stderr)
            return EXIT_USAGE
    n_ctx = args.ctx_size // args.parallel
    # LLM's arguments, the same for `ninfer serve` and each replica on Ray
    llm_kwargs = dict(n_ctx=n_ctx, threads=args.threads, n_batch=args.batch_size, cache_type_k=args.cache_type_k,
                      cache_type_v=args.cache_type_v, device=device, n_gpu_layers=args.n_gpu_layers,
                      gpu_mem_budget=args.gpu_mem_budget, n_seq_max=args.parallel, chat_template=chat_template,
                      **speculation, **kv_tiers, **rope)
    kv = mf.kv_bytes_per_token(CACHE_TYPES[args.cache_type_k][1], CACHE_TYPES[args.cache_type_v][1])
    weights = mf.weight_bytes()
    each = " each replica's" if on_ray else ""
    print(f"ninfer serve: model {mf.path} ({mf.architecture}, {mf.n_params() / 1e6:.0f} M parameters)\n"
          f"ninfer serve:{each} memory budget {_gib(weights + kv * n_ctx * args.parallel)} = weights "
          f"{_gib(weights)} (memory-mapped) + KV cache up to {_gib(kv * n_ctx * args.parallel)} ({args.parallel} "
          f"slots x {n_ctx} tokens, {args.cache_type_k}/{args.cache_type_v}, allocated as used)\n"
          + (f"ninfer serve: device cuda, -ngl {args.n_gpu_layers} (the GPU memory plan follows at load)\n"
             if device == "cuda" else ""),
          end="", file=sys.stderr, flush=True)
    if on_ray:
        from ninfer.server.replicas import serve_on_ray

        return serve_on_ray(args, model, settings, llm_kwargs, num_gpus=1 if device == "cuda" else 0)
    return _serve_here(args, model, settings, llm_kwargs)


def _settings(args: argparse.Namespace) -> ServerSettings:
    from ninfer.server import ServerSettings

    return ServerSettings(
        n_parallel=args.parallel, queue_size=args.queue_size, timeout_s=args.timeout, api_key=args.api_key,
        alias=args.alias, n_predict=args.n_predict, temperature=args.temp, metrics=args.metrics,
        sampler_core=args.sampler_core, sampler_rt=args.sampler_rt, max_body_bytes=args.max_body_size,
        body_timeout_s=args.body_timeout, pooling=args.pooling, webui=not args.no_webui,
        batch_policy=args.batch_policy, ubatch_size=args.ubatch_size,
    )


def _serve_here(args: argparse.Namespace, model: Any, settings: ServerSettings, llm_kwargs: dict[str, Any]) -> int:
    """One process: uvicorn on --host/--port, the model loading on a thread meanwhile."""
    import uvicorn

    from ninfer.llm import LLM
    from ninfer.server import create_app
    from ninfer.server.app import SHUTDOWN_GRACE_S
    from ninfer.server.guards import header_deadline_protocol

    print(f"ninfer serve: listening on http://{args.host}:{args.port} (/health is 503 until the model is loaded)",
          file=sys.stderr, flush=True)

    def load() -> LLM:
        return LLM(model, **llm_kwargs, log=lambda line: print(line, file=sys.stderr, flush=True))

    failed: list[Exception] = []

    def stop_on_load_error(e: Exception) -> None:
        failed.append(e)
        server.should_exit = True

    app = create_app(load=load, settings=settings, on_load_error=stop_on_load_error)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=args.log_level == "debug",
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                                           timeout_keep_alive=args.keep_alive_timeout,
                                           http=header_deadline_protocol(args.body_timeout)))
    try:
        server.run()
    except KeyboardInterrupt:
        return 130
    if failed:
        print(f"ninfer: error: the model failed to load: {failed[0]}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _size(text: str) -> int:
    """--gpu-mem-budget's and --max-body-size's value in bytes (argparse names the flag when it cannot be read)."""
    from ninfer.backends.budget import parse_size
    from ninfer.errors import InvalidArgumentError

    try:
        return parse_size(text)
    except InvalidArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bind_error(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (a name that does not resolve, an address not on this machine,
    a port in use), found by binding a socket before anything is announced or loaded; None when it can. (uvicorn
    would otherwise fail after the model's banner, with an errno and no address.)"""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn: a port in TIME_WAIT is free)
            s.bind(addr)
    except OSError as e:  # (socket.gaierror is one)
        return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


if __name__ == "__main__":
    sys.exit(main())
