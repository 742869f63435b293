import random
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from seq2seq.text.bpe_dropout import Resegmenter, split_word
from seq2seq.text.tokenizer import Tokenizer, language_tag


@pytest.fixture(scope="module")
def german(tokenizer: Tokenizer, multi30k_lines) -> list[list[int]]:
    return tokenizer.encode_source(multi30k_lines("train", "de", 3000))


def test_split_word_merges_in_rank_order_and_leftmost_on_a_tie() -> None:
    ranks = {"ab": 0, "bc": 1, "abc": 2, "aa": 3}
    rng = random.Random(0)
    assert split_word("abc", ranks=ranks, p=0, rng=rng) == ["abc"]  # ab first, then ab+c
    assert split_word("aaa", ranks=ranks, p=0, rng=rng) == ["aa", "a"]  # the leftmost pair of two equal ones
    assert split_word("xbc", ranks=ranks, p=0, rng=rng) == ["x", "bc"]

    class Always(random.Random):  # every candidate dropped: the word stays in characters
        def random(self) -> float:
            return 0.0

    assert split_word("abc", ranks=ranks, p=0.5, rng=Always()) == ["a", "b", "c"]


def test_without_dropout_the_merges_give_the_tokenizers_own_pieces(tokenizer: Tokenizer, german) -> None:
    """The ranks read from the scores and our merge loop are sentencepiece's BPE: every Multi30k word type splits
    as the tokenizer splits it, so the pool's first entry (and p -> 0) is the tokenizer's segmentation."""
    split = Resegmenter(german, tokenizer=tokenizer, p=0.1, seed=0, max_len=128)
    assert split.mismatched == 0 and split.word_types > 5000


def test_an_epochs_pieces_spell_the_same_text_and_change_by_epoch(tokenizer: Tokenizer, german) -> None:
    split = Resegmenter(german, tokenizer=tokenizer, p=0.1, seed=0, max_len=128)
    rows = list(range(len(german)))
    first, second = split.ids(1, rows), split.ids(2, rows)
    assert tokenizer.decode(first) == tokenizer.decode(second) == tokenizer.decode(german)
    assert split.lengths(1).tolist() == [len(ids) for ids in first]
    assert split.lengths(2).tolist() == [len(ids) for ids in second]
    changed = sum(a != b for a, b in zip(first, german, strict=True))
    assert changed > len(german) // 2  # most sentences have some word split
    assert sum(a != b for a, b in zip(first, second, strict=True)) > len(german) // 2
    # Mostly into more pieces (a skipped merge can also let others build a longer piece: fewer, now and then)
    assert sum(map(len, first)) > 1.05 * sum(map(len, german))
    # One row at a time, any subset, as a loader worker reads them: the same pieces.
    assert [split.ids(1, [row])[0] for row in (5, 0, 2999)] == [first[5], first[0], first[2999]]


def test_the_same_seed_gives_the_same_pieces_in_another_process(tokenizer: Tokenizer, tmp_path) -> None:
    """What sentencepiece's own sampling does not do (module docstring): a new process, the same pools and picks."""
    path = tmp_path / "spm.model"
    tokenizer.save(path)
    texts = ["Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche."] * 50
    script = (
        "import sys; from seq2seq.text.tokenizer import Tokenizer; from seq2seq.text.bpe_dropout import Resegmenter\n"
        f"tok = Tokenizer.from_file({str(path)!r}); seqs = tok.encode_source({texts!r})\n"
        "split = Resegmenter(seqs, tokenizer=tok, p=0.3, seed=4, max_len=64)\n"
        "print(split.ids(7, range(len(seqs))))"
    )
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    here = Resegmenter(tokenizer.encode_source(texts), tokenizer=tokenizer, p=0.3, seed=4, max_len=64)
    assert runs[0] == runs[1] == f"{here.ids(7, range(len(texts)))}\n"
    other = Resegmenter(tokenizer.encode_source(texts), tokenizer=tokenizer, p=0.3, seed=5, max_len=64)
    assert other.ids(7, range(len(texts))) != here.ids(7, range(len(texts)))


