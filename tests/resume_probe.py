"""Callbacks that tests of seq2seq.fit load by class path (in a `python -m seq2seq.fit` subprocess, or in
process): what was trained on, at what rate, and a kill -9 at a chosen update."""

import json
import os
import signal
from pathlib import Path

import lightning as L


class BatchLog(L.Callback):
    """Appends (update number, a fingerprint of the batch) for every batch trained on, flushed at once."""

    def __init__(self, path: str):
        self.path = Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        record = {"step": trainer.global_step, "epoch": trainer.current_epoch,
                  "batch": batch["src"].sum(dim=1).tolist()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


class KillAt(L.Callback):
    """kill -9 of its own process before update `step`: no hook, no handler, no checkpoint on the way out."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class LrLog(L.Callback):
    """Appends the learning rate each update trains with (read before the update, one line each)."""

    def __init__(self, path: str):
        self.path = Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with self.path.open("a") as f:
            f.write(f"{trainer.optimizers[0].param_groups[0]['lr']!r}\n")
