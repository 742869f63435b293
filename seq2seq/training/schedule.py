"""Learning-rate schedules: the multipliers torch's LambdaLR applies to the peak rate (pure functions,
wrapped in objects whose attributes are plain data, so the scheduler's state stays loadable with
weights_only), and LinearBudget, the callback that tells the linear one where the run's end is.

inverse_sqrt (the paper's, fairseq's) needs no budget and a run can be extended; linear decays to 0
when the budget is spent: trainer.max_steps, max_epochs or max_time, the first reached.
"""

import math
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, Timer

from seq2seq.model import ConfigError

LrSchedule = Literal["inverse_sqrt", "linear"]
NO_END = ("linear decays the rate to 0 at the end of the run, and this run has none: set trainer.max_steps, "
          "max_epochs or max_time, or use inverse_sqrt")


def inverse_sqrt_schedule(step: int, *, warmup_steps: int) -> float:
    """The paper's / fairseq's multiplier: linear warm-up to 1 at `warmup_steps`, then sqrt(warmup/step)."""
    step = step + 1  # LambdaLR counts from 0; the first update already uses a non-zero rate
    if step < warmup_steps:
        return step / warmup_steps
    return math.sqrt(warmup_steps / step)


def linear_schedule(step: int, *, warmup_steps: int, progress: float) -> float:
    """Linear warm-up, and a linear decay that reaches 0 when the budget is spent (`progress` 1).

    Inverse sqrt leaves the rate high where a run with a fixed budget stops; this one anneals to 0
    there, so the last weights are the settled ones. The rate is the lower of the two lines, so the
    decay starts from (1 - progress at the end of warm-up), not from 1.
    """
    return max(0.0, min((step + 1) / warmup_steps, 1.0 - progress))


def max_time_timer(trainer: L.Trainer) -> Timer | None:
    """The Timer that trainer.max_time adds (one with a duration), or None if the run has no max_time."""
    timers = (cb for cb in trainer.callbacks if isinstance(cb, Timer))  # type: ignore[attr-defined]  # typed loosely
    return next((timer for timer in timers if timer.time_remaining() is not None), None)


def time_spent(trainer: L.Trainer) -> float:
    """The share of trainer.max_time used so far, 0 to 1 (0 without max_time).

    Rank 0's value on every rank: clocks differ between processes, and DDP ranks must take the same
    step (Lightning's Timer broadcasts its stop decision in the same way).
    """
    timer = max_time_timer(trainer)
    if timer is None:
        return 0.0
    elapsed, remaining = timer.time_elapsed(), timer.time_remaining()
    assert remaining is not None  # a duration: max_time_timer chose it for that
    return float(trainer.strategy.broadcast(min(elapsed / max(elapsed + remaining, 1e-9), 1.0)))


class InverseSqrt:
    """LambdaLR multiplier as an object (not a lambda), so the scheduler's state_dict stays plain data."""

    def __init__(self, warmup_steps: int):
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        return inverse_sqrt_schedule(step, warmup_steps=self.warmup_steps)


class LinearToZero:
    """LambdaLR multiplier for `linear_schedule`. The progress is the further of updates over
    `budget_steps` and `time_spent` (of max_time), both set by the module. Plain attributes only:
    LambdaLR saves them in the checkpoint."""

    def __init__(self, warmup_steps: int):
        self.warmup_steps = warmup_steps
        self.budget_steps = math.inf  # updates that max_steps / max_epochs allow
        self.time_spent = 0.0

    def __call__(self, step: int) -> float:
        progress = min(max(step / self.budget_steps, self.time_spent), 1.0)
        return linear_schedule(step, warmup_steps=self.warmup_steps, progress=progress)


def multiplier(schedule: LrSchedule, *, warmup_steps: int) -> InverseSqrt | LinearToZero:
    return LinearToZero(warmup_steps) if schedule == "linear" else InverseSqrt(warmup_steps)


class LinearBudget(Callback):
    """Feeds a LinearToZero its budget. At the start of training, the updates the run may take (after a
    resume too, where the budget may have grown: the rate restored from the checkpoint is the old
    budget's, 0 at its end, so it is recomputed for the new one); before each update, the share of
    max_time spent, which the scheduler's step after that update reads for the next. The module adds it
    (TranslationModule.configure_callbacks) when its schedule is linear."""

    def __init__(self, multiplier: LinearToZero):
        self.multiplier = multiplier

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        budget = float(trainer.estimated_stepping_batches)  # max_steps or what max_epochs allow
        self.multiplier.budget_steps = budget if budget > 0 else math.inf  # -1: no bound in steps
        if math.isinf(self.multiplier.budget_steps) and max_time_timer(trainer) is None:
            raise ConfigError("model.lr_schedule", NO_END)
        scheduler = pl_module.lr_schedulers()
        assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
        for group, base_lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
            group["lr"] = base_lr * self.multiplier(scheduler.last_epoch)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.multiplier.time_spent = time_spent(trainer)
