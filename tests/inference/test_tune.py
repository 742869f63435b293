"""Tests for seq2seq.inference.tune: the length penalty chosen on validation. (Chosen and stored at the end of a
run: tests/training/test_callbacks.py.)"""

import pytest

from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.tune import choose_length_penalty


class ScriptedTranslator:
    """Translates every sentence as `outputs[length_penalty]` says, and records the searches asked for."""

    def __init__(self, outputs: dict[float, str]):
        self.outputs, self.searches = outputs, []

    def translate(self, sources, search: SearchConfig):
        self.searches.append(search)
        return [self.outputs[search.length_penalty]] * len(sources)


def test_the_penalty_with_the_best_validation_bleu_is_chosen_the_first_on_a_tie():
    references = ["a man rides a red bicycle down the street"] * 3
    translator = ScriptedTranslator({0.6: "a man rides", 1.0: "a man rides a red bicycle down the street",
                                     2.0: "a man rides a red bicycle down the street", 3.0: "a man rides a bike"})
    best, scores = choose_length_penalty(translator, ["x"] * 3, references, beam_size=4,  # type: ignore[arg-type]
                                         length_penalties=[0.6, 1.0, 2.0, 3.0])
    assert best == 1.0 and scores[1.0] == scores[2.0] == pytest.approx(100)
    assert scores[0.6] < scores[3.0] < 100
    assert [s.beam_size for s in translator.searches] == [4] * 4


class ScriptedMultilingual:
    """A multilingual stand-in: for_target gives each target's ScriptedTranslator."""

    def __init__(self, per_target: dict[str, ScriptedTranslator]):
        self.per_target, self.chosen = per_target, []

    def for_target(self, tgt_lang: str, *, src_lang: str = "") -> ScriptedTranslator:
        self.chosen.append((src_lang, tgt_lang))
        return self.per_target[tgt_lang]


def test_a_multilingual_model_s_penalty_is_chosen_by_its_directions_mean_bleu():
    """Into de the penalty 1.0 is perfect and 2.0 poor; into fr 2.0 is perfect and 1.0 a little off: each penalty
    scores the mean of the directions' corpus BLEU (each direction decoded by its own target's translator)."""
    import sacrebleu

    de_ref, fr_ref = "ein mann fährt ein rotes fahrrad die straße hinunter", "un homme descend la rue sur un vélo rouge"
    de = ScriptedTranslator({1.0: de_ref, 2.0: "ein mann"})
    fr = ScriptedTranslator({1.0: "un homme descend la rue sur un vélo", 2.0: fr_ref})
    sources = ["x"] * 4
    references = [de_ref, fr_ref, fr_ref, fr_ref]
    directions = [("en", "de"), ("en", "fr"), ("en", "fr"), ("en", "fr")]
    translator = ScriptedMultilingual({"de": de, "fr": fr})
    best, scores = choose_length_penalty(translator, sources, references, beam_size=4,  # type: ignore[arg-type]
                                         length_penalties=[1.0, 2.0], directions=directions)
    for alpha in (1.0, 2.0):
        per_direction = [sacrebleu.corpus_bleu([de.outputs[alpha]], [[de_ref]]).score,
                         sacrebleu.corpus_bleu([fr.outputs[alpha]] * 3, [[fr_ref] * 3]).score]
        assert scores[alpha] == pytest.approx(sum(per_direction) / 2)
    assert best == 1.0
    assert set(translator.chosen) == {("en", "de"), ("en", "fr")}
