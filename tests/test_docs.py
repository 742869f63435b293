"""The documentation, checked against the code it describes: every command a `bash` block of README.md or docs/
shows is parsed by that command's own parser, the Python a page marks as runnable runs, every `docs/...#anchor`
the source and the README cite exists, and what the README and the code may not hold (commit hashes, README titles
cited from code) is not there. `make docs` (mkdocs build --strict) checks the links between the pages themselves."""

import argparse
import importlib
import os
import re
import shlex
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import test_layout as layout

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = sorted([REPO / "README.md", *DOCS.rglob("*.md")])
RUNS = "<!-- runs in tests/test_docs.py -->"  # the line above a ```python block that this file runs
FENCE = re.compile(r"^(\s*)```(\w*)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the fence's line, 1-based
    language: str
    text: str
    runs: bool

    def where(self, offset: int = 0) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line + 1 + offset}"


def blocks(page: Path) -> Iterator[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    number = 0
    while number < len(lines):
        opening = FENCE.match(lines[number])
        if opening is None:
            number += 1
            continue
        end = number + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        runs = number > 0 and lines[number - 1].strip() == RUNS
        indent = len(opening.group(1))
        text = "\n".join(line[indent:] for line in lines[number + 1:end])
        yield Block(page, number + 1, opening.group(2), text, runs)
        number = end + 1


def face_name(module: str) -> str:
    """The name a user types for a face: `python -m seq2seq.<name>`, `seq2seq-<name>` (the server's is `serve`)."""
    return module.removeprefix("seq2seq.").removesuffix(".server")


# The commands the docs may show (test_layout's faces), by name; the clone's scripts, by path, and their faces.
FACES = {face_name(module): module for module in layout.FACES}
SCRIPTS = {f"{script.replace('.', '/')}.py": face_name(face) for script, face in layout.SCRIPTS.items()
           if script.startswith("serve.")}
SHELL_ENDS = ("|", ">", "<", "&", ";", "2>")


@dataclass(frozen=True)
class Command:
    where: str
    face: str
    argv: list[str]
    makes: tuple[str, ...] = ()  # the block's shell lines that write a --config it reads (`sed ... > x.yaml`)


def commands() -> list[Command]:
    """Every command of ours in a bash block, continuation lines joined, cut where the shell takes over."""
    found = []
    for page in PAGES:
        for block in blocks(page):
            if block.language not in ("bash", "sh", "shell"):
                continue
            joined = block.text.replace("\\\n", " ")
            writers = {target: line for line in joined.splitlines() if (target := written(line))}
            for offset, line in enumerate(joined.splitlines()):
                for part in re.split(r"\s(?:&&|\|\||;)\s", line):
                    words = shlex.split(part, comments=True)
                    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value before it
                        words = words[1:]
                    face, argv = face_of(words)
                    if face is None:
                        continue
                    cut = next((i for i, word in enumerate(argv) if word.startswith(SHELL_ENDS)), len(argv))
                    configs = [argv[i + 1] for i in range(cut - 1) if argv[i] == "--config"]
                    makes = tuple(writers[name] for name in configs if name in writers)
                    found.append(Command(block.where(offset), face, argv[:cut], makes))
    return found


def written(line: str) -> str | None:
    """The file a shell line writes with `>` at its end, if it does."""
    words = shlex.split(line, comments=True)
    return words[-1] if len(words) >= 3 and words[-2] == ">" else None


def face_of(words: list[str]) -> tuple[str | None, list[str]]:
    if len(words) >= 3 and words[0].endswith(("python", "python3")) and words[1] == "-m" \
            and words[2].startswith("seq2seq."):
        name = words[2].removeprefix("seq2seq.")
        return (name if name in FACES else f"unknown module seq2seq.{name}"), words[3:]
    if words and words[0].startswith("seq2seq-"):
        name = words[0].removeprefix("seq2seq-")
        return (name if name in FACES else f"unknown script {words[0]}"), words[1:]
    if len(words) >= 2 and words[0].endswith(("python", "python3")) and words[1] in SCRIPTS:
        return SCRIPTS[words[1]], words[2:]
    return None, words


class Parsed(Exception):
    """Raised where a command would start work: its arguments are parsed by then."""


def test_the_docs_show_commands_of_every_kind():
    faces = {command.face for command in commands()}
    assert {"fit", "translate", "serve", "export", "convert", "score"} <= faces, faces


@pytest.mark.parametrize("command", commands(), ids=lambda command: command.where)
def test_every_command_the_docs_show_parses(command: Command, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str], tmp_path: Path):
    assert command.face in FACES, f"{command.where}: {command.face}"
    before = set(os.environ)
    module = importlib.import_module(FACES[command.face])
    for key in set(os.environ) - before:  # seq2seq.fit sets GOMP_SPINCOUNT on import: not for the tests after
        del os.environ[key]
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [command.face])  # pytest's own arguments are not the command's
    if command.face == "fit":
        from seq2seq.training.fit import TranslationCLI

        def stop(self) -> None:
            raise Parsed

        monkeypatch.setattr(TranslationCLI, "before_instantiate_classes", stop)
        monkeypatch.chdir(REPO)  # the configs' paths are the repository's
    if command.makes:  # the files the block makes first, made as it makes them, beside the repository's configs
        work = tmp_path / "work"
        work.mkdir()
        (work / "configs").symlink_to(REPO / "configs")
        for line in command.makes:
            subprocess.run(["bash", "-c", line], cwd=work, check=True)
        monkeypatch.chdir(work)
    try:
        module.main(command.argv)
    except Parsed:
        return
    except SystemExit as exit:
        message = capsys.readouterr().err.strip().splitlines()
        assert exit.code in (0, None), f"{command.where}: {' '.join(command.argv)}\n" + "\n".join(message[-3:])
        return
    pytest.fail(f"{command.where}: the command ran past its parsing")


