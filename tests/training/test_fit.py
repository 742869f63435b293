"""Training end to end: configs, a few-step fit, self-contained checkpoints, resume, DDP."""

import builtins
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from conftest import MULTI30K, write_tiny_run
from machines import MACHINES, pretend_machine

import seq2seq.training.fit
from seq2seq.average import main as average_main
from seq2seq.checkpoint import CheckpointError
from seq2seq.decoding.config import SearchConfig
from seq2seq.model import TransformerConfig
from seq2seq.training.data import TranslationDataModule
from seq2seq.training.fit import AtomicCheckpointIO, Trainer, TranslationCLI, main
from seq2seq.training.module import TranslationModule
from seq2seq.training.schedule import inverse_sqrt_schedule

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


class ParseOnlyCLI(TranslationCLI):
    """Parses and validates a config as `python -m seq2seq.fit` does, without building anything."""

    def instantiate_classes(self) -> None:
        pass


def parse(*config_names: str, overrides: tuple[str, ...] = ()):
    args = [arg for name in config_names for arg in ("--config", str(REPO / "configs" / name))]
    return ParseOnlyCLI(TranslationModule, TranslationDataModule, trainer_class=Trainer, run=False,
                        args=[*args, *overrides]).config


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_parses_and_builds_offline(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                request: pytest.FixtureRequest):
    if name == "finetune.yaml":  # needs a model to start from: the export tests' en→de demo model stands in
        pretrained = request.getfixturevalue("trained")
        cli = TranslationCLI(TranslationModule, TranslationDataModule, trainer_class=Trainer, run=False, args=[
            "--config", str(REPO / "configs" / name), f"--model.init_from={pretrained}",
            f"--data.tokenizer_path={tmp_path}/spm.model", f"--trainer.default_root_dir={tmp_path}"])
        stored = torch.load(pretrained, weights_only=True)["seq2seq"]
        assert cli.model.config.d_model == stored["model_config"]["d_model"] == 64  # init_from's model ...
        assert (cli.model.config.dropout, cli.model.config.attention_dropout) == (0.1, 0.1)  # ... with the YAML's dropouts
        assert (tmp_path / "spm.model").read_bytes() == stored["tokenizer"]  # its tokenizer, written, not trained
        return
    names = (name,) if name != "multi30k_local.yaml" else ("multi30k.yaml", name)
    if name == "wmt.yaml":  # accelerator: gpu, refused where torch finds none: parsed as on a GPU machine
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = parse(*names, overrides=(f"--data.tokenizer_path={tmp_path}/spm.model",))

    def build(vocab_size: int) -> TranslationModule:
        transformer = {key: value for key, value in vars(config.model.transformer).items() if key != "vocab_size"}
        return TranslationModule(
            transformer=TransformerConfig(vocab_size=vocab_size, **transformer),
            val_search=SearchConfig(**vars(config.model.val_search)),
            **{key: value for key, value in vars(config.model).items() if key not in ("transformer", "val_search")},
        )

    if name in ("wmt.yaml", "multi30k.yaml"):
        # Their data is on the Hub: build the model only, with the vocabulary their tokenizer will have.
        model = build(config.data.vocab_size)
        if name == "wmt.yaml":
            assert config.data.vocab_size == 32000
            assert sum(p.numel() for p in model.parameters()) == 60_522_496  # transformer-base, closed form
        return
    if name == "multi30k_multilingual.yaml":  # six directions of the Multi30k files, each a Direction
        from seq2seq.training.directions import Direction, check_directions

        directions = [Direction(**vars(d)) for d in config.data.directions]
        check_directions(directions)
        assert [d.name for d in directions] == ["de-en", "en-de", "fr-en", "en-fr", "cs-en", "en-cs"]
        if MULTI30K.is_dir():  # (relative to the repository, where the commands run: ../shared/data/multi30k)
            assert all((REPO / path).is_file() for d in directions
                       for path in (*d.train_files, *(d.valid_files or []), *(d.test_files or [])))
        build(config.data.vocab_size)  # (its tokenizer trains on all six: left to the multilingual tests' smaller run)
        return
    if name == "multi30k_local.yaml" and not MULTI30K.is_dir():
        pytest.skip(f"Multi30k not found at {MULTI30K}")
    data = TranslationDataModule(**config.data)
    model = build(data.vocab_size)  # trains the tokenizer: offline
    assert model.config.vocab_size == config.data.vocab_size


def read_metrics(root: Path) -> list[dict[str, str]]:
    (path,) = sorted(root.glob("lightning_logs/version_*/metrics.csv"))[-1:]
    with path.open() as f:
        return list(csv.DictReader(f))


