"""The HTTP server under hostile load: normal requests keep their latency, the server its memory.

    python bench/server_soak.py --checkpoint checkpoints/multi30k/best.ckpt [--seconds 20] [--clients 4]

Starts serve/server.py on loopback (one torch thread, --read-timeout 2) and runs two loads for
--seconds each, alternating, twice: --clients normal clients sending one sentence at a time (each
waits for its answer), alone; then the same beside a process of hostile clients that, each kind in
a loop, declare 300 MB bodies, stream chunked bodies that never end, send JSON nested 50,000 deep,
multipart forms of 1,001 fields, beams of 400, requests over the token budget (4,999 sentences "a"),
and hold --slow connections that send their headers a byte at a time and stall; then the hostile
clients alone, twice, with nothing decoding (what the rejected requests leave). Prints the normal
requests' p50 / p95 latency in each load and the hostile / normal ratio, what the hostile requests
got (by status), and the server's resident memory (VmRSS in /proc/<pid>/status, sampled every
0.2 s): after warm-up, at the end of each phase, and its peak. Exits 1 if the p50 ratio is over 2,
memory grew more than --max-growth-mb from the end of the first normal phase, or a hostile request
got a 500. tests/serve/test_server_soak.py runs a short version of it.
"""

import argparse
import asyncio
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SLOW_HEAD = b"POST /translate HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used (/proc/<pid>/stat), in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


# ---------------------------------------------------------------------------------------------
# Hostile clients: a process of their own (run as `--hostile PORT`), so that their work does not
# hold up the normal clients' event loop in this one; they print what they got as JSON.


def hostile_requests() -> dict[str, bytes]:
    def post(path: str, content_type: str, body: bytes, length: int | None = None) -> bytes:
        return (f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body

    fields = b"".join(b'--x\r\nContent-Disposition: form-data; name="q"\r\n\r\na\r\n' for _ in range(1001)) + b"--x--\r\n"
    return {
        "300 MB body": post("/translate", "application/json", b'{"q": "' + b"a" * 65536, length=300 << 20),
        "deep JSON": post("/translate", "application/json", b"[" * 50_000),
        "1001 fields": post("/translate", "multipart/form-data; boundary=x", fields),
        "beam 400": post("/v1/translate", "application/json", b'{"q": "a", "beam_size": 400}'),
        "over budget": post("/v1/translate", "application/json", json.dumps({"q": ["a"] * 4999}).encode()),
    }


async def status(port: int, talk: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bytes]]) -> int:
    """The status of the response `talk` reads on a new connection to the server; 0 for none."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return 0
    try:
        head = await talk(reader, writer)
        return int(head.split(b" ")[1]) if head.startswith(b"HTTP/") else 0
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        return 0
    finally:
        writer.close()


async def exchange(port: int, data: bytes, *, stream_chunked: bool = False) -> int:
    """The status the server answers to `data` (then an endless chunked body, if asked)."""

    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(data)
        if not stream_chunked:
            await writer.drain()
            return await asyncio.wait_for(reader.read(65536), 10)
        chunk = b"%x\r\n%s\r\n" % (65536, b"a" * 65536)
        read = asyncio.ensure_future(reader.read(65536))
        try:
            for _ in range(64):  # 4 MiB at most, until the server answers
                if read.done():
                    break
                writer.write(chunk)
                await writer.drain()
        except OSError:  # closed by the server: its answer may be there, or lost to the reset
            pass
        return await asyncio.wait_for(read, 10)

    return await status(port, talk)


async def slow_client(port: int) -> int:
    """Headers a byte every 50 ms, then a stall: the status the server closes it with (408 expected)."""

    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        for byte in SLOW_HEAD[:40]:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.05)
        return await asyncio.wait_for(reader.read(65536), 60)

    return await status(port, talk)


async def hostile(port: int, seconds: float, *, slow: int, pause: float) -> dict[str, dict[int, int]]:
    got: dict[str, Counter[int]] = {}
    deadline = time.monotonic() + seconds

    async def loop(kind: str, call) -> None:  # noqa: ANN001
        while time.monotonic() < deadline:
            got.setdefault(kind, Counter())[await call()] += 1
            await asyncio.sleep(pause)

    requests = hostile_requests()
    tasks = [loop(kind, lambda data=data: exchange(port, data)) for kind, data in requests.items()]
    chunked = (b"POST /translate HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    tasks.append(loop("endless chunked", lambda: exchange(port, chunked, stream_chunked=True)))
    tasks += [loop("slow client", lambda: slow_client(port)) for _ in range(slow)]
    await asyncio.gather(*tasks)
    return {kind: dict(counts) for kind, counts in got.items()}


# ---------------------------------------------------------------------------------------------
# Normal clients, the server's memory, and the phases.


async def normal_load(url: str, sentences: list[str], *, clients: int, seconds: float) -> tuple[list[float], Counter[int]]:
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    deadline = time.monotonic() + seconds
    target = httpx.get(url + "/languages").json()[0]["targets"][0]

    async def client(http: httpx.AsyncClient, offset: int) -> None:
        i = offset
        while time.monotonic() < deadline:
            start = time.perf_counter()
            reply = await http.post(url + "/translate", json={"q": sentences[i % len(sentences)], "source": "auto",
                                                              "target": target})
            latencies.append(time.perf_counter() - start)
            statuses[reply.status_code] += 1
            i += clients

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        await asyncio.gather(*(client(http, k) for k in range(clients)))
    return latencies, statuses


@dataclass
class Memory:
    """The server's VmRSS, sampled every 0.2 s in a thread."""

    pid: int
    samples: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while not self.stop.wait(0.2):
            try:
                self.samples.append(rss_mib(self.pid))
            except (OSError, StopIteration):
                return


