"""Lexical constraints (seq2seq/decoding/constraints.py, search.constrained_beam_search): the progress functions,
the search against a brute-force constrained search on a table model, and the Translator, CLI and
server faces of constraints and glossaries."""

import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_search import PrefixState, per_row

import seq2seq.text.glossary
from seq2seq.decoding.beam import beam_search
from seq2seq.decoding.config import SearchConfig
from seq2seq.decoding.constraints import Progress, advance, all_met, allocate, met, next_tokens, start
from seq2seq.decoding.search import decode
from seq2seq.inference.translator import Translator
from seq2seq.model import Transformer, TransformerConfig
from seq2seq.text.glossary import Glossary, continues_word
from seq2seq.text.tokenizer import BOS_ID, EOS_ID, PAD_ID

IDS = {"bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID}


def glossary_terms(text: str, glossary: dict[str, str]) -> list[str]:
    """The target terms a glossary forces for `text` (seq2seq/text/glossary.py, tested in test_glossary.py)."""
    return Glossary(glossary).terms_in(text)


# ---- progress over one hypothesis ---------------------------------------------------------------------


def test_progress_places_phrases_in_any_order_and_loses_an_unfinished_one():
    phrases = [[5, 6, 7], [9]]
    p = start(phrases)
    assert next_tokens(p, phrases) == {5, 9} and met(p, phrases) == 0
    p = advance(p, phrases, 5)
    assert p == Progress(done=(False, False), active=0, matched=1) and next_tokens(p, phrases) == {5, 6, 9}
    p = advance(p, phrases, 8)  # left unfinished: its progress is lost
    assert p == Progress(done=(False, False)) and met(p, phrases) == 0
    for token in (9, 5, 6, 7):
        p = advance(p, phrases, token)
    assert all_met(p) and p.just_placed == 0 and met(p, phrases) == 4 and next_tokens(p, phrases) == set()
    assert advance(p, phrases, 8, continues_word=True) == Progress(done=(False, True))  # 7 8: not a whole word
    p = advance(start(phrases), phrases, 5)
    p = advance(p, phrases, 9)
    assert p == Progress(done=(False, True), just_placed=1)  # leaves phrase 0, places phrase 1
    assert advance(p, phrases, 4) == Progress(done=(False, True))  # the next token: no longer "just placed"


def test_allocate_shares_the_beam_among_banks():
    # candidates best first, with their banks (constraint tokens met)
    assert allocate([0, 0, 0, 1, 2], beam_size=3, num_banks=3) == [0, 3, 4]  # one place per bank
    assert allocate([0, 0, 0, 0, 2], beam_size=4, num_banks=3) == [0, 1, 2, 4]  # bank 1 empty: its place goes back
    assert allocate([0, 1, 2, 3], beam_size=2, num_banks=4) == [2, 3]  # fewer places than banks: the fullest
    assert allocate([0, 0], beam_size=5, num_banks=1) == [0, 1]


# ---- the search against brute force --------------------------------------------------------------------


class BigramModel:
    """log P(next | source's first token, the last token) = table[src0][last]; only tokens 4..7 and EOS
    have probability, so a beam of 400 holds every output of up to 4 tokens: beam search is exhaustive."""

    def __init__(self, seed: int, vocab_size: int = 800):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.full((8, 8, vocab_size), -math.inf)
        self.table[:, :, [EOS_ID, 4, 5, 6, 7]] = torch.randn(8, 8, 5, generator=g) * 1.5
        self.table = self.table.log_softmax(-1)
        self.config = SimpleNamespace(max_positions=64, pad_id=PAD_ID, vocab_size=vocab_size)

    def encode(self, src):
        return src.float()[:, :, None]

    def new_state(self):
        return PrefixState()

    def decode(self, tgt_in, memory, src_mask, state=None):
        memory = per_row(memory, src_mask, tgt_in)
        state.grow(tgt_in)
        first = memory[:, 0, 0].long()
        last = state.fed[:, -1].clamp(max=7)  # a dead beam (-inf) may go on with any token: its row is moot
        return self.table[first, last][:, None, :]

    def log_prob(self, src0: int, tokens: list[int]) -> float:
        previous, total = BOS_ID, 0.0
        for token in [*tokens, EOS_ID]:
            total += float(self.table[src0, previous, token])
            previous = token
        return total


def brute_force(model: BigramModel, src0: int, phrases: list[list[int]], max_len: int) -> tuple[list[int], float]:
    """The most likely output of at most max_len tokens that contains every phrase."""
    best: tuple[list[int], float] = ([], -math.inf)
    for length in range(max_len + 1):
        for tokens in itertools.product(range(4, 8), repeat=length):
            tokens = list(tokens)
            if all(any(tokens[i : i + len(p)] == p for i in range(len(tokens))) for p in phrases):
                score = model.log_prob(src0, tokens)
                if score > best[1]:
                    best = (tokens, score)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_an_exhaustive_constrained_beam_finds_the_brute_force_best(seed: int):
    model = BigramModel(seed)
    src = torch.tensor([[4, 4], [5, 4], [6, 4], [7, 4]])
    constraints = [[[6, 6]], [[7], [4]], [], [[5, 4, 5]]]
    search = SearchConfig(beam_size=400, length_penalty=0.0, max_len_a=0.0, max_len_b=4)
    results = decode(model, src, search, constraints=constraints, **IDS)
    for src0, phrases, [best] in zip((4, 5, 6, 7), constraints, results, strict=True):
        tokens, score = brute_force(model, src0, phrases, 4)
        assert best.tokens == tokens and best.log_prob == pytest.approx(score, abs=1e-4)
    unconstrained = beam_search(model, src[2:3], search, **IDS)
    assert unconstrained[0][0].tokens == results[2][0].tokens  # no phrases: the plain search's answer


def random_model() -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=30, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=1,
                               num_decoder_layers=2, dropout=0.0, max_positions=64)
    model = Transformer(config).double().eval()
    with torch.no_grad():
        model.output_projection.weight[EOS_ID].mul_(3)
    return model


