"""Training callbacks of ours (Lightning's own, such as EarlyStopping, are used from the configs as
they are).

PowerEMA: an exponential moving average of the weights whose horizon grows with training, so that
the first, random updates fade out on their own (Lightning's EMAWeightAveraging has a fixed decay:
with 0.999 over a 3,300-update run, the weights of the first 300 updates keep ~5% of the average).

TuneLengthPenalty: at the end of training, the best checkpoint's length penalty is chosen on the
validation set and stored in that checkpoint as the translation default, so that
`python -m seq2seq.translate` (and Translator, and the server) use it without being told.
"""

from __future__ import annotations

import sacrebleu
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, WeightAveraging
from torch import Tensor

from seq2seq.checkpoint import CheckpointError, store_search_defaults
from seq2seq.search import SearchConfig
from seq2seq.translator import Translator


class PowerAverage:
    """AveragedModel's multi_avg_fn for the power-function EMA of Karras et al. 2024 (EDM2): after t
    updates the average moves towards the weights by 1 - beta_t, beta_t = (1 - 1/t)^(gamma + 1).

    Each update t' <= t then weighs about in proportion to t'^gamma: the last ~t/(gamma + 1) updates count
    most, and the first half of training keeps 0.5^(gamma + 1) of the average (1.6% for gamma 5).
    """

    def __init__(self, gamma: float):
        self.gamma = gamma

    def __call__(self, averaged: list[Tensor], current: list[Tensor], num_averaged: Tensor) -> None:
        t = int(num_averaged) + 1  # this update's number; AveragedModel copies the weights at t = 1 itself
        beta = (1 - 1 / t) ** (self.gamma + 1)
        torch._foreach_lerp_(averaged, current, 1 - beta)


class PowerEMA(WeightAveraging):
    def __init__(self, *, gamma: float = 5.0):
        """Lightning's WeightAveraging with PowerAverage: validation and checkpoints use the average, the
        trained weights stay in checkpoints under current_model_state, and a resume continues both."""
        if not gamma > 0:
            raise ValueError(f"PowerEMA: gamma must be > 0, got {gamma}")
        super().__init__(multi_avg_fn=PowerAverage(gamma))


def choose_length_penalty(translator: Translator, sources: list[str], references: list[str], *, beam_size: int,
                          length_penalties: list[float]) -> tuple[float, dict[float, float]]:
    """The length penalty with the highest corpus BLEU on (sources, references), the first on a tie; and
    every penalty's BLEU."""
    scores = {}
    for alpha in length_penalties:
        hypotheses = translator.translate(sources, SearchConfig(beam_size=beam_size, length_penalty=alpha))
        scores[alpha] = sacrebleu.metrics.BLEU().corpus_score(hypotheses, [references]).score
    return max(scores, key=lambda alpha: scores[alpha]), scores


class TuneLengthPenalty(Callback):
    def __init__(self, *, beam_size: int = 5, length_penalties: tuple[float, ...] = (0.6, 1.0, 1.5, 2.0, 2.5, 3.0)):
        """After fit: decode the validation set with `beam_size` under each of `length_penalties` using the
        best checkpoint (the first ModelCheckpoint's), and store the best-scoring pair in it."""
        SearchConfig(beam_size=beam_size)  # a ConfigError at start, not after hours of training
        for alpha in length_penalties:
            SearchConfig(length_penalty=alpha)
        if not length_penalties:
            raise ValueError("TuneLengthPenalty: length_penalties is empty; give at least one value")
        self.beam_size, self.length_penalties = beam_size, list(length_penalties)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or trainer.interrupted:
            return
        checkpoint = trainer.checkpoint_callback
        path = checkpoint.best_model_path if isinstance(checkpoint, ModelCheckpoint) else ""
        valid = getattr(trainer.datamodule, "datasets", {}).get("valid")  # type: ignore[attr-defined]
        if not path or valid is None:
            print("TuneLengthPenalty: no best checkpoint or no validation set; nothing tuned", flush=True)
            return
        # The strategy's device: by on_fit_end Lightning has already moved the module back to the CPU.
        translator = Translator.from_checkpoint(path, device=trainer.strategy.root_device)
        best, scores = choose_length_penalty(translator, list(valid["src"]), list(valid["tgt"]),
                                             beam_size=self.beam_size, length_penalties=self.length_penalties)
        table = ", ".join(f"{alpha:g}: {bleu:.2f}" for alpha, bleu in scores.items())
        try:
            store_search_defaults(path, {"beam_size": self.beam_size, "length_penalty": best})
        except (OSError, CheckpointError) as error:  # training is saved already: say so, lose nothing
            print(f"length penalty on validation (beam {self.beam_size}, BLEU): {table}; error: cannot store "
                  f"{best:g} in {path} ({error}); pass --length-penalty {best:g} when translating", flush=True)
            return
        print(f"length penalty on validation (beam {self.beam_size}, BLEU): {table}; "
              f"{best:g} stored in {path} as the translation default", flush=True)
