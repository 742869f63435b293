"""HTTP translation server: LibreTranslate's API, with requests batched together as they arrive.

    python serve/server.py --checkpoint checkpoints/multi30k/best.ckpt --port 5000 [--beam-size 5]
    curl -s localhost:5000/translate -H 'Content-Type: application/json' \
         -d '{"q": "Ein Hund läuft.", "source": "de", "target": "en"}'
    {"translatedText":"A dog is running."}

Endpoints (JSON or form bodies, as LibreTranslate takes them; errors are `{"error": "..."}`):

    POST /translate      q (a string or a list), source, target, format (text), alternatives (n-best)
                         -> {"translatedText": ..., "alternatives": [...]}    LibreTranslate's
    GET  /languages      [{"code": "de", "name": "German", "targets": ["en"]}, ...]
    GET  /health         {"status": "ok", "batches": ..., "requests": ..., "sentences": ..., "queued": ...}
    POST /v1/translate   {"q": [...], "beam_size": 5, "nbest": 2, ...any SearchConfig field}
                         -> {"translations": [[{"text": ..., "score": ...}, ...], ...]}

Dynamic batching: a request's sentences join one queue; a batcher task takes whatever has arrived
within --max-wait-ms of the first (up to --max-tokens source tokens), decodes it as one length-sorted
batch in a worker thread (the event loop keeps accepting), and hands each request its own results.
Requests with different search options are decoded in separate batches, and seeded sampling
requests one at a time (a draw must not depend on what else arrived). The queue is bounded
(--max-queue: a full queue answers 429), a request's text too (--char-limit: 400), and a request
waits at most --timeout seconds (503). Bad input is a 400 with a one-line message, never a 500.
SIGTERM or Ctrl-C stops accepting, finishes the requests already in, and exits 0.

Starlette + uvicorn (the `[serve]` extra): FastAPI's models would add little here, since one
endpoint takes JSON and form bodies alike and the options are already one validated dataclass.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from seq2seq.model import ConfigError
from seq2seq.precision import tune_process_memory
from seq2seq.search import SearchConfig
from seq2seq.translate import (
    add_search_arguments,
    checkpoint_search,
    describe,
    load_translator,
    one_line_warnings,
    search_config,
)
from seq2seq.translator import Translation, Translator

LANGUAGE_NAMES = {"cs": "Czech", "de": "German", "en": "English", "fr": "French", "es": "Spanish", "it": "Italian",
                  "nl": "Dutch", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "zh": "Chinese",
                  "ja": "Japanese", "ar": "Arabic", "pl": "Polish", "tr": "Turkish", "uk": "Ukrainian"}


class BadRequest(Exception):
    """A client error: answered 400 with this message."""


class Busy(Exception):
    """The queue is full: answered 429."""


@dataclass
class Job:
    """One request's sentences, waiting for the batcher; `result` resolves to their n-best lists."""

    texts: list[str]
    search: SearchConfig
    tokens: int  # source tokens, counted against the batch budget
    result: asyncio.Future[list[list[Translation]]]


@dataclass
class Stats:
    batches: int = 0  # decoder calls (translate_nbest), each one length-sorted batch of requests
    requests: int = 0
    sentences: int = 0


