"""HTTP translation server: LibreTranslate's API, with requests batched together as they arrive.

    python serve/server.py --checkpoint checkpoints/multi30k/best.ckpt --port 5000 [--beam-size 5]
    curl -s localhost:5000/translate -H 'Content-Type: application/json' \
         -d '{"q": "Ein Hund läuft.", "source": "de", "target": "en"}'
    {"translatedText":"A dog is running."}

Endpoints (JSON or form bodies, as LibreTranslate takes them; errors are `{"error": "..."}`):

    POST /translate      q (a string or a list; each split into sentences, put back with its own
                         spacing), source, target, format (text), alternatives (n-best)
                         -> {"translatedText": ..., "alternatives": [...]}    LibreTranslate's
    GET  /languages      [{"code": "de", "name": "German", "targets": ["en"]}, ...]
    GET  /health         {"status": "ok", "batches": ..., "requests": ..., "sentences": ..., "queued": ...}
    POST /v1/translate   {"q": [...], "beam_size": 5, "nbest": 2, ...any SearchConfig field}
                         -> {"translations": [[{"text": ..., "score": ...}, ...], ...]}; with
                         "alignments": true each also has "alignment": [[i, j], ...], with
                         "token_scores": true "token_scores": [...]; "target_prefix": the start of
                         each translation (a string, or a list as long as q)

Dynamic batching: a request's sentences join one queue; a batcher task takes whatever has arrived
within --max-wait-ms of the first, decodes it in a worker thread (the event loop keeps accepting) in
calls of at most --max-batch-tokens, and hands each request its own results. Requests with different
search options are decoded in separate calls, and seeded sampling requests one at a time (a draw
must not depend on what else arrived). When a call fails, its requests are decoded again one at a
time, so that only the one that fails alone gets the error. A request whose client has gone (timed
out or disconnected) is not decoded. SIGTERM or Ctrl-C stops accepting, finishes the requests
already in, and exits 0.

A request's cost is bounded before it is queued, in decoder tokens: per sentence, its hypotheses
(the beam; 1 for greedy and sampling) times its output limit (max_len_a x source tokens + max_len_b,
at most the model's max_positions; the tokenizer counts the source), at least 16 each. Limits
(flag, default, answer beyond it):

    --char-limit 5000            characters of q per request                          400
    --max-request-tokens 16384   decoder tokens per request                           400
    --max-beam-size 16           beam_size of a request (LibreTranslate alternatives + 1)  400
    --max-batch-tokens 8192      decoder tokens per decoder call (bounds its memory)  split
    --max-queue 1024             requests waiting                                     429
    --timeout 60                 seconds a request waits for its translation          503
    --max-body-size 1048576      bytes of a request body (Content-Length or streamed) 413
    --read-timeout 10            seconds to send a whole request (headers and body)   408, closed
    --max-connections 512        open connections (idle ones are closed first)        503, closed

Bad input is a 400 with a one-line message, never a 500; running out of memory is a 503 and any
other failure a 500 without internals (stderr has the details, one line each).

Starlette + uvicorn (the `[serve]` extra): FastAPI's models would add little here, since one
endpoint takes JSON and form bodies alike and the options are already one validated dataclass.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import http
import itertools
import json
import logging
import math
import resource
import signal
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import h11
import torch
import uvicorn
from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from seq2seq.cli import add_search_arguments, check_flags, describe, one_line_warnings, open_translator
from seq2seq.model import ConfigError
from seq2seq.precision import tune_process_memory
from seq2seq.search import SearchConfig
from seq2seq.sentences import rejoin_all, split_paragraphs
from seq2seq.translator import Translation, Translator, check_glossary, glossary_terms

LANGUAGE_NAMES = {"cs": "Czech", "de": "German", "en": "English", "fr": "French", "es": "Spanish", "it": "Italian",
                  "nl": "Dutch", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "zh": "Chinese",
                  "ja": "Japanese", "ar": "Arabic", "pl": "Polish", "tr": "Turkish", "uk": "Ukrainian"}
# Every hypothesis holds a vocabulary-wide row of scores (the logits and the search's temporaries
# over them) however short its output: measured, about as much memory as 20 cached target positions.
# Charged less, a client could ask for one-step outputs (max_len_b 0) of thousands of one-token
# sentences and hold that many rows at once.
MIN_STEPS_CHARGED = 16
MAX_FORM_FIELDS = 1000  # as Starlette's request.form() allows
FD_RESERVE = 64  # open files kept for what is not a connection: the model, the event loop, torch's threads


class BadRequest(Exception):
    """A client error: answered 400 with this message."""


class Busy(Exception):
    """The queue is full: answered 429."""


class BodyTooLarge(Exception):
    """The body grew past --max-body-size while it was read: answered 413."""


def decoding_cost(length: int, search: SearchConfig, *, max_positions: int, at_least: int = 0) -> int:
    """The decoder tokens one sentence of `length` source tokens may cost: its hypotheses times its
    steps (the output limit as search.max_lengths computes it, raised to the `at_least` tokens a target
    prefix and constraints need, plus EOS), at least MIN_STEPS_CHARGED."""
    if length == 0:
        return 0  # an empty line is answered without decoding
    length = min(length, max_positions)  # the Translator truncates a longer line
    limit = min(max(math.floor(search.max_len_a * length + search.max_len_b), at_least, 0), max_positions - 1)
    rows = 1 if search.sampling else search.beam_size
    return rows * max(limit + 1, MIN_STEPS_CHARGED)


def shown(value: Any, limit: int = 100) -> str:
    """`value`'s repr for a message, cut to `limit` characters: a client's value may be megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def summary(error: BaseException) -> str:
    """One line for the log: the error's type and the first line of its message."""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:500]


