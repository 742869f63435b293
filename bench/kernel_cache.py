"""What oneDNN's kernel compiling costs a translation run, before and after rounding row counts.

    python bench/kernel_cache.py --checkpoint checkpoints/multi30k-ende/best.ckpt [--beam 1] [--slices 5]

oneDNN compiles a kernel for every matmul shape it meets, and a decoding batch's row count changes as its
sentences finish. Four configurations, each in processes of its own (the kernel cache's capacity is read
once a process), taking turns --pairs times:

    before  every row count as it comes, a cache of precision.KERNEL_CACHE_CAPACITY (64) kernels
    padded  row counts rounded by numerics.padded_rows, the cache of 64
    cache   every row count as it comes, a cache of DECODING_KERNEL_CACHE_CAPACITY (512)
    after   both, as the translate CLI, score CLI and server now run

Each process translates --slices slices of --sentences Multi30k training sentences, a different slice each
time, as a file's batches differ (the first slice also pays for compiling what every later one reuses),
with ONEDNN_VERBOSE=profile_create, which prints each kernel oneDNN compiles and the milliseconds it took.
Prints per configuration the seconds of the slices after the first, the kernels compiled (every oneDNN
primitive made: the linear layers', attention's batched matmuls', weight reorders) and the milliseconds
spent compiling them there, and the peak RSS; then each one's speed-up over `before`, median of the
processes' ratios in turn and fastest process against fastest. (profile_create prints a line for every
primitive made, cache hits included, inside the timed region: alike for all.) Run by hand, not in CI.
"""

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGURATIONS = ("before", "padded", "cache", "after")  # (padded rows, 512 kernels): no/no, yes/no, no/yes, yes/yes


def child(args: argparse.Namespace) -> None:
    """One process: translate the slices and print one JSON line of seconds per slice and peak RSS."""
    import torch

    from seq2seq.decoding.config import SearchConfig
    from seq2seq.inference.translator import Translator
    from seq2seq.model import numerics

    if args.child in ("before", "cache"):
        numerics.padded_rows = lambda rows: rows  # type: ignore[assignment]
    torch.set_num_threads(args.threads)
    translator = Translator.from_checkpoint(args.checkpoint, precision=args.precision, workers=1,
                                            threads=args.threads)
    with gzip.open(args.data, "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    search = SearchConfig(beam_size=args.beam, length_penalty=0.0 if args.beam == 1 else 1.0, scores=False)
    seconds = []
    for i in range(args.slices):
        texts = lines[i * args.sentences : (i + 1) * args.sentences]
        print(f"SLICE {i}", flush=True)
        start = time.perf_counter()
        translator.translate(texts, search)
        seconds.append(time.perf_counter() - start)
    status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
    peak = next((int(line.split()[1]) // 1024 for line in status.splitlines() if line.startswith("VmHWM")), 0)
    print("RESULT " + json.dumps({"seconds": seconds, "peak_rss_mib": peak, "precision": translator.precision}),
          flush=True)


def run(configuration: str, args: argparse.Namespace) -> dict:
    """A child process of `configuration`: its seconds per slice, and the kernels compiled (and their ms) in
    the slices after the first, read from oneDNN's verbose lines."""
    from seq2seq.precision import DECODING_KERNEL_CACHE_CAPACITY, KERNEL_CACHE_CAPACITY

    capacity = DECODING_KERNEL_CACHE_CAPACITY if configuration in ("cache", "after") else KERNEL_CACHE_CAPACITY
    env = dict(os.environ, ONEDNN_PRIMITIVE_CACHE_CAPACITY=str(capacity), ONEDNN_VERBOSE="profile_create")
    command = [sys.executable, __file__, "--child", configuration, "--checkpoint", args.checkpoint,
               "--data", args.data, "--beam", str(args.beam), "--slices", str(args.slices),
               "--sentences", str(args.sentences), "--threads", str(args.threads), "--precision", args.precision]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the {configuration} process failed:\n{done.stderr[-3000:]}")
    out = done.stdout
    slice_, kernels, compile_ms, result = -1, 0, 0.0, None
    for line in out.splitlines():
        if line.startswith("SLICE "):
            slice_ = int(line.split()[1])
        elif line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
        elif "create:cache_miss" in line and slice_ >= 1:
            kernels += 1
            compile_ms += float(line.rsplit(",", 1)[1])
    assert result is not None, out[-2000:]
    return {**result, "kernels": kernels, "compile_ms": compile_ms, "later": sum(result["seconds"][1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", default=str(REPO.parent / "shared/data/multi30k/train.en.gz"),
                        help="gzipped source sentences, in the checkpoint's source language")
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--slices", type=int, default=5)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--pairs", type=int, default=3, help="processes of each configuration, taking turns")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--child", choices=CONFIGURATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGURATIONS}
    for _ in range(args.pairs):
        for name in CONFIGURATIONS:
            runs[name].append(run(name, args))
    precision = runs["after"][0]["precision"]
    print(f"{args.checkpoint}, {precision}, beam {args.beam}, {args.threads} thread(s); {args.slices} slices of "
          f"{args.sentences} sentences a process, the first left out; {args.pairs} processes each, in turns")
    print("| configuration | seconds (each process) | kernels compiled | compiling ms | peak RSS |")
    print("|---|---|---|---|---|")
    for name in CONFIGURATIONS:
        r = runs[name]
        seconds = ", ".join(f"{x['later']:.2f}" for x in r)
        print(f"| {name} | {seconds} | "
              f"{statistics.median(x['kernels'] for x in r):.0f} | {statistics.median(x['compile_ms'] for x in r):.0f} | "
              f"{statistics.median(x['peak_rss_mib'] for x in r):.0f} MiB |")
    before = runs["before"]
    for name in CONFIGURATIONS[1:]:
        ratios = [b["later"] / a["later"] for a, b in zip(runs[name], before, strict=True)]
        fastest = min(x["later"] for x in before) / min(x["later"] for x in runs[name])
        print(f"{name}: {statistics.median(ratios):.2f}x before's speed (median of the turns), fastest process "
              f"against fastest {fastest:.2f}x")


if __name__ == "__main__":
    main()
