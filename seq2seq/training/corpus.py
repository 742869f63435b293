"""Parallel text read for training: line-parallel files (plain or .gz), a two-column .tsv, Hub-layout
.parquet/.json/.jsonl files or a Hub dataset, as `datasets` tables of (src, tgt) pairs; each pair's fate under the
length and ratio filters (`Status`); and the tokenising map over a table. data.py's TranslationDataModule builds
its splits from these."""

from __future__ import annotations

import gzip
import logging
import os
from collections.abc import Callable, Iterator
from enum import IntEnum
from itertools import zip_longest
from pathlib import Path

import datasets
from lightning.pytorch.utilities import rank_zero_only

from seq2seq.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class DataError(ValueError):
    """Bad input data or data options; the message names the file or option and the fix."""


def os_reason(error: OSError) -> str:
    """Why a file could not be written, in words: "File exists" from mkdir means a file is in the way."""
    if isinstance(error, FileExistsError | NotADirectoryError):
        return "a file stands where a folder of its path should be"
    return error.strerror or str(error)


@rank_zero_only
def info(message: str) -> None:
    log.info(message)


# ---- reading local files ------------------------------------------------------------------------


def _lines(path: str) -> Iterator[str]:
    """The lines of a text file (plain or .gz), without line ends; rejects non-UTF-8 bytes."""
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                # utf-8-sig on the first line: a byte-order mark (Windows editors write one) is not text.
                yield raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}, line {number}: not UTF-8 ({e.reason} at byte {e.start} of the line); "
                    "convert the file to UTF-8, e.g. `iconv -f latin1 -t utf-8`"
                ) from None


def _pairs_from_text(src_path: str, tgt_path: str, stamp: str) -> Iterator[dict[str, str]]:
    # `stamp` (sizes, mtimes) goes unused: it is an argument so that from_generator's cache,
    # keyed on the arguments, is rebuilt when a file changes.
    for src, tgt in zip_longest(_lines(src_path), _lines(tgt_path)):
        if src is None or tgt is None:
            n_src, n_tgt = (sum(1 for _ in _lines(p)) for p in (src_path, tgt_path))
            raise DataError(
                f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}: source and target files "
                "must be parallel, one sentence pair per line number"
            )
        yield {"src": src, "tgt": tgt}


def _pairs_from_tsv(path: str, stamp: str) -> Iterator[dict[str, str]]:
    for number, line in enumerate(_lines(path), start=1):
        columns = line.split("\t")
        if len(columns) != 2:
            raise DataError(
                f"{path}, line {number}: expected 2 tab-separated columns (source, target), found "
                f"{len(columns)}; remove tabs inside sentences or use a source file and a target file"
            )
        yield {"src": columns[0], "tgt": columns[1]}


def is_empty(path: str) -> bool:
    """No bytes (for .gz: none once decompressed); `datasets` would say only "corresponds to no data"."""
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        return not f.read(1)


_PAIR = datasets.Features({"src": datasets.Value("string"), "tgt": datasets.Value("string")})


