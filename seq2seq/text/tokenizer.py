"""Text to token ids and back, for both sides of a translation model: one of two kinds.

- **Joint** (what `seq2seq.fit` trains): one sentencepiece model for both languages (a shared
  vocabulary, so the embedding matrices can be tied), whose ids are the model's, with fixed specials:

    PAD_ID = 0   padding; never predicted, masked out of attention and loss
    UNK_ID = 1   only for models trained without byte fallback (ours always have it)
    BOS_ID = 2   starts every decoder input
    EOS_ID = 3   ends every decoder output

- **Marian** (an imported OPUS-MT model, seq2seq/convert.py): a source and a target sentencepiece
  model over one vocabulary list (OPUS-MT's vocab.json) whose ids are not sentencepiece's: a piece's id
  is its place in the list (a piece missing from it is <unk>), eos "</s>" = 0, unk "<unk>" = 1, pad
  "<pad>" the last; there is no BOS: the decoder starts from pad, and every source ends with eos.

Everything else reads the special ids from the instance (`pad_id`, `unk_id`, `bos_id`: what the
decoder starts from, `eos_id`) and encodes with `encode_source` / `encode_target`, so it works with both.

`Tokenizer.to_bytes()` serializes either kind (a joint model: its sentencepiece proto, as checkpoints
have always held; a Marian pair: a header, its vocabulary and both protos), so a checkpoint carries
the tokenizer and inference needs no side file. `Tokenizer.load_or_train(path, texts, ...)` is the
model file a training run works with: loaded if it exists, else trained (by one process) and written.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import sentencepiece as spm
from filelock import FileLock

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3


TAG = re.compile(r">>([A-Za-z][A-Za-z0-9_-]*)<<")
"""A language tag and its code: `>>fr<<`, `>>fra<<`, `>>zh_Hant<<` (OPUS-MT's form: an imported multilingual Marian
model's vocabulary holds them, and a joint model trained for several target languages holds its own)."""
TARGET_TAGS = ("encoder", "decoder")
"""Where a multilingual model's target-language tag goes: first in the source (what the encoder reads), or the
decoder's first token (forced when translating, as NLLB's target language is)."""


def language_tag(lang: str) -> str:
    """The tag that names `lang` (`>>fr<<`); ValueError for a code a tag cannot hold."""
    if not TAG.fullmatch(f">>{lang}<<"):
        raise ValueError(f"{lang!r} is not a language code a tag can hold: letters, digits, '_' or '-', "
                         "starting with a letter (de, fra, zh_Hant)")
    return f">>{lang}<<"


MARIAN_MAGIC = b"seq2seq marian tokenizer\n"  # a sentencepiece proto starts with a protobuf tag, never with this
MARIAN_SPECIALS = {"eos": "</s>", "unk": "<unk>", "pad": "<pad>"}


class Tokenizer:
    """Batched encode/decode of either kind (module docstring); no special tokens added but a Marian source's eos."""

    def __init__(self, processor: spm.SentencePieceProcessor, *, target: spm.SentencePieceProcessor | None = None,
                 vocabulary: list[str] | None = None) -> None:
        """A joint model (`processor` alone), or a Marian pair: `processor` for the source, `target`, and
        the `vocabulary` (pieces in id order) both map their pieces into."""
        self._sp, self._target = processor, target if target is not None else processor
        self._vocabulary = vocabulary
        if vocabulary is None:
            if target is not None:
                raise ValueError("a tokenizer with a target model of its own needs the vocabulary both map into")
            specials = (processor.pad_id(), processor.unk_id(), processor.bos_id(), processor.eos_id())
            if specials != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
                raise ValueError(
                    f"this sentencepiece model has special ids pad/unk/bos/eos = {specials}, but seq2seq needs "
                    f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}; train it with Tokenizer.train (or pass "
                    "--pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3 to spm_train)"
                )
            self.pad_id, self.unk_id, self.bos_id, self.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
            self._index: dict[str, int] = {}
            return
        self._index = {piece: i for i, piece in enumerate(vocabulary)}
        if len(self._index) != len(vocabulary):
            twice = next(p for i, p in enumerate(vocabulary) if self._index[p] != i)
            raise ValueError(f"the vocabulary lists the piece {twice!r} twice")
        missing = [piece for piece in MARIAN_SPECIALS.values() if piece not in self._index]
        if missing:
            raise ValueError(f"the vocabulary lacks the special piece(s) {', '.join(missing)} a Marian model needs")
        self.eos_id, self.unk_id, self.pad_id = (self._index[MARIAN_SPECIALS[k]] for k in ("eos", "unk", "pad"))
        self.bos_id = self.pad_id  # Marian's decoder starts from pad (whose embedding is zero): there is no BOS

    @property
    def kind(self) -> Literal["joint", "marian"]:
        return "joint" if self._vocabulary is None else "marian"

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        *,
        vocab_size: int,
        model_type: str = "bpe",
        character_coverage: float = 1.0,
        max_sentences: int = 2_000_000,
        seed: int = 0,
        languages: Iterable[str] = (),
    ) -> Tokenizer:
        """Train a joint model on at most `max_sentences` lines drawn uniformly from `texts`, with a tag piece for
        each of `languages` (a multilingual model's target languages: `language_tag`).

        `texts` is read once, as a stream (reservoir sampling), so a WMT-size corpus is never held
        in memory beyond the sample. The same texts and seed give the same model, byte for byte.
        The tags are control symbols, not user-defined ones: both are single pieces, never split, but a
        control symbol is never made from text, so a sentence that contains ">>fr<<" cannot ask for French
        (the tag's id is put in by `tag_id`'s callers), and decoding drops it.
        """
        tags = [language_tag(lang) for lang in languages]
        sample = _reservoir_sample(texts, k=max_sentences, seed=seed)
        if not any(line.strip() for line in sample):
            raise ValueError("cannot train a tokenizer: the training text is empty (no non-blank line)")
        spm.set_random_generator_seed(seed)  # unigram's seeding; bpe on a fixed sample is deterministic
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sample),
                model_writer=model,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                control_symbols=tags,  # (ids 4, 5, ... after the four above)
                # "identity" keeps characters as they are: nmt_nfkc rewrites e.g. a no-break space or
                # "½" (45 lines of Multi30k), so decode(encode(x)) != x. Runs of spaces and leading or
                # trailing spaces are still collapsed (remove_extra_whitespaces' default), which is the
                # only change a round trip makes; all de/en lines of Multi30k with normal spacing
                # round-trip exactly (tests/text/test_tokenizer.py).
                normalization_rule_name="identity",
                # Characters outside the sample (a capped sample misses rare ones) become UTF-8 byte
                # pieces instead of <unk>, so nothing in a test set decodes to "⁇".
                byte_fallback=True,
                # We did the sampling; sentencepiece should take all of it.
                input_sentence_size=0,
                minloglevel=2,
            )
        except (RuntimeError, ValueError) as e:  # in sentencepiece's words, e.g. "Vocabulary size too high"
            raise ValueError(
                f"training a {model_type} tokenizer of vocab_size={vocab_size} on {len(sample)} lines failed: "
                f"{_first_line(e)}"
            ) from e
        return cls.from_bytes(model.getvalue())

    @classmethod
    def load_or_train(
        cls,
        path: str | os.PathLike,
        texts: Callable[[], Iterable[str]],
        *,
        vocab_size: int,
        model_type: str = "bpe",
        character_coverage: float = 1.0,
        max_sentences: int = 2_000_000,
        seed: int = 0,
        languages: Iterable[str] = (),
    ) -> Tokenizer:
        """The model at `path`; if there is none, one trained on `texts()` (options: `train`), written there.

        Processes that call this at once (DDP ranks) share the work: one trains, under a file lock beside
        `path`, while the others wait, then all load the one model. `texts` is a function so that the
        corpus is read only when a model must be trained; what it raises passes through unchanged.
        What fails here is raised as a TokenizerFileError, whose `step` says what: the caller words the
        message, as it knows which of its options named `path` and what the texts were.
        """
        path = Path(path)
        if not path.is_file():
            with _failing("write", path, OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                lock = FileLock(f"{path}.lock")
                lock.acquire()
            try:
                if not path.is_file():  # unless another process trained it while we waited
                    lines = texts()
                    # ValueError: no text, or sentencepiece refusing the options.
                    with _failing("train", path, ValueError):
                        tokenizer = cls.train(
                            lines, vocab_size=vocab_size, model_type=model_type,
                            character_coverage=character_coverage, max_sentences=max_sentences, seed=seed,
                            languages=languages,
                        )  # fmt: skip
                    partial_path = path.with_name(f"{path.name}.{os.getpid()}.partial")
                    with _failing("write", path, OSError):
                        tokenizer.save(partial_path)
                        os.replace(partial_path, path)  # atomic: nobody reads a half-written model
            finally:
                lock.release()
        with _failing("load", path, (OSError, ValueError)):
            return cls.from_file(path)

    @classmethod
    def from_marian(cls, *, source: bytes, target: bytes, vocabulary: list[str]) -> Tokenizer:
        """A Marian pair from its two sentencepiece models' bytes and its vocabulary (pieces in id order)."""
        return cls(_processor(source, "source model"), target=_processor(target, "target model"),
                   vocabulary=list(vocabulary))

    @classmethod
    def from_bytes(cls, b: bytes) -> Tokenizer:
        """Load what `to_bytes` returns: a sentencepiece model proto (a `.model` file's content), or a Marian pair."""
        if not b.startswith(MARIAN_MAGIC):
            return cls(_processor(b, "sentencepiece model"))
        try:
            size = int.from_bytes(b[len(MARIAN_MAGIC) : len(MARIAN_MAGIC) + 8], "little")
            start = len(MARIAN_MAGIC) + 8
            header = json.loads(b[start : start + size].decode("utf-8"))
            vocabulary, source_size = header["vocabulary"], int(header["source_bytes"])
            if not isinstance(vocabulary, list) or not all(isinstance(p, str) for p in vocabulary):
                raise ValueError("its vocabulary is not a list of pieces")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"a damaged Marian tokenizer: {e}") from None
        source, target = b[start + size : start + size + source_size], b[start + size + source_size :]
        return cls.from_marian(source=source, target=target, vocabulary=vocabulary)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer model {path} does not exist")
        return cls.from_bytes(path.read_bytes())

    def to_bytes(self) -> bytes:
        """The tokenizer as bytes (`from_bytes` reads them); the same tokenizer gives the same bytes."""
        if self._vocabulary is None:
            return self._sp.serialized_model_proto()
        source = self._sp.serialized_model_proto()
        header = json.dumps({"vocabulary": self._vocabulary, "source_bytes": len(source)},
                            ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return MARIAN_MAGIC + len(header).to_bytes(8, "little") + header + source + self._target.serialized_model_proto()

    def model_bytes(self, side: Literal["source", "target"]) -> bytes:
        """The sentencepiece model that splits `side`'s text into pieces (the same joint one for both)."""
        return (self._sp if side == "source" else self._target).serialized_model_proto()

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.to_bytes())

    # Workers (DataLoader, datasets.map with num_proc) receive the tokenizer by pickling; the
    # SWIG processor itself cannot be pickled, its proto can.
    def __getstate__(self) -> bytes:
        return self.to_bytes()

    def __setstate__(self, state: bytes) -> None:
        self.__dict__.update(Tokenizer.from_bytes(state).__dict__)

    # ---- use ----------------------------------------------------------------------------

    def encode_source(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each source text: a joint model's add nothing; a Marian source ends with eos, as
        Marian's models were trained."""
        if self._vocabulary is None:
            return self._sp.encode(list(texts), out_type=int)
        return [[*ids, self.eos_id] for ids in self._marian_ids(self._sp, texts)]

    def encode_target(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each target text (a reference, a forced prefix); no BOS or EOS added."""
        if self._vocabulary is None:
            return self._target.encode(list(texts), out_type=int)
        return self._marian_ids(self._target, texts)

    def _marian_ids(self, processor: spm.SentencePieceProcessor, texts: list[str]) -> list[list[int]]:
        # MarianTokenizer keeps a leading language code (">>fra<<", which multilingual OPUS-MT models read
        # to choose the target language) as one piece, and splits the rest with sentencepiece.
        out = []
        for text in texts:
            code, rest = _language_code(text)
            pieces = ([code] if code else []) + processor.encode(rest, out_type=str)
            out.append([self._index.get(piece, self.unk_id) for piece in pieces])
        return out

    @property
    def source_suffix(self) -> list[int]:
        """What encode_source appends to every source: Marian's eos; nothing for a joint model."""
        return [] if self._vocabulary is None else [self.eos_id]

    def source_tokens(self, ids: list[int]) -> int:
        """How many tokens of the text a source's ids hold (the suffix not counted): 0 for an empty text."""
        return len(ids) - len(self.source_suffix)

    def cut_source(self, ids: list[int], limit: int) -> list[int]:
        """A source's ids cut to at most `limit` tokens, the suffix kept (the model never saw a source without)."""
        if len(ids) <= limit:
            return ids
        suffix = self.source_suffix
        return ids[: limit - len(suffix)] + suffix

    def word_indices(self, ids: list[int]) -> list[int]:
        """Per id, the index of the space-separated word of the decoded text it belongs to (what
        `text.split(" ")` numbers; a no-break space joins): sentencepiece marks a space as "▁" at the
        start of the piece after it.
        A bare "▁" piece starts the word its next pieces spell, unless the next piece brings its own."""
        vocabulary = self._vocabulary
        out, word, bare = [], -1, False
        for i in ids:
            piece = vocabulary[i] if vocabulary is not None else self._sp.id_to_piece(int(i))
            if piece.startswith("\u2581"):
                if not bare:
                    word += 1
                bare = piece == "\u2581"
            else:
                word, bare = max(word, 0), False
            out.append(max(word, 0))
        if bare and word > 0:  # bare "▁" pieces at the end spell no word (decoding drops the space)
            out = [w if w < word else word - 1 for w in out]
        return out

    def is_ordinary(self, i: int) -> bool:
        """Whether piece `i` is one that text splits into by merges: not a control symbol (a tag, pad, bos, eos),
        <unk>, an unused piece or a byte of byte fallback. (A joint model's; a Marian pair's pieces: False.)"""
        sp = self._sp
        return self._vocabulary is None and not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)
                                                 or sp.is_byte(i))

    def score(self, i: int) -> float:
        """Piece `i`'s score in a joint model: for BPE, the earlier its merge was learnt, the higher."""
        return self._sp.get_score(i)

    def pieces(self) -> list[str]:
        """Every piece, in id order (what another engine's vocabulary file lists)."""
        if self._vocabulary is not None:
            return list(self._vocabulary)
        return [self._sp.id_to_piece(i) for i in range(self._sp.get_piece_size())]

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Text of each id sequence; stops at the first EOS, drops PAD and BOS (a Marian pair drops
        <unk> too, as MarianTokenizer.decode(skip_special_tokens=True) does).

        Accepts what a search returns (lists of ints, with or without BOS, padded after EOS).
        """
        dropped = {self.pad_id, self.bos_id} if self._vocabulary is None else {self.pad_id, self.unk_id}
        texts = []
        for row in ids:
            kept = []
            for i in row:
                i = int(i)
                if i == self.eos_id:
                    break
                if i not in dropped:
                    kept.append(i)
            if self._vocabulary is None:
                texts.append(self._sp.decode(kept))
            else:
                # As MarianTokenizer.decode: a piece the target model lacks (the vocabulary is both models')
                # keeps its "▁", which becomes a space; no space at either end (a dropped <unk> may leave one)
                pieces = [self._vocabulary[i] for i in kept]
                texts.append(self._target.decode_pieces(pieces).replace("\u2581", " ").strip())
        return texts

    @property
    def languages(self) -> list[str]:
        """The language codes this tokenizer has a tag piece for, in id order: a joint model's control symbols
        `>>xx<<`, a Marian vocabulary's `>>xxx<<` pieces; [] for a bilingual model."""
        if self._vocabulary is not None:
            pieces = self._vocabulary
        else:
            pieces = [self._sp.id_to_piece(i) for i in range(self._sp.get_piece_size()) if self._sp.is_control(i)]
        return [match.group(1) for piece in pieces if (match := TAG.fullmatch(piece))]

    def tag_id(self, lang: str) -> int:
        """The id of `lang`'s tag; ValueError (one line, naming the languages there are) if it has none."""
        tag = language_tag(lang)
        if self._vocabulary is not None:
            found = self._index.get(tag)
        else:
            found = self._sp.piece_to_id(tag)
            found = found if found != self.unk_id and self._sp.is_control(found) else None
        if found is None:
            languages = self.languages
            have = f"its target languages are {', '.join(languages)}" if languages else "it has no language tags"
            raise ValueError(f"this model has no tag for {lang!r}: {have}")
        return found

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size() if self._vocabulary is None else len(self._vocabulary)


