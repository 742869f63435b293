"""Tests for seq2seq.module: the schedules, the model schema as the CLI sees it, hyperparameter checks."""

import io
import math
import typing
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Timer

from seq2seq.data import TranslationDataModule
from seq2seq.fit import TranslationCLI
from seq2seq.model import ConfigError, TransformerConfig
from seq2seq.module import LinearToZero, TranslationModule, inverse_sqrt_schedule, linear_schedule, time_spent
from seq2seq.search import SearchConfig

SMALL = TransformerConfig(vocab_size=40, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                          num_decoder_layers=1)


def test_inverse_sqrt_schedule():
    assert inverse_sqrt_schedule(0, warmup_steps=4) == 0.25
    assert inverse_sqrt_schedule(3, warmup_steps=4) == 1.0  # the peak, at the 4th update
    assert inverse_sqrt_schedule(15, warmup_steps=4) == pytest.approx(0.5)  # sqrt(4/16)


def test_linear_schedule_warms_up_then_falls_to_zero_at_the_end_of_the_budget():
    assert linear_schedule(0, warmup_steps=4, progress=0.0) == 0.25
    assert linear_schedule(3, warmup_steps=4, progress=0.0) == 1.0
    assert linear_schedule(3, warmup_steps=4, progress=0.1) == pytest.approx(0.9)  # the lower of the two lines
    assert linear_schedule(1, warmup_steps=4, progress=0.9) == pytest.approx(0.1)  # a short budget cuts warm-up
    assert linear_schedule(50, warmup_steps=4, progress=1.0) == 0.0
    assert linear_schedule(50, warmup_steps=4, progress=1.2) == 0.0  # never negative


def test_linear_to_zero_follows_updates_or_time_whichever_is_further():
    multiplier = LinearToZero(warmup_steps=2)
    assert multiplier(10) == 1.0  # no budget known yet: the peak
    multiplier.budget_steps = 40
    assert multiplier(10) == pytest.approx(0.75)
    multiplier.time_spent = 0.5
    assert multiplier(10) == pytest.approx(0.5)  # the clock is further on than the updates
    assert multiplier(30) == pytest.approx(0.25)
    assert multiplier(40) == 0.0 and multiplier(41) == 0.0


def test_linear_to_zero_state_is_plain_data_and_is_restored():
    """LambdaLR saves the multiplier's attributes in the checkpoint, which must load with weights_only=True."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    multiplier = LinearToZero(warmup_steps=2)
    multiplier.budget_steps, multiplier.time_spent = 40.0, 0.25
    schedule = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([parameter], lr=1.0), multiplier)
    buffer = io.BytesIO()
    torch.save(schedule.state_dict(), buffer)
    buffer.seek(0)
    fresh = LinearToZero(warmup_steps=2)
    torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([parameter], lr=1.0), fresh).load_state_dict(
        torch.load(buffer, weights_only=True))
    assert (fresh.budget_steps, fresh.time_spent) == (40.0, 0.25)


def test_time_spent_is_the_share_of_max_time_and_is_broadcast():
    timer = Timer(duration="00:00:02:00")
    timer.load_state_dict({"time_elapsed": {"train": 30.0}})  # a resumed run: 30 s already spent
    broadcast = []
    strategy = SimpleNamespace(broadcast=lambda value: broadcast.append(value) or value)
    assert time_spent(SimpleNamespace(callbacks=[timer], strategy=strategy)) == pytest.approx(0.25)
    assert broadcast == [pytest.approx(0.25)]  # rank 0's value is what every rank uses
    timer.load_state_dict({"time_elapsed": {"train": 500.0}})
    assert time_spent(SimpleNamespace(callbacks=[timer], strategy=strategy)) == 1.0
    assert time_spent(SimpleNamespace(callbacks=[Timer(duration=None)], strategy=strategy)) == 0.0  # no max_time


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
        ({"val_search": SearchConfig(sampling=True)}, "model.val_search.sampling: validation BLEU needs a deterministic"),
        ({"transformer": TransformerConfig(vocab_size=40, d_model=16, num_heads=2, pad_id=5)},
         "model.transformer.pad_id: must be the tokenizer's pad id 0, got 5"),
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
