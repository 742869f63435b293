"""What a search is asked for and what it knows of the model: SearchConfig (every decoding option, validated
once), Hypothesis, and the protocols a model decodes through (`encode` and a one-step `decode` with an
incremental DecoderState). The conventions every search keeps are written in seq2seq/decoding/search.py."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar, runtime_checkable

from torch import Tensor

from seq2seq.model.config import ConfigError, check_field_types, check_range

NEG_INF = float("-inf")


def _option(default: Any, help: str, *, flag: str | None = None) -> Any:
    """A SearchConfig field; `help` (and an older `flag` spelling) are for the CLIs built from it."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """How to decode: beam search (beam_size > 1), greedy (beam_size 1) or sampling.

    Built once (from CLI flags, a server request, a training config) and checked here, so that no
    search function re-validates and a bad value is refused before a model is loaded.
    """

    beam_size: int = _option(5, "hypotheses kept per sentence; 1 is greedy search", flag="--beam")
    nbest: int = _option(1, "translations returned per sentence, best first (<= beam size)")
    length_penalty: float = _option(0.6, "GNMT's alpha for ranking beam hypotheses; 0 ranks by raw log-prob")
    max_len_a: float = _option(1.5, "output length limit a * source tokens + b")
    max_len_b: int = _option(10, "see --max-len-a")
    min_len: int = _option(0, "outputs are at least this many tokens long (EOS forbidden before)")
    no_repeat_ngram_size: int = _option(0, "forbid repeating an n-gram of this size; 0: off", flag="--no-repeat-ngram")
    sampling: bool = _option(False, "draw each token from the model's distribution instead of searching")
    temperature: float = _option(1.0, "sampling: divide the logits by it (< 1 sharper, > 1 flatter)")
    top_k: int = _option(0, "sampling: draw from the k most likely tokens only; 0: all")
    top_p: float = _option(1.0, "sampling: draw from the smallest set of tokens with this much probability")
    seed: int | None = _option(None, "sampling: seed of the random draws, for a reproducible run")
    token_scores: bool = _option(False, "also report each output token's log-probability (then the final EOS's)")
    scores: bool = _option(True, "each translation's score (on by default); off (--no-scores), greedy search "
                                 "skips the normaliser over the vocabulary at every step, as CTranslate2 without "
                                 "return_scores: the same tokens, scores nan (beam search, sampling and a "
                                 "constrained search compute them anyway)")
    alignments: bool = _option(False, "also report word alignments (source word - output word), from the "
                                      "decoder's cross-attention")

    def __post_init__(self) -> None:
        check_field_types(self)
        check_range(self, "beam_size", low=1)
        check_range(self, "length_penalty", low=0, high=10)  # ((5 + n) / 6) ** alpha overflows beyond
        # Bounded above too: a huge float would overflow the int64 length to 0 (every output empty).
        check_range(self, "max_len_a", low=0, high=1000)
        check_range(self, "max_len_b", low=0, high=1_000_000)
        check_range(self, "min_len", low=0)
        check_range(self, "no_repeat_ngram_size", low=0)
        check_range(self, "temperature", low=1e-4, high=1e4)  # beyond, log_probs / T overflows into NaN
        check_range(self, "top_k", low=0)
        check_range(self, "top_p", low=0, high=1, low_open=True)
        check_range(self, "seed", low=0, high=2**63 - 1)
        if self.max_len_a == 0 and self.max_len_b == 0:
            raise ConfigError("max_len_b", "max_len_a and max_len_b are both 0: every output would be empty")
        if self.sampling and self.nbest != 1:
            raise ConfigError("nbest", f"sampling draws one translation per sentence: must be 1, got {self.nbest}")
        if not self.sampling and not 1 <= self.nbest <= self.beam_size:
            raise ConfigError("nbest", f"must be between 1 and beam_size ({self.beam_size}), got {self.nbest}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SearchConfig:
        """The config a dict describes (a checkpoint's stored defaults; absent keys keep theirs); an unknown
        key is a ConfigError."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(unknown[0], f"is not a SearchConfig field (known: {', '.join(sorted(names))})")
        return cls(**values)

    @property
    def hypotheses(self) -> int:
        """The decoder rows a sentence takes: the beam; one for greedy search and sampling."""
        return 1 if self.sampling else self.beam_size

    def check_model(self, *, vocab_size: int, max_positions: int) -> None:
        """What the search asks of the model it runs on: beam search ranks 2 * beam_size candidates among the
        first step's vocabulary, and no output is longer than max_positions - 1 tokens (the decoder reads BOS
        too), so a min_len beyond that could never be met."""
        if not self.sampling and self.beam_size > 1 and 2 * self.beam_size > vocab_size:
            raise ConfigError("beam_size", f"{self.beam_size} needs a vocabulary of at least {2 * self.beam_size} "
                                           f"tokens; this model has {vocab_size}")
        if self.min_len > max_positions - 1:
            raise ConfigError("min_len", f"{self.min_len} is more tokens than this model writes in an output "
                                         f"(max_positions - 1 = {max_positions - 1}); ask for at most that")


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]
    """Generated ids without BOS and without the final EOS (a forced prefix included)."""
    score: float
    """Ranking score: length-normalised log_prob for beam search, log_prob otherwise."""
    log_prob: float
    """Sum of the log-probabilities of all tokens and the final EOS."""
    token_log_probs: list[float] | None = None
    """With SearchConfig.token_scores: the log-probability of each token, then of the final EOS."""
    source_positions: list[int] | None = None
    """With SearchConfig.alignments: per token, the source position its alignment layer attended to most."""