@pytest.mark.parametrize("search", [SearchConfig(beam_size=1, max_len_a=0, max_len_b=6),
                                    SearchConfig(beam_size=4, nbest=3, max_len_a=0, max_len_b=6)],
                         ids=["greedy", "beam"])
def test_every_output_holds_its_phrases_and_the_others_are_untouched(search: SearchConfig):
    model = random_model()
    src = torch.randint(4, 30, (4, 6), generator=torch.Generator().manual_seed(1))
    constraints = [[[7, 8], [12]], [], [[20, 21, 22, 23, 24, 25, 26, 27]], [[9, 9, 9]]]  # 8 tokens: max_len grows
    prefix = [[], [], [], [11]]
    results = decode(model, src, search, constraints=constraints, prefix=prefix, **IDS)
    plain = decode(model, src[1:2], search, **IDS)
    assert [h.tokens for h in results[1]] == [h.tokens for h in plain[0]]
    for phrases, pre, hyps in zip(constraints, prefix, results, strict=True):
        # (a beam still short of its phrases at max_len cannot end: fewer than nbest may finish)
        assert 1 <= len(hyps) <= search.nbest
        for h in hyps:
            assert h.tokens[: len(pre)] == pre
            assert all(any(h.tokens[i : i + len(p)] == p for i in range(len(h.tokens))) for p in phrases)
    # A placed phrase ends its word: with every token but 9 continuing a word, 12 is followed by 9 or EOS
    continuing = frozenset(range(30)) - {9, EOS_ID}
    for h in decode(model, src, search, constraints=[[[12]]] * 4, continuing=continuing, **IDS):
        at = h[0].tokens.index(12)
        assert h[0].tokens[at + 1 : at + 2] in ([], [9])
    with pytest.raises(ValueError, match="not sampling"):
        decode(model, src, SearchConfig(sampling=True), constraints=constraints, **IDS)


# ---- Translator, CLI, server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def translator(trained: Path) -> Translator:
    return Translator.from_checkpoint(trained, precision="fp32")


SOURCES = ["The woman does not sell the book.", "A man sees the dog.", "", "The children sing."]


