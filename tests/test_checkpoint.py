"""Tests for seq2seq.checkpoint: the format training writes, and the reader that checks a file before trusting it.

Every damaged or hostile file must give a CheckpointError: one line that names the file.
"""

import os
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import write_not_ours

from seq2seq.average import main as average_main
from seq2seq.checkpoint import (
    CHECKPOINT_KEY,
    CheckpointError,
    InferenceCheckpoint,
    check_training_state,
    checksum,
    inference_model,
    load_checkpoint,
    model_weights,
    read_inference,
    save_atomic,
    store_search_defaults,
)
from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.translator import Translator
from seq2seq.model import ConfigError, Transformer, TransformerConfig
from seq2seq.text.tokenizer import Tokenizer
from seq2seq.translate import main as translate_main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tiny_run) -> Path:
    _, checkpoints = tiny_run
    return checkpoints / "best.ckpt"


def read(path: Path):
    return read_inference(path, load_checkpoint(path))


def load_error(path: Path) -> str:
    """The message Translator.from_checkpoint gives; it must be one line naming the file."""
    with pytest.raises(CheckpointError) as caught:
        Translator.from_checkpoint(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message, message
    return message


def rewrite(checkpoint: Path, path: Path, change) -> Path:
    """A copy of the checkpoint with `change(loaded_dict)` applied, saved as torch.save would."""
    loaded = torch.load(checkpoint, weights_only=True)
    change(loaded)
    torch.save(loaded, path)
    return path


def resign(loaded: dict) -> None:
    """Recompute the stored checksum, as a careless (or hostile) tool editing the file would."""
    entry = loaded[CHECKPOINT_KEY]
    entry["sha256"] = checksum(weights=model_weights(loaded["state_dict"]), config=entry["model_config"],
                               tokenizer=entry["tokenizer"], src_lang=entry["src_lang"], tgt_lang=entry["tgt_lang"])


def flip_byte_in_record(source: Path, target: Path, record: str, offset_in_record: int) -> None:
    """Flip one bit inside a stored (uncompressed) zip record, as a bad disk or a bad copy would."""
    info = zipfile.ZipFile(source).getinfo(record)
    data = bytearray(source.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len + offset_in_record] ^= 0x04
    target.write_bytes(bytes(data))


# ---- what training writes ----------------------------------------------------------------------


def test_checkpoint_alone_loads_with_weights_only(checkpoint: Path, tmp_path: Path):
    alone = tmp_path / "model.ckpt"  # nothing else in the folder: no tokenizer file, no config
    shutil.copy(checkpoint, alone)
    loaded = Translator.from_checkpoint(alone)
    assert (loaded.src_lang, loaded.tgt_lang) == ("de", "en")
    assert loaded.model.config.d_model == 32 and loaded.tokenizer.vocab_size == 600
    assert not loaded.model.training
    stored = torch.load(checkpoint, weights_only=True)
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, stored["state_dict"][f"model.{name}"]), name
    assert len(stored[CHECKPOINT_KEY]["sha256"]) == 64
    (text,) = loaded.translate(["Ein Hund läuft."])
    assert isinstance(text, str)


def test_format_1_without_a_checksum_still_loads_with_a_warning(checkpoint: Path, tmp_path: Path):
    def to_format_1(loaded: dict) -> None:
        loaded[CHECKPOINT_KEY]["format"] = 1
        del loaded[CHECKPOINT_KEY]["sha256"]

    path = rewrite(checkpoint, tmp_path / "old.ckpt", to_format_1)
    with pytest.warns(UserWarning, match="format 1 has no checksum"):
        assert read(path).src_lang == "de"


# ---- files that are not ours, or not there -----------------------------------------------------


@pytest.mark.parametrize("kind", ["other_dict", "tensor", "pickled_module", "text", "empty"])
def test_files_that_are_not_checkpoints_are_refused_in_one_line(kind: str, tmp_path: Path):
    path = tmp_path / f"{kind}.ckpt"
    write_not_ours(path, kind)  # "text": a text file renamed .ckpt gave a bare IndexError
    message = load_error(path)
    expected = {"empty": "is empty (0 bytes)", "text": "cannot be read as a checkpoint (torch.load: "}.get(
        kind, "is not a seq2seq training checkpoint")
    assert expected in message