def test_fit_writes_self_contained_checkpoints(tiny_run):
    config, checkpoints = tiny_run
    assert (checkpoints / "best.ckpt").is_file() and (checkpoints / "last.ckpt").is_file()
    checkpoint = torch.load(checkpoints / "best.ckpt", weights_only=True)  # no pickle needed
    meta = checkpoint["seq2seq"]
    assert meta["src_lang"] == "de" and meta["tgt_lang"] == "en"
    assert meta["model_config"]["d_model"] == 32 and meta["model_config"]["vocab_size"] == 600
    assert isinstance(meta["tokenizer"], bytes) and len(meta["tokenizer"]) > 1000
    assert checkpoint["global_step"] == 12
    rows = read_metrics(config.parent)
    val = [row for row in rows if row.get("val_bleu")]
    assert val and float(val[-1]["val_sentences"]) == 40  # the whole validation set was decoded
    assert float(val[-1]["val_ppl"]) > 1


def test_resume_continues_step_and_schedule(tiny_run, tmp_path: Path):
    _, checkpoints = tiny_run
    root = tmp_path / "resume"
    config = write_tiny_run(root, max_steps=16)
    shutil.copytree(checkpoints, root / "checkpoints")
    shutil.copy(checkpoints.parent / "spm.model", root / "spm.model")
    cli = main(["--config", str(config), "--ckpt_path", "last"])
    assert cli.trainer.global_step == 16  # 12 before, 4 after
    optimizer = cli.trainer.optimizers[0]
    expected_lr = 0.003 * inverse_sqrt_schedule(16, warmup_steps=5)  # the schedule continued, not restarted
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr)
    assert optimizer.state_dict()["state"][0]["step"].item() == 16  # Adam's moments continued too
    # A second run in the same folder (its saved config already there) starts without complaint.
    cli = main(["--config", str(config), "--trainer.max_steps=2"])
    assert cli.trainer.global_step == 2


def linear_rates(*, first: int, last: int, peak: float, warmup: int, budget: int) -> list[float]:
    """The rate of updates first..last (from 1) under lr_schedule linear: each is set after the update before."""
    return [peak * min(k / warmup, 1 - (k - 1) / budget) if k > 1 else peak / warmup for k in range(first, last + 1)]


def read_rates(path: Path) -> list[float]:
    return [float(line) for line in path.read_text().split()]


def test_linear_schedule_decays_to_zero_at_max_steps_and_an_extended_resume_continues(tmp_path: Path):
    config = write_tiny_run(tmp_path, max_steps=12, train_pairs=100, val_pairs=4)
    log = ["--trainer.callbacks+=resume_probe.LrLog", f"--trainer.callbacks.path={tmp_path / 'lr.txt'}"]
    cli = main(["--config", str(config), "--model.lr_schedule=linear", *log])
    assert cli.trainer.global_step == 12
    # Warm-up for 5, then the line to 0: the last update trains at peak/12, and the rate after it is 0.
    assert read_rates(tmp_path / "lr.txt") == pytest.approx(linear_rates(first=1, last=12, peak=0.003, warmup=5,
                                                                         budget=12), rel=1e-9)
    assert cli.trainer.optimizers[0].param_groups[0]["lr"] == 0.0
    # Resumed with twice the budget: the rate is the new line's at once, not the 0 the checkpoint ended at.
    log[1] = f"--trainer.callbacks.path={tmp_path / 'lr2.txt'}"
    cli = main(["--config", str(config), "--model.lr_schedule=linear", "--trainer.max_steps=24", "--ckpt_path",
                "last", *log])
    assert cli.trainer.global_step == 24
    assert read_rates(tmp_path / "lr2.txt") == pytest.approx(linear_rates(first=13, last=24, peak=0.003, warmup=5,
                                                                          budget=24), rel=1e-9)


def test_linear_schedule_follows_the_clock_under_max_time(tmp_path: Path):
    """max_time ends the run long before max_steps: the rate must still be near 0 by then."""
    config = write_tiny_run(tmp_path, max_steps=100_000, train_pairs=100, val_pairs=4)
    cli = main(["--config", str(config), "--model.lr_schedule=linear", "--model.warmup_steps=1",
                "--trainer.max_time=00:00:00:04", "--trainer.limit_val_batches=0"])
    steps = cli.trainer.global_step
    assert 4 < steps < 100_000  # stopped by the clock, after several updates
    # The rate left is about one update's share of the 4 s; a rate that ignored the clock would be ~0.003.
    assert cli.trainer.optimizers[0].param_groups[0]["lr"] < 0.003 * 0.5


