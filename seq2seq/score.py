"""python -m seq2seq.score --checkpoint X --src FILE --tgt FILE [--output FILE] [--precision auto] ...

The model's log-probability of given translations, for filtering a corpus, reranking, or flagging a
sentence for review: one output line per input pair, in order,

    log_prob<TAB>token log-probabilities

the log-probability of the whole target (natural log), then one per target token and one for the
final EOS, space-separated; they sum to the first. Computed as translation computes them
(seq2seq/decoding/scoring.py): the same precision rules (`--precision auto`), device and length-sorted
batches. A pair that cannot be scored (an empty source, a side longer than the model reads) gives an
empty line, and a warning naming its line. --src and --tgt must have as many lines; they are read,
checked and written as python -m seq2seq.translate reads, checks and writes (UTF-8, one line per
pair, whole lines written as they are done). A multilingual model scores one direction a run: `--tgt-lang` names
the targets' language.
"""

import argparse
import sys
import time
from itertools import islice

import torch

from seq2seq.checkpoint import CheckpointError
from seq2seq.cli import interruption, one_line_warnings, stop_on_sigterm
from seq2seq.decoding.scoring import Forced
from seq2seq.inference.preparation import resolve_device
from seq2seq.inference.translator import Translator
from seq2seq.precision import DECODING_KERNEL_CACHE_CAPACITY, PRECISIONS, tune_process_memory
from seq2seq.textio import Output, OutputRefused, check_input_path, check_output, read_lines, where

WINDOW = 1000  # pairs scored (sorted by length) and written at a time


def format_scores(forced: Forced | None) -> str:
    """An output line, without its newline: empty for a pair that was not scored."""
    if forced is None:
        return ""
    return f"{forced.log_prob:.4f}\t" + " ".join(f"{score:.4f}" for score in forced.token_log_probs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m seq2seq.score", description=__doc__.split("\n\n")[1])
    parser.add_argument("--checkpoint", required=True, help="a .ckpt (python -m seq2seq.fit or seq2seq.convert)")
    parser.add_argument("--src", required=True, help="the sources, one per line; - for stdin")
    parser.add_argument("--tgt", required=True, help="their translations, line-aligned with --src")
    parser.add_argument("--output", default="-", help="where the scores go; - for stdout (a FIFO or a device is "
                                                       "written into)")
    parser.add_argument("--force", action="store_true",
                        help="replace --output if it is a file that holds anything (an empty one is written without)")
    parser.add_argument("--tgt-lang", default=None,
                        help="a multilingual model's target language, the targets' (one of its checkpoint's; default: "
                             "its only one)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="padded positions per batch")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="as for translation: auto picks bf16 where bf16 matmuls are fast here, else fp32")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.src == "-" and args.tgt == "-":
        parser.error("--src - and --tgt - would both read stdin; give one of them as a file")
    try:
        resolve_device(args.device)
    except ValueError as error:
        parser.error(f"--device: {error}")
    inputs = {"--src": args.src, "--tgt": args.tgt, "--checkpoint": args.checkpoint}
    for option in ("--src", "--tgt"):
        check_input_path(inputs[option], option=option)
    try:
        check_output(args.output, force=args.force, replaces=False, inputs=inputs.items(), example="scores.txt")
    except OutputRefused as error:
        raise SystemExit(f"error: {error}") from None
    one_line_warnings()
    stop_on_sigterm()
    try:
        score_input(args)
    except KeyboardInterrupt as error:  # before the first window (run reports a stop after that)
        stop, status = interruption(error)
        print(f"\n{stop} before any pair was scored; {where(args.output)} was not written", file=sys.stderr)
        raise SystemExit(status) from None


def score_input(args: argparse.Namespace) -> None:
    sources, targets = read_lines(args.src, option="--src"), read_lines(args.tgt, option="--tgt")
    if len(sources) != len(targets):
        raise SystemExit(f"error: --src {args.src} has {len(sources)} lines but --tgt {args.tgt} has "
                         f"{len(targets)}; they must be line-aligned")
    try:
        translator = Translator.from_checkpoint(args.checkpoint, device=args.device, precision=args.precision)
    except (CheckpointError, OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    try:
        translator = translator.for_target(args.tgt_lang) if args.tgt_lang else translator
        translator.source_tag()  # (a multilingual model's target chosen: said before any pair is scored)
    except ValueError as error:
        raise SystemExit(f"error: --tgt-lang: {error}") from None
    start = time.perf_counter()
    output = Output(args.output)
    pairs = iter(zip(sources, targets, strict=True))
    try:
        while window := list(islice(pairs, WINDOW)):
            scored = translator.score([s for s, _ in window], [t for _, t in window], max_tokens=args.max_tokens,
                                      first_line=output.lines + 1)
            for forced in scored:
                output.write(format_scores(forced) + "\n")
        output.close()
    except KeyboardInterrupt as error:
        output.cut_to_whole_lines()
        stop, status = interruption(error)
        print(f"\n{stop}: {where(args.output)} holds the scores of the first {output.lines} pairs", file=sys.stderr)
        raise SystemExit(status) from None
    except OSError as error:  # a full disk, /dev/full
        output.cut_to_whole_lines()
        raise SystemExit(f"error: cannot write {where(args.output)} ({error.strerror}); it holds the scores of the "
                         f"first {output.lines} pairs") from None
    print(f"scored {output.lines} pairs in {time.perf_counter() - start:.1f}s ({translator.precision}, "
          f"{torch.get_num_threads()} threads)", file=sys.stderr)


def run() -> None:
    """The command: `main` with the process set up for it."""
    tune_process_memory(kernels=DECODING_KERNEL_CACHE_CAPACITY)  # large blocks reused, kernels kept
    main()


if __name__ == "__main__":
    run()