def test_missing_file_folder_and_newer_format(checkpoint: Path, tmp_path: Path):
    assert "missing.ckpt does not exist; training writes them under" in load_error(tmp_path / "missing.ckpt")
    assert "is a folder; give a .ckpt file in it" in load_error(tmp_path)
    newer = rewrite(checkpoint, tmp_path / "newer.ckpt", lambda c: c[CHECKPOINT_KEY].update(format=99))
    assert "has checkpoint format 99; this version of seq2seq reads formats 1, 2" in load_error(newer)


def test_truncated_file_is_refused(checkpoint: Path, tmp_path: Path):
    path = tmp_path / "truncated.ckpt"
    path.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])  # a copy cut short
    assert "cannot be read as a checkpoint (torch.load: RuntimeError): damaged, e.g. a copy cut short" in load_error(path)


@pytest.mark.parametrize("special", ["/dev/null", "fifo", "loop"])
def test_a_checkpoint_path_that_is_not_a_regular_file(special: str, tmp_path: Path):
    path = Path(special)
    if special == "fifo":
        path = tmp_path / "pipe.ckpt"
        os.mkfifo(path)
    elif special == "loop":
        path = tmp_path / "loop.ckpt"
        path.symlink_to(path)
    expected = "does not exist" if special == "loop" else "is not a regular file (a device or a pipe)"
    assert expected in load_error(path)


def test_non_finite_weights_are_refused(checkpoint: Path, tmp_path: Path):
    """What a diverged run saved: it translated every sentence into an empty line, exit 0."""
    def poison(loaded: dict) -> None:
        loaded["state_dict"]["model.decoder.embed.tokens.weight"][5, 3] = float("nan")
        resign(loaded)

    path = rewrite(checkpoint, tmp_path / "nan.ckpt", poison)
    message = load_error(path)  # the embedding is tied: it may be named by any of its three names
    assert re.search(r"its weight '\w+\.(embed\.tokens|output_projection)\.weight' holds NaN or infinite values "
                     r"\(the training run diverged\)", message), message


# ---- damaged contents --------------------------------------------------------------------------


def test_a_flipped_bit_in_the_weights_is_caught_by_the_checksum(checkpoint: Path, tmp_path: Path):
    records = sorted(zipfile.ZipFile(checkpoint).infolist(), key=lambda info: -info.file_size)
    weights = next(info for info in records if "/data/" in info.filename)  # the largest tensor
    path = tmp_path / "flipped.ckpt"
    flip_byte_in_record(checkpoint, path, weights.filename, weights.file_size // 2)
    torch.load(path, weights_only=True)  # torch itself loads it without a word
    assert "is damaged: its weights or tokenizer do not match the checksum" in load_error(path)


def test_a_changed_byte_in_the_stored_tokenizer_is_caught_by_the_checksum(checkpoint: Path, tmp_path: Path):
    raw = checkpoint.read_bytes()
    # Pickle protocol 2 stores bytes as their latin-1 string in UTF-8: "▁" (e2 96 81) is 6 bytes there.
    marker = "▁".encode().decode("latin-1").encode()
    piece = re.search(re.escape(marker) + b"[a-z]{3,}", raw)  # a word piece of the stored sentencepiece model
    assert piece is not None
    where = piece.start() + len(marker) + 1  # its second letter
    path = tmp_path / "tokenizer.ckpt"
    path.write_bytes(raw[:where] + b"q" + raw[where + 1 :])  # one word piece spelled differently: no error
    assert "is damaged: its weights or tokenizer do not match the checksum" in load_error(path)


def test_corrupted_tokenizer_bytes_with_a_matching_checksum(checkpoint: Path, tmp_path: Path):
    def garble(loaded: dict) -> None:
        loaded[CHECKPOINT_KEY]["tokenizer"] = b"\x0a\x05garbage" * 10
        resign(loaded)

    assert "its stored tokenizer cannot be loaded" in load_error(rewrite(checkpoint, tmp_path / "t.ckpt", garble))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda e: e.pop("tokenizer"), "its 'seq2seq' entry is damaged: 'tokenizer' is missing"),
        (lambda e: e.update(src_lang=7), "'src_lang' is a int, not a str"),
        (lambda e: e["model_config"].update(d_modle=32), "model_config is invalid: d_modle: is not a TransformerConfig field"),
        (lambda e: e["model_config"].update(norm="rms"), "model_config is invalid: norm: expected one of ['layernorm', 'rmsnorm'], got 'rms'"),
        (lambda e: e["model_config"].update(num_encoder_layers=2), "num_encoder_layers is 2 but the file holds 1 encoder"),
        (lambda e: e["model_config"].update(norm_placement="pre"), "the config describes a weight 'decoder.final_norm."),
        (lambda e: e["model_config"].update(d_ff=65), "is stored as (64, 32) but the config makes it (65, 32)"),
    ],
)
def test_entry_and_config_problems_are_named(checkpoint: Path, tmp_path: Path, change, message: str):
    def apply(loaded: dict) -> None:
        change(loaded[CHECKPOINT_KEY])
        if "sha256" in loaded[CHECKPOINT_KEY] and "tokenizer" in loaded[CHECKPOINT_KEY]:
            try:
                resign(loaded)
            except (TypeError, AttributeError):
                pass

    assert message in load_error(rewrite(checkpoint, tmp_path / "bad.ckpt", apply))


