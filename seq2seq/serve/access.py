"""Who may translate, and how much: API keys kept hashed in SQLite, and the requests per minute and characters per
day of each key and of each client address, counted in a SQLite file that every server process opening it shares.

A key is `s2s_<id>_<secret>`: the id (public, shown by `keys list`, the row a key is looked up by) and 32 random
bytes. The database keeps the id and the SHA-256 of the whole key, never the key: a leaked database grants nothing.
SHA-256 rather than a slow password hash because the secret is random, not chosen by a person: there is nothing
to guess (256 bits), and every request would otherwise pay for bcrypt's work. The stored digest and the given
key's are compared with hmac.compare_digest, in constant time.

Limits are fixed windows, each minute and each UTC day from its start: a request that would go over its window is
refused (429) with the seconds until the window ends as Retry-After, and is not counted. A request with a key is
counted against the key's limits (its own, or the server's where the key has none); a request without one
against its client address's. Counts live in the `usage` table, changed inside one write transaction per request
(BEGIN IMMEDIATE): server processes behind one proxy, started with the same --api-keys file (or --limits-db),
share every count, as they share the keys. Without a file the counts are this process's alone (SQLite in memory).
flask-limiter's fixed windows (LibreTranslate's) work the same way; Redis is not needed for processes on one host.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PREFIX = "s2s_"
WINDOWS = {"minute": 60, "day": 86_400}  # seconds; a day from 00:00 UTC

SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    id TEXT PRIMARY KEY,        -- the key's public part
    digest BLOB NOT NULL,       -- SHA-256 of the whole key
    req_limit INTEGER,          -- requests per minute; NULL: the server's --req-limit
    char_limit INTEGER,         -- characters per day; NULL: the server's --daily-char-limit
    note TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS usage (
    subject TEXT NOT NULL,      -- key:<id> or address:<client address>
    window TEXT NOT NULL,       -- minute | day
    start INTEGER NOT NULL,     -- the window's first second (Unix time)
    amount INTEGER NOT NULL,    -- requests (minute) or characters (day) counted in it
    PRIMARY KEY (subject, window)
);
"""


class AccessError(Exception):
    """A key database that cannot be used (missing, not ours, read-only): one line, naming the file."""


class Refused(Exception):
    """A request that may not be served: its HTTP status, the message, and for a full window Retry-After."""

    def __init__(self, status: int, message: str, *, retry_after: float | None = None, reason: str = "limit") -> None:
        super().__init__(message)
        self.status, self.retry_after, self.reason = status, retry_after, reason


@dataclass(frozen=True)
class Key:
    """A key's row, without its secret."""

    id: str
    req_limit: int | None
    char_limit: int | None
    note: str
    created: float


@dataclass(frozen=True)
class Limits:
    """The server's limits (--req-limit, --daily-char-limit): for client addresses, and for keys without their own.
    None: no limit."""

    req_limit: int | None = None
    char_limit: int | None = None

    def __post_init__(self) -> None:
        for name in ("req_limit", "char_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{'req-limit' if name == 'req_limit' else 'daily-char-limit'} must be at least 1, "
                                 f"got {value}")


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def connect(path: Path | None, *, create: bool = False, write: bool = True) -> sqlite3.Connection:
    """The database at `path` (None: one in memory), its tables made where `create`; AccessError (one line) for a
    file that is missing, not SQLite, not ours or, where `write`, that cannot be written. A file whose mode has no
    write bit is opened read-only, as its owner meant, even by root (whom the file system would let write)."""
    if path is not None and not create and not path.is_file():
        raise AccessError(f"{path}: no such key database; create it with python -m seq2seq.serve keys --db {path} add")
    try:
        if path is None:
            connection = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        else:
            read_only = path.is_file() and not path.stat().st_mode & 0o222
            connection = sqlite3.connect(f"{path.resolve().as_uri()}{'?mode=ro' if read_only else ''}", uri=True,
                                         timeout=5.0, isolation_level=None, check_same_thread=False)
        connection.execute("PRAGMA busy_timeout = 5000")
        if create or path is None:
            connection.executescript(SCHEMA)
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not {"keys", "usage"} <= tables:
            raise AccessError(f"{path}: not a key database of this server (no keys and usage tables); give the file "
                              "python -m seq2seq.serve keys add made")
        if write:  # a read-only file fails here, at the start, not at the first request (a row written, undone)
            connection.execute("BEGIN IMMEDIATE")
            try:
                connection.execute("INSERT INTO usage VALUES ('', 'minute', 0, 0)")
            finally:
                connection.execute("ROLLBACK")
            if path is not None:
                connection.execute("PRAGMA journal_mode = WAL")  # readers and the writer do not block each other
    except sqlite3.DatabaseError as error:
        raise AccessError(f"{path}: {error}; give a key database this process may {'write' if write else 'read'}") \
            from None
    return connection