def load_files(files: list[str], *, option: str, cache_dir: str | None) -> datasets.Dataset:
    """A split from local files: `src`/`tgt` columns, or Hub-layout columns for parquet/json."""
    for path in files:
        if not Path(path).is_file():
            raise DataError(f"{option}: {path} does not exist (relative to {os.getcwd()}); fix the path")
    empty = [path for path in files if is_empty(path)]
    if empty and len(empty) == len(files):  # one empty side of two: the line-count check names both
        raise DataError(f"{option}: {', '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty; "
                        "give files with one sentence per line")
    if all(p.endswith(".parquet") for p in files):
        return datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache_dir)
    if all(p.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz")) for p in files):
        return datasets.load_dataset("json", data_files=files, split="train", cache_dir=cache_dir)
    stamp = ";".join(f"{p}:{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}" for p in files)
    generator: Callable[..., Iterator[dict[str, str]]]
    if len(files) == 1 and files[0].endswith((".tsv", ".tsv.gz")):
        generator, kwargs = _pairs_from_tsv, {"path": files[0], "stamp": stamp}
    elif len(files) == 2:
        generator, kwargs = _pairs_from_text, {"src_path": files[0], "tgt_path": files[1], "stamp": stamp}
    else:
        raise DataError(
            f"{option}={files}: give [source_file, target_file] (one sentence per line, plain or "
            ".gz), one two-column .tsv, or Hub-layout .parquet/.json/.jsonl files"
        )
    try:
        return datasets.Dataset.from_generator(
            generator, features=_PAIR, gen_kwargs=kwargs, cache_dir=cache_dir
        )
    except datasets.exceptions.DatasetGenerationError as e:
        if isinstance(e.__cause__, DataError):  # ours names the file and line; the wrapper does not
            raise e.__cause__ from None
        raise


def select_pair(ds: datasets.Dataset, *, src_lang: str, tgt_lang: str, where: str) -> datasets.Dataset:
    """`src`/`tgt` text columns, from either Hub layout or from our own file readers."""
    if ds.features == _PAIR:
        return ds
    if "translation" in ds.column_names:
        feature = ds.features["translation"]
        languages = list(feature.languages if isinstance(feature, datasets.Translation) else feature)
        found, ds, prefix = f"its `translation` column has {languages}", ds.flatten(), "translation."
    else:
        languages = ds.column_names
        found, prefix = f"it has no `translation` column and its columns are {languages}", ""
    missing = [lang for lang in (src_lang, tgt_lang) if lang not in languages]
    if missing:
        raise DataError(f"{where} has no {missing} text: {found}; set src_lang/tgt_lang to languages it has")
    ds = ds.select_columns([prefix + src_lang, prefix + tgt_lang])
    return ds.rename_columns({prefix + src_lang: "src", prefix + tgt_lang: "tgt"})


# ---- tokenising and filtering -------------------------------------------------------------------


class Status(IntEnum):
    """What becomes of a pair; stored per row by the tokenising map (an int8 column: the values are
    part of every cached split, so they never change), counted with np.bincount, then filtered on."""

    KEEP = 0
    EMPTY = 1  # training: a side without tokens; evaluation: a source without (it has no keys)
    TOO_LONG = 2  # training: a side over max_tokens_per_sentence
    BAD_RATIO = 3  # training: one side over max_length_ratio times the other
    TRUNCATED = 4  # evaluation only: kept, but cut to max_tokens_per_sentence


KEPT = (Status.KEEP, Status.TRUNCATED)


def status_of(src: int, tgt: int, *, max_len: int, max_ratio: float, evaluation: bool) -> Status:
    """The fate of a pair of `src` and `tgt` tokens."""
    if evaluation:  # scores must cover every reference: cut, don't drop; but an empty source has no keys
        return Status.EMPTY if src == 0 else Status.TRUNCATED if max(src, tgt) > max_len else Status.KEEP
    if src == 0 or tgt == 0:
        return Status.EMPTY
    if max(src, tgt) > max_len:
        return Status.TOO_LONG
    return Status.BAD_RATIO if max(src, tgt) > max_ratio * min(src, tgt) else Status.KEEP


def tokenize_batch(
    batch: dict, indices: list[int], *, tokenizer: Tokenizer, max_len: int, max_ratio: float, evaluation: bool,
    source_tag: int | None = None, target_tag: int | None = None, direction: int | None = None,
) -> dict:
    """Ids, sizes and statuses of a batch of pairs. A multilingual run's tag (the id of the target language's tag)
    starts every source (`source_tag`) or every target (`target_tag`, the decoder's first token), counted in its
    length (a side empty but for it is still empty); each row records its `direction`."""
    src_ids = tokenizer.encode_source([text or "" for text in batch["src"]])
    tgt_ids = tokenizer.encode_target([text or "" for text in batch["tgt"]])
    # An empty source is one without text tokens (a Marian source of an empty text is its eos alone)
    src_tag = [source_tag] if source_tag is not None else []
    tgt_tag = [target_tag] if target_tag is not None else []
    status = [
        status_of(len(s) + len(src_tag) if tokenizer.source_tokens(s) else 0, len(t) + len(tgt_tag) if t else 0,
                  max_len=max_len, max_ratio=max_ratio, evaluation=evaluation)
        for s, t in zip(src_ids, tgt_ids, strict=True)
    ]
    # Dropped pairs are filtered out next, so store no ids for them; kept ones are cut to max_len.
    src_ids = [[*src_tag, *tokenizer.cut_source(s, max_len - len(src_tag))] if code in KEPT else []
               for s, code in zip(src_ids, status, strict=True)]
    tgt_ids = [[*tgt_tag, *t[: max_len - len(tgt_tag)]] if code in KEPT else []
               for t, code in zip(tgt_ids, status, strict=True)]
    sizes = [max(len(s), len(t) + 1) for s, t in zip(src_ids, tgt_ids, strict=True)]
    out = {"src_ids": src_ids, "tgt_ids": tgt_ids, "size": sizes, "status": status, "index": indices}
    return out if direction is None else {**out, "direction": [direction] * len(indices)}


def is_kept(status: list[int]) -> list[bool]:
    return [s in KEPT for s in status]


_IDS = datasets.List(datasets.Value("int32"))
TOKENIZED = {"src_ids": _IDS, "tgt_ids": _IDS, "size": datasets.Value("int32"),
              "status": datasets.Value("int8"), "index": datasets.Value("int64")}  # fmt: skip


# ---- the data module ----------------------------------------------------------------------------
