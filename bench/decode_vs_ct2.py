"""Our decoder against CTranslate2 (fp32 and int8) on the same exported weights, in one run.

    python bench/decode_vs_ct2.py --checkpoint checkpoints/multi30k/best.ckpt [--beams 5 1] [--threads 1 2]
    python bench/decode_vs_ct2.py --base [--sentences 300]     # a random transformer-base, 32k vocabulary

Translates the Multi30k test set (test_2016_flickr, in the checkpoint's source language) with our
Translator, in the precision `auto` picks on this machine and in int8, and with CTranslate2
running the same checkpoint exported by seq2seq.export, fp32 and int8. Equal work for all: the
same sentences, beam, length limit (a fixed number of tokens, as CTranslate2 has no per-sentence
a * length + b), ranking by raw log-probability (length penalty 0: CTranslate2's normalisation is
not GNMT's), PAD and BOS never generated, batches of at most --max-tokens source tokens sorted by
length. For each thread count and beam the engines take turns, --repeats times, and the fastest run
of each counts, so a burst of load hits all alike.

--base builds a random-weight transformer-base (d_model 512, 8 heads, d_ff 2048, 6+6 layers) with a
32,000-piece BPE model trained on Multi30k's four languages (~1 min, kept in --cache); random
weights rarely choose EOS, so every output runs --max-len (20) steps, as the issue's table did.

Prints target tokens per second (tokens + EOS of the best hypotheses), each engine's ratio to the
fastest CTranslate2, and how many outputs equal ours (fp32) token for token. Run by hand, not in CI.
"""

import argparse
import gzip
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from train_throughput import time_alternating

from seq2seq.checkpoint import CHECKPOINT_KEY, inference_entry, save_atomic
from seq2seq.export import export_ctranslate2
from seq2seq.model import Transformer, TransformerConfig
from seq2seq.precision import tune_process_memory
from seq2seq.search import SearchConfig
from seq2seq.tokenizer import Tokenizer
from seq2seq.translator import Translator

REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a trained checkpoint (or --base)")
    parser.add_argument("--base", action="store_true", help="a random-weight transformer-base instead")
    parser.add_argument("--cache", default="/tmp/seq2seq-bench", help="--base: where its checkpoint is kept")
    parser.add_argument("--data", default=str(REPO.parent / "shared/data/multi30k"))
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--beams", type=int, nargs="+", default=[5, 1])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-len", type=int, help="output tokens at most, EOS excluded (default: 100; --base: 20)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="source tokens per batch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.base == bool(args.checkpoint):
        parser.error("give --checkpoint or --base")
    if args.base:
        args.checkpoint = str(base_checkpoint(Path(args.cache), Path(args.data)))
    args.max_len = args.max_len or (20 if args.base else 100)

    translator = Translator.from_checkpoint(args.checkpoint, precision="fp32")
    max_len = min(args.max_len, translator.model.config.max_positions - 1)
    with gzip.open(Path(args.data) / f"test_2016_flickr.{translator.src_lang}.gz", "rt", encoding="utf-8") as f:
        sources = f.read().split("\n")[: args.sentences]
    sources = [s for s in sources if s.strip()]
    pieces = translator.tokenizer.pieces()
    source_pieces = [[pieces[i] for i in ids] for ids in translator.tokenizer.encode_source(sources)]
    with tempfile.TemporaryDirectory(prefix="decode_vs_ct2.") as scratch_dir:
        run(args, translator, sources, source_pieces, max_len, Path(scratch_dir))


def base_checkpoint(cache: Path, data: Path) -> Path:
    """A random transformer-base with a 32k joint BPE over Multi30k de/en/fr/cs, written once."""
    path = cache / "random-base-32k.ckpt"
    if path.is_file():
        return path
    texts = []
    for lang in ("de", "en", "fr", "cs"):
        with gzip.open(data / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            texts += f.read().split("\n")
    tokenizer = Tokenizer.train(texts, vocab_size=32000)
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=tokenizer.vocab_size, d_model=512, num_heads=8, d_ff=2048,
                               num_encoder_layers=6, num_decoder_layers=6, dropout=0.0, max_positions=256)
    model = Transformer(config)
    state_dict = {f"model.{name}": value for name, value in model.state_dict().items()}
    entry = inference_entry(state_dict=state_dict, config=config, tokenizer=tokenizer.to_bytes(), src_lang="de",
                            tgt_lang="en")
    cache.mkdir(parents=True, exist_ok=True)
    save_atomic({"state_dict": state_dict, CHECKPOINT_KEY: entry}, path)
    return path


