"""Lexical constraints on a term test set built from Multi30k: satisfaction, BLEU before and after, cost.

    python bench/constraints.py --checkpoint checkpoints/multi30k-ende/best.ckpt \
        --src ../shared/data/multi30k/test_2016_flickr.en.gz --ref ../shared/data/multi30k/test_2016_flickr.de.gz \
        --sentences 200

The terms: for each sentence, the longest word of its reference (letters only, 4 or more) that the
unconstrained translation lacks, as a glossary would supply a term the model did not choose; sentences
whose translation already has every such word get no term and are left out. Both runs are beam 5 over the
same sentences (the constrained one with one phrase each), timed in turns; prints how many outputs hold
their term, corpus BLEU of both against the references, and the time ratio.
"""

import argparse
import gzip
import re
import statistics
import sys
import time
from pathlib import Path

import sacrebleu
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seq2seq.decoding.config import SearchConfig  # noqa: E402
from seq2seq.inference.translator import Translator  # noqa: E402


def read(path: str, n: int) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f][:n]


def term(reference: str, translation: str) -> str | None:
    """The longest word of the reference the translation lacks (letters only, at least 4), or None."""
    have = set(re.findall(r"\w+", translation))
    words = [w for w in re.findall(r"[^\W\d_]+", reference) if len(w) >= 4 and w not in have]
    return max(words, key=len) if words else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--sentences", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", default="auto")
    args = parser.parse_args()
    translator = Translator.from_checkpoint(args.checkpoint, precision=args.precision)
    search = SearchConfig(beam_size=5, length_penalty=translator.search.length_penalty)
    sources, references = read(args.src, args.sentences), read(args.ref, args.sentences)
    first = translator.translate(sources, search)
    terms = [term(r, t) for r, t in zip(references, first, strict=True)]
    kept = [i for i, t in enumerate(terms) if t is not None]
    sources, references, terms = [sources[i] for i in kept], [references[i] for i in kept], [terms[i] for i in kept]
    constraints = [[t] for t in terms]
    seconds: dict[str, list[float]] = {"plain": [], "constrained": []}
    for _ in range(args.repeats):
        start = time.perf_counter()
        plain = translator.translate(sources, search)
        seconds["plain"].append(time.perf_counter() - start)
        start = time.perf_counter()
        results = translator.translate_nbest(sources, search, constraints=constraints)
        seconds["constrained"].append(time.perf_counter() - start)
    constrained = [hyps[0].text for hyps in results]
    # held: reported met, and the term a whole word of the output (not the start of a longer one)
    held = sum(not hyps[0].unmet_constraints and t in re.findall(r"\w+", hyps[0].text)
               for hyps, t in zip(results, terms, strict=True))
    bleu = sacrebleu.metrics.BLEU()
    before, after = bleu.corpus_score(plain, [references]), bleu.corpus_score(constrained, [references])
    print(f"{len(sources)} sentences with a term (of {args.sentences}), beam 5, {translator.precision}, "
          f"{torch.get_num_threads()} threads")
    before_held = sum(t in re.findall(r"\w+", p) for t, p in zip(terms, plain, strict=True))
    print(f"terms in the unconstrained outputs: {before_held}; "
          f"in the constrained outputs: {held} ({100 * held / len(sources):.1f}%)")
    print(f"BLEU without constraints {before.score:.2f}, with {after.score:.2f}  ({bleu.get_signature()})")
    base = min(seconds["plain"])
    for name, times in seconds.items():
        print(f"{name:12s} best {min(times):6.2f} s  median {statistics.median(times):6.2f} s  "
              f"best / plain {min(times) / base:5.2f}x")
    for i in range(3):
        print(f"  {sources[i]}\n  term {terms[i]!r}\n  - {plain[i]}\n  + {constrained[i]}")


if __name__ == "__main__":
    main()
