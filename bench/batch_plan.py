"""The training batch plan of one epoch: time to make it and memory to hold it, against the plan as
lists of Python ints made pair by pair (the baseline, run in the same process).

    python bench/batch_plan.py [--pairs 2900000] [--max-tokens 4096]

Sizes are drawn like Multi30k's (a pair's padded positions: mostly 10-40, a long tail), as many as
--pairs. Prints seconds and bytes per pair of each, and the ratios.
"""

import argparse
import math
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_batching import reference_batches  # noqa: E402  # the pair-by-pair plan, kept as the tests' reference

from seq2seq.training.batching import TokenBatchSampler  # noqa: E402


def measure(make) -> tuple[float, int, object]:  # noqa: ANN001
    """Seconds to make the plan (untraced: tracing slows Python's allocations), then the bytes it holds."""
    start = time.perf_counter()
    make()
    seconds = time.perf_counter() - start
    tracemalloc.start()
    plan = make()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return seconds, held, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2_900_000)
    parser.add_argument("--max-tokens", type=int, default=4096)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    sizes = np.clip(np.round(rng.lognormal(math.log(20), 0.45, args.pairs)), 2, 256).astype(np.int64)
    options = {"max_tokens": args.max_tokens, "shuffle": True, "shuffle_window": 100_000, "seed": 0}

    def ours() -> object:
        sampler = TokenBatchSampler(sizes, **options)
        return sampler._plan()

    def baseline() -> object:
        return reference_batches(sizes, epoch=0, rank=0, world_size=1, **options)

    ours_s, ours_bytes, plan = measure(ours)
    base_s, base_bytes, lists = measure(baseline)
    assert len(plan.starts) == len(lists)  # type: ignore[attr-defined]
    print(f"{args.pairs:,} pairs, {len(lists):,} batches of <= {args.max_tokens} tokens")
    print(f"lists, pair by pair: {base_s:.2f} s, {base_bytes / args.pairs:.1f} bytes a pair")
    print(f"arrays, batch by batch: {ours_s:.2f} s, {ours_bytes / args.pairs:.1f} bytes a pair")
    print(f"ratio: {base_s / ours_s:.1f}x faster, {base_bytes / ours_bytes:.1f}x less memory")


if __name__ == "__main__":
    main()