def test_translator_constraints_and_glossary(translator: Translator):
    search = SearchConfig(beam_size=4)
    got = translator.translate_nbest(SOURCES, search, constraints=[["Katze"], [], [], ["nicht", "Lied"]])
    assert "Katze" in got[0][0].text.split() or "Katze" in got[0][0].text and got[0][0].unmet_constraints == []
    assert got[2] == [] and got[3][0].unmet_constraints == []
    assert "nicht" in got[3][0].text and "Lied" in got[3][0].text
    assert got[1][0].text == translator.translate([SOURCES[1]], search)[0] and got[1][0].unmet_constraints == []
    glossary = {"dog": "Pferd", "book": "Zeitung", "og": "never"}  # whole words only: "og" is not in "dog"
    assert glossary_terms(SOURCES[1], glossary) == ["Pferd"]
    via_glossary = translator.translate(SOURCES, search, glossary=glossary)
    assert "Zeitung" in via_glossary[0] and "Pferd" in via_glossary[1] and "never" not in " ".join(via_glossary)
    assert translator.translate_nbest(SOURCES[:1], search)[0][0].unmet_constraints is None


def test_a_phrase_the_model_already_writes_changes_nothing_and_punctuation_may_follow(translator: Translator):
    search = SearchConfig(beam_size=4)
    for source in SOURCES[:2] + SOURCES[3:]:
        plain = translator.translate([source], search)[0]
        for word in (plain.split(" ")[-1].rstrip(".!?"), plain.split(" ")[1]):  # the last word: a period follows it
            [[t]] = translator.translate_nbest([source], search, constraints=[[word]])
            assert t.text == plain and t.unmet_constraints == [], (source, word)


def test_a_phrase_continued_by_a_forced_prefix_is_not_met(translator: Translator):
    """A prefix forces "Buchx": the pieces of "Buch" are there, but not as a word; said, not counted."""
    [[t]] = translator.translate_nbest(SOURCES[:1], SearchConfig(beam_size=4), prefixes=["Die Frau Buchx"],
                                       constraints=[["Buch"]])
    assert t.text.startswith("Die Frau Buchx")
    assert (t.unmet_constraints == []) == any(w.strip(".,") == "Buch" for w in t.text.split(" "))


def test_beam_1_scores_are_greedys_with_or_without_constraints_in_the_batch(translator: Translator):
    search = SearchConfig(beam_size=1)
    alone = translator.translate_nbest(SOURCES, search)
    mixed = translator.translate_nbest(SOURCES, search, constraints=[["Katze"], [], [], []])
    assert [h[0].score for h in mixed[1:] if h] == pytest.approx([h[0].score for h in alone[1:] if h])
    assert mixed[0][0].score == pytest.approx(mixed[0][0].score)


def test_a_phrase_the_search_cannot_place_is_said_not_dropped(translator: Translator):
    """no_repeat_ngram_size 1 forbids any token twice: a phrase of one piece twice cannot be placed."""
    search = SearchConfig(beam_size=4, no_repeat_ngram_size=1)
    piece = translator.tokenizer.encode_target(["Buch"])[0]
    assert len(piece) == 1
    [[t]] = translator.translate_nbest(SOURCES[:1], search, constraints=[["Buch Buch"]])
    assert t.unmet_constraints == ["Buch Buch"] and t.text  # translated without it, and says so


def test_glossaries_are_checked_and_sampling_refused(translator: Translator):
    with pytest.raises(ValueError, match=r"gives 'dog' two target terms \('Hund' and 'Köter'\)"):
        translator.translate(SOURCES[:2], glossary={"dog": "Hund", " dog ": "Köter"})
    with pytest.raises(ValueError, match="empty target term"):
        translator.translate(SOURCES[:2], glossary={"dog": " "})
    with pytest.raises(ValueError, match="need a search .*not sampling"):  # refused before any line, matched or not
        translator.translate(["nothing to match"], SearchConfig(sampling=True), glossary={"dog": "Hund"})
    assert glossary_terms("A (dog).", {"dog": "Hund", "c++": "C++", "og": "x"}) == ["Hund"]