def test_a_run_reports_its_tokenizer_and_its_data(tmp_path: Path):
    """The data module's lines (the tokenizer trained, pairs read, dropped and kept) were logged at INFO,
    which Python's default level hid: a user preparing millions of pairs saw nothing of it. Each split's
    counts once, though prepare_data and setup each build it."""
    config = write_tiny_run(tmp_path, max_steps=1, train_pairs=50, val_pairs=4)
    result = fit_subprocess(config, "--trainer.limit_val_batches=0")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert sum(bool(re.fullmatch(r"trained .*spm\.model on 50 pairs in [\d.]+s", line)) for line in lines) == 1, lines
    assert sum(bool(re.fullmatch(r"train: 50 pairs read; dropped 0 with an empty side, .*; kept 50", line))
               for line in lines) == 1, lines
    assert sum(bool(re.fullmatch(r"valid: 4 pairs read; .*; kept 4", line)) for line in lines) == 1, lines


def test_linear_schedule_without_an_end_is_refused(tmp_path: Path):
    config = write_tiny_run(tmp_path, max_steps=1, train_pairs=50, val_pairs=4)
    with pytest.raises(SystemExit, match=r"^error: model.lr_schedule: linear decays the rate to 0 at the end of the "
                                         r"run, and this run has none: set trainer.max_steps, max_epochs or max_time"):
        main(["--config", str(config), "--model.lr_schedule=linear", "--trainer.max_steps=-1",
              "--trainer.max_epochs=-1", "--trainer.val_check_interval=10"])


def probe_env() -> dict[str, str]:
    """The environment for `python -m seq2seq.fit` subprocesses that load callbacks from tests/ by class path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}


def test_ddp_two_processes_on_cpu(tmp_path: Path):
    """Two gloo processes: both train on disjoint batches, one checkpoint set, BLEU over all of val.

    In the default run on purpose: it takes ~15 s, and DDP is the one path a single-process test misses."""
    config = write_tiny_run(tmp_path, max_steps=6, train_pairs=800, val_pairs=37)
    probe = tmp_path / "probe"
    env = probe_env()
    command = [
        sys.executable, "-m", "seq2seq.fit", "--config", str(config), "--model.compile=false",
        "--trainer.strategy=ddp", "--trainer.devices=2",
        "--trainer.callbacks+=ddp_probe.RankProbe", f"--trainer.callbacks.out_dir={probe}",
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world_size"] == 2 for r in ranks)
    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == 6
    assert ranks[0]["batches"] != ranks[1]["batches"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt"]
    val = [row for row in read_metrics(tmp_path) if row.get("val_bleu")]
    assert float(val[-1]["val_sentences"]) == 37  # each rank decoded part; scored once over all 37


@pytest.mark.parametrize("machine", ["avx2", "amx"])
def test_bf16_on_a_cpu_without_bf16_matmuls_warns(machine: str, tmp_path: Path, monkeypatch):
    pretend_machine(monkeypatch, machine)
    config = write_tiny_run(tmp_path, max_steps=1, train_pairs=100, val_pairs=4)
    args = ["--config", str(config), "--trainer.precision=bf16-mixed", "--trainer.limit_val_batches=0"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = main(args)
    assert cli.trainer.global_step == 1
    warned = [w for w in caught if "bf16 matmuls are slower" in str(w.message)]
    assert len(warned) == (0 if machine == "amx" else 1)
    if warned:
        assert "no bf16 matmul units" in str(warned[0].message)
        assert "--trainer.precision=auto or 32-true" in str(warned[0].message)


@pytest.mark.parametrize("machine,chosen", [("amx", "bf16-mixed"), ("avx512_bf16", "bf16-mixed"), ("avx2", "32-true")])
def test_precision_auto_follows_the_machine_and_is_passed_to_ddp_ranks(machine: str, chosen: str, tmp_path: Path,
                                                                       monkeypatch, capsys):
    pretend_machine(monkeypatch, machine)
    asked = []
    real = seq2seq.training.fit.bf16_matmuls
    monkeypatch.setattr("seq2seq.training.fit.bf16_matmuls",
                        lambda device, training=False: asked.append(training) or real(device, training=training))
    monkeypatch.setenv("_SEQ2SEQ_AUTO_PRECISION", "")
    monkeypatch.delenv("_SEQ2SEQ_AUTO_PRECISION")  # and gone again after the test
    config = write_tiny_run(tmp_path, max_steps=1, train_pairs=50, val_pairs=4)
    cli = main(["--config", str(config), "--trainer.precision=auto", "--trainer.limit_val_batches=0"])
    assert cli.trainer.precision == chosen and asked == [True]  # for training: forward and backward
    printed = capsys.readouterr().out
    assert f"trainer.precision auto: {chosen} on {MACHINES[machine].model} (this CPU has" in printed
    assert os.environ["_SEQ2SEQ_AUTO_PRECISION"] == f"cpu={chosen}"  # what the DDP processes it starts inherit
    cli = main(["--config", str(config), "--trainer.precision=auto", "--trainer.limit_val_batches=0",
                "--trainer.max_steps=2"])
    assert cli.trainer.precision == chosen and asked == [True]  # inherited, not decided again
    cli = main(["--config", str(config), "--trainer.precision=32-true", "--trainer.limit_val_batches=0"])
    assert cli.trainer.precision == "32-true"  # a precision given is kept


# ---- failing early and loudly ------------------------------------------------------------------


@pytest.mark.parametrize(("override", "message"), [("--model.lr=-0.001", "model.lr: must be > 0, got -0.001"),
                                                   ("--model.warmup_steps=0", "model.warmup_steps: must be >= 1, got 0"),
                                                   ("--model.transformer.dropout=1.5", "model.transformer.dropout: must be >= 0 and < 1"),
                                                   ("--model.transformer.pad_id=5", "model.transformer.pad_id: must be the tokenizer's pad id 0, got 5"),
                                                   ("--model.val_search.sampling=true", "model.val_search.sampling: validation BLEU needs")])
def test_bad_hyperparameters_fail_before_any_data_work(override: str, message: str, tmp_path: Path):
    config = write_tiny_run(tmp_path, max_steps=1, train_pairs=50, val_pairs=4)
    with pytest.raises(SystemExit, match=f"^error: {re.escape(message)}"):
        main(["--config", str(config), override])
    assert not (tmp_path / "spm.model").exists()  # refused before the tokenizer was trained


@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_a_gpu_asked_for_where_torch_has_none_is_one_line(accelerator: str, tmp_path: Path, monkeypatch, capsys):
    """configs/wmt.yaml's accelerator: gpu on a CPU machine: auto printed a choice for no device, then
    Lightning's MisconfigurationException came as a traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CUDA build on a machine without a GPU too
    config = write_tiny_run(tmp_path, max_steps=1, train_pairs=50, val_pairs=4)
    with pytest.raises(SystemExit, match=rf"^error: trainer.accelerator: {accelerator} asks for a CUDA GPU, but this "
                                         r"torch \(.*\) (is a CPU-only build|finds no GPU); run on a GPU machine .*or "
                                         r"pass --trainer.accelerator=cpu$"):
        main(["--config", str(config), f"--trainer.accelerator={accelerator}"])
    assert "trainer.precision auto" not in capsys.readouterr().out
    assert not (tmp_path / "spm.model").exists()  # refused before the tokenizer was trained


