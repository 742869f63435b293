"""Training throughput: our Transformer against torch.nn.Transformer of the same size, same batches.

    python bench/train_throughput.py [--sizes multi30k base] [--precisions fp32 bf16] [--steps 6] [--max-tokens N]
                                     [--bf16-attention auto bf16 fp32] [--device cuda]

One training step = forward, label-smoothed loss, backward, fused AdamW update. Ours is what
TranslationModule.training_step runs (output projection fused with the loss over non-pad positions,
seq2seq/training/loss.py); the baseline is what a plain PyTorch loop writes (full logits, F.cross_entropy).
Both models see the same Multi30k token-budget batches, in alternation (ours, baseline, ours, ...)
so that machine noise hits both alike. Also prints the fraction of the machine's matmul peak (a
large square matmul timed in this same process) that each step reaches, with FLOPs counted by
torch's FlopCounterMode. bench/train_ablation.py splits our speed-up into its parts.

With --device cuda the same runs on the GPU (bf16 autocast, each step's time taken after a synchronize), and
each row also gives its MFU: 6 N FLOPs a target token (N, the parameters, printed) over the GPU's datasheet dense
bf16 peak (seq2seq/training/mfu.py). `--max-tokens auto` there sizes the batches as `data.max_tokens: auto`
does (the largest whose training step fits the GPU's memory, seq2seq/training/budget.py): a GPU runs near its
peak only at large batches.

Under bf16, our attention runs in the precision training would choose here (`auto`: bf16 unless its
kernels time slower than float32's, seq2seq/precision.py) or, with --bf16-attention, in each
one given, as separate rows. The process keeps freed memory as `python -m seq2seq.fit` does.
"""

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from seq2seq.model import Transformer, TransformerConfig
from seq2seq.model.positions import sinusoidal_table
from seq2seq.precision import bf16_attention, tune_process_memory
from seq2seq.text.tokenizer import PAD_ID
from seq2seq.training.budget import size_budget
from seq2seq.training.data import TranslationDataModule
from seq2seq.training.loss import training_loss
from seq2seq.training.mfu import gpu_peak, training_flops_per_token

MULTI30K = Path(__file__).resolve().parents[2] / "shared/data/multi30k"

SIZES = {
    # name: (d_model, num_heads, d_ff, layers, vocab, norm_placement, max_tokens)
    "multi30k": (256, 4, 1024, 3, 8000, "pre", 4096),
    "base": (512, 8, 2048, 6, 32000, "post", 2048),
}


class BaselineTransformer(nn.Module):
    """torch.nn.Transformer with what it lacks for translation: tied embeddings, √d scale, sinusoids."""

    def __init__(self, *, d_model: int, num_heads: int, d_ff: int, layers: int, vocab: int, norm_first: bool):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model, padding_idx=PAD_ID)
        nn.init.normal_(self.embedding.weight, std=d_model**-0.5)
        self.register_buffer("positions", sinusoidal_table(max_positions=1024, d_model=d_model), persistent=False)
        self.transformer = nn.Transformer(
            d_model=d_model, nhead=num_heads, num_encoder_layers=layers, num_decoder_layers=layers,
            dim_feedforward=d_ff, dropout=0.1, batch_first=True, norm_first=norm_first,
        )
        self.scale = math.sqrt(d_model)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens) * self.scale + self.positions[: tokens.size(1)]

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1), dtype=torch.bool)
        hidden = self.transformer(
            self.embed(src), self.embed(tgt_in), tgt_mask=causal, tgt_is_causal=True,
            src_key_padding_mask=src == PAD_ID, tgt_key_padding_mask=tgt_in == PAD_ID,
            memory_key_padding_mask=src == PAD_ID,
        )
        return F.linear(hidden, self.embedding.weight)  # as nn.Linear; `@` hits a slower bf16 kernel on CPU


def ours(*, d_model, num_heads, d_ff, layers, vocab, norm_placement) -> nn.Module:
    config = TransformerConfig(
        vocab_size=vocab, d_model=d_model, num_heads=num_heads, d_ff=d_ff, num_encoder_layers=layers,
        num_decoder_layers=layers, dropout=0.1, norm_placement=norm_placement,
    )
    return Transformer(config)


