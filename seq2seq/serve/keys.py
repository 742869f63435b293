"""`python -m seq2seq.serve keys`: the server's API keys (seq2seq/serve/access.py keeps them).

    python -m seq2seq.serve keys --db keys.db add --req-limit 60 --char-limit 100000 --note "team A"
    python -m seq2seq.serve keys --db keys.db list
    python -m seq2seq.serve keys --db keys.db remove 3f9c01ab
    python -m seq2seq.serve --checkpoint best.ckpt --api-keys keys.db     # every request needs one of its keys

`add` prints the new key once (only its SHA-256 is stored: a key that is lost is removed and added again); `list`
shows each key's id, limits and note, never a key.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from seq2seq.serve.access import PREFIX, AccessError, KeyStore, connect, parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m seq2seq.serve keys", description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, required=True,
                        help="the key database (SQLite; `add` creates it), the server's --api-keys file")
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="make a key and print it (once)")
    add.add_argument("--req-limit", type=int, default=None,
                     help="requests a minute this key may make (default: the server's --req-limit)")
    add.add_argument("--char-limit", type=int, default=None,
                     help="characters a day this key may translate (default: the server's --daily-char-limit)")
    add.add_argument("--note", default="", help="who or what the key is for, shown by list")
    commands.add_parser("list", help="the keys' ids, limits and notes (never a key)")
    remove = commands.add_parser("remove", help="remove a key, by its id (or the key itself)")
    remove.add_argument("id")
    return parser


def limit(value: int | None) -> str:
    return "server's" if value is None else str(value)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        store = KeyStore(connect(args.db, create=args.command == "add", write=args.command != "list"))
        if args.command == "add":
            key, row = store.add(req_limit=args.req_limit, char_limit=args.char_limit, note=args.note)
            print(key)
            print(f"added key {row.id} to {args.db} ({limit(row.req_limit)} requests a minute, "
                  f"{limit(row.char_limit)} characters a day); it is shown only now", file=sys.stderr)
        elif args.command == "list":
            rows = store.list()
            print(f"{'id':<10} {'req/min':>8} {'chars/day':>10}  {'created (UTC)':<19}  note")
            for row in rows:
                created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(row.created))
                print(f"{row.id:<10} {limit(row.req_limit):>8} {limit(row.char_limit):>10}  {created:<19}  {row.note}")
        else:
            id = parse(args.id)[0] if args.id.startswith(PREFIX) else args.id  # a whole key is not echoed
            if not store.remove(id):
                parser.exit(1, f"error: {args.db} has no key {id!r} (python -m seq2seq.serve keys --db {args.db} list)\n")
            print(f"removed key {id} from {args.db}", file=sys.stderr)
    except (AccessError, ValueError) as error:
        parser.exit(2, f"error: {error}\n")