def out_of_memory(error: BaseException) -> bool:
    # torch's CPU allocator raises a RuntimeError ("DefaultCPUAllocator: can't allocate memory"),
    # CUDA's torch.OutOfMemoryError (a RuntimeError too): neither message is for the client.
    return isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and any(s in str(error) for s in ("can't allocate memory", "out of memory")))


@dataclass
class Job:
    """One request's sentences, waiting for the batcher; `result` resolves to their n-best lists."""

    texts: list[str]
    search: SearchConfig
    costs: list[int]  # decoder tokens per sentence (decoding_cost)
    result: asyncio.Future[list[list[Translation]]]
    generator: torch.Generator | None = None  # seeded sampling: one for all the job's decoder calls
    prefixes: list[str] | None = None  # /v1's target_prefix: the start of each translation ("" for none)
    constraints: list[list[str]] | None = None  # /v1's constraints and glossary terms: phrases per text
    answers: dict[int, list[Translation]] = field(default_factory=dict)

    @property
    def cost(self) -> int:
        return sum(self.costs)

    def answer(self, index: int, translations: list[Translation]) -> None:
        self.answers[index] = translations
        if len(self.answers) == len(self.texts) and not self.result.done():
            self.result.set_result([self.answers[i] for i in range(len(self.texts))])


@dataclass
class Stats:
    batches: int = 0  # decoder calls (translate_nbest), each one length-sorted batch of sentences
    requests: int = 0
    sentences: int = 0


