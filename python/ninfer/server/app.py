"""The ASGI app: llama.cpp's /completion, OpenAI's /v1/completions and /v1/chat/completions, and the rest of
llama-server's surface (/health, /v1/models, /tokenize, /detokenize, /props, /metrics).

    app = ninfer.server.create_app(ninfer.LLM("model.gguf", n_seq_max=4), settings=ServerSettings(n_parallel=4))

The handlers validate, tokenize and hand a request to the engine loop (ninfer.engine, on its EngineThread); they
never run the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ninfer import _core
from ninfer.engine import POLICIES, AsyncRequest, DeadlineError, EngineThread, GenParams, QueueFullError, make_policy
from ninfer.engine.speculative import SpecConfig
from ninfer.errors import InvalidArgumentError, NinferError, shown
from ninfer.llm import LLM
from ninfer.server import embeddings, formats, metrics, structured, tools
from ninfer.server.choices import Answers
from ninfer.server.echo import Echo
from ninfer.server.errors import APIError, from_ninfer, install, sse
from ninfer.server.guards import Guard, TokenFloor
from ninfer.server.slots import slots_view
from ninfer.server.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingsRequest,
    LlamaEmbeddingRequest,
    OpenAICompletionRequest,
    TokenizeRequest,
)
from ninfer.server.webui import add_chat_page

log = logging.getLogger("ninfer.server")
# What a stopping server gives the requests in flight before it closes them (uvicorn's, and each Ray replica's).
SHUTDOWN_GRACE_S = 5.0


@dataclass
class ServerSettings:
    n_parallel: int = 1
    queue_size: int = 64
    timeout_s: float = 600.0  # per request, queue wait included
    api_key: str | None = None
    alias: str | None = None  # the model id clients name; default: the file name
    n_predict: int = -1  # default when a request gives none (-1: until the context is full)
    temperature: float = 0.8
    metrics: bool = True
    sampler_core: int | None = None
    sampler_rt: bool = False
    retry_after_s: int = 1
    max_body_bytes: int = 4 * 2**20  # a larger request body is a 413, refused before it is read
    body_timeout_s: float = 30.0  # the whole body within this long of the headers, or 408
    pooling: str = "mean"  # how the embedding endpoints pool the tokens' hidden states ("mean" or "last")
    webui: bool = True  # the chat page at / (ninfer/server/webui.py)
    # "throughput": prompt chunks run in the decode batch's forward pass, at most ubatch_size rows a step;
    # "deterministic": each prompt chunk alone, answers equal to LLM.generate's (ninfer/engine/policy.py)
    batch_policy: str = "throughput"
    ubatch_size: int = 512

    def __post_init__(self) -> None:
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise InvalidArgumentError(f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}")
        t = self.body_timeout_s
        if not isinstance(t, (int, float)) or not (t > 0 and math.isfinite(t)):
            raise InvalidArgumentError(f"body_timeout_s must be a finite number of seconds > 0, got {t!r}")
        if self.batch_policy not in POLICIES:
            raise InvalidArgumentError(f"batch_policy must be one of {', '.join(POLICIES)}, got {self.batch_policy!r}")
        if not isinstance(self.ubatch_size, int) or self.ubatch_size < 1:
            raise InvalidArgumentError(f"ubatch_size must be a positive integer, got {self.ubatch_size!r}")


class _State:
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.llm: LLM | None = None
        self.scheduler: EngineThread | None = None
        self.load_error: str | None = None
        self.token_floor: TokenFloor | None = None
        self.created = int(time.time())

    def attach(self, llm: LLM) -> None:
        s = self.settings
        self.scheduler = serve(llm, s)
        self.model_id = s.alias or llm.model_file.path.name
        tok = llm.tokenizer
        self.token_floor = TokenFloor.of([tok.token_text(i) for i in range(tok.vocab_size)],
                                         llm.model_file.metadata.get("tokenizer.ggml.model"))
        self.llm = llm

    def ready(self) -> tuple[LLM, EngineThread]:
        if self.load_error is not None:
            raise APIError(503, f"the model failed to load: {self.load_error}", type="unavailable_error")
        if self.llm is None or self.scheduler is None:
            raise APIError(503, "Loading model", type="unavailable_error")
        return self.llm, self.scheduler


def serve(llm: LLM, s: ServerSettings) -> EngineThread:
    """The LLM's engine loop on a thread of its own, with the settings' slots and sampler thread."""
    engine = llm.engine
    n_parallel = max(1, min(s.n_parallel, len(engine.slots)))
    if n_parallel < s.n_parallel:
        log.warning("%d slots asked for, but the model was loaded for %d sequences (LLM(n_seq_max=)): serving %d",
                    s.n_parallel, len(engine.slots), n_parallel)
    sampler = None
    if s.sampler_core is not None or s.sampler_rt:
        sampler = _core.SamplerThread(core=s.sampler_core, realtime=s.sampler_rt)
        for w in sampler.warnings:
            log.warning("%s", w)
    policy = make_policy(s.batch_policy, min(s.ubatch_size, engine.limits.n_batch), engine.limits.n_batch)
    engine.configure(n_slots=n_parallel, sampler=sampler, policy=policy)
    return EngineThread(engine, queue_size=s.queue_size, timeout_s=s.timeout_s)


class _JSONBodies:
    """Every POST body here is JSON: read it as JSON whatever Content-Type says (curl -d sends a form type;
    llama-server accepts that too)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


