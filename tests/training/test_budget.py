"""The token budget sized to a GPU's memory and the accumulation to tokens per update (training/budget.py), on a
CPU: the sizing rule against pretended memory, the probe step itself, and a run's use of both."""

from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import write_tiny_run

import seq2seq.training.module as module_file
from seq2seq.model import ConfigError, Transformer, TransformerConfig
from seq2seq.training.budget import (
    CPU_MAX_TOKENS,
    GRANULE,
    HEADROOM,
    BudgetError,
    accumulation,
    largest_budget,
    probe_step,
)
from seq2seq.training.data import DataError, TranslationDataModule
from seq2seq.training.module import BUDGET_KEY, TranslationModule

GIB = 2**30


def linear_memory(*, fixed: float, per_position: float, fits: float | None = None, seen: list | None = None):
    """A step's peak as a GPU shows it: a fixed part and bytes per position; over `fits` bytes, out of memory."""

    def peak_bytes(budget: int) -> int:
        if seen is not None:
            seen.append(budget)
        peak = fixed + per_position * budget
        if fits is not None and peak > fits:
            raise torch.OutOfMemoryError("CUDA out of memory (pretended)")
        return int(peak)

    return peak_bytes


def test_the_budget_fills_the_headroom_the_line_predicts():
    """80 GB, 2 GB fixed, 100 KB a position, 6 GB reserved for the optimiser: the largest multiple of GRANULE whose
    peak stays under HEADROOM of the memory less the reservation, found with the line's two probes and one check."""
    seen: list[int] = []
    budget = largest_budget(linear_memory(fixed=2 * GIB, per_position=100_000, seen=seen), memory=80 * GIB,
                            reserved=6 * GIB, low=251, high=2**20)
    allowed = HEADROOM * 80 * GIB - 6 * GIB
    assert budget % GRANULE == 0 and 2 * GIB + 100_000 * budget <= allowed < 2 * GIB + 100_000 * (budget + GRANULE)
    assert seen == [251, 2048, 4096, budget]


def test_a_budget_over_what_the_line_predicts_is_lowered_until_a_step_fits():
    """The real peak grows faster than the two small probes said (fragmentation, attention at long lengths): the
    predicted budget runs out of memory, and lower ones are tried, a tenth at a time, until one fits."""
    seen: list[int] = []
    small_then_steep = linear_memory(fixed=GIB, per_position=50_000, fits=20 * GIB, seen=seen)
    budget = largest_budget(small_then_steep, memory=40 * GIB, reserved=0, low=251, high=2**20)
    assert GIB + 50_000 * budget <= 20 * GIB and budget % GRANULE == 0
    assert len(seen) > 4 and seen[3] > budget  # the prediction was tried first, and failed


def test_the_budget_is_capped_and_has_a_floor():
    assert largest_budget(linear_memory(fixed=0, per_position=1), memory=80 * GIB, reserved=0, low=251,
                          high=10_000) == 9_984  # the cap (tokens per update over the devices), to GRANULE
    with pytest.raises(BudgetError, match=r"^one batch of 251 padded positions \(the longest sentence allowed\) needs "
                                          r"4\.0 GiB of the 3\.4 GiB this GPU has for it: lower "
                                          r"data\.max_tokens_per_sentence"):
        largest_budget(linear_memory(fixed=4 * GIB, per_position=1), memory=4 * GIB, reserved=0, low=251, high=2**20)


@pytest.mark.parametrize(("wanted", "max_tokens", "world", "batches"),
                         [(None, 4096, 1, 1), (25_000, 4096, 1, 7), (25_000, 4096, 8, 1), (25_000, 3_000, 4, 3)])
def test_accumulation_reaches_the_tokens_per_update(wanted, max_tokens: int, world: int, batches: int):
    assert accumulation(tokens_per_update=wanted, max_tokens=max_tokens, world_size=world) == batches


def test_the_probe_step_runs_the_training_step_at_the_budget_and_frees_its_gradients():
    """What size_budget times on a GPU, on a CPU: budget // length rows of the longest length, forward and backward
    (every parameter gets a gradient), under autocast; none kept after."""
    model = Transformer(TransformerConfig(vocab_size=64, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                                          num_decoder_layers=1))
    seen = []
    model.encoder.register_forward_pre_hook(lambda module, args: seen.append((tuple(args[0].shape), args[0].dtype)))
    grads = []
    for p in model.parameters():
        p.register_hook(lambda grad: grads.append(grad.dtype) or grad)
    probe_step(model, budget=1000, length=33, dtype=torch.bfloat16)
    assert seen == [((30, 33), torch.long)]  # 1000 // 33 rows of the longest length
    assert all(p.grad is None for p in model.parameters()) and len(grads) == len(list(model.parameters()))
    probe_step(model, budget=1000, length=33, dtype=torch.bfloat16, rdrop_alpha=5.0)
    assert seen[1:] == [((60, 33), torch.long)]  # R-Drop: the rows twice over, in one pass of the model


def tiny_data(root: Path, **options) -> TranslationDataModule:
    write_tiny_run(root, train_pairs=300, val_pairs=4)
    return TranslationDataModule(src_lang="de", tgt_lang="en", tokenizer_path=str(root / "spm.model"), vocab_size=600,
                                 train_files=[str(root / "data/train.de"), str(root / "data/train.en")],
                                 max_tokens_per_sentence=64, cache_dir=str(root / "cache"), **options)


