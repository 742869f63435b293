"""What /translate and /translate_file hand the translator: texts and files as documents (plain text,
HTML, SubRip subtitles), and the translated files kept for /download_file.
"""

from __future__ import annotations

import itertools
import secrets
import time
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass, field

from seq2seq.inference.documents import Document, document_of
from seq2seq.inference.translator import Translator
from seq2seq.serve.bodies import BadRequest, shown
from seq2seq.text.markup import Splitter

FORMATS = {".txt": "text", ".html": "html", ".htm": "html", ".srt": "srt"}  # /translate_file, by extension
MEDIA_TYPES = {"text": "text/plain; charset=utf-8", "html": "text/html; charset=utf-8",
               "srt": "application/x-subrip; charset=utf-8"}


def file_format(filename: str) -> str:
    """The format of an uploaded file, by its extension; a BadRequest naming those accepted."""
    extension = "." + filename.rsplit(".", 1)[-1].lower() if "." in filename else ""
    if extension not in FORMATS:
        raise BadRequest(f"cannot translate {shown(filename)}: send a {', '.join(FORMATS)} file")
    return FORMATS[extension]


def document(text: str, *, format: str, translator: Translator, name: str = "q") -> Document:
    """`text` as a document of `format` (text, html, srt), split into sentences as `translator` reads
    them; a BadRequest naming `name` for markup or subtitles that cannot be read."""
    return _document(text, format=format, split=translator.sentence_spans, name=name)


def visible_text(text: str, *, format: str, name: str = "q") -> str:
    """What a reader sees of `text` (for language detection and the character limit): HTML without its
    markup, subtitles without their numbers and timings."""
    if format == "text":
        return text
    return " ".join(_document(text, format=format, split=lambda t: [(0, len(t))] if t.strip() else [],
                              name=name).sentences)


def _document(text: str, *, format: str, split: Splitter, name: str) -> Document:
    try:
        return document_of(text, format=format, split=split)
    except ValueError as error:
        raise BadRequest(f"{name}: {error}") from None


@dataclass
class Stored:
    filename: str
    content: bytes
    media_type: str
    expires: float
    client: str


class StoreFull(Exception):
    """The translated files kept for download fill the store, or the client's share of it (a 503, with when to
    retry): nothing unexpired is dropped to make room."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class FileStore:
    """Translated files until they are downloaded (LibreTranslate answers /translate_file with a link): in
    memory, each for `keep` seconds. A file is charged its bytes when it is stored, whatever its text cost
    (a page of markup without text is free of --char-limit, not of memory): the store holds at most
    `max_bytes`, and one client (its address) at most `share` of that; a file that does not fit is refused
    (StoreFull), never made room for by dropping another client's file before it expires. The 404 of a file
    gone says whether it expired or was never made."""

    max_bytes: int = 64 << 20
    keep: float = 3600.0
    share: float = 0.25
    files: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    expired: OrderedDict[str, None] = field(default_factory=OrderedDict)  # the last tokens that expired
    used: int = 0

    def check_room(self, size: int, *, client: str) -> None:
        """StoreFull (or a BadRequest for a file no client may keep) unless `size` bytes more fit: asked before
        a file is translated (with the upload's size), and again when it is stored (with the translation's)."""
        self.expire()
        mine = sum(len(s.content) for s in self.files.values() if s.client == client)
        allowed = int(self.max_bytes * self.share)
        if size > allowed:
            raise BadRequest(f"the file has {size} bytes, more than this server keeps for a client ({allowed}); "
                             "split the file")
        if mine + size > allowed:
            raise StoreFull(f"you hold {mine} bytes of translated files not yet expired, and this one's {size} would "
                            f"pass this server's {allowed} a client; retry in {self._wait(client):.0f} s, when your "
                            "oldest expires", retry_after=self._wait(client))
        if self.used + size > self.max_bytes:
            raise StoreFull(f"this server holds {self.used} bytes of translated files not yet expired, and this "
                            f"one's {size} would pass its limit of {self.max_bytes} (--max-stored-bytes); retry in "
                            f"{self._wait(None):.0f} s, when the oldest expires", retry_after=self._wait(None))

    def put(self, filename: str, text: str, *, format: str, client: str = "") -> str:
        """Keep a translated file; its name in /download_file/<name> (the token, then the file's own name
        without any folders). StoreFull if it does not fit (check_room)."""
        content = text.encode("utf-8")
        self.check_room(len(content), client=client)
        filename = filename.replace("\\", "/").rsplit("/", 1)[-1] or "file"
        token = secrets.token_urlsafe(16)
        self.files[token] = Stored(filename, content, MEDIA_TYPES[format], time.monotonic() + self.keep, client)
        self.used += len(content)
        return f"{token}.{urllib.parse.quote(filename, safe='')}"  # a basename: no "/" for the route to trip on

    def _wait(self, client: str | None) -> float:
        """Seconds until the oldest file (of `client`, or of anyone) expires."""
        first = next((s for s in self.files.values() if client is None or s.client == client), None)
        return max(1.0, first.expires - time.monotonic()) if first is not None else 1.0

    def get(self, name: str) -> Stored | None:
        self.expire()
        return self.files.get(name.split(".", 1)[0])

    def gone(self, name: str) -> str:
        """Why `name` is not here, in the 404's words."""
        if name.split(".", 1)[0] in self.expired:
            return f"that file expired ({self.keep:.0f} s after it was translated); translate it again"
        return "no such file: it was never made here (or expired long ago); translate it again"

    def expire(self) -> None:
        now = time.monotonic()
        for token in list(itertools.takewhile(lambda t: self.files[t].expires < now, self.files)):
            self.used -= len(self.files.pop(token).content)
            self.expired[token] = None
        while len(self.expired) > 10_000:
            self.expired.popitem(last=False)


def content_disposition(filename: str) -> str:
    """An attachment header for `filename` whatever it holds (quotes, newlines, non-ASCII): RFC 6266's
    filename* with an ASCII fallback."""
    fallback = "".join(c if c.isascii() and c.isprintable() and c not in '"\\;' else "_" for c in filename) or "file"
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{urllib.parse.quote(filename, safe='')}"
