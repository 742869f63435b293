"""Tests for seq2seq.training.module: the schedules, the model schema as the CLI sees it, hyperparameter checks,
and every precision and device branch as far as a CPU can run it."""

import math
import typing
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from conftest import write_tiny_run
from lightning.pytorch.plugins.precision import MixedPrecision

import seq2seq.decoding.search as search_module
import seq2seq.decoding.steps as steps_module
from seq2seq.decoding.config import SearchConfig
from seq2seq.model import ConfigError, TransformerConfig
from seq2seq.model.attention import MultiHeadAttention
from seq2seq.precision import Verdict
from seq2seq.training.callbacks import PowerEMA
from seq2seq.training.data import TranslationDataModule
from seq2seq.training.fit import TranslationCLI
from seq2seq.training.module import TrainingDiverged, TranslationModule

SMALL = TransformerConfig(vocab_size=40, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                          num_decoder_layers=1)


class ParseOnlyCLI(TranslationCLI):
    def instantiate_classes(self) -> None:
        pass


def parse(*args: str):
    return ParseOnlyCLI(TranslationModule, TranslationDataModule, run=False,
                        args=["--data.src_lang=de", "--data.tgt_lang=en", "--data.tokenizer_path=x", *args]).config


def test_every_transformer_config_field_is_settable_from_the_cli_with_its_type():
    """The model's one schema: TranslationModule takes TransformerConfig itself, so no field can be left out
    or re-typed as a plain str (which let `norm: rms` through as RMSNorm by fall-through)."""
    hints = typing.get_type_hints(TransformerConfig)
    config = parse()
    for f in fields(TransformerConfig):
        if f.name == "vocab_size":  # linked from the tokenizer
            continue
        assert getattr(config.model.transformer, f.name) == f.default, f.name
        choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is typing.Literal else ()
        if choices:
            assert getattr(parse(f"--model.transformer.{f.name}={choices[-1]}").model.transformer, f.name) == choices[-1]
    for field in fields(SearchConfig):
        assert getattr(config.model.val_search, field.name) == (1 if field.name == "beam_size" else field.default)


@pytest.mark.parametrize("override", ["--model.transformer.positions=rotery", "--model.transformer.norm=rms",
                                      "--model.transformer.d_modl=3", "--model.val_search.beem=2"])
def test_a_typo_in_the_model_section_is_an_error(override: str, capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit):
        parse(override)
    err = capsys.readouterr().err
    assert override.split("=")[0].removeprefix("--") in err or "unrecognized arguments" in err, err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": -1e-3}, "model.lr: must be > 0, got -0.001"),
        ({"lr": math.nan}, "model.lr: must be a finite number, got nan"),
        ({"warmup_steps": 0}, "model.warmup_steps: must be >= 1, got 0"),  # held the rate at 0 for the whole run
        ({"lr_schedule": "cosine"}, "model.lr_schedule: must be one of inverse_sqrt, linear, got 'cosine'"),
        ({"label_smoothing": 1.0}, "model.label_smoothing: must be >= 0 and < 1, got 1.0"),
        ({"weight_decay": -0.1}, "model.weight_decay: must be >= 0, got -0.1"),
        ({"adam_betas": (0.9, 1.0)}, "model.adam_betas[1]: must be >= 0 and < 1, got 1.0"),
        ({"adam_eps": 0.0}, "model.adam_eps: must be > 0, got 0.0"),
        ({"rdrop_alpha": -1.0}, "model.rdrop_alpha: must be a number >= 0 (0: no R-Drop), got -1.0"),
        ({"rdrop_alpha": math.inf}, "model.rdrop_alpha: must be a number >= 0 (0: no R-Drop), got inf"),
        ({"val_search": SearchConfig(sampling=True)}, "model.val_search.sampling: validation BLEU needs a deterministic"),
    ],
)
def test_bad_hyperparameters_are_refused_at_construction_naming_the_key(options, message):
    with pytest.raises(ConfigError, match=f"^{message.replace('[', '.').replace(']', '.').replace('(', '.').replace(')', '.')}"):
        TranslationModule(**{"transformer": SMALL, **options})


def test_hyperparameters_are_plain_data_for_weights_only_checkpoints():
    module = TranslationModule(transformer=SMALL, val_search=SearchConfig(beam_size=4, length_penalty=1.0))
    assert module.hparams["transformer"] == SMALL.to_dict()
    assert module.hparams["val_search"]["beam_size"] == 4
    assert module.val_search.length_penalty == 1.0 and module.config is SMALL
    torch.save(dict(module.hparams), "/dev/null")  # plain types: no pickle of our classes needed


