"""seq2seq/text/sentences.py and the paragraph faces: real paragraphs (Multi30k sentences joined with varied
whitespace) split, translated and put back with exactly the input's layout."""

import gzip
import random
from pathlib import Path

import pytest
from conftest import DEMO_DATA, MULTI30K

from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.translator import Translator
from seq2seq.text.sentences import model_sentence_spans, rejoin, sentence_spans

SEPARATORS = [" ", "  ", "\n", "\n\n", "\t", " \n "]


def paragraphs(sentences: list[str], n: int, seed: int = 0) -> list[tuple[str, list[str]]]:
    """n texts of 1 to 5 sentences joined by varied whitespace, with whitespace around some; and their sentences."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        chosen = rnd.sample(sentences, rnd.randint(1, 5))
        text = "".join(s + rnd.choice(SEPARATORS) for s in chosen[:-1]) + chosen[-1]
        out.append((rnd.choice(["", " ", "\n"]) + text + rnd.choice(["", " ", "\n\n"]), chosen))
    return out


def ended(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [s.strip() for s in f if s.strip() and s.strip()[-1] in ".!?"]


@pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"Multi30k not found at {MULTI30K}")
@pytest.mark.parametrize("language", ["en", "de", "fr", "cs"])
def test_paragraphs_split_into_their_sentences_and_rejoin_exactly(language: str):
    sentences = ended(MULTI30K / f"test_2016_flickr.{language}.gz")
    exact = 0
    for text, chosen in paragraphs(sentences, 200):
        spans = sentence_spans(text, language=language)
        assert rejoin(text, spans, [text[a:b] for a, b in spans]) == text  # the layout, always
        assert all(text[a:b] == text[a:b].strip() and text[a:b] for a, b in spans)
        exact += [text[a:b] for a, b in spans] == chosen
    assert exact >= 196, f"{exact} of 200 paragraphs split into their sentences"
    assert sentence_spans(" \n\t ", language=language) == []


def test_rejoin_replaces_only_the_sentences():
    text = "  One.\n\nTwo!  Three?\t"
    spans = sentence_spans(text, language="en")
    assert [text[a:b] for a, b in spans] == ["One.", "Two!", "Three?"]
    assert rejoin(text, spans, ["1", "2", "3"]) == "  1\n\n2  3\t"
    with pytest.raises(ValueError, match="3 sentences but 2 translations"):
        rejoin(text, spans, ["1", "2"])


@pytest.fixture(scope="module")
def translator(trained: Path) -> Translator:
    return Translator.from_checkpoint(trained, precision="fp32")


def test_a_paragraph_translates_as_its_sentences_alone(translator: Translator):
    """The demo model (en→de): each paragraph's output is each sentence translated alone, put back with
    the paragraph's own whitespace."""
    sentences = ended(DEMO_DATA / "test.en.gz")[:60]
    search = SearchConfig(beam_size=3)
    alone = dict(zip(sentences, translator.translate(sentences, search), strict=True))
    texts = paragraphs(sentences, 25, seed=1)
    got = translator.translate_paragraphs([text for text, _ in texts] + ["", "  "], search)
    for (text, chosen), output in zip(texts, got[:-2], strict=True):
        spans = sentence_spans(text, language="en")
        assert [text[a:b] for a, b in spans] == chosen
        assert output == rejoin(text, spans, [alone[s] for s in chosen])
    assert got[-2:] == ["", "  "]
    # Tabs and runs of spaces inside a sentence are one space to the model (pysbd ends a segment at a newline)
    first, rest = sentences[0].split(" ", 1)
    [spaced] = translator.translate_paragraphs([f"{first} \t {rest}"], search)
    assert spaced == translator.translate([sentences[0]], search)[0]


def test_the_cli_splits_lines_and_keeps_one_line_per_line(trained: Path, translator: Translator, tmp_path: Path):
    from seq2seq.translate import main

    sentences = ended(DEMO_DATA / "test.en.gz")[:20]
    lines = [" ".join(sentences[i : i + 3]) for i in range(0, 18, 3)] + ["", "\t".join(sentences[18:20])]
    (tmp_path / "in").write_text("\n".join(lines) + "\n", encoding="utf-8")
    main(["--checkpoint", str(trained), "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
          "--split-sentences", "--beam", "3", "--precision", "fp32"])
    out = (tmp_path / "out").read_text(encoding="utf-8").split("\n")
    assert len(out) == len(lines) + 1 and out[-1] == "" and out[6] == ""
    assert out[:-1] == translator.translate_paragraphs(lines, SearchConfig(beam_size=3))
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(trained), "--input", str(tmp_path / "in"), "--split-sentences", "--nbest", "2"])


def test_a_line_longer_than_the_model_reads_is_split_not_truncated(translator: Translator):
    """A run-on line of several hundred tokens without a sentence end: cut at spaces into parts that fit,
    each translated, the spaces between them kept; no part truncated (no warning)."""
    import warnings

    words = " ".join(ended(DEMO_DATA / "test.en.gz")[:40]).replace(".", "").split(" ")
    line = " ".join(words)
    limit = translator.model.config.max_positions
    assert len(translator.tokenizer.encode_source([line])[0]) > 2 * limit
    spans = model_sentence_spans(line, tokenizer=translator.tokenizer, language="en", max_positions=limit)
    assert len(spans) >= 3 and rejoin(line, spans, [line[a:b] for a, b in spans]) == line
    assert all(len(translator.tokenizer.encode_source([line[a:b]])[0]) <= limit for a, b in spans)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a truncation warning would fail here
        [out] = translator.translate_paragraphs([line], SearchConfig(beam_size=2))
    assert out == " ".join(translator.translate([line[a:b] for a, b in spans], SearchConfig(beam_size=2)))


def test_the_cli_keeps_lines_of_spaces_and_names_the_input_line_of_a_word_too_long(trained: Path, tmp_path: Path,
                                                                                     recwarn: pytest.WarningsRecorder):
    """--split-sentences: a line of spaces comes out as it went in (as the server keeps it), and a word too long
    for the model is truncated with a warning naming its input line, not its sentence's number (line 3 here,
    the fourth sentence)."""
    from seq2seq.translate import main

    word = "x" * 3000  # one "word" of far more pieces than the model reads
    lines = ["A dog runs. Two men play.", "   ", f"A cat sleeps. A {word} sits.", "\t"]
    (tmp_path / "in").write_text("\n".join(lines) + "\n", encoding="utf-8")
    main(["--checkpoint", str(trained), "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
          "--split-sentences", "--beam", "1", "--precision", "fp32"])
    out = (tmp_path / "out").read_text(encoding="utf-8").split("\n")
    assert out[1] == "   " and out[3] == "\t" and len(out) == len(lines) + 1
    warned = [str(w.message) for w in recwarn if "max_positions" in str(w.message)]
    assert len(warned) == 1 and warned[0].startswith("input line 3 has "), warned
