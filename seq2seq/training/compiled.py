"""The compiled training step: the model's encoder and decoder (Transformer.hidden_states) under torch.compile,
used where it is timed to pay on this machine.

What is compiled is the forward pass from token ids to the decoder's last hidden states, and with it (through
AOTAutograd) its backward: inductor fuses what eager runs as separate kernels (the norms with the residual adds,
dropout, the casts between bf16 and float32 under autocast, the activations) on a CPU and on a GPU. The fused
projection-and-loss (training/loss.py) stays eager: it walks the target tokens in chunks whose count moves with
the batch, and it is already one pass over each chunk's logits. Shapes are dynamic: token-budget batches change
their (B, S, T) at every step, and one graph serves them all instead of one compile per shape.

Whether it pays is measured, not assumed (the answer moves with the machine, the model's size and the precision:
docs/results/training-speed.md#compiled has the figures): `compiled_step_pays` times the eager and the compiled
step of the run's own model on a batch of its token budget, once per machine, model shape and precision, and keeps
the verdict in the machine's cache file (seq2seq/precision.py) as precision's are kept. Timing it the first time
compiles the step (tens of seconds on a CPU; printed); a run that then compiles reads inductor's on-disk cache.

Dropout under compile draws its masks from inductor's own random numbers (the eager CPU path's 16-bit trick in
model/layers.py is not traceable), so a compiled run does not draw an eager run's masks: an exact resume is exact
between runs of the same kind.
"""

import hashlib
import json
import time

import torch

from seq2seq.model import Transformer, TransformerConfig
from seq2seq.precision import Verdict, autocast_dtype, device_name, timed_verdict
from seq2seq.training.budget import probe_step
from seq2seq.training.loss import HiddenStates

# The timing batch's sentence length: Multi30k's are 10-20 pieces, WMT's ~30.
TIMING_LENGTH = 32


def compile_hidden_states(model: Transformer) -> HiddenStates:
    """model.hidden_states under torch.compile (inductor, dynamic shapes); compiled at its first call."""
    return torch.compile(model.hidden_states, dynamic=True)


def compiled_step_pays(config: TransformerConfig, device: torch.device, *, precision: str, max_tokens: int,
                       fp32_attention: bool, fp32_residual: bool) -> Verdict:
    """Whether the compiled training step (forward, fused loss, backward) runs MARGIN times faster than the eager
    one here, for a model of `config` in Lightning's `precision` ("bf16-mixed", "32-true", ...), with batches of
    `max_tokens` padded positions; timed once per machine and kept."""
    shape = {
        "config": config.to_dict(), "precision": precision, "max_tokens": max_tokens, "fp32_attention": fp32_attention,
        "fp32_residual": fp32_residual,
        "device": device_name(device) if device.type != "cpu" else "cpu",
    }
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return timed_verdict(
        f"compiled-training-{digest}",
        lambda compiled: step_seconds(config, device, precision=precision, max_tokens=max_tokens,
                                      fp32_attention=fp32_attention, fp32_residual=fp32_residual,
                                      compiled=compiled),
        what="the compiled training step", candidates=(True, False), baseline="eager",
    )


def step_seconds(config: TransformerConfig, device: torch.device, *, precision: str, max_tokens: int,
                 fp32_attention: bool, fp32_residual: bool, compiled: bool, repeats: int = 3) -> float:
    """The fastest of `repeats` training steps (forward, loss, backward: budget.probe_step; no optimiser) of a
    fresh model of `config` on batches of `max_tokens` positions, after two warm-up steps (which compile, when
    `compiled`)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # a seeded run's numbers kept
        model = Transformer(config).to(device).train()
        model.attention_in_fp32_under_autocast(enabled=fp32_attention)
        model.residual_in_fp32_under_autocast(enabled=fp32_residual)
        hidden_states = compile_hidden_states(model) if compiled else model.hidden_states

        def step() -> None:
            probe_step(model, budget=max_tokens, length=TIMING_LENGTH, dtype=autocast_dtype(precision),
                       hidden_states=hidden_states)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        for _ in range(2):  # the first compiles forward and backward; the second meets any recompile
            step()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - start)
        return best
