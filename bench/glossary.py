"""Glossary matching (seq2seq/text/glossary.py) against the per-term regular expressions it replaced, on Multi30k.

    python bench/glossary.py [--data ../shared/data/multi30k] [--terms 100000] [--lines 1000] [--baseline-lines 20]

The glossary: the distinct words, then word pairs, then triples of Multi30k's English training side, in
the order they first appear, up to --terms (a term glossary of names and phrases, many of them
overlapping); each target is its source in capitals. The text: the first --lines English test2016
sentences. Timed in this process: building the Glossary once (one Aho-Corasick automaton) and matching
every line with it, against the old way (translator.glossary_terms until the Glossary: one regular
expression per term per line, reimplemented here as `per_term_regex`), which takes seconds a line with
100,000 terms and so runs over the first --baseline-lines only; the ratio is per line. Also checks that
what the Glossary forces is among what the old way forced (it forces fewer: of overlapping terms the
leftmost-longest only). Run by hand, not in CI.
"""

import argparse
import gzip
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from decode_vs_ct2 import cpu_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from seq2seq.text.glossary import Glossary, unspaced  # noqa: E402


def per_term_regex(text: str, glossary: Mapping[str, str]) -> list[str]:
    """The old matching (translator.glossary_terms): each term searched for with its own regular
    expression, overlapping occurrences too, kept at word edges; every term found is forced."""

    def spaced_word_char(char: str) -> bool:
        return (char.isalnum() or char == "_") and not unspaced(char)

    found = []
    for source, target in glossary.items():
        term = source.strip()
        for match in re.finditer(f"(?={re.escape(term)})", text) if term else ():
            start, end = match.start(), match.start() + len(term)
            if ((start == 0 or unspaced(term[0]) or not spaced_word_char(text[start - 1]))
                    and (end == len(text) or unspaced(term[-1]) or not spaced_word_char(text[end]))):
                found.append(target)
                break
    return found


def read(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.strip() for line in f]


def term_glossary(lines: list[str], size: int) -> dict[str, str]:
    """Up to `size` distinct words, then pairs, then triples of `lines`, in the order they first appear."""
    terms: dict[str, str] = {}
    for n in (1, 2, 3):
        for line in lines:
            words = line.split()
            for i in range(len(words) - n + 1):
                term = " ".join(words[i:i + n])
                terms.setdefault(term, term.upper())
                if len(terms) == size:
                    return terms
    return terms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(REPO.parent / "shared/data/multi30k"))
    parser.add_argument("--terms", type=int, default=100_000)
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--baseline-lines", type=int, default=20)
    args = parser.parse_args()
    terms = term_glossary(read(Path(args.data) / "train.en.gz"), args.terms)
    lines = read(Path(args.data) / "test_2016_flickr.en.gz")[: args.lines]
    baseline_lines = lines[: args.baseline_lines]

    start = time.perf_counter()
    glossary = Glossary(terms)
    built = time.perf_counter() - start
    start = time.perf_counter()
    found = [glossary.terms_in(line) for line in lines]
    matched = time.perf_counter() - start
    start = time.perf_counter()
    old = [per_term_regex(line, terms) for line in baseline_lines]
    old_matched = time.perf_counter() - start

    new_per_line, old_per_line = matched / len(lines), old_matched / len(baseline_lines)
    subset = all(set(new) <= set(was) for new, was in zip(found, old, strict=False))
    print(f"{cpu_model()}; {len(glossary)} terms ({glossary.characters} characters), {len(lines)} test2016 lines")
    print(f"Glossary: built once in {built:.3f} s; matched {len(lines)} lines in {matched:.3f} s "
          f"({new_per_line * 1e6:.1f} µs a line, {sum(map(len, found)) / len(lines):.1f} terms a line)")
    print(f"per-term regex (the old way): {len(baseline_lines)} lines in {old_matched:.2f} s "
          f"({old_per_line:.3f} s a line, {sum(map(len, old)) / len(old):.1f} terms a line); "
          f"{len(lines)} lines would take ~{old_per_line * len(lines):.0f} s")
    print(f"ratio per line (old / new): {old_per_line / new_per_line:,.0f}x; {len(lines)} lines, the build included: "
          f"{old_per_line * len(lines) / (built + matched):,.0f}x")
    print(f"what the Glossary forces is among what the old way forced on all {len(old)} lines: {subset}")


if __name__ == "__main__":
    main()