def test_a_hostile_config_is_refused_before_anything_is_allocated(checkpoint: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch):
    """A 30 KB file whose config describes a 20 GB model: compared on the meta device, never built."""
    def huge(loaded: dict) -> None:
        for key in [key for key in loaded if key not in ("state_dict", CHECKPOINT_KEY)]:
            del loaded[key]
        loaded["state_dict"] = {"model.decoder.embed.tokens.weight": torch.zeros(4, 4)}
        loaded[CHECKPOINT_KEY]["model_config"].update(vocab_size=1_000_000, d_model=4096, d_ff=16384,
                                                     num_encoder_layers=24, num_decoder_layers=24, num_heads=16)

    path = rewrite(checkpoint, tmp_path / "hostile.ckpt", huge)
    assert path.stat().st_size < 100_000
    built_on, real_init = [], Transformer.__init__

    def spy(self, *args, **kwargs):
        built_on.append(torch.empty(0).device.type)  # "meta" inside `with torch.device("meta")`
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "__init__", spy)
    assert "its model_config does not match its weights" in load_error(path)
    assert built_on == []  # refused on its layer count, before even the skeleton that costs no memory

    def long_positions(loaded: dict) -> None:  # the sinusoid table is computed, not stored: 2e9 x 32 floats
        loaded[CHECKPOINT_KEY]["model_config"]["max_positions"] = 2_000_000_000
        resign(loaded)

    path = rewrite(checkpoint, tmp_path / "positions.ckpt", long_positions)
    assert re.search(r"asks for [\d.]+ GiB of position tables \(max_positions=2000000000\); refusing", load_error(path))

    def many_layers(loaded: dict) -> None:  # even the meta skeleton of a million layers takes an hour
        loaded[CHECKPOINT_KEY]["model_config"]["num_decoder_layers"] = 1_000_000
        resign(loaded)

    path = rewrite(checkpoint, tmp_path / "layers.ckpt", many_layers)
    built_on.clear()
    assert "num_decoder_layers is 1000000 but the file holds 1 decoder layers" in load_error(path)
    assert built_on == []


# ---- writing -----------------------------------------------------------------------------------


def test_save_atomic_replaces_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    target = tmp_path / "ckpt" / "last.ckpt"
    save_atomic({"step": 1}, target)
    assert torch.load(target, weights_only=True) == {"step": 1}
    elsewhere = tmp_path / "tmpdir"
    elsewhere.mkdir()
    monkeypatch.setenv("TMPDIR", str(elsewhere))  # a temporary folder, maybe on another filesystem: unused
    monkeypatch.setattr("tempfile.tempdir", None)

    def killed(obj, f):  # the process dies half-way through writing
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr("seq2seq.checkpoint.torch.save", killed)
    with pytest.raises(KeyboardInterrupt):
        save_atomic({"step": 2}, target)
    assert torch.load(target, weights_only=True) == {"step": 1}  # the old checkpoint, whole
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]  # no partial file left
    assert list(elsewhere.iterdir()) == []
    monkeypatch.undo()
    mask = os.umask(0o022)
    try:
        save_atomic({"step": 3}, target)
    finally:
        os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o644  # as any new file (mkstemp alone makes it 0600)