def ours_loss(model: Transformer, batch: dict) -> torch.Tensor:
    """What TranslationModule.training_step does: projection fused with the loss, pad rows skipped."""
    loss, _, tokens = training_loss(model, **batch, smoothing=0.1)
    return loss / tokens


def baseline_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """What a plain PyTorch training loop writes."""
    batch = {k: v for k, v in batch.items() if k != "target_positions"}
    logits = model(batch["src"], batch["tgt_in"])  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), batch["tgt_out"].flatten(), ignore_index=PAD_ID, label_smoothing=0.1)


def make_step(model: nn.Module, loss_fn, *, bf16: bool, device: torch.device):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)

    def step(batch: dict) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's kernels run after the call that queues them returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_alternating(steps: dict[str, Callable[[dict], None]], batches: list[dict],
                     device: torch.device) -> dict[str, list[float]]:
    """Seconds of each step on each batch; the steps take turns on every batch, so noise hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for batch in batches:
        for name, step in steps.items():
            synchronize(device)
            start = time.perf_counter()
            step(batch)
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def matmul_peak(dtype: torch.dtype, device: torch.device, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of an n x n x n matmul: the machine's practical peak for this dtype."""
    n = 8192 if device.type == "cuda" else n  # a GPU needs a large one to reach its peak
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    F.linear(a, b)  # a @ b.T, nn.Linear's layout: the fastest bf16 one on AVX2 CPUs, as fast as any in fp32
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        F.linear(a, b)
    synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def step_flops(step, batch) -> int:
    with FlopCounterMode(display=False) as counter:
        step(batch)
    return counter.get_total_flops()