@dataclass
class Batcher:
    """The queue of jobs and the task that decodes them in batches, one batch at a time."""

    translator: Translator
    max_tokens: int = 8192
    max_wait: float = 0.005  # seconds the first job of a batch waits for others to join it
    batching: bool = True  # False: one request per batch (the benchmark's baseline)
    max_queue: int = 1024
    stats: Stats = field(default_factory=Stats)

    def __post_init__(self) -> None:
        self.queue: asyncio.Queue[Job] = asyncio.Queue(self.max_queue)
        # One worker: torch already spreads one batch over the intra-op threads.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decoder")

    def submit(self, texts: list[str], search: SearchConfig) -> asyncio.Future[list[list[Translation]]]:
        """Queue the texts; raises Busy when the queue is full."""
        tokens = sum(len(ids) for ids in self.translator.tokenizer.encode(texts))
        job = Job(texts, search, tokens, asyncio.get_running_loop().create_future())
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            raise Busy(f"the server has {self.queue.qsize()} requests queued; retry later") from None
        self.stats.requests += 1
        return job.result

    async def run(self) -> None:
        """Forever: take the first job, gather what joins it within max_wait, decode, answer."""
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self.queue.get()]
            deadline = loop.time() + self.max_wait
            tokens = jobs[0].tokens
            while self.batching and tokens < self.max_tokens:
                try:
                    job = self.queue.get_nowait() if loop.time() >= deadline else await asyncio.wait_for(
                        self.queue.get(), deadline - loop.time())
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
                jobs.append(job)
                tokens += job.tokens
            await self._decode(jobs)

    async def _decode(self, jobs: list[Job]) -> None:
        jobs = [job for job in jobs if not job.result.done()]  # a request that timed out is not decoded
        by_search: dict[SearchConfig, list[Job]] = {}
        for job in jobs:
            by_search.setdefault(job.search, []).append(job)
        loop = asyncio.get_running_loop()
        groups = [group for search, group in by_search.items() if not (search.sampling and search.seed is not None)]
        # A seeded draw must not depend on what else arrived: such requests are decoded alone.
        groups += [[job] for search, group in by_search.items() if search.sampling and search.seed is not None
                   for job in group]
        for group in groups:
            search = group[0].search
            texts = [text for job in group for text in job.texts]
            try:
                results = await loop.run_in_executor(
                    self.executor, lambda texts=texts, search=search: self.translator.translate_nbest(
                        texts, search, max_tokens=self.max_tokens))
            except Exception as error:  # noqa: BLE001  # every waiting request must hear of it
                for job in group:
                    if not job.result.done():
                        job.result.set_exception(error)
                continue
            self.stats.batches += 1
            self.stats.sentences += len(texts)
            start = 0
            for job in group:
                if not job.result.done():
                    job.result.set_result(results[start : start + len(job.texts)])
                start += len(job.texts)

    async def drain(self) -> None:
        """Decode what is still queued (at shutdown), then stop the worker."""
        while not self.queue.empty():
            await self._decode([self.queue.get_nowait() for _ in range(self.queue.qsize())])
        self.executor.shutdown(wait=True)


# ---------------------------------------------------------------------------------------------
# Requests: parsing and checking, each problem a BadRequest with one line.


