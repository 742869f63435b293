"""What asking for token scores and word alignments costs a translation run, against the same run without.

    python bench/decode_features.py --checkpoint checkpoints/multi30k-ende/best.ckpt \
        --input test.en --sentences 500 --repeats 3

Translator.translate_nbest over the same sentences with SearchConfig(token_scores, alignments) off, each
alone, and both, in turns (repeats interleaved, so that a slow moment of the machine hits every
configuration alike); prints each one's best and median seconds and its ratio to the plain run. The
plain search runs exactly as it did before these options existed: they add one teacher-forced pass over
the finished outputs (seq2seq/decoding/scoring.py) and nothing to the search's steps; `--before REV` also times
the plain run with seq2seq/decoding/search.py as commit REV had it (loaded from git beside today's), to show it.
"""

import argparse
import gzip
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import seq2seq.inference.translator  # noqa: E402
from seq2seq.decoding.config import Hypothesis  # noqa: E402
from seq2seq.inference.translator import Translator  # noqa: E402


def search_as_of(rev: str):
    """seq2seq/decoding/search.py as commit `rev` had it, loaded as a module of its own beside today's."""
    source = subprocess.run(["git", "show", f"{rev}:seq2seq/decoding/search.py"], check=True, capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    path = Path(tempfile.mkdtemp()) / "search_before.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("search_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["search_before"] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--sentences", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--before", default=None, metavar="REV", help="also time search.py as of this git commit")
    args = parser.parse_args()
    opener = gzip.open if args.input.endswith(".gz") else open
    with opener(args.input, "rt", encoding="utf-8") as f:
        texts = [line.rstrip("\n") for line in f][: args.sentences]
    translator = Translator.from_checkpoint(args.checkpoint, precision=args.precision)
    plain = replace(translator.search, beam_size=args.beam, nbest=1)
    configs = {"plain": plain, "token_scores": replace(plain, token_scores=True),
               "alignments": replace(plain, alignments=True),
               "both": replace(plain, token_scores=True, alignments=True)}
    decoders = {name: seq2seq.inference.translator.decode for name in configs}
    if args.before:
        old = search_as_of(args.before)

        def decode_before(*args, **kwargs):  # its hypotheses as today's class (they lack the new fields)
            return [[Hypothesis(tokens=h.tokens, score=h.score, log_prob=h.log_prob) for h in hyps]
                    for hyps in old.decode(*args, **kwargs)]

        configs["plain, before"], decoders["plain, before"] = plain, decode_before
    translator.translate(texts[:20], plain)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in configs}
    outputs: dict[str, list[str]] = {}
    for _ in range(args.repeats):
        for name, search in configs.items():
            seq2seq.inference.translator.decode = decoders[name]  # what Translator decodes with
            start = time.perf_counter()
            # (translate_nbest, which keeps the scores: translate() would spare today's greedy search its
            # normaliser, which search.py as of --before computes)
            outputs[name] = [hyps[0].text if hyps else "" for hyps in translator.translate_nbest(texts, search)]
            seconds[name].append(time.perf_counter() - start)
    assert all(out == outputs["plain"] for out in outputs.values()), "the options changed a translation"
    print(f"{len(texts)} sentences, beam {args.beam}, {translator.precision}, {torch.get_num_threads()} threads; "
          "the same translations in every configuration")
    base = min(seconds["plain"])
    for name, times in seconds.items():
        print(f"{name:13s} best {min(times):6.2f} s  median {statistics.median(times):6.2f} s  "
              f"best / plain {min(times) / base:5.2f}x")


if __name__ == "__main__":
    main()