@dataclass
class Result:
    latencies: dict[str, list[float]]  # "normal" / "hostile": the normal requests' latencies, seconds
    statuses: dict[str, Counter[int]]  # what the normal requests got, per load
    hostile: dict[str, Counter[int]]  # per hostile kind, its statuses
    rss: dict[str, float]  # MiB: "warm", "normal 1", "hostile 1", ..., "hostile alone 1", ..., "peak"
    cpu: dict[str, float]  # the server's CPU seconds, per load, summed over the rounds
    stderr: str

    def ratio(self, q: float = 0.5) -> float:
        return percentile(self.latencies["hostile"], q) / percentile(self.latencies["normal"], q)

    def growth(self) -> float:
        return max(v for k, v in self.rss.items() if k != "warm") - self.rss["normal 1"]


def start_attack(port: int, *, seconds: float, slow: int, pause: float) -> subprocess.Popen[str]:
    attack = subprocess.Popen([sys.executable, __file__, "--hostile", str(port), "--seconds", str(seconds),
                               "--slow", str(slow), "--pause", str(pause)], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # its start (imports) is not part of the load
    return attack


def collect(attack: subprocess.Popen[str], into: dict[str, Counter[int]]) -> None:
    out, _ = attack.communicate(timeout=120)
    for kind, counts in json.loads(out).items():
        into.setdefault(kind, Counter()).update({int(k): v for k, v in counts.items()})


def soak(checkpoint: str, *, seconds: float, clients: int = 4, slow: int = 20, rounds: int = 2,
         pause: float = 0.02, sentences: list[str] | None = None, server_flags: list[str] | None = None) -> Result:
    """Alternate `rounds` x (normal load, normal + hostile load), `seconds` each, on a server of its own."""
    if sentences is None:
        with gzip.open(REPO / "seq2seq/demo/data/test.en.gz", "rt", encoding="utf-8") as f:
            sentences = [line for line in f.read().split("\n") if line.strip()]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, str(REPO / "serve/server.py"), "--checkpoint", checkpoint, "--port", str(port),
               "--threads", "1", "--read-timeout", "2", *(server_flags or [])]
    with tempfile.TemporaryFile("w+", encoding="utf-8") as stderr:
        process = subprocess.Popen(command, cwd=REPO, stderr=stderr, text=True)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        stderr.seek(0)
                        raise SystemExit(f"the server did not start: {stderr.read()}") from None
                    time.sleep(0.1)
            asyncio.run(normal_load(url, sentences, clients=clients, seconds=1.0))  # warm-up
            memory = Memory(process.pid)
            rss = {"warm": rss_mib(process.pid)}
            latencies: dict[str, list[float]] = {"normal": [], "hostile": []}
            statuses: dict[str, Counter[int]] = {"normal": Counter(), "hostile": Counter()}
            hostile_got: dict[str, Counter[int]] = {}
            cpu = {"normal": 0.0, "hostile": 0.0}
            for round_ in range(1, rounds + 1):
                for load in ("normal", "hostile"):
                    attack = start_attack(port, seconds=seconds, slow=slow, pause=pause) if load == "hostile" else None
                    used = cpu_seconds(process.pid)
                    got, codes = asyncio.run(normal_load(url, sentences, clients=clients, seconds=seconds))
                    cpu[load] += cpu_seconds(process.pid) - used
                    latencies[load] += got
                    statuses[load] += codes
                    if attack is not None:
                        collect(attack, hostile_got)
                    rss[f"{load} {round_}"] = rss_mib(process.pid)
            # The hostile clients alone: nothing decodes, so the decoder's memory (which grows to its peak
            # as batches of new sizes come, over minutes) does not hide what the rejected requests leave.
            for round_ in range(1, rounds + 1):
                collect(start_attack(port, seconds=seconds, slow=slow, pause=pause), hostile_got)
                rss[f"hostile alone {round_}"] = rss_mib(process.pid)
            memory.stop.set()
            rss["peak"] = max(memory.samples + list(rss.values()))
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        stderr.seek(0)
        return Result(latencies, statuses, hostile_got, rss, cpu, stderr.read())


