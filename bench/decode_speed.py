"""Decoding speed: our cached Translator against a decoder that recomputes the whole prefix per step.

    python bench/decode_speed.py [--checkpoint checkpoints/multi30k/best.ckpt] [--sentences 1000]
    python bench/decode_speed.py --random-model --sentences 100      # no trained model needed

Translates the Multi30k test set (test_2016_flickr, de→en) with beam 5 and with greedy search, and
prints translated tokens per second (hypothesis tokens + EOS, summed over the best translations)
for two models that differ only in how the decoder is run:

- cached: the Transformer itself; each step feeds one new token, the decoder keeps the keys and
  values of earlier positions and the projected source in its `DecoderState`;
- no cache: a wrapper whose `decode` feeds the whole prefix (BOS + every token so far) through
  `model.decode(..., state=None)` and keeps the last position, so each step recomputes all earlier
  positions and re-projects the source, as a naive implementation would.

Same weights, same search code (seq2seq.decoding.search through Translator), same batches, measured in the
same run, interleaved, so the ratio holds on a loaded machine even where the absolute numbers do not.
Both runs must produce the same translations; the table says whether they did.

Run by hand, not in CI. On an AVX2-only CPU (no AMX) bf16 matmuls are far slower than fp32, so
fp32 is the default; `--precision bf16` is there for machines where it pays. On a machine whose
cores are busy with other jobs, pass `--threads 1`: decoding is thousands of small ops per
sentence, and torch's threads waiting on each other at every one of them make timings swing by 5x
or more (greedy on 100 sentences here: 1.6 s with one thread, 6.9 s with two next to a training run).

A random model almost never emits EOS, so every output runs to its length limit (1.5 x source + 10
tokens, ~33 on average): longer prefixes than a trained model's, which favours the cache.
"""

import argparse
import gzip
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.documents import Translation
from seq2seq.inference.translator import Translator
from seq2seq.model import Transformer, TransformerConfig
from seq2seq.text.tokenizer import Tokenizer

MULTI30K = Path(__file__).resolve().parents[2] / "shared/data/multi30k"


# ---------------------------------------------------------------------------------------------
# The baseline: the same model, decoded without any cache.


class PrefixState:
    """What the no-cache decoder keeps: the ids fed so far, (R, T) with BOS first."""

    def __init__(self, prefix: Tensor | None = None):
        self.prefix = prefix

    @property
    def length(self) -> int:
        return 0 if self.prefix is None else self.prefix.size(1)

    def reorder(self, indices: Tensor, *, sentences: Tensor | None = None) -> "PrefixState":
        return PrefixState(self.prefix.index_select(0, indices))


class NoCacheDecoder(nn.Module):
    """The search's model interface over a Transformer, recomputing the whole prefix at every step.

    An nn.Module so that Translator can move it and put it in eval mode like the real model.
    """

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model
        self.config = model.config

    def fuse_self_attention(self) -> "NoCacheDecoder":
        self.model.fuse_self_attention()  # as Translator does to a Transformer
        return self

    def encode(self, src: Tensor) -> Tensor:
        return self.model.encode(src)

    @staticmethod
    def new_state() -> PrefixState:
        return PrefixState()

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, state: PrefixState | None = None) -> Tensor:
        # The search passes the one new token per row; the real state grows in place, so does this one.
        state.prefix = tgt_in if state.prefix is None else torch.cat((state.prefix, tgt_in), dim=1)
        return self.model.decode(state.prefix, memory, src_mask, state=None)[:, -1:]  # (R, 1, V)


# ---------------------------------------------------------------------------------------------
# Models and data.


def multi30k_lines(stem: str, lang: str, limit: int | None = None) -> list[str]:
    path = MULTI30K / f"{stem}.{lang}.gz"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found; the benchmark reads Multi30k from ../shared/data/multi30k")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    lines = lines[:-1] if lines and lines[-1] == "" else lines
    return lines[:limit]


