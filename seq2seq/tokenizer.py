"""A joint sentencepiece tokenizer with fixed special ids.

One model covers both languages (shared vocabulary, so the embedding matrices can be tied).
The special ids are fixed here, not read from a model file, so every part of the project
(masks, collate, search) can rely on them:

    PAD_ID = 0   padding; never predicted, masked out of attention and loss
    UNK_ID = 1   only for models trained without byte fallback (ours always have it)
    BOS_ID = 2   starts every decoder input
    EOS_ID = 3   ends every decoder output

`Tokenizer.to_bytes()` is the serialized sentencepiece model proto, so a checkpoint can carry
the tokenizer and inference needs no side file. `Tokenizer.load_or_train(path, texts, ...)` is the
model file a training run works with: loaded if it exists, else trained (by one process) and written.
"""

from __future__ import annotations

import io
import os
import random
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


class Tokenizer:
    """A sentencepiece model: batched encode/decode without special tokens added."""

    # The special ids, which __init__ checks the model has.
    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

    def __init__(self, processor: spm.SentencePieceProcessor) -> None:
        specials = (processor.pad_id(), processor.unk_id(), processor.bos_id(), processor.eos_id())
        if specials != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise ValueError(
                f"this sentencepiece model has special ids pad/unk/bos/eos = {specials}, but seq2seq needs "
                f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}; train it with Tokenizer.train (or pass "
                "--pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3 to spm_train)"
            )
        self._sp = processor

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
    ) -> Tokenizer:
        """Train a joint model on at most `max_sentences` lines drawn uniformly from `texts`.

        `texts` is read once, as a stream (reservoir sampling), so a WMT-size corpus is never held
        in memory beyond the sample. The same texts and seed give the same model, byte for byte.
        """
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
                # "identity" keeps characters as they are: nmt_nfkc rewrites e.g. a no-break space or
                # "½" (45 lines of Multi30k), so decode(encode(x)) != x. Runs of spaces and leading or
                # trailing spaces are still collapsed (remove_extra_whitespaces' default), which is the
                # only change a round trip makes; all de/en lines of Multi30k with normal spacing
                # round-trip exactly (tests/test_tokenizer.py).
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
    def from_bytes(cls, b: bytes) -> Tokenizer:
        """Load from a serialized model proto (what `to_bytes` returns; a `.model` file's content)."""
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(b)
        except RuntimeError as e:  # sentencepiece's parse error, several lines of C++ context
            raise ValueError(_first_line(e)) from e
        return cls(processor)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer model {path} does not exist")
        return cls.from_bytes(path.read_bytes())

    def to_bytes(self) -> bytes:
        return self._sp.serialized_model_proto()

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.to_bytes())

    # Workers (DataLoader, datasets.map with num_proc) receive the tokenizer by pickling; the
    # SWIG processor itself cannot be pickled, its proto can.
    def __getstate__(self) -> bytes:
        return self.to_bytes()

    def __setstate__(self, state: bytes) -> None:
        processor = spm.SentencePieceProcessor()
        processor.LoadFromSerializedProto(state)
        self._sp = processor

    # ---- use ----------------------------------------------------------------------------

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text; no BOS/EOS added."""
        return self._sp.encode(list(texts), out_type=int)

    def pieces(self) -> list[str]:
        """Every piece, in id order (what another engine's vocabulary file lists)."""
        return [self._sp.id_to_piece(i) for i in range(self._sp.get_piece_size())]

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Text of each id sequence; stops at the first EOS, drops PAD and BOS.

        Accepts what a search returns (lists of ints, with or without BOS, padded after EOS).
        """
        texts = []
        for row in ids:
            kept = []
            for i in row:
                i = int(i)
                if i == EOS_ID:
                    break
                if i not in (PAD_ID, BOS_ID):
                    kept.append(i)
            texts.append(self._sp.decode(kept))
        return texts

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()



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
