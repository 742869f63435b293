"""What the server's tests share: sentences the demo model translates, and a real server on loopback (in a thread
of this process, `Running`, or a process of its own, `start_process`)."""

import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from seq2seq.serve.guards import uvicorn_config

SENTENCES = ["A dog runs across the meadow .", "Two men play football in the park .", "A woman reads a book .",
             "The children sing .", "A man rides a bike in the city while it rains .", "People stand outside ."]


class Running:
    """A uvicorn server in a thread of this process, on a free loopback port; `options` for uvicorn_config."""

    def __init__(self, app, **options):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, log_level="warning", **options))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_process(command: list[str], checkpoint: Path, *flags: str, timeout: float = 60,
                  **popen: Any) -> tuple[subprocess.Popen, str, int]:
    """`command` (the server's, as a user starts it) on `checkpoint` in a process of its own, on a free loopback
    port (fp32, one thread), once its /health answers: the process, its URL and its port. One that exits or does
    not answer within `timeout` seconds is killed, and the test fails."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([*command, "--checkpoint", str(checkpoint), "--port", str(port), "--precision", "fp32",
                                "--threads", "1", *flags], **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url, port
        except httpx.TransportError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise AssertionError("the server did not start") from None
            time.sleep(0.1)
