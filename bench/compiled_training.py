"""The compiled training step against the eager one: what `model.compile: auto` decides from, at length.

    python bench/compiled_training.py [--precision bf16] [--no-dropout] [--max-tokens 2048] [--steps 8]

One Multi30k token-budget batch, the config's model (d_model 256, 3+3 pre-norm layers, 8k vocabulary), one
training step (forward, fused loss, backward, fused AdamW) timed `--steps` times after three warm-up steps (which
compile) in each of three forms: eager; the encoder and decoder compiled with static shapes (the best a compile
can do on one shape); and compiled with dynamic shapes (what training/compiled.py compiles: one graph for every
batch shape). Prints the fastest step of each and its ratio to eager, in one process. `--no-dropout` sets every
dropout to 0 (dropout under compile draws its masks in inductor's kernels, the eager CPU path in ours).
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_throughput as tt  # noqa: E402  # (this folder's: the same model and batches)

from seq2seq.model.attention import MultiHeadAttention  # noqa: E402
from seq2seq.model.layers import Dropout  # noqa: E402
from seq2seq.precision import tune_process_memory  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--no-dropout", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    tune_process_memory()
    with tempfile.TemporaryDirectory() as tmp:
        batch = tt.batches_for(vocab_tokens=8000, max_tokens=args.max_tokens, count=2, workdir=Path(tmp))[1]
    print(f"batch: {tuple(batch['src'].shape)} source, {tuple(batch['tgt_in'].shape)} target; {args.precision}"
          f"{', no dropout' if args.no_dropout else ''}", flush=True)
    best = {}
    for form in ("eager", "static", "dynamic"):
        torch.manual_seed(0)
        model = tt.ours(d_model=256, num_heads=4, d_ff=1024, layers=3, vocab=8000, norm_placement="pre")
        if args.no_dropout:
            for module in model.modules():
                if isinstance(module, MultiHeadAttention):
                    module.attention_dropout = 0.0
                elif isinstance(module, Dropout):
                    module.p = 0.0
        model.attention_in_fp32_under_autocast(enabled=True)  # as `auto` chose on the AMX Xeon measured
        hidden_states = None
        if form != "eager":
            hidden_states = torch.compile(model.hidden_states, dynamic=form == "dynamic")

        def loss(m, b, hidden_states=hidden_states):
            value, _, tokens = tt.training_loss(m, **b, smoothing=0.1, hidden_states=hidden_states)
            return value / tokens

        step = tt.make_step(model.train(), loss, bf16=args.precision == "bf16", device=torch.device("cpu"))
        started = time.perf_counter()
        for _ in range(3):
            step(batch)
        warm_up = time.perf_counter() - started
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - started)
        best[form] = min(times)
        print(f"{form:<8} {best[form] * 1e3:7.1f} ms a step ({best['eager'] / best[form]:.2f}x eager); "
              f"warm-up {warm_up:.0f} s", flush=True)


if __name__ == "__main__":
    main()