@dataclass
class Batcher:
    """The queue of jobs and the task that decodes them in batches, one decoder call at a time."""

    translator: Translator
    max_tokens: int = 8192  # source tokens per encoder batch, as translate_nbest takes them
    max_batch_tokens: int = 8192  # decoder tokens (decoding_cost) per decoder call
    max_wait: float = 0.005  # seconds the first job of a batch waits for others to join it
    batching: bool = True  # False: one request per batch (the benchmark's baseline)
    max_queue: int = 1024
    stats: Stats = field(default_factory=Stats)

    def __post_init__(self) -> None:
        self.queue: asyncio.Queue[Job] = asyncio.Queue(self.max_queue)
        # One worker: torch already spreads one batch over the intra-op threads.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decoder")

    def costs(self, texts: list[str], search: SearchConfig, *, at_least: list[int] | None = None) -> list[int]:
        """decoding_cost of each text, from the tokenizer's count of its tokens (`at_least`: the target
        tokens each must hold, its prefix's and constraints')."""
        max_positions = self.translator.model.config.max_positions
        needed = at_least if at_least is not None else [0] * len(texts)
        return [decoding_cost(len(ids), search, max_positions=max_positions, at_least=n)
                for ids, n in zip(self.translator.tokenizer.encode_source(texts), needed, strict=True)]

    def submit(self, texts: list[str], search: SearchConfig, *, costs: list[int] | None = None,
               prefixes: list[str] | None = None,
               constraints: list[list[str]] | None = None) -> asyncio.Future[list[list[Translation]]]:
        """Queue the texts (with the start each translation must have, if `prefixes`); raises Busy when
        the queue is full."""
        costs = self.costs(texts, search) if costs is None else costs
        generator = None
        if search.sampling and search.seed is not None:
            generator = torch.Generator(device=self.translator.device).manual_seed(search.seed)
        job = Job(texts, search, costs, asyncio.get_running_loop().create_future(), generator, prefixes, constraints)
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
            cost = jobs[0].cost
            while self.batching and cost < self.max_batch_tokens:
                try:
                    job = self.queue.get_nowait() if loop.time() >= deadline else await asyncio.wait_for(
                        self.queue.get(), deadline - loop.time())
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
                jobs.append(job)
                cost += job.cost
            await self._decode(jobs)

    async def _decode(self, jobs: list[Job]) -> None:
        by_search: dict[SearchConfig, list[Job]] = {}
        for job in jobs:
            by_search.setdefault(job.search, []).append(job)
        groups = [group for search, group in by_search.items() if not (search.sampling and search.seed is not None)]
        # A seeded draw must not depend on what else arrived: such requests are decoded alone.
        groups += [[job] for search, group in by_search.items() if search.sampling and search.seed is not None
                   for job in group]
        for group in groups:
            for call in self._calls(group):
                await self._decode_call(call)

    def _calls(self, group: list[Job]) -> list[list[tuple[Job, int]]]:
        """The group's sentences (job, index) in arrival order, cut into calls of <= max_batch_tokens."""
        calls: list[list[tuple[Job, int]]] = [[]]
        cost = 0
        for job in group:
            for i, sentence_cost in enumerate(job.costs):
                if calls[-1] and cost + sentence_cost > self.max_batch_tokens:
                    calls.append([])
                    cost = 0
                calls[-1].append((job, i))
                cost += sentence_cost
        return calls

    async def _decode_call(self, call: list[tuple[Job, int]]) -> None:
        # A job whose future is done has no one waiting: timed out, disconnected, or failed already.
        call = [(job, i) for job, i in call if not job.result.done()]
        if not call:
            return
        jobs = list({id(job): job for job, _ in call}.values())
        texts = [job.texts[i] for job, i in call]
        prefixes = [job.prefixes[i] if job.prefixes else "" for job, i in call] if any(j.prefixes for j in jobs) else None
        constraints = ([job.constraints[i] if job.constraints else [] for job, i in call]
                       if any(j.constraints for j in jobs) else None)
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self.executor, lambda: self.translator.translate_nbest(
                    texts, jobs[0].search, max_tokens=self.max_tokens, generator=jobs[0].generator, prefixes=prefixes,
                    constraints=constraints))
        except Exception as error:  # noqa: BLE001  # every waiting request must hear of it
            if len(jobs) == 1:
                if not jobs[0].result.done():
                    jobs[0].result.set_exception(error)
                return
            print(f"error: a decoder call for {len(jobs)} requests failed ({summary(error)}); "
                  "decoding them one at a time", file=sys.stderr, flush=True)
            for job in jobs:  # only the request that fails alone gets the error
                await self._decode_call([(j, i) for j, i in call if j is job])
            return
        self.stats.batches += 1
        self.stats.sentences += len(texts)
        for (job, i), translations in zip(call, results, strict=True):
            job.answer(i, translations)

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
        try:
            fields = urllib.parse.parse_qs(text, keep_blank_values=True, max_num_fields=MAX_FORM_FIELDS)
        except ValueError:
            raise BadRequest(too_many_fields()) from None
    elif content_type == "multipart/form-data":
        fields = await read_multipart(request)
    if fields is not None:
        return {key: values if len(values) > 1 else values[0] for key, values in fields.items()}
    raw = await request.body()
    if not raw:
        raise BadRequest("the request has no body; send JSON (or form fields) with q, source and target")
    example = '{"q": "text", "source": "de", "target": "en"}'
    try:
        body = json.loads(raw)
    except RecursionError:  # json's C parser counts its depth against the recursion limit: no crash
        raise BadRequest(f"the JSON body is nested too deeply; send a flat object such as {example}") from None
    except UnicodeDecodeError:
        raise BadRequest(f"the body is not UTF-8 text; send JSON such as {example}") from None
    except json.JSONDecodeError as error:
        raise BadRequest(f"the body is not valid JSON ({error}); send e.g. {example}") from None
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() (4300) digits
        raise BadRequest("the JSON body holds a number too long to read (over 4300 digits)") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the JSON body must be an object with q, source and target, not a {type(body).__name__}")
    return body


