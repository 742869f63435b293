"""Line-oriented text for the faces: UTF-8 lines read with one-line errors that name the file and the
line, and outputs written a whole line at a time (so that an interrupted run or a full disk leaves whole
lines, and says how many); what an output may be is checked before any work by seq2seq/cli.py's
check_output, the policy every face shares. python -m seq2seq.translate and python -m seq2seq.score read
and write through it; it imports nothing of ours.
"""

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

MAX_LINE_BYTES = 1 << 20  # a "line" longer than this is no sentence: a binary file, /dev/zero


def utf8_stdout() -> TextIO:
    """stdout writing UTF-8, as the input is read, whatever the locale's encoding says."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)  # a StringIO put in place of stdout has none
    if reconfigure is not None:
        reconfigure(encoding="utf-8")
    return sys.stdout


BOM = "\ufeff".encode()


class InputError(Exception):
    """Input that cannot be translated; the message names the file (or stdin) and the line."""


def iter_lines(path: str, *, option: str = "--input") -> Iterator[str]:
    """The lines of a UTF-8 file, or of stdin for "-", without their line ends, read as they are needed.

    Streamed, so a huge or endless input (a pipe, /dev/zero) costs no more memory than a window of
    lines, and a line of more than MAX_LINE_BYTES is refused rather than read whole. Lines end at
    "\n" only (a "\r" before it goes too): str.splitlines would also split at U+2028, U+0085, form
    feeds and the like inside a sentence, and the output would then have more lines than the input,
    out of step with the references. Bytes are decoded here, so the input is UTF-8 whatever the locale
    says, and a bad byte is reported with its line. A UTF-8 BOM (which Windows editors write) is not
    part of the first sentence. Raises InputError (a missing file: SystemExit, before anything is read).
    """
    name = "stdin" if path == "-" else path
    stream = open_input(path, option=option)
    with contextlib.nullcontext(stream) if path == "-" else stream:  # stdin stays open
        number = 0
        while True:
            try:
                raw = stream.readline(MAX_LINE_BYTES + 3)  # the text, "\r\n", and one byte to see a longer one
            except OSError as error:
                raise InputError(f"{option}: cannot read {name} after line {number}: {error.strerror}") from None
            if not raw or (number == 0 and raw == BOM):  # a file of nothing but a BOM has no line
                return
            number += 1
            raw = raw.removesuffix(b"\n").removesuffix(b"\r")
            if len(raw) > MAX_LINE_BYTES:
                raise InputError(f"{name} line {number} is longer than {MAX_LINE_BYTES >> 20} MiB: not a text file "
                                 "with one sentence per line")
            try:
                text = (raw.removeprefix(BOM) if number == 1 else raw).decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{name} line {number} is not UTF-8; convert the file to UTF-8") from None
            yield text


def read_lines(path: str, *, option: str = "--input") -> list[str]:
    """All the lines iter_lines gives, or exit with its one-line error."""
    try:
        return list(iter_lines(path, option=option))
    except InputError as error:
        raise SystemExit(f"error: {error}") from None


def open_input(path: str, *, option: str) -> BinaryIO:
    """The file (or stdin for "-") to read bytes from; a missing or unreadable one is one line and an exit."""
    try:
        return stdin_bytes() if path == "-" else open(path, "rb")  # noqa: SIM115  # the caller closes it
    except FileNotFoundError:
        raise SystemExit(f"error: {option} {path} does not exist") from None
    except OSError as error:
        raise SystemExit(f"error: {option}: cannot read {path}: {error.strerror}") from None


def read_text(path: str, *, option: str = "--input", limit: int = 64 << 20) -> str:
    """A whole UTF-8 file (or stdin for "-") as one text, newlines kept (a document: HTML, subtitles);
    InputError naming the line of a byte that is not UTF-8, or a file over `limit` bytes."""
    name = "stdin" if path == "-" else path
    stream = open_input(path, option=option)
    with contextlib.nullcontext(stream) if path == "-" else stream:  # stdin stays open
        data = stream.read(limit + 1)
    if len(data) > limit:
        raise InputError(f"{name} is over {limit >> 20} MiB: too big to translate as one document; split it")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise InputError(f"{name} line {line} is not UTF-8 text (byte {data[error.start]:#04x}); save it as UTF-8") from None


def count_lines(path: str, *, option: str = "--input") -> int | None:
    """How many lines a regular file has, every one checked as it will be read (so that a bad line
    stops the run before anything is translated); None for stdin, a pipe or a device, read only once."""
    if path == "-" or not Path(path).is_file():
        return None
    try:
        return sum(1 for _ in iter_lines(path, option=option))
    except InputError as error:
        raise SystemExit(f"error: {error}") from None


def stdin_bytes() -> BinaryIO:
    if sys.stdin is None:  # started with stdin closed (`<&-`)
        raise SystemExit("error: --input -: stdin is closed; give --input FILE, or pipe the sentences in")
    stdin = getattr(sys.stdin, "buffer", None)  # a StringIO put in place of stdin has none
    return io.BytesIO(sys.stdin.read().encode("utf-8")) if stdin is None else stdin


def check_input_path(path: str, *, option: str) -> None:
    """Exit with one line unless `path` can be read: checked before --output is opened (and emptied)."""
    if path == "-":
        return
    if not os.path.exists(path):
        raise SystemExit(f"error: {option} {path} does not exist")
    if os.path.isdir(path):
        raise SystemExit(f"error: {option} {path} is a folder; give a file")
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        raise SystemExit(f"error: {option}: cannot read {path}: {error.strerror}") from None


class UpToABadLine:
    """The lines before the first one that cannot be read, then the end: those are translated and
    written before the error (kept in `error`) is reported."""

    def __init__(self, lines: Iterator[str]) -> None:
        self.lines = lines
        self.error: InputError | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self.lines
        except InputError as error:
            self.error = error


class Output:
    """Where translations go, whole lines at a time: a file written unbuffered, cut back to its last
    whole line when a write fails (a full disk) or is interrupted, or stdout."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lines = 0  # lines written whole: counted after the write
        if path == "-":
            self.stream: TextIO | None = utf8_stdout()
            self.fd = -1
        else:
            self.stream = None
            regular = not os.path.exists(path) or os.path.isfile(path)  # a FIFO or a device is not truncated
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if regular else 0), 0o666)
            except OSError as error:  # the folder changed since cli.check_output
                raise SystemExit(f"error: --output {path} cannot be written ({error.strerror})") from None
        self.whole = 0  # bytes of whole lines in the file

    def write(self, text: str) -> None:
        """`text`: one input line's output, ending in a newline."""
        if self.stream is not None:
            self.stream.write(text)
            self.stream.flush()  # a reader (or an interrupted run) has every line done
        else:
            data = memoryview(text.encode("utf-8"))
            while data:
                data = data[os.write(self.fd, data):]
            self.whole += len(text.encode("utf-8"))
        self.lines += 1

    def flush(self) -> None:
        """Nothing to do: each write went out whole (stdout is flushed by write)."""

    def cut_to_whole_lines(self) -> None:
        """After a failed or interrupted write: drop the part of a line that got out (not possible on stdout)."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):  # /dev/full and other devices cannot be truncated
                os.ftruncate(self.fd, self.whole)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)  # inside the caller's try: a close that fails (quota, NFS) is a write error too



def where(path: str) -> str:
    return "stdout" if path == "-" else f"--output {path}"