def create_app(llm: LLM | None = None, *, load: Callable[[], LLM] | None = None,
               settings: ServerSettings | None = None,
               on_load_error: Callable[[Exception], None] | None = None) -> FastAPI:
    """The server as an ASGI app. Pass a loaded `llm` (load it with n_seq_max >= n_parallel for parallel
    slots), or `load`, called on a thread at startup while /health answers 503 (if it raises, /health says why
    and `on_load_error` is called)."""
    if (llm is None) == (load is None):
        raise ValueError("create_app needs exactly one of llm= or load=")
    state = _State(settings or ServerSettings())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if llm is not None:
            state.attach(llm)
        else:
            def work() -> None:
                try:
                    state.attach(load())  # type: ignore[misc]
                    log.info("model loaded; serving")
                except Exception as e:  # reported by /health and every endpoint
                    log.error("model failed to load: %s", e)
                    state.load_error = str(e)
                    if on_load_error is not None:
                        on_load_error(e)
            threading.Thread(target=work, name="ninfer-load", daemon=True).start()
        yield
        if state.scheduler is not None:
            state.scheduler.close()

    app = FastAPI(title="ninfer", lifespan=lifespan)
    app.state.ninfer = state
    app.add_middleware(_JSONBodies)
    cfg = state.settings  # (the middleware added last runs first: the key and the body's limits before all else)
    app.add_middleware(Guard, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
                       body_timeout_s=cfg.body_timeout_s)
    install(app)
    if cfg.webui:
        add_chat_page(app)

    # ---- helpers ----------------------------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        """Any name: one model is served, and it answers to every name (as llama-server's does); /v1/models
        lists it. (Kept as the place a server of several models would choose.)"""

    def check_length(llm: LLM, text: str) -> None:
        """Refuse a text that cannot fit the context whatever its tokens, before tokenizing it."""
        floor = state.token_floor
        if floor is None or 4 * len(text) < llm.n_ctx * floor.per_token:  # (4: the most bytes of a character)
            return
        n_bytes, n_tokens = floor.min_tokens(text)
        if n_tokens >= llm.n_ctx:
            raise APIError(400, f"the prompt is {n_bytes} bytes long, so at least {n_tokens} tokens, but the context "
                                f"holds {llm.n_ctx} (n_ctx) including at least one generated token",
                           code="context_length_exceeded")

    async def prompt_ids(llm: LLM, prompt: str | list[int], add_special: bool = True) -> list[int]:
        if isinstance(prompt, str):
            check_length(llm, prompt)
        try:
            return await asyncio.to_thread(llm.encode_prompt, prompt, add_special)
        except NinferError as e:
            raise from_ninfer(e) from None

    def gen_params(llm: LLM, body: Any, max_tokens: int | None, name: str, bias: list[tuple[int, float]],
                   n_probs: int = 0) -> GenParams:
        n = state.settings.n_predict if max_tokens is None else max_tokens
        if n == 0 or n < -1:
            raise APIError(400, f"{name} must be -1 (until the context is full) or a positive integer, got {n}",
                           param=name)
        if n > llm.n_ctx:
            raise APIError(400, f"{name}={n} is more than the context holds (n_ctx={llm.n_ctx} per slot)",
                           param=name)
        for tok, _ in bias:
            if not 0 <= tok < llm.n_vocab:
                raise APIError(400, f"logit_bias: token id {tok} is out of range for a vocabulary of {llm.n_vocab}",
                               param="logit_bias")
        fields = body.model_fields_set
        return GenParams(
            max_tokens=n, temperature=body.temperature if "temperature" in fields else state.settings.temperature,
            # top_k past the vocabulary keeps everything, a window past the context sees all of it: clamp both.
            top_k=min(body.top_k, llm.n_vocab), top_p=body.top_p, min_p=body.min_p, typical_p=body.typical_p,
            repeat_penalty=body.repeat_penalty,
            repeat_last_n=llm.n_ctx if body.repeat_last_n == -1 else min(body.repeat_last_n, llm.n_ctx),
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            seed=None if body.seed in (None, -1) else body.seed, logit_bias=bias, stop=body.stop or [],
            ignore_eos=body.ignore_eos, cache_prompt=body.cache_prompt, n_probs=n_probs,
            t_max_predict_ms=getattr(body, "t_max_predict_ms", 0.0), speculative=speculation(llm, body),
        )

    def speculation(llm: LLM, body: Any) -> bool | SpecConfig:
        """The request's speculative.n_max/n_min/p_min over the server's settings (n_max 0: none for it)."""
        fields = {"n_max": body.speculative_n_max, "n_min": body.speculative_n_min, "p_min": body.speculative_p_min}
        if all(v is None for v in fields.values()) or llm.engine.speculator is None:
            return True
        if fields["n_max"] == 0:
            return False
        base = llm.engine.speculator.config
        try:
            return dataclasses.replace(base, **{k: v for k, v in fields.items() if v is not None})
        except NinferError as e:
            raise APIError(400, f"speculative: {e}", param="speculative.n_max") from None

    def parse_bias(raw: Any) -> list[tuple[int, float]]:
        if not raw:
            return []
        items = raw.items() if isinstance(raw, dict) else raw
        out = []
        for tok, b in items:
            try:
                tok = int(tok)
            except ValueError:
                raise APIError(400, f"logit_bias: {shown(tok)} is not a token id", param="logit_bias") from None
            out.append((tok, float("-inf") if b is False else float(b)))
        return out

    def submit(sched: EngineThread, prompt: list[int], params: GenParams, stream: bool) -> AsyncRequest:
        return submit_n(sched, prompt, params, stream, 1)[0]

    def submit_n(sched: EngineThread, prompt: list[int], params: GenParams, stream: bool, n: int
                 ) -> list[AsyncRequest]:
        """n answers to one prompt: the first request is queued, the others ride on it as its siblings (the
        engine forks its evaluated prompt for them); with a seed, answer i draws with seed + i."""
        loop, deadline = asyncio.get_running_loop(), time.monotonic() + state.settings.timeout_s
        reqs = [AsyncRequest(prompt, params if i == 0 or params.seed is None else
                             dataclasses.replace(params, seed=(params.seed + i) % 2**64), loop, deadline=deadline,
                             stream=stream) for i in range(n)]
        reqs[0].siblings = reqs[1:]
        try:
            sched.submit(reqs[0])
        except QueueFullError as e:
            raise APIError(503, f"the server is busy: {e}; retry later", type="unavailable_error",
                           code="queue_full", headers={"Retry-After": str(state.settings.retry_after_s)}) from None
        return reqs

    def failure(e: Exception) -> APIError:
        if isinstance(e, DeadlineError):
            return APIError(503, str(e), type="unavailable_error", code="timeout",
                            headers={"Retry-After": str(state.settings.retry_after_s)})
        if isinstance(e, NinferError):
            return from_ninfer(e)
        return APIError(500, f"generation failed: {e}", type="server_error")

    async def collect(http: Request, sched: EngineThread, req: AsyncRequest) -> Any:
        """Wait for the result of a non-streamed request (no pieces: only "done" or "error" comes); a client that
        hangs up cancels it at once. (The body is read: the next message receive() gives is http.disconnect.)"""

        async def hung_up() -> None:
            while (await http.receive())["type"] != "http.disconnect":
                pass

        result = asyncio.ensure_future(req.events.get())
        gone = asyncio.ensure_future(hung_up())
        try:
            await asyncio.wait((result, gone), return_when=asyncio.FIRST_COMPLETED)
            if not result.done():
                sched.cancel(req)
                raise APIError(499, "client closed the request")
            kind, value = result.result()
            if kind == "error":
                raise failure(value)
            return value
        except asyncio.CancelledError:
            sched.cancel(req)
            raise
        finally:
            result.cancel()
            gone.cancel()

    async def events(sched: EngineThread, req: AsyncRequest) -> AsyncIterator[tuple[str, Any]]:
        """The request's events until done; closing the iterator early (client gone) cancels the request."""
        finished = False
        try:
            while True:
                kind, value = await req.events.get()
                finished = kind in ("done", "error")
                yield kind, value
                if finished:
                    return
        finally:
            if not finished:
                sched.cancel(req)

    def stream(body: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- llama.cpp --------------------------------------------------------------------------------------------
    @app.post("/completion")
    @app.post("/completions")
    async def completion(body: CompletionRequest, http: Request) -> Any:
        llm, sched = state.ready()
        check_model(body.model)
        ids = await prompt_ids(llm, body.prompt)
        params = gen_params(llm, body, body.n_predict, "n_predict", parse_bias(body.logit_bias), body.n_probs)
        params.grammar = await structured.grammar_for(llm, body)
        piece = llm.tokenizer.token_to_piece
        req = submit(sched, ids, params, stream=body.stream)
        prompt_text = body.prompt if isinstance(body.prompt, str) else ""
        if not body.stream:
            return formats.llama_final(await collect(http, sched, req), state.model_id, params, prompt_text, piece)

        async def gen() -> AsyncIterator[str]:
            async for kind, value in events(sched, req):
                if kind == "piece":
                    chunk = {"index": 0, "content": value[0], "tokens": value[2], "stop": False, "id_slot": -1,
                             "tokens_predicted": value[1]}
                    if params.n_probs:
                        chunk["completion_probabilities"] = formats.llama_probs(piece, value[2], value[3])
                    yield sse(chunk)
                elif kind == "done":  # the text went out in the pieces: the closing object's content is empty
                    final = formats.llama_final(value, state.model_id, params, prompt_text, piece)
                    final.pop("completion_probabilities", None)
                    yield sse({**final, "content": "", "tokens": []})
                else:
                    yield sse(failure(value).body())
        return stream(gen())

    # ---- OpenAI -----------------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def v1_completions(body: OpenAICompletionRequest, http: Request) -> Any:
        llm, sched = state.ready()
        check_model(body.model)
        ids = await prompt_ids(llm, body.prompt)
        k = body.logprobs
        params = gen_params(llm, body, body.max_tokens, "max_tokens", parse_bias(body.logit_bias),
                            0 if k is None else max(k, 1))
        params.grammar = await structured.grammar_for(llm, body)
        echoed = None
        if body.echo:
            text = body.prompt if isinstance(body.prompt, str) else await asyncio.to_thread(llm.detokenize, ids)
            echoed = await Echo.of(sched, text, ids, k, llm.tokenizer.token_to_piece)
        return await openai_run(http, llm, sched, ids, params, body, chat=False, logprobs=k, echoed=echoed)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def v1_chat(body: ChatRequest, http: Request) -> Any:
        llm, sched = state.ready()
        check_model(body.model)
        try:  # (on a thread: a slow template must not hold the event loop, and every other client, meanwhile)
            text, offered = await asyncio.to_thread(tools.chat_prompt, llm, [m.as_template_input() for m in
                                                                            body.messages], body.tools,
                                                    body.tool_choice)
        except NinferError as e:
            raise from_ninfer(e) from None
        ids = await prompt_ids(llm, text, add_special=False)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = gen_params(llm, body, limit, "max_tokens", parse_bias(body.logit_bias), 0 if k is None else max(k, 1))
        params.grammar = await structured.grammar_for(llm, body, offered)
        return await openai_run(http, llm, sched, ids, params, body, chat=True, logprobs=k, offered=offered)

    async def merged(sched: EngineThread, reqs: list[AsyncRequest]) -> AsyncIterator[tuple[int, str, Any]]:
        """(answer index, kind, value) of several requests' events as they come, until each is done; closing
        early cancels the unfinished ones (each `events` generator does)."""
        inbox: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()

        async def pump(i: int, r: AsyncRequest) -> None:
            async for kind, value in events(sched, r):
                await inbox.put((i, kind, value))

        pumps = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            left = len(reqs)
            while left:
                item = await inbox.get()
                left -= item[1] in ("done", "error")
                yield item
        finally:
            for p in pumps:
                p.cancel()

    async def openai_run(http: Request, llm: LLM, sched: EngineThread, ids: list[int], params: GenParams, body: Any,
                         chat: bool, logprobs: int | None, offered: tools.Tools | None = None,
                         echoed: Echo | None = None) -> Any:
        reqs = submit_n(sched, ids, params, body.stream, body.n)
        answers = Answers(formats.OpenAI(state.model_id, chat, llm.tokenizer.token_to_piece, logprobs), body.n,
                          offered, echoed)
        if not body.stream:
            results = []
            try:
                for r in reqs:
                    results.append(await collect(http, sched, r))
            finally:
                for r in reqs:
                    if not r.finished:
                        sched.cancel(r)
            return answers.final(results)
        usage = body.stream_options is not None and body.stream_options.include_usage
        return stream(answers.stream(merged(sched, reqs), lambda e: failure(e).body(), usage))

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> Any:
        llm, _ = state.ready()
        return {"object": "list", "data": [{
            "id": state.model_id, "object": "model", "created": state.created, "owned_by": "ninfer",
            "meta": {"n_ctx": llm.n_ctx, "n_vocab": llm.n_vocab, "architecture": llm.architecture,
                     "size": llm.model_file.gguf.file_size, "n_params": llm.model_file.n_params()},
        }]}

    # ---- llama-server's utilities ----------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Any:
        state.ready()
        return {"status": "ok"}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Any:
        llm, _ = state.ready()

        def work() -> Any:
            ids = llm.tokenize(body.content, body.add_special)
            return [{"id": t, "piece": llm.detokenize([t])} for t in ids] if body.with_pieces else ids

        return {"tokens": await asyncio.to_thread(work)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Any:
        llm, _ = state.ready()
        bad = [t for t in body.tokens if not 0 <= t < llm.n_vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range for a vocabulary of {llm.n_vocab}",
                           param="tokens")
        return {"content": await asyncio.to_thread(llm.detokenize, body.tokens)}

    @app.get("/props")
    async def props() -> Any:
        llm, sched = state.ready()
        try:
            template = llm.chat_template.source
        except (NinferError, AttributeError):
            template = ""
        return {
            "default_generation_settings": {"n_ctx": llm.n_ctx, "n_predict": state.settings.n_predict,
                                            "temperature": state.settings.temperature, "model": state.model_id},
            "total_slots": sched.n_parallel, "model_path": str(llm.model_file.path), "chat_template": template,
            "build_info": f"ninfer {__import__('ninfer').__version__}",
        }

    @app.post("/v1/embeddings")
    @app.post("/embeddings")
    async def v1_embeddings(body: EmbeddingsRequest) -> Any:
        llm, sched = state.ready()
        check_model(body.model)
        return embeddings.openai_answer(await embeddings.run(llm, sched, body.input, state.settings.pooling,
                                                             prompt_ids), state.model_id, body.encoding_format)

    @app.post("/embedding")
    async def embedding(body: LlamaEmbeddingRequest) -> Any:
        llm, sched = state.ready()
        return embeddings.llama_answer(await embeddings.run(llm, sched, body.content, state.settings.pooling,
                                                            prompt_ids))

    @app.get("/slots")
    async def slots(fail_on_no_slot: int = 0) -> Any:
        llm, sched = state.ready()
        view = slots_view(sched, llm.n_ctx)
        if fail_on_no_slot and all(s["is_processing"] for s in view):
            raise APIError(503, "no slot available", type="unavailable_error")
        return view

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        if not state.settings.metrics:
            raise APIError(501, "metrics are off: start the server with --metrics", type="not_supported_error")
        _, sched = state.ready()
        body, content_type = metrics.render(sched)
        return Response(body, media_type=content_type)

    return app


__all__ = ["SHUTDOWN_GRACE_S", "JSONResponse", "ServerSettings", "create_app"]