def random_translator(*, precision: str, seed: int = 0) -> Translator:
    """configs/multi30k.yaml's model with random weights, and a tokenizer trained now on Multi30k train."""
    texts = multi30k_lines("train", "de") + multi30k_lines("train", "en")
    tokenizer = Tokenizer.train(texts, vocab_size=8000, seed=seed)
    torch.manual_seed(seed)
    config = TransformerConfig(
        vocab_size=tokenizer.vocab_size, d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3,
        num_decoder_layers=3, max_positions=256, norm_placement="pre", tie_embeddings="all",
    )
    return Translator(model=Transformer(config), tokenizer=tokenizer, src_lang="de", tgt_lang="en", precision=precision)


# ---------------------------------------------------------------------------------------------
# Measuring.


@dataclass
class Result:
    seconds: float
    tokens: int
    translations: list[list[Translation]]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def timed_translate(translator: Translator, sources: list[str], *, beam_size: int, max_tokens: int) -> Result:
    start = time.perf_counter()
    nbest = translator.translate_nbest(sources, SearchConfig(beam_size=beam_size), max_tokens=max_tokens)
    seconds = time.perf_counter() - start
    tokens = sum(len(hyps[0].tokens) + 1 for hyps in nbest if hyps)  # + 1: the EOS was decoded too
    return Result(seconds, tokens, nbest)


def same_translations(a: Result, b: Result) -> bool:
    """Equal texts; the two decoders may differ in the last float bits, which can flip a near-tie."""
    return [h[0].text if h else "" for h in a.translations] == [h[0].text if h else "" for h in b.translations]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="decoding speed with and without the decoder cache")
    parser.add_argument("--checkpoint", default="checkpoints/multi30k/best.ckpt")
    parser.add_argument("--random-model", action="store_true",
                        help="random weights in configs/multi30k.yaml's shape (also used when --checkpoint is absent)")
    parser.add_argument("--sentences", type=int, default=1000, help="first N lines of the test set")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="source tokens per batch (Translator's)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.random_model or not Path(args.checkpoint).is_file():
        why = "--random-model" if args.random_model else f"{args.checkpoint} not found"
        print(f"{why}: building a random model; training a tokenizer on Multi30k train ...", file=sys.stderr)
        cached = random_translator(precision=args.precision)
        model_name = f"random weights in multi30k.yaml's shape ({why})"
    else:
        cached = Translator.from_checkpoint(args.checkpoint, precision=args.precision)
        model_name = args.checkpoint
    no_cache = Translator(model=NoCacheDecoder(cached.model), tokenizer=cached.tokenizer, precision=args.precision)
    sources = multi30k_lines("test_2016_flickr", "de", args.sentences)

    # Warm-up (allocator, kernels, lazy inits), not timed.
    for translator in (cached, no_cache):
        translator.translate(sources[:8], SearchConfig(beam_size=5), max_tokens=args.max_tokens)

    config = cached.model.config
    print(f"model: {model_name}; d_model {config.d_model}, {config.num_encoder_layers}+{config.num_decoder_layers} "
          f"layers, vocab {config.vocab_size}; {len(sources)} sentences de→en; {args.precision}; "
          f"{torch.get_num_threads()} threads; max_tokens {args.max_tokens}")
    print(f"{'search':<8} {'decoder':<9} {'seconds':>8} {'tokens':>7} {'tokens/s':>9}  {'cached / no cache'}")
    for name, beam_size in (("beam 5", 5), ("greedy", 1)):
        fast = timed_translate(cached, sources, beam_size=beam_size, max_tokens=args.max_tokens)
        slow = timed_translate(no_cache, sources, beam_size=beam_size, max_tokens=args.max_tokens)
        agree = "same output" if same_translations(fast, slow) else "OUTPUTS DIFFER"
        for label, result in (("cached", fast), ("no cache", slow)):
            print(f"{name:<8} {label:<9} {result.seconds:>8.2f} {result.tokens:>7} {result.tokens_per_second:>9.0f}",
                  end="")
            print(f"  {fast.tokens_per_second / slow.tokens_per_second:.2f}x ({agree})" if label == "no cache" else "")


if __name__ == "__main__":
    main()
