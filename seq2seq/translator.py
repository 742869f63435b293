"""Translator: load a training checkpoint and translate batches of sentences.

    translator = Translator.from_checkpoint("checkpoints/multi30k/best.ckpt")
    translator.translate(["Ein Hund läuft.", "Zwei Männer."], beam_size=5)

This is the one place that reads checkpoints. A checkpoint written by training carries the model
config, the tokenizer (serialized sentencepiece proto) and the language pair under the key
"seq2seq", as plain types, so it loads with `torch.load(weights_only=True)` and needs no other file.

Inputs are batched by a token budget over the sentences sorted by length (little padding, so
little wasted compute), and the results are put back in input order. An empty line translates to
an empty line; a line longer than the model's `max_positions` is truncated, with a warning.
"""

import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from seq2seq.model import Transformer, TransformerConfig
from seq2seq.search import Hypothesis, beam_search, greedy, sample
from seq2seq.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

CHECKPOINT_KEY = "seq2seq"  # where module.py writes what inference needs; bump the format on any change
CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class Translation:
    text: str
    score: float
    """The search's ranking score (length-normalised log-probability for beam search)."""
    tokens: list[int]


def load_checkpoint(path: str | Path, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a training checkpoint with weights_only=True; say what is wrong if it is not ours."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"checkpoint {path} is a folder; give a .ckpt file in it (best.ckpt or last.ckpt)")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; training writes them under checkpoints/<run>/")
    not_ours = f"{path} is not a seq2seq training checkpoint; use a .ckpt written by `python -m seq2seq.fit`"
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        # weights_only refuses to build arbitrary Python objects (it would run the file's code);
        # ours hold tensors and plain types only, so a refusal means the file is someone else's.
        raise ValueError(f"{not_ours} (it stores Python objects that torch.load(weights_only=True) "
                         "refuses to load)") from error
    except (RuntimeError, EOFError, KeyError, ValueError) as error:
        # Not a torch archive at all: a bad magic number, a truncated zip, a KeyError from the legacy reader.
        raise ValueError(f"{not_ours} (torch.load cannot read it: not written by torch.save, or damaged)") from error
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(CHECKPOINT_KEY), dict) or (
        "state_dict" not in checkpoint
    ):
        raise ValueError(f"{not_ours} (no '{CHECKPOINT_KEY}' entry)")
    version = checkpoint[CHECKPOINT_KEY].get("format")
    if version != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{path} has checkpoint format {version}; this version of seq2seq reads format {CHECKPOINT_FORMAT}"
        )
    return checkpoint


