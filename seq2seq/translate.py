"""python -m seq2seq.translate --checkpoint X [--input FILE|-] [--output FILE] [--ref FILE] [--beam 5] ...

One output line per input line, in order (an empty line gives an empty line). With --nbest N > 1
each input line gives N lines `index<TAB>score<TAB>translation` (index from 0; an empty line gives
N empty translations with score 0). With --ref, sacreBLEU and chrF (with their signatures) go to
stderr, so stdout stays the translations. Input, references and output are UTF-8.
"""

import argparse
import sys
import time
from pathlib import Path

import sacrebleu

from seq2seq.translator import Translation, Translator


def read_lines(path: str) -> list[str]:
    """The lines of a UTF-8 file, or of stdin for "-", without their line ends.

    Lines end at "\n" only (a "\r" before it goes too): str.splitlines would also split at
    U+2028, U+0085, form feeds and the like inside a sentence, and the output would then have more
    lines than the input, out of step with the references. Stdin is read as bytes, so it is UTF-8
    whatever the locale says, and a bad byte is reported with its line like a file's.
    """
    name = "stdin" if path == "-" else path
    try:
        data = read_stdin() if path == "-" else Path(path).read_bytes()
    except FileNotFoundError:
        raise SystemExit(f"error: {path} does not exist") from None
    except OSError as error:
        raise SystemExit(f"error: cannot read {path}: {error.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise SystemExit(f"error: {name} line {line} is not UTF-8; convert the file to UTF-8") from None
    lines = text.split("\n")
    if lines[-1] == "":  # the newline that ends the last line; an empty input has no lines
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def read_stdin() -> bytes:
    stdin = getattr(sys.stdin, "buffer", None)  # a StringIO put in place of stdin has none
    return sys.stdin.read().encode("utf-8") if stdin is None else stdin.read()


def write_stdout(text: str) -> None:
    """Write UTF-8 bytes, as the input is read, whatever the locale's encoding says."""
    stdout = getattr(sys.stdout, "buffer", None)  # a StringIO put in place of stdout has none
    if stdout is None:
        sys.stdout.write(text)
    else:
        sys.stdout.flush()
        stdout.write(text.encode("utf-8"))
        stdout.flush()


def one_line(text: str) -> str:
    """A translation as one output line: the model can emit newline bytes (byte-fallback pieces)."""
    return text.replace("\r", " ").replace("\n", " ")


def format_nbest(hyps: list[Translation], *, nbest: int, prefix: str = "") -> list[str]:
    """`prefix score<TAB>translation` lines, one per hypothesis (beam search gives `nbest`).

    An empty input line has no hypotheses; it gets `nbest` empty translations with score 0 (the
    log-probability of the only possible output), so that it too gives `nbest` lines.
    """
    if not hyps:
        return [f"{prefix}{0.0:.4f}\t"] * nbest
    return [f"{prefix}{t.score:.4f}\t{one_line(t.text)}" for t in hyps]


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """The search options, shared with serve/translate.py."""
    parser.add_argument("--beam", type=int, default=5, help="beam size; 1 is greedy search")
    parser.add_argument("--nbest", type=int, default=1, help="translations per input line (<= beam)")
    parser.add_argument("--length-penalty", type=float, default=0.6, help="GNMT's alpha; 0 ranks by raw log-prob")
    parser.add_argument("--max-len-a", type=float, default=1.5, help="output length limit: a * source length + b")
    parser.add_argument("--max-len-b", type=int, default=10)
    parser.add_argument("--no-repeat-ngram", type=int, default=0, help="forbid repeating n-grams of this size")
    parser.add_argument("--sampling", action="store_true", help="sample instead of searching")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=8192, help="source tokens per batch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")


def check_search_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error for option combinations the Translator would refuse on the first line."""
    if args.beam < 1:
        parser.error(f"--beam must be at least 1, got {args.beam}")
    if args.sampling and args.nbest != 1:
        parser.error("--sampling draws one translation per line; leave --nbest at 1")
    if not args.sampling and not 1 <= args.nbest <= args.beam:
        parser.error(f"--nbest ({args.nbest}) must be between 1 and --beam ({args.beam})")
    if args.temperature <= 0:
        parser.error(f"--temperature must be > 0, got {args.temperature}")


def load_translator(args: argparse.Namespace) -> Translator:
    """The checkpoint's Translator, or exit with load_checkpoint's message (no traceback)."""
    try:
        return Translator.from_checkpoint(args.checkpoint, device=args.device, precision=args.precision)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None


def search_options(args: argparse.Namespace) -> dict:
    return {
        "beam_size": args.beam,
        "nbest": args.nbest,
        "length_penalty": args.length_penalty,
        "max_len_a": args.max_len_a,
        "max_len_b": args.max_len_b,
        "no_repeat_ngram_size": args.no_repeat_ngram,
        "sampling": args.sampling,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m seq2seq.translate", description=__doc__.split("\n\n")[1])
    parser.add_argument("--checkpoint", required=True, help="a .ckpt written by python -m seq2seq.fit")
    parser.add_argument("--input", default="-", help="one sentence per line; - for stdin")
    parser.add_argument("--output", default="-", help="where translations go; - for stdout")
    parser.add_argument("--ref", default=None, help="reference translations, line-aligned: print BLEU and chrF")
    add_search_arguments(parser)
    args = parser.parse_args(argv)
    check_search_arguments(parser, args)

    sources = read_lines(args.input)
    references = read_lines(args.ref) if args.ref else None
    if references is not None and len(references) != len(sources):
        source_name = "stdin" if args.input == "-" else args.input
        raise SystemExit(
            f"error: {source_name} has {len(sources)} lines but {args.ref} has {len(references)}; "
            "the references must be line-aligned with the input"
        )
    translator = load_translator(args)
    start = time.perf_counter()
    nbest = translator.translate_nbest(sources, **search_options(args))
    elapsed = time.perf_counter() - start
    if args.nbest > 1:
        lines = [line for i, hyps in enumerate(nbest) for line in format_nbest(hyps, nbest=args.nbest, prefix=f"{i}\t")]
    else:
        lines = [one_line(hyps[0].text) if hyps else "" for hyps in nbest]
    text = "".join(line + "\n" for line in lines)
    if args.output == "-":
        write_stdout(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")
    print(f"translated {len(sources)} lines in {elapsed:.1f}s", file=sys.stderr)
    if references is not None:
        best = [one_line(hyps[0].text) if hyps else "" for hyps in nbest]
        bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
        print(f"{bleu.corpus_score(best, [references])}  {bleu.get_signature()}", file=sys.stderr)
        print(f"{chrf.corpus_score(best, [references])}  {chrf.get_signature()}", file=sys.stderr)


if __name__ == "__main__":
    main()
