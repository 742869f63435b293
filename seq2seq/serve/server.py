"""HTTP translation server: LibreTranslate's API, with requests batched together as they arrive.

    python -m seq2seq.serve --checkpoint checkpoints/multi30k/best.ckpt --port 5000 [--beam-size 5]
    python -m seq2seq.serve --checkpoint de-en.ckpt --checkpoint fr-en.ckpt ...   # one per language pair
    python -m seq2seq.serve --checkpoint multilingual.ckpt --checkpoint de-en.ckpt  # every direction of the first,
                                                                                    # de→en by the second
    curl -s localhost:5000/translate -H 'Content-Type: application/json' \
         -d '{"q": "Ein Hund läuft.", "source": "de", "target": "en"}'
    {"translatedText":"A dog is running."}

Endpoints (JSON or form bodies, as LibreTranslate takes them; errors are `{"error": "..."}`):

    POST /translate      q (a string or a list; each split into sentences, put back with its own
                         spacing), source (or auto), target, format (text or html), alternatives
                         -> {"translatedText": ..., "alternatives": [...], "detectedLanguage": ...}
    POST /translate_file file (.txt, .html, .srt), source, target -> {"translatedFileUrl": ...}
    GET  /download_file/NAME  the translated file
    POST /detect         q -> [{"confidence": ..., "language": ...}, ...]    (all LibreTranslate's)
    GET  /languages      [{"code": "de", "name": "German", "targets": ["en"]}, ...]: every direction of every
                         model (a multilingual model's each), each pair routed to its most specific model
    GET  /health         {"status": "ok", "batches": ..., "requests": ..., "sentences": ..., "queued": ...,
                          "models": [the same per model, with the "directions" it serves]}
    POST /v1/translate   {"q": [...], "beam_size": 5, "nbest": 2, ...any SearchConfig field, and source and
                          target where the server has several models}
                         -> {"translations": [[{"text": ..., "score": ...}, ...], ...]}; with
                         "alignments": true each also has "alignment": [[i, j], ...], with
                         "token_scores": true "token_scores": [...]; "target_prefix": the start of
                         each translation (a string, or a list as long as q)
    GET  /               the translation page (seq2seq/serve/web.py; --no-web-ui: none)
    GET  /frontend/settings  what the page needs: keyRequired, charLimit, ... (LibreTranslate's names)
    GET  /metrics        Prometheus' text format (--metrics; behind --metrics-token where given)

With --api-keys DB every translating request needs a key of DB (python -m seq2seq.serve keys --db DB add), and
--req-limit / --daily-char-limit bound each key's or client address's requests a minute and characters a day
(seq2seq/serve/access.py: 429 with Retry-After, counted in the SQLite file that every process given it shares).

Dynamic batching: a request's sentences join its model's queue; a batcher task takes whatever has
arrived within --max-wait-ms of the first, decodes it in a decoder thread (the event loop keeps
accepting) in calls of at most --max-batch-tokens, and hands each request its own results. There are
--workers decoder threads (default: one per core; one on a GPU), each with --threads intra-op threads
(default: 1; all the cores for a GPU's one), shared by the models, and as many batcher tasks per model,
so that several batches decode at once. Requests with different search options are decoded in separate
calls, and seeded sampling requests one at a time (a draw must not depend on what else arrived). When
a call fails, its requests are decoded again one at a time, so that only the one that fails alone gets
the error. A request whose client has gone (timed out or disconnected) is not decoded. SIGTERM or
Ctrl-C stops accepting, finishes the requests already in, and exits 0 (130 for Ctrl-C). With --compile,
every kind of decoding step is compiled for the decoder threads' --threads before the server starts
(long the first time, less from inductor's disk cache later), so that no request waits for it; a step
that cannot be compiled, or Ctrl-C meanwhile, is one line and an exit.

A request's cost is bounded before it is queued, in decoder tokens: per sentence, its hypotheses
(the beam; 1 for greedy and sampling) times its output limit (max_len_a x source tokens + max_len_b,
at most the model's max_positions; the tokenizer counts the source), at least 16 each. The limits
are the flags of `build_parser`, each one's help saying what it bounds; docs/serving.md#limits is
their one table (tests/serve/test_limits_table.py checks it against this parser: a new flag or a
changed default fails there until the table has it).

Bad input is a 400 with a one-line message, never a 500; running out of memory is a 503 and any
other failure a 500 without internals (stderr has the details, one line each).

Starlette + uvicorn (the `[serve]` extra): FastAPI's models would add little here, since one
endpoint takes JSON and form bodies alike and the options are already one validated dataclass.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import uvicorn

from seq2seq.cli import (
    add_search_arguments,
    check_flags,
    compile_before_answering,
    describe,
    interruption,
    one_line_warnings,
    open_translator,
    parallelism,
    stop_on_sigterm,
)
from seq2seq.precision import DECODING_KERNEL_CACHE_CAPACITY, tune_process_memory
from seq2seq.serve import keys
from seq2seq.serve.access import AccessError, Gate, Limits
from seq2seq.serve.app import create_app
from seq2seq.serve.guards import (
    FD_RESERVE,
    open_file_limit,
    uvicorn_config,
)
from seq2seq.serve.metrics import Metrics


def build_parser() -> argparse.ArgumentParser:
    """The command's flags: the server's own (its limits: docs/serving.md#limits), then the search and run
    options every decoding face takes (add_search_arguments)."""
    parser = argparse.ArgumentParser(prog="python -m seq2seq.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, action="append",
                        help="a .ckpt written by python -m seq2seq.fit (or seq2seq.convert); repeat it to serve several: "
                             "each language pair is served by the most specific model that has it (a bilingual one "
                             "before a multilingual one)")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    parser.add_argument("--port", type=int, default=5000, help="0 to 65535 (0: any free port) (default: 5000)")
    parser.add_argument("--max-wait-ms", type=float, default=5.0,
                        help="how long a batch waits for more requests to join it (default: 5)")
    parser.add_argument("--no-batching", action="store_true", help="decode each request alone (a baseline)")
    parser.add_argument("--max-queue", type=int, default=1024, help="requests waiting at most; then 429")
    parser.add_argument("--char-limit", type=int, default=5000, help="characters per request at most; then 400")
    parser.add_argument("--max-glossary-chars", type=int, default=100_000,
                        help="characters of a /v1 request's glossary (its source and target terms together) at most, "
                             "counted before it is compiled; then 400 (default: 100000)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a request waits at most; then 503")
    parser.add_argument("--max-request-tokens", type=int, default=16384,
                        help="decoder tokens per request at most (beam x output limit per sentence, at least 16 "
                             "each, summed); then 400 (default: 16384)")
    parser.add_argument("--max-batch-tokens", type=int, default=8192,
                        help="decoder tokens per decoder call at most: bounds its memory (default: 8192)")
    parser.add_argument("--max-beam-size", type=int, default=16, help="beam size of a request at most; then 400")
    parser.add_argument("--max-body-size", type=int, default=1 << 20,
                        help="bytes of a request body at most; then 413 (default: 1048576)")
    parser.add_argument("--max-stored-bytes", type=int, default=64 << 20,
                        help="bytes of translated files kept for /download_file at most (an hour each; a client a "
                             "quarter of them), charged as each is stored; then 503 (default: 67108864)")
    parser.add_argument("--read-timeout", type=float, default=10.0,
                        help="seconds a client has to send a whole request; then 408 and closed (default: 10)")
    parser.add_argument("--max-connections", type=int, default=512,
                        help="open connections at most; idle ones are closed first, then 503 (default: 512)")
    access = parser.add_argument_group("keys, limits, metrics and the web page (docs/serving.md#keys-and-limits)")
    access.add_argument("--api-keys", type=Path, default=None, metavar="DB",
                        help="require an API key from this database (python -m seq2seq.serve keys --db DB add), as "
                             "api_key in the body or an Authorization: Bearer header; else 401 (none) or 403 (wrong)")
    access.add_argument("--limits-db", type=Path, default=None, metavar="DB",
                        help="count the limits in this SQLite file (created if missing) instead of in memory, so that "
                             "every server process given it shares them (the --api-keys file does this by itself)")
    access.add_argument("--req-limit", type=int, default=None,
                        help="requests a minute per client address, and per key without its own; then 429 with "
                             "Retry-After (default: no limit)")
    access.add_argument("--daily-char-limit", type=int, default=None,
                        help="characters a day (UTC) per client address, and per key without its own; then 429 "
                             "with Retry-After (default: no limit)")
    access.add_argument("--metrics", action="store_true", help="serve GET /metrics in Prometheus' format")
    access.add_argument("--metrics-token", default=os.environ.get("SEQ2SEQ_METRICS_TOKEN"),
                        help="/metrics only with Authorization: Bearer TOKEN (default: $SEQ2SEQ_METRICS_TOKEN; the "
                             "variable keeps it out of the process list)")
    access.add_argument("--no-web-ui", action="store_true", help="no translation page at /")
    access.add_argument("--root-path", default=None,
                        help="the path prefix a reverse proxy serves this server under (e.g. /translate-api), for "
                             "the URLs it writes (/translate_file's link)")
    access.add_argument("--trusted-proxies", default=None, metavar="IPS",
                        help="comma-separated addresses (or *) of reverse proxies whose X-Forwarded-For and "
                             "X-Forwarded-Proto are believed: the client's address (for --req-limit) is taken from "
                             "them only for these (default: none, the connection's address)")
    add_search_arguments(parser, target=False)  # (requests choose the target: a multilingual model serves them all)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keys"]:  # python -m seq2seq.serve keys ...: the API keys (seq2seq/serve/keys.py)
        keys.main(argv[1:])
        return
    parser = build_parser()
    args = parser.parse_args(argv)
    search = check_flags(parser, args)
    for name in ("max_queue", "char_limit", "max_request_tokens", "max_batch_tokens", "max_beam_size",
                 "max_body_size", "max_connections", "max_glossary_chars", "max_stored_bytes", "req_limit",
                 "daily_char_limit"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.port <= 65535:  # before the model loads: uvicorn would fail with three tracebacks
        parser.error(f"--port must be between 0 and 65535, got {args.port}")
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
    if args.metrics_token is not None and not args.metrics:
        parser.error("--metrics-token is for --metrics: give both, or neither")
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        parser.error(f"--root-path must start with / and not end with one, e.g. /translate-api; got {args.root_path!r}")
    try:  # before the model loads: a missing or read-only key database is one line at once
        gate = Gate(keys_path=args.api_keys, limits_path=args.limits_db,
                    limits=Limits(req_limit=args.req_limit, char_limit=args.daily_char_limit))
    except (AccessError, ValueError) as error:
        parser.error(f"--{'api-keys' if args.api_keys else 'limits-db'} {error}" if isinstance(error, AccessError)
                     else str(error))
    one_line_warnings()
    stop_on_sigterm()  # until uvicorn runs (below): loading and compiling stopped with a line, as Ctrl-C is
    workers, threads = parallelism(args)
    try:
        loaded = [open_translator(parser, argparse.Namespace(**{**vars(args), "checkpoint": path}), parallel=False,
                                  served_by=(workers, threads))
                  for path in args.checkpoint]
    except KeyboardInterrupt as error:  # Ctrl-C or SIGTERM while the model loads: one line, as after it starts
        stop, status = interruption(error)
        print(f"\n{stop} while loading the model; the server was not started", file=sys.stderr)
        raise SystemExit(status) from None
    try:
        app = create_app([t for t, _ in loaded], [search for _, search in loaded], max_tokens=args.max_tokens,
                         max_wait=args.max_wait_ms / 1000,
                         batching=not args.no_batching, max_queue=args.max_queue, char_limit=args.char_limit,
                         timeout=args.timeout, max_request_tokens=args.max_request_tokens,
                         max_batch_tokens=args.max_batch_tokens, max_beam_size=args.max_beam_size,
                         max_body_size=args.max_body_size, max_glossary_chars=args.max_glossary_chars,
                         max_stored_bytes=args.max_stored_bytes, workers=workers, threads=threads,
                         gate=gate if gate.active else None,
                         metrics=Metrics(token=args.metrics_token) if args.metrics else None,
                         web_ui=not args.no_web_ui)
    except ValueError as error:  # a checkpoint's tuned beam over --max-beam-size, two models for one pair, ...
        parser.error(str(error))
    for translator, _ in loaded:  # for the decoder threads' count, before uvicorn: a failure or Ctrl-C is one line
        compile_before_answering(translator, threads=threads, face="the server")
    for translator, search in loaded:
        print(f"{translator.pairs} on http://{args.host}:{args.port} ({translator.precision}"
              f"{' compiled' if translator.compiled else ''}, "
              f"{workers} decoder threads x {threads} threads, {describe(search)})", file=sys.stderr, flush=True)

    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then raises the signal again for the handler
    # that was there before it: these record it, so the process ends with a line and a plain exit
    # status (0 for SIGTERM, 130 for Ctrl-C) instead of dying by the signal or a KeyboardInterrupt.
    received: list[int] = []
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda number, frame: received.append(number))
    started = time.perf_counter()
    server = uvicorn.Server(uvicorn_config(app, max_connections=args.max_connections, read_timeout=args.read_timeout,
                                           host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=args.timeout, root_path=args.root_path or "",
                                           proxy_headers=args.trusted_proxies is not None,
                                           forwarded_allow_ips=args.trusted_proxies or ""))
    server.run()
    if not server.started:  # uvicorn has said why (the port is taken, ...), as uvicorn.run exits
        sys.exit(3)
    name = signal.Signals(received[0]).name if received else "the server"
    print(f"stopped by {name} after {time.perf_counter() - started:.0f}s", file=sys.stderr)
    sys.exit(130 if signal.SIGINT in received else 0)


def run() -> None:
    """The command: `main` with the process set up for it, and Ctrl-C or SIGTERM answered with a line."""
    tune_process_memory(kernels=DECODING_KERNEL_CACHE_CAPACITY)  # large blocks reused, kernels kept
    try:
        main()
    except KeyboardInterrupt as error:  # in the moment between the start-up's compile and uvicorn's own handlers
        stop, status = interruption(error)
        print(f"\n{stop}; the server was not started", file=sys.stderr)
        sys.exit(status)


if __name__ == "__main__":
    run()