def test_validation_decodes_without_scores(monkeypatch: pytest.MonkeyPatch):
    """Validation reads the translations' text alone, so its greedy search skips the normaliser
    (SearchConfig.scores), with the tokens the scored search gives."""
    torch.manual_seed(0)
    module = TranslationModule(transformer=SMALL, val_search=SearchConfig(beam_size=1, max_len_a=1.0, max_len_b=4))
    module.tokenizer = SimpleNamespace(bos_id=1, eos_id=2, pad_id=SMALL.pad_id, decode=lambda ids: [str(t) for t in ids])
    src = torch.tensor([[5, 6, 7, 8], [9, 10, 11, SMALL.pad_id]])
    module.eval()
    scored = search_module.decode(module.model, src, module.val_search, bos=1, eos=2, pad=SMALL.pad_id)

    def refused(*args, **kwargs):
        raise AssertionError("validation ran the normaliser")

    monkeypatch.setattr(steps_module, "log_normalizer", refused)  # where step_logits reads them
    monkeypatch.setattr(steps_module, "normalizer_and_bounds", refused)
    assert module.translate_batch(src) == [str(hyps[0].tokens) for hyps in scored]


# ---- every precision and device a machine may bring ----------------------------------------------


class OptimizerProbe(L.Callback):
    """What the optimizer saw at the first update (Adam's first moment, (1 - beta1) * the gradient used),
    and each rank's precision and attention setting."""

    def __init__(self):
        self.first_moment_norm: float | None = None
        self.fp32_attention: set[bool] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        state = trainer.optimizers[0].state
        moments = [state[p]["exp_avg"] for p in pl_module.parameters() if p in state]
        if self.first_moment_norm is None and moments:  # not before the first update taken
            self.first_moment_norm = float(torch.linalg.vector_norm(torch.stack([m.norm() for m in moments])))
        self.fp32_attention |= {m.fp32_under_autocast for m in pl_module.modules() if isinstance(m, MultiHeadAttention)}


def tiny_training(root: Path, *, module_options: dict | None = None, **trainer_options
                  ) -> tuple[TranslationModule, OptimizerProbe]:
    """Two updates of a one-layer model on Multi30k pairs, in this process."""
    write_tiny_run(root, train_pairs=600, val_pairs=4)
    data = TranslationDataModule(src_lang="de", tgt_lang="en", tokenizer_path=str(root / "spm.model"), vocab_size=600,
                                 train_files=[str(root / "data/train.de"), str(root / "data/train.en")],
                                 max_tokens=256, max_tokens_per_sentence=64, cache_dir=str(root / "cache"))
    module = TranslationModule(transformer=TransformerConfig(vocab_size=600, d_model=16, num_heads=2, d_ff=32,
                                                             num_encoder_layers=1, num_decoder_layers=1),
                               warmup_steps=1, **(module_options or {}))
    probe = OptimizerProbe()
    callbacks = [probe, *trainer_options.pop("callbacks", [])]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, default_root_dir=root, **trainer_options)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2
    return module, probe


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_gradients_are_clipped_under_every_precision(precision: str, fused: bool, tmp_path: Path, monkeypatch):
    """Lightning's mixed-precision plugin refused to clip with the fused AdamW: the first update of every
    shipped config crashed wherever `auto` picked bf16-mixed. Clipped at 1e-3 (far below the raw norm),
    the optimizer must have seen gradients of norm 1e-3, under fp16 too, where a GradScaler multiplies
    them by 2^16 first (16-mixed is a GPU precision; on a CPU Lightning would swap in bf16, so the
    plugin is built here by hand) and clipping before unscaling would leave them 2^16 times smaller.
    Unfused: the AdamW of devices with no fused one, which Lightning unscales itself (once only)."""
    if not fused:
        adamw = torch.optim.AdamW
        monkeypatch.setattr(torch.optim, "AdamW", lambda *args, fused=None, **kwargs: adamw(*args, fused=False, **kwargs))
    options: dict = {"precision": precision}
    if precision == "16-mixed":
        options = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    module, probe = tiny_training(tmp_path, gradient_clip_val=1e-3, **options)
    assert module.trainer.optimizers[0].defaults["fused"] is fused  # the fastest valid step, where there is one
    adam_beta1 = module.hparams["adam_betas"][0]
    assert probe.first_moment_norm == pytest.approx((1 - adam_beta1) * 1e-3, rel=1e-3)