async def read_body(request: Request) -> dict[str, Any]:
    """JSON or form fields as a dict; a repeated form field `q` becomes a list."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    fields: dict[str, list[Any]] | None = None
    if content_type == "application/x-www-form-urlencoded":
        # Parsed here: Starlette (python-multipart) reads bytes that are not percent-encoded as
        # latin-1, but `curl -d q=Männer` sends them as raw UTF-8, which LibreTranslate accepts.
        try:
            text = (await request.body()).decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest("the form body is not UTF-8; send UTF-8 text (percent-encoded or raw)") from None
        fields = urllib.parse.parse_qs(text, keep_blank_values=True)
    elif content_type == "multipart/form-data":
        form = await request.form()
        fields = {key: form.getlist(key) for key in form}
    if fields is not None:
        return {key: values if len(values) > 1 else values[0] for key, values in fields.items()}
    raw = await request.body()
    if not raw:
        raise BadRequest("the request has no body; send JSON (or form fields) with q, source and target")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadRequest(f"the body is not valid JSON ({error}); send e.g. "
                         '{"q": "text", "source": "de", "target": "en"}') from None
    if not isinstance(body, dict):
        raise BadRequest(f"the JSON body must be an object with q, source and target, not a {type(body).__name__}")
    return body


def texts_of(body: dict[str, Any], *, char_limit: int) -> tuple[list[str], bool]:
    """The `q` field as a list of strings, and whether it was a single string."""
    if "q" not in body:
        raise BadRequest("missing field q: the text to translate (a string or a list of strings)")
    q = body["q"]
    single = isinstance(q, str)
    texts = [q] if single else q
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise BadRequest("q must be a string or a list of strings")
    if not texts or not any(t.strip() for t in texts):
        raise BadRequest("q is empty: give the text to translate")
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest("q holds a lone surrogate (\\ud800-\\udfff without its pair), which is not text; "
                             "send valid Unicode") from None
    chars = sum(len(t) for t in texts)
    if chars > char_limit:
        raise BadRequest(f"q has {chars} characters, more than this server's limit of {char_limit}; "
                         "split the text over several requests")
    # One request line is one sentence to the model: newlines inside would be translated as one.
    return [" ".join(t.split()) for t in texts], single


def int_field(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    number = None
    if not isinstance(value, bool):  # JSON true is not a count
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: 1e999 in JSON is infinity
            pass
    if number is None or (isinstance(value, float) and value != number):
        raise BadRequest(f"{name} must be a whole number, got {value!r}")
    return number


@dataclass
class Server:
    """The endpoints over one Translator and its Batcher."""

    batcher: Batcher
    search: SearchConfig  # the defaults: the command line's search options
    char_limit: int = 5000
    timeout: float = 60.0

    @property
    def translator(self) -> Translator:
        return self.batcher.translator

    async def translate(self, texts: list[str], search: SearchConfig) -> list[list[Translation]]:
        try:
            search.check_vocabulary(self.translator.model.config.vocab_size)
        except ConfigError as error:
            raise BadRequest(f"{error.field}: {error.problem}") from None
        future = self.batcher.submit(texts, search)
        try:
            return await asyncio.wait_for(future, self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no translation within {self.timeout:g} s; the server is busy, retry later") from None

    def check_languages(self, body: dict[str, Any]) -> None:
        source, target = body.get("source"), body.get("target")
        src, tgt = self.translator.src_lang, self.translator.tgt_lang
        if source not in (src, "auto") or target != tgt:
            raise BadRequest(f"this server translates {src} to {tgt} only (source {source!r}, target {target!r}); "
                             "GET /languages lists it")
        if body.get("format", "text") != "text":
            raise BadRequest(f"format {body.get('format')!r} is not supported; send plain text with format text")

    async def libretranslate(self, request: Request) -> JSONResponse:
        body = await read_body(request)
        texts, single = texts_of(body, char_limit=self.char_limit)
        self.check_languages(body)
        alternatives = int_field(body, "alternatives", 0)
        if not 0 <= alternatives <= 9:
            raise BadRequest(f"alternatives must be between 0 and 9, got {alternatives}")
        search = self.search
        if alternatives:  # n-best: the beam must hold them
            nbest = alternatives + 1
            search = dataclasses.replace(search, nbest=nbest, beam_size=max(search.beam_size, nbest), sampling=False)
        nbest_lists = await self.translate(texts, search)
        best = [hyps[0].text if hyps else "" for hyps in nbest_lists]
        others = [[h.text for h in hyps[1:]] + [""] * (alternatives - len(hyps[1:])) for hyps in nbest_lists]
        response: dict[str, Any] = {"translatedText": best[0] if single else best}
        if alternatives:
            response["alternatives"] = others[0] if single else others
        if body.get("source") == "auto":
            detected = {"confidence": 100.0, "language": self.translator.src_lang}
            response["detectedLanguage"] = detected if single else [detected] * len(texts)
        return JSONResponse(response)

    async def v1_translate(self, request: Request) -> JSONResponse:
        body = await read_body(request)
        texts, _ = texts_of(body, char_limit=self.char_limit)
        options = {k: v for k, v in body.items() if k != "q"}
        names = {f.name for f in dataclasses.fields(SearchConfig)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise BadRequest(f"unknown option {unknown[0]!r}; the options are {', '.join(sorted(names))}")
        try:
            search = dataclasses.replace(self.search, **options)
        except ConfigError as error:
            raise BadRequest(f"{error.field}: {error.problem}") from None
        nbest_lists = await self.translate(texts, search)
        return JSONResponse({"translations": [[{"text": h.text, "score": h.score} for h in hyps]
                                              for hyps in nbest_lists]})

    async def languages(self, request: Request) -> JSONResponse:
        src, tgt = self.translator.src_lang, self.translator.tgt_lang
        return JSONResponse([{"code": src, "name": LANGUAGE_NAMES.get(src, src), "targets": [tgt]},
                             {"code": tgt, "name": LANGUAGE_NAMES.get(tgt, tgt), "targets": []}])

    async def health(self, request: Request) -> JSONResponse:
        stats = self.batcher.stats
        return JSONResponse({"status": "ok", "batches": stats.batches, "requests": stats.requests,
                             "sentences": stats.sentences, "queued": self.batcher.queue.qsize(),
                             "precision": self.translator.precision})


def answer_errors(endpoint):
    """Each failure as {"error": ...} with its status; an unexpected one is a 500 that says what broke."""

    async def handle(request: Request) -> JSONResponse:
        try:
            return await endpoint(request)
        except BadRequest as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        except Busy as error:
            return JSONResponse({"error": str(error)}, status_code=429)
        except TimeoutError as error:
            return JSONResponse({"error": str(error)}, status_code=503)
        except Exception as error:  # noqa: BLE001  # a bug of ours: the client still gets JSON
            print(f"error: {request.method} {request.url.path}: {type(error).__name__}: {error}", file=sys.stderr)
            return JSONResponse({"error": f"internal error: {type(error).__name__}: {error}"}, status_code=500)

    return handle


def create_app(translator: Translator, search: SearchConfig | None = None, *, max_tokens: int = 8192,
               max_wait: float = 0.005, batching: bool = True, max_queue: int = 1024, char_limit: int = 5000,
               timeout: float = 60.0) -> Starlette:
    """The ASGI app; its batcher starts and drains with the app's lifespan. `search`: the requests'
    defaults (the translator's own, tuned on validation where its checkpoint stores them, if None)."""
    search = translator.search if search is None else search

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        batcher = Batcher(translator, max_tokens=max_tokens, max_wait=max_wait, batching=batching,
                          max_queue=max_queue)
        server = Server(batcher, search, char_limit=char_limit, timeout=timeout)
        app.state.server = server
        task = asyncio.create_task(batcher.run())
        try:
            yield
        finally:  # uvicorn has stopped accepting and waited for the open requests
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await batcher.drain()

    def route(path: str, name: str, methods: list[str]) -> Route:
        async def endpoint(request: Request) -> JSONResponse:
            return await getattr(request.app.state.server, name)(request)

        return Route(path, answer_errors(endpoint), methods=methods)

    routes = [route("/translate", "libretranslate", ["POST"]), route("/v1/translate", "v1_translate", ["POST"]),
              route("/languages", "languages", ["GET"]), route("/health", "health", ["GET"])]
    return Starlette(routes=routes, lifespan=lifespan)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python serve/server.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a .ckpt written by python -m seq2seq.fit")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--max-wait-ms", type=float, default=5.0,
                        help="how long a batch waits for more requests to join it (default: 5)")
    parser.add_argument("--no-batching", action="store_true", help="decode each request alone (a baseline)")
    parser.add_argument("--max-queue", type=int, default=1024, help="requests waiting at most; then 429")
    parser.add_argument("--char-limit", type=int, default=5000, help="characters per request at most; then 400")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a request waits at most; then 503")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    add_search_arguments(parser)
    args = parser.parse_args(argv)
    search = search_config(parser, args)
    for name in ("max_queue", "char_limit"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_wait_ms < 0 or args.timeout <= 0:
        parser.error("--max-wait-ms must be >= 0 and --timeout > 0")
    one_line_warnings()
    if args.threads:
        torch.set_num_threads(args.threads)
    translator = load_translator(args, search)
    search = checkpoint_search(parser, args, translator)
    app = create_app(translator, search, max_tokens=args.max_tokens, max_wait=args.max_wait_ms / 1000,
                     batching=not args.no_batching, max_queue=args.max_queue, char_limit=args.char_limit,
                     timeout=args.timeout)
    print(f"{translator.src_lang}→{translator.tgt_lang} on http://{args.host}:{args.port} ({translator.precision}, "
          f"{torch.get_num_threads()} threads, {describe(search)})", file=sys.stderr, flush=True)

    import uvicorn

    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then raises the signal again for the handler
    # that was there before it: these record it, so the process ends with a line and a plain exit
    # status (0 for SIGTERM, 130 for Ctrl-C) instead of dying by the signal or a KeyboardInterrupt.
    received: list[int] = []
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda number, frame: received.append(number))
    started = time.perf_counter()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=args.timeout)
    name = signal.Signals(received[0]).name if received else "the server"
    print(f"stopped by {name} after {time.perf_counter() - started:.0f}s", file=sys.stderr)
    sys.exit(130 if signal.SIGINT in received else 0)


if __name__ == "__main__":
    tune_process_memory()  # a process of its own: large blocks reused, oneDNN's kernel cache bounded
    main()