def test_resume_from_last_without_a_checkpoint_is_refused(tmp_path: Path):
    config = write_tiny_run(tmp_path, max_steps=1, train_pairs=50, val_pairs=4)
    with pytest.raises(SystemExit, match=r"^error: --ckpt_path last: no last\*\.ckpt in .*checkpoints; to train from "
                                         "scratch leave out --ckpt_path"):
        main(["--config", str(config), "--ckpt_path", "last"])


def test_resume_from_a_damaged_last_checkpoint_is_explained(tmp_path: Path):
    config = write_tiny_run(tmp_path, max_steps=1, train_pairs=50, val_pairs=4)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")  # what a kill during Lightning's copy from TMPDIR left
    with pytest.raises(SystemExit, match=r"^error: --ckpt_path last: .*last\.ckpt is empty \(0 bytes\): a save was "
                                         r"interrupted; use another checkpoint; or leave out --ckpt_path to start afresh$"):
        main(["--config", str(config), "--ckpt_path", "last"])


def test_resume_from_a_checkpoint_with_damaged_training_state_is_refused(tiny_run, tmp_path: Path):
    """What a resume loads beyond the inference weights (Adam's moments here) is checksummed too."""
    _, checkpoints = tiny_run
    root = tmp_path / "resume"
    config = write_tiny_run(root, max_steps=16)
    shutil.copytree(checkpoints, root / "checkpoints")
    shutil.copy(checkpoints.parent / "spm.model", root / "spm.model")
    last = root / "checkpoints" / "last.ckpt"
    loaded = torch.load(last, weights_only=True)
    moment = loaded["optimizer_states"][0]["state"][0]["exp_avg"].view(-1)
    moment[:1].view(torch.int32).bitwise_xor_(1 << 30)
    torch.save(loaded, last)
    with pytest.raises(SystemExit, match=r"^error: --ckpt_path last: .*last\.ckpt is damaged: its training state "
                                         r"\(the trained weights, the optimiser's moments, the loop's position\) does "
                                         "not match the checksum"):
        main(["--config", str(config), "--ckpt_path", "last"])