def test_fp16_overflows_are_skipped_by_the_scaler_not_taken_for_divergence(tmp_path: Path):
    """Under 16-mixed a GradScaler starts high and backs off: its first steps may overflow to infinite
    gradients, which it skips. The divergence check must leave those to it (elsewhere it stops the run)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # fp16 overflows at 65504
    module, _ = tiny_training(tmp_path, gradient_clip_val=1.0, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert scaler.get_scale() < 2.0**40  # it overflowed, and backed off
    assert all(torch.isfinite(p).all() for p in module.parameters())  # the overflowing steps were skipped


@pytest.mark.parametrize("bf16_attention", [False, True])
def test_the_attention_verdict_is_applied_under_autocast(bf16_attention: bool, tmp_path: Path, monkeypatch):
    """Under bf16-mixed the module asks whether attention pays in bf16 here, and sets every attention layer
    accordingly (fp32 attention where bf16's kernels are slower, as torch's CPU ones were on an AMX Xeon)."""
    asked = []

    def verdict(device, *, dropout):
        asked.append((device.type, dropout))
        return Verdict(bf16_attention, "pretended")

    monkeypatch.setattr("seq2seq.training.machine.bf16_attention", verdict)
    _, probe = tiny_training(tmp_path, precision="bf16-mixed")
    assert asked == [("cpu", False)] and probe.fp32_attention == {not bf16_attention}
    asked.clear()
    _, probe = tiny_training(tmp_path / "fp32", precision="32-true")
    assert asked == [] and probe.fp32_attention == {False}  # no autocast: nothing to decide


@pytest.mark.parametrize(("setting", "pays", "compiled", "rdrop_alpha"),
                         [("auto", False, False, 0.0), ("auto", True, True, 0.0), (False, True, False, 0.0),
                          ("auto", True, True, 5.0)])
def test_the_compiled_step_is_chosen_by_its_verdict(setting, pays: bool, compiled: bool, rdrop_alpha: float,
                                                    tmp_path: Path, monkeypatch):
    """model.compile auto asks whether the compiled step pays here (once, with the run's precision and token budget,
    twice the budget under R-Drop, whose step runs the batch twice over) and trains through it where it does; false
    never asks. The compile itself is tested in test_compiled_training.py."""
    asked, compiles = [], []

    def verdict(config, device, *, precision, max_tokens, fp32_attention, fp32_residual):
        asked.append((device.type, precision, max_tokens, fp32_attention, fp32_residual))
        return Verdict(pays, "pretended")

    def compile_hidden_states(model):
        compiles.append(model)
        return model.hidden_states  # eager, as a stand-in: the training loop runs through what setup chose

    monkeypatch.setattr("seq2seq.training.machine.compiled_step_pays", verdict)
    monkeypatch.setattr("seq2seq.training.module.compile_hidden_states", compile_hidden_states)
    module, _ = tiny_training(tmp_path, module_options={"compile": setting, "rdrop_alpha": rdrop_alpha})
    budget = 512 if rdrop_alpha else 256
    assert asked == ([("cpu", "32-true", budget, False, False)] if setting == "auto" else [])
    assert compiles == ([module.model] if compiled else [])


@pytest.mark.e2e  # a compile of forward and backward under autocast: ~40 s
def test_training_through_the_compiled_step(tmp_path: Path):
    """model.compile true, bf16-mixed: Lightning trains through the compiled encoder and decoder (clipping, the
    fused AdamW, the divergence check) and the weights stay finite."""
    module, probe = tiny_training(tmp_path, module_options={"compile": True}, precision="bf16-mixed",
                                  gradient_clip_val=1.0)
    assert module._hidden_states is not None and probe.first_moment_norm
    assert all(torch.isfinite(p).all() for p in module.parameters())


class HostWaits(L.Callback):
    """The ops of each training step (batch start to batch end: forward, loss, backward, clipping, the optimizer's
    step) that make a host wait for a GPU: a tensor's value read on the host (.item(), bool, int), or a count of
    true values (nonzero, a boolean mask's selection), recorded on a CPU through torch's dispatcher."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        waits, ops = self.waits, self.ops = [], []

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.__name__
                ops.append(name)
                bool_index = name.startswith(("index.", "index_put")) and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []) if i is not None)
                if name.split(".")[0] in ("_local_scalar_dense", "nonzero", "masked_select", "item") or bool_index:
                    waits.append(name)
                return func(*args, **(kwargs or {}))

        self.mode, self.steps = Record(), 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.mode.__exit__(None, None, None)
        self.steps += 1


