"""The run tuned to the machine it is on, as training starts (MachineTuning, which TranslationModule adds
through configure_callbacks): denormal floats flushed, a warning for bf16 given where bf16 is slow,
and the precision of attention under autocast, which rank 0 decides and every rank follows; and whether
the training step is compiled (choose_compiled_step, which TranslationModule.on_fit_start asks), decided alike."""

import os

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from seq2seq.model import Transformer
from seq2seq.precision import AUTO_TRAINING_PRECISION_ENV, bf16_attention, bf16_matmuls
from seq2seq.training.compiled import compiled_step_pays


class MachineTuning(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Tiny Adam second moments and softmax tails underflow into denormal floats, which x86 CPUs
        # process many times slower (the AdamW step most of all). Training loses nothing by flushing
        # them to zero.
        torch.set_flush_denormal(True)
        warn_if_bf16_is_slow_here(trainer)
        model = pl_module.model
        if isinstance(model, Transformer):  # a TranslationModule's
            choose_attention_precision(trainer, model)


def warn_if_bf16_is_slow_here(trainer: L.Trainer) -> None:
    """A bf16 precision given for a CPU without bf16 matmul units (auto would not have chosen it)."""
    device, precision = trainer.strategy.root_device, str(trainer.precision)
    chosen_by_auto = os.environ.get(AUTO_TRAINING_PRECISION_ENV) == f"{device.type}={precision}"
    if device.type != "cpu" or "bf16" not in precision or chosen_by_auto:
        return
    matmuls = bf16_matmuls(device, training=True)
    if not matmuls.pays:
        rank_zero_warn(
            f"trainer.precision={precision} on a CPU whose bf16 matmuls are slower than fp32 ({matmuls.why}): "
            "a training step there runs many times slower than in fp32 (docs/results/training-speed.md). Use "
            "--trainer.precision=auto or 32-true on this machine."
        )


def choose_attention_precision(trainer: L.Trainer, model: Transformer) -> None:
    """Under autocast, attention in float32 where its low-precision kernels are the slower ones here
    (MultiHeadAttention.fp32_under_autocast). Rank 0 decides, timing at most once per machine, and
    every rank follows it: all compute alike."""
    precision = str(trainer.precision)
    if not precision.endswith("-mixed"):
        return
    verdict = None
    if trainer.is_global_zero:
        verdict = bf16_attention(trainer.strategy.root_device, dropout=model.config.attention_dropout > 0)
    low = bool(trainer.strategy.broadcast(verdict is not None and verdict.pays))
    model.attention_in_fp32_under_autocast(enabled=not low)
    if verdict is not None:
        low_name = "bf16" if precision.startswith("bf16") else "fp16"
        rank_zero_info(f"attention under {precision}: {low_name if low else 'float32'} ({verdict.why})")


def choose_compiled_step(trainer: L.Trainer, model: Transformer, *, setting: bool | str, max_tokens: int) -> bool:
    """Whether to train through the compiled encoder and decoder: as `setting` says (model.compile), or for "auto"
    as rank 0 times it here (training/compiled.py; once per machine, model shape and precision) and every rank
    follows, so that all compute alike."""
    if setting != "auto":
        return bool(setting)
    verdict = None
    if trainer.is_global_zero:
        verdict = compiled_step_pays(model.config, trainer.strategy.root_device, precision=str(trainer.precision),
                                     max_tokens=max_tokens, fp32_attention=model.attention_in_fp32(),
                                     fp32_residual=model.residual_in_fp32())
    compiled = bool(trainer.strategy.broadcast(verdict is not None and verdict.pays))
    if verdict is not None:
        rank_zero_info(f"training step: {'compiled' if compiled else 'eager'} ({verdict.why})")
    return compiled