def run(args: argparse.Namespace, translator: Translator, sources: list[str], source_pieces: list[list[str]],
        max_len: int, scratch: Path) -> None:
    import ctranslate2

    folders = {"ct2 fp32": export_ctranslate2(args.checkpoint, scratch / "fp32"),
               "ct2 int8": export_ctranslate2(args.checkpoint, scratch / "int8", quantization="int8")}
    ours = {"ours " + translator.precision: translator}  # fp32: the reference the others are compared with
    auto = Translator.from_checkpoint(args.checkpoint)  # what a user gets on this machine
    if auto.precision != translator.precision:
        ours[f"ours {auto.precision} (auto)"] = auto
    else:
        ours = {f"ours {translator.precision} (auto)": translator}
    ours["ours int8"] = Translator.from_checkpoint(args.checkpoint, precision="int8")
    print(f"{cpu_model()}; torch {torch.__version__}, ctranslate2 {ctranslate2.__version__}; "
          f"{len(sources)} sentences, max {max_len} tokens, batches <= {args.max_tokens} source tokens; "
          f"{'random transformer-base' if args.base else args.checkpoint}; auto chose {auto.precision}")
    print("| threads | search | engine | tgt tok/s | vs fastest CTranslate2 | identical to ours fp32 |")
    print("|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        engines = {name: ctranslate2.Translator(str(folder), device="cpu", intra_threads=threads, inter_threads=1)
                   for name, folder in folders.items()}
        for beam in args.beams:
            compare(ours, engines, sources, source_pieces, beam=beam, threads=threads, max_len=max_len,
                    max_tokens=args.max_tokens, repeats=args.repeats)


def compare(ours: dict[str, Translator], engines: dict, sources: list[str], source_pieces: list[list[str]], *,
            beam: int, threads: int, max_len: int, max_tokens: int, repeats: int) -> None:
    """One table row per engine: the engines take turns `repeats` times; the fastest run of each counts."""
    search = SearchConfig(beam_size=beam, length_penalty=0.0, max_len_a=0.0, max_len_b=max_len)
    reference = next(iter(ours))
    tokenizer = ours[reference].tokenizer
    index = {piece: i for i, piece in enumerate(tokenizer.pieces())}
    outputs: dict[str, list[list[int]]] = {}

    def translate(name: str):
        def run(_: object) -> None:
            nbest = ours[name].translate_nbest(sources, search, max_tokens=max_tokens)
            outputs[name] = [hyps[0].tokens for hyps in nbest]
        return run

    def ct2(name: str):
        def run(_: object) -> None:
            results = engines[name].translate_batch(
                source_pieces, beam_size=beam, length_penalty=0.0, max_decoding_length=max_len + 1,
                max_batch_size=max_tokens, batch_type="tokens", suppress_sequences=[["<pad>"], ["<s>"]])
            # CTranslate2 does not force EOS at the limit: a hypothesis that reaches it has max_len + 1
            # tokens where ours has max_len and EOS; count and compare the same max_len.
            outputs[name] = [[index[p] for p in r.hypotheses[0] if p != "</s>"][:max_len] for r in results]
        return run

    steps = {**{name: translate(name) for name in ours}, **{name: ct2(name) for name in engines}}
    times = time_alternating(steps, [None] * repeats)
    speed = {name: sum(len(tokens) + 1 for tokens in outputs[name]) / min(seconds) for name, seconds in times.items()}
    fastest = max(speed["ct2 fp32"], speed["ct2 int8"])
    for name in steps:
        same = sum(a == b for a, b in zip(outputs[name], outputs[reference], strict=True))
        label = "greedy" if beam == 1 else f"beam {beam}"
        print(f"| {threads} | {label} | {name} | {speed[name]:,.0f} | {speed[name] / fastest:.2f}x | "
              f"{same}/{len(sources)} |", flush=True)


if __name__ == "__main__":
    tune_process_memory()  # as the translate CLI does (CTranslate2 has its own allocator cache)
    sys.exit(main())
