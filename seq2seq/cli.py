"""What the faces share (python -m seq2seq.translate, serve/translate.py, serve/server.py): one flag per
SearchConfig field, `open_translator` (the checkpoint's Translator and the search to run, or one line
saying what is wrong), how a translation is written as text, how a face reports warnings and a stop
(Ctrl-C or SIGTERM), and `check_output`, the one policy for what every face that writes a file or a folder
(translate, score, average, convert, export) may write. Faces import this, never each other.
"""

import argparse
import dataclasses
import os
import re
import signal
import sys
import time
import typing
import warnings
from dataclasses import fields

import torch

from seq2seq.checkpoint import CheckpointError
from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.documents import Translation
from seq2seq.inference.preparation import Compiled, resolve_device
from seq2seq.inference.translator import DEFAULT_SEARCH, Translator
from seq2seq.model import ConfigError
from seq2seq.model.compiled import CompileError
from seq2seq.precision import PRECISIONS

# ---------------------------------------------------------------------------------------------
# The search flags, and the Translator they run on.


def search_flags() -> dict[str, list[str]]:
    """Each SearchConfig field's CLI flags: its older spelling first where it has one (`--beam`), then its
    name with dashes (`--beam-size`), or `--no-` and the name for a switch that is on unless turned off
    (`--no-scores`). The first is the one messages use."""
    return {f.name: [f"--no-{f.name.replace('_', '-')}"] if f.default is True else
            [flag for flag in (f.metadata["flag"], f"--{f.name.replace('_', '-')}") if flag]
            for f in fields(SearchConfig)}


def add_search_arguments(parser: argparse.ArgumentParser, *, target: bool = True) -> None:
    """One flag per SearchConfig field (its name with dashes; older spellings kept), and the run's options:
    `--tgt-lang` unless `target` is False (a face whose requests name their target: the server)."""
    group = parser.add_argument_group("search (SearchConfig in seq2seq/decoding/config.py)")
    hints = typing.get_type_hints(SearchConfig)
    all_flags = search_flags()
    for f in fields(SearchConfig):
        flags = all_flags[f.name]
        if hints[f.name] is bool:  # None when not given: the checkpoint's value (its search defaults) applies
            group.add_argument(*flags, dest=f.name, action="store_const", const=f.default is not True, default=None,
                               help=f.metadata["help"])
        else:
            kind = float if hints[f.name] is float else int  # int | None (the seed) is an int when given
            # None: not given. The checkpoint's tuned value (its search defaults) then applies, else ours.
            group.add_argument(*flags, dest=f.name, type=kind, default=None,
                               help=f"{f.metadata['help']} (default: the checkpoint's, else {f.default})")
    if target:
        parser.add_argument("--tgt-lang", default=None,
                            help="a multilingual model's target language (one of its checkpoint's; default: its only one)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="source tokens per batch")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    parser.add_argument("--workers", type=int, default=None,
                        help="batches decoded at once, each on a thread of its own (default: one per core on the CPU; "
                             "one on a GPU: docs/performance/threads.md#workers)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of each worker (default: the cores over the workers: 1 on the CPU, "
                             "all of them for a GPU's one worker)")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="auto: bf16 where bf16 matmuls are fast here (AMX, AVX512-BF16, a GPU from Ampere on), else fp32; "
                             "int8 (CPU): quantised linear layers, faster, outputs differ slightly (default: auto)")
    parser.add_argument("--compile", nargs="?", choices=COMPILE_CHOICES, default="auto", const="on",
                        help="auto: decode with this model's compiled decoder where one is kept on this machine "
                             "(python -m seq2seq.export --to compiled builds it, once), else eager; on (--compile "
                             "alone): that kept decoder, built first where there is none (minutes, once per machine, "
                             "model, precision and --threads; int8 and GPUs compile in every run); off: eager; jit: "
                             "compiled in this run (torch.compile: minutes, each run), nothing kept. "
                             "Absolute positions only (docs/performance/compiled-decoding.md) (default: auto)")


COMPILE_CHOICES = ("auto", "on", "off", "jit")
COMPILED: dict[str, Compiled] = {"auto": "auto", "on": True, "off": False, "jit": "jit"}
"""--compile's values as Translator's `compiled`."""


def flag_message(error: ConfigError) -> str:
    """A SearchConfig error in the CLI's words: `--beam` where the config says `beam_size`."""
    flags = {name: names[0] for name, names in search_flags().items()}
    problem = re.sub(r"\b[a-z_]+\b", lambda word: flags.get(word[0], word[0]), error.problem)
    return f"{flags.get(error.field, error.field)}: {problem}"


