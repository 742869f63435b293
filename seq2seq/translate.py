"""python -m seq2seq.translate --checkpoint X [--input FILE|-] [--output FILE] [--ref FILE] [--beam 5] ...

One output line per input line, in order (an empty line gives an empty line). With --nbest N > 1
each input line gives N lines `index<TAB>score<TAB>translation` (index from 0; an empty line gives
N empty translations with score 0). With --ref, sacreBLEU and chrF (with their signatures) go to
stderr, so stdout stays the translations. Input, references and output are UTF-8 (a byte-order
mark at the start of a file is dropped).

Every option, the output path and the checkpoint are checked before any sentence is translated.
Each translation is written (and flushed) as soon as it and every line before it are done, so an
interrupted run keeps them; lines are batched by length within windows of 1,000. On a terminal,
stderr shows a progress bar (not when stderr is piped or redirected).
"""

import argparse
import dataclasses
import os
import re
import sys
import time
import typing
import warnings
from dataclasses import fields
from pathlib import Path
from typing import TextIO

import sacrebleu
import torch
from tqdm import tqdm

from seq2seq.checkpoint import CheckpointError
from seq2seq.model import ConfigError
from seq2seq.precision import PRECISIONS, tune_process_memory
from seq2seq.search import SearchConfig
from seq2seq.translator import DEFAULT_SEARCH, Translation, Translator, resolve_device

WINDOW = 1000  # input lines read and sorted by length at a time; each line is written once it and those before are done


def read_lines(path: str, *, option: str = "--input") -> list[str]:
    """The lines of a UTF-8 file, or of stdin for "-", without their line ends.

    Lines end at "\n" only (a "\r" before it goes too): str.splitlines would also split at
    U+2028, U+0085, form feeds and the like inside a sentence, and the output would then have more
    lines than the input, out of step with the references. Stdin is read as bytes, so it is UTF-8
    whatever the locale says, and a bad byte is reported with its line like a file's. A UTF-8 BOM
    (which Windows editors write) is not part of the first sentence.
    """
    name = "stdin" if path == "-" else path
    try:
        data = read_stdin() if path == "-" else Path(path).read_bytes()
    except FileNotFoundError:
        raise SystemExit(f"error: {option} {path} does not exist") from None
    except OSError as error:
        raise SystemExit(f"error: {option}: cannot read {path}: {error.strerror}") from None
    try:
        text = data.decode("utf-8-sig")
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


def utf8_stdout() -> TextIO:
    """stdout writing UTF-8, as the input is read, whatever the locale's encoding says."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)  # a StringIO put in place of stdout has none
    if reconfigure is not None:
        reconfigure(encoding="utf-8")
    return sys.stdout


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


def search_flags() -> dict[str, list[str]]:
    """Each SearchConfig field's CLI flags: its older spelling first where it has one (`--beam`), then its
    name with dashes (`--beam-size`). The first is the one messages use."""
    return {f.name: [flag for flag in (f.metadata["flag"], f"--{f.name.replace('_', '-')}") if flag]
            for f in fields(SearchConfig)}


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per SearchConfig field (its name with dashes; older spellings kept), and the run's options."""
    group = parser.add_argument_group("search (SearchConfig in seq2seq/search.py)")
    hints = typing.get_type_hints(SearchConfig)
    all_flags = search_flags()
    for f in fields(SearchConfig):
        flags = all_flags[f.name]
        if hints[f.name] is bool:
            group.add_argument(*flags, dest=f.name, action="store_true", help=f.metadata["help"])
        else:
            kind = float if hints[f.name] is float else int  # int | None (the seed) is an int when given
            # None: not given. The checkpoint's tuned value (its search defaults) then applies, else ours.
            group.add_argument(*flags, dest=f.name, type=kind, default=None,
                               help=f"{f.metadata['help']} (default: the checkpoint's, else {f.default})")
    parser.add_argument("--max-tokens", type=int, default=8192, help="source tokens per batch")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="auto: bf16 where bf16 matmuls are fast here (AMX, AVX512-BF16, a GPU from Ampere on), else fp32; "
                             "int8 (CPU): quantised linear layers, faster, outputs differ slightly (default: auto)")


def flag_message(error: ConfigError) -> str:
    """A SearchConfig error in the CLI's words: `--beam` where the config says `beam_size`."""
    flags = {name: names[0] for name, names in search_flags().items()}
    problem = re.sub(r"\b[a-z_]+\b", lambda word: flags.get(word[0], word[0]), error.problem)
    return f"{flags.get(error.field, error.field)}: {problem}"


def search_config(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  defaults: SearchConfig = DEFAULT_SEARCH) -> SearchConfig:
    """The flags given, over `defaults` (a checkpoint's `translator.search` once it is loaded), as a
    SearchConfig, or a usage error naming the flag; the device and batch size checked too."""
    given = {f.name: getattr(args, f.name) for f in fields(SearchConfig)
             if getattr(args, f.name) is not None and getattr(args, f.name) is not False}
    try:
        search = dataclasses.replace(defaults, **given)
    except ConfigError as error:
        parser.error(flag_message(error))
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    try:
        resolve_device(args.device)
    except ValueError as error:
        parser.error(f"--device: {error}")
    return search


def checkpoint_search(parser: argparse.ArgumentParser, args: argparse.Namespace, translator: Translator) -> SearchConfig:
    """The search to run: the flags given over the checkpoint's tuned defaults, checked against its vocabulary."""
    search = search_config(parser, args, translator.search)
    try:
        search.check_vocabulary(translator.model.config.vocab_size)
    except ConfigError as error:
        raise SystemExit(f"error: {flag_message(error)}") from None
    return search