def counting_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each glossary automaton built from now on, as its number of terms (glossary.automaton: the costly step)."""
    built: list[int] = []
    automaton = seq2seq.text.glossary.automaton

    def spy(entries):
        built.append(len(entries))
        return automaton(entries)

    monkeypatch.setattr(seq2seq.text.glossary, "automaton", spy)
    return built


def test_a_glossary_is_compiled_once_per_call_and_once_for_a_whole_stream(translator: Translator,
                                                                           monkeypatch: pytest.MonkeyPatch):
    """Today's glossaries were one regular expression per term per sentence: the automaton is built once
    for a call, once for a stream of many windows, and never again for a Glossary given ready made."""
    search, glossary = SearchConfig(beam_size=4), {"dog": "Pferd", "book": "Zeitung"}
    alone = [translator.translate([text], search, glossary=glossary)[0] for text in SOURCES]
    built = counting_builds(monkeypatch)
    stream = translator.translate_stream(SOURCES, search, window=1, glossary=glossary)  # four windows
    assert [hyps[0].text if hyps else "" for hyps in stream] == alone and built == [2]
    assert "Zeitung" in alone[0] and "Pferd" in alone[1]
    translator.translate_paragraphs(SOURCES, search, glossary=glossary)
    assert built == [2, 2]
    ready = Glossary(glossary)
    assert [hyps[0].text if hyps else "" for hyps in translator.translate_stream(SOURCES, search, window=1,
                                                                                 glossary=ready)] == alone
    assert translator.translate(SOURCES[:2], search, glossary=ready) == translator.translate(SOURCES[:2], search,
                                                                                           glossary=glossary)
    assert built == [2, 2, 2, 2]  # `ready`, then the mapping's own for the last call


def test_scripts_without_spaces_match_terms_and_end_phrases_where_no_space_marks_a_word():
    """Chinese, Japanese, Thai and Korean text marks no word boundary with a space (Korean's particles join the
    word before them): a glossary term there is found without one, and a placed phrase may be followed by a
    letter of such a script; a term's edge in a spaced script keeps its boundary."""
    glossary = {"東京": "Tokyo", "タワー": "tower", "ไทย": "Thai", "서울": "Seoul", "dog": "Hund", "Tokyo": "東京"}
    assert glossary_terms("我去東京了", glossary) == ["Tokyo"]
    assert glossary_terms("東京タワーに行く", glossary) == ["Tokyo", "tower"]
    assert glossary_terms("ภาษาไทยดี", glossary) == ["Thai"]
    assert glossary_terms("서울에서 만나요", glossary) == ["Seoul"]
    assert glossary_terms("Tokyoに行く", glossary) == ["東京"]  # the Latin edge: no letter of its script beside it
    assert glossary_terms("Tokyoites and dogs", glossary) == []
    assert glossary_terms("東京dog", glossary) == ["Tokyo", "Hund"]
    assert glossary_terms("dodog dog", {"dog": "Hund"}) == glossary_terms("dogdog dog", {"dog": "Hund"}) == ["Hund"]
    assert glossary_terms("aaa a", {"aa": "x"}) == [] and glossary_terms("aa", {"aa": "x"}) == ["x"]
    # After a placed phrase the next piece may not continue its word, unless it starts a word itself
    assert [continues_word(piece) for piece in ["ing", "s", "2", "<0xE6>"]] == [True] * 4
    assert not any(continues_word(piece) for piece in ["に", "東", "タワー", "ー", "ดี", "에서", "▁dog", "、", ","])