def test_resume_from_an_averaged_checkpoint_is_refused_in_one_line(tiny_run, tmp_path: Path):
    """An averaged checkpoint has the weights but no optimiser or loop: Lightning's restore raised a KeyError."""
    _, checkpoints = tiny_run
    root = tmp_path / "resume"
    config = write_tiny_run(root, max_steps=16)
    shutil.copy(checkpoints.parent / "spm.model", root / "spm.model")
    averaged = root / "averaged.ckpt"
    average_main(["--checkpoints", str(checkpoints / "last.ckpt"), str(checkpoints / "last.ckpt"),
                  "--output", str(averaged)])
    with pytest.raises(SystemExit, match=r"^error: --ckpt_path .*averaged\.ckpt holds a model's weights but no "
                                         r"training state \(optimizer_states, loops\), as an averaged checkpoint does"):
        main(["--config", str(config), "--ckpt_path", str(averaged)])


@contextmanager
def writes_denied(folder: Path):
    """Creating files under `folder` raises PermissionError, as for a read-only folder (tests run as root,
    for whom chmod denies nothing)."""
    folder = folder.resolve()
    real_open, real_os_open = builtins.open, os.open

    def inside(path) -> bool:
        return isinstance(path, str | os.PathLike) and Path(os.fspath(path)).resolve().is_relative_to(folder)

    def guarded_open(file, mode="r", *args, **kwargs):
        if inside(file) and any(c in mode for c in "wax+"):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_os_open(path, flags, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builtins, "open", guarded_open)
        patch.setattr(os, "open", guarded_os_open)
        yield


def test_a_checkpoint_folder_that_cannot_be_written_fails_before_training(tmp_path: Path):
    config = write_tiny_run(tmp_path, max_steps=2, train_pairs=50, val_pairs=4)
    (tmp_path / "checkpoints").mkdir()
    with writes_denied(tmp_path / "checkpoints"), pytest.raises(
        SystemExit, match=r"^error: ModelCheckpoint dirpath: cannot write to .*checkpoints \(Permission denied\)"
    ):
        main(["--config", str(config)])  # Lightning 2.6 alone: exit 0, "best: .../best.ckpt", an empty folder
    assert not list((tmp_path / "checkpoints").iterdir())
    blocked = write_tiny_run(tmp_path / "blocked", max_steps=2, train_pairs=50, val_pairs=4)
    blocked.write_text(blocked.read_text().replace(f"dirpath: {tmp_path}/blocked/checkpoints",
                                                   f"dirpath: {config}/checkpoints"))  # under a file
    with pytest.raises(SystemExit, match=r"^error: ModelCheckpoint dirpath: cannot write to .*tiny\.yaml/checkpoints"):
        main(["--config", str(blocked)])


def test_a_checkpoint_write_failing_mid_run_ends_the_run_loudly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    config = write_tiny_run(tmp_path, max_steps=2, train_pairs=50, val_pairs=4)
    (tmp_path / "checkpoints").mkdir()
    monkeypatch.setattr("seq2seq.training.fit.check_output_folders", lambda trainer: None)  # the folder broke after start
    with writes_denied(tmp_path / "checkpoints"), pytest.raises(
        SystemExit, match=r"^error: cannot write checkpoint .*checkpoints/.*\.ckpt: Permission denied"
    ):
        main(["--config", str(config)])
    assert not list((tmp_path / "checkpoints").iterdir())  # and no partial file


def test_a_run_that_diverges_stops_instead_of_saving_nan_weights(tmp_path: Path):
    config = write_tiny_run(tmp_path, max_steps=30, train_pairs=200, val_pairs=4)
    with pytest.raises(SystemExit, match=r"^error: the gradients are NaN or infinite at step \d+: the run diverged "
                                         r"\(checkpoints written before are kept\)\. Start a new run with a lower model\.lr"):
        main(["--config", str(config), "--model.lr=1e6", "--model.warmup_steps=1"])
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()  # no NaN checkpoint over the good ones


def test_resuming_a_checkpoint_of_another_model_or_tokenizer_is_refused(tiny_run, tmp_path: Path):
    _, checkpoints = tiny_run
    config = write_tiny_run(tmp_path, max_steps=14)
    shutil.copytree(checkpoints, tmp_path / "checkpoints")
    shutil.copy(checkpoints.parent / "spm.model", tmp_path / "spm.model")
    resume = ["--config", str(config), "--ckpt_path", "last"]
    with pytest.raises(SystemExit, match=r"^error: model\.transformer\.d_model: is 64 but the checkpoint to resume "
                                         r"\(.*last\.ckpt\) was trained with 32; set it back"):
        main([*resume, "--model.transformer.d_model=64"])
    (tmp_path / "spm.model").unlink()  # retrained on the same data with another seed: same size, other pieces
    with pytest.raises(SystemExit, match=r"^error: --ckpt_path last: .*last\.ckpt was trained with another tokenizer "
                                         r"than data\.tokenizer_path="):
        main([*resume, "--data.vocab_size=600", "--data.seed=1", "--data.tokenizer_model_type=unigram"])


