"""Import a pretrained Hugging Face Marian model (the 1,000+ OPUS-MT models) as a checkpoint of ours.

    python -m seq2seq.convert --from huggingface Helsinki-NLP/opus-mt-de-en --output opus-mt-de-en.ckpt
    python -m seq2seq.convert --from huggingface ./opus-mt-de-en/ --output de-en.ckpt --src-lang de --tgt-lang en

The command (`python -m seq2seq.convert`, or `seq2seq-convert`); the work is seq2seq/interop/convert.py's.
"""

import argparse

import torch

from seq2seq.checkpoint import CheckpointError
from seq2seq.interop.convert import ConvertError, convert_huggingface


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m seq2seq.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source_format", required=True, choices=["huggingface"],
                        help="the toolkit the model comes from")
    parser.add_argument("source", metavar="SRC", help="a model folder, or a Hub id (Helsinki-NLP/opus-mt-de-en)")
    parser.add_argument("--output", required=True, help="the checkpoint to write (.ckpt), in a folder that exists")
    parser.add_argument("--src-lang", default=None, help="source language code (default: the model's record)")
    parser.add_argument("--tgt-lang", default=None,
                        help="target language code (default: the model's record); for a multi-target model (>>fra<< "
                             "tags), the one target to keep (default: every tagged language)")
    parser.add_argument("--force", action="store_true", help="replace --output if it is a file that holds anything")
    args = parser.parse_args(argv)
    try:
        convert_huggingface(args.source, args.output, src_lang=args.src_lang, tgt_lang=args.tgt_lang, force=args.force)
    except (ConvertError, CheckpointError) as error:
        raise SystemExit(f"error: {error}") from None
    print(f"wrote {args.output} (from {args.source})")


def run() -> None:
    """The command, without gradients (nothing here trains)."""
    torch.set_grad_enabled(False)
    main()


if __name__ == "__main__":
    run()
