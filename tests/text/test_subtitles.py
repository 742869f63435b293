"""seq2seq/text/subtitles.py and the document formats of python -m seq2seq.translate (--format, by extension):
SubRip files keep their numbers, timings and line counts; HTML files their markup."""

import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import srt
from bs4 import BeautifulSoup

from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.documents import Translation
from seq2seq.inference.translator import Translator
from seq2seq.text.sentences import sentence_spans
from seq2seq.text.subtitles import SHOWN, SrtDocument, wrap

SUBTITLES = """1
00:00:01,000 --> 00:00:03,500
A man in a blue shirt
is climbing a rock wall.

2
00:00:04,000 --> 00:00:06,000 X1:100 X2:200 Y1:10 Y2:20
<i>Two dogs play.</i> A child watches.

3
01:02:03,004 --> 01:02:05,006
People stand outside.
Two men play football.
A woman reads.

"""


def split(text: str) -> list[tuple[int, int]]:
    return sentence_spans(text, language="en")


def said(text: str, alignment: list[tuple[int, int]] | None = None) -> Translation:
    return Translation(text=text, score=0.0, tokens=[], alignment=alignment)


def test_the_identity_translation_gives_the_file_back_with_its_lines_rebalanced():
    document = SrtDocument(SUBTITLES, split=split)
    assert document.sentences == ["A man in a blue shirt is climbing a rock wall.", "Two dogs play.", "A child watches.",
                                  "People stand outside.", "Two men play football.", "A woman reads."]
    out = document.render([said(s, [(i, i) for i in range(len(s.split()))]) for s in document.sentences])
    before, after = list(srt.parse(SUBTITLES)), list(srt.parse(out))
    assert [(c.index, c.start, c.end, c.proprietary) for c in after] == [
        (c.index, c.start, c.end, c.proprietary) for c in before]
    assert [len(c.content.split("\n")) for c in after] == [2, 1, 3]  # as many lines as each cue had
    assert [" ".join(c.content.split()) for c in after] == [" ".join(c.content.split()) for c in before]
    assert after[1].content == "<i>Two dogs play.</i> A child watches."  # the cue's tag carried by alignment


def test_a_translation_is_broken_into_even_lines_at_spaces_outside_tags():
    assert wrap("one two three four", lines=2) == "one two\nthree four"
    assert wrap("a verylongword b", lines=2) in ("a verylongword\nb", "a\nverylongword b")
    assert wrap("single", lines=3) == "single"
    assert wrap("x y", lines=3) == "x\ny"
    assert wrap('<font color="red">one two</font> three four', lines=2) == '<font color="red">one two</font>\nthree four'
    for n in range(1, 6):
        text = " ".join(f"w{i}" for i in range(9))
        lines = wrap(text, lines=n).split("\n")
        assert len(lines) == n and " ".join(lines) == text
        assert max(map(len, lines)) - min(map(len, lines)) <= 6


@pytest.mark.parametrize("text, line", [("garbage\n\nmore\n", 1), (SUBTITLES + "4\n00:00:0x --> 1\nA.\n", 16),
                                         ("\n\n1\nA dog without a timing.\n", 3)])
def test_what_is_not_subrip_is_an_error_naming_its_line(text: str, line: int):
    with pytest.raises(ValueError, match=rf"^line {line} is not an SRT cue"):
        SrtDocument(text, split=split)


