"""What each training-step optimisation is worth: the fused loss and the CPU dropout, on and off.

    python bench/train_ablation.py [--size multi30k] [--steps 6]

Four copies of our model (same init) train on the same Multi30k batches, in alternation so that
machine noise hits all alike; the table gives each variant's speed-up over the plain one (full
logits + per-token loss, torch's nn.Dropout).
"""

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn
from train_throughput import SIZES, batches_for, make_step, ours, ours_loss, time_alternating

from seq2seq.model.layers import Dropout
from seq2seq.text.tokenizer import PAD_ID
from seq2seq.training.loss import label_smoothed_nll


def full_logits_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The unfused path: (B, T, V) logits, then the per-token label-smoothed loss."""
    loss, _ = label_smoothed_nll(model(batch["src"], batch["tgt_in"]), batch["tgt_out"], smoothing=0.1, pad_id=PAD_ID)
    return loss.sum() / (batch["tgt_out"] != PAD_ID).sum()


def with_torch_dropout(model: nn.Module) -> nn.Module:
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Dropout):
                setattr(module, name, nn.Dropout(child.p))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="multi30k", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant (after one warm-up step)")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    d_model, heads, d_ff, layers, vocab, placement, max_tokens = SIZES[args.size]
    with tempfile.TemporaryDirectory() as tmp:
        batches = batches_for(vocab_tokens=8000, max_tokens=max_tokens, count=args.steps + 1, workdir=Path(tmp))
    steps = {}
    for name, loss_fn, torch_dropout in (
        ("full logits + nn.Dropout", full_logits_loss, True),
        ("full logits + our Dropout", full_logits_loss, False),
        ("fused loss + nn.Dropout", ours_loss, True),
        ("fused loss + our Dropout", ours_loss, False),
    ):
        torch.manual_seed(0)
        model = ours(d_model=d_model, num_heads=heads, d_ff=d_ff, layers=layers, vocab=vocab, norm_placement=placement)
        model = with_torch_dropout(model) if torch_dropout else model
        steps[name] = make_step(model.train(), loss_fn, bf16=False)
        steps[name](batches[0])  # warm-up
    seconds = {name: sum(times) for name, times in time_alternating(steps, batches[1:]).items()}
    plain = seconds["full logits + nn.Dropout"]
    print(f"\n{args.size}, fp32, {torch.get_num_threads()} threads, {args.steps} steps each")
    print(f"{'variant':<28} {'seconds':>8} {'speed-up':>9}")
    for name, total in seconds.items():
        print(f"{name:<28} {total:8.2f} {plain / total:8.2f}x")


if __name__ == "__main__":
    main()