def too_many_fields() -> str:
    return f"the form has more than {MAX_FORM_FIELDS} fields; send fewer sentences per request"


async def read_multipart(request: Request) -> dict[str, list[str]]:
    """A multipart/form-data body's fields, each name and value UTF-8 (else a BadRequest).

    Parsed with python-multipart here rather than by Starlette's request.form(), which reads a field
    that is not UTF-8 as latin-1 (a url-encoded body is refused then), answers a missing boundary with
    an HTTPException of its own, and spools file parts to temporary files.
    """
    _, params = parse_options_header(request.headers.get("content-type"))
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadRequest("the multipart body has no boundary in its Content-Type; let the HTTP client build "
                         "the form, or send JSON")
    parts: list[tuple[bytes, bytearray]] = []
    header = [b"", b""]  # name, value of the part header being read
    disposition = [b""]

    def on_header_end() -> None:
        if header[0].strip().lower() == b"content-disposition":
            disposition[0] = header[1]
        header[:] = [b"", b""]

    def on_headers_finished() -> None:
        if len(parts) >= MAX_FORM_FIELDS:
            raise BadRequest(too_many_fields())
        name = parse_options_header(disposition[0])[1].get(b"name")
        if name is None:
            raise BadRequest("a multipart part has no name in its Content-Disposition; send q, source and target "
                             "as named form fields")
        parts.append((name, bytearray()))
        disposition[0] = b""

    def add(index: int) -> Callable[[bytes, int, int], None]:
        return lambda data, start, end: header.__setitem__(index, header[index] + data[start:end])

    parser = MultipartParser(boundary, {
        "on_header_field": add(0), "on_header_value": add(1), "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished,
        "on_part_data": lambda data, start, end: parts[-1][1].extend(data[start:end])})
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except FormParserError as error:
        raise BadRequest(f"the multipart body is malformed ({error}); let the HTTP client build the form, or "
                         "send JSON") from None
    fields: dict[str, list[str]] = {}
    for name, value in parts:
        try:
            fields.setdefault(name.decode("utf-8"), []).append(value.decode("utf-8"))
        except UnicodeDecodeError:
            raise BadRequest("the form body is not UTF-8; send UTF-8 text") from None
    return fields


def texts_of(body: dict[str, Any], *, char_limit: int, keep_layout: bool = False) -> tuple[list[str], bool]:
    """The `q` field as a list of strings, and whether it was a single string; with `keep_layout` as
    given (the caller splits them into sentences), else each made one line with single spaces."""
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
    if keep_layout:
        return list(texts), single
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
        raise BadRequest(f"{name} must be a whole number, got {shown(value)}")
    return number


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone: once the body is read, uvicorn's receive() waits for that."""
    with contextlib.suppress(Exception):  # a receive() that fails has no client behind it either
        while (await request.receive())["type"] != "http.disconnect":
            pass


def translation_json(translation: Translation) -> dict[str, Any]:
    """/v1's answer for one translation: its text and score, and what the request asked for besides:
    `alignment` ([[source word, translation word], ...]) and `token_scores`."""
    out: dict[str, Any] = {"text": translation.text, "score": translation.score}
    if translation.alignment is not None:
        out["alignment"] = [list(pair) for pair in translation.alignment]
    if translation.token_scores is not None:
        out["token_scores"] = translation.token_scores
    if translation.unmet_constraints:
        out["unmet_constraints"] = translation.unmet_constraints
    return out