def test_save_atomic_raises_when_it_cannot_write(tmp_path: Path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError):
        save_atomic({"step": 1}, blocker / "last.ckpt")


def test_search_defaults_are_stored_checksummed_and_checked(checkpoint: Path, tmp_path: Path):
    path = tmp_path / "tuned.ckpt"
    shutil.copy(checkpoint, path)
    store_search_defaults(path, {"beam_size": 3, "length_penalty": 1.5})
    assert read(path).search == SearchConfig(beam_size=3, length_penalty=1.5)
    assert read(checkpoint).search == SearchConfig()  # a file without them: the translation defaults stay ours

    def edit(loaded: dict) -> None:  # changed by hand, checksum not updated
        loaded[CHECKPOINT_KEY]["search"]["length_penalty"] = 9.0

    assert "is damaged" in load_error(rewrite(path, tmp_path / "edited.ckpt", edit))

    def invalid(loaded: dict) -> None:  # invalid, however well signed
        entry = loaded[CHECKPOINT_KEY]
        entry["search"] = {"beam_size": 0}
        entry["sha256"] = checksum(weights=model_weights(loaded["state_dict"]), config=entry["model_config"],
                                   tokenizer=entry["tokenizer"], src_lang=entry["src_lang"],
                                   tgt_lang=entry["tgt_lang"], search=entry["search"])

    assert "its stored search defaults are invalid (beam_size" in load_error(
        rewrite(path, tmp_path / "invalid.ckpt", invalid))
    with pytest.raises(ConfigError):
        store_search_defaults(path, {"beam_sizes": 4})  # refused before the file is touched
    assert read(path).search == SearchConfig(beam_size=3, length_penalty=1.5)


def test_a_tokenizer_of_another_size_than_the_embeddings_is_refused(checkpoint: Path, tmp_path: Path,
                                                                    tokenizer: Tokenizer):
    """Re-checksummed with the public inference_entry, such a file used to load, then die in decoding
    (IndexError: piece id is out of range) or make a server answer every request 500."""
    assert tokenizer.vocab_size != read(checkpoint).config.vocab_size

    def swap(loaded: dict) -> None:
        entry = loaded[CHECKPOINT_KEY]
        entry["tokenizer"] = tokenizer.to_bytes()
        resign(loaded)

    swapped = rewrite(checkpoint, tmp_path / "swapped.ckpt", swap)
    message = load_error(swapped)
    assert re.search(r"swapped\.ckpt: its tokenizer has 2000 pieces but its model has \d+ embedding rows "
                     r"\(vocab_size\); they come from different runs", message), message
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"^error: .*swapped\.ckpt: its tokenizer has 2000 pieces"):
        translate_main(["--checkpoint", str(swapped), "--input", str(tmp_path / "in.de")])
    server = subprocess.run([sys.executable, str(REPO / "serve" / "server.py"), "--checkpoint", str(swapped),
                             "--port", "0"], capture_output=True, text=True, timeout=120)  # it used to start, then 500
    assert server.returncode == 1 and re.fullmatch(r"error: .*swapped\.ckpt: its tokenizer has 2000 pieces[^\n]*\n",
                                                   server.stderr), server.stderr


