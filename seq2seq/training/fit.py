"""python -m seq2seq.fit --config configs/X.yaml [--trainer.max_epochs=3 ...] [--ckpt_path last]

LightningCLI over TranslationModule and TranslationDataModule: the YAML's `trainer:`, `model:` and
`data:` sections are their constructor arguments (`model.transformer` is the TransformerConfig).
The model's vocabulary size is linked from the data module's tokenizer (trained on the first run,
by one process only), so no number has to be kept in sync by hand.

`trainer.precision: auto` (the default) is decided here, before Lightning sees it: bf16-mixed on a
GPU with native bf16 and on a CPU with bf16 matmul units (seq2seq/precision.py says how that
is decided), else 32-true. The choice and its reason are printed at start.

Before any work, and so before hours of training can be lost: the model section is validated
(every key named in its error), the checkpoint and log folders must be writable, and a resumed
checkpoint must exist and pass the checks of checkpoint.py. Checkpoints are written atomically
beside their target and a failed write ends the run. A bad input ends with one `error:` line.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision.precision import (
    _PRECISION_INPUT,  # Lightning's choices: jsonargparse checks them
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only

from seq2seq.checkpoint import (
    CheckpointError,
    check_training_state,
    load_checkpoint,
    read_inference,
    remove_partial_writes,
    save_atomic,
)
from seq2seq.decoding.config import SearchConfig
from seq2seq.model import ConfigError, TransformerConfig
from seq2seq.precision import AUTO_TRAINING_PRECISION_ENV, bf16_matmuls, device_name, tune_process_memory
from seq2seq.text.tokenizer import PAD_ID, Tokenizer
from seq2seq.training.corpus import DataError, os_reason
from seq2seq.training.data import TranslationDataModule
from seq2seq.training.module import TrainingDiverged, TranslationModule, check_hyperparameters
from seq2seq.training.pretrained import fine_tuning_config, load_pretrained
from seq2seq.training.schedule import NO_END, max_time_timer

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning 2.6 stages a checkpoint in TMPDIR and moves it (a copy, not atomic, across
    filesystems: a kill leaves a truncated file), and swallows a PermissionError (the run "succeeds"
    with no checkpoint). This one writes beside the target, renames, and raises."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        try:
            save_atomic(checkpoint, path)
        except (OSError, RuntimeError) as error:
            if isinstance(error, RuntimeError) and "unexpected pos" not in str(error):
                raise  # not a write error (a CUDA error while saving, say): keep its own message
            # torch's zip writer reports a full disk as "unexpected pos" (a RuntimeError)
            reason = os_reason(error) if isinstance(error, OSError) else "the disk may be full"
            free = shutil.disk_usage(Path(path).parent).free / 2**20 if Path(path).parent.is_dir() else float("nan")
            raise CheckpointError(f"cannot write checkpoint {path}: {reason} ({free:.0f} MiB free there); "
                                  "free space or fix the folder, then resume with --ckpt_path last") from error


def resolve_auto_precision(precision: Any, *, accelerator: Any) -> Any:
    """`auto` made concrete for the device training will run on; any other value is Lightning's to check.

    Decided once, by the process the user started: the DDP processes Lightning launches inherit the
    choice through the environment, so ranks cannot decide differently and train in different precisions.
    """
    if precision != "auto":
        return precision
    if os.environ.get("PL_TRAINER_PRECISION"):  # Lightning's environment default, which a value given bypasses
        return os.environ["PL_TRAINER_PRECISION"]
    name = str(accelerator).lower()
    if name in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        device = torch.device("cuda", 0)
    elif name in ("auto", "cpu"):
        device = torch.device("cpu")
    else:  # mps, tpu, an Accelerator object: no measurement of ours applies
        device = torch.device("meta")
    inherited = os.environ.get(AUTO_TRAINING_PRECISION_ENV, "")  # "cpu=32-true": the device type it was chosen for
    if inherited.startswith(f"{device.type}="):
        return inherited.split("=", 1)[1]
    verdict = bf16_matmuls(device, training=True)
    chosen = "bf16-mixed" if verdict.pays else "32-true"
    os.environ[AUTO_TRAINING_PRECISION_ENV] = f"{device.type}={chosen}"
    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # set by Lightning from RANK / SLURM_PROCID / LOCAL_RANK
        where = device_name(device) if device.type != "meta" else str(accelerator)
        print(f"trainer.precision auto: {chosen} on {where} ({verdict.why})", flush=True)
    return chosen


def check_accelerator(accelerator: Any) -> None:
    """A GPU asked for where torch has none is one line naming the key (configs/wmt.yaml asks for one):
    Lightning would raise a MisconfigurationException, after `auto` had printed a choice for no device."""
    if str(accelerator).lower() in ("gpu", "cuda") and not torch.cuda.is_available():
        build = (f"this torch ({torch.__version__}) is a CPU-only build" if torch.version.cuda is None
                 else f"this torch ({torch.__version__}, CUDA {torch.version.cuda}) finds no GPU")
        raise ConfigError("trainer.accelerator", f"{accelerator} asks for a CUDA GPU, but {build}; run on a GPU "
                          "machine with a CUDA build of torch (docs/installation.md), or pass "
                          "--trainer.accelerator=cpu")


class Trainer(pl.Trainer):
    """Lightning's Trainer with `precision: auto`, resolved before Lightning (whose choices it is not one of) sees it."""

    def __init__(self, *, precision: Literal["auto"] | _PRECISION_INPUT | None = "auto", **kwargs: Any) -> None:
        super().__init__(precision=resolve_auto_precision(precision, accelerator=kwargs.get("accelerator", "auto")),
                         **kwargs)


class TranslationCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.vocab_size", "model.transformer.vocab_size", apply_on="instantiate")
        # A fine-tuning run's data is tokenised with the pretrained model's tokenizer.
        parser.link_arguments("model.init_from", "data.init_from", apply_on="parse")
        parser.add_argument(
            "--ckpt_path",
            type=str | None,
            default=None,
            help="resume from this checkpoint: a path, or 'last' for the newest last*.ckpt the checkpoint callback wrote",
        )
        # The data module's batch sampler shards token-budget batches across ranks itself; Lightning's
        # DistributedSampler would split them a second time.
        parser.set_defaults({"trainer.use_distributed_sampler": False})

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        # Which model.transformer fields the YAML files and the command line set: a fine-tuning run takes
        # the others from model.init_from (the parsed config holds every field, defaults filled in). Only
        # then: without init_from the second parse would fail on the link from it.
        self.given_fields: dict[str, set[str]] = {"model.transformer": set(), "data": set()}
        if self.config["model"].get("init_from") is not None:
            given = parser.parse_args(args, defaults=False)
            for section in self.given_fields:
                values = given.get(section)
                self.given_fields[section] = set(vars(values)) if values is not None else set()

    def before_instantiate_classes(self) -> None:
        # Instantiating the data module trains the tokenizer (minutes on WMT): check the model first.
        check_model_section(self.config["model"], given_fields=self.given_fields["model.transformer"])
        if self.config["model"].get("init_from") is not None:
            check_fine_tuning_data(self.config["data"], init_from=self.config["model"]["init_from"],
                                   given_fields=self.given_fields["data"])
        check_accelerator(self.config["trainer"]["accelerator"])
        if not self.config["trainer"].get("reload_dataloaders_every_n_epochs"):
            # Each epoch can pack its own number of batches (BPE-dropout, more pairs than one shuffle window, several
            # directions' shares: training/data.py), and Lightning reads a loader's length once per build: it would
            # validate only after epochs as long as the first and cut longer ones short. Building the loaders each
            # epoch makes it read each epoch's length (on a CPU, milliseconds; worker processes restart).
            self.config["trainer"]["reload_dataloaders_every_n_epochs"] = 1


