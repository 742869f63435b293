"""Length-penalty tuning on a Translator: the penalty with the best corpus BLEU on the validation set
at a beam size, stored in the checkpoint as its translation default. `python -m seq2seq.fit` runs it
after training when its config has a TuneLengthPenalty callback (training/callbacks.py), which names
the checkpoint and the validation set; the decoding is here, on the inference side of the house.
"""

import sacrebleu

from seq2seq.checkpoint import CheckpointError, store_search_defaults
from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.translator import Translator


def choose_length_penalty(translator: Translator, sources: list[str], references: list[str], *, beam_size: int,
                          length_penalties: list[float], directions: list[tuple[str, str]] | None = None,
                          ) -> tuple[float, dict[float, float]]:
    """The length penalty with the highest corpus BLEU on (sources, references), the first on a tie; and
    every penalty's BLEU. `directions`: a multilingual model's (src, tgt) of each pair; the BLEU is then the mean
    of each direction's corpus BLEU, as validation's val_bleu is (no direction left behind)."""
    groups: dict[tuple[str, str] | None, list[int]] = {}  # (None: the one direction of a bilingual model)
    for i, direction in enumerate(directions or [None] * len(sources)):
        groups.setdefault(direction, []).append(i)
    scores = {}
    for alpha in length_penalties:
        search, bleus = SearchConfig(beam_size=beam_size, length_penalty=alpha), []
        for direction, rows in groups.items():
            chosen = translator if direction is None else translator.for_target(direction[1], src_lang=direction[0])
            hypotheses = chosen.translate([sources[i] for i in rows], search)
            bleus.append(sacrebleu.metrics.BLEU().corpus_score(hypotheses, [[references[i] for i in rows]]).score)
        scores[alpha] = sum(bleus) / len(bleus)
    return max(scores, key=lambda alpha: scores[alpha]), scores


def tune_length_penalty(*, checkpoint: str, sources: list[str], references: list[str], beam_size: int,
                        length_penalties: list[float], device: str,
                        directions: list[tuple[str, str]] | None = None) -> None:
    """choose_length_penalty on the checkpoint's Translator, then stored in it; one line says what was
    chosen, and a store that fails says what to pass instead (the training run is kept whatever happens)."""
    translator = Translator.from_checkpoint(checkpoint, device=device)
    best, scores = choose_length_penalty(translator, sources, references, beam_size=beam_size,
                                         length_penalties=length_penalties, directions=directions)
    table = ", ".join(f"{alpha:g}: {bleu:.2f}" for alpha, bleu in scores.items())
    table += " (the directions' mean)" if directions is not None else ""
    try:
        store_search_defaults(checkpoint, {"beam_size": beam_size, "length_penalty": best})
    except (OSError, CheckpointError) as error:
        print(f"length penalty on validation (beam {beam_size}, BLEU): {table}; error: cannot store {best:g} in "
              f"{checkpoint} ({error}); pass --length-penalty {best:g} when translating", flush=True)
        return
    print(f"length penalty on validation (beam {beam_size}, BLEU): {table}; {best:g} stored in {checkpoint} as "
          "the translation default", flush=True)
