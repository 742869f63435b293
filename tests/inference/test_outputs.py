"""Tests for seq2seq.inference.outputs: hypotheses as Translations. (Decoder-side tags dropped from every output:
tests/training/test_multilingual.py.)"""

from pathlib import Path

from seq2seq.decoding.config import Hypothesis
from seq2seq.inference.outputs import word_alignment
from seq2seq.inference.translator import Translator


def test_alignments_of_a_tagged_source_number_its_words_from_its_first_word(multilingual_run: Path):
    """A source's tag takes a position but no word: the word pairs number the source's words from its first."""
    french = Translator.from_checkpoint(multilingual_run / "checkpoints" / "best.ckpt", precision="fp32").for_target("fr")
    tokenizer = french.tokenizer
    [source] = french.prepare_inputs(["man dog"]).ids  # the tag, then each word's pieces
    words = tokenizer.word_indices(source[1:])
    last = {word: position + 1 for position, word in enumerate(words)}  # each word's last piece, after the tag
    target = tokenizer.encode_target(["homme chien"])[0]
    target_words = tokenizer.word_indices(target)
    positions = [last[0] if word == 0 else last[1] for word in target_words]
    alignment = word_alignment(tokenizer, source, Hypothesis(tokens=target, score=0.0, log_prob=0.0,
                                                             source_positions=[0, *positions[1:]]), source_tags=1)
    assert alignment == sorted({(0, w) for w in target_words[1:] if w == 0} | {(1, w) for w in target_words if w == 1})
