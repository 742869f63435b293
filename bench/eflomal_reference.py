"""Reference word alignments for bench/alignments.py, from eflomal (a Bayesian IBM-model aligner).

    pip install eflomal          # in any environment: it needs only numpy and a C compiler
    python bench/eflomal_reference.py --src train.en test.en --tgt train.de test.de --last 1000 \
        --output test.en-de.gdfa

eflomal aligns the concatenation of the files (a test set alone is too small to learn from) in both
directions; the links of the last `--last` pairs, symmetrised with grow-diag-final-and, are written in
Pharaoh format (`i-j`, source word - target word, 0-based). Words are runs of characters between
spaces (`line.split(" ")`, as seq2seq's alignments number them), lowercased for the aligner. Gzipped
files are read as they are.
"""

import argparse
import gzip
import tempfile
from pathlib import Path


def read(paths: list[str]) -> list[str]:
    lines: list[str] = []
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            lines += [line.rstrip("\n") for line in f]
    return lines


def links(path: Path) -> list[set[tuple[int, int]]]:
    out = []
    for line in path.read_text(encoding="utf-8").split("\n")[:-1]:
        out.append({(int(i), int(j)) for i, j in (pair.split("-") for pair in line.split())})
    return out


def grow_diag_final_and(forward: set[tuple[int, int]], reverse: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Koehn et al.'s symmetrisation: the intersection, grown by neighbours in the union, then final-and."""
    union, alignment = forward | reverse, forward & reverse
    neighbours = [(-1, 0), (0, -1), (1, 0), (0, 1), (-1, -1), (-1, 1), (1, -1), (1, 1)]
    grown = True
    while grown:
        grown = False
        for i, j in sorted(alignment):
            for di, dj in neighbours:
                candidate = (i + di, j + dj)
                if candidate in union and candidate not in alignment:
                    src_free = all(a != candidate[0] for a, _ in alignment)
                    tgt_free = all(b != candidate[1] for _, b in alignment)
                    if src_free or tgt_free:
                        alignment.add(candidate)
                        grown = True
    for directed in (forward, reverse):
        for i, j in sorted(directed):
            if all(a != i for a, _ in alignment) and all(b != j for _, b in alignment):
                alignment.add((i, j))
    return alignment


def main() -> None:
    import eflomal

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", nargs="+", required=True)
    parser.add_argument("--tgt", nargs="+", required=True)
    parser.add_argument("--last", type=int, required=True, help="write the links of the last N pairs")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    src, tgt = read(args.src), read(args.tgt)
    assert len(src) == len(tgt), f"{len(src)} source lines, {len(tgt)} target lines"
    with tempfile.TemporaryDirectory() as scratch:
        fwd, rev = Path(scratch) / "fwd", Path(scratch) / "rev"
        # eflomal splits lines at whitespace: one space between words makes that split(" ")
        eflomal.Aligner().align([" ".join(s.lower().split()) for s in src], [" ".join(t.lower().split()) for t in tgt],
                                links_filename_fwd=str(fwd), links_filename_rev=str(rev))
        forward, reverse = links(fwd)[-args.last:], links(rev)[-args.last:]
    with open(args.output, "w", encoding="utf-8") as f:
        for a, b in zip(forward, reverse, strict=True):
            f.write(" ".join(f"{i}-{j}" for i, j in sorted(grow_diag_final_and(a, b))) + "\n")


if __name__ == "__main__":
    main()
