"""What the faces' output tests share (seq2seq/textio.py's check_output is one policy for every face)."""

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest


def refused(main: Callable[[list[str]], None], *args: str) -> str:
    """The one `error:` line a face's main() exits with (no traceback, no errno)."""
    with pytest.raises(SystemExit) as caught:
        main(list(args))
    message = str(caught.value.code)
    assert message.startswith("error: ") and "\n" not in message and "Errno" not in message, message
    return message


def read_while(fifo: Path, write: Callable[[], None]) -> list[str]:
    """What a reader of the FIFO gets while `write` runs (a pipe to another program): [its text], [] if `write`
    never opened the FIFO (the reader is then let go)."""
    got: list[str] = []

    def read() -> None:
        with open(fifo, encoding="utf-8") as reader:  # waits for the writer, then reads to its close
            got.append(reader.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        write()
        reader.join(timeout=60)
    finally:
        if reader.is_alive():
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    return got