def batches_for(*, vocab_tokens: int, max_tokens: int, count: int, workdir: Path) -> list[dict]:
    data = TranslationDataModule(
        src_lang="de", tgt_lang="en", tokenizer_path=str(workdir / "spm.model"), vocab_size=vocab_tokens,
        train_files=[str(MULTI30K / "train.de.gz"), str(MULTI30K / "train.en.gz")], valid_split=None,
        test_split=None, max_tokens=max_tokens, cache_dir=str(workdir / "cache"),
    )
    data.setup("fit")
    loader = data.train_dataloader()
    batches = []
    for batch in loader:
        batches.append({k: batch[k] for k in ("src", "tgt_in", "tgt_out", "target_positions")})
        if len(batches) == count:
            break
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["multi30k", "base"], choices=list(SIZES))
    # bf16 by default only where the CPU has bf16 matmul units (AMX / AVX512-BF16) or on a GPU: on our
    # AVX2-only AMD EPYC torch's bf16 matmuls run at 16 GFLOP/s in nn.Linear's layout and 1.3 in the
    # others (backward uses those), against 130-160 in fp32.
    parser.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per model (after one warm-up step)")
    parser.add_argument("--max-tokens", default=None,
                        help="padded tokens per batch instead of each size's default (small batches make bf16 "
                             "on an AVX2 CPU measurable); auto (--device cuda): the largest that fits the GPU")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bf16-attention", nargs="+", default=["auto"], choices=["auto", "bf16", "fp32"],
                        help="under bf16, our attention's precision: auto (what training picks here) or as given")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch finds no CUDA GPU here")
    if args.max_tokens not in (None, "auto") and not args.max_tokens.isdigit():
        parser.error(f"--max-tokens: a number of padded positions or auto, got {args.max_tokens!r}")
    if args.max_tokens == "auto" and device.type != "cuda":
        parser.error("--max-tokens auto sizes batches to a GPU's memory: give --device cuda, or a number")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as training does (training/module.py); both models get it
    tune_process_memory()  # as seq2seq.fit does
    attentions = {"auto": not bf16_attention(device, dropout=False).pays, "bf16": False, "fp32": True}
    # (precision, our attention in fp32 under autocast): fp32 has no autocast, so one row.
    runs = [(p, attentions[a]) for p in args.precisions for a in (args.bf16_attention if p == "bf16" else ["auto"])]

    peaks = {p: matmul_peak(torch.float32 if p == "fp32" else torch.bfloat16, device) for p in args.precisions}
    datasheet = gpu_peak(device)
    where = f"{torch.cuda.get_device_name(device)}" if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"matmul peak here: {', '.join(f'{p} {g:.0f} GFLOP/s' for p, g in peaks.items())}; {where}"
          + (f"; datasheet bf16 peak {datasheet / 1e12:.0f} TFLOP/s" if datasheet else ""))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            d_model, heads, d_ff, layers, vocab, placement, max_tokens = SIZES[size]
            model_args = dict(d_model=d_model, num_heads=heads, d_ff=d_ff, layers=layers, vocab=vocab)
            if args.max_tokens == "auto":  # sized on ours, as training sizes it, at the longest Multi30k pairs
                torch.manual_seed(0)
                probe = ours(**model_args, norm_placement=placement).to(device)
                budget = size_budget(probe, length=128, high=2**20, dtype=torch.bfloat16 if "bf16" in args.precisions
                                     else None)
                del probe
                torch.cuda.empty_cache()
                print(f"{size}: --max-tokens auto sized {budget} padded positions a batch", flush=True)
            else:
                budget = int(args.max_tokens or max_tokens)
            batches = [{k: v.to(device) for k, v in b.items()}
                       for b in batches_for(vocab_tokens=8000, max_tokens=budget, count=args.steps + 1,
                                            workdir=Path(tmp))]
            for precision, fp32_attention in runs:
                if precision == "bf16":
                    precision = f"bf16 ({'fp32' if fp32_attention else 'bf16'} attention)"
                torch.manual_seed(0)
                models = {
                    "ours": ours(**model_args, norm_placement=placement),
                    "nn.Transformer": BaselineTransformer(**model_args, norm_first=placement == "pre"),
                }
                models["ours"].attention_in_fp32_under_autocast(enabled=fp32_attention)
                losses = {"ours": ours_loss, "nn.Transformer": baseline_loss}
                bf16 = precision.startswith("bf16")
                steps = {name: make_step(m.to(device).train(), losses[name], bf16=bf16, device=device)
                         for name, m in models.items()}
                flops = {name: step_flops(step, batches[0]) for name, step in steps.items()}  # also the warm-up
                tokens = sum(int((b["tgt_out"] != PAD_ID).sum()) for b in batches[1:])
                times = time_alternating(steps, batches[1:], device)
                for name in steps:
                    total = sum(times[name])
                    achieved = flops[name] / statistics.median(times[name]) / 1e9
                    model_mfu = (training_flops_per_token(models[name]) * tokens / total / datasheet
                                 if datasheet else None)
                    rows.append((size, precision, name, tokens / total, achieved / peaks["bf16" if bf16 else "fp32"],
                                 model_mfu))
                ratio = sum(times["nn.Transformer"]) / sum(times["ours"])
                rows.append((size, precision, "ours / nn.Transformer", ratio, None, None))
                count = sum(p.numel() for p in models["ours"].parameters())
                print(f"done: {size} {precision}, N = {count / 1e6:.1f}M parameters (ours), batches of {budget} "
                      "padded positions", flush=True)

    mfu_head = f" {'MFU (6N)':>9}" if datasheet else ""
    print(f"\n{'size':<9} {'precision':<24} {'model':<22} {'tgt tok/s (or ratio)':>20} {'of matmul peak':>15}{mfu_head}")
    for size, precision, name, value, fraction, model_mfu in rows:
        shown = f"{value:.2f}x" if fraction is None else f"{value:,.0f}"
        frac = "" if fraction is None else f"{fraction:.0%}"
        mfu_cell = f" {model_mfu:>9.1%}" if model_mfu is not None else (" " * 10 if datasheet else "")
        print(f"{size:<9} {precision:<24} {name:<22} {shown:>20} {frac:>15}{mfu_cell}")
    ours_rows = {(size, precision): value for size, precision, name, value, *_ in rows if name == "ours"}
    for (size, precision), value in ours_rows.items():
        if precision != "fp32" and (size, "fp32") in ours_rows:
            print(f"{size}: ours {precision} / ours fp32 = {value / ours_rows[size, 'fp32']:.2f}x")

if __name__ == "__main__":
    main()