class Seen(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.accumulate = trainer.accumulate_grad_batches
        self.max_tokens = trainer.train_dataloader.batch_sampler.max_tokens


def run(root: Path, data: TranslationDataModule, *, tokens_per_update: int | None = None, ckpt_path=None,
        max_steps: int = 2) -> tuple[TranslationModule, Seen]:
    module = TranslationModule(transformer=TransformerConfig(vocab_size=600, d_model=16, num_heads=2, d_ff=32,
                                                             num_encoder_layers=1, num_decoder_layers=1),
                               warmup_steps=1, tokens_per_update=tokens_per_update)
    seen = Seen()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[seen], default_root_dir=root)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, seen


def test_auto_on_a_cpu_is_the_cpu_budget_and_tokens_per_update_sets_the_accumulation(tmp_path: Path):
    module, seen = run(tmp_path, tiny_data(tmp_path, max_tokens="auto"), tokens_per_update=10_000)
    assert seen.max_tokens == CPU_MAX_TOKENS and seen.accumulate == 3  # ceil(10,000 / 4,096)
    assert module.trainer.global_step == 2


def test_auto_on_a_gpu_is_sized_by_rank_zero_kept_in_checkpoints_and_by_a_resume(tmp_path: Path, monkeypatch):
    """The sizing a GPU gets, pretended on the CPU: the budget found (capped at tokens_per_update on one device)
    is the sampler's and the checkpoint's; a resume takes the checkpoint's, whatever a new sizing would say."""
    sized = []

    def size(self, datamodule, *, high):
        sized.append(high)
        return 512 + 256 * len(sized)  # another budget at each sizing

    monkeypatch.setattr(module_file.TranslationModule, "_size_budget", size)
    module, seen = run(tmp_path, tiny_data(tmp_path, max_tokens="auto"), tokens_per_update=700)
    assert sized == [700] and seen.max_tokens == 768 and seen.accumulate == 1
    path = tmp_path / "run.ckpt"
    module.trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=True)[BUDGET_KEY] == 768
    resumed, seen = run(tmp_path / "again", tiny_data(tmp_path / "again", max_tokens="auto"), tokens_per_update=700,
                        ckpt_path=path, max_steps=3)
    assert sized == [700] and seen.max_tokens == 768  # not sized again


def test_a_budget_given_is_used_as_given(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(module_file.TranslationModule, "_size_budget", lambda *a, **k: pytest.fail("sized"))
    _, seen = run(tmp_path, tiny_data(tmp_path, max_tokens=1024))
    assert seen.max_tokens == 1024 and seen.accumulate == 1


@pytest.mark.parametrize("value", ["big", 1.5, True])
def test_a_bad_budget_names_the_key(value, tmp_path: Path):
    with pytest.raises(DataError, match=f"^data.max_tokens must be a number of padded positions or auto, got {value!r}"):
        tiny_data(tmp_path, max_tokens=value)


def test_tokens_per_update_and_an_accumulation_are_not_both_given(tmp_path: Path):
    from seq2seq.training.fit import main

    config = write_tiny_run(tmp_path, max_steps=2, train_pairs=50, val_pairs=4)
    with pytest.raises(SystemExit, match=r"^error: model.tokens_per_update: is given, and so is "
                                         r"trainer.accumulate_grad_batches=2: give one"):
        main(["--config", str(config), "--model.tokens_per_update=8000", "--trainer.accumulate_grad_batches=2"])
    with pytest.raises(ConfigError, match="^model.tokens_per_update: must be a positive number of positions, got 0"):
        TranslationModule(transformer=TransformerConfig(vocab_size=64), tokens_per_update=0)


@pytest.mark.parametrize("rdrop_alpha", [0.0, 5.0])
def test_size_budget_runs_its_probes_on_the_model_and_reads_the_gpus_memory(rdrop_alpha: float,
                                                                            monkeypatch: pytest.MonkeyPatch):
    """size_budget's own path, as far as a CPU runs it: torch.cuda's memory calls pretended (a 1 GiB GPU, a
    peak of 64 MiB plus 100 KB a position), the probes real training steps of the model at each budget asked."""
    import contextlib

    import seq2seq.training.budget as budget_module

    model = Transformer(TransformerConfig(vocab_size=64, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                                          num_decoder_layers=1)).eval()
    probed, real_probe = [], budget_module.probe_step

    def probe(m, *, budget, length, dtype, rdrop_alpha):
        probed.append((budget, length, m.training, rdrop_alpha))
        real_probe(m, budget=budget, length=length, dtype=dtype, rdrop_alpha=rdrop_alpha)

    monkeypatch.setattr(budget_module, "probe_step", probe)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 2**30))
    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 64 * 2**20 + 100_000 * probed[-1][0])
    monkeypatch.setattr(torch.random, "fork_rng", lambda **kwargs: contextlib.nullcontext())
    found = budget_module.size_budget(model, length=65, high=2**20, dtype=None, rdrop_alpha=rdrop_alpha)
    reserved = budget_module.OPTIMIZER_COPIES * sum(p.numel() * 4 for p in model.parameters())
    allowed = HEADROOM * 2**30 - reserved
    assert 64 * 2**20 + 100_000 * found <= allowed < 64 * 2**20 + 100_000 * (found + GRANULE)
    assert [b for b, _, _, _ in probed][:3] == [65, 2048, 4096]
    assert {(n, t, alpha) for _, n, t, alpha in probed} == {(65, True, rdrop_alpha)}  # R-Drop's step is the one probed
    assert not model.training  # given back as it came
