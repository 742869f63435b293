"""docs/serving.md#limits, the one table of the server's flags and their defaults, against the server's own parser
(seq2seq/serve/server.py's build_parser): a flag added, removed or given another default fails here, naming the
row to add, drop or change. The search flags (one per SearchConfig field) are the translation page's, not rows."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")  # the [serve] extra

from seq2seq.decoding.config import SearchConfig  # noqa: E402
from seq2seq.serve import server  # noqa: E402

PAGE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
START, END = "<!-- limits:start -->", "<!-- limits:end -->"
HEADER = ["flag", "default", "what it limits"]


def table_rows() -> dict[str, tuple[str, int]]:
    """Each row's flag -> (its default cell, its line number), from between the markers."""
    text = PAGE.read_text(encoding="utf-8")
    assert text.count(START) == 1 and text.count(END) == 1, f"{PAGE} must hold {START} ... {END} once"
    first = text[: text.index(START)].count("\n") + 1
    lines = text[text.index(START) + len(START): text.index(END)].splitlines()
    rows: dict[str, tuple[str, int]] = {}
    table = [(first + i, line) for i, line in enumerate(lines) if line.strip().startswith("|")]
    assert table, f"no table between {START} and {END} in {PAGE}"
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for _, line in table]
    assert cells[0] == HEADER, f"{PAGE}:{table[0][0]}: the limits table's columns must be {' | '.join(HEADER)}"
    for (number, _), row in zip(table[2:], cells[2:], strict=True):
        assert len(row) == 3, f"{PAGE}:{number}: a row has 3 cells (a | inside one splits it): {row}"
        flag = re.fullmatch(r"`(--[a-z0-9-]+)`", row[0])
        assert flag, f"{PAGE}:{number}: the first cell is one flag in backticks, got {row[0]!r}"
        assert flag[1] not in rows, f"{PAGE}:{number}: {flag[1]} has two rows"
        rows[flag[1]] = (row[1], number)
    return rows


def server_options() -> dict[str, argparse.Action]:
    """The parser's options but --help and the search group's (one per SearchConfig field), by their long flag."""
    search = {f.name for f in dataclasses.fields(SearchConfig)}
    return {next(s for s in action.option_strings if s.startswith("--")): action
            for action in server.build_parser()._actions
            if action.option_strings and action.dest not in search and not isinstance(action, argparse._HelpAction)}


def expected_cell(action: argparse.Action) -> str:
    """How the default cell shows the parser's default: `required`, `off` for a switch, the value in backticks, or
    for a default of None (worked out at start) words without backticks."""
    if action.required:
        return "required"
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if action.default is None:
        return "what is chosen, in words (no backticks)"
    value = action.default
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def shows_default(cell: str, action: argparse.Action) -> bool:
    if action.required:
        return cell == "required"
    if isinstance(action, argparse._StoreTrueAction):
        return cell == "off"
    if action.default is None:
        return bool(cell) and "`" not in cell
    literal = re.match(r"`([^`]+)`", cell)
    kind = action.type if callable(action.type) else str
    try:
        return literal is not None and kind(literal[1]) == action.default
    except ValueError:
        return False


def test_the_limits_table_lists_every_server_flag_with_its_default() -> None:
    rows, options = table_rows(), server_options()
    problems = []
    for flag, action in options.items():
        if flag not in rows:
            help_text = (action.help or "").replace("|", "/")
            problems.append(f"no row for {flag}: add `| `{flag}` | {expected_cell(action)} | {help_text} |`")
        elif not shows_default(rows[flag][0], action):
            problems.append(f"{PAGE.name}:{rows[flag][1]}: {flag}'s default cell is {rows[flag][0]!r}; the parser's "
                            f"default is {action.default!r}: write {expected_cell(action)}")
    for flag, (_, number) in rows.items():
        if flag not in options:
            problems.append(f"{PAGE.name}:{number}: {flag} is no flag of python -m seq2seq.serve: remove its row")
    assert not problems, ("docs/serving.md#limits (between the limits markers) and seq2seq/serve/server.py's "
                          "build_parser disagree:\n" + "\n".join(problems))


def test_the_limits_are_written_once() -> None:
    """The table is the page's alone: the server's docstring points to it rather than listing the flags and their
    defaults again (a usage line may show a value)."""
    doc = server.__doc__ or ""
    for flag, action in server_options().items():
        if action.default not in (None, False):
            shown = f"{action.default:g}" if isinstance(action.default, float) else str(action.default)
            assert not re.search(rf"(?m)^\s*{re.escape(flag)}\s+{re.escape(shown)}\b", doc), (  # a table's row
                f"server.py's docstring gives {flag}'s default again: point to docs/serving.md#limits instead")
    assert "docs/serving.md#limits" in doc
    assert server.build_parser().description == doc.split("\n\n")[0]