def cpu_model() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else 'unknown CPU'} ({os.cpu_count()} cores)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="the model to serve")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds per phase (4 phases)")
    parser.add_argument("--clients", type=int, default=4, help="normal clients")
    parser.add_argument("--slow", type=int, default=20, help="slow connections held open at any time")
    parser.add_argument("--pause", type=float, default=0.02, help="seconds each hostile loop waits between requests")
    parser.add_argument("--max-growth-mb", type=float, default=50.0)
    parser.add_argument("--hostile", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hostile:
        got = asyncio.run(hostile(args.hostile, args.seconds, slow=args.slow, pause=args.pause))
        print(json.dumps(got))
        return
    if not args.checkpoint:
        parser.error("--checkpoint is required")
    result = soak(args.checkpoint, seconds=args.seconds, clients=args.clients, slow=args.slow, pause=args.pause)
    print(f"{cpu_model()}; 2 x ({args.seconds:g} s normal, {args.seconds:g} s normal + hostile), {args.clients} "
          f"normal clients, {args.slow} slow connections")
    for load in ("normal", "hostile"):
        values = result.latencies[load]
        print(f"{load:>8}: {len(values)} normal requests {dict(result.statuses[load])}, p50 "
              f"{percentile(values, 0.5) * 1000:.0f} ms, p95 {percentile(values, 0.95) * 1000:.0f} ms")
    print("server CPU: " + ", ".join(f"{load} {result.cpu[load]:.1f} s" for load in ("normal", "hostile"))
          + f" in {2 * args.seconds:g} s of each load")
    print(f"ratio hostile / normal: p50 {result.ratio(0.5):.2f}x, p95 {result.ratio(0.95):.2f}x")
    for kind, counts in sorted(result.hostile.items()):
        print(f"  {kind}: {dict(sorted(counts.items()))}")
    print("server RSS (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in result.rss.items())
          + f"; growth from the end of the first normal phase {result.growth():+.1f}")
    lines = result.stderr.count("\n")
    print(f"server stderr: {lines} lines, {'a' if 'Traceback' in result.stderr else 'no'} traceback")
    failed = (result.ratio() > 2 or result.growth() > args.max_growth_mb
              or any(500 in counts for counts in result.hostile.values()))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
