"""Export a trained checkpoint to CTranslate2, so it runs (fp32, int8, ...) with no seq2seq installed, or to
Hugging Face; or compile its decoder for this machine, kept for every later run here.

    python -m seq2seq.export --checkpoint checkpoints/multi30k/best.ckpt --to ctranslate2 --output ct2/ \
        [--quantization int8]
    python -m seq2seq.export --checkpoint checkpoints/multi30k/best.ckpt --to compiled [--precision auto] [--threads 1]

`--to compiled` builds the package the translate command, serve/translate.py, the server and Translator use with no
flag (seq2seq/inference/kept.py): for one precision and one count of intra-op threads a decoder thread (the
commands' default on a CPU is 1), in this machine's cache folder (XDG_CACHE_HOME, else ~/.cache).

The command (`python -m seq2seq.export`, or `seq2seq-export`); the work is seq2seq/interop/export.py's.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

from seq2seq.checkpoint import CheckpointError
from seq2seq.inference.kept import PACKAGED_PRECISIONS
from seq2seq.interop.export import (
    QUANTIZATIONS,
    ExportError,
    check_output,
    export_ctranslate2,
    export_huggingface,
    tag_usage,
)

PACKAGED_PRECISIONS_FLAG = ("auto", *PACKAGED_PRECISIONS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m seq2seq.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a .ckpt written by python -m seq2seq.fit")
    parser.add_argument("--to", required=True, choices=["ctranslate2", "huggingface", "compiled"],
                        help="the engine to export to; compiled: this machine's compiled decoder, kept for later runs")
    parser.add_argument("--output", default=None,
                        help="the folder to write, in a folder that exists (must not exist itself, unless --force); "
                             "not for --to compiled, which is kept in this machine's cache folder")
    parser.add_argument("--precision", choices=PACKAGED_PRECISIONS_FLAG, default="auto",
                        help="--to compiled: the precision the decoder runs in, as the translate command's --precision "
                             "(auto: bf16 where bf16 matmuls are fast here, else fp32; int8 compiles in each run)")
    parser.add_argument("--threads", type=int, default=1,
                        help="--to compiled: intra-op threads of each decoder thread, as the translate command's "
                             "--threads (default: 1, the commands' default on a CPU)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="CTranslate2 weight type (default: float32 as trained)")
    parser.add_argument("--force", action="store_true",
                        help="replace --output if it holds an earlier export (and nothing else)")
    args = parser.parse_args(argv)
    if args.to == "compiled":
        compile_for_this_machine(parser, args)
        return
    if args.output is None:
        parser.error(f"--to {args.to} needs --output")
    if args.to == "huggingface" and args.quantization:
        parser.error("--quantization is for --to ctranslate2")
    try:  # before the engine's import and the checkpoint's reading, which take seconds
        check_output(args.output, checkpoint=Path(args.checkpoint), force=args.force)
    except ExportError as error:
        raise SystemExit(f"error: {error}") from None
    output = Path(args.output)
    package = {"ctranslate2": "ctranslate2", "huggingface": "transformers"}[args.to]
    try:
        __import__(package)
    except ImportError:
        raise SystemExit(f"error: --to {args.to} needs the {package} package: pip install -e '.[export]'") from None
    try:
        if args.to == "ctranslate2":
            export_ctranslate2(args.checkpoint, output, quantization=args.quantization, force=args.force)
        else:
            export_huggingface(args.checkpoint, output, force=args.force)
    except (CheckpointError, ExportError) as error:
        raise SystemExit(f"error: {error}") from None
    print(f"wrote {output} ({args.to}{', ' + args.quantization if args.quantization else ''})")
    usage = tag_usage(args.checkpoint, args.to)
    if usage is not None:
        print(usage)


def compile_for_this_machine(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--to compiled: the checkpoint's decoder compiled and kept on this machine (a line per kind as it compiles), or
    found kept already; its folder printed."""
    if args.output is not None or args.quantization or args.force:
        parser.error("--to compiled takes no --output, --quantization or --force (it is kept in the machine's cache)")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    from seq2seq.cli import progress_line
    from seq2seq.inference.translator import Translator
    from seq2seq.model.compiled import CompileError

    try:
        translator = Translator.from_checkpoint(args.checkpoint, precision=args.precision, threads=args.threads,
                                                compiled=True, progress=progress_line)
    except (CheckpointError, OSError, ValueError, CompileError) as error:
        raise SystemExit(f"error: {error}") from None
    except KeyboardInterrupt:  # (the building thread, a daemon, maybe inside the C++ compiler, which the
        # interpreter's exit would abort under it: its temporary folder is all there is, leave at once)
        print("\ninterrupted while compiling: nothing was kept", file=sys.stderr, flush=True)
        os._exit(130)
    if translator.package is None:
        raise SystemExit(f"error: no compiled decoder is kept for a {translator.precision} model on "
                         f"{translator.device} (fp32 or bf16 on a CPU, absolute positions): --compile compiles it in "
                         f"each run")
    print(f"kept {translator.package} ({translator.precision}, decoder threads of {args.threads} intra-op "
          f"thread{'s' if args.threads > 1 else ''})")


def run() -> None:
    """The command, without gradients (nothing here trains)."""
    torch.set_grad_enabled(False)
    main()


if __name__ == "__main__":
    run()