def runnable_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page) if block.runs]


def test_the_docs_mark_python_to_run():
    assert runnable_blocks()


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda block: block.where())
def test_every_python_block_marked_to_run_runs(block: Block):
    assert block.language == "python", f"{block.where()}: {RUNS} marks a ```python block"
    exec(compile(block.text, block.where(), "exec"), {"__name__": "docs"})


def slug(heading: str) -> str:
    """The id MkDocs' toc extension gives a heading without an explicit `{ #id }`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[`*_]", "", text).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[-\s]+", "-", text).strip("-")


def anchors(page: Path) -> set[str]:
    found = set()
    for block_free in strip_blocks(page.read_text(encoding="utf-8")).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*$", block_free)
        if heading:
            explicit = re.search(r"\{\s*#([\w-]+)[^}]*\}\s*$", heading.group(1))
            found.add(explicit.group(1) if explicit else slug(heading.group(1)))
        found.update(re.findall(r"""\bid=["']([\w-]+)["']""", block_free))
        found.update(re.findall(r"\{\s*#([\w-]+)[^}]*\}", block_free))
    return found


def strip_blocks(text: str) -> str:
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)


CITED = re.compile(r"\bdocs/([\w./-]+\.md)(?:#([\w-]+))?")


def citing_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "Makefile", REPO / "pyproject.toml",
             REPO / "mkdocs.yml"]
    for folder in ("seq2seq", "serve", "bench", "configs", "tests", ".ci"):
        files += [path for path in (REPO / folder).rglob("*") if path.is_file() and path.suffix in
                  (".py", ".yaml", ".cpp", ".md", "") and "__pycache__" not in path.parts]
    return [path for path in files if path.exists()]


def test_every_docs_anchor_the_repository_cites_exists():
    missing, cited = [], 0
    for path in citing_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            for page, anchor in CITED.findall(line):
                if page.startswith("img/") or path == Path(__file__):
                    continue
                cited += 1
                target = DOCS / page
                if not target.is_file():
                    missing.append(f"{path.relative_to(REPO)}:{number}: docs/{page} does not exist")
                elif anchor and anchor not in anchors(target):
                    missing.append(f"{path.relative_to(REPO)}:{number}: docs/{page} has no #{anchor}")
    assert cited > 20
    assert not missing, "\n".join(missing)


