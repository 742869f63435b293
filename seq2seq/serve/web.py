"""The translation page at `/` (seq2seq/serve/web/: index.html, app.js, style.css), served by the server itself with
nothing from elsewhere (no CDN, no web font: it works offline, behind a proxy under a prefix too, since every URL
in it is relative). The page talks to the server through its public API (/languages, /detect, /v1/translate,
/translate_file, /frontend/settings), as any client would.

Plain HTML, CSS and JavaScript with no library and no build step: what the page does (fetch, a few elements kept
in step with the answers) is small, and the browser's own Intl.Segmenter splits the text into sentences. The
answers' text is put in with textContent, never as markup, and the Content-Security-Policy allows scripts and
styles from this server alone: a translation (or a hostile source) cannot become active in the page.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

PAGE = Path(__file__).with_name("web")
HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


async def index(request: Request) -> Response:
    return FileResponse(PAGE / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)


class Assets(StaticFiles):
    """The page's scripts and styles, with its headers (StaticFiles sets none of them)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *((k.encode(), v.encode()) for k, v in HEADERS.items())]
            await send(message)

        await super().__call__(scope, receive, with_headers)  # type: ignore[arg-type]


def page_routes() -> list[BaseRoute]:
    return [Route("/", index, methods=["GET"]), Mount("/static", app=Assets(directory=PAGE), name="static")]
