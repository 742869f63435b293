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