@dataclass(frozen=True)
class SpecialIds:
    """The ids the searches treat apart, in one place: every row starts with `bos`, a hypothesis ends
    with `eos`, `pad` fills sources and forced prefixes; `bos` and `pad` are never generated."""

    bos: int
    eos: int
    pad: int


class DecoderState(Protocol):
    @property
    def length(self) -> int: ...

    def reorder(self: _Self, indices: Tensor, *, sentences: Tensor | None = None) -> _Self:
        """Row j becomes row indices[j]; `sentences`, if given, selects the per-sentence rows (memory)."""
        ...


_Self = TypeVar("_Self")
State = TypeVar("State", bound=DecoderState)


class ModelConfig(Protocol):
    @property
    def max_positions(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


class EncoderDecoder(Protocol[State]):
    """What the searches need of a model; generic in its own state type (the Transformer's DecoderState).

    `decode` gets one memory row per sentence (N) and R = N * K target rows, the K hypotheses of a
    sentence adjacent (K = 1 in greedy search and sampling, and on beam search's first step).
    """

    @property
    def config(self) -> ModelConfig: ...

    def encode(self, src: Tensor) -> Tensor: ...

    def new_state(self) -> State: ...

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, state: State | None = None) -> Tensor: ...


# ---------------------------------------------------------------------------------------------
# Small pure functions: one decoding step, the constraints on it, scoring.


@runtime_checkable
class StepDecoder(Protocol):
    """An EncoderDecoder whose one-token step gives with its logits what `step_logits` would compute from them
    (the compiled decoder: model/compiled.py, computed in the step's generated code): their normaliser or None, the
    maxima of the logits' chunks of `chunk` columns (a ValueError where it computes them over another width) or
    None, and each row's argmax (the first of equal maxima) or None."""

    def decode_step(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, state: Any, *, chunk: int,
                    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]: ...  # (R, V), (R,), (R, V // chunk), (R,)


@functools.cache
def is_step_decoder(kind: type) -> bool:
    """Whether a decoder of this class is a StepDecoder, asked once a class: a runtime-checkable protocol's
    isinstance inspects the object's members each time, at every step."""
    return issubclass(kind, StepDecoder)