def check_model_section(model: Any, *, given_fields: Collection[str]) -> None:
    """The parsed `model:` section's values, checked as construction will check them; errors name the key.
    given_fields: the model.transformer fields set by the YAML or the command line."""
    for section in ("transformer", "val_search"):
        if getattr(model, section, None) is None:  # `val_search:` with every key commented out is YAML null
            raise ConfigError(f"model.{section}", "is empty; give its fields, or leave the key out for the defaults")
    transformer = {key: value for key, value in vars(model.transformer).items() if key != "vocab_size"}
    try:
        val_search = SearchConfig(**vars(model.val_search))
    except ConfigError as error:
        raise ConfigError(f"model.val_search.{error.field}", error.problem) from None
    check_hyperparameters(val_search=val_search, label_smoothing=model.label_smoothing, lr=model.lr,
                          lr_schedule=model.lr_schedule, warmup_steps=model.warmup_steps,
                          weight_decay=model.weight_decay, adam_betas=tuple(model.adam_betas), adam_eps=model.adam_eps)
    if model.init_from is not None:
        pretrained = load_pretrained(model.init_from).config
        try:
            given = TransformerConfig(**{**transformer, "vocab_size": pretrained.vocab_size})
        except ConfigError as error:
            raise ConfigError(f"model.transformer.{error.field}", error.problem) from None
        merged = fine_tuning_config(pretrained, given, init_from=model.init_from, given_fields=given_fields)
        for key, value in merged.to_dict().items():  # the saved config.yaml shows the model trained
            if key != "vocab_size":
                setattr(model.transformer, key, value)
        return
    # The pad id first: the stand-in vocab_size below must not appear in its message.
    if transformer.get("pad_id", PAD_ID) != PAD_ID:
        raise ConfigError("model.transformer.pad_id", f"must be the tokenizer's pad id {PAD_ID}, got "
                          f"{transformer['pad_id']!r}; leave it out")
    try:
        # vocab_size comes from the tokenizer later; any value that passes stands in for it here.
        TransformerConfig(vocab_size=PAD_ID + 1, **transformer)
    except ConfigError as error:
        raise ConfigError(f"model.transformer.{error.field}", error.problem) from None


def check_fine_tuning_data(data: Any, *, init_from: str, given_fields: Collection[str]) -> None:
    """What the `data:` section says that model.init_from decides: the directions, where the tags go, the tokenizer."""
    pretrained = load_pretrained(init_from)
    several = getattr(data, "directions", None)
    theirs = list(pretrained.directions) or [(pretrained.src_lang, pretrained.tgt_lang)]
    ours = [_pair(d) for d in several] if several else [(data.src_lang, data.tgt_lang)]
    if not several and not pretrained.directions and ours[0] == theirs[0][::-1]:
        raise ConfigError("data.src_lang", f"is {data.src_lang} and data.tgt_lang {data.tgt_lang}, but model.init_from "
                                           f"{init_from} translates {theirs[0][0]} to {theirs[0][1]}: this data would "
                                           "train it backwards; swap them, or start from a model of this direction")
    target_tag = getattr(data, "target_tag", "encoder")
    if several and pretrained.directions and target_tag != pretrained.target_tag:
        raise ConfigError("data.target_tag", f"is {target_tag}, but model.init_from {init_from} was trained with its "
                                             f"tags on the {pretrained.target_tag} side; give {pretrained.target_tag}")
    if set(ours) != set(theirs):  # another name for a language (deu, de), new directions, a model made bilingual
        shown = {"them": ", ".join(f"{s}→{t}" for s, t in theirs), "us": ", ".join(f"{s}→{t}" for s, t in ours)}
        log.warning(f"note: model.init_from {init_from} translates {shown['them']}; this run's data is {shown['us']}, "
                    "which the fine-tuned checkpoint will say"
                    + ("" if several or not pretrained.directions else " (a bilingual model: its sources without tags)"))
    vocab_size = Tokenizer.from_bytes(pretrained.tokenizer).vocab_size
    if "vocab_size" in given_fields and data.vocab_size != vocab_size:
        raise ConfigError("data.vocab_size", f"is {data.vocab_size}, but the data is tokenised with model.init_from "
                                             f"{init_from}'s tokenizer, of {vocab_size} pieces (none is trained): "
                                             "leave it out")
    ignored = sorted({"tokenizer_model_type", "character_coverage"} & set(given_fields))
    if ignored:
        log.warning(f"note: data.{' and data.'.join(ignored)} ignored: no tokenizer is trained, model.init_from "
                    f"{init_from}'s is used")


def _pair(direction: Any) -> tuple[str, str]:
    """A data.directions entry's (src, tgt), as the config holds it before it is instantiated (or after)."""
    if isinstance(direction, dict):
        return direction["src_lang"], direction["tgt_lang"]
    return direction.src_lang, direction.tgt_lang


