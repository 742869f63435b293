"""The HTTP server under load: dynamic batching against the same server decoding one request at a time.

    python bench/serve_load.py --checkpoint checkpoints/multi30k/best.ckpt [--clients 1 8 32] [--requests 200]
    python bench/serve_load.py --checkpoint ... --paragraphs 4 [--clients 8]

With --paragraphs K each request is a paragraph of K consecutive Multi30k test sentences instead,
sent twice over: to /translate, which splits it into sentences and puts it back, and to
/v1/translate, which gives the model the whole paragraph as one sequence (what the server did before
it split); sentences/s counts source sentences, and BLEU (sacreBLEU, against the K references joined)
shows what each gives. The server runs with batching for both.

Starts serve/server.py twice on loopback (a port of its own each time), once with batching and
once with --no-batching, and for each number of concurrent clients sends a fixed number of
requests (--requests in all, spread over the clients), each one Multi30k test sentence (in the
checkpoint's source language, source auto), every
client waiting for its answer before its next request. Prints sentences per second, p50 and p95
latency, the decoder batches the server ran (from /health), and the throughput ratio batching /
no batching per client count. Same machine, same process for the load, servers run one after the
other. Run by hand, not in CI.
"""

import argparse
import asyncio
import contextlib
import gzip
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import sacrebleu
from decode_vs_ct2 import cpu_model

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(checkpoint: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, str(REPO / "serve/server.py"), "--checkpoint", checkpoint, "--port", str(port),
               *extra]
    process = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + (1200 if "--compile" in extra else 120)  # (compiling every kind: minutes)
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {process.stderr.read() if process.stderr else ''}") from None
            time.sleep(0.2)


@contextlib.contextmanager
def serving(args: argparse.Namespace, extra: list[str]) -> Iterator[tuple[str, str, str]]:
    """serve/server.py with the run's options (and `extra`) for as long as the block runs: its URL and
    the language pair its checkpoint translates; stopped by SIGTERM as an operator would."""
    process, url = start_server(args.checkpoint, ["--beam-size", args.beam_size, "--threads", args.threads,
                                                  "--workers", args.workers, "--precision", args.precision,
                                                  *(["--compile"] if args.compile else []), *extra])
    try:
        [(source, target)] = [(lang["code"], t) for lang in httpx.get(url + "/languages").json() for t in lang["targets"]]
        yield url, source, target
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def multi30k_test(args: argparse.Namespace, language: str) -> list[str]:
    with gzip.open(Path(args.data) / f"test_2016_flickr.{language}.gz", "rt", encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


async def load(url: str, sentences: list[str], *, clients: int, requests: int, target: str = "en",
               endpoint: str = "/translate", outputs: dict[int, str] | None = None) -> tuple[float, list[float]]:
    """(wall seconds, per-request latencies) of `requests` requests of one text each (a sentence, or a
    paragraph) from `clients` clients; `outputs` collects the translations by request number."""
    latencies: list[float] = []
    next_sentence = iter(range(requests))

    async def client(http: httpx.AsyncClient) -> None:
        for i in next_sentence:
            text = sentences[i % len(sentences)]
            body = ({"q": text, "source": "auto", "target": target} if endpoint == "/translate" else {"q": [text]})
            start = time.perf_counter()
            reply = await http.post(url + endpoint, json=body)
            latencies.append(time.perf_counter() - start)
            if reply.status_code != 200:
                raise SystemExit(f"request {i}: {reply.status_code} {reply.text}")
            if outputs is not None:
                answer = reply.json()
                outputs[i] = answer["translatedText"] if "translatedText" in answer else answer["translations"][0][0]["text"]

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return time.perf_counter() - start, latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", default=str(REPO.parent / "shared/data/multi30k"))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=200, help="requests per client count")
    parser.add_argument("--beam-size", default="5")
    parser.add_argument("--threads", default="2", help="the server's intra-op threads per decoder thread")
    parser.add_argument("--workers", default="1", help="the server's decoder threads (--workers)")
    parser.add_argument("--precision", default="auto", help="the server's --precision")
    parser.add_argument("--compile", action="store_true", help="the server compiles its decoding steps (--compile)")
    parser.add_argument("--paragraphs", type=int, default=0, metavar="K",
                        help="requests of K sentences each: split by the server against decoded whole")
    args = parser.parse_args()
    if args.paragraphs:
        return paragraphs(args)
    print(f"{cpu_model()}; {args.requests} requests per row, beam {args.beam_size}, server with {args.workers} decoder "
          f"threads x {args.threads} threads, precision {args.precision}{', compiled' if args.compile else ''}")
    print("| clients | server | sentences/s | p50 latency | p95 latency | decoder batches |")
    print("|---|---|---|---|---|---|")
    throughput: dict[tuple[int, str], float] = {}
    for mode, extra in (("batching", []), ("no batching", ["--no-batching"])):
        with serving(args, extra) as (url, source, target):
            sentences = multi30k_test(args, source)
            asyncio.run(load(url, sentences, clients=2, requests=10, target=target))  # warm-up
            for clients in args.clients:
                before = httpx.get(url + "/health").json()["batches"]
                seconds, latencies = asyncio.run(load(url, sentences, clients=clients, requests=args.requests,
                                                      target=target))
                batches = httpx.get(url + "/health").json()["batches"] - before
                throughput[clients, mode] = args.requests / seconds
                print(f"| {clients} | {mode} | {args.requests / seconds:.1f} | {percentile(latencies, 0.5) * 1000:.0f} ms "
                      f"| {percentile(latencies, 0.95) * 1000:.0f} ms | {batches} |", flush=True)
    print()
    for clients in args.clients:
        ratio = throughput[clients, "batching"] / throughput[clients, "no batching"]
        print(f"{clients} clients: batching / no batching = {ratio:.2f}x")


def paragraphs(args: argparse.Namespace) -> None:
    with serving(args, []) as (url, source, target):
        k = args.paragraphs
        sentences, translations = multi30k_test(args, source), multi30k_test(args, target)
        count = min(args.requests, len(sentences) // k)
        sources = [" ".join(sentences[i * k : (i + 1) * k]) for i in range(count)]
        references = [" ".join(translations[i * k : (i + 1) * k]) for i in range(count)]
        print(f"{cpu_model()}; {source}→{target}, {count} requests of {k} sentences per row, beam {args.beam_size}, "
              f"server with {args.workers} decoder threads x {args.threads} threads, batching")
        print("| clients | request | source sentences/s | p50 latency | p95 latency | BLEU |")
        print("|---|---|---|---|---|---|")
        asyncio.run(load(url, sources, clients=2, requests=4, target=target))  # warm-up
        speed = {}
        for clients in args.clients:
            for name, endpoint in (("split (/translate)", "/translate"), ("whole (/v1/translate)", "/v1/translate")):
                outputs: dict[int, str] = {}
                seconds, latencies = asyncio.run(load(url, sources, clients=clients, requests=count, target=target,
                                                      endpoint=endpoint, outputs=outputs))
                bleu = sacrebleu.corpus_bleu([outputs[i] for i in range(count)], [references]).score
                speed[clients, endpoint] = count * k / seconds
                print(f"| {clients} | {name} | {count * k / seconds:.1f} | {percentile(latencies, 0.5) * 1000:.0f} ms "
                      f"| {percentile(latencies, 0.95) * 1000:.0f} ms | {bleu:.2f} |", flush=True)
    print()
    for clients in args.clients:
        print(f"{clients} clients: split / whole = {speed[clients, '/translate'] / speed[clients, '/v1/translate']:.2f}x "
              "source sentences/s")


if __name__ == "__main__":
    main()