def test_the_cli_translates_subtitles_and_pages_by_extension(trained: Path, translator: Translator, tmp_path: Path):
    search = SearchConfig(beam_size=2)
    (tmp_path / "in.srt").write_text(SUBTITLES, encoding="utf-8")
    page = "<html><head><title>A dog.</title></head><body><p>A <b>big</b> dog runs. Two men play.</p></body></html>\n"
    (tmp_path / "in.html").write_text(page, encoding="utf-8")
    (tmp_path / "in.txt").write_text("A dog runs. Two men play.\n", encoding="utf-8")
    for name in ("in.srt", "in.html"):
        done = subprocess.run([sys.executable, "-m", "seq2seq.translate", "--checkpoint", str(trained), "--input",
                               str(tmp_path / name), "--output", str(tmp_path / f"out-{name}"), "--beam", "2",
                               "--precision", "fp32"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    cues = list(srt.parse((tmp_path / "out-in.srt").read_text(encoding="utf-8")))
    alone = translator.translate(SrtDocument(SUBTITLES, split=split).sentences, search)
    assert [" ".join(c.content.split()) for c in cues] == [alone[0], f"<i>{alone[1]}</i> {alone[2]}" if
                                                           BeautifulSoup(cues[1].content, "html.parser").i else "",
                                                           " ".join(alone[3:])]
    assert (tmp_path / "out-in.html").read_text(encoding="utf-8") == translator.translate_html([page], search)[0]
    refused = subprocess.run([sys.executable, "-m", "seq2seq.translate", "--checkpoint", str(trained), "--input",
                              str(tmp_path / "in.html"), "--nbest", "2"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--nbest is for --format lines" in refused.stderr
    bad = tmp_path / "bad.srt"
    bad.write_bytes(b"1\n00:00:01,000 --> 00:00:02,000\nA \xff dog.\n")
    failed = subprocess.run([sys.executable, "-m", "seq2seq.translate", "--checkpoint", str(trained), "--input",
                             str(bad)], capture_output=True, text=True)
    assert failed.returncode == 1 and failed.stderr.strip() == (
        f"error: {bad} line 3 is not UTF-8 text (byte 0xff); save it as UTF-8")


@pytest.fixture(scope="module")
def translator(trained: Path) -> Translator:
    return Translator.from_checkpoint(trained, precision="fp32")


def test_subtitle_text_is_not_html_and_its_formatting_is_kept():
    text = ("1\r\n00:00:01,000 --> 00:00:02,000\r\n<i>Tom & Jerry</i> say \"hi\".\r\n\r\n"
            "2\r\n00:00:03,000 --> 00:00:04,000\r\nif x<y and y>z then.\r\n\r\n"
            "3\r\n00:00:05,000 --> 00:00:06,000\r\n{\\an8}A man rides.\r\n\r\n"
            "4\r\n00:00:07,000 --> 00:00:08,000\r\n- A dog runs.\r\n- A cat sleeps.\r\n\r\n")
    document = SrtDocument(text, split=split)
    assert document.sentences == ['Tom & Jerry say "hi".', "if x<y and y>z then.", "A man rides.", "A dog runs.",
                                  "A cat sleeps."]
    out = document.render([said(s, [(i, i) for i in range(len(s.split()))]) for s in document.sentences])
    assert out == text  # the identity gives the file back: CRLF, "&" and "<", {\an8}, the dialogue's dashes


PLAYER = re.compile(r"<\s*/?\s*([A-Za-z][A-Za-z0-9_]*)[^>]*>|\{(?:\\|[^{}\\]:)[^}]*\}")  # as VLC reads them


def player_markup(text: str) -> Counter:
    """The tags and overrides a player reads in a file's cues, as VLC reads them (a tag runs to the next ">"):
    those it applies (<i>, <font ...>) or hides (an override; any other tag, when the cue closes it)."""
    seen: Counter = Counter()
    for cue in srt.parse(text):
        tokens = list(PLAYER.finditer(cue.content))
        names = [m.group(1).lower() for m in tokens if m.group(1)]
        for m in tokens:
            if m.group(1) is None or m.group(1).lower() in SHOWN or names.count(m.group(1).lower()) > 1:
                seen[m.group(0)] += 1
    return seen


def test_a_cue_is_read_as_players_read_it_and_its_translation_written_so_that_none_reads_markup_in_it():
    """Players apply <i> and hide closed tags and overrides, and know no entities: "&lt;img ...&gt;" is text, and
    stays these characters (it was written raw, a live <img>); tags players hide mid-cue (<c.yellow>, <span
    style>, {\\i1}) are not read by the model; a translation (or a glossary's target term) saying <b> or {\\an8}
    is written with a word joiner that no player reads as markup."""
    text = ("1\n00:00:01,000 --> 00:00:02,000\n<i>The woman</i> <code>&lt;img src=x onerror=alert(1)&gt;</code>\n\n"
            "2\n00:00:03,000 --> 00:00:04,000\nA <c.yellow>dog</c> runs {\\i1}fast{\\i0} <span style='x'>home</span>.\n\n")
    document = SrtDocument(text, split=split)
    assert document.sentences == ["The woman &lt;img src=x onerror=alert(1)&gt;", "A dog runs fast home."]
    out = document.render([said("Die Frau &lt;img src=x onerror=alert(1)&gt;", [(i, i) for i in range(5)]),
                           said("Ein Hund <b>rennt</b> {\\an8}schnell <img src=x onerror=alert(1)> heim.",
                                [(0, 0), (1, 1), (2, 2), (3, 3), (4, 5)])])
    assert player_markup(out) == player_markup(text)
    cues = list(srt.parse(out))
    assert cues[0].content == "<i>Die Frau</i> <code>&lt;img src=x onerror=alert(1)&gt;</code>"
    for kept in ("<\u2060b>rennt<\u2060/b>", "{\u2060\\an8}", "<\u2060img", "<c.yellow>Hund</c>", "{\\i1}", "{\\i0}",
                 "<span style='x'>"):
        assert cues[1].content.count(kept) == 1, (kept, cues[1].content)


def test_random_cues_and_hostile_translations_give_players_no_markup_the_cue_lacked():
    rnd = random.Random(10)
    pieces = ["<i>", "</i>", "<b>", "</b>", "<font color=red>", "</font>", "<c.x>", "</c>", "{\\an8}", "{y:i}", "<",
              ">", "&lt;", "&amp;", "word", "two words", "A dog runs.", "- ", "{", "}", "</", "<x", "<3"]
    hostile = ["<b>", "</i>", "<script>alert(1)</script>", "{\\an1}", "{y:b}", "<font color=x>", "</font>", "<c.x>",
               "</c>", "<img src=x>", "&lt;b&gt;"]
    for _ in range(500):
        body = "".join(rnd.choice(pieces) for _ in range(rnd.randint(1, 10))).replace("\n", " ").strip() or "x"
        text = f"1\n00:00:01,000 --> 00:00:02,000\n{body}\n\n"
        try:
            document = SrtDocument(text, split=split)
        except ValueError:
            continue  # what srt cannot read as a cue (a body that looks like a timing): said in one line
        translations = [said(" ".join(rnd.choice([*hostile, *s.split()]) for _ in range(rnd.randint(1, 5))),
                             [(rnd.randrange(len(s.split())), rnd.randrange(5)) for _ in range(3)])
                        for s in document.sentences]
        out = document.render(translations)
        assert not player_markup(out) - player_markup(text), (text, out)


@pytest.mark.parametrize("text, line", [
    ("1\n00:00:01,000 --> 00:00:02,000\nHello.\n\nThis is no cue\nmore\n", 5),  # after the last cue
    ("1\n00:00:01,000 --> 00:00:02,000\nHello.\n\nJunk.\n\n2\n00:00:03,000 --> 00:00:04,000\nBye.\n", 5)])
def test_text_after_a_blank_line_that_starts_no_cue_is_an_error_naming_its_line(text: str, line: int):
    with pytest.raises(ValueError, match=rf"^line {line} is not an SRT cue"):
        SrtDocument(text, split=split)


def test_a_cue_without_a_number_gets_the_one_after_the_cue_before():
    text = ("00:00:01,000 --> 00:00:02,000\nHello.\n\n7\n00:00:03,000 --> 00:00:04,000\nBye.\n\n"
            "00:00:05,000 --> 00:00:06,000\nAgain.\n\n")
    document = SrtDocument(text, split=split)
    out = document.render([said(s) for s in document.sentences])
    assert [cue.index for cue in srt.parse(out)] == [1, 7, 8]
