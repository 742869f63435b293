"""python -m seq2seq.translate --checkpoint X [--input FILE|-] [--output FILE] [--ref FILE] [--beam 5] ...

One output line per input line, in order (an empty line gives an empty line). With --nbest N > 1
each input line gives N lines `index<TAB>score<TAB>translation` (index from 0; an empty line gives
N empty translations with score 0). With --ref, sacreBLEU and chrF (with their signatures) go to
stderr, so stdout stays the translations. Input, references and output are UTF-8 (a byte-order
mark at the start of a file is dropped).

Every option, the output path, the checkpoint and (for a file) every input line are checked before
any sentence is translated; the output may not be the input, the references, the checkpoint or any
file that is not text; an existing file that holds anything is replaced only with --force (a FIFO or
a device is written into, never emptied). The input is streamed (a pipe or an endless one costs no
more memory than a window of 1,000 lines, batched by length). Each translation is written as soon as it and every
line before it are done, a whole line at a time, so an interrupted run or a full disk leaves a file
of whole lines, and the message says how many. On a terminal, stderr shows a progress bar (not
when stderr is piped or redirected).
"""

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from seq2seq.cli import (
    add_search_arguments,
    check_flags,
    describe,
    format_nbest,
    interruption,
    one_line,
    one_line_warnings,
    open_translator,
    stop_on_sigterm,
    with_extras,
)
from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.documents import Translation, document_of, text_only
from seq2seq.inference.translator import Translator
from seq2seq.model.compiled import CompileError
from seq2seq.precision import DECODING_KERNEL_CACHE_CAPACITY, tune_process_memory
from seq2seq.text.glossary import Glossary, normal_term
from seq2seq.textio import (
    InputError,
    Output,
    OutputRefused,
    UpToABadLine,
    check_input_path,
    check_output,
    count_lines,
    iter_lines,
    read_lines,
    read_text,
    where,
)

FORMATS = {".html": "html", ".htm": "html", ".srt": "srt"}  # --format by --input's extension (else lines)
WINDOW = 1000  # input lines read and sorted by length at a time; each line is written once it and those before are done


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m seq2seq.translate", description=__doc__.split("\n\n")[1])
    parser.add_argument("--checkpoint", required=True, help="a .ckpt written by python -m seq2seq.fit")
    parser.add_argument("--input", default="-", help="one sentence per line; - for stdin")
    parser.add_argument("--output", default="-", help="where translations go; - for stdout (a FIFO or a device is "
                                                       "written into)")
    parser.add_argument("--force", action="store_true",
                        help="replace --output if it is a file that holds anything (an empty one is written without)")
    parser.add_argument("--ref", default=None, help="reference translations, line-aligned: print BLEU and chrF")
    parser.add_argument("--target-prefix", default=None, metavar="FILE",
                        help="line-aligned with the input: the start each translation must have (an empty line: none)")
    parser.add_argument("--constraints", default=None, metavar="FILE",
                        help="line-aligned with the input: tab-separated phrases each translation must contain")
    parser.add_argument("--split-sentences", action="store_true",
                        help="split each line into sentences, translate them, and put the line back together with "
                             "its own spacing (still one output line per input line)")
    parser.add_argument("--format", choices=["lines", "html", "srt"], default=None,
                        help="lines: one sentence (or paragraph, with --split-sentences) per line; html: a page or "
                             "fragment, markup kept; srt: SubRip subtitles, timings kept (default: by --input's "
                             "extension, .html/.htm html, .srt srt, else lines)")
    parser.add_argument("--glossary", default=None, metavar="FILE",
                        help="`source term<TAB>target term` lines: where a source term occurs (a whole word; of "
                             "overlapping terms the leftmost, then the longest), its target term must be in the "
                             "translation")
    add_search_arguments(parser)
    args = parser.parse_args(argv)
    search = check_flags(parser, args)
    if search.sampling and (args.constraints or args.glossary):
        parser.error("--constraints and --glossary need a search (--beam), not --sampling")
    args.format = args.format or FORMATS.get(Path(args.input).suffix.lower(), "lines")
    if args.format != "lines":
        given = [flag for flag, on in (("--nbest", search.nbest > 1), ("--alignments", search.alignments),
                                       ("--token-scores", search.token_scores), ("--target-prefix", args.target_prefix),
                                       ("--constraints", args.constraints), ("--ref", args.ref),
                                       ("--split-sentences", args.split_sentences), ("--sampling", search.sampling)) if on]
        if given:
            parser.error(f"--format {args.format} translates a whole document (sentences split, the rest kept); "
                         f"{given[0]} is for --format lines")
    if args.split_sentences:
        given = [flag for flag, on in (("--nbest", search.nbest > 1), ("--alignments", search.alignments),
                                       ("--token-scores", search.token_scores), ("--target-prefix", args.target_prefix),
                                       ("--constraints", args.constraints)) if on]
        if given:  # each is per sentence, and a line would hold several
            parser.error(f"--split-sentences does not go with {given[0]} (yet): give one sentence per line for it")
    inputs = {"--input": args.input, "--checkpoint": args.checkpoint} | ({"--ref": args.ref} if args.ref else {})
    for option in ("--target-prefix", "--constraints", "--glossary"):
        if getattr(args, option[2:].replace("-", "_")):
            inputs[option] = getattr(args, option[2:].replace("-", "_"))
    for option in ("--input", "--ref", "--target-prefix", "--constraints", "--glossary"):  # the checkpoint says what is wrong with it when it loads
        if inputs.get(option):
            check_input_path(inputs[option], option=option)
    if args.ref == "-" and args.input == "-":
        parser.error("--ref - and --input - would both read stdin; give one of them as a file")
    for option in ("--target-prefix", "--constraints", "--glossary"):
        if inputs.get(option) == "-" and args.input == "-":
            parser.error(f"{option} - and --input - would both read stdin; give one of them as a file")
    try:
        check_output(args.output, force=args.force, replaces=False, inputs=inputs.items(), example="translations.txt")
    except OutputRefused as error:
        raise SystemExit(f"error: {error}") from None
    one_line_warnings()
    stop_on_sigterm()
    try:
        translate_input(parser, args)
    except KeyboardInterrupt as error:  # before the first line was written (run reports an interruption after that)
        stop, status = interruption(error)
        print(f"\n{stop} before any line was translated; {where(args.output)} was not written", file=sys.stderr)
        raise SystemExit(status) from None


