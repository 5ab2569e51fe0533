"""OpenAI-style error objects for every failure the server answers: {"error": {"message", "type", "param", "code"}}.

One exception class (`APIError`) for what the handlers reject on purpose, and handlers that turn pydantic's
validation errors, unknown routes and ninfer's own exceptions into the same shape.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ninfer.errors import ContextOverflowError, NinferError

log = logging.getLogger("ninfer.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_ninfer(e: NinferError) -> APIError:
    if isinstance(e, ContextOverflowError):
        return APIError(400, str(e), code="context_length_exceeded")
    return APIError(400, str(e))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"malformed JSON in the request body: {ctx.get('error', err.get('msg'))}", None
    parts, param = [], None
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # Drop pydantic's union-branch labels (e.g. 'str', 'list[int]') from the path.
        field = ".".join(x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool"))
        param = param or field or None
        parts.append(f"{field or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(e)
        return APIError(400, message, param=param).response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), type=kind, headers=getattr(e, "headers", None)).response()

    @app.exception_handler(NinferError)
    async def _ninfer(_: Request, e: NinferError) -> JSONResponse:
        return from_ninfer(e).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
