import pickle

import pytest
import sentencepiece as spm

from seq2seq.text.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    Tokenizer,
    TokenizerFileError,
    _reservoir_sample,
    language_tag,
)


def test_special_ids_are_fixed(tokenizer: Tokenizer) -> None:
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2, 3)
    assert tokenizer.vocab_size == 2000


def test_round_trips_multi30k(tokenizer: Tokenizer, multi30k_lines) -> None:
    texts = [
        line
        for stem in ("train", "val", "test_2016_flickr")
        for lang in ("de", "en")
        for line in multi30k_lines(stem, lang)
    ]
    decoded = tokenizer.decode(tokenizer.encode_source(texts))
    # The one normalisation: runs of spaces collapse and the ends are trimmed (85 of the 62,028 lines).
    spaced_normally = [t == t.strip() and "  " not in t for t in texts]
    assert sum(spaced_normally) > 0.99 * len(texts)
    for text, out, normal in zip(texts, decoded, spaced_normally, strict=True):
        assert out == (text if normal else " ".join(w for w in text.split(" ") if w))


def test_characters_outside_the_training_text_round_trip(tokenizer: Tokenizer) -> None:
    texts = ["Crème brûlée ½ ﬁ „Zitat“ — 東京 🙂", "Nummer\u00a028"]  # byte fallback, no "⁇"
    ids = tokenizer.encode_source(texts)
    assert UNK_ID not in {i for row in ids for i in row}
    assert tokenizer.decode(ids) == texts


def test_encode_adds_no_specials_and_decode_stops_at_eos(tokenizer: Tokenizer) -> None:
    [ids] = tokenizer.encode_source(["Ein Hund läuft."])
    assert not {PAD_ID, BOS_ID, EOS_ID} & set(ids)
    [other] = tokenizer.encode_source(["Zwei Katzen."])
    rows = [[BOS_ID, *ids, EOS_ID, *other, PAD_ID], [*ids, PAD_ID, PAD_ID], [BOS_ID, EOS_ID], []]
    assert tokenizer.decode(rows) == ["Ein Hund läuft.", "Ein Hund läuft.", "", ""]


def test_bytes_file_and_pickle_trips(tokenizer: Tokenizer, tmp_path, multi30k_lines) -> None:
    texts = multi30k_lines("val", "en", 50)
    expected = tokenizer.encode_source(texts)
    copies = [Tokenizer.from_bytes(tokenizer.to_bytes()), pickle.loads(pickle.dumps(tokenizer))]
    tokenizer.save(tmp_path / "sub" / "m.model")
    copies.append(Tokenizer.from_file(tmp_path / "sub" / "m.model"))
    for copy in copies:
        assert copy.to_bytes() == tokenizer.to_bytes()
        assert copy.encode_source(texts) == expected
        assert copy.decode(expected) == tokenizer.decode(expected)


def test_training_is_seeded_and_capped(multi30k_lines) -> None:
    texts = multi30k_lines("train", "en", 3000)
    a = Tokenizer.train(iter(texts), vocab_size=500, max_sentences=1000, seed=1)
    b = Tokenizer.train(iter(texts), vocab_size=500, max_sentences=1000, seed=1)
    c = Tokenizer.train(iter(texts), vocab_size=500, max_sentences=1000, seed=2)
    assert a.to_bytes() == b.to_bytes()
    assert a.to_bytes() != c.to_bytes()  # another sample of 1000 lines


def test_unigram_model(multi30k_lines) -> None:
    texts = multi30k_lines("train", "de", 2000)
    tok = Tokenizer.train(texts, vocab_size=600, model_type="unigram")
    assert tok.vocab_size == 600
    assert tok.decode(tok.encode_source(texts[:100])) == texts[:100]


def test_reservoir_sample_is_uniform_and_streams() -> None:
    stream = (str(i) for i in range(10_000))  # a generator: read once, no len()
    sample = _reservoir_sample(stream, k=1000, seed=0)
    assert len(sample) == len(set(sample)) == 1000
    assert 3500 < sum(int(x) for x in sample) / len(sample) < 6500  # not the first 1000
    assert _reservoir_sample(map(str, range(10_000)), k=1000, seed=0) == sample
    assert _reservoir_sample(["a", "b"], k=5, seed=0) == ["a", "b"]


