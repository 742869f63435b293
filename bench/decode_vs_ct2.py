"""Our decoder against CTranslate2 (fp32 and int8) on the same exported weights and the same cores, in one run.

    python bench/decode_vs_ct2.py --checkpoint checkpoints/multi30k/best.ckpt [--beams 5 1] [--threads 1 2]
    python bench/decode_vs_ct2.py --base [--sentences 300]     # a random transformer-base, 32k vocabulary

Translates the Multi30k test set (test_2016_flickr, in the checkpoint's source language) with our
Translator, in the precision `auto` picks on this machine and in int8, and with CTranslate2
running the same checkpoint exported by seq2seq.export, fp32 and int8. Equal work for all: text in
and text out (CTranslate2 takes pieces: its sources are tokenised and its outputs detokenised with the
same sentencepiece model inside its timed work, as our Translator does inside its own), the
same sentences, beam, length limit (a fixed number of tokens, as CTranslate2 has no per-sentence
a * length + b), ranking by raw log-probability (length penalty 0: CTranslate2's normalisation is
not GNMT's), PAD and BOS never generated, batches sorted by length, and no scores unless --scores asks both for them (CTranslate2's translate_batch returns none by
default, and its greedy search then computes no log-softmax; ours with SearchConfig(scores=False), as its
translate() and CLI do, skips the same normaliser; beam search computes it in both). Equal hardware:
for each core count in --threads every engine runs in every configuration that uses those cores (ours:
workers x threads per worker; CTranslate2: inter_threads x intra_threads) and with every batch size it is
offered (ours: --ours-batches, in source tokens; CTranslate2: --ct2-batches, in tokens or in examples, its
`max_batch_size` and `batch_type`), and its fastest counts: no one batch size is the best for all. For each core
count and beam every configuration runs once, then each engine's fastest takes turns with the others' --repeats
times, and the fastest run of each counts, so a burst of load hits all alike.

--base builds a random-weight transformer-base (d_model 512, 8 heads, d_ff 2048, 6+6 layers) with a
32,000-piece BPE model trained on Multi30k's four languages (~1 min, kept in --cache); random
weights rarely choose EOS, so every output runs --max-len (20) steps, as the issue's table did.

Prints per engine its fastest configuration, target tokens per second (tokens + EOS of the best
hypotheses), the ratio to the fastest CTranslate2, how far the process's resident memory rose during
its run (peak RSS over what was there before), the median and 95th percentile latency of 200 one-sentence calls
(the interactive case: the best over the thread counts per worker), and how many outputs equal ours in fp32 token
for token. Ours: as a user gets it (the default: the compiled decoder kept for the model on this machine where
`python -m seq2seq.export --to compiled` built it, else eager), and eager in the auto precision and int8. Run by
hand, not in CI.
"""

import argparse
import gzip
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from train_throughput import time_alternating

from seq2seq.checkpoint import CHECKPOINT_KEY, inference_entry, save_atomic
from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.translator import Translator
from seq2seq.interop.export import export_ctranslate2
from seq2seq.model import Transformer, TransformerConfig
from seq2seq.precision import DECODING_KERNEL_CACHE_CAPACITY, tune_process_memory
from seq2seq.text.tokenizer import Tokenizer

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
    parser.add_argument("--ours-batches", type=int, nargs="+", default=[8192, 2048, 512],
                        help="our batch sizes swept, in source tokens (rows x longest source)")
    parser.add_argument("--ct2-batches", nargs="+", default=["tokens:8192", "tokens:1024", "examples:64",
                                                             "examples:16"],
                        help="CTranslate2's batch sizes swept, as batch_type:max_batch_size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true",
                        help="also ours in the auto precision and in int8 with its decoding steps compiled "
                             "(Translator(compiled=True): the auto precision's package built and kept where none is; "
                             "int8 compiles on each configuration's first run, which the fastest of --repeats leaves out)")
    parser.add_argument("--scores", action="store_true",
                        help="both engines compute each translation's score (CTranslate2: return_scores)")
    args = parser.parse_args()
    if args.base == bool(args.checkpoint):
        parser.error("give --checkpoint or --base")
    try:
        args.ct2_batches = [(kind, int(size)) for kind, size in (spec.split(":") for spec in args.ct2_batches)]
    except ValueError:
        parser.error("--ct2-batches takes batch_type:max_batch_size, e.g. tokens:1024 examples:64")
    if any(kind not in ("tokens", "examples") for kind, _ in args.ct2_batches):
        parser.error("--ct2-batches: batch_type is tokens or examples")
    if args.base:
        args.checkpoint = str(base_checkpoint(Path(args.cache), Path(args.data)))
    args.max_len = args.max_len or (20 if args.base else 100)

    translator = Translator.from_checkpoint(args.checkpoint, precision="fp32")
    max_len = min(args.max_len, translator.model.config.max_positions - 1)
    with gzip.open(Path(args.data) / f"test_2016_flickr.{translator.src_lang}.gz", "rt", encoding="utf-8") as f:
        sources = f.read().split("\n")[: args.sentences]
    sources = [s for s in sources if s.strip()]
    with tempfile.TemporaryDirectory(prefix="decode_vs_ct2.") as scratch_dir:
        run(args, translator, sources, max_len, Path(scratch_dir))


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


