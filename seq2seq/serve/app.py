"""The ASGI app behind the server (seq2seq/serve/server.py is its command, with the endpoints and limits): one
Server of the models it routes to by language pair, the LibreTranslate endpoints and /v1, each request's cost
checked before it is queued, its sentences decoded by its model's batchers, the answer rendered off the event
loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from seq2seq.cli import compiled_line
from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.documents import EMPTY, Document, Translation, per_document, search_for
from seq2seq.inference.inputs import MIN_STEPS_CHARGED
from seq2seq.inference.pool import start_decoder_thread
from seq2seq.inference.translator import Translator
from seq2seq.model import ConfigError
from seq2seq.serve.access import Gate
from seq2seq.serve.answers import answer_errors, translation_json
from seq2seq.serve.batcher import Batcher
from seq2seq.serve.bodies import BadRequest, TooCostly, Upload, api_key, int_field, read_body, shown, texts_of
from seq2seq.serve.documents import (
    FORMATS,
    FileStore,
    content_disposition,
    document,
    file_format,
    visible_text,
)
from seq2seq.serve.guards import (
    AcceptErrors,
    BodyLimit,
)
from seq2seq.serve.languages import NAMES, Detector
from seq2seq.serve.metrics import Measured, Metrics
from seq2seq.serve.web import page_routes
from seq2seq.text.glossary import Glossary

T = TypeVar("T")


DOCUMENTS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="documents")


def render_each(doc: Document, renderings: list[list[Translation]]) -> list[str]:
    return [doc.render(r) for r in renderings]


async def off_loop(work: Callable[[], T]) -> T:
    """`work` in the documents thread, so that the event loop keeps serving meanwhile (parsing and
    rendering a document take time in proportion to it; decoding has threads of its own). One thread,
    not asyncio's default pool of up to cores + 4: the work holds the GIL anyway, and every thread
    that allocates grows a malloc arena of its own that is kept (keep_freed_memory)."""
    return await asyncio.get_running_loop().run_in_executor(DOCUMENTS, work)


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone: once the body is read, uvicorn's receive() waits for that."""
    with contextlib.suppress(Exception):  # a receive() that fails has no client behind it either
        while (await request.receive())["type"] != "http.disconnect":
            pass


@dataclass
class Model:
    """One direction the server translates: the Translator into its target (a multilingual checkpoint's
    `for_target`, sharing the model), the Batcher of its checkpoint (shared by a multilingual model's directions:
    each source carries its target's tag, so one batch may mix them) and its requests' default search (the
    command line's options over the checkpoint's tuned ones)."""

    batcher: Batcher
    search: SearchConfig
    translator: Translator

    @property
    def pair(self) -> tuple[str, str]:
        return self.translator.src_lang, self.translator.tgt_lang


