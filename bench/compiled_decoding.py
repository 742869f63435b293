"""The Translator's compiled decoding step (`--compile`) against its eager one, paired in one process.

    python bench/compiled_decoding.py --checkpoint checkpoints/multi30k-ende/best.ckpt [--precision bf16] [--sentences 200]

Two Translators of one checkpoint, one thread: eager and `compiled=True`. The compiled one first compiles every
kind of step a search makes (`compile_decoding`; timed and printed: tens of seconds each with nothing in
inductor's disk cache). Then, for each beam, the test
sentences one at a time, the two Translators in turns (which goes first alternates), and per engine the median
seconds a sentence, the median of the per-sentence ratios, and how many outputs are the same; then all the
sentences at once, eager / compiled / compiled / eager. Run by hand, not in CI (docs/results/compiled-decoding.md).
"""

import argparse
import gzip
import statistics
import time
from pathlib import Path

import torch

from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.translator import Translator
from seq2seq.precision import DECODING_KERNEL_CACHE_CAPACITY, device_name, tune_process_memory

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--sentences", type=int, default=200)
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared/data/multi30k")
    args = parser.parse_args()
    tune_process_memory(kernels=DECODING_KERNEL_CACHE_CAPACITY)  # as the translate CLI does
    torch.set_num_threads(1)
    eager = Translator.from_checkpoint(args.checkpoint, precision=args.precision)
    with gzip.open(args.data / f"test_2016_flickr.{eager.src_lang}.gz", "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f][: args.sentences]
    compiled = Translator.from_checkpoint(args.checkpoint, precision=args.precision, compiled=True)
    start = time.perf_counter()
    compiled.compile_decoding()
    print(f"# {device_name(torch.device('cpu'))}; {args.checkpoint}, {args.precision}, one thread; "
          f"compiling: {time.perf_counter() - start:.0f} s", flush=True)
    print("| search | one sentence p50, eager -> compiled | paired speed-up | same outputs | "
          f"all {len(lines)} at once, eager / compiled (s) |")
    print("|---|---|---|---|---|")
    for beam in args.beams:
        search = SearchConfig(beam_size=beam)
        seconds: dict[str, list[float]] = {"eager": [], "compiled": []}
        same = 0
        for i, line in enumerate(lines):
            outputs = {}
            for name in ("eager", "compiled") if i % 2 else ("compiled", "eager"):
                translator = eager if name == "eager" else compiled
                began = time.perf_counter()
                outputs[name] = translator.translate([line], search)[0]
                seconds[name].append(time.perf_counter() - began)
            same += outputs["eager"] == outputs["compiled"]
        bulk: dict[str, list[float]] = {"eager": [], "compiled": []}
        for name in ("eager", "compiled", "compiled", "eager"):
            began = time.perf_counter()
            (eager if name == "eager" else compiled).translate(lines, search)
            bulk[name].append(time.perf_counter() - began)
        ratio = statistics.median(e / c for e, c in zip(seconds["eager"], seconds["compiled"], strict=True))
        print(f"| {'greedy' if beam == 1 else f'beam {beam}'} | {statistics.median(seconds['eager']) * 1e3:.1f} -> "
              f"{statistics.median(seconds['compiled']) * 1e3:.1f} ms | {ratio:.2f}x | {same}/{len(lines)} | "
              f"{min(bulk['eager']):.2f} / {min(bulk['compiled']):.2f} ({min(bulk['eager']) / min(bulk['compiled']):.2f}x) |",
              flush=True)


if __name__ == "__main__":
    main()