def load_translator(args: argparse.Namespace, search: SearchConfig) -> Translator:
    """The checkpoint's Translator, checked against the search options, or exit with one line (no traceback)."""
    try:
        translator = Translator.from_checkpoint(args.checkpoint, device=args.device, precision=args.precision)
        search.check_vocabulary(translator.model.config.vocab_size)
    except ConfigError as error:
        raise SystemExit(f"error: {flag_message(error)}") from None
    except (CheckpointError, OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    return translator


def one_line_warnings() -> None:
    """Warnings (a truncated line) as one `warning:` line on stderr, each one shown, not the first only."""
    warnings.formatwarning = lambda message, *_args, **_kwargs: f"warning: {message}\n"
    warnings.simplefilter("always", UserWarning)


def check_output_path(path: str, *, inputs: list[str]) -> None:
    """Refuse an output that cannot be written now, not after the whole input has been translated."""
    if path == "-":
        return
    target = Path(path)
    folder = target.parent
    if not path:
        raise SystemExit("error: --output is empty; give a file path, or - for stdout")
    if target.is_dir():
        raise SystemExit(f"error: --output {path} is a folder; give a file path")
    if folder.exists() and not folder.is_dir():
        raise SystemExit(f"error: --output {path}: {folder} is a file, not a folder")
    if not folder.is_dir():
        raise SystemExit(f"error: --output {path}: the folder {folder} does not exist; create it first")
    for other in inputs:
        if other != "-" and target.exists() and Path(other).exists() and target.samefile(other):
            raise SystemExit(f"error: --output {path} is the input file {other}: it would be overwritten")
    existed = target.exists()
    try:
        with open(target, "a", encoding="utf-8"):  # "a": an existing file is not emptied by the check
            pass
    except OSError as error:
        raise SystemExit(f"error: --output {path} cannot be written ({error.strerror})") from None
    if not existed:
        target.unlink()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m seq2seq.translate", description=__doc__.split("\n\n")[1])
    parser.add_argument("--checkpoint", required=True, help="a .ckpt written by python -m seq2seq.fit")
    parser.add_argument("--input", default="-", help="one sentence per line; - for stdin")
    parser.add_argument("--output", default="-", help="where translations go; - for stdout")
    parser.add_argument("--ref", default=None, help="reference translations, line-aligned: print BLEU and chrF")
    add_search_arguments(parser)
    args = parser.parse_args(argv)
    search = search_config(parser, args)
    check_output_path(args.output, inputs=[args.input] + ([args.ref] if args.ref else []))
    one_line_warnings()

    sources = read_lines(args.input)
    references = read_lines(args.ref, option="--ref") if args.ref else None
    if references is not None and len(references) != len(sources):
        source_name = "stdin" if args.input == "-" else args.input
        raise SystemExit(
            f"error: {source_name} has {len(sources)} lines but {args.ref} has {len(references)}; "
            "the references must be line-aligned with the input"
        )
    translator = load_translator(args, search)
    search = checkpoint_search(parser, args, translator)
    start = time.perf_counter()
    best: list[str] = []
    output = utf8_stdout() if args.output == "-" else open(args.output, "w", encoding="utf-8")  # noqa: SIM115
    try:
        write_translations(translator.translate_stream(sources, search, max_tokens=args.max_tokens, window=WINDOW),
                           output, nbest=search.nbest, best=best, total=len(sources))
        if output is not sys.stdout:
            output.close()  # inside the try: a close that fails (quota, NFS) is a write error too
    except KeyboardInterrupt:
        print(f"\ninterrupted: {where(args)} holds the translations of the first {len(best)} lines", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:  # `... | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        raise SystemExit(141) from None
    except OSError as error:  # a full disk, /dev/full
        raise SystemExit(f"error: cannot write {where(args)} ({error.strerror}); it holds the translations of "
                         f"at most the first {len(best)} lines") from None
    finally:
        if output is not sys.stdout and not output.closed:
            try:
                output.close()
            except OSError:
                pass  # an error is already being reported
    print(f"translated {len(sources)} lines in {time.perf_counter() - start:.1f}s ({translator.precision}, "
          f"{torch.get_num_threads()} threads, {describe(search)})", file=sys.stderr)
    if references is not None:
        bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
        print(f"{bleu.corpus_score(best, [references])}  {bleu.get_signature()}", file=sys.stderr)
        print(f"{chrf.corpus_score(best, [references])}  {chrf.get_signature()}", file=sys.stderr)


def describe(search: SearchConfig) -> str:
    if search.sampling:
        return "sampling"
    return "greedy" if search.beam_size == 1 else f"beam {search.beam_size}, length penalty {search.length_penalty:g}"


def where(args: argparse.Namespace) -> str:
    return "stdout" if args.output == "-" else f"--output {args.output}"


def write_translations(results, output: TextIO, *, nbest: int, best: list[str], total: int | None = None,
                       progress: TextIO | None = None) -> None:
    """Write each line's translation(s) as soon as it and every line before it are done, flushed at
    once; `best` collects the 1-bests. A progress bar goes to `progress` if it is a terminal (not
    when piped or redirected, where it would fill a log)."""
    progress = progress if progress is not None else sys.stderr
    with tqdm(total=total, file=progress, unit=" lines", dynamic_ncols=True, leave=False,
              disable=not progress.isatty()) as bar:
        for i, hyps in enumerate(results):
            best.append(one_line(hyps[0].text) if hyps else "")
            if nbest > 1:
                text = "".join(f"{line}\n" for line in format_nbest(hyps, nbest=nbest, prefix=f"{i}\t"))
            else:
                text = best[-1] + "\n"
            output.write(text)
            output.flush()  # one line at a time: a reader (or an interrupted run) has every line done
            bar.update()


if __name__ == "__main__":
    tune_process_memory()  # a process of its own: large blocks reused, oneDNN's kernel cache bounded
    main()