def test_the_cli_compiles_its_glossary_once_for_every_window(trained: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    """A 100,000-entry --glossary cost ~3.5 s a line when each line compiled its terms again: the run builds
    one automaton, read before the model loads, for all its windows (plain lines and --split-sentences)."""
    import seq2seq.translate
    from seq2seq.translate import main

    (tmp_path / "in").write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    (tmp_path / "glossary").write_text("dog\tPferd\nbook\tZeitung\nsmall dog\tHündchen\n", encoding="utf-8")
    monkeypatch.setattr(seq2seq.translate, "WINDOW", 2)  # two windows of the four lines
    built = counting_builds(monkeypatch)
    for run, split in enumerate(([], ["--split-sentences"])):
        main(["--checkpoint", str(trained), "--input", str(tmp_path / "in"), "--output", str(tmp_path / f"out{run}"),
              "--glossary", str(tmp_path / "glossary"), "--precision", "fp32", "--beam", "4", *split])
        lines = (tmp_path / f"out{run}").read_text(encoding="utf-8").split("\n")
        assert "Zeitung" in lines[0] and "Pferd" in lines[1] and "Hündchen" not in "".join(lines)
    assert built == [3, 3]  # one a run


def test_bad_constraints_name_the_line(translator: Translator):
    with pytest.raises(ValueError, match=r"^line 2 has an empty constraint"):
        translator.translate_nbest(SOURCES[:2], constraints=[["Hund"], ["", "x"]])
    with pytest.raises(ValueError, match=r"^the constraints of line 1 take \d+ tokens, more than the model writes"):
        translator.translate_nbest(SOURCES[:1], constraints=[[" ".join(["Katze"] * 200)]])
    with pytest.raises(ValueError, match=r"^1 constraint lists for 2 texts"):
        translator.translate_nbest(SOURCES[:2], constraints=[["Hund"]])
    with pytest.raises(ValueError, match=r"^the constraints end after line 1, before the texts do"):
        list(translator.translate_stream(SOURCES[:2], constraints=[["Hund"]]))


def test_the_cli_reads_constraints_and_a_glossary(trained: Path, translator: Translator, tmp_path: Path, capsys):
    from seq2seq.translate import main

    (tmp_path / "in").write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    (tmp_path / "constraints").write_text("Katze\n\n\nnicht\tLied\n", encoding="utf-8")
    (tmp_path / "glossary").write_text("dog\tPferd\n\nbook\tZeitung\n", encoding="utf-8")
    main(["--checkpoint", str(trained), "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
          "--constraints", str(tmp_path / "constraints"), "--glossary", str(tmp_path / "glossary"),
          "--precision", "fp32", "--beam", "4"])
    lines = (tmp_path / "out").read_text(encoding="utf-8").split("\n")
    expected = translator.translate(SOURCES, SearchConfig(beam_size=4), constraints=[["Katze"], [], [], ["nicht", "Lied"]],
                                    glossary={"dog": "Pferd", "book": "Zeitung"})
    assert lines[:4] == expected and "Zeitung" in lines[0] and "Katze" in lines[0] and "Pferd" in lines[1]
    for content, message in (("dog Pferd\n", "line 1 has no tab: write source term<TAB>target term"),
                             ("dog\tPferd\ncat\t\n", "line 2 has an empty target term"),
                             ("dog\tPferd\tHund\n", "line 1 has more than one tab"),
                             ("dog\tPferd\ndog\tHund\n", "line 2 gives 'dog' a second target term"),
                             ("caf\u00e9\tA\ncafe\u0301 \tB\n", "line 2 gives 'caf\u00e9' a second target term")):
        (tmp_path / "glossary").write_text(content, encoding="utf-8")
        with pytest.raises(SystemExit, match=f"^error: --glossary .*glossary {message}"):
            main(["--checkpoint", str(trained), "--input", str(tmp_path / "in"), "--output", str(tmp_path / "o2"),
                  "--glossary", str(tmp_path / "glossary")])
    (tmp_path / "constraints").write_text("Katze\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"has 4 lines but --constraints .*constraints has 1; give one line per "
                                         r"input line"):
        main(["--checkpoint", str(trained), "--input", str(tmp_path / "in"), "--output", str(tmp_path / "o3"),
              "--constraints", str(tmp_path / "constraints")])
    (tmp_path / "constraints").write_text("Katze\nHund\t\n\n\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"^error: --constraints .*constraints line 2 has an empty phrase \(two tabs "
                                         r"together, or one at an end\): separate the phrases by one tab$"):
        main(["--checkpoint", str(trained), "--input", str(tmp_path / "in"), "--output", str(tmp_path / "o4"),
              "--constraints", str(tmp_path / "constraints")])
