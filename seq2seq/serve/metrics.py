"""`/metrics` in Prometheus' text format (prometheus-client): what the server did, by endpoint and by model.

Requests are counted by an ASGI middleware around the whole app (so a body refused before the app runs is
counted too), labelled by the route's name, never the raw path (a client's paths would grow the labels without
bound). What the batchers did is read from their Stats when Prometheus scrapes, not counted on the decoding path.
Each app has a registry of its own: two servers in one process (the tests) do not share counts.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from seq2seq.serve.batcher import Batcher

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENDPOINTS = ("/translate", "/translate_file", "/download_file", "/detect", "/v1/translate", "/languages", "/health",
             "/metrics", "/frontend/settings", "/", "/static")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
REASONS = {413: "body_size", 401: "key", 403: "key"}  # a rejection's reason where its status says it


def endpoint_of(path: str) -> str:
    """The label for a request path: one of ENDPOINTS, or "other"."""
    if path.startswith("/download_file/"):
        return "/download_file"
    if path.startswith("/static/"):
        return "/static"
    return path if path in ENDPOINTS else "other"


class BatcherStats(Collector):
    """Each model's batcher's Stats and queue, read at scrape time; `batchers` gives (model label, batcher)."""

    def __init__(self, batchers: Callable[[], Sequence[tuple[str, Batcher]]]) -> None:
        self.batchers = batchers

    def collect(self) -> Iterator[Metric]:
        sentences = CounterMetricFamily("seq2seq_sentences_decoded", "Sentences decoded", labels=["model"])
        tokens = CounterMetricFamily("seq2seq_tokens_decoded", "Output tokens of the best translations decoded",
                                     labels=["model"])
        calls = CounterMetricFamily("seq2seq_decoder_calls", "Decoder calls (batches)", labels=["model"])
        busy = CounterMetricFamily("seq2seq_decoder_busy_seconds", "Decoder-thread seconds spent decoding",
                                   labels=["model"])
        queued = GaugeMetricFamily("seq2seq_queue_depth", "Requests waiting for a decoder call", labels=["model"])
        sizes = HistogramMetricFamily("seq2seq_batch_sentences", "Sentences per decoder call", labels=["model"])
        for model, batcher in self.batchers():
            stats = batcher.stats
            sentences.add_metric([model], stats.sentences)
            tokens.add_metric([model], stats.tokens)
            calls.add_metric([model], stats.batches)
            busy.add_metric([model], stats.busy_seconds)
            queued.add_metric([model], batcher.queue.qsize())
            counts = dict(stats.batch_sizes)  # a copy: the event loop may add to it meanwhile
            buckets = [(str(bound), sum(n for size, n in counts.items() if size <= bound)) for bound in BATCH_BUCKETS]
            buckets.append(("+Inf", sum(counts.values())))
            sizes.add_metric([model], buckets, sum_value=sum(size * n for size, n in counts.items()))
        yield from (sentences, tokens, calls, busy, queued, sizes)


class Metrics:
    """The registry of one app, its request metrics, and the /metrics endpoint (behind `token` where given)."""

    def __init__(self, *, token: str | None = None) -> None:
        self.token = token
        self.registry = CollectorRegistry()
        self.requests = Counter("seq2seq_http_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=self.registry)
        self.latency = Histogram("seq2seq_http_request_duration_seconds", "Seconds from a request's start to the end "
                                 "of its answer", ["endpoint"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("seq2seq_http_requests_in_flight", "Requests being answered", ["endpoint"],
                               registry=self.registry)
        self.rejections = Counter("seq2seq_rejections", "Requests refused, by reason", ["reason"],
                                  registry=self.registry)

    def watch(self, batchers: Callable[[], Sequence[tuple[str, Batcher]]]) -> None:
        self.registry.register(BatcherStats(batchers))

    async def endpoint(self, request: Request) -> Response:
        if self.token is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return JSONResponse({"error": "/metrics needs the server's --metrics-token as an Authorization: "
                                              "Bearer header"}, status_code=401, headers={"www-authenticate": "Bearer"})
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE)


class Measured:
    """ASGI middleware: each HTTP request counted by endpoint and status, timed, and while it runs in flight; a
    refusal counted by its reason (answer_errors writes it into the request's state; else its status says it)."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = endpoint_of(scope["path"])
        status = 500  # if the app fails before it answers
        started = time.perf_counter()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        in_flight = self.metrics.in_flight.labels(endpoint)
        in_flight.inc()
        try:
            await self.app(scope, receive, sending)
        finally:
            in_flight.dec()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
            self.metrics.requests.labels(endpoint, str(status)).inc()
            reason = scope.get("state", {}).get("rejection") or REASONS.get(status)
            if reason is not None:
                self.metrics.rejections.labels(reason).inc()
