import gzip
import json
import logging
import multiprocessing
import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import datasets
import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from seq2seq.text.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from seq2seq.training.batching import TokenBatchSampler, collate
from seq2seq.training.corpus import DataError, Status
from seq2seq.training.data import TranslationDataModule


def small(tmp_path: Path, tokenizer_path: str, **kwargs) -> TranslationDataModule:
    """A data module over files under tmp_path, with its own datasets cache."""
    kwargs = {"src_lang": "de", "tgt_lang": "en", "tokenizer_path": tokenizer_path, **kwargs}
    return TranslationDataModule(cache_dir=str(tmp_path / "cache"), **kwargs)


def write_lines(path: Path, lines: list[str]) -> str:
    data = ("\n".join(lines) + "\n").encode("utf-8")
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return str(path)


# ---- batching on Multi30k ------------------------------------------------------------------------


def test_padding_efficiency_and_budget_on_multi30k_train(multi30k: TranslationDataModule) -> None:
    real = padded = pairs = 0
    for batch in multi30k.train_dataloader():
        (b, s), (_, t) = batch["src"].shape, batch["tgt_in"].shape
        assert b * max(s, t) <= 4096  # the documented count: B * max(len(src), len(tgt) + 1)
        real += int((batch["src"] != PAD_ID).sum() + (batch["tgt_in"] != PAD_ID).sum())
        padded += b * s + b * t
        pairs += b
    assert pairs == len(multi30k.datasets["train"]) > 28_900  # every kept pair, once
    assert real / padded >= 0.90


def test_evaluation_batches_are_fixed_and_sorted(multi30k: TranslationDataModule) -> None:
    sampler = multi30k.val_dataloader().batch_sampler
    first = list(sampler)
    sampler.set_epoch(5)
    assert list(sampler) == first
    sizes = multi30k.sizes["valid"][[i for batch in first for i in batch]]
    assert (np.diff(sizes) >= 0).all()


def test_batches_hold_shifted_targets_and_raw_text(
    multi30k: TranslationDataModule, multi30k_lines, tokenizer: Tokenizer
) -> None:
    src_lines, ref_lines = multi30k_lines("val", "de"), multi30k_lines("val", "en")
    batch = next(iter(multi30k.val_dataloader()))
    assert batch["src"].dtype == batch["tgt_in"].dtype == batch["index"].dtype == torch.long
    assert batch["src_text"] == [src_lines[i] for i in batch["index"].tolist()]
    assert batch["ref_text"] == [ref_lines[i] for i in batch["index"].tolist()]
    assert (batch["tgt_in"][:, 0] == BOS_ID).all()
    for tgt_in, tgt_out, ref in zip(batch["tgt_in"], batch["tgt_out"], batch["ref_text"], strict=True):
        y = tokenizer.encode_target([ref])[0]
        assert tgt_in.tolist() == [BOS_ID, *y] + [PAD_ID] * (len(tgt_in) - len(y) - 1)
        assert tgt_out.tolist() == [*y, EOS_ID] + [PAD_ID] * (len(tgt_out) - len(y) - 1)
    train = next(iter(multi30k.train_dataloader()))
    assert set(train) == {"src", "tgt_in", "tgt_out", "target_positions"}
    real = (train["tgt_out"] != PAD_ID).flatten()
    assert torch.equal(train["target_positions"], torch.arange(real.numel())[real])  # in order, the non-pad ones


# ---- Lightning --------------------------------------------------------------------------------


class Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.seen: dict[int, list[int]] = {}
        self.val_rows = 0

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen.setdefault(self.current_epoch, []).append(int(batch["src"].sum()))
        return (self.w * batch["src"].float().mean()).sum()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        assert len(batch["ref_text"]) == len(batch["index"]) == len(batch["src"])
        self.val_rows += len(batch["index"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_reshuffles_every_epoch(tmp_path: Path, multi30k_dir: Path, tokenizer_path: str) -> None:
    val = [str(multi30k_dir / "val.de.gz"), str(multi30k_dir / "val.en.gz")]
    dm = small(tmp_path, tokenizer_path, train_files=val, valid_files=val, max_tokens=1024)
    module = Recorder()
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # what fit.py sets: the batch sampler deals out batches itself
    )
    trainer.fit(module, datamodule=dm)
    sampler = TokenBatchSampler(dm.sizes["train"], max_tokens=1024, shuffle=True)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        rows = [[dm.datasets["train"][i] for i in batch] for batch in sampler]
        expected = [int(collate(r, with_text=False, bos=2, eos=3, pad=0)["src"].sum()) for r in rows]
        assert module.seen[epoch] == expected  # Lightning called set_epoch(epoch) before the epoch
    assert module.seen[0] != module.seen[1]
    assert module.val_rows == 2 * 1014  # two epochs, no pair lost


@pytest.mark.parametrize(("device", "pinned"), [("cpu", False), ("cuda", True)])
def test_rank_world_size_and_epoch_come_from_the_trainer(multi30k: TranslationDataModule, device: str,
                                                         pinned: bool) -> None:
    """...and whether batches are page-locked: for a GPU's copies, which then do not block the host."""
    progress = SimpleNamespace(epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=3)))
    strategy = SimpleNamespace(root_device=torch.device(device))
    multi30k.trainer = SimpleNamespace(global_rank=1, world_size=2, fit_loop=progress, strategy=strategy)
    try:
        loader = multi30k.train_dataloader()
        sampler = loader.batch_sampler
        # The epoch is set before Lightning's first iter(), which loader workers fetch ahead from.
        assert (sampler.rank, sampler.world_size, sampler.epoch) == (1, 2, 3)
        assert loader.pin_memory is pinned
    finally:
        multi30k.trainer = None


# ---- Hub layouts ------------------------------------------------------------------------------

HUB_README = """---
configs:
- config_name: de-en
  data_files:
  - split: train
    path: de-en/train-*
  - split: validation
    path: de-en/validation-*
  - split: test
    path: de-en/test-*
---
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, multi30k_lines) -> SimpleNamespace:
    """Multi30k val/test pairs as parquet in two Hub layouts (wmt/wmt14 and bentrevett/multi30k)."""
    de, en = multi30k_lines("val", "de"), multi30k_lines("val", "en")
    parts = {"train": slice(0, 600), "validation": slice(600, 800), "test": slice(800, 1014)}
    root = tmp_path_factory.mktemp("hub")
    (root / "wmt" / "de-en").mkdir(parents=True)
    (root / "wmt" / "README.md").write_text(HUB_README)  # names the config, as on the Hub
    (root / "flat" / "data").mkdir(parents=True)
    for split, part in parts.items():
        pairs = [{"de": d, "en": e} for d, e in zip(de[part], en[part], strict=True)]
        pq.write_table(
            pa.table({"translation": pairs}), root / "wmt" / "de-en" / f"{split}-00000-of-00001.parquet"
        )
        pq.write_table(
            pa.table({"en": en[part], "de": de[part]}),
            root / "flat" / "data" / f"{split}-00000-of-00001.parquet",
        )
    return SimpleNamespace(root=root, de=de, en=en)


def texts(dm: TranslationDataModule, split: str) -> tuple[list[str], list[str]]:
    """(source texts, reference texts) of an evaluation split, in the split's order."""
    loader = dm.val_dataloader() if split == "valid" else dm.test_dataloader()
    rows = {}
    for batch in loader:
        pairs = zip(batch["src_text"], batch["ref_text"], strict=True)
        rows.update(zip(batch["index"].tolist(), pairs, strict=True))
    in_order = [rows[i] for i in sorted(rows)]
    return [src for src, _ in in_order], [ref for _, ref in in_order]


def test_hub_translation_column_by_config(tmp_path: Path, hub: SimpleNamespace, tokenizer_path: str) -> None:
    dm = small(tmp_path, tokenizer_path, hf_name=str(hub.root / "wmt"), hf_config="de-en")
    dm.setup("fit")
    dm.setup("test")
    assert len(dm.datasets["train"]) == 600
    assert texts(dm, "valid") == (hub.de[600:800], hub.en[600:800])
    assert texts(dm, "test") == (hub.de[800:], hub.en[800:])


def test_hub_flat_columns_other_direction(tmp_path: Path, hub: SimpleNamespace, tokenizer_path: str) -> None:
    dm = small(
        tmp_path,
        tokenizer_path,
        src_lang="en",
        tgt_lang="de",
        hf_name=str(hub.root / "flat"),
        hf_data_dir="data",
    )
    dm.setup("validate")
    assert texts(dm, "valid") == (hub.en[600:800], hub.de[600:800])


