"""What the server's tests share: sentences the demo model translates, and a real server on loopback."""

import socket
import threading
import time

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
