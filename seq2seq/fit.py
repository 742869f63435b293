"""python -m seq2seq.fit --config configs/demo.yaml [--key value ...]: train a model (the LightningCLI and
its checks are seq2seq/training/fit.py), then, where the config has a TuneLengthPenalty callback, tune
the best checkpoint's length penalty on the validation set (seq2seq/inference/tune.py)."""

import os

# OpenMP threads that finish an operation spin, waiting for the next one: libgomp (torch's OpenMP on
# Linux) spins 300,000 times before it sleeps. When another program takes a core, the spinning
# thread burns the time its preempted partner needs, at each of the thousands of operations of a
# step, and training loses far more than the share of the machine taken. A short spin keeps that
# share and costs little alone; never spinning (OMP_WAIT_POLICY=PASSIVE) keeps it too but costs more
# alone (docs/performance/threads.md#spin; bench/train_load.py measures it). Read when the OpenMP runtime
# loads, so before torch is imported; a wait policy or spin count the user set is kept.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from seq2seq.checkpoint import CheckpointError
from seq2seq.inference.tune import tune_length_penalty
from seq2seq.training.callbacks import TuneLengthPenalty
from seq2seq.training.fit import TranslationCLI
from seq2seq.training.fit import main as train


def main(args: list[str] | None = None) -> TranslationCLI:
    cli = train(args)
    for callback in cli.trainer.callbacks:  # type: ignore[attr-defined]  # typed loosely by Lightning
        if isinstance(callback, TuneLengthPenalty) and callback.request is not None:  # rank 0 of a finished run
            request = callback.request
            try:
                tune_length_penalty(checkpoint=request.checkpoint, sources=request.sources,
                                    references=request.references, beam_size=request.beam_size,
                                    length_penalties=request.length_penalties, device=request.device,
                                    directions=request.directions)
            except (CheckpointError, OSError, ValueError) as error:
                raise SystemExit(f"error: tuning the length penalty failed ({error}); the training run is kept in "
                                 f"{request.checkpoint}") from None
    return cli


if __name__ == "__main__":
    main()
