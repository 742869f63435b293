"""Interactive translation: load a checkpoint once, translate each line as it is typed.

    python -m seq2seq.interactive --checkpoint checkpoints/multi30k/best.ckpt [--beam 5] [--nbest 3]
    python serve/translate.py ...   # the same, from a clone

Shows a prompt on a terminal; with piped stdin it prints one translation per input line, flushed
at once, so another program can drive it line by line (with --nbest N: N lines
`score<TAB>translation` and a blank line per input; an empty input gives N empty translations
with score 0). Input and output are UTF-8; a line that is not UTF-8 is reported on stderr and
answered with an empty translation, so the answers stay in step. A line longer than the model
accepts is truncated, with a warning naming its line number. Ctrl-D or an end of input quits.
"""

import argparse
import sys

from seq2seq.cli import (
    add_search_arguments,
    check_flags,
    compile_before_answering,
    describe,
    format_nbest,
    interruption,
    one_line,
    one_line_warnings,
    open_translator,
    stop_on_sigterm,
    with_extras,
)
from seq2seq.precision import DECODING_KERNEL_CACHE_CAPACITY, tune_process_memory
from seq2seq.textio import MAX_LINE_BYTES, utf8_stdout


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m seq2seq.interactive", description="interactive translation")
    parser.add_argument("--checkpoint", required=True, help="a .ckpt written by python -m seq2seq.fit")
    add_search_arguments(parser)
    args = parser.parse_args(argv)
    check_flags(parser, args)
    one_line_warnings()
    stop_on_sigterm()
    translator, search = open_translator(parser, args)
    # before the first line, which would otherwise wait while each kind of step compiles
    compile_before_answering(translator, face="serve/translate.py")
    # Bytes in, decoded here: a stray non-UTF-8 byte must not end the session with a traceback.
    stdin = sys.stdin.buffer
    stdout = utf8_stdout()
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"{translator.pairs}, {describe(search)}; Ctrl-D quits.", file=sys.stderr)
    number = 0
    while True:
        if interactive:
            print(f"{translator.src_lang}> " if translator.src_lang else "> ", end="", file=sys.stderr, flush=True)
        raw = stdin.readline(MAX_LINE_BYTES + 3)  # bounded (/dev/zero has no line end): the text, "\r\n", one more
        if not raw:
            break
        number += 1
        text = raw.removesuffix(b"\n").removesuffix(b"\r")
        if len(text) > MAX_LINE_BYTES:
            while raw and not raw.endswith(b"\n"):  # the rest of the line, read and dropped in bounded pieces
                raw = stdin.readline(MAX_LINE_BYTES)
            print(f"error: input line {number} is longer than {MAX_LINE_BYTES >> 20} MiB; translating it as an "
                  "empty line", file=sys.stderr)
            line = ""
        else:
            try:
                line = text.decode("utf-8")
            except UnicodeDecodeError:
                print(f"error: input line {number} is not UTF-8; translating it as an empty line", file=sys.stderr)
                line = ""
        if number == 1:
            line = line.removeprefix("\ufeff")  # a byte-order mark is not part of the sentence
        hyps = translator.translate_nbest([line], search, max_tokens=args.max_tokens, first_line=number)[0]
        if search.nbest > 1:
            print("\n".join(format_nbest(hyps, nbest=search.nbest, search=search)), file=stdout)
            print(file=stdout)
        else:
            print(with_extras(one_line(hyps[0].text) if hyps else "", hyps[0] if hyps else None, search), file=stdout)
        stdout.flush()


def run() -> None:
    """The command: `main` with the process set up for it, and Ctrl-C or SIGTERM answered with a line."""
    tune_process_memory(kernels=DECODING_KERNEL_CACHE_CAPACITY)  # large blocks reused, kernels kept
    try:
        main()
    except KeyboardInterrupt as error:  # Ctrl-C at the prompt, or SIGTERM: leave quietly, as Ctrl-D does
        print(file=sys.stderr)
        sys.exit(interruption(error)[1])


if __name__ == "__main__":
    run()