def translate_input(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.format != "lines":
        return translate_document(parser, args, glossary=read_glossary(args.glossary) if args.glossary else None)
    total = count_lines(args.input)
    references = read_lines(args.ref, option="--ref") if args.ref else None
    source_name = "stdin" if args.input == "-" else args.input
    if references is not None and total is not None and len(references) != total:
        raise SystemExit(f"error: {source_name} has {total} lines but {args.ref} has {len(references)}; "
                         "the references must be line-aligned with the input")
    for option, path in (("--target-prefix", args.target_prefix), ("--constraints", args.constraints)):
        aligned = count_lines(path, option=option) if path else None
        if aligned is not None and total is not None and aligned != total:
            raise SystemExit(f"error: {source_name} has {total} lines but {option} {path} has {aligned}; give one "
                             "line per input line (an empty line for none)")
    if args.constraints and Path(args.constraints).is_file():  # every phrase checked before any work
        try:
            for _ in read_constraints(args.constraints):
                pass
        except InputError as error:
            raise SystemExit(f"error: {error}") from None
    glossary = read_glossary(args.glossary) if args.glossary else None
    translator, search = open_translator(parser, args)
    say_compiling(translator)
    start = time.perf_counter()
    best: list[str] | None = [] if references is not None else None  # kept only for the scores
    output = Output(args.output)
    lines = UpToABadLine(iter_lines(args.input))
    prefixes = iter_lines(args.target_prefix, option="--target-prefix") if args.target_prefix else None
    constraints = read_constraints(args.constraints) if args.constraints else None
    if args.split_sentences:
        results = paragraphs(translator, lines, search, max_tokens=args.max_tokens, glossary=glossary)
    else:
        # One translation a line is written without its score (n-best lines, a beam search's, have theirs)
        results = translator.translate_stream(lines, text_only(search),
                                              max_tokens=args.max_tokens, window=WINDOW, prefixes=prefixes,
                                              constraints=constraints, glossary=glossary)
    try:
        write_translations(results, output, search=search, best=best, total=total)
        output.close()
        if lines.error is not None:  # found only now in a stream that could not be checked first (stdin)
            raise lines.error
    except KeyboardInterrupt as error:
        output.cut_to_whole_lines()
        stop, status = interruption(error)
        print(f"\n{stop}: {where(args.output)} holds the translations of the first {output.lines} lines",
              file=sys.stderr)
        raise SystemExit(status) from None
    except BrokenPipeError:  # `... | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        raise SystemExit(141) from None
    except (InputError, ValueError) as error:  # ValueError: a target prefix too long, or prefixes that end early
        raise SystemExit(f"error: {error}; {where(args.output)} holds the translations of the {output.lines} lines "
                         "before it") from None
    except CompileError as error:  # --compile: each kind of step compiles at its first batch
        raise SystemExit(f"error: {error}: translate without --compile; {where(args.output)} holds the translations "
                         f"of the {output.lines} lines before it") from None
    except OSError as error:  # a full disk, /dev/full
        output.cut_to_whole_lines()
        partial = " and maybe part of the next" if args.output == "-" else ""
        raise SystemExit(f"error: cannot write {where(args.output)} ({error.strerror}); it holds the translations of "
                         f"the first {output.lines} lines{partial}") from None
    finally:
        with contextlib.suppress(OSError):  # an error is already being reported
            output.close()
    print(f"translated {output.lines} lines in {time.perf_counter() - start:.1f}s{compiling_of(translator)} "
          f"({decoder_of(translator)}, {workers_of(translator, search)}, {describe(search)})", file=sys.stderr)
    if references is not None and best is not None:
        if len(references) != len(best):
            raise SystemExit(f"error: {source_name} had {len(best)} lines but {args.ref} has {len(references)}: no "
                             f"scores (the references must be line-aligned with the input); {where(args.output)} holds "
                             "every translation")
        try:  # seconds on a large file, after every line was written
            import sacrebleu  # (with --ref only: a part of start-up that translating alone never uses)

            bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
            print(f"{bleu.corpus_score(best, [references])}  {bleu.get_signature()}", file=sys.stderr)
            print(f"{chrf.corpus_score(best, [references])}  {chrf.get_signature()}", file=sys.stderr)
        except KeyboardInterrupt as error:
            stop, status = interruption(error)
            print(f"\n{stop} while scoring: {where(args.output)} holds every translation", file=sys.stderr)
            raise SystemExit(status) from None


def say_compiling(translator: Translator) -> None:
    """--compile compiling in this process (int8, a GPU): a line before the first batch, which otherwise waits
    silently while its kinds compile."""
    if translator.compiled and translator.package is None:
        print(f"{translator.pairs}: --compile: each kind of decoding step compiles at its "
              "first batch (seconds to a minute each, in every run)", file=sys.stderr, flush=True)


def decoder_of(translator: Translator) -> str:
    """How the end line names the decoder: its precision, and `compiled` where it ran compiled ('bf16 compiled')."""
    return f"{translator.precision}{' compiled' if translator.compiled else ''}"


def compiling_of(translator: Translator) -> str:
    """The end line's share of compiling (--compile), which a short run is mostly: ', 88.1s of it compiling'."""
    return f", {translator.compiling_seconds:.1f}s of it compiling" if translator.compiling_seconds else ""


def workers_of(translator: Translator, search: SearchConfig) -> str:
    """How the end-of-run line names the decoding threads the batches ran on (Translator.decoded): '2 workers
    x 1 thread', '1 worker x 16 threads', the most batches' first and the others after it ('2 workers x 1
    thread; 1 batch on 1 worker x 2 threads'); with no batch, those `search` would have taken."""
    def count(n: int, what: str) -> str:
        return f"{n} {what}" + ("s" if n != 1 else "")

    def threads(workers: int, each: int) -> str:
        return f"{count(workers, 'worker')} x {count(each, 'thread')}"

    used = translator.decoded.most_common() or [(translator.decoding_threads(search), 0)]
    return "; ".join([threads(*used[0][0]), *(f"{n} batch{'es' if n != 1 else ''} on {threads(*config)}"
                                              for config, n in used[1:])])


def translate_document(parser: argparse.ArgumentParser, args: argparse.Namespace, *,
                       glossary: Glossary | None) -> None:
    """--format html or srt: the whole input as one document, its sentences translated as one batch and
    put back (seq2seq/text/markup.py, seq2seq/text/subtitles.py); the output is written when all is done."""
    try:
        text = read_text(args.input)
    except InputError as error:
        raise SystemExit(f"error: {error}") from None
    translator, search = open_translator(parser, args)
    say_compiling(translator)
    start = time.perf_counter()
    split = translator.sentence_spans
    try:
        document = document_of(text, format=args.format, split=split)
    except ValueError as error:  # subtitles that are not SubRip ("line N is not ..."), markup that cannot be read
        name = "stdin" if args.input == "-" else args.input
        raise SystemExit(f"error: {name}{'' if str(error).startswith('line ') else ':'} {error}") from None
    try:
        [translated] = translator.translate_documents([document], search, max_tokens=args.max_tokens,
                                                      glossary=glossary)
    except CompileError as error:
        raise SystemExit(f"error: {error}: translate without --compile; {where(args.output)} was not written") from None
    output = Output(args.output)
    try:
        output.write(translated)
        output.close()
    except KeyboardInterrupt:  # the document is one write: what got out of it is cut away, main says none was written
        output.cut_to_whole_lines()
        raise
    except OSError as error:
        output.cut_to_whole_lines()
        raise SystemExit(f"error: cannot write {where(args.output)} ({error.strerror})") from None
    print(f"translated {len(document.sentences)} sentences of {args.format} in {time.perf_counter() - start:.1f}s"
          f"{compiling_of(translator)} ({decoder_of(translator)}, {workers_of(translator, search)}, {describe(search)})",
          file=sys.stderr)


def paragraphs(translator: Translator, lines: Iterable[str], search: SearchConfig, *, max_tokens: int,
               glossary: Glossary | None) -> Iterator[list[Translation]]:
    """--split-sentences: each line's translation, its sentences translated a window of lines at a time,
    as one 1-best Translation (its score, the sum of its sentences', is not kept: the output has none)."""
    iterator, done = iter(lines), 0
    while chunk := list(islice(iterator, WINDOW)):
        for text in translator.translate_paragraphs(chunk, search, max_tokens=max_tokens, glossary=glossary,
                                                    first_line=done + 1):
            yield [Translation(text=text, score=0.0, tokens=[])] if text else []  # a line of spaces stays one
        done += len(chunk)


def read_constraints(path: str) -> Iterator[list[str]]:
    """Each line's tab-separated phrases (a blank line: none), read as they are needed; InputError naming
    the line of an empty phrase."""
    for number, line in enumerate(iter_lines(path, option="--constraints"), start=1):
        phrases = line.split("\t") if line.strip() else []
        if any(not phrase.strip() for phrase in phrases):
            raise InputError(f"--constraints {path} line {number} has an empty phrase (two tabs together, or one at "
                             "an end): separate the phrases by one tab")
        yield phrases


def read_glossary(path: str) -> Glossary:
    """`source term<TAB>target term` lines (blank lines skipped), as one Glossary compiled once for the run;
    one error line naming a line without a tab, an empty term, or a source term given twice with different
    targets (terms compared as the Glossary compares them: glossary.normal_term)."""
    glossary: dict[str, str] = {}
    for number, line in enumerate(read_lines(path, option="--glossary"), start=1):
        if not line.strip():
            continue
        if line.count("\t") != 1:
            tabs = "no tab" if line.count("\t") == 0 else "more than one tab"
            raise SystemExit(f"error: --glossary {path} line {number} has {tabs}: write source term<TAB>target term")
        source, target = (normal_term(part) for part in line.split("\t"))
        if not source or not target:
            raise SystemExit(f"error: --glossary {path} line {number} has an empty {'source' if not source else 'target'} "
                             "term: write source term<TAB>target term")
        if glossary.get(source, target) != target:
            raise SystemExit(f"error: --glossary {path} line {number} gives {source!r} a second target term "
                             f"({glossary[source]!r}, then {target!r}); keep one")
        glossary[source] = target
    return Glossary(glossary)


def write_translations(results: Iterable[list[Translation]], output: Output | TextIO, *, search: SearchConfig,
                       best: list[str] | None = None, total: int | None = None, progress: TextIO | None = None) -> None:
    """Write each line's translation(s) as soon as it and every line before it are done, one whole line
    (n-best: one group of lines) per write, with the columns `search` asks for (alignments, token
    scores); `best` collects the 1-bests. A progress bar goes to `progress` if it is a terminal (not when
    piped or redirected, where it would fill a log)."""
    nbest = search.nbest
    progress = progress if progress is not None else sys.stderr
    with tqdm(total=total, file=progress, unit=" lines", dynamic_ncols=True, leave=False,
              disable=not progress.isatty()) as bar:
        for i, hyps in enumerate(results):
            first = one_line(hyps[0].text) if hyps else ""
            if nbest > 1:
                text = "".join(f"{line}\n" for line in format_nbest(hyps, nbest=nbest, prefix=f"{i}\t", search=search))
            else:
                text = with_extras(first, hyps[0] if hyps else None, search) + "\n"
            output.write(text)
            output.flush()
            unmet = hyps[0].unmet_constraints if hyps else None
            if unmet:  # a constraint the search could not place: translated without them, and said
                print(f"warning: line {i + 1}: could not place the constraint(s) {', '.join(map(repr, unmet))}; "
                      "translated without them", file=sys.stderr)
            if best is not None:
                best.append(first)
            bar.update()


def run() -> None:
    """The command: `main` with the process set up for it."""
    tune_process_memory(kernels=DECODING_KERNEL_CACHE_CAPACITY)  # large blocks reused, kernels kept
    main()


if __name__ == "__main__":
    run()