def test_anchors_are_read_as_mkdocs_makes_them():
    assert slug("Target prefixes (autocompletion)") == "target-prefixes-autocompletion"
    assert slug("The `--compile` flag") == "the-compile-flag"
    page = DOCS / "architecture.md"
    assert {"floors", "rules"} <= anchors(page)


def test_the_readme_is_short_and_says_what_is():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 350
    hashes = re.findall(r"`[0-9a-f]{7,40}`", readme)
    assert not hashes, f"README.md names commits {hashes}: history goes to CHANGELOG.md"


def comments_and_docstrings(path: Path) -> Iterator[tuple[int, str]]:
    with path.open("rb") as file:
        tokens = list(tokenize.tokenize(file.readline))
    for token in tokens:
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and token.string.lstrip("rbuRBU")
                                                .startswith(('"""', "'''"))):
            for offset, line in enumerate(token.string.splitlines()):
                yield token.start[0] + offset, line


def source_files() -> list[Path]:
    return sorted([*(REPO / "seq2seq").rglob("*.py"), *(REPO / "serve").glob("*.py")])


def test_the_code_cites_pages_never_readme_titles():
    cited = [f"{path.relative_to(REPO)}:{number}: {line.strip()}" for path in source_files()
             for number, line in comments_and_docstrings(path) if re.search(r"README(?!\.md)", line)]
    assert not cited, "cite docs/<page>.md#<anchor> instead:\n" + "\n".join(cited)


# What a figure measured on one machine looks like: a speed, a timing, a ratio. Those live on docs/results/.
FIGURE = re.compile(r"\btok(?:ens)?/s\b|\b\d+(?:\.\d+)?\s?(?:ms|µs|us|ns)\b|\b\d+\.\d+\s?[x×](?!\w)|"
                    r"\b\d+(?:\.\d+)?×")


def test_no_comment_or_docstring_gives_a_speed_figure():
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}" for path in source_files()
             for number, line in comments_and_docstrings(path) if FIGURE.search(line)]
    assert not found, "numbers measured on a machine go to a docs/results/ page:\n" + "\n".join(found)


def test_the_search_options_table_has_every_searchconfig_field_with_its_flags_and_default():
    """docs/translation.md#search-options against SearchConfig and the flags cli.py makes from it."""
    from dataclasses import fields

    from seq2seq.cli import search_flags
    from seq2seq.decoding.config import SearchConfig

    text = (DOCS / "translation.md").read_text(encoding="utf-8")
    rows = {match[1]: match for match in re.finditer(r"^\| `(\w+)` \| ([^|]*) \| ([^|]*) \|", text, re.M)}
    problems = []
    for field in fields(SearchConfig):
        row = rows.get(field.name)
        if row is None:
            problems.append(f"no row for {field.name}: add | `{field.name}` | flags | {field.default} | ... |")
            continue
        shown = set(re.findall(r"`(--[\w-]+)`", row[2]))
        if shown != set(search_flags()[field.name]):
            problems.append(f"{field.name}: the row gives {sorted(shown)}, the parser {search_flags()[field.name]}")
        default = row[3].strip()
        if isinstance(field.default, bool):
            expected = "on" if field.default else "off"
        else:
            expected = "none" if field.default is None else str(field.default)
        if expected != default:
            problems.append(f"{field.name}: the row's default is {default!r}, SearchConfig's {expected!r}")
    assert not problems, "docs/translation.md#search-options and SearchConfig disagree:\n" + "\n".join(problems)


def test_the_figures_are_made_from_the_results_data(tmp_path: Path):
    pytest.importorskip("matplotlib")  # the docs extra
    result = subprocess.run([sys.executable, str(DOCS / "figures.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for name in ("multi30k-curves.png", "decode-speed.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG"), name
        assert (DOCS / "img" / name).is_file(), f"docs/img/{name}: run python docs/figures.py and commit it"
