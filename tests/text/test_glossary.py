"""seq2seq/text/glossary.py: a glossary checked and compiled once, then matched leftmost-longest at word edges, in NFC.
(The Translator, CLI and server faces of glossaries are in test_constraints.py and test_server.py.)"""

import unicodedata

import pytest

import seq2seq.text.glossary
from seq2seq.text.glossary import Glossary, as_glossary, normal_term

OVERLAPPING = {"small mother": "Omi", "mother": "Mama", "small": "winzig"}


def test_the_longest_term_wins_and_the_terms_inside_it_are_not_forced():
    """Each overlapping term was forced before: "Die kleine Mutter Omi Mama. winzig Mutter." for this sentence."""
    glossary = Glossary(OVERLAPPING)
    assert glossary.terms_in("The small mother helps the doctor.") == ["Omi"]
    assert glossary.terms_in("The small dog sees the mother of the small mother.") == ["winzig", "Mama", "Omi"]
    assert glossary.terms_in("The smaller mothers.") == []


def test_of_terms_overlapping_at_different_starts_the_leftmost_wins():
    glossary = Glossary({"New York": "NY", "York City": "YC", "City": "Stadt", "City Hall": "Rathaus"})
    assert glossary.terms_in("New York City") == ["NY", "Stadt"]  # "York City" overlaps "New York": left out
    assert glossary.terms_in("in York City Hall") == ["YC"]  # "City Hall" starts inside "York City"
    assert glossary.terms_in("BrandNew York City") == ["YC"]  # "New York" is no whole word here: it blocks nothing
    assert glossary.terms_in("New York, City Hall") == ["NY", "Rathaus"]


def test_each_target_term_comes_once_in_the_order_the_text_first_has_it():
    glossary = Glossary({"dog": "Hund", "cat": "Katze", "hound": "Hund"})
    assert glossary.terms_in("A cat, a dog and a hound and a cat.") == ["Katze", "Hund"]


def test_terms_and_texts_are_compared_in_nfc():
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    assert unicodedata.normalize("NFC", decomposed) == composed != decomposed
    assert Glossary({composed: "Café"}).terms_in(f"A {decomposed} opens.") == ["Café"]
    assert Glossary({decomposed: "Café"}).terms_in(f"A {composed} opens.") == ["Café"]
    assert Glossary({"cafe": "Kaffee"}).terms_in(f"A {decomposed} opens.") == []  # the accent is part of the word
    assert Glossary({"Zoe": decomposed}).terms_in("Zoe") == [composed]  # the target term in NFC too
    with pytest.raises(ValueError, match="two target terms"):  # one source term, written two ways
        Glossary({composed: "a", decomposed: "b"})


def test_terms_are_found_as_whole_words_only():
    glossary = Glossary({"dog": "Hund", "c++": "C++", "og": "x", "_id": "Kennung"})
    assert glossary.terms_in("A (dog).") == ["Hund"]
    assert glossary.terms_in("dogs, hotdog, dog_food, dog2") == []
    assert glossary.terms_in("dodog dog") == glossary.terms_in("dogdog dog") == ["Hund"]
    assert glossary.terms_in("I write c++ and my_id, not _id.") == ["C++", "Kennung"]
    assert Glossary({"aa": "x"}).terms_in("aaa a") == [] and Glossary({"aa": "x"}).terms_in("aa") == ["x"]


def test_scripts_without_spaces_need_no_word_edge():
    glossary = Glossary({"東京": "Tokyo", "タワー": "tower", "ไทย": "Thai", "서울": "Seoul", "dog": "Hund", "Tokyo": "東京"})
    assert glossary.terms_in("我去東京了") == ["Tokyo"]
    assert glossary.terms_in("東京タワーに行く") == ["Tokyo", "tower"]
    assert glossary.terms_in("ภาษาไทยดี") == ["Thai"]
    assert glossary.terms_in("서울에서 만나요") == ["Seoul"]
    assert glossary.terms_in("Tokyoに行く") == ["東京"]  # the Latin edge: no letter of its script beside it
    assert glossary.terms_in("Tokyoites and dogs") == []
    assert glossary.terms_in("東京dog") == ["Tokyo", "Hund"]
    assert Glossary({"東京タワー": "Tokyo Tower", "東京": "Tokyo"}).terms_in("東京タワーに行く") == ["Tokyo Tower"]


def test_a_glossary_is_checked_and_normalised_as_it_is_built():
    glossary = Glossary({"  Boston \t Terrier ": " Boston-Terrier ", "fence": "Zaun"})
    assert glossary.terms == {"Boston Terrier": "Boston-Terrier", "fence": "Zaun"}
    assert len(glossary) == 2 and glossary.characters == len("Boston TerrierBoston-TerrierfenceZaun")
    assert glossary.terms_in("A Boston Terrier at the fence.") == ["Boston-Terrier", "Zaun"]
    with pytest.raises(ValueError, match=r"gives 'dog' two target terms \('Hund' and 'Köter'\); keep one"):
        Glossary({"dog": "Hund", " dog ": "Köter"})
    assert Glossary({"dog": "Hund", " dog ": " Hund"}).terms == {"dog": "Hund"}  # the same twice is no conflict
    with pytest.raises(ValueError, match="empty target term"):
        Glossary({"dog": " "})
    with pytest.raises(ValueError, match="empty source term"):
        Glossary({"\n": "Hund"})
    with pytest.raises(TypeError, match="maps text to text, not str to int"):
        Glossary({"dog": 5})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="a mapping of source term -> target term, not a list"):
        Glossary([("dog", "Hund")])  # type: ignore[arg-type]
    empty = Glossary({})
    assert not empty and empty.terms_in("dog") == [] and empty.characters == 0
    assert normal_term(" cafe\u0301\u00a0 au  lait ") == "caf\u00e9 au lait"


def test_a_glossary_is_compiled_once_and_passed_on_as_it_is(monkeypatch: pytest.MonkeyPatch):
    built = []
    automaton = seq2seq.text.glossary.automaton
    monkeypatch.setattr(seq2seq.text.glossary, "automaton", lambda entries: built.append(len(entries)) or automaton(entries))
    glossary = Glossary(OVERLAPPING)
    for _ in range(3):
        glossary.terms_in("The small mother.")
    assert as_glossary(glossary) is glossary and built == [3]
    assert as_glossary({"dog": "Hund"}).terms_in("A dog.") == ["Hund"] and built == [3, 1]
