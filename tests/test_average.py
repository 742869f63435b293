"""python -m seq2seq.average: the mean of several checkpoints' weights, as a checkpoint Translator reads."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_run

from seq2seq.average import average, main, write
from seq2seq.checkpoint import CHECKPOINT_KEY, CheckpointError, load_checkpoint, read_inference
from seq2seq.search import SearchConfig
from seq2seq.training.fit import main as fit
from seq2seq.translator import Translator

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run with EMA weights that keeps a checkpoint every 4 updates; returns its checkpoint folder."""
    root = tmp_path_factory.mktemp("ema_run")
    config = write_tiny_run(root, max_steps=12, train_pairs=200, val_pairs=4)
    fit(["--config", str(config), "--trainer.limit_val_batches=0",
         "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={root}/steps",
         "--trainer.callbacks.filename={step}", "--trainer.callbacks.every_n_train_steps=4",
         "--trainer.callbacks.save_top_k=-1",
         "--trainer.callbacks+=EMAWeightAveraging", "--trainer.callbacks.decay=0.5"])
    return root / "steps"


def steps(folder: Path) -> list[str]:
    return [str(folder / f"step={n}.ckpt") for n in (4, 8, 12)]


@pytest.mark.parametrize("weights,key", [("inference", "state_dict"), ("trained", "current_model_state")])
def test_the_average_is_the_mean_of_the_weights(ema_run: Path, weights: str, key: str, tmp_path: Path):
    paths = steps(ema_run)
    out = tmp_path / "avg.ckpt"
    main(["--checkpoints", *paths, "--output", str(out), "--weights", weights])
    loaded = [torch.load(p, weights_only=True)[key] for p in paths]
    averaged = read_inference(out, load_checkpoint(out))  # our format, checksum and all
    assert averaged.search == SearchConfig()  # no tuned defaults: they were tuned for other weights
    for name, tensor in averaged.weights.items():
        expected = sum(state[f"model.{name}"].double() for state in loaded) / 3
        torch.testing.assert_close(tensor, expected.float(), rtol=0, atol=1e-7)
    assert set(torch.load(out, weights_only=True)) == {"state_dict", CHECKPOINT_KEY}  # no optimiser state
    Translator.from_checkpoint(out).translate(["Ein Hund."])


def test_checkpoints_of_different_models_are_not_averaged(ema_run: Path, tiny_run, tmp_path: Path):
    _, other = tiny_run
    with pytest.raises(CheckpointError, match="another tokenizer|another config"):
        average([steps(ema_run)[0], str(other / "best.ckpt")])
    with pytest.raises(CheckpointError, match="no trained weights besides"):
        average([str(other / "best.ckpt")], weights="trained")


def test_the_cli_answers_bad_input_in_one_line(ema_run: Path, tmp_path: Path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "seq2seq.average", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=120)

    missing = run("--checkpoints", str(tmp_path / "nope.ckpt"), "--output", str(tmp_path / "a.ckpt"))
    assert missing.returncode == 1 and missing.stderr.startswith("error: checkpoint") and "does not exist" in missing.stderr
    assert missing.stderr.count("\n") == 1
    same = run("--checkpoints", steps(ema_run)[0], "--output", steps(ema_run)[0])
    assert same.returncode == 2 and "is one of the --checkpoints" in same.stderr
    done = run("--checkpoints", *steps(ema_run)[:2], "--output", str(tmp_path / "b.ckpt"))
    assert done.returncode == 0 and "averaged 2 checkpoints" in done.stdout


def test_a_written_average_reads_back_bitwise(ema_run: Path, tmp_path: Path):
    averaged = average(steps(ema_run)[:1])
    write(averaged, tmp_path / "one.ckpt")
    again = read_inference(tmp_path / "one.ckpt", load_checkpoint(tmp_path / "one.ckpt"))
    assert all(torch.equal(again.weights[n], t) for n, t in averaged.weights.items())


def flip_bit(tensor: torch.Tensor) -> None:
    """One flipped bit in the middle of a float tensor, as a bad disk or a bad copy would leave it."""
    flat = tensor.view(-1)
    flat[flat.numel() // 2 : flat.numel() // 2 + 1].view(torch.int32).bitwise_xor_(1 << 30)


def test_a_flipped_bit_in_the_trained_weights_is_refused(ema_run: Path, tmp_path: Path):
    """The trained weights of an EMA run (current_model_state) have a checksum of their own: one flipped
    bit there made a freshly checksummed average that translated everything to ⁇."""
    damaged = tmp_path / "damaged.ckpt"
    checkpoint = torch.load(steps(ema_run)[1], weights_only=True)
    flip_bit(checkpoint["current_model_state"]["model.encoder.layers.0.ffn.w_in.weight"])
    torch.save(checkpoint, damaged)
    read_inference(damaged, load_checkpoint(damaged))  # what it translates with is intact
    with pytest.raises(CheckpointError, match=r"damaged\.ckpt is damaged: its training state \(the trained weights"):
        average([steps(ema_run)[0], str(damaged)], weights="trained")
    average([steps(ema_run)[0], str(damaged)], weights="inference")  # the EMA weights are another matter
