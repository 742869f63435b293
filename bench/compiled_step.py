"""What a compiled decoding step would save at a few rows (one sentence, greedy or beam 5): a feasibility bench.

    python bench/compiled_step.py --checkpoint checkpoints/multi30k-ende/best.ckpt [--rows 1 5] [--precision bf16]

At a few rows a decoding step is mostly overhead: each linear layer's oneDNN call costs ~25-50 us of which the
kernel itself runs ~5-9 (ONEDNN_VERBOSE's exec time), and a step dispatches ~130 eager ops around ~20 such calls. This
bench writes the decoder step of the checkpoint's model as one pure function over a cache of fixed capacity
(`pure_step`: no state object, no Python branches on the data) and times, per step, at --rows rows:

    model     the model's own eager step (Transformer.decode with a DecoderState), as the Translator runs it
    pure      the pure step, eager
    compiled  the pure step under torch.compile (inductor, frozen weights): on a CPU its bf16 linear layers
              call the same oneDNN op as the model does, its fp32 ones MKL's packed GEMM
    cpp       the same with inductor's max-autotune and its CPP GEMM templates, which generate the matmuls'
              micro-kernels (AMX or AVX-512) into the compiled step instead of calling oneDNN per layer
    graphs    (--device cuda, in place of cpp) the compiled step replayed as a CUDA graph (mode
              "reduce-overhead"): one launch a step instead of one per kernel

Each compiled variant runs in a process of its own (inductor's options are per process), taking turns with
the model's own step, and prints its median per-step time, its ratio to the model's in the same process, and
how far its logits are from the model's (the same argmax at every step, over a real sentence's steps). Only
the variants the Multi30k and base models use are written out (absolute sinusoidal or learned positions,
LayerNorm, pre- or post-norm, ReLU or GELU); others are refused. Compiling with max-autotune takes a minute
or more. Run by hand, not in CI: a measurement for the design of a compiled step in the Translator, not one.
"""

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"cpu": ("compiled", "cpp"), "cuda": ("compiled", "graphs")}


