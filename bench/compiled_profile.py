"""Where a compiled search spends its time: the encoder, the compiled steps, their Python, the cache, the rest.

    python bench/compiled_profile.py --checkpoint checkpoints/multi30k-ende/best.ckpt [--beam 5] [--sentences 500]

A `compiled=True` Translator (one thread, bf16, fp32 or int8) compiles its kinds of step (`compile_decoding`), then
translates the Multi30k test sentences at once, twice; the second run is timed by wrapping the CompiledDecoder's
methods and the cache's: the encoder, the compiled step (its kernels and dynamo's call), `decode` around it (the
step's Python: the position, the cache's room, the cross keys once a sentence), the cache's reorders and growth.
What is left of the whole is the search's own eager work between steps (normaliser, top-k, bookkeeping) and the
tokenizer. Run by hand, not in CI (docs/results/compiled-decoding.md).
"""

import argparse
import gzip
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.translator import Translator
from seq2seq.model.compiled import CompiledDecoder, CompiledState
from seq2seq.precision import DECODING_KERNEL_CACHE_CAPACITY, device_name, tune_process_memory

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32", "int8"))
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--sentences", type=int, default=500)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared/data/multi30k")
    args = parser.parse_args()
    tune_process_memory(kernels=DECODING_KERNEL_CACHE_CAPACITY)  # as the translate CLI does
    torch.set_num_threads(1)
    translator = Translator.from_checkpoint(args.checkpoint, precision=args.precision, compiled=True)
    with gzip.open(args.data / f"test_2016_flickr.{translator.src_lang}.gz", "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f][: args.sentences]
    search = SearchConfig(beam_size=args.beam, length_penalty=0.0, max_len_a=0.0, max_len_b=100, scores=False)
    translator.compile_decoding()
    translator.translate_nbest(lines, search)  # first use: allocations, oneDNN's kernels for the encoder

    seconds: Counter[str] = Counter()

    def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - began
        return run

    decoder = translator.decoding
    assert isinstance(decoder, CompiledDecoder)
    decoder._step = timed("compiled step", decoder._step)  # type: ignore[method-assign]
    decoder._steps = timed("decode", decoder._steps)  # type: ignore[method-assign]  # (decode's and decode_step's)
    decoder.encode = timed("encoder", decoder.encode)  # type: ignore[method-assign]
    CompiledState.reorder = timed("cache reorder", CompiledState.reorder)  # type: ignore[method-assign]
    CompiledState.reserve = timed("cache growth", CompiledState.reserve)  # type: ignore[method-assign]
    began = time.perf_counter()
    nbest = translator.translate_nbest(lines, search)
    total = time.perf_counter() - began
    tokens = sum(len(hyps[0].tokens) + 1 for hyps in nbest if hyps)
    parts = {"encoder": seconds["encoder"], "compiled step": seconds["compiled step"],
             "the step's Python": seconds["decode"] - seconds["compiled step"] - seconds["cache growth"],
             "cache growth": seconds["cache growth"], "cache reorder": seconds["cache reorder"]}
    parts["the search's own work (the rest)"] = total - sum(parts.values())
    print(f"# {device_name(torch.device('cpu'))}; {args.checkpoint}, {args.precision}, one thread, "
          f"{'greedy' if args.beam == 1 else f'beam {args.beam}'}, {len(lines)} sentences at once: {total:.2f} s, "
          f"{tokens / total:,.0f} tgt tok/s")
    for name, value in parts.items():
        print(f"{name}: {value:.3f} s ({value / total:.0%})")


if __name__ == "__main__":
    main()
