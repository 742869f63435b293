"""BPE-dropout in training: the sampler planning on an epoch's sizes, the (epoch, row) keys, the data module; epochs of
other lengths under Lightning."""

from collections import Counter
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from seq2seq.text.tokenizer import Tokenizer
from seq2seq.training.batching import TokenBatchSampler
from seq2seq.training.corpus import DataError
from seq2seq.training.data import TranslationDataModule


def test_the_sampler_plans_each_epoch_on_its_sizes_and_resumes_the_same_batches() -> None:
    base = np.random.default_rng(0).integers(3, 40, size=500)

    def sizes(epoch: int) -> np.ndarray:
        return base + np.random.default_rng(epoch).integers(0, 10, size=500)

    def sampler() -> TokenBatchSampler:
        return TokenBatchSampler(base, max_tokens=256, shuffle=True, shuffle_window=100, seed=3, epoch_sizes=sizes)

    whole = sampler()
    for epoch in (0, 1):
        whole.set_epoch(epoch)
        batches = list(whole)
        keys = [[key for key in batch if isinstance(key, tuple)] for batch in batches]
        assert [len(k) for k in keys] == [len(b) for b in batches]  # (epoch, row) keys
        assert {e for batch in keys for e, _ in batch} == {epoch}
        assert Counter(row for batch in keys for _, row in batch) == Counter(range(500))  # every pair once
        for batch in keys:
            assert len(batch) * max(sizes(epoch)[row] for _, row in batch) <= 256  # the epoch's sizes, not base
    whole.set_epoch(1)
    unbroken = list(whole)
    resumed = sampler()
    resumed.load_state_dict(whole.state_dict(batches_done=4))
    assert list(resumed) == unbroken[4:]
    with pytest.warns(UserWarning, match="resplit"):  # a resume with BPE-dropout switched off is told so
        TokenBatchSampler(base, max_tokens=256, shuffle=True, shuffle_window=100, seed=3).load_state_dict(
            whole.state_dict(batches_done=4))
    with pytest.raises(ValueError, match="training batches"):
        TokenBatchSampler(base, max_tokens=256, shuffle=False, epoch_sizes=sizes)
    too_big = TokenBatchSampler(base, max_tokens=256, shuffle=True, epoch_sizes=lambda epoch: base + 300)
    with pytest.raises(ValueError, match="max_tokens 256"):
        list(too_big)


def write(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory, multi30k_lines) -> dict:
    root = tmp_path_factory.mktemp("resplit")
    de, en = multi30k_lines("train", "de", 1500), multi30k_lines("train", "en", 1500)
    return {"root": root, "de": de, "en": en,
            "train_files": [write(root / "train.de", de), write(root / "train.en", en)]}


def module(pairs: dict, tokenizer_path: str, **kwargs) -> TranslationDataModule:
    return TranslationDataModule(src_lang="de", tgt_lang="en", tokenizer_path=tokenizer_path,
                                 train_files=pairs["train_files"], valid_split=None, test_split=None,
                                 max_tokens=1024, cache_dir=str(pairs["root"] / "cache"), **kwargs)


def epoch_batches(dm: TranslationDataModule, epoch: int, limit: int | None = None) -> list[dict]:
    loader = dm.train_dataloader()
    assert isinstance(loader.batch_sampler, TokenBatchSampler)
    loader.batch_sampler.set_epoch(epoch)
    out = []
    for batch in loader:
        out.append(batch)
        if limit is not None and len(out) == limit:
            break
    return out


def test_every_pair_is_trained_once_an_epoch_in_new_pieces_within_the_budget(
    pairs: dict, tokenizer: Tokenizer, tokenizer_path: str
) -> None:
    dm = module(pairs, tokenizer_path, bpe_dropout=0.1)
    dm.setup("fit")
    plain = module(pairs, tokenizer_path)
    plain.setup("fit")
    texts = Counter(zip(tokenizer.decode(tokenizer.encode_source(pairs["de"])),
                        tokenizer.decode(tokenizer.encode_target(pairs["en"])), strict=True))
    pieces = []
    for epoch in (0, 1):
        batches = epoch_batches(dm, epoch)
        for batch in batches:
            assert batch["src"].numel() <= 1024 and batch["tgt_out"].numel() <= 1024
        seen = Counter((src, tgt) for b in batches for src, tgt in zip(
            tokenizer.decode(b["src"].tolist()), tokenizer.decode(b["tgt_in"][:, 1:].tolist()), strict=True))
        assert seen == texts  # N pairs in, N out: the same text, in other pieces
        pieces.append(sum(int((b["src"] != 0).sum()) for b in batches))
    deterministic = sum(int((b["src"] != 0).sum()) for b in epoch_batches(plain, 0))
    assert pieces[0] > deterministic and pieces[1] > deterministic and pieces[0] != pieces[1]


