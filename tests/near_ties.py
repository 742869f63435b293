"""Outputs of two decoders compared by a criterion no CPU's kernels move: where they differ, the model itself must
rate the choices that parted them as a tie within the rounding of the precision they ran in.

Which near-ties flip depends on the kernels a CPU runs (AVX2, AVX-512, AMX, VNNI sum and round in other orders), so
a count of identical outputs, or a chrF floor, holds on the machine it was tuned on and not on the next. Instead:

- greedy (`greedy_near_ties`): at the first token where two outputs part, after the same prefix, a reference
  model (the same weights in float64, or, where the weights are quantised, the precision's own eager model) rates
  both tokens within `logit_tolerance` of each other;
- beam search (`beam_near_ties`): the two outputs' total scores under the reference are within the sum of the
  tokens' tolerances. That holds where a tie decided the final ranking between hypotheses both searches had; a
  tie at a pruning step can lead to outputs whose totals differ by more. Where ties are as narrow as float32's or
  float64's that is rare enough for a decisive (trained) model; where they are as wide as bf16's or int8's, a test
  compares greedy instead, which has a first point of divergence to check.

The tolerance is derived from the precision's rounding, not measured on any machine: a logit's error is at most
ROUNDINGS[precision] rounding units `u` of the row's largest logit (the logits' scale), and a choice between two
logits flips only if they are within both engines' errors of each other, twice that.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

UNIT_ROUNDOFF = {"fp64": 2.0**-53, "fp32": 2.0**-24, "bf16": 2.0**-8, "int8": 2.0**-7}
"""Half a unit in the last place, relative: float64's 53-bit significand, float32's 24, bf16's 8. int8's weights
round to half of 1/127 of a row's largest value, but its activations to 7 bits (fbgemm's reduce_range, which keeps
AVX2's 16-bit pairwise sums from saturating; the compiled step's `activation_bits` likewise), asymmetric over a
row's range: half of (max - min) / 127, up to 1/127 of the row's largest magnitude, about 2^-7."""

ROUNDINGS = {"fp64": 64, "fp32": 64, "bf16": 4, "int8": 4}
"""A logit's error in units of u times the logits' scale. float32 and float64 store every activation almost exactly
but sum dot products of up to d_ff terms in whatever order a kernel blocks them (the error of a sum grows with its
length: 64 allows for sums of a few thousand terms, in a few layers, at u each); bf16 and int8 round each stored
activation to u (the matmuls accumulate in float32 or int32, whose own rounding is negligible beside), and the norms
keep an earlier layer's rounding from growing: a logit carries its own rounding and the last few operations'."""


def reference_model(checkpoint) -> torch.nn.Module:
    """The checkpoint's model as it was trained, in float64 and eval mode, nothing packed or fused: the reference."""
    from seq2seq.checkpoint import load_checkpoint, read_inference
    from seq2seq.model import Transformer

    loaded = read_inference(checkpoint, load_checkpoint(checkpoint))
    model = Transformer(loaded.config)
    model.load_state_dict(loaded.weights)
    return model.double().eval()


def logit_tolerance(precision: str, logits: torch.Tensor) -> float:
    """How close two logits of `logits` (one row) may be for two engines in `precision` to rank them either way."""
    return 2 * ROUNDINGS[precision] * UNIT_ROUNDOFF[precision] * float(logits.abs().max())


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where a and b differ (the shorter's length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def teacher_forced_logits(model, src: Sequence[int], tgt: Sequence[int], *, bos: int) -> torch.Tensor:
    """The model's logits (T + 1, V) for each next token of `tgt` (and the one after it), as float64: encoded and
    decoded as the searches do (an int8 or bf16-around-int8 model's decoder takes the memory in its own dtype)."""
    with torch.inference_mode():
        src_ids = torch.tensor([list(src)])
        memory = model.encode(src_ids)
        logits = model.decode(torch.tensor([[bos, *tgt]]), memory, src_ids != model.config.pad_id)[0]
    return logits.double()


def tokens_of(src: torch.Tensor, pad: int) -> list[list[int]]:
    """A right-padded batch of sources (N, S) as lists of their tokens."""
    return [row[row != pad].tolist() for row in src]


def greedy_near_ties(reference, sources: Sequence[Sequence[int]], ours: Sequence[Sequence[int]],
                     theirs: Sequence[Sequence[int]], *, precision: str, bos: int, eos: int) -> list[str]:
    """For each pair of greedy outputs (token ids without EOS) that differ: a line saying why it is not a near-tie,
    if the reference model does not rate the two tokens at their first difference within `precision`'s tolerance.
    An empty list: every difference is a near-tie (assert it is empty)."""
    problems = []
    for i, (src, a, b) in enumerate(zip(sources, ours, theirs, strict=True)):
        if list(a) == list(b):
            continue
        at = first_difference(a, b)
        logits = teacher_forced_logits(reference, src, a[:at], bos=bos)[at]
        token_a, token_b = (a[at] if at < len(a) else eos), (b[at] if at < len(b) else eos)
        gap, tolerance = float(logits[token_a] - logits[token_b]), logit_tolerance(precision, logits)
        if abs(gap) > tolerance:
            problems.append(f"sentence {i}, token {at}: {token_a} against {token_b}, {gap:+.3g} apart in the reference "
                            f"model, over {precision}'s tolerance {tolerance:.3g}: not a near-tie")
    return problems


def token_log_probs(logits: torch.Tensor, tgt: Sequence[int], *, eos: int) -> torch.Tensor:
    """log P of each token of tgt + EOS (T + 1,), from teacher_forced_logits' (T + 1, V)."""
    return logits.log_softmax(dim=-1).gather(1, torch.tensor([[*tgt, eos]]).T)[:, 0]


def sequence_score(reference, src: Sequence[int], tgt: Sequence[int], *, bos: int, eos: int) -> tuple[float, float]:
    """(sum of log P(tgt + EOS | src) under the reference, the sum of its tokens' tolerances in float64 terms)."""
    logits = teacher_forced_logits(reference, src, tgt, bos=bos)
    return float(token_log_probs(logits, tgt, eos=eos).sum()), float(logits.abs().amax(dim=-1).sum())


def beam_near_ties(reference, sources: Sequence[Sequence[int]], ours: Sequence[Sequence[int]],
                   theirs: Sequence[Sequence[int]], *, precision: str, bos: int, eos: int) -> list[str]:
    """For each pair of beam outputs that differ: a line if their total scores under the reference model are
    further apart than `precision`'s tolerance summed over their tokens (a log-probability errs by its logit's
    error and the normaliser's: twice a logit's). See the module's docstring for where this is principled."""
    problems = []
    for i, (src, a, b) in enumerate(zip(sources, ours, theirs, strict=True)):
        if list(a) == list(b):
            continue
        (score_a, scale_a), (score_b, scale_b) = (sequence_score(reference, src, t, bos=bos, eos=eos) for t in (a, b))
        tolerance = 2 * ROUNDINGS[precision] * UNIT_ROUNDOFF[precision] * (scale_a + scale_b)
        if abs(score_a - score_b) > tolerance:
            problems.append(f"sentence {i}: totals {score_a:.6g} against {score_b:.6g} in the reference model, over "
                            f"{precision}'s tolerance {tolerance:.3g}: not a near-tie")
    return problems
