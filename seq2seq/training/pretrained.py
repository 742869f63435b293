"""Fine-tuning: a run that starts from a pretrained model's weights (`model.init_from: PATH`).

PATH is one of our checkpoints, or a model `python -m seq2seq.convert` imported (an OPUS-MT Marian
model). Unlike `--ckpt_path`, which resumes a run exactly (its optimiser, schedule, loader position),
`init_from` takes only what inference would: the weights, the tokenizer and the model config. The
optimiser, the schedule and the step count start afresh.

The model config is PATH's. The YAML's `model.transformer` may still say what changes no weight and
no function of the weights: the dropouts, and `max_positions` where no weight is stored per position.
Any other field set to a value other than PATH's is an error naming it, whether it would change a
weight's shape (`d_model`) or what the pretrained weights compute (`activation`). A field the YAML and
the command line leave out is PATH's (fit.py asks the parser which fields were given, and passes the
merged config on). TranslationModule, given a whole config, checks it again with every field as given:
it must be PATH's but for the fields that may differ.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from seq2seq.checkpoint import CheckpointError, InferenceCheckpoint, load_checkpoint, read_inference
from seq2seq.model import ConfigError, Transformer, TransformerConfig

# What fine-tuning may change: training-time regularisation, and the longest sequence where positions
# are computed, not stored (a learned table changes shape, which the shape check refuses).
MAY_DIFFER = ("dropout", "attention_dropout", "activation_dropout", "max_positions")


def load_pretrained(path: str | Path) -> InferenceCheckpoint:
    """The checked inference part of `path`; a CheckpointError naming model.init_from if it cannot be used.

    fit's checks, the module and the data module each ask for it: the file is read and its checksum
    verified once per version of it (its size and modification time), not once per caller.
    """
    try:
        stat = os.stat(path)
    except OSError:
        stat = None  # load_checkpoint says what is wrong with it
    try:
        if stat is None:
            return read_inference(path, load_checkpoint(path))
        return _load_pretrained(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    except CheckpointError as error:
        raise CheckpointError(f"model.init_from: {error}") from None


@functools.lru_cache(maxsize=1)
def _load_pretrained(path: str, size: int, mtime_ns: int) -> InferenceCheckpoint:
    return read_inference(path, load_checkpoint(path))


def fine_tuning_config(pretrained: TransformerConfig, given: TransformerConfig, *, init_from: str | Path,
                       given_fields: Collection[str]) -> TransformerConfig:
    """The pretrained config with what `given` may change in it; a ConfigError naming
    model.transformer.<field> for a field set to something else (module docstring). `given_fields`: the
    fields the YAML or the command line set; `given`'s other fields are not looked at."""
    changes = {}
    for name, value in given.to_dict().items():
        theirs = getattr(pretrained, name)
        if name == "vocab_size" or value == theirs or name not in given_fields:
            continue
        changed_shape = _changed_weight(pretrained, **{name: value})
        if changed_shape is None and name in MAY_DIFFER:
            changes[name] = value
            continue
        if changed_shape is not None:
            problem = (f"would change the shape of the weight '{changed_shape[0]}' from {changed_shape[1]} to "
                       f"{changed_shape[2]}")
        else:
            problem = f"would change what the pretrained weights compute (only {', '.join(MAY_DIFFER)} may differ)"
        raise ConfigError(f"model.transformer.{name}", f"is {value!r} but model.init_from {init_from} was trained with "
                          f"{theirs!r}: it {problem}; leave it out to take the pretrained model's")
    if given.vocab_size != pretrained.vocab_size:
        raise ConfigError("model.transformer.vocab_size", f"is {given.vocab_size}, but model.init_from {init_from} "
                          f"has {pretrained.vocab_size} pieces: the vocabulary comes from init_from's tokenizer")
    try:
        return replace(pretrained, **changes)
    except ConfigError as error:
        raise ConfigError(f"model.transformer.{error.field}", error.problem) from None


def _changed_weight(config: TransformerConfig, **change: Any) -> tuple[str, tuple, tuple] | None:
    """(name, shape before, shape after) of the first stored weight `change` reshapes, adds or removes; None if none."""
    try:
        changed = replace(config, **change)
    except ConfigError:
        return None  # an invalid value: the config's own check names it when it is built
    with torch.device("meta"):
        before, after = Transformer(config).state_dict(), Transformer(changed).state_dict()
    for name in sorted(set(before) | set(after)):
        shape_before = tuple(before[name].shape) if name in before else ()
        shape_after = tuple(after[name].shape) if name in after else ()
        if name not in before or name not in after or shape_before != shape_after:
            return name, shape_before if name in before else ("absent",), shape_after if name in after else ("absent",)
    return None