def test_empty_sections_missing_files_and_short_positions_are_named(tmp_path: Path):
    config = write_tiny_run(tmp_path, max_steps=1, train_pairs=50, val_pairs=4)
    empty = tmp_path / "empty_section.yaml"
    empty.write_text(config.read_text().replace("  val_search:\n    beam_size: 1\n    max_len_b: 5\n",
                                                "  val_search:\n"))  # every key commented out: YAML null
    with pytest.raises(SystemExit, match=r"^error: model\.val_search: is empty; give its fields, or leave the key out"):
        main(["--config", str(empty)])
    with pytest.raises(SystemExit, match=r"^error: valid_files: .*nowhere\.en does not exist .*; fix the path"):
        main(["--config", str(config), f"--data.valid_files=[{tmp_path}/data/val.de, {tmp_path}/nowhere.en]"])
    with pytest.raises(SystemExit, match=r"^error: model\.transformer\.max_positions: 16 cannot hold a pair of "
                                         r"data\.max_tokens_per_sentence=64 tokens"):
        main(["--config", str(config), "--model.transformer.max_positions=16"])


def test_a_full_disk_during_a_checkpoint_write_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def disk_full(obj, f):  # what torch's zip writer raises when the disk fills up
        f.write(b"PK\x03\x04")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 166912 vs 166800")

    monkeypatch.setattr("seq2seq.checkpoint.torch.save", disk_full)
    with pytest.raises(CheckpointError, match=r"^cannot write checkpoint .*last\.ckpt: the disk may be full \(\d+ MiB "
                                              r"free there\); free space"):
        AtomicCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    assert list(tmp_path.iterdir()) == []


def test_an_error_that_is_not_a_write_error_keeps_its_own_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A RuntimeError torch.save raises for another reason than a full disk (a CUDA error while the
    tensors are copied, say) is not told as a disk problem: it goes up unchanged, and the checkpoint
    already there is untouched, with no partial write left beside it."""
    error = RuntimeError("CUDA error: device-side assert triggered")

    def cuda_error(obj, f):
        f.write(b"PK\x03\x04")
        raise error

    target = tmp_path / "last.ckpt"
    target.write_bytes(b"the previous checkpoint")
    monkeypatch.setattr("seq2seq.checkpoint.torch.save", cuda_error)
    with pytest.raises(RuntimeError) as caught:
        AtomicCheckpointIO().save_checkpoint({"step": 1}, target)
    assert caught.value is error and type(caught.value) is RuntimeError and caught.value.__cause__ is None
    assert list(tmp_path.iterdir()) == [target] and target.read_bytes() == b"the previous checkpoint"


GOMP_PROBE = """
import json, os, sys

class AtTorch:  # what libgomp will read: the environment when torch (which loads it) is first imported
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print(json.dumps({key: os.environ.get(key) for key in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}))
            sys.exit(0)  # the rest of the import is not what is tested: a fraction of a second instead of seconds

sys.meta_path.insert(0, AtTorch())
import seq2seq.fit  # the face, as `python -m seq2seq.fit` runs it
print("seq2seq.fit imported without torch")
"""


@pytest.mark.parametrize("given,expected", [
    ({}, {"GOMP_SPINCOUNT": "10000", "OMP_WAIT_POLICY": None}),  # a short spin by default
    ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": "PASSIVE"}),  # a policy: kept alone
    ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": "active"}),
    ({"GOMP_SPINCOUNT": "5"}, {"GOMP_SPINCOUNT": "5", "OMP_WAIT_POLICY": None}),  # the user's spin count
], ids=["unset", "passive", "active", "spin_count_given"])
def test_openmp_spins_briefly_unless_told_otherwise_before_torch_loads(given: dict[str, str], expected: dict):
    """seq2seq.fit sets GOMP_SPINCOUNT at import, before torch loads libgomp (which reads it then), unless
    the user set a wait policy or a spin count; in a new process, with no other OpenMP variable set."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OMP_", "GOMP_", "KMP_"))}
    result = subprocess.run([sys.executable, "-c", GOMP_PROBE], cwd=REPO, env={**env, **given},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout) == expected