@dataclass
class Server:
    """The endpoints over one Translator and its Batcher."""

    batcher: Batcher
    search: SearchConfig  # the defaults: the command line's search options
    char_limit: int = 5000
    timeout: float = 60.0
    max_request_tokens: int = 16384
    max_beam_size: int = 16

    @property
    def translator(self) -> Translator:
        return self.batcher.translator

    def check_cost(self, texts: list[str], search: SearchConfig, *, at_least: list[int] | None = None) -> list[int]:
        """Each sentence's decoding_cost; a BadRequest if the request's beam or total is over the limits."""
        try:
            search.check_vocabulary(self.translator.model.config.vocab_size)
        except ConfigError as error:
            raise BadRequest(f"{error.field}: {error.problem}") from None
        if not search.sampling and search.beam_size > self.max_beam_size:
            raise BadRequest(f"beam_size {search.beam_size} is more than this server's limit of {self.max_beam_size} "
                             "(--max-beam-size); ask for a smaller beam")
        rows = 1 if search.sampling else search.beam_size
        sentences = sum(1 for text in texts if text)
        # A floor from the count alone, checked before the tokenizer runs on the event loop: a flood of
        # thousands of one-word sentences is refused without being tokenised.
        if sentences * rows * MIN_STEPS_CHARGED > self.max_request_tokens:
            raise self.over_budget(sentences * rows * MIN_STEPS_CHARGED, sentences, rows,
                                   f"at least {MIN_STEPS_CHARGED}")
        costs = self.batcher.costs(texts, search, at_least=at_least)
        if sum(costs) > self.max_request_tokens:
            raise self.over_budget(sum(costs), sentences, rows, f"up to {max(costs) // rows}")
        return costs

    def over_budget(self, tokens: int, sentences: int, rows: int, steps: str) -> BadRequest:
        return BadRequest(
            f"this request may decode {tokens} tokens ({sentences} sentences x {rows} hypotheses x {steps} steps), "
            f"more than this server's limit of {self.max_request_tokens} per request (--max-request-tokens); send "
            "fewer or shorter sentences per request" + (", or ask for a smaller beam" if rows > 1 else ""))

    async def translate(self, request: Request, texts: list[str], search: SearchConfig, *,
                        prefixes: list[str] | None = None,
                        constraints: list[list[str]] | None = None) -> list[list[Translation]]:
        at_least = None
        if prefixes is not None or constraints is not None:  # the output limit grows to hold them
            tokenizer = self.translator.tokenizer
            prefix_tokens = [len(ids) for ids in tokenizer.encode_target(prefixes)] if prefixes else [0] * len(texts)
            phrase_tokens = ([sum(map(len, tokenizer.encode_target(phrases))) if phrases else 0 for phrases in constraints]
                             if constraints else [0] * len(texts))
            at_least = [a + b for a, b in zip(prefix_tokens, phrase_tokens, strict=True)]
        costs = self.check_cost(texts, search, at_least=at_least)
        future = self.batcher.submit(texts, search, costs=costs, prefixes=prefixes, constraints=constraints)
        gone = asyncio.ensure_future(until_disconnected(request))
        waiting: set[asyncio.Future[Any]] = {future, gone}
        try:
            await asyncio.wait(waiting, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if future.done():
            return future.result()
        future.cancel()  # the batcher skips a job whose future is done
        if gone.done() and not gone.cancelled():
            raise ClientDisconnect()
        raise TimeoutError(f"no translation within {self.timeout:g} s; the server is busy, retry later")

    def check_languages(self, body: dict[str, Any]) -> None:
        source, target = body.get("source"), body.get("target")
        src, tgt = self.translator.src_lang, self.translator.tgt_lang
        if source not in (src, "auto") or target != tgt:
            raise BadRequest(f"this server translates {src} to {tgt} only (source {shown(source)}, target "
                             f"{shown(target)}); GET /languages lists it")
        if body.get("format", "text") != "text":
            raise BadRequest(f"format {shown(body.get('format'))} is not supported; send plain text with format text")

    async def libretranslate(self, request: Request) -> JSONResponse:
        body = await read_body(request)
        texts, single = texts_of(body, char_limit=self.char_limit, keep_layout=True)
        self.check_languages(body)
        alternatives = int_field(body, "alternatives", 0)
        if not 0 <= alternatives <= 9:
            raise BadRequest(f"alternatives must be between 0 and 9, got {alternatives}")
        if alternatives >= self.max_beam_size:
            raise BadRequest(f"alternatives {alternatives} needs a beam of {alternatives + 1}, more than this "
                             f"server's limit of {self.max_beam_size} (--max-beam-size)")
        search = self.search
        if alternatives:  # n-best: the beam must hold them
            nbest = alternatives + 1
            search = dataclasses.replace(search, nbest=nbest, beam_size=max(search.beam_size, nbest), sampling=False)
        # A text may be a paragraph: its sentences are translated (all of the request's in one batch) and
        # put back with the text's own spaces and newlines; alternative i takes each sentence's i-th.
        spans, sentences = split_paragraphs(texts, tokenizer=self.translator.tokenizer, language=self.translator.src_lang,
                                            max_positions=self.translator.model.config.max_positions)
        nbest_lists = await self.translate(request, sentences, search)
        best = rejoin_all(texts, spans, [hyps[0].text if hyps else "" for hyps in nbest_lists])
        # Alternative i of a text: its sentences' i-th (their best where they have fewer), or "" where none has one
        bounds = list(itertools.accumulate((len(text_spans) for text_spans in spans), initial=0))
        most = [max((len(hyps) for hyps in nbest_lists[a:b]), default=0) for a, b in itertools.pairwise(bounds)]
        alternative = [rejoin_all(texts, spans, [(hyps[i] if i < len(hyps) else hyps[0]).text if hyps else ""
                                                 for hyps in nbest_lists]) for i in range(1, alternatives + 1)]
        others = [[alternative[i - 1][t] if i < most[t] else "" for i in range(1, alternatives + 1)]
                  for t in range(len(texts))]
        response: dict[str, Any] = {"translatedText": best[0] if single else best}
        if alternatives:
            response["alternatives"] = others[0] if single else others
        if body.get("source") == "auto":
            detected = {"confidence": 100.0, "language": self.translator.src_lang}
            response["detectedLanguage"] = detected if single else [detected] * len(texts)
        return JSONResponse(response)

    async def v1_translate(self, request: Request) -> JSONResponse:
        body = await read_body(request)
        texts, single = texts_of(body, char_limit=self.char_limit)
        prefixes = self.target_prefixes(body, texts, single=single)
        constraints = self.constraints(body, texts, single=single, prefixes=prefixes)
        options = {k: v for k, v in body.items() if k not in ("q", "target_prefix", "constraints", "glossary")}
        names = {f.name for f in dataclasses.fields(SearchConfig)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise BadRequest(f"unknown option {shown(unknown[0])}; the options are {', '.join(sorted(names))}")
        try:
            search = dataclasses.replace(self.search, **options)
        except ConfigError as error:
            raise BadRequest(f"{error.field}: {error.problem}"[:300]) from None  # the problem shows the value
        if constraints is not None and search.sampling:
            raise BadRequest("constraints and glossary need a search (beam_size >= 1), not sampling")
        nbest_lists = await self.translate(request, texts, search, prefixes=prefixes, constraints=constraints)
        return JSONResponse({"translations": [[translation_json(h) for h in hyps] for hyps in nbest_lists]})

    def constraints(self, body: dict[str, Any], texts: list[str], *, single: bool,
                    prefixes: list[str] | None) -> list[list[str]] | None:
        """/v1's `constraints` (a list of phrases for a single q, a list of such lists as long as q's) and
        `glossary` (an object, source term -> target term, for every text), as phrases per text; checked
        as the translator will check them."""
        if "constraints" not in body and "glossary" not in body:
            return None
        per_text: list[list[str]] = [[] for _ in texts]
        if "constraints" in body:
            given = body["constraints"]
            lists = [given] if single and isinstance(given, list) and all(isinstance(p, str) for p in given) else given
            if (not isinstance(lists, list) or len(lists) != len(texts)
                    or not all(isinstance(x, list) and all(isinstance(p, str) for p in x) for x in lists)):
                raise BadRequest(f"constraints must be {'a list of phrases' if single else f'a list of {len(texts)} lists of phrases'}"
                                 ", as q is: the target phrases each translation must contain")
            per_text = [list(x) for x in lists]
        glossary = body.get("glossary")
        if glossary is not None:
            if not isinstance(glossary, dict):
                raise BadRequest("glossary must be an object of source term -> target term")
            try:
                glossary = check_glossary(glossary)
            except (TypeError, ValueError) as error:
                raise BadRequest(str(error)) from None
            per_text = [[*phrases, *glossary_terms(text, glossary)] for phrases, text in zip(per_text, texts, strict=True)]
        if sum(len(p) for phrases in per_text for p in phrases) > self.char_limit:
            raise BadRequest(f"the constraints have more than this server's limit of {self.char_limit} characters")
        try:
            forced = self.translator.tokenizer.encode_target(prefixes) if prefixes is not None else None
            self.translator.constraint_ids(per_text, len(texts), forced=forced, first_line=1)
        except ValueError as error:  # it names the text by its line number: here, its place in q (from 1)
            raise BadRequest(str(error).replace("line ", "q item ", 1)) from None
        return per_text

    def target_prefixes(self, body: dict[str, Any], texts: list[str], *, single: bool) -> list[str] | None:
        """/v1's `target_prefix`: a string for a single q, a list as long as q's for a list ("" for none);
        each within the model's length."""
        if "target_prefix" not in body:
            return None
        given = body["target_prefix"]
        prefixes = [given] if single and isinstance(given, str) else given
        if not isinstance(prefixes, list) or len(prefixes) != len(texts) or not all(isinstance(p, str) for p in prefixes):
            raise BadRequest(f"target_prefix must be {'a string' if single else f'a list of {len(texts)} strings'}, "
                             "as q is: the start each translation must have (\"\" for none)")
        if sum(len(p) for p in prefixes) > self.char_limit:
            raise BadRequest(f"target_prefix has more than this server's limit of {self.char_limit} characters")
        limit = self.translator.model.config.max_positions - 1
        for i, ids in enumerate(self.translator.tokenizer.encode_target([p.strip() for p in prefixes])):
            if len(ids) > limit:
                raise BadRequest(f"target_prefix[{i}] has {len(ids)} tokens, more than the model writes ({limit})")
        return [" ".join(p.split()) for p in prefixes]

    async def languages(self, request: Request) -> JSONResponse:
        src, tgt = self.translator.src_lang, self.translator.tgt_lang
        return JSONResponse([{"code": src, "name": LANGUAGE_NAMES.get(src, src), "targets": [tgt]},
                             {"code": tgt, "name": LANGUAGE_NAMES.get(tgt, tgt), "targets": []}])

    async def health(self, request: Request) -> JSONResponse:
        stats = self.batcher.stats
        return JSONResponse({"status": "ok", "batches": stats.batches, "requests": stats.requests,
                             "sentences": stats.sentences, "queued": self.batcher.queue.qsize(),
                             "precision": self.translator.precision})


def answer_errors(endpoint: Callable[[Request], Awaitable[JSONResponse]]) -> Callable[[Request], Awaitable[JSONResponse]]:
    """Each failure as {"error": ...} with its status; an unexpected one is a 500 (503: out of memory)
    that says nothing of our internals, and one line on stderr that does."""

    async def handle(request: Request) -> JSONResponse:
        try:
            return await endpoint(request)
        except BadRequest as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        except BodyTooLarge as error:  # the rest of the body is not read: the connection cannot be reused
            return JSONResponse({"error": str(error)}, status_code=413, headers={"connection": "close"})
        except Busy as error:
            return JSONResponse({"error": str(error)}, status_code=429)
        except TimeoutError as error:
            return JSONResponse({"error": str(error)}, status_code=503)
        except ClientDisconnect:  # no one to answer: uvicorn drops what is sent
            return JSONResponse({"error": "the client disconnected"}, status_code=400)
        except Exception as error:  # noqa: BLE001  # a bug of ours, or no memory left: the client still gets JSON
            print(f"error: {request.method} {request.url.path}: {summary(error)}", file=sys.stderr, flush=True)
            if out_of_memory(error):
                return JSONResponse({"error": "the server ran out of memory for this request; retry later, or send "
                                              "fewer or shorter sentences"}, status_code=503)
            return JSONResponse({"error": "internal error; the server's log has the details"}, status_code=500)

    return handle


# ---------------------------------------------------------------------------------------------
# Connections: the body size, the time to send a request, how many are open, and what asyncio
# logs when the process runs out of file descriptors.


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


def create_app(translator: Translator, search: SearchConfig | None = None, *, max_tokens: int = 8192,
               max_wait: float = 0.005, batching: bool = True, max_queue: int = 1024, char_limit: int = 5000,
               timeout: float = 60.0, max_request_tokens: int = 16384, max_batch_tokens: int = 8192,
               max_beam_size: int = 16, max_body_size: int = 1 << 20) -> Starlette:
    """The ASGI app; its batcher starts and drains with the app's lifespan. `search`: the requests'
    defaults (the translator's own, tuned on validation where its checkpoint stores them, if None).
    The limits are the flags of the same names (the module's docstring)."""
    search = translator.search if search is None else search
    if not search.sampling and search.beam_size > max_beam_size:
        raise ValueError(f"the default beam size {search.beam_size} is over --max-beam-size {max_beam_size}; "
                         "raise --max-beam-size or lower --beam-size")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(AcceptErrors(loop.get_exception_handler()))
        batcher = Batcher(translator, max_tokens=max_tokens, max_batch_tokens=max_batch_tokens, max_wait=max_wait,
                          batching=batching, max_queue=max_queue)
        server = Server(batcher, search, char_limit=char_limit, timeout=timeout,
                        max_request_tokens=max_request_tokens, max_beam_size=max_beam_size)
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
            response: JSONResponse = await getattr(request.app.state.server, name)(request)
            return response

        return Route(path, answer_errors(endpoint), methods=methods)

    routes = [route("/translate", "libretranslate", ["POST"]), route("/v1/translate", "v1_translate", ["POST"]),
              route("/languages", "languages", ["GET"]), route("/health", "health", ["GET"])]
    return Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(BodyLimit, max_bytes=max_body_size)])


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
    parser.add_argument("--max-request-tokens", type=int, default=16384,
                        help="decoder tokens per request at most (beam x output limit per sentence, at least 16 "
                             "each, summed); then 400 (default: 16384)")
    parser.add_argument("--max-batch-tokens", type=int, default=8192,
                        help="decoder tokens per decoder call at most: bounds its memory (default: 8192)")
    parser.add_argument("--max-beam-size", type=int, default=16, help="beam size of a request at most; then 400")
    parser.add_argument("--max-body-size", type=int, default=1 << 20,
                        help="bytes of a request body at most; then 413 (default: 1048576)")
    parser.add_argument("--read-timeout", type=float, default=10.0,
                        help="seconds a client has to send a whole request; then 408 and closed (default: 10)")
    parser.add_argument("--max-connections", type=int, default=512,
                        help="open connections at most; idle ones are closed first, then 503 (default: 512)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    add_search_arguments(parser)
    args = parser.parse_args(argv)
    search = check_flags(parser, args)
    for name in ("max_queue", "char_limit", "max_request_tokens", "max_batch_tokens", "max_beam_size",
                 "max_body_size", "max_connections"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if args.max_wait_ms < 0 or args.timeout <= 0 or args.read_timeout <= 0:
        parser.error("--max-wait-ms must be >= 0, --timeout and --read-timeout > 0")
    if args.beam_size is not None and not search.sampling and search.beam_size > args.max_beam_size:  # before loading
        parser.error(f"--beam {search.beam_size} is over --max-beam-size {args.max_beam_size}; raise --max-beam-size")
    files = open_file_limit()
    if files - FD_RESERVE < 1:
        parser.error(f"this process may open {files} files (ulimit -n), too few to serve; raise ulimit -n")
    if args.max_connections > files - FD_RESERVE:
        print(f"warning: --max-connections {args.max_connections} lowered to {files - FD_RESERVE}: this process may "
              f"open {files} files (ulimit -n); raise it to allow more", file=sys.stderr)
        args.max_connections = files - FD_RESERVE
    one_line_warnings()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        translator, search = open_translator(parser, args)
    except KeyboardInterrupt:  # Ctrl-C while the model loads: one line, as after it starts
        print("\ninterrupted while loading the model; the server was not started", file=sys.stderr)
        raise SystemExit(130) from None
    try:
        app = create_app(translator, search, max_tokens=args.max_tokens, max_wait=args.max_wait_ms / 1000,
                         batching=not args.no_batching, max_queue=args.max_queue, char_limit=args.char_limit,
                         timeout=args.timeout, max_request_tokens=args.max_request_tokens,
                         max_batch_tokens=args.max_batch_tokens, max_beam_size=args.max_beam_size,
                         max_body_size=args.max_body_size)
    except ValueError as error:  # the checkpoint's tuned beam over --max-beam-size
        parser.error(str(error))
    print(f"{translator.src_lang}→{translator.tgt_lang} on http://{args.host}:{args.port} ({translator.precision}, "
          f"{torch.get_num_threads()} threads, {describe(search)})", file=sys.stderr, flush=True)

    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then raises the signal again for the handler
    # that was there before it: these record it, so the process ends with a line and a plain exit
    # status (0 for SIGTERM, 130 for Ctrl-C) instead of dying by the signal or a KeyboardInterrupt.
    received: list[int] = []
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda number, frame: received.append(number))
    started = time.perf_counter()
    server = uvicorn.Server(uvicorn_config(app, max_connections=args.max_connections, read_timeout=args.read_timeout,
                                           host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=args.timeout))
    server.run()
    if not server.started:  # uvicorn has said why (the port is taken, ...), as uvicorn.run exits
        sys.exit(3)
    name = signal.Signals(received[0]).name if received else "the server"
    print(f"stopped by {name} after {time.perf_counter() - started:.0f}s", file=sys.stderr)
    sys.exit(130 if signal.SIGINT in received else 0)


if __name__ == "__main__":
    tune_process_memory()  # a process of its own: large blocks reused, oneDNN's kernel cache bounded
    main()
