"""The chat page at `/` (where llama-server has its web UI): three static files shipped inside the package
(ninfer/server/static: no build step, nothing fetched from elsewhere), read once when the app is made. The page
talks to this server's /v1/chat/completions with stream: true; it needs no API key to load (the key, when the
server has one, is typed into the page and sent with its requests)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

STATIC = Path(__file__).with_name("static")
# path -> (file in STATIC, media type)
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/static/chat.css": ("chat.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset(FILES)
# Scripts and styles from these files only (no inline code, no other origin); requests to this server only.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def add_chat_page(app: FastAPI) -> None:
    for path, (name, media_type) in FILES.items():
        body = (STATIC / name).read_bytes()

        async def page(body: bytes = body, media_type: str = media_type) -> Response:
            return Response(body, media_type=media_type, headers=HEADERS)

        app.add_api_route(path, page, methods=["GET"], include_in_schema=False)