def test_last_ckpt_follows_every_validation_and_every_n_updates_and_partial_writes_are_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """configs/wmt.yaml's two last.ckpt writers (after each validation; every N updates), as shipped but for
    the folder and N: last.ckpt holds every validation's and every N-th update's state, newest last. The
    unfinished writes a killed run left (`.last.ckpt.*.partial`, each a checkpoint's size) go at the start."""

    shipped = yaml.safe_load((REPO / "configs" / "wmt.yaml").read_text(encoding="utf-8"))["trainer"]["callbacks"]
    writers = [c for c in shipped if c["class_path"].endswith("ModelCheckpoint") and c["init_args"]["filename"] == "last"]
    assert len(writers) == 2 and writers[1]["init_args"]["every_n_train_steps"] == 1000
    writers[1]["init_args"]["every_n_train_steps"] = 3
    checkpoints = tmp_path / "checkpoints"
    for writer in writers:
        writer["init_args"]["dirpath"] = str(checkpoints)
    config = write_tiny_run(tmp_path, max_steps=10, train_pairs=400, val_pairs=4)
    text = config.read_text(encoding="utf-8")
    start, end = text.index("  callbacks:\n"), text.index("model:\n")
    callbacks = yaml.safe_dump({"callbacks": writers}, default_flow_style=False)
    config.write_text(text[:start] + "".join(f"  {line}\n" for line in callbacks.splitlines()) + text[end:],
                      encoding="utf-8")
    checkpoints.mkdir()
    leftovers = [checkpoints / ".last.ckpt.k2j4x9q1.partial", checkpoints / ".best.ckpt.0a9b8c7d.partial"]
    for leftover in leftovers:
        leftover.write_bytes(b"PK\x03\x04" + b"\0" * 1000)  # what a kill -9 during a save leaves
    (checkpoints / ".notes.partial").write_text("not ours")  # not a checkpoint write: kept
    real_save, saved = seq2seq.training.fit.save_atomic, []

    def record(checkpoint: dict, path) -> None:
        saved.append((Path(path).name, checkpoint["global_step"]))
        real_save(checkpoint, path)

    monkeypatch.setattr("seq2seq.training.fit.save_atomic", record)
    main(["--config", str(config), "--trainer.val_check_interval=4", "--trainer.check_val_every_n_epoch=null",
          "--trainer.max_epochs=-1"])
    assert [step for name, step in saved if name == "last.ckpt"] == [3, 4, 6, 8, 9]
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 9
    assert not any(leftover.exists() for leftover in leftovers) and (checkpoints / ".notes.partial").exists()
    out = capsys.readouterr().out
    assert re.search(r"^removed 2 unfinished checkpoint write\(s\) of an interrupted run from .*checkpoints: "
                     r"\.best\.ckpt\.0a9b8c7d\.partial, \.last\.ckpt\.k2j4x9q1\.partial$", out, re.MULTILINE)
    assert re.search(r"; last: .*checkpoints/last\.ckpt$", out, re.MULTILINE), out  # not "(none)"


# ---- exact resume ------------------------------------------------------------------------------

RESUME_CALLBACKS = """  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {root}/checkpoints
        every_n_train_steps: {every}
        save_top_k: 0
        save_last: true
        enable_version_counter: false
    - class_path: seq2seq.training.callbacks.PowerEMA
    - class_path: resume_probe.BatchLog
      init_args:
        path: {root}/batches.jsonl
"""


def fit_subprocess(config: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**probe_env(), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "seq2seq.fit", "--config", str(config), "--seed_everything=7",
               "--model.transformer.dropout=0.2", "--trainer.precision=32-true", "--model.compile=false", *extra]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def resume_run(root: Path, *, every: int = 4, tokenizer: Path | None = None) -> Path:
    """A tiny run of 28 updates that saves last.ckpt every `every` updates (only saving: training is the same)."""
    config = write_tiny_run(root, max_steps=28, train_pairs=250, val_pairs=8)
    text = config.read_text(encoding="utf-8")
    start, end = text.index("  callbacks:\n"), text.index("model:\n")
    callbacks = RESUME_CALLBACKS.format(root=root, every=every)
    config.write_text(text[:start] + callbacks + text[end:], encoding="utf-8")
    if tokenizer is not None:
        shutil.copy(tokenizer, root / "spm.model")  # the same tokenizer: it is not what is tested here
    return config


def batch_log(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "batches.jsonl").read_text().splitlines()]


