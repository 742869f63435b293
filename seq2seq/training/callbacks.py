"""Training callbacks of ours (Lightning's own, such as EarlyStopping, are used from the configs as
they are).

PowerEMA: an exponential moving average of the weights whose horizon grows with training, so that
the first, random updates fade out on their own (Lightning's EMAWeightAveraging has a fixed decay:
with 0.999 over a 3,300-update run, the weights of the first 300 updates keep ~5% of the average).

TuneLengthPenalty: at the end of training, names the best checkpoint and the validation set, on which
`python -m seq2seq.fit` then chooses the length penalty (seq2seq/inference/tune.py) and stores it in that
checkpoint as the translation default, so that `python -m seq2seq.translate` (and Translator, and the
server) use it without being told. Training only says what to tune: decoding is inference's.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, WeightAveraging
from torch import Tensor

from seq2seq.decoding.config import SearchConfig


class PowerAverage:
    """AveragedModel's multi_avg_fn for the power-function EMA of Karras et al. 2024 (EDM2): after t
    updates the average moves towards the weights by 1 - beta_t, beta_t = (1 - 1/t)^(gamma + 1).

    Each update t' <= t then weighs about in proportion to t'^gamma: the last ~t/(gamma + 1) updates count
    most, and the first half of training keeps 0.5^(gamma + 1) of the average (1.6% for gamma 5).
    """

    def __init__(self, gamma: float):
        self.gamma = gamma

    def __call__(self, averaged: list[Tensor], current: list[Tensor], num_averaged: Tensor | int) -> None:
        t = int(num_averaged) + 1  # this update's number; the weights are copied at t = 1 instead
        beta = (1 - 1 / t) ** (self.gamma + 1)
        torch._foreach_lerp_(averaged, current, 1 - beta)


class PowerEMA(WeightAveraging):
    def __init__(self, *, gamma: float = 5.0):
        """Lightning's WeightAveraging with PowerAverage: validation and checkpoints use the average, the
        trained weights stay in checkpoints under current_model_state, and a resume continues both."""
        if not gamma > 0:
            raise ValueError(f"PowerEMA: gamma must be > 0, got {gamma}")
        self.power = PowerAverage(gamma)
        super().__init__(multi_avg_fn=self.power)
        self._updates = 0  # the average's count, kept on the host (read from the device as training starts)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after a resume restored it: read here, once, not inside a step
        self._updates = int(self._average_model.n_averaged) if self._average_model is not None else 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """WeightAveraging's update, without AveragedModel.update_parameters' two reads of its count on the host at
        every update (`bool(n_averaged == 0)`, `if n_averaged > 0`: each a wait for a GPU): the count is read once
        a run, as training starts (a resume has restored it on the device), then counted here as well; the arithmetic
        is the same."""
        average = self._average_model
        if average is None or trainer.global_step <= self._latest_update_step or not self.should_update(
                step_idx=trainer.global_step - 1):
            return
        ours = self._use_buffers
        current = [t.detach() for t in (chain(pl_module.parameters(), pl_module.buffers()) if ours
                                        else pl_module.parameters())]
        kept = [t.detach() for t in (chain(average.module.parameters(), average.module.buffers()) if ours
                                     else average.module.parameters())]
        if self._updates == 0:
            torch._foreach_copy_(kept, current)
        else:
            groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
            for mine, theirs in zip(kept, current, strict=True):
                pair = groups.setdefault((mine.device, mine.dtype), ([], []))
                pair[0].append(mine)
                pair[1].append(theirs.to(mine.device))
            for mine_group, theirs_group in groups.values():
                self.power(mine_group, theirs_group, self._updates)
        average.n_averaged += 1
        self._updates += 1
        self._latest_update_step = trainer.global_step


@dataclass(frozen=True)
class TuningRequest:
    """What TuneLengthPenalty asks seq2seq/inference/tune.py to do once training has ended."""

    checkpoint: str
    sources: list[str]
    references: list[str]
    beam_size: int
    length_penalties: list[float]
    device: str
    directions: list[tuple[str, str]] | None = None  # a multilingual run's (src, tgt) of each validation pair


class TuneLengthPenalty(Callback):
    def __init__(self, *, beam_size: int = 5, length_penalties: tuple[float, ...] = (0.6, 1.0, 1.5, 2.0, 2.5, 3.0)):
        """Asks for the validation set to be decoded with `beam_size` under each of `length_penalties` with
        the best checkpoint (the first ModelCheckpoint's) after fit, and the best-scoring pair stored in
        it: `python -m seq2seq.fit` does it with `request`; a Trainer driven from Python calls
        seq2seq.inference.tune.tune_length_penalty(**vars(request)) itself."""
        SearchConfig(beam_size=beam_size)  # a ConfigError at start, not after hours of training
        for alpha in length_penalties:
            SearchConfig(length_penalty=alpha)
        if not length_penalties:
            raise ValueError("TuneLengthPenalty: length_penalties is empty; give at least one value")
        self.beam_size, self.length_penalties = beam_size, list(length_penalties)
        self.request: TuningRequest | None = None  # set at the end of a fit that has something to tune

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Training's part: what to tune on. The decoding is inference's (seq2seq/inference/tune.py), which
        python -m seq2seq.fit runs with `self.request` once training has ended."""
        if not trainer.is_global_zero or trainer.interrupted:
            return
        checkpoint = trainer.checkpoint_callback
        path = checkpoint.best_model_path if isinstance(checkpoint, ModelCheckpoint) else ""
        valid = getattr(trainer.datamodule, "datasets", {}).get("valid")  # type: ignore[attr-defined]
        if not path or valid is None:
            print("TuneLengthPenalty: no best checkpoint or no validation set; nothing tuned", flush=True)
            return
        # The strategy's device: by on_fit_end Lightning has already moved the module back to the CPU.
        several = getattr(trainer.datamodule, "directions", None)  # type: ignore[attr-defined]
        directions = [(several[k].src_lang, several[k].tgt_lang) for k in valid["direction"]] if several else None
        self.request = TuningRequest(checkpoint=path, sources=list(valid["src"]), references=list(valid["tgt"]),
                                     beam_size=self.beam_size, length_penalties=self.length_penalties,
                                     device=str(trainer.strategy.root_device), directions=directions)
