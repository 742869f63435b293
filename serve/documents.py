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

from seq2seq.markup import Splitter
from seq2seq.translator import Document, Translator, document_of

from bodies import BadRequest, shown

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


@dataclass
class FileStore:
    """Translated files until they are downloaded (LibreTranslate answers /translate_file with a link):
    in memory, each for `keep` seconds, the oldest dropped first when they hold more than `max_bytes`."""

    max_bytes: int = 64 << 20
    keep: float = 3600.0
    files: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def put(self, filename: str, text: str, *, format: str) -> str:
        """Keep a translated file; its name in /download_file/<name> (the token, then the file's own name
        without any folders)."""
        self.expire()
        filename = filename.replace("\\", "/").rsplit("/", 1)[-1] or "file"
        content = text.encode("utf-8")
        token = secrets.token_urlsafe(16)
        self.files[token] = Stored(filename, content, MEDIA_TYPES[format], time.monotonic() + self.keep)
        while sum(len(s.content) for s in self.files.values()) > self.max_bytes and len(self.files) > 1:
            self.files.popitem(last=False)
        return f"{token}.{urllib.parse.quote(filename, safe='')}"  # a basename: no "/" for the route to trip on

    def get(self, name: str) -> Stored | None:
        self.expire()
        return self.files.get(name.split(".", 1)[0])

    def expire(self) -> None:
        now = time.monotonic()
        for token in list(itertools.takewhile(lambda t: self.files[t].expires < now, self.files)):
            del self.files[token]


def content_disposition(filename: str) -> str:
    """An attachment header for `filename` whatever it holds (quotes, newlines, non-ASCII): RFC 6266's
    filename* with an ASCII fallback."""
    fallback = "".join(c if c.isascii() and c.isprintable() and c not in '"\\;' else "_" for c in filename) or "file"
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{urllib.parse.quote(filename, safe='')}"