def _processor(proto: bytes, what: str) -> spm.SentencePieceProcessor:
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(proto)
    except RuntimeError as e:  # sentencepiece's parse error, several lines of C++ context
        raise ValueError(f"{what}: {_first_line(e)}" if what != "sentencepiece model" else _first_line(e)) from e
    return processor


def _language_code(text: str) -> tuple[str, str]:
    """(">>fra<<", the rest) for a text that starts with a language code, else ("", text); as MarianTokenizer."""
    end = text.find("<<") if text.startswith(">>") else -1
    return (text[: end + 2], text[end + 2 :]) if end != -1 else ("", text)


class TokenizerFileError(Exception):
    """What `Tokenizer.load_or_train` could not do: `write` the model file at `path` (its folder, its lock
    or the model: `error` is the OSError), `train` a model (sentencepiece's ValueError), or `load` the
    model that is there (an OSError, or a ValueError for bytes that are no model)."""

    def __init__(self, step: Literal["write", "train", "load"], path: Path, error: Exception) -> None:
        super().__init__(f"cannot {step} the tokenizer model {path}: {error}")
        self.step, self.path, self.error = step, path, error


@contextmanager
def _failing(
    step: Literal["write", "train", "load"], path: Path, errors: type[Exception] | tuple[type[Exception], ...]
) -> Iterator[None]:
    """`errors` raised inside, as a TokenizerFileError of `step`."""
    try:
        yield
    except errors as error:
        raise TokenizerFileError(step, path, error) from error


def _first_line(error: Exception) -> str:
    """Sentencepiece's errors carry lines of C++ context; the first says what went wrong."""
    return str(error).strip().split("\n")[0]


def _reservoir_sample(texts: Iterable[str], *, k: int, seed: int) -> list[str]:
    """A uniform sample of at most `k` items of a stream, in one pass (Vitter's algorithm R)."""
    if k < 1:
        raise ValueError(f"max_sentences must be at least 1, got {k}")
    rng = random.Random(seed)
    sample: list[str] = []
    for n, text in enumerate(texts):
        if n < k:
            sample.append(text)
        else:
            j = int(rng.random() * (n + 1))  # keep this item with probability k / (n + 1)
            if j < k:
                sample[j] = text
    return sample