@pytest.mark.parametrize("precision,rdrop_alpha", [("32-true", 0.0), ("bf16-mixed", 0.0), ("bf16-mixed", 5.0)])
def test_a_training_step_never_waits_for_the_device(precision: str, rdrop_alpha: float, tmp_path: Path):
    """On a GPU every wait for the device inside a step idles it while the host catches up; the step has none
    (the target positions come with the batch, the loss and token counts are summed on the device and read at
    the log, the divergence flag goes to the fused AdamW as found_inf, PowerEMA counts its updates on the host),
    clipped, under each precision, and under R-Drop (its batch doubled on the device)."""
    waits = HostWaits()
    write_tiny_run(tmp_path, train_pairs=600, val_pairs=4)
    data = TranslationDataModule(src_lang="de", tgt_lang="en", tokenizer_path=str(tmp_path / "spm.model"),
                                 vocab_size=600, train_files=[str(tmp_path / "data/train.de"),
                                                              str(tmp_path / "data/train.en")],
                                 max_tokens=256, max_tokens_per_sentence=64, cache_dir=str(tmp_path / "cache"))
    module = TranslationModule(transformer=TransformerConfig(vocab_size=600, d_model=16, num_heads=2, d_ff=32,
                                                             num_encoder_layers=1, num_decoder_layers=1),
                               warmup_steps=1, rdrop_alpha=rdrop_alpha)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=True, enable_model_summary=False,
                        callbacks=[PowerEMA(), waits], default_root_dir=tmp_path, precision=precision,
                        gradient_clip_val=1.0,
                        log_every_n_steps=50)
    trainer.fit(module, datamodule=data)
    assert waits.steps == 4 and "_fused_adamw_.default" in waits.ops  # (the steps were seen)
    assert waits.waits == []
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_the_loss_and_speed_are_logged_every_log_every_n_steps(tmp_path: Path):
    """Summed on the device between logs and logged where Lightning writes its logs: after the 2nd update with
    log_every_n_steps 2 (the interval's loss per target token, its tokens a second); nothing before it."""

    class Logged(L.Callback):  # (a callback's batch end comes before the module's: it sees the previous batch's logs)
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append(sorted(k for k in trainer.callback_metrics if k.startswith(("train_", "tgt_"))))

    logged = Logged()
    module, _ = tiny_training(tmp_path, callbacks=[logged], log_every_n_steps=2)
    metrics = module.trainer.callback_metrics
    assert logged.seen == [[], []]
    assert sorted(k for k in metrics if k.startswith(("train_", "tgt_"))) == ["tgt_tokens_per_sec", "train_loss",
                                                                                "train_nll"]
    assert all(0 < float(metrics[k]) < 1e9 for k in ("train_loss", "train_nll", "tgt_tokens_per_sec"))


def test_a_diverged_step_is_skipped_on_the_device_and_stops_the_run_at_the_next_read(tmp_path: Path):
    """Non-finite gradients at the second update: the fused AdamW leaves every weight (and its moments) as they
    were, and the run stops where the flag is next read (here the end of training), naming that step."""

    class Poison(L.Callback):
        def on_after_backward(self, trainer, pl_module):
            if trainer.global_step == 1:
                next(pl_module.parameters()).grad[0] = float("nan")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.before = [p.detach().clone() for p in pl_module.parameters()]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.after = [p.detach().clone() for p in pl_module.parameters()]

    poison = Poison()
    with pytest.raises(TrainingDiverged, match="^the gradients are NaN or infinite at step 1: the run diverged"):
        tiny_training(tmp_path, callbacks=[poison])
    assert all(torch.equal(a, b) for a, b in zip(poison.before, poison.after, strict=True))


def test_a_bad_compile_setting_names_the_key():
    with pytest.raises(ConfigError, match="^model.compile: must be true, false or auto, got 'yes'"):
        TranslationModule(transformer=SMALL, compile="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("fp32_residual", [False, True])
def test_the_residual_stream_s_precision_is_the_module_s_option(fp32_residual: bool):
    """model.fp32_residual reaches the model (bf16 by default under bf16 autocast: tests/model/test_model.py), and is
    kept in the checkpoint's hyperparameters so that a resume computes alike."""
    module = TranslationModule(transformer=SMALL, fp32_residual=fp32_residual)
    assert module.model.residual_in_fp32() is fp32_residual and module.hparams["fp32_residual"] is fp32_residual
    with pytest.raises(ConfigError, match="^model.fp32_residual: must be true or false, got 'no'"):
        TranslationModule(transformer=SMALL, fp32_residual="no")  # type: ignore[arg-type]


@pytest.mark.parametrize("device,fused", [("cpu", True), ("cuda", True), ("mps", False), ("meta", False)])
def test_the_fused_optimizer_where_torch_has_one(device: str, fused: bool, monkeypatch):
    module = TranslationModule(transformer=SMALL)
    monkeypatch.setattr(TranslationModule, "device", property(lambda self: torch.device(device)))
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"] is fused
