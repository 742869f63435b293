"""Tests for seq2seq/textio.py's line reading: newlines only, a byte-order mark, a line's byte limit."""

import io
import sys
from pathlib import Path

import pytest

from seq2seq.translate import read_lines


def test_read_lines_drops_a_byte_order_mark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "in.txt"
    path.write_bytes("\ufeffEin Hund.\nZwei.\n".encode())  # what Notepad writes
    assert read_lines(str(path)) == ["Ein Hund.", "Zwei."]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\ufeffEin Hund.\n".encode())))
    assert read_lines("-") == ["Ein Hund."]
    path.write_bytes("Ein\ufeffHund.\n".encode())  # inside a line it is the sentence's (a zero-width space)
    assert read_lines(str(path)) == ["Ein\ufeffHund."]


def test_read_lines_splits_at_newlines_only(tmp_path: Path):
    # str.splitlines would split the first line at U+2028 and U+0085: one more output line than input.
    path = tmp_path / "in.txt"
    path.write_bytes("Ein\u2028Hund\x85.\r\n\nzwei\x0c\n".encode())
    assert read_lines(str(path)) == ["Ein\u2028Hund\x85.", "", "zwei\x0c"]
    path.write_bytes(b"")
    assert read_lines(str(path)) == []
    path.write_bytes(b"no newline at the end")
    assert read_lines(str(path)) == ["no newline at the end"]


def test_lines_of_exactly_the_limit_are_read_and_one_byte_more_is_refused(tmp_path: Path):
    from seq2seq.textio import MAX_LINE_BYTES, InputError, iter_lines

    path = tmp_path / "in.txt"
    path.write_bytes(b"a" * MAX_LINE_BYTES + b"\r\n" + b"b" * MAX_LINE_BYTES + b"\n" + b"c" * MAX_LINE_BYTES)
    assert [len(line) for line in iter_lines(str(path))] == [MAX_LINE_BYTES] * 3
    path.write_bytes(b"ok\n" + b"d" * (MAX_LINE_BYTES + 1) + b"\n")
    with pytest.raises(InputError, match="line 2 is longer than 1 MiB"):
        list(iter_lines(str(path)))
    path.write_bytes("\ufeff".encode())  # a BOM alone is an empty file, not one empty line
    assert read_lines(str(path)) == []