def test_local_parquet_and_json_files(tmp_path: Path, hub: SimpleNamespace, tokenizer_path: str) -> None:
    jsonl = tmp_path / "valid.jsonl"
    rows = [
        {"translation": {"de": d, "en": e}} for d, e in zip(hub.de[600:800], hub.en[600:800], strict=True)
    ]
    jsonl.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    dm = small(
        tmp_path,
        tokenizer_path,
        train_files=[str(hub.root / "flat" / "data" / "train-00000-of-00001.parquet")],
        valid_files=[str(jsonl)],
    )
    dm.setup("fit")
    assert len(dm.datasets["train"]) == 600
    assert texts(dm, "valid") == (hub.de[600:800], hub.en[600:800])


@pytest.mark.parametrize("layout", ["wmt", "flat"])
def test_hub_dataset_without_the_language(
    tmp_path: Path, hub: SimpleNamespace, tokenizer_path: str, layout: str
) -> None:
    dm = small(
        tmp_path,
        tokenizer_path,
        src_lang="fr",
        hf_name=str(hub.root / layout),
        hf_config="de-en" if layout == "wmt" else None,
    )
    with pytest.raises(DataError, match=r"no \['fr'\] text") as error:
        dm.setup("fit")
    assert "'de'" in str(error.value) and "'en'" in str(error.value)  # the languages it does have


def test_hub_name_that_cannot_be_loaded(tmp_path: Path, tokenizer_path: str) -> None:
    dm = small(tmp_path, tokenizer_path, hf_name="no-such-user/no-such-dataset", hf_config="de-en")
    with pytest.raises(DataError, match="cannot load hf_name='no-such-user/no-such-dataset'"):
        dm.setup("fit")


# ---- local text files and bad input -----------------------------------------------------------


def test_text_gz_and_tsv_files_give_the_same_pairs(
    tmp_path: Path, multi30k_lines, tokenizer_path: str
) -> None:
    de, en = multi30k_lines("val", "de", 300), multi30k_lines("val", "en", 300)
    src, tgt = write_lines(tmp_path / "v.de", de), write_lines(tmp_path / "v.en.gz", en)
    tsv = write_lines(tmp_path / "v.tsv", [f"{d}\t{e}" for d, e in zip(de, en, strict=True)])
    for files in ([src, tgt], [tsv]):
        dm = small(tmp_path, tokenizer_path, train_files=[src, tgt], valid_files=files)
        dm.setup("validate")
        assert texts(dm, "valid") == (de, en)


def test_an_edited_file_is_read_again(tmp_path: Path, tokenizer_path: str) -> None:
    src, tgt = tmp_path / "v.de", tmp_path / "v.en"
    for de in (["Ein Hund."], ["Ein Hund.", "Eine Katze."]):
        write_lines(src, de)
        write_lines(tgt, ["A dog.", "A cat."][: len(de)])
        dm = small(
            tmp_path, tokenizer_path, train_files=[str(src), str(tgt)], valid_files=[str(src), str(tgt)]
        )
        dm.setup("validate")
        assert texts(dm, "valid")[0] == de  # not the cached first version


def test_files_with_different_line_counts(tmp_path: Path, tokenizer_path: str) -> None:
    src, tgt = (
        write_lines(tmp_path / "a.de.gz", ["Ein Hund."] * 3),
        write_lines(tmp_path / "a.en", ["A dog."] * 2),
    )
    dm = small(tmp_path, tokenizer_path, train_files=[src, tgt])
    with pytest.raises(DataError, match=rf"{src} has 3 lines but {tgt} has 2"):
        dm.setup("fit")


def test_missing_file(tmp_path: Path, tokenizer_path: str) -> None:
    src = write_lines(tmp_path / "a.de", ["Ein Hund."])
    dm = small(tmp_path, tokenizer_path, train_files=[src, str(tmp_path / "nowhere.en")])
    with pytest.raises(DataError, match=r"^train_files: .*nowhere\.en does not exist"):
        dm.setup("fit")


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_empty_training_files_are_named(tmp_path: Path, suffix: str) -> None:
    # No tokenizer yet: the first thing done with the files is training one (datasets' own error named no file).
    src, tgt = write_lines(tmp_path / f"a.de{suffix}", []), write_lines(tmp_path / f"a.en{suffix}", [])
    (tmp_path / f"a.de{suffix}").write_bytes(gzip.compress(b"") if suffix else b"")
    (tmp_path / f"a.en{suffix}").write_bytes(gzip.compress(b"") if suffix else b"")
    dm = small(tmp_path, str(tmp_path / "spm.model"), train_files=[src, tgt])
    with pytest.raises(DataError, match=rf"^train_files: {src}, {tgt} are empty; give files with one sentence"):
        _ = dm.tokenizer
    blank = [write_lines(tmp_path / "b.de", ["  ", ""]), write_lines(tmp_path / "b.en", ["", " "])]
    dm = small(tmp_path, str(tmp_path / "spm.model"), train_files=blank)
    with pytest.raises(DataError, match=r"^cannot train the tokenizer on train_files=.*b\.de.*the training text is empty"):
        _ = dm.tokenizer


