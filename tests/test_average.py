"""python -m seq2seq.average: the mean of several checkpoints' weights, as a checkpoint Translator reads."""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import output_checks
import pytest
import torch
from conftest import write_tiny_run

from seq2seq.average import average, main, write
from seq2seq.checkpoint import CHECKPOINT_KEY, CheckpointError, load_checkpoint, read_inference
from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.translator import Translator
from seq2seq.training.fit import main as fit

REPO = Path(__file__).resolve().parents[1]
SMALL = REPO / "tests" / "data" / "format3.ckpt"  # a small checkpoint of ours (tests/data/README.md)


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
    assert same.returncode == 1 and "is the --checkpoints file" in same.stderr and same.stderr.count("\n") == 1
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


# ---- --output: the policy every face shares (seq2seq/textio.py's check_output), checked before any checkpoint is read ----


def refused(*args: str) -> str:
    return output_checks.refused(main, *args)


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_dev_null_is_refused_and_stays_a_device(force: list[str], tmp_path: Path):
    """`--output /dev/null` (as root) renamed a 6 MB checkpoint over /dev/null, exit 0. The checkpoint named here
    does not exist: the refusal comes before any reading (and so before any write, even on code that would write)."""
    message = refused("--checkpoints", str(tmp_path / "none.ckpt"), "--output", "/dev/null", *force)
    assert message == "error: --output /dev/null is a character device, not a file: name a new file"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_a_fifo_is_refused_and_stays_a_fifo(force: list[str], tmp_path: Path):
    fifo = tmp_path / "avg.ckpt"
    os.mkfifo(fifo)
    message = refused("--checkpoints", str(SMALL), "--output", str(fifo), *force)
    assert message == f"error: --output {fifo} is a FIFO (named pipe), not a file: name a new file"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_an_existing_file_is_replaced_only_with_force(tmp_path: Path):
    taken = tmp_path / "avg.ckpt"
    taken.write_bytes(b"mine")
    message = refused("--checkpoints", str(SMALL), "--output", str(taken))
    assert message == f"error: --output {taken} exists: name a new file, or pass --force to replace it"
    assert taken.read_bytes() == b"mine"
    main(["--checkpoints", str(SMALL), "--output", str(taken), "--force"])
    assert Translator.from_checkpoint(taken).model.config == Translator.from_checkpoint(SMALL).model.config
    empty = tmp_path / "tmp.XXXX"  # an empty file (mktemp's) holds nothing to lose: written without --force
    empty.write_bytes(b"")
    main(["--checkpoints", str(SMALL), "--output", str(empty)])
    assert read_inference(empty, load_checkpoint(empty)).config == read_inference(taken, load_checkpoint(taken)).config


def test_a_missing_folder_is_refused_and_not_created(tmp_path: Path):
    output = tmp_path / "new" / "deep" / "avg.ckpt"
    message = refused("--checkpoints", str(tmp_path / "none.ckpt"), "--output", str(output))
    assert message == f"error: --output {output}: the folder {output.parent} does not exist; create it first"
    assert not (tmp_path / "new").exists()


def test_a_folder_is_refused_in_one_line(tmp_path: Path):
    """It was `error: [Errno 21] Is a directory: '….partial' -> '…'`, after the averaging."""
    message = refused("--checkpoints", str(SMALL), "--output", str(tmp_path), "--force")
    assert message == f"error: --output {tmp_path} is a folder; name the file to write, e.g. {tmp_path / 'averaged.ckpt'}"
    assert list(tmp_path.iterdir()) == []


def test_an_input_or_a_link_as_output_is_refused_even_with_force(tmp_path: Path):
    copy = tmp_path / "a.ckpt"
    shutil.copy(SMALL, copy)
    link = tmp_path / "link.ckpt"
    link.symlink_to(copy)
    for output in (copy, link):  # a link to a checkpoint is that checkpoint
        message = refused("--checkpoints", str(SMALL), str(copy), "--output", str(output), "--force")
        assert message == f"error: --output {output} is the --checkpoints file {copy}: it would be overwritten"
    other = tmp_path / "other.ckpt"
    link.unlink()
    link.symlink_to(other)  # dangling: the rename would replace the link, not write where it leads
    message = refused("--checkpoints", str(SMALL), "--output", str(link), "--force")
    assert message == f"error: --output {link} is a symbolic link: name the file itself, or a new one"
    assert copy.read_bytes() == SMALL.read_bytes() and link.is_symlink() and not other.exists()


def test_a_write_that_fails_midway_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    taken = tmp_path / "avg.ckpt"
    taken.write_bytes(b"mine")

    def disk_full(obj, f) -> None:
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("seq2seq.checkpoint.torch.save", disk_full)
    message = refused("--checkpoints", str(SMALL), "--output", str(taken), "--force")
    assert message == (f"error: --output {taken}: cannot write it (No space left on device); what was there is as it "
                       "was")
    assert taken.read_bytes() == b"mine" and [p.name for p in tmp_path.iterdir()] == ["avg.ckpt"]  # no partial file
