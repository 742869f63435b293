"""How well a model's attention alignments agree with an external aligner's, per decoder layer.

    python bench/alignments.py --checkpoint checkpoints/multi30k-ende/best.ckpt \
        --src test.en --tgt test.de --reference test.en-de.gdfa

The reference is Pharaoh `i-j` lines for the same pairs (bench/eflomal_reference.py writes eflomal's);
no gold alignments exist for Multi30k, so this measures agreement, not error. Each reference translation
is teacher-forced (seq2seq/decoding/scoring.py's way), and each target token is aligned to the source token its
layer's cross-attention (averaged over heads) weighs most, then mapped to words as
`SearchConfig.alignments` does. Two readings per layer: the attention of the step that *predicts* the
token (what seq2seq reports), and of the step that *reads* it (one position later), which some layers
align better. Prints precision, recall and F1 against the reference, and AER taking the reference as
sure links; the layer `scoring.alignment_layer` picks is marked.
"""

import argparse
import gzip
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seq2seq.decoding.scoring import alignment_layer  # noqa: E402
from seq2seq.inference.translator import Translator, pad_batch  # noqa: E402


def read(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def pharaoh(line: str) -> set[tuple[int, int]]:
    return {(int(i), int(j)) for i, j in (pair.split("-") for pair in line.split())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--tgt", required=True)
    parser.add_argument("--reference", required=True, help="Pharaoh lines for the same pairs")
    parser.add_argument("--batch", type=int, default=50)
    args = parser.parse_args()
    translator = Translator.from_checkpoint(args.checkpoint, precision="fp32")
    tok, model = translator.tokenizer, translator.model
    sources, targets, reference = read(args.src), read(args.tgt), [pharaoh(x) for x in read(args.reference)]
    layers = model.config.num_decoder_layers
    found: dict[tuple[int, str], list[set[tuple[int, int]]]] = {(k, r): [] for k in range(layers)
                                                                  for r in ("predicts", "reads")}
    for start in range(0, len(sources), args.batch):
        src_ids = tok.encode_source([s.strip() for s in sources[start : start + args.batch]])
        tgt_ids = tok.encode_target([t.strip() for t in targets[start : start + args.batch]])
        src = pad_batch(src_ids, pad=tok.pad_id, device=translator.device)
        width = max(map(len, tgt_ids)) + 1
        tgt_in = torch.full((len(tgt_ids), width), tok.pad_id)
        for row, t in enumerate(tgt_ids):
            tgt_in[row, : len(t) + 1] = torch.tensor([tok.bos_id, *t])
        with torch.inference_mode():
            memory = model.encode(src)
            for k in range(layers):
                _, attention = model.decode_with_attention(tgt_in, memory, src != tok.pad_id, layer=k)  # (B, T, S)
                best = attention.argmax(dim=-1).tolist()
                for row, (s, t) in enumerate(zip(src_ids, tgt_ids, strict=True)):
                    source_words = tok.word_indices(s[: tok.source_tokens(s)])
                    target_words = tok.word_indices(t)
                    for reading, offset in (("predicts", 0), ("reads", 1)):
                        positions = best[row][offset : offset + len(t)]
                        found[k, reading].append({(source_words[p], target_words[j]) for j, p in enumerate(positions)
                                                  if p < len(source_words)})
    print(f"{len(sources)} pairs, {sum(map(len, reference))} reference links; model {args.checkpoint}")
    print("layer  reading   precision  recall  F1     AER   links")
    for (k, reading), ours in found.items():
        hits = sum(len(a & b) for a, b in zip(ours, reference, strict=True))
        n_ours, n_ref = sum(map(len, ours)), sum(map(len, reference))
        precision, recall = hits / max(n_ours, 1), hits / max(n_ref, 1)
        f1 = 2 * precision * recall / max(precision + recall, 1e-9)
        aer = 1 - 2 * hits / max(n_ours + n_ref, 1)
        mark = " <- SearchConfig.alignments" if k == alignment_layer(layers) and reading == "predicts" else ""
        print(f"{k:5d}  {reading:8s}  {precision:9.3f}  {recall:6.3f}  {f1:5.3f}  {aer:5.3f}  {n_ours}{mark}")


if __name__ == "__main__":
    main()