def configurations(cores: int) -> list[tuple[int, int]]:
    """(workers, threads each) that use `cores` cores: one worker on all of them, one per core, and
    the splits between."""
    return [(workers, cores // workers) for workers in range(1, cores + 1) if cores % workers == 0]


def peak_rss_during(work: Callable[[], None]) -> float:
    """MiB the process's resident memory rose to above where it was, while `work` ran (Linux: the
    high-water mark is reset first)."""
    status = Path("/proc/self/status")
    if not status.exists():
        work()
        return float("nan")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS

    def kib(field: str) -> int:
        return next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith(field))

    before = kib("VmRSS:")
    work()
    return (kib("VmHWM:") - before) / 1024


def run(args: argparse.Namespace, translator: Translator, sources: list[str], max_len: int, scratch: Path) -> None:
    import ctranslate2

    folders = {"fp32": export_ctranslate2(args.checkpoint, scratch / "fp32"),
               "int8": export_ctranslate2(args.checkpoint, scratch / "int8", quantization="int8")}
    auto = Translator.from_checkpoint(args.checkpoint).precision  # what a user gets on this machine
    precisions = list(dict.fromkeys([auto, "int8", *(["fp32"] if auto != "fp32" else [])]))
    print(f"{cpu_model()}; torch {torch.__version__}, ctranslate2 {ctranslate2.__version__}; "
          f"{len(sources)} sentences, max {max_len} tokens; ours' batches swept {args.ours_batches} source tokens, "
          f"CTranslate2's {' '.join(f'{k}:{n}' for k, n in args.ct2_batches)}; "
          f"{'random transformer-base' if args.base else args.checkpoint}; auto chose {auto}; "
          f"scores {'on in both' if args.scores else 'off in both (CTranslate2 default)'}")
    print("| cores | search | engine | best configuration and batch | tgt tok/s | vs best CTranslate2 | peak RSS rise | "
          "1-sentence p50 / p95 | identical to ours fp32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cores in args.threads:
        engines: dict[str, dict[tuple[int, int], Engine]] = {}
        engines[f"ours {auto} (default)"] = {(w, t): Ours(Translator.from_checkpoint(
            args.checkpoint, workers=w, threads=t)) for w, t in configurations(cores)}  # (what a user gets)
        for precision in precisions:
            engines[f"ours {precision} eager"] = {(w, t): Ours(Translator.from_checkpoint(
                args.checkpoint, precision=precision, workers=w, threads=t, compiled=False))
                for w, t in configurations(cores)}
        for precision in dict.fromkeys([auto, "int8"]) if args.compile else ():
            engines[f"ours {precision} compiled"] = {(w, t): Ours(Translator.from_checkpoint(
                args.checkpoint, precision=precision, workers=w, threads=t, compiled=True))
                for w, t in configurations(cores)}
        for compute, folder in folders.items():
            engines[f"ct2 {compute}"] = {(w, t): Theirs(ctranslate2.Translator(str(folder), device="cpu",
                                                                               intra_threads=t, inter_threads=w),
                                                        translator.tokenizer)
                                         for w, t in configurations(cores)}
        batches = {name: [("tokens", n) for n in args.ours_batches] if name.startswith("ours") else args.ct2_batches
                   for name in engines}
        for beam in args.beams:
            compare(engines, sources, beam=beam, cores=cores, max_len=max_len, batches=batches,
                    repeats=args.repeats, scores=args.scores)


Batch = tuple[str, int]  # (batch_type, max_batch_size): ("tokens", 8192), ("examples", 64)
Config = tuple[int, int, Batch]  # workers (inter_threads), threads each (intra_threads), batch


class Ours:
    def __init__(self, translator: Translator) -> None:
        self.translator = translator

    def translate(self, sources: list[str], search: SearchConfig, *, batch: Batch) -> list[list[int]]:
        """Text in, text out (the Translator tokenises and detokenises): each best translation's token ids."""
        return [hyps[0].tokens for hyps in self.translator.translate_nbest(sources, search, max_tokens=batch[1])]


class Theirs:
    def __init__(self, translator: Any, tokenizer: Tokenizer) -> None:
        self.translator = translator
        self.tokenizer = tokenizer
        self.pieces = tokenizer.pieces()
        self.index = {piece: i for i, piece in enumerate(self.pieces)}

    def translate(self, sources: list[str], search: SearchConfig, *, batch: Batch) -> list[list[int]]:
        """Text in, text out, as ours: the sources tokenised with the same sentencepiece model (CTranslate2 takes
        pieces) and the outputs detokenised, inside the timed work; each best translation's token ids."""
        pieces = [[self.pieces[i] for i in ids] for ids in self.tokenizer.encode_source([s.strip() for s in sources])]
        results = self.translator.translate_batch(
            pieces, beam_size=search.beam_size, length_penalty=0.0, max_decoding_length=int(search.max_len_b) + 1,
            max_batch_size=batch[1], batch_type=batch[0], suppress_sequences=[["<pad>"], ["<s>"]],
            return_scores=search.scores)
        # CTranslate2 does not force EOS at the limit: a hypothesis that reaches it has max_len + 1
        # tokens where ours has max_len and EOS; count and compare the same max_len.
        ids = [[self.index[p] for p in r.hypotheses[0] if p != "</s>"][: int(search.max_len_b)] for r in results]
        self.tokenizer.decode(ids)  # (the text a user gets, as our Translator makes it)
        return ids


Engine = Ours | Theirs


def compare(engines: dict[str, dict[tuple[int, int], Engine]], sources: list[str], *, beam: int, cores: int,
            max_len: int, batches: dict[str, list[Batch]], repeats: int, scores: bool) -> None:
    """One row per engine, in its fastest configuration (workers x threads for ours, inter x intra threads
    for CTranslate2, on `cores` cores) and batch size: every configuration runs once, then each engine's fastest
    takes turns with the others' `repeats` times, and the fastest run counts."""
    search = SearchConfig(beam_size=beam, length_penalty=0.0, max_len_a=0.0, max_len_b=max_len, scores=scores)
    outputs: dict[tuple[str, Config], list[list[int]]] = {}
    rss: dict[tuple[str, Config], float] = {}

    def step(name: str, config: Config) -> Callable[[object], None]:
        def run(_: object) -> None:
            def work() -> None:
                outputs[name, config] = engines[name][config[:2]].translate(sources, search, batch=config[2])
            rss[name, config] = max(rss.get((name, config), 0.0), peak_rss_during(work))
        return run

    for name in engines:  # warm-up: first calls allocate, pick kernels and start threads
        for engine in engines[name].values():
            engine.translate(sources[:64], search, batch=batches[name][0])
    configs = {name: [(w, t, batch) for w, t in engines[name] for batch in batches[name]] for name in engines}
    tokens = {}

    def speed(times: dict[str, list[float]], name: str, config: Config) -> float:
        tokens[name, config] = sum(len(t) + 1 for t in outputs[name, config])
        return tokens[name, config] / min(times[f"{name} {config}"])

    swept = time_alternating({f"{name} {config}": step(name, config) for name in engines
                              for config in configs[name]}, [None])
    best = {name: max(configs[name], key=lambda config, name=name: speed(swept, name, config)) for name in engines}
    times = time_alternating({f"{name} {best[name]}": step(name, best[name]) for name in engines}, [None] * repeats)
    rate = {name: speed(times, name, best[name]) for name in engines}
    fastest = max(rate[name] for name in engines if name.startswith("ct2"))
    reference = next((name for name in engines if name.startswith("ours fp32")), next(iter(engines)))
    label = "greedy" if beam == 1 else f"beam {beam}"
    for name in engines:
        config = best[name]
        same = sum(a == b for a, b in zip(outputs[name, config], outputs[reference, best[reference]], strict=True))
        kind = "workers x threads" if name.startswith("ours") else "inter x intra"
        p50, p95, threads = one_sentence_latency(engines[name], sources, search)
        print(f"| {cores} | {label} | {name} | {config[0]} x {config[1]} ({kind}), {config[2][1]} {config[2][0]} | "
              f"{rate[name]:,.0f} | {rate[name] / fastest:.2f}x | {rss[name, config]:.0f} MiB | {p50 * 1000:.1f} / "
              f"{p95 * 1000:.1f} ms ({threads} thread{'s' if threads > 1 else ''}) | {same}/{len(sources)} |",
              flush=True)


def one_sentence_latency(configs: dict[tuple[int, int], Engine], sources: list[str], search: SearchConfig,
                         calls: int = 200) -> tuple[float, float, int]:
    """The median and 95th percentile seconds of `calls` one-sentence calls (the interactive case, a server's lone
    request), and the threads per worker that gave them: each distinct thread count is tried (one sentence is one
    batch, so more workers cannot help), the lowest median counts."""
    best: tuple[float, float, int] = (float("inf"), float("inf"), 0)
    for threads in sorted({config[1] for config in configs}):
        engine = configs[next(config for config in configs if config[1] == threads)]
        seconds = []
        for i in range(calls):
            start = time.perf_counter()
            engine.translate(sources[i % len(sources) : i % len(sources) + 1], search, batch=("tokens", 8192))
            seconds.append(time.perf_counter() - start)
        seconds.sort()
        best = min(best, (seconds[len(seconds) // 2], seconds[int(len(seconds) * 0.95)], threads))
    return best


if __name__ == "__main__":
    tune_process_memory(kernels=DECODING_KERNEL_CACHE_CAPACITY)  # as the translate CLI does (CTranslate2: its own)
    sys.exit(main())