def test_the_training_state_is_checksummed_and_kept_so_by_stored_search_defaults(checkpoint: Path, tmp_path: Path):
    path = tmp_path / "tuned.ckpt"
    shutil.copy(checkpoint, path)
    check_training_state(path, load_checkpoint(path))
    store_search_defaults(path, {"length_penalty": 1.2})  # rewrites the entry: the training state stays sealed
    loaded = load_checkpoint(path)
    assert set(loaded) > {"optimizer_states", "loops", "callbacks", "rng_states"}
    check_training_state(path, loaded)

    def damage(loaded: dict) -> None:  # one flipped bit in Adam's second moment, which no other checksum covers
        moment = next(iter(loaded["optimizer_states"][0]["state"].values()))["exp_avg_sq"].view(-1)
        moment[:1].view(torch.int32).bitwise_xor_(1 << 20)

    damaged = rewrite(path, tmp_path / "damaged.ckpt", damage)
    read(damaged)  # what inference reads is intact
    with pytest.raises(CheckpointError, match=r"damaged\.ckpt is damaged: its training state"):
        check_training_state(damaged, load_checkpoint(damaged))
    for change in (lambda loaded: loaded["loops"]["fit_loop"].update(epoch_progress={}),
                   lambda loaded: loaded[CHECKPOINT_KEY].pop("training_sha256")):
        with pytest.raises(CheckpointError, match="its training state"):
            check_training_state(path, load_checkpoint(rewrite(path, tmp_path / "changed.ckpt", change)))

    def format_3(loaded: dict) -> None:  # written before training_sha256 existed: read, with a warning
        loaded[CHECKPOINT_KEY].pop("training_sha256")
        loaded[CHECKPOINT_KEY]["format"] = 3

    older = rewrite(path, tmp_path / "format3.ckpt", format_3)
    with pytest.warns(UserWarning, match="format 3 has no checksum of its training state"):
        check_training_state(older, load_checkpoint(older))


@pytest.mark.parametrize("name,version", [("format2.ckpt", 2), ("format3.ckpt", 3), ("format5.ckpt", 5)])
def test_checkpoints_written_by_earlier_versions_still_load(name: str, version: int, tmp_path: Path):
    """Files written by earlier versions of fit (tests/data/README.md), loaded by today's code: checked
    (format, checksum, shapes, tokenizer), translated with, averaged."""
    path = REPO / "tests" / "data" / name
    loaded = load_checkpoint(path)
    assert loaded[CHECKPOINT_KEY]["format"] == version
    assert read(path).search == SearchConfig()  # written before tuned defaults were stored
    translator = Translator.from_checkpoint(path, precision="fp32")
    assert translator.model.config.d_model == 32 and translator.tokenizer.vocab_size == 600
    assert len(translator.translate(["Ein Hund läuft.", "", "Zwei Männer."])) == 3
    averaged = tmp_path / "averaged.ckpt"
    average_main(["--checkpoints", str(path), str(path), "--output", str(averaged)])
    assert Translator.from_checkpoint(averaged).model.config == translator.model.config


def test_a_multilingual_checkpoint_of_format_5_still_loads_with_its_tags_in_the_source(tmp_path: Path):
    path = REPO / "tests" / "data" / "format5-multilingual.ckpt"
    assert load_checkpoint(path)[CHECKPOINT_KEY]["format"] == 5
    translator = Translator.from_checkpoint(path, precision="fp32")
    assert translator.directions == (("en", "de"), ("en", "fr"), ("de", "en"), ("fr", "en"))
    assert translator.target_tag == "encoder"
    french = translator.for_target("fr")
    assert french.prepare_inputs(["A dog."]).ids[0][0] == translator.tokenizer.tag_id("fr")
    assert len(french.translate(["A dog runs.", "", "Two men."])) == 3
    averaged = tmp_path / "averaged.ckpt"
    average_main(["--checkpoints", str(path), str(path), "--output", str(averaged)])
    assert Translator.from_checkpoint(averaged).directions == translator.directions



@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "relative"])
def test_the_inference_model_is_built_without_initialising_and_holds_the_checkpoints_weights_and_buffers(
        positions: str):
    """inference_model skips the random initialisation the weights replace: every parameter and buffer (stored or
    computed, as the position tables) is that of a model initialised and then loaded."""
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=40, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                               num_decoder_layers=1, max_positions=32, positions=positions)
    trained = Transformer(config)
    loaded = InferenceCheckpoint(config, trained.state_dict(), b"", "de", "en", SearchConfig())
    model = inference_model(loaded)
    expected = dict(trained.named_parameters()) | dict(trained.named_buffers())
    got = dict(model.named_parameters()) | dict(model.named_buffers())
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