def test_bad_training_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        Tokenizer.train(["", "  "], vocab_size=100)
    with pytest.raises(ValueError, match="max_sentences"):
        Tokenizer.train(["a"], vocab_size=100, max_sentences=0)
    with pytest.raises(ValueError, match="vocab_size=300 on 100 lines failed: .*Vocabulary size too high"):
        Tokenizer.train(["Ein Hund.", "A dog."] * 50, vocab_size=300)


def test_rejects_a_model_with_other_special_ids(tmp_path, multi30k_lines) -> None:
    prefix = tmp_path / "default_ids"
    text = tmp_path / "text.txt"
    text.write_text("\n".join(multi30k_lines("train", "en", 500)) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(prefix), vocab_size=300, minloglevel=2)
    with pytest.raises(ValueError, match="pad/unk/bos/eos"):
        Tokenizer.from_file(f"{prefix}.model")


def test_load_or_train_trains_once_and_reads_the_texts_only_then(tmp_path, multi30k_lines) -> None:
    texts, reads = multi30k_lines("val", "en"), []

    def read() -> list[str]:
        reads.append(len(texts))
        return texts

    path = tmp_path / "sub" / "m.model"
    first = Tokenizer.load_or_train(path, read, vocab_size=500, seed=1)
    again = Tokenizer.load_or_train(path, read, vocab_size=500, seed=1)
    assert len(reads) == 1 and first.to_bytes() == again.to_bytes() == path.read_bytes()
    assert first.to_bytes() == Tokenizer.train(texts, vocab_size=500, seed=1).to_bytes()
    assert not list(path.parent.glob("*.partial"))


def test_load_or_train_says_which_step_failed(tmp_path) -> None:
    (tmp_path / "a_file").write_text("in the way", encoding="utf-8")
    steps = {
        "write": (tmp_path / "a_file" / "m.model", OSError),
        "train": (tmp_path / "blank.model", ValueError),  # only blank lines to train on
        "load": (tmp_path / "bad.model", ValueError),  # bytes that are no model
    }
    (tmp_path / "bad.model").write_bytes(b"not a model")
    for step, (path, error) in steps.items():
        with pytest.raises(TokenizerFileError) as failed:
            Tokenizer.load_or_train(path, lambda: ["", " "], vocab_size=500)
        assert (failed.value.step, failed.value.path) == (step, path)
        assert isinstance(failed.value.error, error)

    def unreadable() -> list[str]:
        raise LookupError("the corpus is gone")

    with pytest.raises(LookupError, match="the corpus is gone"):  # the texts' own errors pass through
        Tokenizer.load_or_train(tmp_path / "other.model", unreadable, vocab_size=500)


# ---- language tags (a multilingual model's target languages) -----------------------------------------


def test_a_tag_is_one_piece_no_text_can_make_and_decoding_drops(multi30k_lines, tmp_path) -> None:
    texts = multi30k_lines("train", "de", 2000) + multi30k_lines("train", "en", 2000)
    tok = Tokenizer.train(texts, vocab_size=500, languages=["en", "fr", "de"])
    assert tok.languages == ["en", "fr", "de"]
    assert [tok.tag_id(lang) for lang in ("en", "fr", "de")] == [4, 5, 6]  # after the four specials
    assert tok.pieces()[5] == ">>fr<<" and tok.vocab_size == 500
    [hostile] = tok.encode_source([">>fr<< Ein Mann"])  # a sentence that writes the tag gets its characters
    assert tok.tag_id("fr") not in hostile and tok.decode([hostile]) == [">>fr<< Ein Mann"]
    [sentence] = tok.encode_source(["Ein Mann"])
    assert tok.decode([[tok.tag_id("en"), *sentence]]) == ["Ein Mann"]
    assert Tokenizer.from_bytes(tok.to_bytes()).languages == ["en", "fr", "de"]  # kept in the model's bytes
    with pytest.raises(ValueError, match="this model has no tag for 'cs': its target languages are en, fr, de"):
        tok.tag_id("cs")
    bilingual = Tokenizer.train(texts, vocab_size=500)
    assert bilingual.languages == []
    with pytest.raises(ValueError, match="this model has no tag for 'en': it has no language tags"):
        bilingual.tag_id("en")
    assert Tokenizer.load_or_train(tmp_path / "spm.model", lambda: texts, vocab_size=500,
                                   languages=["cs"]).languages == ["cs"]


