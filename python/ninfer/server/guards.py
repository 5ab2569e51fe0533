"""What the server checks before a request reaches a handler, as one ASGI middleware around the app (`Guard`):

1. the API key, when one is set, on every path but /health and /metrics (the OpenAPI pages /docs, /redoc and
   /openapi.json included), before the body is read or validated: a client without the key learns nothing of the
   schema;
2. the body's size: a Content-Length over `max_body_bytes` is refused before a byte of the body is read, and a
   chunked body is counted as it arrives and refused as soon as it passes the limit (413);
3. the time the body takes to arrive: all of it within `body_timeout_s` of the request's headers, or 408 and the
   connection closed (a client that announces 1000 bytes and sends 10 no longer holds a connection).

The headers come before any middleware can run, so their deadline is in the HTTP protocol instead
(`header_deadline_protocol`): a connection whose request line and headers are not whole within the same time is
closed (a client that connects and sends nothing, or a header a byte a second, no longer holds one).

The body, once whole, is handed to the app as one message; after it the app's receive() is the server's own, so a
handler still sees the client hang up (http.disconnect).

Also `TokenFloor`: the fewest tokens a text can become, from its length, so a prompt that certainly cannot fit the
context is refused before the tokenizer spends memory and time on it.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass
from typing import Any

from ninfer.server.errors import APIError
from ninfer.server.webui import PAGE_PATHS
from ninfer.tokenizer import bytes_to_unicode

# Paths that answer without the API key, as llama-server's /health (and /metrics, which Prometheus scrapes), and the
# chat page's static files (the page asks for the key and sends it with its own requests).
OPEN_PATHS = frozenset({"/health", "/metrics", *PAGE_PATHS})


class _TooLarge(Exception):
    pass


class _Gone(Exception):
    pass


def _size(n: int) -> str:
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20} MiB"
    if n >= 2**10 and n % 2**10 == 0:
        return f"{n // 2**10} KiB"
    return f"{n} bytes"


def auth_error(headers: dict[str, str], key: str) -> APIError | None:
    """The 401 for a request whose `Authorization: Bearer KEY` (or `X-Api-Key`) is missing or wrong; None if right."""
    header = headers.get("authorization", "")
    given = header[7:].strip() if header.lower().startswith("bearer ") else headers.get("x-api-key")
    if given is not None and hmac.compare_digest(given.encode(), key.encode()):
        return None
    return APIError(401, "Invalid API Key" if given else "no API key given (Authorization: Bearer KEY)",
                    type="authentication_error", code="invalid_api_key")


class Guard:
    """ASGI middleware: the API key, then the body's size and arrival time (see the module's docstring)."""

    def __init__(self, app: Any, *, api_key: str | None, max_body_bytes: int, body_timeout_s: float):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            error = auth_error(headers, self.api_key)
            if error is not None:
                await error.response()(scope, receive, send)
                return
        length = headers.get("content-length")
        if length is None and "chunked" not in headers.get("transfer-encoding", "").lower():
            await self.app(scope, receive, send)  # no body (GET, HEAD)
            return
        too_large = APIError(413, f"the request body is larger than this server accepts ({_size(self.max_body_bytes)}"
                                  ", --max-body-size)", code="request_too_large")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await APIError(400, "Content-Length is not a number").response()(scope, receive, send)
                return
            if declared > self.max_body_bytes:
                # (The server reads and drops what the client still sends, up to its keep-alive timeout, so a
                # client that writes its whole body before reading gets this answer rather than a reset.)
                await too_large.response()(scope, receive, send)
                return
        try:
            body = await self._read(receive)
        except _Gone:
            return
        except _TooLarge:
            await too_large.response()(scope, receive, send)
            return
        except TimeoutError:
            error = APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                             code="request_timeout", headers={"Connection": "close"})
            await error.response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Any) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks: list[bytes] = []
        n = 0
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(receive(), left)
            if message["type"] == "http.disconnect":
                raise _Gone
            chunk = message.get("body", b"")
            n += len(chunk)
            if n > self.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """A receive() that gives the body read already as one message, then the server's own messages."""
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# The bytes UTF-8 text can hold: all but 0xC0, 0xC1 and 0xF5-0xFF, which no well-formed UTF-8 sequence contains.
UTF8_BYTES = [b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5]


@dataclass(frozen=True)
class TokenFloor:
    """A floor on how many tokens a text becomes, from its length alone, so a prompt that certainly cannot fit the
    context is refused before the tokenizer spends memory and time on it (a 10 MB prompt: seconds, a gigabyte).

    A vocab entry's raw text (Tokenizer.token_text) is at least as long in UTF-8 as the text it covers: byte-level
    BPE ('gpt2') writes each byte as one character of 1 or 2 bytes; SentencePiece ('llama') writes a space as
    '\u2581' (3 bytes) and other characters as themselves, and a byte token '<0xXX>' covers one byte; special
    tokens are cut out verbatim. So a text of B bytes is at least B / `per_token` tokens, `per_token` being the
    longest raw text, counting only the bytes the vocab can spell: byte-level BPE drops a byte whose character is
    not in the vocab (SmolLM2's has none for 0x04, for one), so those are not counted (`dropped`)."""

    per_token: int
    dropped: bytes = b""

    @classmethod
    def of(cls, tokens: list[str], model: str | None) -> TokenFloor | None:
        """From the vocab's raw texts and tokenizer.ggml.model; None when no floor holds (an unknown tokenizer, or
        SentencePiece without every byte token: a character it cannot spell may vanish whole)."""
        vocab = set(tokens)
        if model == "gpt2":
            chars = bytes_to_unicode()
            dropped = bytes(b for b in UTF8_BYTES if chars[b] not in vocab)
        elif model == "llama":
            if any(f"<0x{b:02X}>" not in vocab for b in UTF8_BYTES):
                return None
            dropped = b""
        else:
            return None
        longest = max((len(t.encode("utf-8")) for t in tokens), default=0)
        return cls(longest, dropped) if longest else None

    def min_tokens(self, text: str) -> tuple[int, int]:
        """(the text's length in UTF-8 bytes, the fewest tokens it can become)."""
        data = text.encode("utf-8", "surrogatepass")
        spelled = len(data.translate(None, self.dropped)) if self.dropped else len(data)
        return len(data), -(-spelled // self.per_token)


def header_deadline_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with a deadline on each request's line and headers: `seconds` from the connection's
    start, or from the first byte of a later request on a kept-alive connection, until the headers are whole; then
    the connection is closed. (Between requests uvicorn's keep-alive timeout applies; a body, the Guard's.)"""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderDeadline(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._watch_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_watching()
            super().connection_lost(exc)

        def _waiting_for_headers(self) -> bool:
            # (uvicorn makes a request's cycle when its headers are whole, and keeps it after its response)
            return self.cycle is None or self.cycle.response_complete

        def _watch_headers(self) -> None:
            if not self._waiting_for_headers():
                self._stop_watching()
            elif self._header_timer is None:  # (not re-armed by later bytes: a trickle does not extend it)
                self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def _stop_watching(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
