"""Multilingual quality on Multi30k's test2016: BLEU per direction, zero-shot against pivoting through English.

    python bench/multilingual.py --checkpoint checkpoints/multi30k_multilingual/best.ckpt [--checkpoint ...]
                                 [--zero-shot de-fr fr-de] [--beam 5] [--length-penalty 1.0] [--lines N]

For each checkpoint (a multilingual model of `python -m seq2seq.fit`, e.g. configs/multi30k_multilingual.yaml's, or
a bilingual one to compare with, whose one direction is scored alike):
every direction it was trained on, then each --zero-shot direction (never trained) translated directly (the target's
tag on a source it never saw with it) and by pivoting through English with the same model (src→en, then en→tgt), all
scored with sacreBLEU against test_2016_flickr's references (Multi30k is 4-way parallel: the same images' captions).
`off-target` is the share of outputs a language identifier (lingua, the server's) reads as another of the model's
languages: what goes wrong first in zero-shot translation (Zhang et al. 2020). One search for every row (beam,
length penalty: the same for every model, so that tuning does not decide the comparison). Prints a Markdown table.
"""

import argparse
import gzip
import sys
from pathlib import Path

import sacrebleu
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seq2seq.decoding.config import SearchConfig  # noqa: E402
from seq2seq.inference.translator import Translator  # noqa: E402
from seq2seq.serve.languages import Detector  # noqa: E402

MULTI30K = Path(__file__).resolve().parents[2] / "shared/data/multi30k"


def test_lines(lang: str, limit: int | None) -> list[str]:
    with gzip.open(MULTI30K / f"test_2016_flickr.{lang}.gz", "rt", encoding="utf-8") as f:
        return f.read().split("\n")[:-1][:limit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", action="append", required=True)
    parser.add_argument("--zero-shot", nargs="*", default=["de-fr", "fr-de"], help="directions never trained")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--length-penalty", type=float, default=1.0)
    parser.add_argument("--lines", type=int, default=None, help="the first N test lines (default: all 1,000)")
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()
    search = SearchConfig(beam_size=args.beam, length_penalty=args.length_penalty)
    print(f"test_2016_flickr, beam {args.beam}, length penalty {args.length_penalty:g}, {args.precision}, "
          f"{torch.get_num_threads()} threads; sacreBLEU {sacrebleu.__version__}\n")
    print("| checkpoint | tags | direction | kind | BLEU | chrF | off-target |")
    print("|---|---|---|---|---|---|---|")
    for path in args.checkpoint:
        translator = Translator.from_checkpoint(path, precision=args.precision)
        trained = list(translator.directions) or [(translator.src_lang, translator.tgt_lang)]  # (a bilingual baseline)
        languages = sorted({lang for pair in trained for lang in pair})
        detector = Detector(languages)
        rows = [(src, tgt, "trained") for src, tgt in trained]
        tags = translator.target_tag if translator.directions else "none"
        rows += [(*pair.split("-"), "zero-shot") for pair in args.zero_shot if translator.directions]
        for src, tgt, kind in rows:
            sources, references = test_lines(src, args.lines), test_lines(tgt, args.lines)
            ways = [(kind, translator.for_target(tgt, src_lang=src).translate(sources, search))]
            if kind == "zero-shot":  # the same model, through English
                english = translator.for_target("en", src_lang=src).translate(sources, search)
                ways.append(("pivot via en", translator.for_target(tgt, src_lang="en").translate(english, search)))
            for name, outputs in ways:
                bleu = sacrebleu.corpus_bleu(outputs, [references]).score
                chrf = sacrebleu.corpus_chrf(outputs, [references]).score
                detected = [detector.detect(text, among=languages)[0] for text in outputs if text.strip()]
                off = sum(lang != tgt for lang in detected) / max(len(detected), 1)
                print(f"| {Path(path).parent.name}/{Path(path).name} | {tags} | {src}→{tgt} | {name} | {bleu:.2f} | {chrf:.2f} "
                      f"| {100 * off:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