class KeyStore:
    """The keys of one database file: added, listed, removed (`keys` command), found by a request's key."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.db = connection

    def add(self, *, req_limit: int | None = None, char_limit: int | None = None, note: str = "") -> tuple[str, Key]:
        """A new key (its secret, shown once, and its row)."""
        for name, value in (("--req-limit", req_limit), ("--char-limit", char_limit)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        id = secrets.token_hex(4)
        key = f"{PREFIX}{id}_{secrets.token_urlsafe(32)}"
        row = Key(id, req_limit, char_limit, note, time.time())
        self.db.execute("INSERT INTO keys VALUES (?, ?, ?, ?, ?, ?)",
                        (row.id, digest(key), row.req_limit, row.char_limit, row.note, row.created))
        return key, row

    def remove(self, id: str) -> bool:
        """Remove the key of `id` (or of a whole key given instead); False if there is none."""
        id = parse(id)[0] if id.startswith(PREFIX) else id
        removed = self.db.execute("DELETE FROM keys WHERE id = ?", (id,)).rowcount > 0
        self.db.execute("DELETE FROM usage WHERE subject = ?", (f"key:{id}",))
        return removed

    def list(self) -> list[Key]:
        return [Key(*row) for row in self.db.execute(
            "SELECT id, req_limit, char_limit, note, created FROM keys ORDER BY created")]

    def find(self, key: str) -> Key | None:
        """The row of `key`, if it is one of these; the digests compared in constant time."""
        id, _ = parse(key)
        row = self.db.execute("SELECT id, digest, req_limit, char_limit, note, created FROM keys WHERE id = ?",
                              (id,)).fetchone()
        stored = row[1] if row is not None else b"\0" * 32  # an unknown id costs the same comparison
        if not hmac.compare_digest(stored, digest(key)) or row is None:
            return None
        return Key(row[0], row[2], row[3], row[4], row[5])


def parse(key: str) -> tuple[str, str]:
    """A key's id and secret ("", "" for a string that is not shaped as our keys)."""
    if not key.startswith(PREFIX) or key.count("_") < 2:
        return "", ""
    id, _, secret = key[len(PREFIX):].partition("_")
    return id, secret


class Gate:
    """What the server asks of each translation request: its key checked (when keys are required) and its
    requests and characters charged to the key or the client address. The database is used from one thread of
    its own (`thread`): a write that waits for another process's never blocks the event loop."""

    def __init__(self, *, keys_path: Path | None = None, limits_path: Path | None = None,
                 limits: Limits = Limits(), clock: Callable[[], float] = time.time) -> None:
        if keys_path is not None and limits_path is not None and keys_path != limits_path:
            raise ValueError("--limits-db is the --api-keys file's when keys are required: give one of them")
        self.keys_required = keys_path is not None
        self.path = keys_path or limits_path
        self.limits, self.clock = limits, clock  # (the windows are UTC minutes and days: wall-clock time)
        self.db = connect(self.path, create=limits_path is not None and keys_path is None)
        self.keys = KeyStore(self.db)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="access")

    @property
    def active(self) -> bool:
        """Whether a request needs the gate at all."""
        return self.keys_required or self.limits.req_limit is not None or self.limits.char_limit is not None

    def admit(self, *, key: str | None, address: str, characters: int) -> str:
        """Check `key` (when keys are required; else a key is not looked at) and charge one request of `characters` to it or to `address`; the subject charged ("key:<id>" or
        "address:<address>"). Refused (401, 403, 429) otherwise. Called in the gate's thread."""
        now, limits = self.clock(), self.limits
        if key is not None and self.keys_required:
            found = self.keys.find(key)
            if found is None:
                raise Refused(403, "the API key is not valid on this server; ask its operator for one", reason="key")
            subject = f"key:{found.id}"
            limits = Limits(req_limit=found.req_limit if found.req_limit is not None else limits.req_limit,
                            char_limit=found.char_limit if found.char_limit is not None else limits.char_limit)
        elif self.keys_required:
            raise Refused(401, "this server requires an API key: send it as api_key in the body or as an "
                               "Authorization: Bearer header", reason="key")
        else:
            subject = f"address:{address}"
        self.charge(subject, characters=characters, limits=limits, now=now)
        return subject

    def charge(self, subject: str, *, characters: int, limits: Limits, now: float) -> None:
        """One request and `characters` counted to `subject` in one write transaction, unless a window is full."""
        if limits.char_limit is not None and characters > limits.char_limit:
            raise Refused(429, f"this request has {characters} characters, more than the {limits.char_limit} a day "
                               "allowed to it; send less text per request")
        wanted = {"minute": (1, limits.req_limit), "day": (characters, limits.char_limit)}
        wanted = {window: w for window, w in wanted.items() if w[1] is not None}
        if not wanted:
            return
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                for window, (amount, limit) in wanted.items():
                    length = WINDOWS[window]
                    start = int(now // length * length)
                    row = self.db.execute("SELECT start, amount FROM usage WHERE subject = ? AND window = ?",
                                          (subject, window)).fetchone()
                    used = row[1] if row is not None and row[0] == start else 0
                    assert limit is not None
                    if used + amount > limit:
                        self.db.execute("ROLLBACK")
                        unit = "requests a minute" if window == "minute" else "characters a day"
                        raise Refused(429, f"over the limit of {limit} {unit} for this "
                                           f"{'key' if subject.startswith('key:') else 'client'}; retry later",
                                      retry_after=max(1, math.ceil(start + length - now)))
                    self.db.execute("INSERT OR REPLACE INTO usage VALUES (?, ?, ?, ?)",
                                    (subject, window, start, used + amount))
                self.db.execute("COMMIT")
            except sqlite3.Error:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise
        except sqlite3.Error as error:  # a file made read-only or locked past busy_timeout since the start
            raise Refused(503, "the server cannot count this request against its limits; retry later",
                          reason="database") from AccessError(f"{self.path}: {error}")
