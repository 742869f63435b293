"""python -m seq2seq.average --checkpoints A.ckpt B.ckpt ... --output averaged.ckpt [--weights trained] [--force]

Checkpoint averaging (Vaswani et al. 2017 average the last 5 or 20): the element-wise mean of the
weights of several checkpoints of one run, written as a checkpoint Translator and the translate CLI
read like any other (weights and our entry only: no optimiser state, so it cannot be resumed).

`--weights inference` (the default) averages what each checkpoint translates with; in a run with
EMAWeightAveraging those are the EMA weights, and `--weights trained` averages the weights the
optimiser trained instead (Lightning keeps them under "current_model_state"). Every checkpoint is
checked as Translator checks one, and all must share the model config, tokenizer and language pair.
Search defaults a checkpoint stores (a tuned length penalty) are not carried over: they were tuned
for other weights.

--output is checked before any checkpoint is read (seq2seq/textio.py's check_output): a new file, or with
--force an existing one, in a folder that exists; never a device, FIFO or link (the write renames a new file
over the path), a folder, or one of the checkpoints.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import Tensor

from seq2seq.checkpoint import (
    CHECKPOINT_KEY,
    CheckpointError,
    InferenceCheckpoint,
    check_training_state,
    inference_entry,
    load_checkpoint,
    model_weights,
    read_inference,
    save_atomic,
)
from seq2seq.decoding.config import SearchConfig
from seq2seq.textio import OutputRefused, check_output


def read_weights(path: str | Path, *, weights: str) -> InferenceCheckpoint:
    checkpoint = load_checkpoint(path)
    loaded = read_inference(path, checkpoint)
    if weights == "inference":
        return loaded
    trained = checkpoint.get("current_model_state")
    if not isinstance(trained, dict):
        raise CheckpointError(f"{path} holds no trained weights besides its inference ones (no EMA in its run); "
                              "use --weights inference")
    check_training_state(path, checkpoint)  # no other checksum covers the trained weights
    trained = model_weights(trained)
    if {k: tuple(v.shape) for k, v in trained.items()} != {k: tuple(v.shape) for k, v in loaded.weights.items()}:
        raise CheckpointError(f"{path}: its trained weights do not match its model config; the file is damaged")
    return loaded._replace(weights=trained)


def average(paths: list[str], *, weights: str = "inference") -> InferenceCheckpoint:
    """The mean of the checkpoints' weights (accumulated in float64), with the first one's config and tokenizer."""
    if not paths:
        raise CheckpointError("--checkpoints: give at least one checkpoint")
    first = read_weights(paths[0], weights=weights)
    sums: dict[str, Tensor] = {name: tensor.double() for name, tensor in first.weights.items()}
    for path in paths[1:]:
        other = read_weights(path, weights=weights)
        for field in ("config", "tokenizer", "src_lang", "tgt_lang", "directions", "target_tag"):
            if getattr(other, field) != getattr(first, field):
                raise CheckpointError(f"{path} has another {field.replace('_', ' ')} than {paths[0]}: only "
                                      "checkpoints of one training run can be averaged")
        for name, tensor in other.weights.items():
            sums[name] += tensor.double()
    averaged = {name: (total / len(paths)).to(first.weights[name].dtype) for name, total in sums.items()}
    return first._replace(weights=averaged, search=SearchConfig())  # tuned for other weights


def write(checkpoint: InferenceCheckpoint, path: str | Path) -> None:
    state_dict = {f"model.{name}": tensor for name, tensor in checkpoint.weights.items()}
    entry = inference_entry(state_dict=state_dict, config=checkpoint.config, tokenizer=checkpoint.tokenizer,
                            src_lang=checkpoint.src_lang, tgt_lang=checkpoint.tgt_lang, directions=checkpoint.directions,
                            target_tag=checkpoint.target_tag)
    save_atomic({"state_dict": state_dict, CHECKPOINT_KEY: entry}, path, create_folder=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m seq2seq.average", description=__doc__.split("\n\n")[1])
    parser.add_argument("--checkpoints", nargs="+", required=True, help="checkpoints of one run (.ckpt)")
    parser.add_argument("--output", required=True, help="the checkpoint to write (.ckpt), in a folder that exists")
    parser.add_argument("--force", action="store_true", help="replace --output if it is a file that holds anything")
    parser.add_argument("--weights", choices=["inference", "trained"], default="inference",
                        help="inference: the weights each checkpoint translates with (EMA ones in an EMA run); "
                             "trained: the optimiser's weights of an EMA run")
    args = parser.parse_args(argv)
    try:  # before the checkpoints are read
        check_output(args.output, force=args.force, replaces=True, example="averaged.ckpt",
                     inputs=[("--checkpoints", path) for path in args.checkpoints])
    except OutputRefused as error:
        raise SystemExit(f"error: {error}") from None
    try:
        averaged = average(args.checkpoints, weights=args.weights)
    except (CheckpointError, OSError) as error:
        raise SystemExit(f"error: {error}") from None
    try:
        write(averaged, args.output)
    except OSError as error:  # a full disk, the folder gone meanwhile: the rename never happened
        raise SystemExit(f"error: --output {args.output}: cannot write it ({error.strerror or error}); what was "
                         "there is as it was") from None
    print(f"averaged {len(args.checkpoints)} checkpoints ({args.weights} weights) into {args.output}")


def run() -> None:
    """The command: `main` with the process set up for it."""
    torch.set_grad_enabled(False)
    main()


if __name__ == "__main__":
    run()