def model_state_dict(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The Transformer's weights out of the LightningModule's state dict (keys 'model.*')."""
    return {key.removeprefix("model."): value for key, value in checkpoint["state_dict"].items() if key.startswith("model.")}


class Translator:
    def __init__(
        self,
        *,
        model: Transformer,
        tokenizer: Tokenizer,
        src_lang: str = "",
        tgt_lang: str = "",
        device: str | torch.device = "cpu",
        precision: Literal["fp32", "bf16"] = "fp32",
    ):
        torch.set_flush_denormal(True)  # denormal floats run ~100x slower on x86 CPUs (see module.py)
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.device = torch.device(device)
        self.precision = precision

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, *, device: str | torch.device = "cpu", precision: Literal["fp32", "bf16"] = "fp32"
    ) -> "Translator":
        checkpoint = load_checkpoint(path)
        meta = checkpoint[CHECKPOINT_KEY]
        model = Transformer(TransformerConfig.from_dict(meta["model_config"]))
        model.load_state_dict(model_state_dict(checkpoint))
        tokenizer = Tokenizer.from_bytes(meta["tokenizer"])
        return cls(
            model=model, tokenizer=tokenizer, src_lang=meta["src_lang"], tgt_lang=meta["tgt_lang"],
            device=device, precision=precision,
        )

    def translate(self, texts: list[str], *, beam_size: int = 5, **search_options: Any) -> list[str]:
        """One translation per input line, in input order; `search_options` are translate_nbest's."""
        nbest = self.translate_nbest(texts, beam_size=beam_size, nbest=1, **search_options)
        return [hyps[0].text if hyps else "" for hyps in nbest]

    def translate_nbest(
        self,
        texts: list[str],
        *,
        beam_size: int = 5,
        nbest: int = 1,
        length_penalty: float = 0.6,
        max_len_a: float = 1.5,
        max_len_b: int = 10,
        min_len: int = 0,
        no_repeat_ngram_size: int = 0,
        sampling: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        max_tokens: int = 8192,
    ) -> list[list[Translation]]:
        """Per input line its `nbest` translations, best first; an empty line gets [].

        beam_size=1 is greedy search; `sampling=True` draws one translation per line (temperature,
        top-k, top-p) instead. `max_tokens` bounds each batch: rows x (longest source) <= max_tokens, in
        source tokens; beam search then holds beam_size times as many decoder rows.
        """
        # Checked here, not only in the search, so that a file of empty lines fails like any other.
        if sampling:
            if nbest != 1:
                raise ValueError(f"sampling draws one translation per line: nbest must be 1, got {nbest}")
            if temperature <= 0:
                raise ValueError(f"temperature must be > 0, got {temperature}; for the argmax use beam_size=1")
        elif not 1 <= nbest <= beam_size:
            raise ValueError(f"nbest ({nbest}) must be between 1 and beam_size ({beam_size}); beam_size 1 is greedy")
        ids = self.tokenizer.encode([text.strip() for text in texts])
        ids = self._truncate(ids)
        results: list[list[Translation]] = [[] for _ in texts]
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        for batch in length_sorted_batches(ids, max_tokens=max_tokens):
            src = pad_batch([ids[i] for i in batch], device=self.device)  # (B, S)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
                if sampling:
                    hyps = sample(
                        self.model, src, bos=BOS_ID, eos=EOS_ID, pad=PAD_ID, temperature=temperature, top_k=top_k,
                        top_p=top_p, generator=generator, max_len_a=max_len_a, max_len_b=max_len_b,
                        min_len=min_len, no_repeat_ngram_size=no_repeat_ngram_size,
                    )
                    nbest_hyps = [[h] for h in hyps]
                elif beam_size == 1:
                    hyps = greedy(
                        self.model, src, bos=BOS_ID, eos=EOS_ID, pad=PAD_ID, max_len_a=max_len_a,
                        max_len_b=max_len_b, min_len=min_len, no_repeat_ngram_size=no_repeat_ngram_size,
                    )
                    nbest_hyps = [[h] for h in hyps]
                else:
                    nbest_hyps = beam_search(
                        self.model, src, bos=BOS_ID, eos=EOS_ID, pad=PAD_ID, beam_size=beam_size, nbest=nbest,
                        length_penalty=length_penalty, max_len_a=max_len_a, max_len_b=max_len_b,
                        min_len=min_len, no_repeat_ngram_size=no_repeat_ngram_size,
                    )
            for i, sentence_hyps in zip(batch, nbest_hyps, strict=True):
                results[i] = self._detokenize(sentence_hyps)
        return results

    def _detokenize(self, hyps: list[Hypothesis]) -> list[Translation]:
        texts = self.tokenizer.decode([h.tokens for h in hyps])
        return [Translation(text=t, score=h.score, tokens=h.tokens) for t, h in zip(texts, hyps, strict=True)]

    def _truncate(self, ids: list[list[int]]) -> list[list[int]]:
        limit = self.model.config.max_positions
        for i, sentence in enumerate(ids):
            if len(sentence) > limit:
                warnings.warn(
                    f"input line {i + 1} has {len(sentence)} tokens, more than the model's max_positions "
                    f"({limit}); translating its first {limit} tokens only",
                    stacklevel=3,
                )
                ids[i] = sentence[:limit]
        return ids


def length_sorted_batches(ids: list[list[int]], *, max_tokens: int) -> list[list[int]]:
    """Indices of the non-empty sentences, longest first, cut into batches of <= max_tokens padded tokens.

    Longest first: the first batch is the largest, so running out of memory happens at once, not
    at the end of a long file.
    """
    order = sorted((i for i, s in enumerate(ids) if s), key=lambda i: -len(ids[i]))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = len(ids[current[0]]) if current else len(ids[i])
        if current and (len(current) + 1) * longest > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def pad_batch(sentences: list[list[int]], *, device: torch.device) -> torch.Tensor:
    length = max(len(s) for s in sentences)
    src = torch.full((len(sentences), length), PAD_ID, dtype=torch.long)
    for row, sentence in enumerate(sentences):
        src[row, : len(sentence)] = torch.tensor(sentence, dtype=torch.long)
    return src.to(device)
