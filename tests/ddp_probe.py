"""Callbacks for the DDP and machine tests: each rank writes down what it trained on and how (loaded by
class path)."""

import json
from pathlib import Path

import lightning as L


class RankProbe(L.Callback):
    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)
        self.batches: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch["src"].sum(dim=1).tolist())  # a fingerprint of each pair in the batch

    def on_train_end(self, trainer, pl_module):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"rank": trainer.global_rank, "world_size": trainer.world_size, "batches": self.batches}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class MachineProbe(L.Callback):
    """Each rank writes down the precision it trained in and whether its attention ran in float32."""

    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)

    def on_train_end(self, trainer, pl_module):
        from seq2seq.model.attention import MultiHeadAttention

        fp32 = sorted({m.fp32_under_autocast for m in pl_module.modules() if isinstance(m, MultiHeadAttention)})
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"rank": trainer.global_rank, "world_size": trainer.world_size,
                  "precision": str(trainer.precision), "fp32_attention": fp32}
        (self.out_dir / f"machine{trainer.global_rank}.json").write_text(json.dumps(record))