def test_a_tokenizer_folder_that_cannot_be_written_is_named(tmp_path: Path, multi30k_dir: Path) -> None:
    (tmp_path / "a_file").write_text("in the way", encoding="utf-8")
    path = tmp_path / "a_file" / "spm.model"
    dm = small(tmp_path, str(path), train_files=[str(multi30k_dir / "val.de.gz"), str(multi30k_dir / "val.en.gz")])
    with pytest.raises(DataError, match=rf"^data.tokenizer_path: cannot write {path} \(a file stands where a folder"):
        _ = dm.tokenizer


def test_a_byte_order_mark_is_not_part_of_the_first_sentence(tmp_path: Path, tokenizer_path: str) -> None:
    src = tmp_path / "bom.de"
    src.write_bytes("\ufeffEin Hund.\nZwei Männer.\n".encode())
    tgt = write_lines(tmp_path / "bom.en", ["A dog.", "Two men."])
    dm = small(tmp_path, tokenizer_path, valid_files=[str(src), tgt])
    dm.setup("validate")
    assert texts(dm, "valid")[0] == ["Ein Hund.", "Zwei Männer."]


@pytest.mark.parametrize("name", ["latin1.de", "latin1.de.gz"])
def test_bytes_that_are_not_utf8(tmp_path: Path, tokenizer_path: str, name: str) -> None:
    data = "Ein Hund.\nEin Mädchen.\n".encode("latin-1")
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    dm = small(
        tmp_path,
        tokenizer_path,
        train_files=[str(path), write_lines(tmp_path / "a.en", ["A dog.", "A girl."])],
    )
    with pytest.raises(DataError, match=rf"{path}, line 2: not UTF-8"):
        dm.setup("fit")


def test_tsv_line_without_two_columns(tmp_path: Path, tokenizer_path: str) -> None:
    tsv = write_lines(tmp_path / "a.tsv", ["Ein Hund.\tA dog.", "Ein Hund. A dog."])
    dm = small(tmp_path, tokenizer_path, train_files=[tsv])
    with pytest.raises(DataError, match=rf"{tsv}, line 2: expected 2 tab-separated columns .* found 1"):
        dm.setup("fit")


def test_bad_options(tmp_path: Path, tokenizer_path: str) -> None:
    with pytest.raises(DataError, match="both 'de'"):
        small(tmp_path, tokenizer_path, tgt_lang="de")
    with pytest.raises(DataError, match="max_tokens=100 cannot hold"):
        small(tmp_path, tokenizer_path, max_tokens=100)
    dm = small(tmp_path, tokenizer_path, train_files=["a", "b", "c"])
    with pytest.raises(DataError, match="train_files"):
        dm.setup("fit")
    with pytest.raises(DataError, match="no train data: set train_files, or hf_name"):
        small(tmp_path, tokenizer_path).setup("fit")
    with pytest.raises(DataError, match="no test data: set test_files, or hf_name"):
        small(tmp_path, tokenizer_path).setup("test")


# ---- filtering --------------------------------------------------------------------------------