def search_config(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  defaults: SearchConfig = DEFAULT_SEARCH) -> SearchConfig:
    """The flags given, over `defaults` (a checkpoint's `translator.search` once it is loaded), as a
    SearchConfig, or a usage error naming the flag."""
    given = {f.name: getattr(args, f.name) for f in fields(SearchConfig) if getattr(args, f.name) is not None}
    try:
        return dataclasses.replace(defaults, **given)
    except ConfigError as error:
        parser.error(flag_message(error))


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SearchConfig:
    """Every flag of add_search_arguments checked before anything is read or loaded (a bad --beam or
    --device must not wait for a large checkpoint): the search over SearchConfig's defaults, which
    open_translator builds again over the checkpoint's, --max-tokens and --device."""
    search = search_config(parser, args)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    for flag in ("workers", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    try:
        resolve_device(args.device)
    except ValueError as error:
        parser.error(f"--device: {error}")
    return search


def parallelism(args: argparse.Namespace) -> tuple[int, int]:
    """(workers, intra-op threads each) from --workers and --threads over the cores this process has
    (torch's thread count: OMP_NUM_THREADS, or the cores). Neither given: one worker per core, each on
    one thread, the fastest configuration for many sentences; one given: the other fills the cores. On a
    GPU (any --device but cpu) the default is one worker: the workers' threads share one device and each
    waits on the others' kernels at every step (docs/performance/threads.md#workers)."""
    cores = torch.get_num_threads()
    if args.workers is None and torch.device(args.device).type != "cpu":
        return 1, args.threads or cores
    if args.workers is None:
        threads = args.threads or 1
        return max(1, cores // threads), threads
    return args.workers, args.threads or max(1, cores // args.workers)


def open_translator(parser: argparse.ArgumentParser, args: argparse.Namespace, *, parallel: bool = True,
                    served_by: tuple[int, int] | None = None) -> tuple[Translator, SearchConfig]:
    """The checkpoint's Translator (`--checkpoint`, `--device`, `--precision`, `--compile`, `--tgt-lang` where the face
    has it, and unless `parallel` is False, `--workers` and `--threads`) and the search to run: the flags given over
    the checkpoint's tuned defaults, checked against its vocabulary. Anything wrong is one line naming the file or the flag,
    and an exit."""
    workers, threads = parallelism(args) if parallel else (1, None)
    try:
        translator = Translator.from_checkpoint(args.checkpoint, device=args.device, precision=args.precision,
                                                workers=workers, threads=threads, compiled=COMPILED[args.compile],
                                                progress=progress_line, served_by=served_by)
    except (CheckpointError, OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    except CompileError as error:  # (--compile building the kept decoder)
        raise SystemExit(f"error: {error}; run it with --compile off") from None
    try:
        if "tgt_lang" in args:  # (a face without it routes each request to its target: the server)
            translator = translator.for_target(args.tgt_lang) if args.tgt_lang else translator
            translator.source_tag()  # (a multilingual model's target chosen: said before any input is read)
    except ValueError as error:
        raise SystemExit(f"error: --tgt-lang: {error}") from None
    if translator.compiled is False and translator.kept_at is not None and args.compile == "auto":
        print(eager_note(translator, checkpoint=args.checkpoint), file=sys.stderr, flush=True)
    search = search_config(parser, args, translator.search)
    try:
        search.check_model(vocab_size=translator.model.config.vocab_size, max_positions=translator.model.config.max_positions)
    except ConfigError as error:
        raise SystemExit(f"error: {flag_message(error)}") from None
    return translator, search


def progress_line(line: str) -> None:
    """Translator's `progress` in a command: each kind of the kept compiled decoder as it builds, on stderr."""
    print(line, file=sys.stderr, flush=True)


def eager_note(translator: Translator, *, checkpoint: str) -> str:
    """The line a command prints where --compile auto found no compiled decoder kept for its model: decoding runs
    eager, and how to make it run compiled from the next run on (never silently slow)."""
    threads = f" --threads {translator.decoder_threads}" if translator.decoder_threads != 1 else ""
    return (f"note: decoding eager: no compiled decoder is kept for this model here ({translator.precision}, "
            f"decoder threads of {translator.decoder_threads} intra-op thread{'s' if translator.decoder_threads > 1 else ''}); `python -m seq2seq.export --checkpoint "
            f"{checkpoint} --to compiled --precision {translator.precision}{threads}` builds it once (minutes), or "
            f"run with --compile (docs/performance/compiled-decoding.md#kept)")


def compile_before_answering(translator: Translator, *, threads: int | None = None, face: str) -> None:
    """--compile in a tool that answers as sentences come (the server, serve/translate.py): every kind of decoding
    step compiled before the first sentence (Translator.compile_decoding, for decoder threads of `threads`), with a
    line before (compiling is long and silent: docs/performance/compiled-decoding.md#cost) and after. A step that
    cannot be compiled is one line and an exit, as is Ctrl-C (130) or SIGTERM (143) while it compiles; `face` names
    what is not started ("the server"). Nothing to do for a kept compiled decoder (Translator.package): it is whole."""
    if not translator.compiled or translator.package is not None:
        return
    print(f"{translator.pairs}: compiling the encoder and the decoding steps (--compile; seconds to a minute a kind, in every run)",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        kinds = translator.compile_decoding(threads=threads)
    except CompileError as error:
        raise SystemExit(f"error: {error}; {face} was not started: run it without --compile") from None
    except KeyboardInterrupt as error:
        stop, status = interruption(error)
        print(f"\n{stop} while compiling the decoding steps; {face} was not started", file=sys.stderr, flush=True)
        # The compiling thread is a daemon, maybe inside inductor's C++, which the interpreter's exit aborts under
        # it ("terminate called without an active exception", exit 134): nothing is written yet, leave at once.
        os._exit(status)
    print(compiled_line(translator, kinds=kinds, seconds=time.perf_counter() - started), file=sys.stderr, flush=True)


def compiled_line(translator: Translator, *, kinds: int, seconds: float) -> str:
    """The line a tool prints once `kinds` kinds of call were compiled (compile_before_answering; the server's app)."""
    return (f"{translator.pairs}: {kinds} kinds of call (encoder, cross-attention "
            f"projection, decoding step) compiled in {seconds:.0f} s (--compile)")


def describe(search: SearchConfig) -> str:
    if search.sampling:
        return "sampling"
    return "greedy" if search.beam_size == 1 else f"beam {search.beam_size}, length penalty {search.length_penalty:g}"


# ---------------------------------------------------------------------------------------------
# Where a face writes: one policy for every --output.


def one_line(text: str) -> str:
    """A translation as one output line: the model can emit newline bytes (byte-fallback pieces)."""
    return text.replace("\r", " ").replace("\n", " ")


def pharaoh(alignment: list[tuple[int, int]]) -> str:
    """Word alignments as Pharaoh's `i-j` pairs (source word i, translation word j), space-separated."""
    return " ".join(f"{i}-{j}" for i, j in alignment)


def with_extras(text: str, translation: Translation | None, search: SearchConfig) -> str:
    """A translation's line with the columns `search` asks for: `<TAB>alignment` (Pharaoh), then
    `<TAB>token scores` (one per token, then the final EOS's); an empty line's columns are empty."""
    columns = [text]
    if search.alignments:
        columns.append(pharaoh(translation.alignment or []) if translation is not None else "")
    if search.token_scores:
        scores = translation.token_scores if translation is not None else None
        columns.append(" ".join(f"{score:.4f}" for score in scores or []))
    return "\t".join(columns)


def format_nbest(hyps: list[Translation], *, nbest: int, prefix: str = "",
                 search: SearchConfig = DEFAULT_SEARCH) -> list[str]:
    """`prefix score<TAB>translation` lines, one per hypothesis (beam search gives `nbest`), with the
    columns `search` asks for (`with_extras`).

    An empty input line has no hypotheses; it gets `nbest` empty translations with score 0 (the
    log-probability of the only possible output), so that it too gives `nbest` lines.
    """
    if not hyps:
        return [with_extras(f"{prefix}{0.0:.4f}\t", None, search)] * nbest
    return [with_extras(f"{prefix}{t.score:.4f}\t{one_line(t.text)}", t, search) for t in hyps]


def one_line_warnings() -> None:
    """Warnings (a truncated line) as one `warning:` line on stderr, each one shown, not the first only."""
    warnings.formatwarning = lambda message, *_args, **_kwargs: f"warning: {message}\n"
    warnings.simplefilter("always", UserWarning)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler's time limit, `kill`, a supervisor's stop), raised in the main thread where Ctrl-C's
    KeyboardInterrupt is (`stop_on_sigterm`), so that a face keeps and reports its work as it does for Ctrl-C: its
    output cut to whole lines, one line saying how far it got, and exit status 143 (128 + SIGTERM), not 130."""


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises Terminated in the main thread. Python's default ends the process at once: exit 143
    with no line, a file of translations cut wherever it was, and nothing saying how far it got."""
    signal.signal(signal.SIGTERM, _terminated)


def _terminated(_number: int, _frame: object) -> None:
    # A second SIGTERM until the face has cut its output to whole lines (`interruption`) is ignored: raised again
    # inside the cut, it would leave a part of a line.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


def interruption(error: KeyboardInterrupt) -> tuple[str, int]:
    """How a face names a stop and the exit status it ends with: Ctrl-C ("interrupted", 130); SIGTERM ("stopped by
    SIGTERM", 143). Called once the face's output is cut to whole lines, it also gives SIGTERM back to Python's
    default: the exit may still wait for a decoder thread's batch, or its compile, and a second SIGTERM
    then ends the process at once, as a second Ctrl-C does."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return ("stopped by SIGTERM", 143) if isinstance(error, Terminated) else ("interrupted", 130)