def check_writable(folder: str | Path, *, option: str) -> None:
    """Create `folder` and a file in it now, rather than learn at the first checkpoint that we cannot."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise CheckpointError(f"{option}: cannot write to {folder} ({os_reason(error)}); fix its "
                              f"permissions or choose another folder") from None


def check_output_folders(trainer: pl.Trainer) -> None:
    """Every checkpoint folder writable, and cleared of the unfinished writes of a killed run."""
    # On every rank: harmless when repeated, and then all ranks stop alike instead of some waiting.
    check_writable(trainer.default_root_dir, option="trainer.default_root_dir")
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            check_writable(callback.dirpath, option="ModelCheckpoint dirpath")
            if rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # the rank that writes checkpoints
                removed = remove_partial_writes(callback.dirpath)
                if removed:
                    print(f"removed {len(removed)} unfinished checkpoint write(s) of an interrupted run from "
                          f"{callback.dirpath}: {', '.join(path.name for path in removed)}", flush=True)


def check_budget(model: TranslationModule, trainer: pl.Trainer) -> None:
    """A linear decay to 0 needs an end to decay to (Lightning counts max_epochs=-1 as none). Checked
    here, before any data work; the module checks again at the start of training."""
    endless = trainer.max_steps == -1 and trainer.max_epochs == -1 and max_time_timer(trainer) is None
    if model.hparams["lr_schedule"] == "linear" and endless:
        raise ConfigError("model.lr_schedule", NO_END)
    if model.hparams["tokens_per_update"] is not None and trainer.accumulate_grad_batches != 1:
        raise ConfigError("model.tokens_per_update", f"is given, and so is trainer.accumulate_grad_batches="
                          f"{trainer.accumulate_grad_batches}: give one (tokens_per_update sets the accumulation)")


def check_lengths(model: TranslationModule, data: TranslationDataModule) -> None:
    """Training pairs may have max_tokens_per_sentence tokens, + 1 for BOS or EOS: the model must take them."""
    if model.config.max_positions < data.max_tokens_per_sentence + 1:
        raise ConfigError("model.transformer.max_positions", f"{model.config.max_positions} cannot hold a pair of "
                          f"data.max_tokens_per_sentence={data.max_tokens_per_sentence} tokens (+1 for BOS/EOS); "
                          "raise one or lower the other")


def resolve_resume(trainer: pl.Trainer, ckpt_path: str | None, *, model: TranslationModule,
                   data: TranslationDataModule) -> str | None:
    """The checkpoint to resume from, checked; 'last' with none to find is an error, not a fresh start.

    It must hold this run's model (every TransformerConfig field) and tokenizer: weights trained with
    another tokenizer of the same size would load without a word and read every id as another piece.
    """
    if ckpt_path is None or ckpt_path == "hpc" or ckpt_path.lower().startswith("registry"):
        return ckpt_path
    init_from = model.hparams.get("init_from")
    if ckpt_path == "last":
        folders = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks
                   if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None]
        found = [path for folder in folders for path in folder.glob("last*.ckpt")]
        if not found:
            where = ", ".join(map(str, folders)) or "(no ModelCheckpoint with a dirpath)"
            raise CheckpointError(f"--ckpt_path last: no last*.ckpt in {where}; to train from scratch leave "
                                  "out --ckpt_path, or give a checkpoint's path")
        path = max(found, key=lambda p: p.stat().st_mtime)
    else:
        path = Path(ckpt_path)
    try:
        checkpoint = load_checkpoint(path)
        stored = read_inference(path, checkpoint)
        check_training_state(path, checkpoint)  # the trained weights, the optimiser: what a resume loads
    except CheckpointError as error:
        raise CheckpointError(f"--ckpt_path {ckpt_path}: {error}; or leave out --ckpt_path to start afresh") from None
    started_from = checkpoint.get("hyper_parameters", {}).get("init_from")
    if init_from is None and started_from is not None:
        raise CheckpointError(f"--ckpt_path {ckpt_path}: {path} is of a fine-tuning run started from {started_from}: "
                              f"repeat that run's command, --model.init_from {started_from} included")
    if init_from is not None and (started_from is None or not same_file(started_from, init_from)):
        # Resuming a fine-tuning run is its command plus --ckpt_path; any other pairing mixes two meanings.
        raise CheckpointError(f"model.init_from and --ckpt_path {ckpt_path} are both given, but {path} is not a "
                              f"checkpoint of a run started from {init_from}: init_from starts a new run from a "
                              "model's weights (fresh optimiser, step 0), --ckpt_path resumes a run exactly (to "
                              "resume a fine-tuning run, repeat its command with --ckpt_path); give one of them")
    missing = [key for key in ("optimizer_states", "loops") if key not in checkpoint]
    if missing:  # written by seq2seq.average (or stripped): Lightning would fail with a KeyError deep in restore
        raise CheckpointError(f"--ckpt_path {ckpt_path}: {path} holds a model's weights but no training state "
                              f"({', '.join(missing)}), as an averaged checkpoint does: it can be translated with "
                              "or exported, not resumed; resume from a checkpoint that training wrote")
    ours = model.config.to_dict()
    differ = [key for key, value in stored.config.to_dict().items() if ours.get(key) != value]
    if differ:
        key = differ[0]
        raise ConfigError(f"model.transformer.{key}", f"is {ours.get(key)!r} but the checkpoint to resume "
                          f"({path}) was trained with {getattr(stored.config, key)!r}; set it back, or leave out "
                          "--ckpt_path to train a new model")
    if stored.tokenizer != data.tokenizer.to_bytes():
        raise CheckpointError(f"--ckpt_path {ckpt_path}: {path} was trained with another tokenizer than "
                              f"data.tokenizer_path={data.tokenizer_path}; point it at that run's spm.model")
    return str(path)


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (./m.ckpt and /abs/m.ckpt, or links to it), or, for files not
    there any more, the same absolute path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def main(args: list[str] | None = None) -> TranslationCLI:
    tune_process_memory()  # large blocks reused, not page-faulted in again; oneDNN's kernel cache bounded
    show_our_reports()
    try:
        return fit(args)
    except (ConfigError, DataError, CheckpointError, TrainingDiverged) as error:
        raise SystemExit(f"error: {error}") from None


def show_our_reports() -> None:
    """Our INFO lines (the tokenizer trained, how many pairs were read, dropped and kept) on stdout, as
    Lightning shows its own: Python's default level (WARNING) hid them, so a user preparing millions of
    pairs saw nothing of it. Where the program has configured logging itself, its handlers decide."""
    logger = logging.getLogger("seq2seq")
    logger.setLevel(logging.INFO)
    if not logging.getLogger().handlers and not any(isinstance(h, StdoutHandler) for h in logger.handlers):
        handler = StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


class StdoutHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout is when a line comes, not the one there when it was made (fit is
    also called in-process, by tests or a notebook, each with a stdout of its own)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


def fit(args: list[str] | None) -> TranslationCLI:
    cli = TranslationCLI(
        TranslationModule,
        TranslationDataModule,
        trainer_class=Trainer,
        run=False,
        # A second run in the same folder overwrites the saved config instead of refusing to start.
        save_config_kwargs={"overwrite": True},
        args=args,
    )
    trainer = cli.trainer
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # keep a CheckpointIO the user chose
        trainer.strategy.checkpoint_io = AtomicCheckpointIO()
    check_lengths(cli.model, cli.datamodule)
    check_budget(cli.model, trainer)
    check_output_folders(trainer)
    ckpt_path = resolve_resume(trainer, cli.config.get("ckpt_path"), model=cli.model, data=cli.datamodule)
    if cli.model.hparams.get("init_from") is not None and ckpt_path is None and cli.datamodule.has_validation:
        # The first BLEU of a fine-tuning run is the pretrained model's: what the run must improve on.
        trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    checkpoint = trainer.checkpoint_callback
    if trainer.is_global_zero and isinstance(checkpoint, ModelCheckpoint):
        best = checkpoint.best_model_score
        print(
            f"best {checkpoint.monitor} = {best.item() if best is not None else float('nan'):.2f}: "
            f"{checkpoint.best_model_path or '(none)'}; last: {newest_last_checkpoint(trainer) or '(none)'}"
        )
    return cli


def newest_last_checkpoint(trainer: pl.Trainer) -> str | None:
    """The newest last*.ckpt any ModelCheckpoint wrote: Lightning's save_last one, or one of our configs'
    `filename: last` writers (which Lightning counts as a "best by step")."""
    written = [path for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)
               for path in (callback.last_model_path, callback.best_model_path)
               if path and Path(path).name.startswith("last") and Path(path).is_file()]
    return max(written, key=lambda path: Path(path).stat().st_mtime, default=None)
