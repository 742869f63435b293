"""Training callbacks: PowerEMA; TuneLengthPenalty, with which python -m seq2seq.fit chooses the length penalty on
validation and stores it as the checkpoint's default."""

from pathlib import Path

import pytest
import torch
from conftest import write_tiny_run

from seq2seq.checkpoint import CHECKPOINT_KEY, load_checkpoint, read_inference
from seq2seq.decoding.config import SearchConfig
from seq2seq.fit import main  # the face: it tunes after training
from seq2seq.inference.translator import Translator
from seq2seq.model import ConfigError
from seq2seq.training.callbacks import PowerAverage, TuneLengthPenalty


@pytest.mark.parametrize("kwargs", [{"beam_size": 0}, {"length_penalties": (-1.0,)}, {"length_penalties": ()}])
def test_bad_options_fail_when_the_callback_is_built(kwargs):
    with pytest.raises((ConfigError, ValueError)):
        TuneLengthPenalty(**kwargs)


def test_fit_stores_the_tuned_penalty_in_the_best_checkpoint(tmp_path: Path, capsys):
    config = write_tiny_run(tmp_path, max_steps=40, train_pairs=300, val_pairs=12)
    main(["--config", str(config), "--trainer.callbacks+=seq2seq.training.callbacks.TuneLengthPenalty",
          "--trainer.callbacks.beam_size=2", "--trainer.callbacks.length_penalties=[0.0, 2.0]"])
    printed = capsys.readouterr().out
    assert "length penalty on validation (beam 2, BLEU): 0: " in printed, printed
    best = tmp_path / "checkpoints" / "best.ckpt"
    stored = torch.load(best, weights_only=True)[CHECKPOINT_KEY]["search"]
    assert stored["beam_size"] == 2 and stored["length_penalty"] in (0.0, 2.0)
    assert read_inference(best, load_checkpoint(best)).search == SearchConfig.from_dict(stored)  # the checksum covers it
    translator = Translator.from_checkpoint(best)
    assert translator.search == SearchConfig(beam_size=2, length_penalty=stored["length_penalty"])
    sentence = ["Ein Mann fährt Fahrrad."]
    assert translator.translate(sentence) == translator.translate(sentence, translator.search)


def test_power_ema_weighs_each_update_about_as_t_to_the_gamma():
    """Against the definition, in float64: after T updates the average is close to sum_t t^gamma w_t / sum_t t^gamma."""
    gamma, updates = 5.0, 300
    weights = [torch.randn(64, dtype=torch.float64) for _ in range(updates)]
    average = [weights[0].clone()]  # AveragedModel copies the first update's weights itself
    for t in range(2, updates + 1):
        PowerAverage(gamma)(average, [weights[t - 1]], torch.tensor(t - 1))
    numerator = sum(t**gamma * w for t, w in enumerate(weights, start=1))
    reference = numerator / sum(t**gamma for t in range(1, updates + 1))
    torch.testing.assert_close(average[0], reference, rtol=0, atol=0.02 * float(reference.abs().mean()))
    early = sum(t**gamma for t in range(1, updates // 2 + 1)) / sum(t**gamma for t in range(1, updates + 1))
    assert early < 0.5 ** (gamma + 1) * 1.1  # the first half of training keeps ~1.6% of the average


def test_a_tuned_penalty_that_cannot_be_stored_is_reported_and_training_kept(tmp_path: Path, capsys, monkeypatch):
    def full_disk(path, search):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("seq2seq.inference.tune.store_search_defaults", full_disk)
    config = write_tiny_run(tmp_path, max_steps=6, train_pairs=100, val_pairs=4)
    main(["--config", str(config), "--trainer.callbacks+=seq2seq.training.callbacks.TuneLengthPenalty",
          "--trainer.callbacks.beam_size=2", "--trainer.callbacks.length_penalties=[1.0]"])
    printed = capsys.readouterr().out
    assert "error: cannot store 1 in" in printed and "pass --length-penalty 1 when translating" in printed
    assert (tmp_path / "checkpoints" / "best.ckpt").is_file()