def test_a_loader_worker_reads_the_batches_the_main_process_planned(pairs: dict, tokenizer_path: str) -> None:
    """The epoch travels in the keys to a worker process (spawned: nothing of this process's state but the
    pickled dataset), which splits the rows as the plan's sizes said."""
    here = module(pairs, tokenizer_path, bpe_dropout=0.1)
    here.setup("fit")
    there = module(pairs, tokenizer_path, bpe_dropout=0.1, num_workers=1)
    there.setup("fit")
    for epoch in (0, 2):
        ours, theirs = epoch_batches(here, epoch, limit=3), epoch_batches(there, epoch, limit=3)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a["src"], b["src"]) and torch.equal(a["tgt_out"], b["tgt_out"])


def test_bpe_dropout_options_are_checked(pairs: dict, tokenizer_path: str, tmp_path: Path, multi30k_lines) -> None:
    for bad in (1.0, -0.1, True, "0.1"):
        with pytest.raises(DataError, match="data.bpe_dropout is"):
            module(pairs, tokenizer_path, bpe_dropout=bad)
    texts = multi30k_lines("train", "de", 800) + multi30k_lines("train", "en", 800)
    unigram = tmp_path / "unigram.model"
    Tokenizer.train(texts, vocab_size=600, model_type="unigram").save(unigram)
    with pytest.raises(DataError, match="data.bpe_dropout: .* needs a BPE tokenizer"):
        module(pairs, str(unigram), bpe_dropout=0.1).setup("fit")


class Counting(L.LightningModule):
    """Records each epoch's training batches (their rows' pieces) and the epochs validation ran after."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.trained: dict[int, int] = Counter()
        self.pieces: dict[int, int] = Counter()
        self.validated: list[int] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.trained[self.current_epoch] += len(batch["src"])
        self.pieces[self.current_epoch] += int((batch["src"] != 0).sum())
        return (self.w * batch["src"].float().mean()).sum()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        if batch_idx == 0:
            self.validated.append(self.current_epoch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("case", ["bpe_dropout", "shuffle_windows"])
def test_under_lightning_every_epoch_trains_every_pair_and_is_validated(
    case: str, pairs: dict, tokenizer_path: str, multi30k_dir: Path
) -> None:
    """Epochs of other lengths: BPE-dropout's, or more pairs than one shuffle window (its windows hold other pairs each
    epoch, so pack into other counts). Lightning reads a loader's length once per build: without a build each epoch
    it validated only after epochs as long as the first and cut longer ones short."""
    val = [str(multi30k_dir / "val.de.gz"), str(multi30k_dir / "val.en.gz")]
    options = {"bpe_dropout": 0.3} if case == "bpe_dropout" else {"shuffle_window": 300}

    def fit(reload: int) -> tuple[Counting, TranslationDataModule]:
        dm = TranslationDataModule(src_lang="de", tgt_lang="en", tokenizer_path=tokenizer_path,
                                   train_files=pairs["train_files"], valid_files=val, max_tokens=512,
                                   cache_dir=str(pairs["root"] / "cache"), **options)
        module = Counting()
        trainer = L.Trainer(max_epochs=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            use_distributed_sampler=False, reload_dataloaders_every_n_epochs=reload,
                            limit_val_batches=1)
        trainer.fit(module, datamodule=dm)
        return module, dm

    module, dm = fit(1)
    assert module.validated == list(range(6))
    assert dict(module.trained) == {epoch: 1500 for epoch in range(6)}
    assert (dm.resplit is not None) == (case == "bpe_dropout")
    counts = set()
    for epoch in range(6):
        sampler = TokenBatchSampler(dm.sizes["train"], max_tokens=512, shuffle=True,
                                    shuffle_window=options.get("shuffle_window", 100_000),
                                    epoch_sizes=dm.resplit.sizes if dm.resplit is not None else None)
        sampler.set_epoch(epoch)
        counts.add(len(sampler))
    assert len(counts) > 1  # (the case: epochs of different lengths)
    # new pieces every epoch under BPE-dropout; the same pieces, in other batches, otherwise
    assert len(set(module.pieces.values())) == (6 if case == "bpe_dropout" else 1)
    why = "data.bpe_dropout" if case == "bpe_dropout" else "more pairs than data.shuffle_window=300"
    with pytest.raises(DataError, match=f"\\({why}\\).*reload_dataloaders_every_n_epochs=1"):
        fit(0)