def test_filters_count_what_they_drop(
    tmp_path: Path, tokenizer_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    long_de = " ".join(["Ein großer brauner Hund läuft über die grüne Wiese."] * 30)  # > 20 tokens
    long_en = " ".join(["A big brown dog runs across the green meadow."] * 30)
    de = ["Ein Hund läuft.", "", "Ein Hund.", long_de, "Ja.", "Zwei Katzen schlafen."]
    en = [
        "A dog runs.",
        "An empty source.",
        "",
        long_en,
        "Yes, a big brown dog runs across the green meadow.",
        "Two cats sleep.",
    ]
    files = [write_lines(tmp_path / "t.de", de), write_lines(tmp_path / "t.en", en)]
    dm = small(tmp_path, tokenizer_path, train_files=files, valid_files=files, max_tokens_per_sentence=20)
    with caplog.at_level(logging.INFO, logger="seq2seq.training"):  # (data.py and corpus.py report)
        dm.setup("fit")
    assert (
        "train: 6 pairs read; dropped 2 with an empty side, dropped 1 with a side over "
        "max_tokens_per_sentence=20, dropped 1 with a length ratio over max_length_ratio=3.0; kept 2"
    ) in caplog.text
    # Evaluation keeps every pair with a source, cutting long ones, so scores cover the references.
    assert (
        "valid: 6 pairs read; dropped 1 with an empty source; cut 1 to max_tokens_per_sentence; kept 5"
        in caplog.text
    )
    assert dm.datasets["valid"]["index"] == [0, 2, 3, 4, 5]
    assert dm.sizes["valid"].max() == 21
    assert dm.datasets["valid"]["tgt"][2] == long_en  # the reference stays whole


def test_status_values_are_those_stored_in_cached_splits() -> None:
    assert {status.name: int(status) for status in Status} == {
        "KEEP": 0, "EMPTY": 1, "TOO_LONG": 2, "BAD_RATIO": 3, "TRUNCATED": 4
    }


def test_nothing_left_after_filtering(tmp_path: Path, tokenizer_path: str) -> None:
    files = [
        write_lines(tmp_path / "t.de", ["Ein Hund läuft schnell."]),
        write_lines(tmp_path / "t.en", ["A dog runs fast."]),
    ]
    dm = small(tmp_path, tokenizer_path, train_files=files, max_tokens_per_sentence=2)
    with pytest.raises(
        DataError,
        match="no train data left after filtering.*dropped 1 with a side over max_tokens_per_sentence=2",
    ):
        dm.setup("fit")


# ---- the tokenizer file and caches ------------------------------------------------------------


def test_tokenizer_is_trained_once_when_missing(tmp_path: Path, multi30k_dir: Path) -> None:
    val = [str(multi30k_dir / "val.de.gz"), str(multi30k_dir / "val.en.gz")]
    path = tmp_path / "tok" / "spm.model"
    dm = small(tmp_path, str(path), train_files=val, vocab_size=700)
    assert dm.vocab_size == 700  # right after __init__, as LightningCLI's link reads it
    assert path.is_file() and not list(path.parent.glob("*.partial"))
    stamp = path.stat().st_mtime_ns
    again = small(tmp_path, str(path), train_files=val, vocab_size=700)
    assert again.tokenizer.to_bytes() == dm.tokenizer.to_bytes() and path.stat().st_mtime_ns == stamp


def test_tokenised_splits_are_cached(
    tmp_path: Path, multi30k_dir: Path, tokenizer_path: str, multi30k_lines
) -> None:
    val = [str(multi30k_dir / "val.de.gz"), str(multi30k_dir / "val.en.gz")]
    first, second = (small(tmp_path, tokenizer_path, train_files=val) for _ in range(2))
    first.setup("fit")
    second.setup("fit")
    assert first.datasets["train"].cache_files == second.datasets["train"].cache_files
    other = tmp_path / "other.model"
    Tokenizer.train(multi30k_lines("val", "de") + multi30k_lines("val", "en"), vocab_size=500).save(other)
    third = small(tmp_path, str(other), train_files=val)
    third.setup("fit")
    assert third.datasets["train"].cache_files != first.datasets["train"].cache_files


def test_tokenising_with_several_processes(tmp_path: Path, multi30k_dir: Path, tokenizer_path: str) -> None:
    val = [str(multi30k_dir / "val.de.gz"), str(multi30k_dir / "val.en.gz")]
    one, two = (
        small(tmp_path / "1", tokenizer_path, train_files=val),
        small(tmp_path / "2", tokenizer_path, train_files=val, num_proc=2),
    )
    one.setup("fit")
    two.setup("fit")
    for column in ("src_ids", "tgt_ids", "index"):
        assert one.datasets["train"][column] == two.datasets["train"][column]


# ---- real DDP (two CPU processes) -------------------------------------------------------------


class BatchLog(L.LightningModule):
    """Writes, per rank and epoch, the batches its sampler dealt and how many steps it ran."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.out, self.steps = out, 0

    def on_train_epoch_start(self) -> None:
        self.batches = list(self.trainer.train_dataloader.batch_sampler)
        self.steps = 0

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return (self.w * batch["src"].float().mean()).sum()

    def on_train_epoch_end(self) -> None:
        record = {"batches": self.batches, "steps": self.steps}
        Path(self.out, f"rank{self.global_rank}-epoch{self.current_epoch}.json").write_text(
            json.dumps(record)
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.slow
def test_lightning_ddp_gives_ranks_disjoint_equal_shares(
    tmp_path: Path, multi30k_dir: Path, tokenizer_path: str
) -> None:
    val = [str(multi30k_dir / "val.de.gz"), str(multi30k_dir / "val.en.gz")]

    def fit(use_distributed_sampler: bool) -> None:
        dm = small(tmp_path, tokenizer_path, train_files=val, valid_split=None, max_tokens=1000)
        trainer = L.Trainer(
            max_epochs=2,
            accelerator="cpu",
            devices=2,
            strategy="ddp_spawn",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=use_distributed_sampler,
        )
        trainer.fit(BatchLog(str(tmp_path)), datamodule=dm)

    fit(use_distributed_sampler=False)
    for epoch in (0, 1):
        ranks = [json.loads((tmp_path / f"rank{r}-epoch{epoch}.json").read_text()) for r in (0, 1)]
        assert ranks[0]["steps"] == ranks[1]["steps"] == len(ranks[0]["batches"]) == len(ranks[1]["batches"])
        seen = Counter(i for rank in ranks for batch in rank["batches"] for i in batch)
        assert set(seen) == set(range(1014))
        assert sum(seen.values()) - 1014 <= max(
            len(b) for b in ranks[0]["batches"]
        )  # one padding batch at most
    with pytest.raises(Exception, match="use_distributed_sampler=False"):
        fit(use_distributed_sampler=True)  # Lightning's own error, if fit.py forgets the flag


class CountingDataModule(TranslationDataModule):
    def _load_raw(self, split: str) -> datasets.Dataset:
        # Nothing is set up here, so the training split is read only to train the tokenizer on.
        Path(f"{self.tokenizer_path}.trained-by-{os.getpid()}").touch()
        return super()._load_raw(split)


def _vocab_size_in_a_process(tokenizer_path: str, files: list[str], cache_dir: str) -> int:
    dm = CountingDataModule(
        src_lang="de",
        tgt_lang="en",
        tokenizer_path=tokenizer_path,
        train_files=files,
        vocab_size=700,
        cache_dir=cache_dir,
    )
    return dm.vocab_size


@pytest.mark.slow
def test_one_process_trains_the_tokenizer_the_others_wait(tmp_path: Path, multi30k_dir: Path) -> None:
    val = [str(multi30k_dir / "val.de.gz"), str(multi30k_dir / "val.en.gz")]
    path = tmp_path / "spm.model"
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        sizes = pool.starmap(_vocab_size_in_a_process, [(str(path), val, str(tmp_path / "cache"))] * 3)
    assert sizes == [700, 700, 700]
    assert len(list(tmp_path.glob("spm.model.trained-by-*"))) == 1


def test_a_marian_source_is_empty_without_text_and_keeps_its_eos_when_cut(multi30k_lines) -> None:
    """An imported model's tokenizer appends eos to every source: "" is [eos] (no text: EMPTY, as for ours),
    and a source cut to the length limit keeps its eos (the model never saw one without)."""
    from marian_hub import build_vocab, train_spm

    from seq2seq.training.corpus import tokenize_batch as _tokenize

    source = train_spm(multi30k_lines("train", "de", 1000), vocab_pieces=200)
    target = train_spm(multi30k_lines("train", "en", 1000), vocab_pieces=200)
    tok = Tokenizer.from_marian(source=source, target=target, vocabulary=list(build_vocab(source, target)))
    batch = {"src": ["", "Ein " * 30, "Ein Hund."], "tgt": ["A dog.", "A " * 30, "A dog."]}
    for evaluation in (True, False):
        out = _tokenize(batch, [0, 1, 2], tokenizer=tok, max_len=8, max_ratio=3.0, evaluation=evaluation)
        assert out["status"][0] == Status.EMPTY
        assert out["status"][1] == (Status.TRUNCATED if evaluation else Status.TOO_LONG)
        assert out["status"][2] == Status.KEEP and out["src_ids"][2][-1] == tok.eos_id
    cut = _tokenize(batch, [0, 1, 2], tokenizer=tok, max_len=8, max_ratio=3.0, evaluation=True)["src_ids"][1]
    assert len(cut) == 8 and cut[-1] == tok.eos_id
