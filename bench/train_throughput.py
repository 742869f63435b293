"""Training throughput: our Transformer against torch.nn.Transformer of the same size, same batches.

    python bench/train_throughput.py [--sizes multi30k base] [--precisions fp32 bf16] [--steps 6]

One training step = forward, label-smoothed loss, backward, AdamW update. Both models see the same
Multi30k token-budget batches, in alternation (ours, baseline, ours, ...) so that machine noise hits
both alike. Also prints the fraction of the machine's matmul peak (a large square matmul timed in
this same process) that each step reaches, with FLOPs counted by torch's FlopCounterMode.
"""

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from seq2seq.data import TranslationDataModule
from seq2seq.model import Transformer, TransformerConfig
from seq2seq.model.positions import sinusoidal_table
from seq2seq.module import label_smoothed_nll
from seq2seq.tokenizer import PAD_ID

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
        return hidden @ self.embedding.weight.T


def ours(*, d_model, num_heads, d_ff, layers, vocab, norm_placement) -> nn.Module:
    config = TransformerConfig(
        vocab_size=vocab, d_model=d_model, num_heads=num_heads, d_ff=d_ff, num_encoder_layers=layers,
        num_decoder_layers=layers, dropout=0.1, norm_placement=norm_placement,
    )
    return Transformer(config)


def make_step(model: nn.Module, *, bf16: bool):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)

    def step(batch: dict) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(batch["src"], batch["tgt_in"])
            loss, _ = label_smoothed_nll(logits, batch["tgt_out"], smoothing=0.1, pad_id=PAD_ID)
            loss = loss.sum() / (batch["tgt_out"] != PAD_ID).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of an n x n x n matmul: the machine's practical peak for this dtype."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
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
        batches.append({k: batch[k] for k in ("src", "tgt_in", "tgt_out")})
        if len(batches) == count:
            break
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["multi30k", "base"], choices=list(SIZES))
    # bf16 only where the CPU has fast bf16 matmuls (AMX / AVX512-BF16) or on a GPU: on an AVX2-only
    # CPU a bf16 matmul runs ~170x slower than fp32 (0.9 vs 155 GFLOP/s measured on our AMD EPYC).
    parser.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per model (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as training does (module.py); both models get it

    peaks = {p: matmul_peak(torch.float32 if p == "fp32" else torch.bfloat16) for p in args.precisions}
    print(f"matmul peak here: {', '.join(f'{p} {g:.0f} GFLOP/s' for p, g in peaks.items())}; "
          f"{torch.get_num_threads()} threads")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            d_model, heads, d_ff, layers, vocab, placement, max_tokens = SIZES[size]
            batches = batches_for(vocab_tokens=8000, max_tokens=max_tokens, count=args.steps + 1, workdir=Path(tmp))
            for precision in args.precisions:
                torch.manual_seed(0)
                models = {
                    "ours": ours(d_model=d_model, num_heads=heads, d_ff=d_ff, layers=layers, vocab=vocab,
                                 norm_placement=placement),
                    "nn.Transformer": BaselineTransformer(d_model=d_model, num_heads=heads, d_ff=d_ff, layers=layers,
                                                          vocab=vocab, norm_first=placement == "pre"),
                }
                steps = {name: make_step(m.train(), bf16=precision == "bf16") for name, m in models.items()}
                flops = {name: step_flops(step, batches[0]) for name, step in steps.items()}  # also the warm-up
                times: dict[str, list[float]] = {name: [] for name in steps}
                tokens = sum(int((b["tgt_out"] != PAD_ID).sum()) for b in batches[1:])
                for batch in batches[1:]:
                    for name, step in steps.items():
                        start = time.perf_counter()
                        step(batch)
                        times[name].append(time.perf_counter() - start)
                for name in steps:
                    total = sum(times[name])
                    achieved = flops[name] / statistics.median(times[name]) / 1e9
                    rows.append((size, precision, name, tokens / total, achieved / peaks[precision]))
                ratio = sum(times["nn.Transformer"]) / sum(times["ours"])
                rows.append((size, precision, "ours / nn.Transformer", ratio, None))
                print(f"done: {size} {precision}", flush=True)

    print(f"\n{'size':<9} {'precision':<9} {'model':<22} {'tgt tok/s (or ratio)':>20} {'of matmul peak':>15}")
    for size, precision, name, value, fraction in rows:
        shown = f"{value:.2f}x" if fraction is None else f"{value:,.0f}"
        frac = "" if fraction is None else f"{fraction:.0%}"
        print(f"{size:<9} {precision:<9} {name:<22} {shown:>20} {frac:>15}")


if __name__ == "__main__":
    main()