def test_the_pool_draws_a_word_as_bpe_dropout_does(tokenizer: Tokenizer) -> None:
    """A frequent word's share of each segmentation across epochs is BPE-dropout's own, within what a pool of 32
    draws and 4000 picks allow (the pool is random: a loose bound, but one a wrong p or a biased pick fails)."""
    word = tokenizer.encode_source(["Männer"])[0]
    split = Resegmenter([word] * 100, tokenizer=tokenizer, p=0.3, seed=1, max_len=64)
    picked = Counter(tuple(ids) for epoch in range(40) for ids in split.ids(epoch, range(100)))
    pieces = tokenizer.pieces()
    order = sorted((i for i in range(len(pieces)) if tokenizer.is_ordinary(i) and len(pieces[i]) > 1),
                   key=lambda i: -tokenizer.score(i))
    ranks, index = {pieces[i]: r for r, i in enumerate(order)}, {pieces[i]: i for i in range(len(pieces))}
    rng = random.Random(0)
    direct = Counter(tuple(index[s] for s in split_word("▁Männer", ranks=ranks, p=0.3, rng=rng)) for _ in range(4000))
    whole = tuple(word)
    assert abs(picked[whole] / 4000 - direct[whole] / 4000) < 0.2
    assert 0.2 < picked[whole] / 4000 < 0.9  # p = 0.3 leaves it whole often, but far from always


def test_the_split_share_grows_with_p(tokenizer: Tokenizer, german) -> None:
    grown = []
    for p in (0.01, 0.1, 0.3):
        split = Resegmenter(german, tokenizer=tokenizer, p=p, seed=0, max_len=128)
        grown.append(split.lengths(0).sum() / sum(len(s) for s in german))
    assert 1 <= grown[0] < grown[1] < grown[2]


def test_tags_and_byte_pieces_are_never_split(multi30k_lines) -> None:
    texts = multi30k_lines("train", "de", 2000) + multi30k_lines("train", "en", 2000)
    tagged = Tokenizer.train(texts, vocab_size=1000, languages=["en"])
    tag = tagged.tag_id("en")
    text = "Ein Hund 東 läuft"  # 東 is not in the vocabulary: byte fallback
    seq = [tag, *tagged.encode_source([text])[0]]
    assert any(tagged._sp.is_byte(i) for i in seq)
    split = Resegmenter([seq] * 30, tokenizer=tagged, p=0.9, seed=0, max_len=64)
    for ids in split.ids(3, range(30)):
        assert ids[0] == tag and tagged.decode([ids[1:]]) == [text]
        bytes_ = [i for i in ids if tagged._sp.is_byte(i)]
        assert bytes_ == [i for i in seq if tagged._sp.is_byte(i)]
    assert language_tag("en") == tagged.pieces()[tag]


def test_a_side_resplit_over_max_len_keeps_its_own_pieces(tokenizer: Tokenizer, german) -> None:
    limit = int(np.median([len(s) for s in german]))
    short = [s for s in german if len(s) <= limit]
    split = Resegmenter(short, tokenizer=tokenizer, p=0.3, seed=0, max_len=limit)
    lengths, ids = split.lengths(2), split.ids(2, range(len(short)))
    assert lengths.max() <= limit and lengths.tolist() == [len(i) for i in ids]
    kept = [a == b for a, b in zip(ids, short, strict=True)]
    assert sum(kept) > 0 and not all(kept)  # the longest fall back; the others are split


def test_a_unigram_or_marian_tokenizer_is_refused(multi30k_lines) -> None:
    texts = multi30k_lines("train", "de", 1000) + multi30k_lines("train", "en", 1000)
    unigram = Tokenizer.train(texts, vocab_size=800, model_type="unigram")
    with pytest.raises(ValueError, match="needs a BPE tokenizer"):
        Resegmenter(unigram.encode_source(texts), tokenizer=unigram, p=0.1, seed=0, max_len=128)
    from marian_hub import build_vocab, train_spm

    source, target = train_spm(texts[:500], vocab_pieces=200), train_spm(texts[1000:1500], vocab_pieces=200)
    marian = Tokenizer.from_marian(source=source, target=target, vocabulary=list(build_vocab(source, target)))
    with pytest.raises(ValueError, match="Marian"):
        Resegmenter([[1, 2]], tokenizer=marian, p=0.1, seed=0, max_len=128)
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        Resegmenter([[1, 2]], tokenizer=unigram, p=1.0, seed=0, max_len=128)
