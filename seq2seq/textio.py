"""Line-oriented text for the faces: UTF-8 lines read with one-line errors that name the file and the
line, and outputs written a whole line at a time (so that an interrupted run or a full disk leaves whole
lines, and says how many); what an output may be is checked before any work by seq2seq/cli.py's
check_output, the policy every face shares. python -m seq2seq.translate and python -m seq2seq.score read
and write through it; it imports nothing of ours.
"""

import contextlib
import io
import os
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
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


class OutputRefused(ValueError):
    """An output a face may not write: one line (no "error: ") naming the option, the path, and what to do."""


def check_output(path: str | Path, *, option: str = "--output", force: bool, replaces: bool,
                 inputs: Iterable[tuple[str, str | Path]] = (), folder: bool = False,
                 example: str = "model.ckpt") -> None:
    """Raise OutputRefused unless a face may write `path`; called before any work (a checkpoint loaded, a model
    converted, a line translated), and it changes nothing at `path`. The policy, for every face:

    - `replaces`: the face writes a new file (a folder, with `folder`) beside `path` and renames it over `path`
      (average, convert, export): a device, FIFO, socket or symbolic link at `path` is refused even with `force`,
      since the rename would replace it (`--output /dev/null` became a regular file), and `-` names no stdout.
      Otherwise the face streams text into `path` (translate, score): `-` is stdout, and a FIFO or a device is
      written into as it is (never truncated, nor opened here: a FIFO would wait for its reader); a file that is
      not text (a checkpoint under another name) is refused even with `force`.
    - An existing regular file that holds anything is refused unless `force` (an empty one has nothing to lose).
    - `folder`: the face writes a folder (export), `path` made absolute and normalised as it writes it (`typo/..`
      is the working folder there): a file there is refused; an existing folder passes, for the face's own rule
      on what it may replace. Without `folder`, a folder at `path` is refused.
    - The folder `path` goes in must exist: no face creates folders.
    - `inputs`, (option, path) pairs (`-`: stdin): the output may be none of them, even with `force`.
    - The folder must take a new file (a folder, with `folder`), tried now; a streaming face's `path` must open
      for appending (which empties nothing).

    `example` names a file to suggest when `path` is a folder (`--output runs/` -> `runs/model.ckpt`).
    """
    shown, kind = str(path), "folder" if folder else "file"
    if not shown:
        raise OutputRefused(f"{option} is empty: name a new {kind}" + ("" if replaces else ", or - for stdout"))
    if shown == "-":
        if replaces:
            raise OutputRefused(f"{option} -: this writes a {kind}, not stdout: name a new {kind}")
        return
    target = Path(os.path.abspath(shown)) if folder else Path(shown)
    for what, other in inputs:
        name = "the input file" if what == "--input" else f"the {what} file"
        if str(other) == "-":
            if _is_stdin(target):
                raise OutputRefused(f"{option} {shown} is {name}, read from stdin: it would be overwritten; write to "
                                    "another file")
        elif same_file(target, Path(other)):
            raise OutputRefused(f"{option} {shown} is {name} {other}: it would be overwritten")
    try:  # the rename faces replace a link itself; the streaming ones write where it leads (/dev/stdout)
        status: os.stat_result | None = os.lstat(target) if replaces else os.stat(target)
    except OSError:  # not there (or not reachable: the folder checks below say why)
        status = None
    if status is not None:
        mode = status.st_mode
        if stat.S_ISLNK(mode):
            raise OutputRefused(f"{option} {shown} is a symbolic link: name the {kind} itself, or a new one")
        if stat.S_ISDIR(mode) and not folder:
            raise OutputRefused(f"{option} {shown} is a folder; name the file to write, e.g. "
                                f"{Path(shown) / example}")
        if not stat.S_ISDIR(mode) and not stat.S_ISREG(mode):
            if replaces:
                raise OutputRefused(f"{option} {shown} is {_special_file(mode)}, not a {kind}: name a new {kind}")
            return  # a FIFO, a terminal, /dev/null: written into as they are, never emptied
        if stat.S_ISREG(mode) and folder:
            raise OutputRefused(f"{option} {shown} is a file, not a folder: name a new folder")
        if stat.S_ISREG(mode) and status.st_size:
            if not replaces and not _looks_like_text(target):
                raise OutputRefused(f"{option} {shown} exists and is not a text file (a checkpoint, an archive?): "
                                    "it would be overwritten; give another path, or delete it first if it is yours "
                                    "to lose")
            if not force:
                raise OutputRefused(f"{option} {shown} exists: name a new {kind}, or pass --force to replace it")
    parent = target.parent
    if not parent.is_dir():
        if parent.exists():
            raise OutputRefused(f"{option} {shown}: {parent} is a file, not a folder")
        raise OutputRefused(f"{option} {shown}: the folder {parent} does not exist; create it first")
    if not replaces:
        existed = os.path.lexists(target)
        try:
            with open(target, "a", encoding="utf-8"):  # "a": an existing file is not emptied by the check
                pass
        except OSError as error:
            raise OutputRefused(f"{option} {shown} cannot be written ({error.strerror})") from None
        if not existed:
            target.unlink()
        return
    try:  # what the face's write makes first: a new file (or folder) beside `path`
        if folder:
            os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".seq2seq-check-"))
        else:
            fd, probe = tempfile.mkstemp(dir=parent, prefix=".seq2seq-check-")
            os.close(fd)
            os.unlink(probe)
    except OSError as error:
        raise OutputRefused(f"{option} {shown}: cannot create a {kind} in {parent} ({error.strerror or error}): "
                            "name a folder you can write to") from None


def same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` name one file (False where either cannot be read)."""
    try:
        return a.samefile(b)  # a hard or symbolic link to an input is that input
    except OSError:
        return False


def _is_stdin(path: Path) -> bool:
    """Whether `path` is the regular file stdin reads: `--output F < F` would empty the input."""
    try:
        a, b = path.stat(), os.fstat(0)
    except (OSError, ValueError):
        return False
    return stat.S_ISREG(a.st_mode) and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _special_file(mode: int) -> str:
    return ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a special file")


def _looks_like_text(path: Path) -> bool:
    """No NUL byte in the first 8 KiB and no zip archive (a torch checkpoint is one): translations are text."""
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
    except OSError:
        return True  # unreadable: the write check that follows says what is wrong
    return b"\0" not in head and not head.startswith(b"PK\x03\x04")


# ---------------------------------------------------------------------------------------------
# Translations as text.