def pure_step(model, *, rows: int, capacity: int):  # type: ignore[no-untyped-def]
    """step(tokens (R,), position () long, keys, values, cross_keys, cross_values) -> logits (R, V), writing the
    new position's keys and values into keys[i], values[i] (R, H, capacity, Dh); its linear layers are plain
    nn.Linear copies of the model's (packed ones hold no parameters for inductor to freeze)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    config = model.config
    if config.positions not in ("sinusoidal", "learned") or config.norm != "layernorm" or \
            config.norm_placement not in ("pre", "post") or config.activation not in ("relu", "gelu"):
        raise SystemExit(f"bench/compiled_step.py writes out absolute positions, LayerNorm, pre/post-norm and "
                         f"ReLU/GELU only; this model has {config.positions}, {config.norm}, "
                         f"{config.norm_placement}, {config.activation}")
    heads, d_model = config.num_heads, config.d_model
    head_dim = d_model // heads
    decoder = model.decoder

    def plain(linear: nn.Module) -> nn.Linear:
        weight = linear.weight.detach()
        copy = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         dtype=weight.dtype, device=weight.device)
        copy.weight.data.copy_(weight)
        if linear.bias is not None:
            copy.bias.data.copy_(linear.bias.detach())
        return copy.requires_grad_(False)

    layers = [dict(norm_self=layer.self_attn_residual.norm, norm_cross=layer.cross_attn_residual.norm,
                   norm_ffn=layer.ffn_residual.norm, qkv=plain(layer.self_attn.qkv_proj),
                   out=plain(layer.self_attn.out_proj), q=plain(layer.cross_attn.q_proj),
                   cross_out=plain(layer.cross_attn.out_proj), w_in=plain(layer.ffn.w_in),
                   w_out=plain(layer.ffn.w_out))
              for layer in decoder.layers]
    output = plain(model.output_projection)
    embed = decoder.embed
    dtype = output.weight.dtype
    positions = (embed.positions(capacity, offset=0).reshape(capacity, d_model).to(dtype)
                 if embed.positions is not None else torch.zeros(capacity, d_model, dtype=dtype, device=output.weight.device))
    activation = F.relu if config.activation == "relu" else F.gelu
    pre = config.norm_placement == "pre"

    def residual(norm: nn.Module, x, f):  # type: ignore[no-untyped-def]
        return x + f(norm(x)) if pre else norm(x + f(x))

    def step(tokens, position, keys, values, cross_keys, cross_values):  # type: ignore[no-untyped-def]
        x = embed.tokens(tokens) * embed.scale + positions.index_select(0, position.view(1))  # (R, D)
        x = x[:, None]  # (R, 1, D)
        mask = (torch.arange(capacity, device=position.device) <= position)[None, None, None, :]  # (1, 1, 1, cap)
        for i, layer in enumerate(layers):
            def self_attention(h, i=i, layer=layer):  # type: ignore[no-untyped-def]
                q, k, v = layer["qkv"](h).view(rows, 1, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
                keys[i].index_copy_(2, position.view(1), k)
                values[i].index_copy_(2, position.view(1), v)
                out = F.scaled_dot_product_attention(q, keys[i], values[i], attn_mask=mask)
                return layer["out"](out.transpose(1, 2).reshape(rows, 1, d_model))

            def cross_attention(h, i=i, layer=layer):  # type: ignore[no-untyped-def]
                q = layer["q"](h).view(rows, 1, heads, head_dim).transpose(1, 2)
                out = F.scaled_dot_product_attention(q, cross_keys[i], cross_values[i])
                return layer["cross_out"](out.transpose(1, 2).reshape(rows, 1, d_model))

            x = residual(layer["norm_self"], x, self_attention)
            x = residual(layer["norm_cross"], x, cross_attention)
            x = residual(layer["norm_ffn"], x, lambda h, layer=layer: layer["w_out"](activation(layer["w_in"](h))))
        if decoder.final_norm is not None:
            x = decoder.final_norm(x)
        return output(x)[:, 0]

    return step


def child(args: argparse.Namespace) -> None:
    """One process: the model's own step against `args.variant`, in turns; one JSON line per row count."""
    import torch

    from seq2seq.decoding.config import SearchConfig
    from seq2seq.inference.translator import Translator
    from seq2seq.precision import DECODING_KERNEL_CACHE_CAPACITY, tune_process_memory

    tune_process_memory(kernels=DECODING_KERNEL_CACHE_CAPACITY)
    torch.set_num_threads(1)  # one worker's thread, as decode_vs_ct2's fastest configurations ran
    translator = Translator.from_checkpoint(args.checkpoint, precision=args.precision, device=args.device)
    model = translator.model
    with gzip.open(args.data / "test_2016_flickr.en.gz", "rt", encoding="utf-8") as f:
        sentence = f.readline().strip()
    # a real sentence's greedy tokens, forced step by step into both steps
    (best,) = translator.translate_nbest([sentence], SearchConfig(beam_size=1, length_penalty=0.0))
    forced = [translator.tokenizer.bos_id, *best[0].tokens][: args.steps]
    src = torch.tensor([translator.tokenizer.encode_source([sentence])[0]], device=translator.device)
    import torch._inductor.config as inductor  # (per process: torch.compile's `options` left these unapplied)

    inductor.freezing = True
    if args.variant == "cpp":
        inductor.max_autotune = True
        inductor.max_autotune_gemm_backends = "CPP,ATEN"
    with torch.no_grad():
        results = [measure(model, rows=rows, forced=forced, src=src, variant=args.variant, turns=args.turns)
                   for rows in args.rows]
    print(json.dumps(results), flush=True)


