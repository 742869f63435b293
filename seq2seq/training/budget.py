"""A batch's token budget sized to the GPU's memory (`data.max_tokens: auto`), and the gradient accumulation that
makes the config's tokens per update (`model.tokens_per_update`) out of the budgets of all devices.

A GPU runs its matmuls near its peak only at large batches, and the largest that fits depends on the GPU, the
model, the precision and the longest sentence allowed: a constant in a config is either too small for an H200 or
too large for a 24 GB card. So the budget is measured as the run starts (`size_budget`): a training step (forward,
fused loss, backward) of the run's model on batches of the longest sentences (`max_tokens_per_sentence`, the
worst case for attention's memory) at two budgets gives the memory a padded position costs and what does not
grow with the batch; the budget predicted to fill HEADROOM of the GPU's memory, less what the optimiser will
allocate, is then checked by a step at that budget, and lowered a tenth at a time until one fits. Rank 0 sizes,
every rank follows (they train alike). A resumed run keeps the budget it started with: the sampler's position
in the epoch counts its batches.

On a CPU the host's memory, not a device's, holds the batch, and nothing here sizes it: `auto` is CPU_MAX_TOKENS
there.
"""

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch

from seq2seq.model import Transformer
from seq2seq.training.loss import HiddenStates, training_loss

CPU_MAX_TOKENS = 4096
# The share of the GPU's memory a training step's peak may take: the rest is for the allocator's fragmentation
# (batches change shape every step), validation's search, and NCCL's buffers under DDP.
HEADROOM = 0.85
GRANULE = 256  # budgets are multiples of this
SLOPE_AT = 2048  # the smaller budget whose step, with one at twice it, gives the memory a position costs
# What AdamW keeps per parameter beyond the weights and gradients the probe's step allocates: two float32 moments,
# and PowerEMA's float32 copy of the weights.
OPTIMIZER_COPIES = 3


class BudgetError(RuntimeError):
    """Not even one sentence of the longest length fits: one line naming what to lower."""


def accumulation(*, tokens_per_update: int | None, max_tokens: int, world_size: int) -> int:
    """Batches summed into one update so that an update holds at least `tokens_per_update` padded positions over
    all devices (1 without a target)."""
    if tokens_per_update is None:
        return 1
    return max(1, math.ceil(tokens_per_update / (max_tokens * world_size)))


def largest_budget(peak_bytes: Callable[[int], int], *, memory: int, reserved: int, low: int, high: int) -> int:
    """The largest budget, a multiple of GRANULE from `low` to `high`, whose step peaks at no more than HEADROOM of
    `memory` less `reserved` bytes; peak_bytes(budget) runs one step (torch.OutOfMemoryError where it does not fit).

    A step at `low` (one sentence of the longest length) must fit. Two more, at SLOPE_AT (or `low`, if larger) and
    twice it, give bytes per position and the fixed part; the budget they predict is then run, and lowered a tenth
    at a time until a step fits."""
    allowed = HEADROOM * memory - reserved
    try:
        first: float = peak_bytes(low)
    except torch.OutOfMemoryError:
        first = math.inf
    if first > allowed:
        raise BudgetError(
            f"one batch of {low} padded positions (the longest sentence allowed) needs {first / 2**30:.1f} GiB of the "
            f"{HEADROOM * memory / 2**30:.1f} GiB this GPU has for it: lower data.max_tokens_per_sentence, or use "
            "a smaller model or a lower precision")
    start = max(low, SLOPE_AT)
    try:
        at_start, at_twice = peak_bytes(start), peak_bytes(2 * start)
        per_position = max((at_twice - at_start) / start, 1.0)
        budget = int((allowed - (at_start - per_position * start)) / per_position)
    except torch.OutOfMemoryError:  # a small GPU: down from the larger of the two
        budget = 2 * start
    budget = max(low, min(high, budget) // GRANULE * GRANULE)
    while budget > low:
        try:
            if peak_bytes(budget) <= allowed:
                return budget
        except torch.OutOfMemoryError:
            pass
        budget = max(low, int(budget * 0.9) // GRANULE * GRANULE)
    return low


def probe_step(model: Transformer, *, budget: int, length: int, dtype: torch.dtype | None,
               hidden_states: HiddenStates | None = None, rdrop_alpha: float = 0.0) -> None:
    """One training step's forward and backward on `budget // length` rows of `length` tokens each (random ids, no
    padding: the most a batch of this budget holds), under autocast to `dtype` if given, through `hidden_states`
    (the model's own by default; training_loss), with R-Drop's two passes where `rdrop_alpha` > 0; gradients freed
    after."""
    device = next(model.parameters()).device
    rows = max(1, budget // length)
    ids = torch.randint(4, model.config.vocab_size, (rows, length), device=device)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()
    try:
        with autocast:
            loss, _, tokens = training_loss(model, src=ids, tgt_in=ids[:, :-1], tgt_out=ids[:, 1:], smoothing=0.1,
                                            hidden_states=hidden_states, rdrop_alpha=rdrop_alpha)
        (loss / tokens).backward()
    finally:
        model.zero_grad(set_to_none=True)


def size_budget(model: Transformer, *, length: int, high: int, dtype: torch.dtype | None,
                rdrop_alpha: float = 0.0) -> int:
    """The largest budget of padded positions whose training step fits this CUDA device's memory (module docstring);
    under R-Drop (`rdrop_alpha` > 0) a step runs each batch twice over."""
    device = next(model.parameters()).device
    _, memory = torch.cuda.mem_get_info(device)
    reserved = OPTIMIZER_COPIES * sum(p.numel() * p.element_size() for p in model.parameters())
    was_training = model.training
    model.train()

    def peak_bytes(budget: int) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        try:
            with torch.random.fork_rng(devices=[device]):  # the run's dropout masks as if unprobed
                probe_step(model, budget=budget, length=length, dtype=dtype, rdrop_alpha=rdrop_alpha)
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device)
        finally:
            torch.cuda.empty_cache()

    try:
        return largest_budget(peak_bytes, memory=memory, reserved=reserved, low=length, high=high)
    finally:
        model.train(was_training)
