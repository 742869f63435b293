"""The server's guards on connections: the body size, the time to send a request, how many are open,
and what asyncio logs when the process runs out of file descriptors. What uvicorn and Starlette leave
open against slow, idle or flooding clients (each class says which of their options falls short)."""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import math
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

FD_RESERVE = 64  # open files kept for what is not a connection: the model, the event loop, torch's threads


class BodyTooLarge(Exception):
    """The body grew past --max-body-size while it was read: answered 413."""


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` is a 413, and no more of it is read. Checked from
    Content-Length before the app runs (h11 has checked it is a number), and counted as the body
    streams in (a chunked body declares no length): uvicorn holds at most ~64 KiB unread."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.max_bytes:
            message = (f"the request body has {int(declared)} bytes, more than this server's limit of "
                       f"{self.max_bytes} (--max-body-size); send less text per request")
            response = JSONResponse({"error": message}, status_code=413, headers={"connection": "close"})
            return await response(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge(f"the request body is over this server's limit of {self.max_bytes} bytes "
                                   "(--max-body-size); send less text per request")
            return message

        await self.app(scope, limited, send)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with what uvicorn 0.54 lacks against slow or idle clients: a deadline to
    send the whole request (--read-timeout, else 408 and closed) and a cap on open connections
    (--max-connections). uvicorn's own options do not cover them: limit_concurrency answers 503 only
    once a request's headers are in and keeps the connection (and its file descriptor) open,
    timeout_keep_alive only times the idle wait after a response, and h11_max_incomplete_event_size
    bounds the header bytes (16 KiB by default, kept) but not the time they take. At the cap, the
    connection that has waited longest without a request in progress (idle, or still sending its
    headers) is closed to make room; if every one has a request in progress, the new one gets a 503.
    `max_connections` and `read_timeout` are set on a subclass (uvicorn_config)."""

    max_connections = 512
    read_timeout = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timer: asyncio.TimerHandle | None = None
        self.waiting_since = time.monotonic()  # without a request in progress since then

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        full = len(self.connections) >= self.max_connections and not self.make_room()
        super().connection_made(transport)
        if full:
            self.refuse(503, "the server has too many open connections; retry later")
        else:
            self.watch_request()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.watch_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.waiting_since = time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
        super().connection_lost(exc)

    def watch_request(self) -> None:
        """The read deadline runs while a request is incomplete; uvicorn's keep-alive timer covers the
        idle wait between requests (this runs only when bytes arrive, and on a new connection)."""
        incomplete = self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing()
        if incomplete and self.read_timer is None:
            self.read_timer = self.loop.call_later(self.read_timeout, self.read_timed_out)
        elif not incomplete and self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None

    def read_timed_out(self) -> None:
        self.read_timer = None
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            self.refuse(408, f"the request was not received whole within {self.read_timeout:g} s (--read-timeout)")
        else:
            self.transport.close()

    def make_room(self) -> bool:
        """Close the connection waiting longest without a request in progress; False if there is none."""
        idle = [c for c in self.connections if isinstance(c, GuardedH11) and c.transport is not None
                and not c.transport.is_closing() and (c.cycle is None or c.cycle.response_complete)]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.waiting_since)
        if oldest.conn.trailing_data[0]:  # halfway through its headers: tell it why
            oldest.refuse(503, "the server is at its connection limit and closed the one waiting longest")
        else:
            oldest.transport.close()
        return True

    def refuse(self, status: int, message: str) -> None:
        """Answer `status` with {"error": message} straight to the socket (h11 sends a response only
        once a request's headers are in), and close."""
        body = json.dumps({"error": message}).encode()
        head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        self.transport.close()


def uvicorn_config(app: ASGIApp, *, max_connections: int = 512, read_timeout: float = 10.0,
                   **options: Any) -> uvicorn.Config:
    """uvicorn's Config for `app` with GuardedH11 as its protocol, whatever http protocols are
    installed (uvicorn would pick httptools if it were there), and no websockets (the app has no
    such route; an upgrade would hand the socket to a protocol without the guards). `options` go to
    uvicorn.Config; its warnings are rate-limited (OncePer)."""
    protocol = type("GuardedH11", (GuardedH11,), {"max_connections": max_connections, "read_timeout": read_timeout})
    config = uvicorn.Config(app, http=protocol, **{"ws": "none", **options})
    logger = logging.getLogger("uvicorn.error")  # configured by Config(): the filter goes on after it
    if not any(isinstance(f, OncePer) for f in logger.filters):
        logger.addFilter(OncePer(10.0))
    return config


class OncePer(logging.Filter):
    """A warning at most once per `seconds` for each call site: uvicorn logs "Invalid HTTP request
    received." for every malformed request, a line a connection for whoever sends garbage."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.last = seconds, dict[tuple[str, int], float]()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        now, key = time.monotonic(), (record.pathname, record.lineno)
        if now - self.last.get(key, -math.inf) < self.seconds:
            return False
        self.last[key] = now
        return True


class AcceptErrors:
    """The event loop's error handler, with "socket.accept() out of system resource" (no file
    descriptor left: EMFILE) as one line per 10 s instead of a traceback per accept() try: Python
    3.11's accept loop goes on trying up to `backlog` (2048) times per wake-up after the first
    failure, which wrote hundreds of thousands of tracebacks a minute. Each of those tries also
    schedules a retry of the listening socket 1 s later; one that runs after shutdown has closed the
    socket fails (ValueError: Invalid file descriptor: -1) and is dropped here too, as there is
    nothing left to retry. Other errors go where they went."""

    def __init__(self, previous: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object] | None) -> None:
        self.previous, self.last, self.suppressed = previous, -math.inf, 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        callback = getattr(context.get("handle"), "_callback", None)
        if getattr(callback, "__name__", "") == "_start_serving" and isinstance(context.get("exception"), ValueError):
            return  # a retry of accept() on a listening socket closed since (at shutdown)
        if context.get("message") != "socket.accept() out of system resource":
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self.last < 10:
            self.suppressed += 1
            return
        more = f" ({self.suppressed} more since the last such line)" if self.suppressed else ""
        print(f"error: cannot accept connections: {context.get('exception')}{more}; raise ulimit -n or lower "
              "--max-connections", file=sys.stderr, flush=True)
        self.last, self.suppressed = now, 0


def open_file_limit() -> int:
    """The number of files this process may open, its soft limit raised to the hard one first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