def measure(model, *, rows: int, forced: list[int], src, variant: str, turns: int) -> dict:  # type: ignore[no-untyped-def]
    """The model's own step, the pure step and the compiled one at `rows` rows, each decoding `forced` in
    turns: per-step medians (the first step, which fills the cross-attention cache, left out), the speed-ups
    over the model's step (median of the turns' ratios), and how far each one's logits are from the model's."""
    import torch

    from seq2seq.model.attention import DecoderState

    memory = model.encode(src).expand(rows, -1, -1).contiguous()  # (R, S, D)
    device = memory.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    src_mask = torch.ones(rows, memory.size(1), dtype=torch.bool, device=device)
    capacity = min(-(-len(forced) // 8) * 8, model.config.max_positions)  # (the positions table ends there)
    step = pure_step(model, rows=rows, capacity=capacity)
    cross = [layer.cross_attn.keys_values(memory) for layer in model.decoder.layers]
    cross_keys = [k.contiguous() for k, _ in cross]
    cross_values = [v.contiguous() for _, v in cross]
    shape = (rows, model.config.num_heads, capacity, model.config.d_model // model.config.num_heads)

    # One cache for every run, zeroed at its start: a CUDA graph replays on the addresses it was recorded with,
    # and writes into its inputs only where they are marked static
    keys = [torch.zeros(shape, dtype=memory.dtype, device=device) for _ in model.decoder.layers]
    values = [torch.zeros(shape, dtype=memory.dtype, device=device) for _ in model.decoder.layers]
    if variant == "graphs":
        for tensor in (*keys, *values, *cross_keys, *cross_values):
            torch._dynamo.mark_static_address(tensor)

    def run_pure(fn):  # type: ignore[no-untyped-def]
        for tensor in (*keys, *values):
            tensor.zero_()
        logits, times = [], []
        for position, token in enumerate(forced):
            sync()
            start = time.perf_counter()
            out = fn(torch.full((rows,), token, device=device), torch.tensor(position, device=device), keys, values,
                     cross_keys, cross_values)
            sync()
            times.append(time.perf_counter() - start)
            logits.append(out.clone())  # (a CUDA graph's next replay overwrites its output)
        return torch.stack(logits).float(), times[1:]  # (steps, R, V)

    def run_model():  # type: ignore[no-untyped-def]
        state = DecoderState()
        logits, times = [], []
        for token in forced:
            sync()
            start = time.perf_counter()
            logits.append(model.decode(torch.full((rows, 1), token, device=device), memory, src_mask, state=state)[:, -1])
            sync()
            times.append(time.perf_counter() - start)
        return torch.stack(logits).float(), times[1:]

    compiled = torch.compile(step, mode="reduce-overhead" if variant == "graphs" else None)
    started = time.perf_counter()
    run_pure(compiled)
    compile_seconds = time.perf_counter() - started
    reference, _ = run_model()
    runs = {"model": run_model, "pure": lambda: run_pure(step), variant: lambda: run_pure(compiled)}
    per_step: dict[str, list[float]] = {name: [] for name in runs}
    logits = {}
    for _ in range(turns):
        for name, run in runs.items():
            logits[name], times = run()
            per_step[name].append(statistics.median(times))
    scale = reference.abs().max().item()
    return {
        "rows": rows, "steps": len(forced), "compile_s": round(compile_seconds, 1),
        **{f"{name}_ms": round(statistics.median(times) * 1e3, 3) for name, times in per_step.items()},
        **{f"{name}_x": round(statistics.median(m / t for m, t in zip(per_step["model"], times, strict=True)), 2)
           for name, times in per_step.items() if name != "model"},
        **{f"{name}_error": round((out - reference).abs().max().item() / scale, 5) for name, out in logits.items()},
        **{f"{name}_argmax": bool(torch.equal(out.argmax(-1), reference.argmax(-1))) for name, out in logits.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared/data/multi30k")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (variants compiled and graphs)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5], help="decoder rows, each a copy of one sentence (1: greedy's one sentence; 5: as many rows as beam 5's, "
                        "without its reorders)")
    parser.add_argument("--steps", type=int, default=24, help="positions decoded (a real sentence's, at most)")
    parser.add_argument("--turns", type=int, default=9, help="turns of model / pure / compiled in each process")
    parser.add_argument("--variant", choices=[v for vs in VARIANTS.values() for v in vs], help=argparse.SUPPRESS)  # a child process's
    args = parser.parse_args()
    if args.variant:
        child(args)
        return
    import torch

    from seq2seq.precision import device_name

    print(f"# {device_name(torch.device(args.device))}; {args.checkpoint}, {args.precision}, one CPU thread, "
          f"per-step medians of {args.turns} turns", flush=True)
    print(f"{'variant':9s} {'rows':>4s} {'model ms':>9s} {'pure ms':>8s} {'compiled ms':>12s} "
          f"{'speed-up':>9s} {'pure x':>7s} {'compile s':>10s} {'max error':>10s} {'same argmax':>12s}")
    for variant in VARIANTS["cuda" if args.device.startswith("cuda") else "cpu"]:
        command = [sys.executable, __file__, "--checkpoint", str(args.checkpoint), "--data", str(args.data),
                   "--precision", args.precision, "--device", args.device, "--steps", str(args.steps), "--turns", str(args.turns),
                   "--variant", variant, "--rows", *map(str, args.rows)]
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            raise SystemExit(f"the {variant} process failed:\n{done.stderr[-3000:]}")
        for line in dict.fromkeys(line for line in done.stderr.splitlines() if "skipping cudagraphs" in line):
            print(f"# {variant}: {line.strip()}", flush=True)  # why the graphs did not apply, where they did not
        for row in json.loads(done.stdout.strip().splitlines()[-1]):
            print(f"{variant:9s} {row['rows']:4d} {row['model_ms']:9.3f} {row['pure_ms']:8.3f} "
                  f"{row[variant + '_ms']:12.3f} {row[variant + '_x']:8.2f}x {row['pure_x']:6.2f}x "
                  f"{row['compile_s']:10.1f} {row[variant + '_error']:10.2e} "
                  f"{str(row[variant + '_argmax'] and row['pure_argmax']):>12s}", flush=True)
    print("# speed-up: the model's own step time over the compiled one, median of the turns' ratios; max error: "
          "the largest logit difference from the model's step, over its largest logit", flush=True)


if __name__ == "__main__":
    main()
