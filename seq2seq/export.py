"""Export a trained checkpoint to CTranslate2, so it runs (fp32, int8, ...) with no seq2seq installed.

    python -m seq2seq.export --checkpoint checkpoints/multi30k/best.ckpt --to ctranslate2 --output ct2/ \
        [--quantization int8]

The command (`python -m seq2seq.export`, or `seq2seq-export`); the work is seq2seq/interop/export.py's.
"""

import argparse
from pathlib import Path

import torch

from seq2seq.checkpoint import CheckpointError
from seq2seq.interop.export import (
    QUANTIZATIONS,
    ExportError,
    check_output,
    export_ctranslate2,
    export_huggingface,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m seq2seq.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a .ckpt written by python -m seq2seq.fit")
    parser.add_argument("--to", required=True, choices=["ctranslate2", "huggingface"], help="the engine to export to")
    parser.add_argument("--output", required=True,
                        help="the folder to write, in a folder that exists (must not exist itself, unless --force)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="CTranslate2 weight type (default: float32 as trained)")
    parser.add_argument("--force", action="store_true",
                        help="replace --output if it holds an earlier export (and nothing else)")
    args = parser.parse_args(argv)
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


def run() -> None:
    """The command, without gradients (nothing here trains)."""
    torch.set_grad_enabled(False)
    main()


if __name__ == "__main__":
    run()