@pytest.mark.e2e  # (make e2e: three runs, one killed; make test: test_resume_continues_step_and_schedule)
@pytest.mark.parametrize("options", [(), ("--data.bpe_dropout=0.1",)], ids=["plain", "bpe-dropout"])
def test_a_run_killed_and_resumed_trains_exactly_as_one_that_never_stopped(tmp_path: Path, options: tuple[str, ...]):
    """kill -9 mid-epoch, and again right after an epoch ended; `--ckpt_path last` each time. The batches
    (which and in what order, and under BPE-dropout in which pieces), the dropout masks, optimiser, schedule and
    EMA weights all continue: the final weights are bitwise equal to those of a run that never stopped (one
    thread in both)."""
    whole = tmp_path / "whole"
    result = fit_subprocess(resume_run(whole), *options)
    assert result.returncode == 0, result.stderr[-3000:]
    unbroken = batch_log(whole)
    epoch_ends = [r["step"] for r, after in zip(unbroken, unbroken[1:], strict=False) if after["epoch"] != r["epoch"]]
    assert len(unbroken) == 28 and epoch_ends and epoch_ends[0] < 20, epoch_ends  # crosses epochs

    # Killed right after the first epoch's end (last.ckpt saved at its last update), resumed, killed
    # again mid-epoch (last.ckpt 1-3 updates back), resumed to the end. With a loader worker process:
    # workers fetch ahead from iter() on, before Lightning sets the epoch.
    broken, first_epoch = tmp_path / "broken", epoch_ends[0] + 1
    config = resume_run(broken, every=first_epoch, tokenizer=whole / "spm.model")
    result = fit_subprocess(config, *options, "--trainer.callbacks+=resume_probe.KillAt",
                            f"--trainer.callbacks.step={first_epoch + 2}")
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    config = resume_run(broken, every=4)
    mid_epoch = 4 * (first_epoch // 4 + 2)
    assert mid_epoch not in (first_epoch, 2 * first_epoch) and mid_epoch < 28
    # Returns once nothing holds its output pipes: a loader worker that outlived the killed run (a fork
    # server's child, which torch's parent watchdog does not see die) held them until the timeout.
    result = fit_subprocess(config, *options, "--ckpt_path", "last", "--data.num_workers=1",
                            "--trainer.callbacks+=resume_probe.KillAt", f"--trainer.callbacks.step={mid_epoch + 2}",
                            timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    result = fit_subprocess(config, *options, "--ckpt_path", "last", "--data.num_workers=1")
    assert result.returncode == 0, result.stderr[-3000:]

    # What each update trained on: the last record of each step (a killed run's later ones were redone).
    resumed = {r["step"]: r for r in batch_log(broken)}
    assert [resumed[step] for step in sorted(resumed)] == unbroken
    ours = torch.load(broken / "checkpoints" / "last.ckpt", weights_only=True)
    theirs = torch.load(whole / "checkpoints" / "last.ckpt", weights_only=True)
    assert ours["global_step"] == theirs["global_step"] == 28
    for key in ("state_dict", "current_model_state"):  # the EMA weights, and the weights trained
        assert ours[key].keys() == theirs[key].keys()
        for name, tensor in theirs[key].items():
            assert torch.equal(ours[key][name], tensor), (key, name)


def test_precision_auto_defers_to_lightning_s_environment_default_and_to_the_device_type(monkeypatch):
    from seq2seq.training.fit import resolve_auto_precision

    monkeypatch.setenv("_SEQ2SEQ_AUTO_PRECISION", "cuda=bf16-mixed")  # chosen for another device type
    assert resolve_auto_precision("auto", accelerator="cpu") == "32-true"  # decided again for the (AVX2) CPU
    monkeypatch.setenv("PL_TRAINER_PRECISION", "bf16-mixed")
    assert resolve_auto_precision("auto", accelerator="cpu") == "bf16-mixed"
    assert resolve_auto_precision("64-true", accelerator="cpu") == "64-true"


@pytest.mark.parametrize("capability,chosen", [((9, 0), "bf16-mixed"), ((8, 0), "bf16-mixed"), ((7, 5), "32-true")])
def test_precision_auto_on_a_gpu_follows_its_compute_capability(capability, chosen: str, monkeypatch, capsys):
    """The GPU branch of `auto`, with torch.cuda's answers stood in for (no GPU here): decided for cuda:0,
    printed with the GPU's name, passed on to the DDP processes under its device type."""
    from seq2seq.training.fit import resolve_auto_precision

    monkeypatch.setenv("_SEQ2SEQ_AUTO_PRECISION", "")
    monkeypatch.delenv("_SEQ2SEQ_AUTO_PRECISION")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_auto_precision("auto", accelerator="gpu") == chosen
    assert (f"trainer.precision auto: {chosen} on NVIDIA H100 80GB HBM3 (compute capability "
            f"{capability[0]}.{capability[1]}") in capsys.readouterr().out
    assert os.environ["_SEQ2SEQ_AUTO_PRECISION"] == f"cuda={chosen}"
    assert resolve_auto_precision("auto", accelerator="cpu") == "32-true"  # the CPU beside it: its own answer
    assert resolve_auto_precision("auto", accelerator="mps") == "32-true"  # no measurement of ours for mps
