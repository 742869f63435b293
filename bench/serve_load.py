"""The HTTP server under load: dynamic batching against the same server decoding one request at a time.

    python bench/serve_load.py --checkpoint checkpoints/multi30k/best.ckpt [--clients 1 8 32] [--requests 200]

Starts serve/server.py twice on loopback (a port of its own each time), once with batching and
once with --no-batching, and for each number of concurrent clients sends a fixed number of
requests (--requests in all, spread over the clients), each one Multi30k test sentence, every
client waiting for its answer before its next request. Prints sentences per second, p50 and p95
latency, the decoder batches the server ran (from /health), and the throughput ratio batching /
no batching per client count. Same machine, same process for the load, servers run one after the
other. Run by hand, not in CI.
"""

import argparse
import asyncio
import gzip
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
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
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {process.stderr.read() if process.stderr else ''}") from None
            time.sleep(0.2)


async def load(url: str, sentences: list[str], *, clients: int, requests: int) -> tuple[float, list[float]]:
    """(wall seconds, per-request latencies) of `requests` single-sentence requests from `clients` clients."""
    latencies: list[float] = []
    next_sentence = iter(range(requests))

    async def client(http: httpx.AsyncClient) -> None:
        for i in next_sentence:
            body = {"q": sentences[i % len(sentences)], "source": "auto", "target": "en"}
            start = time.perf_counter()
            reply = await http.post(url + "/translate", json=body)
            latencies.append(time.perf_counter() - start)
            if reply.status_code != 200:
                raise SystemExit(f"request {i}: {reply.status_code} {reply.text}")

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
    parser.add_argument("--threads", default="2", help="the server's torch threads")
    args = parser.parse_args()
    with gzip.open(Path(args.data) / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        sentences = [line for line in f.read().split("\n") if line.strip()]
    print(f"{cpu_model()}; {args.requests} requests per row, beam {args.beam_size}, server with {args.threads} threads")
    print("| clients | server | sentences/s | p50 latency | p95 latency | decoder batches |")
    print("|---|---|---|---|---|---|")
    throughput: dict[tuple[int, str], float] = {}
    for mode, extra in (("batching", []), ("no batching", ["--no-batching"])):
        process, url = start_server(args.checkpoint, ["--beam-size", args.beam_size, "--threads", args.threads,
                                                      "--precision", "auto", *extra])
        try:
            asyncio.run(load(url, sentences, clients=2, requests=10))  # warm-up
            for clients in args.clients:
                before = httpx.get(url + "/health").json()["batches"]
                seconds, latencies = asyncio.run(load(url, sentences, clients=clients, requests=args.requests))
                batches = httpx.get(url + "/health").json()["batches"] - before
                throughput[clients, mode] = args.requests / seconds
                print(f"| {clients} | {mode} | {args.requests / seconds:.1f} | {percentile(latencies, 0.5) * 1000:.0f} ms "
                      f"| {percentile(latencies, 0.95) * 1000:.0f} ms | {batches} |", flush=True)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    print()
    for clients in args.clients:
        ratio = throughput[clients, "batching"] / throughput[clients, "no batching"]
        print(f"{clients} clients: batching / no batching = {ratio:.2f}x")


if __name__ == "__main__":
    main()
