"""A small multilingual run for the tests (conftest's `multilingual_run` trains it once): Multi30k's first lines
in English, German and French (the same images' captions), four directions into three languages, one of them
low-resource."""

from pathlib import Path

import torch
from conftest import _multi30k_lines

DIRECTIONS = [("en", "de"), ("en", "fr"), ("de", "en"), ("fr", "en")]

CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  max_steps: {steps}
  val_check_interval: {steps}
  check_val_every_n_epoch: null
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {root}/checkpoints
        filename: best
        monitor: val_bleu
        mode: max
        save_last: true
        enable_version_counter: false
    - class_path: seq2seq.training.callbacks.TuneLengthPenalty
      init_args:
        beam_size: 2
        length_penalties: [1.0, 2.0]
model:
  transformer:
    d_model: 64
    num_heads: 4
    d_ff: 256
    num_encoder_layers: 2
    num_decoder_layers: 2
    dropout: 0.0
    max_positions: 128
  lr: 0.003
  warmup_steps: 30
  val_search:
    beam_size: 1
    max_len_b: 20
data:
  tokenizer_path: {root}/spm.model
  vocab_size: 1200
  temperature: 5.0
  max_tokens: 1024
  max_tokens_per_sentence: 64
  cache_dir: {root}/hf_cache
  directions:
{directions}
"""


def write_data(root: Path, *, train_pairs: int, val_pairs: int) -> dict[str, Path]:
    """Multi30k's first lines in each language (train and val), as files; the same images' captions."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    files = {}
    for stem, limit in (("train", train_pairs), ("val", val_pairs)):
        for lang in ("de", "en", "fr"):
            files[f"{stem}.{lang}"] = data / f"{stem}.{lang}"
            files[f"{stem}.{lang}"].write_text("\n".join(_multi30k_lines(stem, lang, limit)) + "\n", encoding="utf-8")
    return files


def directions_yaml(files: dict[str, Path], directions: list[tuple[str, str]], *, small: str = "fr-en") -> str:
    """Each direction's entry; `small` trains on a tenth of the pairs, as a low-resource direction would."""
    entries = []
    for src, tgt in directions:
        train = [files[f"train.{src}"], files[f"train.{tgt}"]]
        if f"{src}-{tgt}" == small:  # (its own files: the first tenth of the lines)
            train = [path.with_name(f"small.{path.name}") for path in train]
            for whole, part in zip([files[f"train.{src}"], files[f"train.{tgt}"]], train, strict=True):
                lines = whole.read_text(encoding="utf-8").splitlines()
                part.write_text("\n".join(lines[: len(lines) // 10]) + "\n", encoding="utf-8")
        entries.append(f"    - src_lang: {src}\n      tgt_lang: {tgt}\n"
                       f"      train_files: [{train[0]}, {train[1]}]\n"
                       f"      valid_files: [{files[f'val.{src}']}, {files[f'val.{tgt}']}]")
    return "\n".join(entries)


def train(root: Path) -> None:
    """A d64 2+2 model trained 400 steps on DIRECTIONS (fr-en on a tenth of the pairs), into `root`, its length
    penalty tuned on the directions' mean BLEU (as `python -m seq2seq.fit` does)."""
    from seq2seq.fit import main

    files = write_data(root, train_pairs=3000, val_pairs=40)
    config = root / "multilingual.yaml"
    config.write_text(CONFIG.format(root=root, steps=400, directions=directions_yaml(files, DIRECTIONS)),
                      encoding="utf-8")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        main(["--config", str(config)])
    finally:
        torch.set_num_threads(threads)