@dataclass
class Server:
    """The endpoints over the models (one per language pair: `routes`) and their batchers."""

    models: dict[tuple[str, str], Model]
    detector: Detector
    char_limit: int = 5000
    timeout: float = 60.0
    max_request_tokens: int = 16384
    max_beam_size: int = 16
    max_glossary_chars: int = 100_000
    files: FileStore = field(default_factory=FileStore)
    gate: Gate | None = None  # API keys and limits (seq2seq/serve/access.py); None: neither

    # -- languages -------------------------------------------------------------------------------

    def pairs(self) -> str:
        return ", ".join(f"{source} to {target}" for source, target in sorted(self.models))

    def route(self, body: dict[str, Any], texts: list[str], *,
              format: str = "text") -> tuple[list[Model], list[dict[str, Any]] | None]:
        """The model for each text (by `source` and `target`; `source: auto` detects each text's language
        among those the server translates into `target` from), and the detections (None unless auto)."""
        source, target = body.get("source"), body.get("target")
        if not isinstance(target, str) or not any(t == target for _, t in self.models):
            raise BadRequest(f"target {shown(target)} is not one this server translates into; it translates "
                             f"{self.pairs()} (GET /languages)")
        if source == "auto":
            among = sorted(s for s, t in self.models if t == target)
            found = [self.detector.detect(visible_text(text, format=format), among=among) for text in texts]
            return ([self.models[(code, target)] for code, _ in found],
                    [{"confidence": confidence, "language": code} for code, confidence in found])
        model = self.models.get((source, target)) if isinstance(source, str) else None
        if model is None:
            raise BadRequest(f"this server does not translate {shown(source)} to {shown(target)}; it translates "
                             f"{self.pairs()}, or give source auto (GET /languages)")
        return [model] * len(texts), None

    def only_model(self, body: dict[str, Any]) -> Model:
        """/v1's model: by `source` and `target`, which may be left out when the server has one model."""
        if "source" not in body and "target" not in body and len(self.models) == 1:
            return next(iter(self.models.values()))
        model = self.models.get((body.get("source"), body.get("target")))  # type: ignore[arg-type]
        if model is None:
            raise BadRequest(f"give source and target, one of the pairs this server translates: {self.pairs()} "
                             f"(got {shown(body.get('source'))} to {shown(body.get('target'))})")
        return model

    # -- who may ask, costs and waiting ----------------------------------------------------------

    async def admit(self, request: Request, body: dict[str, Any], *, characters: int) -> None:
        """The request's key checked and one request of `characters` charged to it or to the client's address
        (Gate.admit, in the gate's thread), before any work on it; Refused (401, 403, 429) otherwise."""
        if self.gate is None or not self.gate.active:
            return
        key, address = api_key(request, body), request.client.host if request.client is not None else ""
        await asyncio.get_running_loop().run_in_executor(
            self.gate.thread, functools.partial(self.gate.admit, key=key, address=address, characters=characters))

    def check_search(self, model: Model, texts: list[str], search: SearchConfig) -> None:
        """A BadRequest for a search this model or server does not take, or for more sentences than the request
        budget holds at MIN_STEPS_CHARGED each: the count alone, before the tokenizer runs on the event loop, so
        that a flood of thousands of one-word sentences is refused without being tokenised."""
        try:
            config = model.translator.model.config
            search.check_model(vocab_size=config.vocab_size, max_positions=config.max_positions)
        except ConfigError as error:
            raise BadRequest(f"{error.field}: {error.problem}") from None
        if not search.sampling and search.beam_size > self.max_beam_size:
            raise TooCostly(f"beam_size {search.beam_size} is more than this server's limit of {self.max_beam_size} "
                             "(--max-beam-size); ask for a smaller beam")
        floor = sum(1 for text in texts if text) * search.hypotheses * MIN_STEPS_CHARGED
        if floor > self.max_request_tokens:
            raise self.over_budget(floor, texts, search, f"at least {MIN_STEPS_CHARGED}")

    def over_budget(self, tokens: int, texts: list[str], search: SearchConfig, steps: str) -> BadRequest:
        sentences, rows = sum(1 for text in texts if text), search.hypotheses
        return TooCostly(
            f"this request may decode {tokens} tokens ({sentences} sentences x {rows} hypotheses x {steps} steps), "
            f"more than this server's limit of {self.max_request_tokens} per request (--max-request-tokens); send "
            "fewer or shorter sentences per request" + (", or ask for a smaller beam" if rows > 1 else ""))

    def submit(self, model: Model, texts: list[str], search: SearchConfig, *, prefixes: list[str] | None = None,
               constraints: list[list[str]] | None = None) -> asyncio.Future[list[list[Translation]]]:
        """The texts prepared once (Translator.prepare_inputs: tokenised, prefixes and constraints checked), charged
        (each text's decoding cost, its output limit raised to hold its prefix and phrases) and queued."""
        self.check_search(model, texts, search)
        try:
            inputs = model.translator.prepare_inputs(texts, search, prefixes=prefixes, constraints=constraints)
        except (TypeError, ValueError) as error:  # it names a text by its line number: here, its place in q (from 1)
            raise BadRequest(str(error).replace("line ", "q item ", 1)) from None
        costs = inputs.costs(search, max_positions=model.translator.model.config.max_positions)
        if sum(costs) > self.max_request_tokens:
            raise self.over_budget(sum(costs), texts, search, f"up to {max(costs) // search.hypotheses}")
        return model.batcher.submit(inputs, search, costs=costs)

    async def wait(self, request: Request, futures: list[asyncio.Future[list[list[Translation]]]]) -> list[list[list[Translation]]]:
        """The futures' results, once all are done; a ClientDisconnect if the client goes first, a
        TimeoutError after --timeout (the batcher then skips what is still queued)."""
        everything = asyncio.gather(*futures)
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            waited: set[asyncio.Future[Any]] = {everything, gone}
            await asyncio.wait(waited, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if everything.done():
            return everything.result()
        for future in futures:
            future.cancel()  # the batcher skips a job whose future is done
        everything.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await everything
        if gone.done() and not gone.cancelled():
            raise ClientDisconnect()
        raise TimeoutError(f"no translation within {self.timeout:g} s; the server is busy, retry later")

    async def translate_documents(self, request: Request, routed: list[tuple[Model, list[Document]]], *,
                                  alternatives: int = 0) -> list[list[list[Translation]]]:
        """Per group of documents (those of one model), each sentence's n-best list: every group queued
        at once, each with its model's batcher, then waited for together."""
        futures = []
        for model, documents in routed:
            search = model.search
            if alternatives:  # n-best: the beam must hold them
                nbest = alternatives + 1
                search = dataclasses.replace(search, nbest=nbest, beam_size=max(search.beam_size, nbest), sampling=False)
            futures.append(self.submit(model, [s for d in documents for s in d.sentences], search_for(documents, search)))
        return await self.wait(request, futures)

    # -- endpoints -------------------------------------------------------------------------------

    async def libretranslate(self, request: Request) -> JSONResponse:
        body = await read_body(request)
        texts, single = texts_of(body, char_limit=self.char_limit, keep_layout=True)
        await self.admit(request, body, characters=sum(map(len, texts)))
        format = body.get("format", "text")
        if format not in ("text", "html"):
            raise BadRequest(f"format {shown(format)} is not one this server reads; send text or html")
        alternatives = int_field(body, "alternatives", 0)
        if not 0 <= alternatives <= 9:
            raise BadRequest(f"alternatives must be between 0 and 9, got {alternatives}")
        if alternatives >= self.max_beam_size:
            raise BadRequest(f"alternatives {alternatives} needs a beam of {alternatives + 1}, more than this "
                             f"server's limit of {self.max_beam_size} (--max-beam-size)")
        models, detected = self.route(body, texts, format=format)
        # Each text may be a paragraph or a page: its sentences are translated (all of a model's in one
        # batch) and put back with the text's own spacing and markup; alternative i takes each sentence's
        # i-th (its best where it has fewer), "" where no sentence of the text has an i-th.
        groups: dict[tuple[str, str], list[int]] = {}
        for i, model in enumerate(models):
            groups.setdefault(model.pair, []).append(i)
        def documents_of(pair: tuple[str, str], indices: list[int]) -> list[Document]:
            return [document(texts[i], format=format, translator=self.models[pair].translator) for i in indices]

        routed = [(self.models[pair], await off_loop(functools.partial(documents_of, pair, indices)))
                  for pair, indices in groups.items()]
        results = await self.translate_documents(request, routed, alternatives=alternatives)
        best: list[str] = [""] * len(texts)
        others: list[list[str]] = [[] for _ in texts]
        for indices, (_, documents), nbest_lists in zip(groups.values(), routed, results, strict=True):
            for i, doc, own in zip(indices, documents, per_document(documents, nbest_lists), strict=True):
                most = max((len(hyps) for hyps in own), default=0)
                # Alternative k of a text: each sentence's k-th (its best where it has fewer); rendering
                # fills a document in, so each rendering after the first starts from a fresh one.
                renderings = [[(hyps[k] if k < len(hyps) else hyps[0]) if hyps else EMPTY for hyps in own]
                              for k in range(min(most, alternatives + 1) or 1)]
                rendered = await off_loop(functools.partial(render_each, doc, renderings))
                best[i] = rendered[0]
                others[i] = [rendered[k] if k < len(rendered) else "" for k in range(1, alternatives + 1)]
        response: dict[str, Any] = {"translatedText": best[0] if single else best}
        if alternatives:
            response["alternatives"] = others[0] if single else others
        if detected is not None:
            response["detectedLanguage"] = detected[0] if single else detected
        return JSONResponse(response)

    async def translate_file(self, request: Request) -> JSONResponse:
        body = await read_body(request)
        upload = body.get("file")
        if isinstance(upload, list):
            raise BadRequest("the form has several files; send one file per request")
        if not isinstance(upload, Upload):
            raise BadRequest("missing file: send the file to translate as the form field file (multipart/form-data), "
                             f"a {', '.join(FORMATS)} file")
        format = file_format(upload.filename)
        await self.admit(request, body, characters=len(upload.text))
        client = request.client.host if request.client is not None else ""
        self.files.check_room(len(upload.text.encode("utf-8")), client=client)  # its keeping is charged first
        # The text a reader sees is counted before the file is split into sentences (splitting takes
        # time that grows faster than the text), and both happen off the event loop.
        characters = len(await off_loop(lambda: visible_text(upload.text, format=format, name=upload.filename)))
        if characters > self.char_limit:
            raise TooCostly(f"{shown(upload.filename)} has {characters} characters of text, more than this server's "
                             f"limit of {self.char_limit}; split the file")
        (model,), _ = self.route(body, [upload.text], format=format)
        doc = await off_loop(lambda: document(upload.text, format=format, translator=model.translator,
                                              name=upload.filename))
        (nbest_lists,) = await self.translate_documents(request, [(model, [doc])])
        translated = await off_loop(lambda: doc.render([hyps[0] if hyps else EMPTY for hyps in nbest_lists]))
        name = self.files.put(upload.filename, translated, format=format, client=client)
        return JSONResponse({"translatedFileUrl": f"{str(request.base_url).rstrip('/')}/download_file/{name}"})

    async def download_file(self, request: Request) -> Response:
        stored = self.files.get(request.path_params["name"])
        if stored is None:
            return JSONResponse({"error": self.files.gone(request.path_params["name"])}, status_code=404)
        return Response(stored.content, media_type=stored.media_type,
                        headers={"content-disposition": content_disposition(stored.filename)})

    async def detect(self, request: Request) -> JSONResponse:
        body = await read_body(request)
        texts, _ = texts_of(body, char_limit=self.char_limit)
        await self.admit(request, body, characters=sum(map(len, texts)))
        among = sorted({source for source, _ in self.models})
        return JSONResponse([{"confidence": confidence, "language": code}
                             for code, confidence in self.detector.rank(" ".join(texts), among=among)])

    async def v1_translate(self, request: Request) -> JSONResponse:
        body = await read_body(request)
        self.check_glossary_size(body)
        texts, single = texts_of(body, char_limit=self.char_limit)
        await self.admit(request, body, characters=sum(map(len, texts)))
        model = self.only_model(body)
        prefixes = self.target_prefixes(body, texts, single=single)
        constraints = await self.constraints(body, texts, single=single)
        options = {k: v for k, v in body.items()
                   if k not in ("q", "target_prefix", "constraints", "glossary", "source", "target", "api_key")}
        names = {f.name for f in dataclasses.fields(SearchConfig)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise BadRequest(f"unknown option {shown(unknown[0])}; the options are {', '.join(sorted(names))}")
        try:
            search = dataclasses.replace(model.search, **options)
        except ConfigError as error:
            raise BadRequest(f"{error.field}: {error.problem}"[:300]) from None  # the problem shows the value
        (nbest_lists,) = await self.wait(request, [self.submit(model, texts, search, prefixes=prefixes,
                                                                constraints=constraints)])
        return JSONResponse({"translations": [[translation_json(h) for h in hyps] for hyps in nbest_lists]})

    def check_glossary_size(self, body: dict[str, Any]) -> None:
        """/v1's `glossary` counted as soon as the body is read, before any work on it: its source and target
        terms' characters within --max-glossary-chars (compiling and matching it grow with them)."""
        glossary = body.get("glossary")
        if isinstance(glossary, dict):  # anything else is refused by `constraints`
            characters = sum(len(term) for pair in glossary.items() for term in pair if isinstance(term, str))
            if characters > self.max_glossary_chars:
                raise TooCostly(f"the glossary has {characters} characters of terms, more than this server's limit "
                                 f"of {self.max_glossary_chars} per request (--max-glossary-chars); send a smaller one")

    async def constraints(self, body: dict[str, Any], texts: list[str], *, single: bool) -> list[list[str]] | None:
        """/v1's `constraints` (a list of phrases for a single q, a list of such lists as long as q's) and
        `glossary` (an object, source term -> target term, for every text), as phrases per text; checked
        as the translator will check them. The glossary is compiled and matched off the event loop (they
        take time with its size, which check_glossary_size has bounded)."""
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
                built = await off_loop(lambda: Glossary(glossary))
            except (TypeError, ValueError) as error:
                raise BadRequest(str(error)) from None
            found = await off_loop(lambda: [built.terms_in(text) for text in texts])
            per_text = [[*phrases, *terms] for phrases, terms in zip(per_text, found, strict=True)]
        if sum(len(p) for phrases in per_text for p in phrases) > self.char_limit:
            raise BadRequest(f"the constraints have more than this server's limit of {self.char_limit} characters")
        return per_text  # (their tokens are checked as the texts are prepared: submit)

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
        return [" ".join(p.split()) for p in prefixes]  # (their tokens are checked as the texts are prepared: submit)

    async def settings(self, request: Request) -> JSONResponse:
        """What the web page needs to know of this server (LibreTranslate's /frontend/settings, its field names)."""
        return JSONResponse({"keyRequired": self.gate is not None and self.gate.keys_required,
                             "apiKeys": self.gate is not None and self.gate.keys_required,
                             "charLimit": self.char_limit, "filesTranslation": True,
                             "supportedFilesFormat": list(FORMATS),
                             "maxAlternatives": min(9, self.max_beam_size - 1),
                             "beamSize": max([1, *(m.search.beam_size for m in self.models.values()
                                                   if not m.search.sampling)])})

    async def languages(self, request: Request) -> JSONResponse:
        sources = sorted({source for source, _ in self.models})
        codes = sources + sorted({target for _, target in self.models} - set(sources))  # sources first
        return JSONResponse([{"code": code, "name": NAMES.get(code, code),
                              "targets": sorted(target for source, target in self.models if source == code)}
                             for code in codes])

    async def health(self, request: Request) -> JSONResponse:
        served: dict[int, list[tuple[str, str]]] = {}  # per batcher (checkpoint), the directions it serves
        batchers: dict[int, Batcher] = {}
        for pair, m in sorted(self.models.items()):
            served.setdefault(id(m.batcher), []).append(pair)
            batchers[id(m.batcher)] = m.batcher
        models: list[dict[str, Any]] = []
        for key, pairs in served.items():
            batcher = batchers[key]
            one = {"source": pairs[0][0], "target": pairs[0][1]} if len(pairs) == 1 else {}
            models.append({**one, "directions": [list(pair) for pair in pairs], "batches": batcher.stats.batches,
                           "requests": batcher.stats.requests, "sentences": batcher.stats.sentences,
                           "queued": batcher.queue.qsize(), "precision": batcher.translator.precision})
        totals = {key: sum(m[key] for m in models) for key in ("batches", "requests", "sentences", "queued")}
        return JSONResponse({"status": "ok", **totals, "precision": models[0]["precision"], "models": models})


def routes(translators: Sequence[Translator]) -> dict[tuple[str, str], int]:
    """Each language pair the translators serve, and the one that serves it: the most specific, a bilingual
    model before a multilingual one and a model of fewer directions before one of more (then the first given).
    ValueError (one line) for two bilingual models of one pair, or a model left with no pair to serve."""
    chosen: dict[tuple[str, str], int] = {}
    for i, translator in enumerate(translators):
        for pair in translator.directions or ((translator.src_lang, translator.tgt_lang),):
            other = chosen.get(pair)
            if other is not None and not translator.directions and not translators[other].directions:
                raise ValueError(f"two models translate {pair[0]} to {pair[1]} (the {other + 1}. and {i + 1}. "
                                 "--checkpoint); give one per language pair")
            if other is None or len(translator.directions) < len(translators[other].directions):  # (bilingual: 0)
                chosen[pair] = i
    for i in range(len(translators)):
        if i not in chosen.values():
            raise ValueError(f"the {i + 1}. --checkpoint would serve nothing: each of its directions has a more "
                             "specific model before it; leave it out")
    return chosen


def create_app(translators: Translator | Sequence[Translator],
               search: SearchConfig | Sequence[SearchConfig] | None = None, *, max_tokens: int = 8192,
               max_wait: float = 0.005, batching: bool = True, max_queue: int = 1024, char_limit: int = 5000,
               timeout: float = 60.0, max_request_tokens: int = 16384, max_batch_tokens: int = 8192,
               max_beam_size: int = 16, max_body_size: int = 1 << 20, max_glossary_chars: int = 100_000,
               max_stored_bytes: int = 64 << 20, workers: int = 1, threads: int | None = None,
               gate: Gate | None = None, metrics: Metrics | None = None, web_ui: bool = True) -> Starlette:
    """The ASGI app over Translators, a bilingual one serving its language pair and a multilingual one each of
    its directions (`routes`: the most specific model for each pair); their batchers, one per translator, start
    and drain with the app's lifespan. `search`: the requests' defaults, one for all or one per translator (each
    translator's own, tuned on validation where its checkpoint stores them, if None). `workers` decoder
    calls run at once (each model's batcher gathers that many batches), each on a thread with `threads`
    intra-op threads (None: torch's count). The limits are the server's flags of the same names
    (docs/serving.md#limits). `gate`: API keys and limits; `metrics`: /metrics and the request counts; `web_ui`:
    the translation page at / (seq2seq/serve/web/)."""
    translators = list(translators) if isinstance(translators, (list, tuple)) else [translators]  # type: ignore[list-item]
    searches = ([t.search for t in translators] if search is None else
                [search] * len(translators) if isinstance(search, SearchConfig) else list(search))
    if not translators or len(searches) != len(translators):
        raise ValueError(f"{len(translators)} translators but {len(searches)} search configurations")
    chosen = routes(translators)
    for defaults in searches:
        if not defaults.sampling and defaults.beam_size > max_beam_size:
            raise ValueError(f"the default beam size {defaults.beam_size} is over --max-beam-size {max_beam_size}; "
                             "raise --max-beam-size or lower --beam-size")
    detector = Detector({source for source, _ in chosen})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(AcceptErrors(loop.get_exception_handler()))
        # The decoder threads serve every model: W threads of T intra-op threads each use the cores W x T
        # the flags give, however many models there are.
        executor = (ThreadPoolExecutor(max_workers=workers, thread_name_prefix="decoder",
                                       initializer=start_decoder_thread, initargs=(threads,)) if threads
                    else ThreadPoolExecutor(max_workers=workers, thread_name_prefix="decoder"))
        batchers = [Batcher(t, max_tokens=max_tokens, max_batch_tokens=max_batch_tokens, max_wait=max_wait,
                            batching=batching, max_queue=max_queue, executor=executor) for t in translators]
        models = {(source, target): Model(batchers[i], searches[i], translators[i].for_target(target, src_lang=source)
                                          if translators[i].directions else translators[i])
                  for (source, target), i in chosen.items()}
        for translator in translators:  # before the first request: compiling a kind takes long (main()
            started = time.perf_counter()  # compiled them already: here for create_app's other callers)
            if kinds := await loop.run_in_executor(executor, translator.compile_decoding):
                print(compiled_line(translator, kinds=kinds, seconds=time.perf_counter() - started), file=sys.stderr,
                      flush=True)
        app.state.server = Server(models, detector, char_limit=char_limit, timeout=timeout,
                                  max_request_tokens=max_request_tokens, max_beam_size=max_beam_size,
                                  max_glossary_chars=max_glossary_chars, files=FileStore(max_bytes=max_stored_bytes),
                                  gate=gate)
        if metrics is not None:
            labels = [", ".join(f"{s}-{t}" for s, t in sorted(p for p, i in chosen.items() if i == n))
                      for n in range(len(translators))]  # a model by the directions it serves here
            metrics.watch(lambda: list(zip(labels, batchers, strict=True)))
        tasks = [asyncio.create_task(batcher.run()) for batcher in batchers for _ in range(workers)]
        try:
            yield
        finally:  # uvicorn has stopped accepting and waited for the open requests
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for batcher in batchers:
                await batcher.drain()
            executor.shutdown(wait=True)

    def route(path: str, name: str, methods: list[str]) -> Route:
        async def endpoint(request: Request) -> Response:
            response: Response = await getattr(request.app.state.server, name)(request)
            return response

        return Route(path, answer_errors(endpoint), methods=methods)

    endpoints: list[BaseRoute] = [route("/translate", "libretranslate", ["POST"]), route("/translate_file", "translate_file", ["POST"]),
                 route("/download_file/{name}", "download_file", ["GET"]), route("/detect", "detect", ["POST"]),
                 route("/v1/translate", "v1_translate", ["POST"]), route("/languages", "languages", ["GET"]),
                 route("/health", "health", ["GET"]), route("/frontend/settings", "settings", ["GET"])]
    if metrics is not None:
        endpoints.append(Route("/metrics", metrics.endpoint, methods=["GET"]))
    if web_ui:
        endpoints += page_routes()
    middleware = [Middleware(BodyLimit, max_bytes=max_body_size)]
    if metrics is not None:  # outermost: a body refused by BodyLimit is counted too
        middleware.insert(0, Middleware(Measured, metrics=metrics))
    return Starlette(routes=endpoints, lifespan=lifespan, middleware=middleware)
