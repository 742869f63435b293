"""Parallel text → tokenised, filtered, token-budget batches, for Lightning.

Sources, per split (files win over the Hub when both are given):
  * `*_files`: [source.txt, target.txt] (plain or .gz, line-parallel), one two-column .tsv, or
    Hub-layout .parquet/.json/.jsonl files;
  * `hf_name` (+ `hf_config` / `hf_data_dir`): `datasets.load_dataset` by Hub name or local folder.
  Hub-layout rows have a `translation` column of {lang: text} (wmt/wmt14) or a column per
  language (bentrevett/multi30k).

Batches (`src`, `tgt_in`, `tgt_out`, and for validation/test `src_text`, `ref_text`, `index`) and
the token budget are described in batching.py.

Several directions (a multilingual model: `directions`, each a training/directions.py `Direction` with its own
languages and data): the tokenizer gets a tag for each target language, every source starts with its target's
tag (on the encoder side, as Johnson et al. 2017 and OPUS-MT put it; with `target_tag: decoder` every target does,
as its first token), an epoch draws each direction's pairs in its
temperature share, and evaluation splits are every direction's together, each row with its direction.

Distributed: the batch sampler deals batches to ranks itself, so fit.py builds the Trainer with
`use_distributed_sampler=False` (without it Lightning stops under DDP with a TypeError saying so).
Every rank gets the same number of batches: the batch list is padded to a multiple of the world
size by repeating batches from its start.

Resuming: the training loader is a ResumableLoader, so a checkpoint records where in its epoch
training was and a resumed run trains on the rest of that epoch's batches, in order.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, Literal

import datasets
import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from seq2seq.text.bpe_dropout import Resegmenter
from seq2seq.text.tokenizer import TARGET_TAGS, Tokenizer, TokenizerFileError
from seq2seq.training.batching import TokenBatchSampler, collate
from seq2seq.training.budget import CPU_MAX_TOKENS
from seq2seq.training.corpus import (
    KEPT,
    TOKENIZED,
    DataError,
    Status,
    info,
    is_kept,
    load_files,
    os_reason,
    select_pair,
    tokenize_batch,
)
from seq2seq.training.directions import Direction, check_directions, sampling_shares, shares_report
from seq2seq.training.pretrained import load_pretrained
from seq2seq.training.resplit import ResplitPairs

log = logging.getLogger(__name__)


class ResumableLoader(DataLoader):
    """A DataLoader whose place in the epoch goes into checkpoints.

    Lightning saves `state_dict()` of the training loader itself (not of its sampler) and hands it
    back to `load_state_dict` on resume, before it iterates. The count of batches trained comes
    from the trainer's loop: counting what the loader handed out would include the batches that
    Lightning's fetcher (and worker processes) fetched ahead but never trained on.
    """

    def __init__(self, *args, batches_done: Callable[[], int], **kwargs):
        super().__init__(*args, **kwargs)
        self.batches_done = batches_done

    def state_dict(self) -> dict[str, Any]:
        assert isinstance(self.batch_sampler, TokenBatchSampler)
        return self.batch_sampler.state_dict(batches_done=self.batches_done())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert isinstance(self.batch_sampler, TokenBatchSampler)
        self.batch_sampler.load_state_dict(state)


class TranslationDataModule(L.LightningDataModule):
    """Parallel data for one direction, `src_lang` → `tgt_lang`, or for several, `directions` (sources: module
    docstring).

    If `tokenizer_path` does not exist, a tokenizer is trained on the training split and saved
    there; one process trains, under a file lock, while the others wait, then all load it.
    """

    def __init__(
        self,
        *,
        src_lang: str | None = None,
        tgt_lang: str | None = None,
        directions: list[Direction] | None = None,
        temperature: float = 5.0,
        target_tag: str = "encoder",
        tokenizer_path: str | None = None,
        vocab_size: int = 8000,
        tokenizer_model_type: str = "bpe",
        character_coverage: float = 1.0,
        tokenizer_max_sentences: int = 2_000_000,
        hf_name: str | None = None,
        hf_config: str | None = None,
        hf_data_dir: str | None = None,
        train_split: str = "train",
        valid_split: str | None = "validation",
        test_split: str | None = "test",
        train_files: list[str] | None = None,
        valid_files: list[str] | None = None,
        test_files: list[str] | None = None,
        max_tokens_per_sentence: int = 256,
        max_length_ratio: float = 3.0,
        max_tokens: int | Literal["auto"] = 4096,
        bpe_dropout: float = 0.0,
        shuffle_window: int = 100_000,
        seed: int = 0,
        num_workers: int = 0,
        num_proc: int = 1,
        cache_dir: str | None = None,
        init_from: str | None = None,
    ) -> None:
        """
        Args:
            src_lang: source language code as the data names it (`de`).
            tgt_lang: target language code (`en`).
            directions: in place of src_lang and tgt_lang and the data options (hf_name, *_files), a multilingual
                run's directions, each with its languages, its data and a weight.
            temperature: how evenly an epoch draws the directions: 1 in proportion to their sizes (times their
                weights), higher towards equal shares (training/directions.py).
            target_tag: where a multilingual run puts the target language's tag: `encoder` (first in the source)
                or `decoder` (the target's first token, forced when translating).
            tokenizer_path: the sentencepiece .model file; trained and written if missing. With
                init_from: optional; the pretrained tokenizer is written there, or must be what is there.
            vocab_size: pieces of a tokenizer trained here.
            tokenizer_model_type: `bpe` or `unigram`, for a tokenizer trained here.
            character_coverage: sentencepiece's share of characters given their own piece.
            tokenizer_max_sentences: lines (source and target together) sampled to train it.
            hf_name: a Hub dataset name, or a local folder laid out like one.
            hf_config: its configuration, e.g. `de-en`.
            hf_data_dir: the sub-folder holding the files, for a folder whose README.md names no configs.
            train_split: split name in the hf_name dataset.
            valid_split: split name in the hf_name dataset; None for no validation.
            test_split: split name in the hf_name dataset; None for none.
            train_files: local files in place of hf_name: [source, target] (plain or .gz), [one.tsv],
                or Hub-layout .parquet/.json/.jsonl files.
            valid_files: the same, for validation.
            test_files: the same, for test.
            max_tokens_per_sentence: training pairs with a longer side are dropped, evaluation
                pairs cut to it.
            max_length_ratio: training pairs whose longer side has more times the tokens of the
                shorter are dropped.
            max_tokens: a batch's budget of padded positions, B * max(len(src), len(tgt) + 1), per device; `auto`:
                on a GPU the largest whose training step fits its memory (measured as training starts, kept by a
                resume: training/budget.py), on a CPU 4,096.
            bpe_dropout: BPE-dropout's probability (Provilkov et al. 2020; 0.1 in the paper): each epoch splits the
                training pairs' words into smaller pieces of the vocabulary, each merge skipped with this probability
                (text/bpe_dropout.py); 0, the default: the tokenizer's own pieces. Needs a BPE tokenizer trained here.
            shuffle_window: pairs sorted by length together; larger packs tighter, smaller mixes more.
            seed: epoch e's training order comes from (seed, e).
            num_workers: DataLoader worker processes.
            num_proc: processes for tokenising (datasets.map).
            cache_dir: where datasets keeps its Arrow files (default: ~/.cache/huggingface/datasets).
            init_from: the checkpoint a fine-tuning run starts from, whose tokenizer is used (nothing is
                trained); `python -m seq2seq.fit` links it from model.init_from.
        """
        super().__init__()
        if tokenizer_path is None and init_from is None:
            raise DataError("data.tokenizer_path is missing: name the sentencepiece model to train (or to use, if it "
                            "exists), e.g. checkpoints/run/spm.model")
        if directions is not None:
            given = [name for name, value in (("src_lang", src_lang), ("tgt_lang", tgt_lang), ("hf_name", hf_name),
                     ("train_files", train_files), ("valid_files", valid_files), ("test_files", test_files)) if value]
            if given:
                raise DataError(f"data.directions is given, and so is data.{', data.'.join(given)}: give each "
                                "direction's languages and data inside its entry of directions")
            if target_tag not in TARGET_TAGS:
                raise DataError(f"data.target_tag is {target_tag!r}; give one of {', '.join(TARGET_TAGS)}")
            try:
                check_directions(directions)
                sampling_shares([1], weights=[1], temperature=temperature)  # (a temperature it can take)
            except ValueError as error:
                raise DataError(f"data.directions: {error}") from None
        elif target_tag != "encoder":
            raise DataError("data.target_tag is for data.directions (a multilingual model); leave it out for one pair")
        elif src_lang is None or tgt_lang is None:
            raise DataError("data.src_lang and data.tgt_lang are missing: name the source and target languages "
                            "(de, en), or give data.directions for a multilingual model")
        elif src_lang == tgt_lang:
            raise DataError(f"src_lang and tgt_lang are both {src_lang!r}; choose two languages")
        if max_tokens != "auto" and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
            raise DataError(f"data.max_tokens must be a number of padded positions or auto, got {max_tokens!r}")
        if max_tokens != "auto" and max_tokens < max_tokens_per_sentence + 1:
            raise DataError(
                f"max_tokens={max_tokens} cannot hold one pair of max_tokens_per_sentence="
                f"{max_tokens_per_sentence} tokens (+1 for BOS/EOS); raise max_tokens or lower the other"
            )
        if isinstance(bpe_dropout, bool) or not isinstance(bpe_dropout, int | float) or not 0 <= bpe_dropout < 1:
            raise DataError(f"data.bpe_dropout is {bpe_dropout!r}: give a probability from 0 (off) up to, not "
                            "including, 1; 0.1 is the paper's")
        # Every argument, by name, in self.hparams (and so in checkpoints): the methods read them there.
        # Copied to attributes only where other code reads them so: module.py (the languages), fit.py.
        self.save_hyperparameters(ignore=["directions"])
        # As plain data (a checkpoint's hyperparameters load with weights_only=True, which reads no classes of ours)
        self.hparams["directions"] = None if directions is None else [asdict(d) for d in directions]
        self.src_lang, self.tgt_lang, self.tokenizer_path = src_lang or "", tgt_lang or "", tokenizer_path
        self.directions = directions  # None: one direction, src_lang → tgt_lang
        self.target_tag = target_tag
        self.max_tokens_per_sentence = max_tokens_per_sentence
        self.max_tokens: int | None = None if max_tokens == "auto" else max_tokens  # auto: until use_max_tokens
        self._tokenizer: Tokenizer | None = None
        self.datasets: dict[str, datasets.Dataset] = {}  # "train"/"valid"/"test": tokenised, filtered
        self.sizes: dict[str, np.ndarray] = {}  # (N,) padded positions of each pair in `datasets`
        self.groups: dict[str, np.ndarray] = {}  # (N,) each pair's index in `directions` (several directions)
        self.resplit: ResplitPairs | None = None  # the training pairs' pieces by epoch, under BPE-dropout
        self.reported: set[str] = set()  # splits whose counts were shown (prepare_data, then setup, build each)

    # ---- the tokenizer --------------------------------------------------------------------------

    def load_tokenizer(self) -> Tokenizer:
        """The tokenizer at tokenizer_path, loaded once. If the file is missing, one is trained on the
        training split first and written there (minutes on WMT): by one process, the others waiting."""
        if self._tokenizer is None:
            self._tokenizer = self._load_or_train_tokenizer()
        return self._tokenizer

    # Attributes because they are read as attributes: LightningCLI's link of `data.vocab_size` to the
    # model's (fit.py) reads `vocab_size` as soon as it has built this object, before the model and before
    # any hook of ours, so that is when a missing tokenizer is trained; module.py and fit.py read
    # `tokenizer`. Both are load_tokenizer, which the data module's own code calls by name (in _build).
    @property
    def tokenizer(self) -> Tokenizer:
        return self.load_tokenizer()

    @property
    def vocab_size(self) -> int:
        return self.load_tokenizer().vocab_size

    @property
    def target_languages(self) -> list[str]:
        """The languages the tokenizer needs a tag for: every direction's target (none for one direction)."""
        return list(dict.fromkeys(d.tgt_lang for d in self.directions or ()))

    def _load_or_train_tokenizer(self) -> Tokenizer:
        tokenizer = self._pretrained_tokenizer() if self.hparams["init_from"] is not None else self._own_tokenizer()
        missing = [lang for lang in self.target_languages if lang not in tokenizer.languages]
        if missing:
            where = (f"model.init_from {self.hparams['init_from']}" if self.hparams["init_from"] is not None
                     else f"data.tokenizer_path: {self.tokenizer_path}")
            raise DataError(f"{where} has no language tag for {', '.join(missing)}, which data.directions translate "
                            "into: a tokenizer trained for these directions has one (delete the file to train it)")
        return tokenizer

    def _own_tokenizer(self) -> Tokenizer:
        assert self.tokenizer_path is not None  # __init__ refuses a run with neither
        hp, path = self.hparams, Path(self.tokenizer_path)
        read: dict[str, Any] = {}  # if a tokenizer is trained here: when reading began, what was read

        def training_text() -> Iterator[str]:
            read["start"], read["raw"] = time.perf_counter(), [self._load_raw("train", d) for d in self._directions()]
            batches = (batch for raw in read["raw"] for batch in raw.iter(batch_size=10_000))
            return (text for batch in batches for text in batch["src"] + batch["tgt"])

        try:
            tokenizer = Tokenizer.load_or_train(
                path, training_text, vocab_size=hp["vocab_size"], model_type=hp["tokenizer_model_type"],
                character_coverage=hp["character_coverage"], max_sentences=hp["tokenizer_max_sentences"],
                seed=hp["seed"], languages=self.target_languages,
            )  # fmt: skip
        except TokenizerFileError as failed:
            raise self._tokenizer_error(failed) from None
        if read:
            seconds = time.perf_counter() - read["start"]
            info(f"trained {path} on {sum(raw.num_rows for raw in read['raw'])} pairs in {seconds:.1f}s")
        return tokenizer

    def _pretrained_tokenizer(self) -> Tokenizer:
        """init_from's tokenizer; written to tokenizer_path if that is given and missing (the run's folder then
        holds its tokenizer, as a run that trained one does), refused if a different one is there."""
        init_from = self.hparams["init_from"]
        tokenizer = Tokenizer.from_bytes(load_pretrained(init_from).tokenizer)  # checked by read_inference
        if self.tokenizer_path is None:
            return tokenizer
        path = Path(self.tokenizer_path)
        try:
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
                partial.write_bytes(tokenizer.to_bytes())
                os.replace(partial, path)  # atomic: every DDP rank writes the same bytes
            elif path.read_bytes() != tokenizer.to_bytes():
                raise DataError(f"data.tokenizer_path: {path} is not the tokenizer of model.init_from {init_from}, "
                                "whose weights need their own: leave tokenizer_path out, or name a new file (the "
                                "pretrained tokenizer is written there)")
        except OSError as error:
            raise DataError(f"data.tokenizer_path: cannot write {path} ({os_reason(error)}); leave it out, or "
                            "choose a folder you can write to") from None
        return tokenizer

    def _tokenizer_error(self, failed: TokenizerFileError) -> DataError:
        """The failure in the words of our options: data.tokenizer_path, where the training text is from."""
        path, error = failed.path, failed.error
        if failed.step == "train":
            train_files = self.hparams["train_files"]
            where = ("data.directions' training data" if self.directions is not None else f"train_files={train_files}"
                     if train_files else f"hf_name={self.hparams['hf_name']!r}")
            return DataError(f"cannot train the tokenizer on {where}: {error}")
        if failed.step == "load":
            return DataError(f"data.tokenizer_path: {path} is not a usable sentencepiece model ({error}); "
                             "delete it to train a new one")
        assert isinstance(error, OSError)  # the one error of a write
        return DataError(f"data.tokenizer_path: cannot write {path} ({os_reason(error)}); choose a folder "
                         "you can write to, or fix its permissions")

    # ---- splits ---------------------------------------------------------------------------------

    @property
    def has_validation(self) -> bool:
        return self._has("valid")

    def _directions(self) -> list[Direction | None]:
        """Each direction's entry; [None] for one direction (its data: the module's own options)."""
        return list(self.directions) if self.directions is not None else [None]

    def _has(self, split: str, direction: Direction | None = None) -> bool:
        """Whether `direction` (by default: any direction) has data for `split`."""
        if direction is None and self.directions is not None:
            return any(self._has(split, d) for d in self.directions)
        where = self.hparams if direction is None else vars(direction)
        from_hub = where["hf_name"] is not None and self.hparams[f"{split}_split"] is not None
        return where[f"{split}_files"] is not None or from_hub

    def _load_raw(self, split: str, direction: Direction | None = None) -> datasets.Dataset:
        """The split as `src`/`tgt` text columns, as read: the module's own data, or `direction`'s."""
        hp, option = self.hparams, f"{split}_files"
        where_from = hp if direction is None else vars(direction)
        files, hf_name, hf_split = where_from[option], where_from["hf_name"], hp[f"{split}_split"]
        if direction is not None:
            option = f"direction {direction.name}: {option}"
        if files is not None:
            ds, where = load_files(files, option=option, cache_dir=hp["cache_dir"]), option
        elif hf_name is not None and hf_split is not None:
            where = f"hf_name={hf_name!r} (hf_config={where_from['hf_config']!r}, split {hf_split!r})"
            try:
                ds = datasets.load_dataset(
                    hf_name, where_from["hf_config"], data_dir=where_from["hf_data_dir"], split=hf_split,
                    cache_dir=hp["cache_dir"],
                )  # fmt: skip
            except (ValueError, FileNotFoundError, ConnectionError) as e:
                raise DataError(f"cannot load {where}: {e}") from e
        else:
            raise DataError(f"no {split} data: set {option}, or hf_name (with {split}_split)")
        if direction is None:
            return select_pair(ds, src_lang=self.src_lang, tgt_lang=self.tgt_lang, where=where)
        return select_pair(ds, src_lang=direction.src_lang, tgt_lang=direction.tgt_lang, where=where)

    def _build(self, split: str) -> tuple[datasets.Dataset, np.ndarray, np.ndarray]:
        """Tokenise and filter a split (datasets caches both as Arrow), every direction's that has it; log what
        was dropped. The pairs, their sizes and their directions (indices into `directions`; zeros for one)."""
        # (one direction: its split, or _load_raw's line saying what to set)
        parts = [(k, self._tokenized(split, k, d)) for k, d in enumerate(self._directions())
                 if d is None or self._has(split, d)]
        if not parts:
            raise DataError(f"no {split} data: no entry of data.directions has {split}_files or hf_name "
                            f"(with data.{split}_split)")
        tokenized = parts[0][1] if len(parts) == 1 else datasets.concatenate_datasets([part for _, part in parts])
        status = tokenized.data.column("status").to_numpy()
        kept = np.isin(status, KEPT)
        groups = np.concatenate([np.full(len(part), k, dtype=np.int64) for k, part in parts])[kept]
        filtered = tokenized.filter(is_kept, input_columns="status", batched=True, desc=f"filtering {split}")
        sizes = tokenized.data.column("size").to_numpy()[kept]
        if self.directions is not None and split == "train" and split not in self.reported:
            info(shares_report(self.directions, pairs=np.bincount(groups, minlength=len(self.directions)),
                               temperature=self.hparams["temperature"]))
            self.reported.add(split)
        return filtered, sizes, groups

    def _tokenized(self, split: str, k: int, direction: Direction | None) -> datasets.Dataset:
        """One direction's split tokenised (a multilingual source after its target's tag), each pair's status."""
        raw, evaluation, tokenizer = self._load_raw(split, direction), split != "train", self.load_tokenizer()
        max_len, max_ratio = self.max_tokens_per_sentence, self.hparams["max_length_ratio"]
        limits = {"max_len": max_len, "max_ratio": max_ratio, "evaluation": evaluation}
        side = "source_tag" if self.target_tag == "encoder" else "target_tag"
        tag = {side: tokenizer.tag_id(direction.tgt_lang), "direction": k} if direction is not None else {}
        tokenized = raw.map(
            tokenize_batch,
            batched=True,
            with_indices=True,
            fn_kwargs={"tokenizer": tokenizer, **limits, **tag},
            remove_columns=[] if evaluation else ["src", "tgt"],  # training needs no text
            features=datasets.Features({**(raw.features if evaluation else {}), **TOKENIZED,
                                        **({"direction": datasets.Value("int32")} if tag else {})}),
            num_proc=self.hparams["num_proc"] if self.hparams["num_proc"] > 1 else None,
            # The sentencepiece processor does not hash stably, so name the result ourselves.
            new_fingerprint=datasets.fingerprint.Hasher.hash(
                [raw._fingerprint, hashlib.sha256(tokenizer.to_bytes()).hexdigest(), limits, "v1", *tag.items()]
            ),
            desc=f"tokenising {split}" + (f" {direction.name}" if direction is not None else ""),
        )
        status = tokenized.data.column("status").to_numpy()
        counts, kept = np.bincount(status, minlength=len(Status)), np.isin(status, KEPT)
        reasons = {Status.EMPTY: "with an empty source" if evaluation else "with an empty side"}
        if not evaluation:
            reasons[Status.TOO_LONG] = f"with a side over max_tokens_per_sentence={max_len}"
            reasons[Status.BAD_RATIO] = f"with a length ratio over max_length_ratio={max_ratio}"
        name = split if direction is None else f"{split} {direction.name}"
        report = f"{name}: {len(status)} pairs read; " + ", ".join(
            f"dropped {counts[code]} {reason}" for code, reason in reasons.items()
        )
        report += f"; cut {counts[Status.TRUNCATED]} to max_tokens_per_sentence" if evaluation else ""
        report += f"; kept {int(kept.sum())}"
        if not kept.any():
            raise DataError(f"no {name} data left after filtering: {report}")
        if name not in self.reported:
            info(report)
            self.reported.add(name)
        return tokenized

    def prepare_data(self) -> None:
        # One process per node tokenises everything once; `setup` on every rank then reads caches.
        for split in ("train", "valid", "test"):
            if self._has(split):
                self._build(split)

    def setup(self, stage: str) -> None:
        # Validation is optional while fitting; a split asked for by name must exist.
        fit = ["train", "valid"] if self._has("valid") else ["train"]
        for split in {"fit": fit, "validate": ["valid"], "test": ["test"]}.get(stage, []):
            if split not in self.datasets:
                self.datasets[split], self.sizes[split], self.groups[split] = self._build(split)
        if stage == "fit" and self.hparams["bpe_dropout"] > 0 and self.resplit is None:
            self.resplit = self._resplit()

    def _resplit(self) -> ResplitPairs:
        """The training pairs' BPE-dropout pieces (pools drawn once per run: seconds on Multi30k)."""
        started, tokenizer, train = time.perf_counter(), self.load_tokenizer(), self.datasets["train"]
        common = {"tokenizer": tokenizer, "p": self.hparams["bpe_dropout"], "max_len": self.max_tokens_per_sentence}
        try:
            src = Resegmenter(train["src_ids"], seed=self.hparams["seed"], **common)
            tgt = Resegmenter(train["tgt_ids"], seed=self.hparams["seed"] + 1, **common)
        except ValueError as error:
            raise DataError(f"data.bpe_dropout: {error}") from None
        info(f"BPE-dropout {self.hparams['bpe_dropout']}: {src.word_types} source and {tgt.word_types} target word "
             f"types, {src.pool_entries + tgt.pool_entries} segmentations drawn in "
             f"{time.perf_counter() - started:.1f} s")
        return ResplitPairs(src=src, tgt=tgt)

    # ---- loaders --------------------------------------------------------------------------------

    def _loader(self, split: str) -> DataLoader:
        hp, tokenizer = self.hparams, self.load_tokenizer()
        if self.trainer is not None:
            rank, world_size = self.trainer.global_rank, self.trainer.world_size
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            rank, world_size = 0, 1
        # several directions' training pairs: an epoch's drawn in the directions' shares
        shares = sampling_shares(np.bincount(self.groups[split], minlength=len(self.directions)).tolist(),
                                 weights=[d.weight for d in self.directions], temperature=hp["temperature"],
                                 ) if self.directions is not None and split == "train" else None
        # (under BPE-dropout the training pairs are read by epoch: the sampler yields (epoch, row) keys for them)
        pairs = self.resplit if split == "train" and self.resplit is not None else self.datasets[split]
        sampler = TokenBatchSampler(
            self.sizes[split],
            max_tokens=self.max_tokens or CPU_MAX_TOKENS,
            shuffle=split == "train",
            shuffle_window=hp["shuffle_window"],
            seed=hp["seed"],
            rank=rank,
            world_size=world_size,
            groups=self.groups[split] if shares is not None else None,
            shares=shares,
            epoch_sizes=pairs.sizes if isinstance(pairs, ResplitPairs) else None,
        )
        kwargs: dict[str, Any] = {
            "batch_sampler": sampler,
            "collate_fn": partial(collate, with_text=split != "train", bos=tokenizer.bos_id, eos=tokenizer.eos_id,
                                  pad=tokenizer.pad_id),
            "num_workers": hp["num_workers"],
            "persistent_workers": hp["num_workers"] > 0,
            # Page-locked batches copy to a GPU without blocking the host (Lightning's transfer asks for that)
            "pin_memory": self.trainer is not None and self.trainer.strategy.root_device.type == "cuda",
            # Its own generator: a DataLoader draws its workers' base seed from torch's global RNG at
            # every iter(), which would shift the dropout masks of a resumed run against an unbroken one.
            "generator": torch.Generator().manual_seed(hp["seed"]),
        }
        if hp["num_workers"] > 0:
            # Started fresh (fork + exec), not forked from this process: CPython 3.11 can fork while
            # another of its threads (a loader's queue feeder, tqdm's monitor, gloo's) holds a lock the
            # child then waits on forever (seen: a 2-process DDP run stuck for 10 minutes in
            # PyOS_AfterFork_Child). Not "forkserver" either: a worker is then the fork server's child,
            # so torch's watchdog (is my parent still the trainer?) never fires, and a kill -9 of the
            # run left its workers and the fork server running for good. Workers persist, so the
            # start (imports, the dataset pickled) is paid once per run.
            kwargs["multiprocessing_context"] = "spawn"
        # Why an epoch's batch count is its own, where it is: the pairs' sizes or the pairs themselves change by
        # epoch, or the length-sorted windows hold other pairs each epoch (a single window packs the same sizes alike)
        varies = [why for why, applies in (
            ("data.bpe_dropout", isinstance(pairs, ResplitPairs)),
            ("several directions drawn in shares", shares is not None),
            (f"more pairs than data.shuffle_window={hp['shuffle_window']}", len(self.sizes[split]) > hp["shuffle_window"]),
        ) if applies and split == "train"]
        if varies and self.trainer is not None and \
                getattr(self.trainer, "reload_dataloaders_every_n_epochs", 0) != 1:  # (set by Lightning, untyped)
            # (Lightning reads a loader's length once per build: it validates after batch len(loader) of an
            # epoch and ends the epoch there, so shorter epochs went unvalidated and longer ones lost their last batches)
            raise DataError(f"the training epochs pack their own number of batches here ({', '.join(varies)}), so the "
                            "training loader must be built each epoch: give the Trainer "
                            "reload_dataloaders_every_n_epochs=1 (python -m seq2seq.fit does)")
        if split == "train" and self.trainer is not None:
            # The epoch the loop will train next (restored on a resume), before Lightning's first iter():
            # worker processes start fetching at iter(), before Lightning calls set_epoch.
            sampler.set_epoch(_loop_progress(self.trainer, "epochs"))
            batches_done = partial(_loop_progress, self.trainer, "batches")
            return ResumableLoader(pairs, batches_done=batches_done, **kwargs)
        return DataLoader(pairs, **kwargs)

    def use_max_tokens(self, max_tokens: int) -> None:
        """The budget `max_tokens: auto` resolved to (training/budget.py), before any loader is built."""
        if self.hparams["max_tokens"] != "auto":
            raise ValueError(f"data.max_tokens is {self.hparams['max_tokens']}: a budget is sized only for auto")
        self.max_tokens = max_tokens

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader | list:
        return self._loader("valid") if "valid" in self.datasets else []  # []: no validation

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")


def _loop_progress(trainer: L.Trainer, counter: Literal["epochs", "batches"]) -> int:
    """Epochs the fit loop has trained (the one it trains next; restored on a resume), or batches trained
    of the current epoch. Private loop state, read only here: Lightning has no public count of either
    (`trainer.current_epoch` is the `completed` count, which a resume updates only after the loader is
    built); this `processed` count is what lightning/pytorch/loops/fit_loop.py hands to set_epoch itself.
    Both trackers are typed as their base class; at run time they are a _ProcessedTracker (loops/progress.py).
    """
    loop = trainer.fit_loop
    progress = loop.epoch_progress if counter == "epochs" else loop.epoch_loop.batch_progress
    return progress.current.processed  # type: ignore[attr-defined]
