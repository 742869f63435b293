"""Tests for seq2seq.inference.languages: what a Translator translates, and the target chosen among a multilingual
model's. (Through a trained model and every face: tests/training/test_multilingual.py.)"""

import pytest

from seq2seq.inference.languages import Languages

DIRECTIONS = (("en", "de"), ("en", "fr"), ("de", "en"))


class Tags:
    """A tokenizer stand-in: each language's tag id."""

    def tag_id(self, lang: str) -> int:
        return {"de": 4, "fr": 5, "en": 6}[lang]


def test_a_multilingual_model_chooses_its_target_only_where_it_has_one():
    several = Languages.of(directions=DIRECTIONS)
    assert several.tgt_lang == "" and several.targets == ["de", "fr", "en"]
    assert several.pairs == "en→de, en→fr, de→en"
    one = Languages.of(directions=(("en", "fr"), ("de", "fr")))
    assert one.tgt_lang == "fr" and one.tag(Tags()) == [5]  # (nothing to choose)
    with pytest.raises(ValueError, match="this model translates into de, fr, en: choose the target language"):
        several.tag(Tags())
    french = several.chosen("fr", src_lang="en")
    assert (french.src_lang, french.tgt_lang, french.pairs) == ("en", "fr", "en→fr") and french.tag(Tags()) == [5]
    assert several.tgt_lang == ""  # (chosen is another value: the model's own is unchanged)
    with pytest.raises(ValueError, match="cannot translate into 'cs': this model translates into de, fr, en"):
        several.chosen("cs")


def test_a_bilingual_model_has_no_tags_and_only_its_own_target():
    pair = Languages.of(src_lang="de", tgt_lang="en")
    assert pair.chosen("en") is pair and pair.tag(Tags()) == [] and pair.pairs == "de→en"
    assert (pair.source_tags, pair.tags_on_the_decoder) == (0, False)
    with pytest.raises(ValueError, match="cannot translate into 'fr': this model translates de→en only"):
        pair.chosen("fr")


@pytest.mark.parametrize(("target_tag", "source_tags", "on_the_decoder"), [("encoder", 1, False), ("decoder", 0, True)])
def test_where_the_tags_go_holds_whichever_target_is_chosen(target_tag: str, source_tags: int, on_the_decoder: bool):
    for languages in (Languages.of(directions=DIRECTIONS, target_tag=target_tag),
                      Languages.of(directions=DIRECTIONS, target_tag=target_tag).chosen("de")):
        assert (languages.source_tags, languages.tags_on_the_decoder) == (source_tags, on_the_decoder)
