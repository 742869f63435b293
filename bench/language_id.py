"""`source: auto`'s language identifier (seq2seq/serve/languages.py, lingua) on Multi30k: accuracy among the
four languages on whole test2016 sentences and on their first 1, 2 and 3 words, detections per
second, and the memory its models take.

    python bench/language_id.py [--data ../shared/data/multi30k] [--languages cs de en fr]

Needs the `[serve]` extra. Run by hand, not in CI.
"""

import argparse
import gzip
import time
from pathlib import Path

from decode_vs_ct2 import cpu_model

REPO = Path(__file__).resolve().parents[1]
from seq2seq.serve.languages import Detector  # noqa: E402


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(REPO.parent / "shared/data/multi30k"))
    parser.add_argument("--languages", nargs="+", default=["cs", "de", "en", "fr"])
    args = parser.parse_args()
    sentences = {}
    for language in args.languages:
        with gzip.open(Path(args.data) / f"test_2016_flickr.{language}.gz", "rt", encoding="utf-8") as f:
            sentences[language] = [line.strip() for line in f if line.strip()]
    before = rss_mib()
    start = time.perf_counter()
    detector = Detector(args.languages)
    loaded = time.perf_counter() - start
    print(f"{cpu_model()}; lingua among {', '.join(args.languages)}: loaded in {loaded:.2f} s, "
          f"{rss_mib() - before:.0f} MiB")
    print("| input | " + " | ".join(args.languages) + " | all |")
    print("|---|" + "---|" * (len(args.languages) + 1))
    for words in (None, 3, 2, 1):
        right, total = [], 0
        for language in args.languages:
            texts = [s if words is None else " ".join(s.split()[:words]) for s in sentences[language]]
            right.append(sum(detector.detect(t, among=args.languages)[0] == language for t in texts) / len(texts))
            total += len(texts)
        name = "whole sentence" if words is None else f"first {words} word{'s' if words > 1 else ''}"
        print(f"| {name} | " + " | ".join(f"{100 * r:.1f}%" for r in right) + f" | {100 * sum(right) / len(right):.1f}% |")
    texts = [s for language in args.languages for s in sentences[language]]
    start = time.perf_counter()
    for text in texts:
        detector.detect(text, among=args.languages)
    print(f"\n{len(texts) / (time.perf_counter() - start):,.0f} sentences/s, one at a time")


if __name__ == "__main__":
    main()