def test_a_tag_is_opus_mt_s_form_and_refuses_what_is_no_code() -> None:
    assert language_tag("fr") == ">>fr<<" and language_tag("zh_Hant") == ">>zh_Hant<<"
    for code in (">>fr<<", "e n", "", "1de"):
        with pytest.raises(ValueError, match="is not a language code a tag can hold"):
            language_tag(code)


# ---- a Marian pair (an imported OPUS-MT model's tokenizer) ------------------------------------------


@pytest.fixture(scope="module")
def marian_pair(multi30k_lines) -> Tokenizer:
    """Two unigram models (German source, English target) over the union vocabulary, as OPUS-MT ships."""
    from marian_hub import build_vocab, train_spm

    source = train_spm(multi30k_lines("train", "de", 1000), vocab_pieces=200)
    target = train_spm(multi30k_lines("train", "en", 1000), vocab_pieces=200)
    return Tokenizer.from_marian(source=source, target=target, vocabulary=list(build_vocab(source, target)))


def test_a_marian_source_ends_with_eos_which_cutting_keeps(marian_pair: Tokenizer) -> None:
    tok = marian_pair
    assert (tok.eos_id, tok.unk_id, tok.pad_id, tok.bos_id) == (0, 1, tok.vocab_size - 1, tok.vocab_size - 1)
    [empty, sentence] = tok.encode_source(["", "Ein Hund läuft über die Wiese."])
    assert empty == [tok.eos_id] and tok.source_tokens(empty) == 0
    assert sentence[-1] == tok.eos_id and tok.source_tokens(sentence) == len(sentence) - 1
    assert tok.cut_source(sentence, 4) == [*sentence[:3], tok.eos_id]
    assert tok.cut_source(sentence, len(sentence)) == sentence
    assert tok.encode_target(["A dog."])[0][-1] != tok.eos_id  # targets: collate adds eos


def test_a_marian_pair_decodes_pieces_only_the_source_model_knows(marian_pair: Tokenizer) -> None:
    """The vocabulary is both models': a German piece decoded by the English model keeps its "▁", which
    must become a space (as MarianTokenizer's convert_tokens_to_string does)."""
    tok = marian_pair
    pieces = tok.pieces()
    ids = [pieces.index(p) for p in ("▁A", "▁dog")] + tok.encode_source(["eine Hund auf"])[0][:-1]
    [text] = tok.decode([ids])
    assert "▁" not in text and text.startswith("A dog ") and text.split()[2:] == ["eine", "Hund", "auf"]


def test_a_multilingual_marian_vocabulary_s_tags_are_its_languages(marian_pair: Tokenizer) -> None:
    """A multi-target OPUS-MT model's vocabulary holds its `>>xxx<<` pieces; its source text names the target."""
    pieces = marian_pair.pieces()
    vocabulary = [*pieces[:-1], ">>fra<<", ">>deu<<", pieces[-1]]  # (pad stays last)
    tok = Tokenizer.from_marian(source=marian_pair.model_bytes("source"), target=marian_pair.model_bytes("target"),
                                vocabulary=vocabulary)
    assert marian_pair.languages == [] and tok.languages == ["fra", "deu"]
    assert tok.tag_id("deu") == len(pieces)
    assert tok.encode_source([">>deu<< A dog."])[0][0] == tok.tag_id("deu")


def test_joint_tokenizers_have_no_source_suffix(tokenizer: Tokenizer) -> None:
    [ids] = tokenizer.encode_source(["Ein Hund."])
    assert tokenizer.source_suffix == [] and tokenizer.source_tokens(ids) == len(ids)
    assert tokenizer.cut_source(ids, 2) == ids[:2]
