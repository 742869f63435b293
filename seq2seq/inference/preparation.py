"""A model made ready to decode on a machine: on its device, in its precision, with the kernels the machine's
timed verdicts choose (seq2seq/precision.py), compiled or eager. Every choice is made on this model only: nothing
here sets anything on a class or on the process that another model would see.
"""

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from seq2seq.decoding.config import EncoderDecoder
from seq2seq.model import Transformer
from seq2seq.model.compiled import CompiledDecoder, bf16_around_int8, check_compilable, int8_compiled
from seq2seq.model.numerics import PackedLinear, for_inference
from seq2seq.precision import (
    Precision,
    bf16_matmuls_pay,
    few_rows_on_torch,
    one_query_sdpa,
    onednn_linears,
    resolve_precision,
)


def resolve_device(name: str | torch.device) -> torch.device:
    """The device, if this machine has it; a ValueError saying what to use instead if not."""
    try:
        device = torch.device(name)
        torch.empty(0, device=device)  # raises for a device this torch build or machine lacks
    except (RuntimeError, AssertionError, ValueError) as error:
        reason = str(error).strip().split("\n")[0]
        raise ValueError(f"device {str(name)!r} cannot be used here ({reason}); use cpu, or a device this "
                         "machine has (cuda, cuda:1, mps)") from None
    return device


@dataclass(frozen=True)
class Prepared:
    model: Transformer
    """The model as it decodes (and scores, teacher-forced): converted in place."""
    decoding: EncoderDecoder[Any]
    """What the searches decode with: the model, or its compiled decoding step (CompiledDecoder)."""
    device: torch.device
    precision: str
    """fp32, bf16 or int8: what `auto` chose."""
    compiled: bool


def prepare(model: Transformer, *, device: str | torch.device = "cpu", precision: Precision = "auto",
            compiled: bool = False) -> Prepared:
    """`model`, converted in place, for decoding on `device` in `precision`.

    `precision`: auto picks bf16 where bf16 matmuls are fast (a GPU from Ampere on, a CPU with AMX or
    AVX512-BF16), else fp32; int8 is a CPU option that changes outputs slightly. On a CPU the fp32 or bf16 linear
    layers are packed for oneDNN where precision.onednn_linears times that faster, their few rows in fp32 on
    torch's own linear where precision.few_rows_on_torch times that faster, and bf16 attention at one query a row
    runs SDPA where precision.one_query_sdpa times that faster.

    `compiled`: the decoding steps run compiled (seq2seq/model/compiled.py): fp32, bf16 or int8, models with
    absolute positions (a ValueError for others); outputs can differ from the eager step's in the last bits of a
    logit, as a different kernel's would. The decoder's linear layers stay unpacked (inductor packs its own copy),
    so teacher-forced scoring runs slower."""
    resolved = resolve_device(device)
    chosen = resolve_precision(precision, resolved)
    packed = onednn_linears(resolved, chosen).pays
    if compiled:
        check_compilable(model.config)
    model = model.to(resolved).fuse_self_attention()
    if resolved.type == "cpu" and chosen == "bf16":  # the machine's verdict, for this model
        model.attend_one_query_by_matmul(not one_query_sdpa(resolved, chosen).pays)
    if compiled and chosen == "int8":  # every linear layer the compiled encoder's and step's int8
        int8_compiled(model.float())
    model = for_inference(model, chosen, packed=packed and not compiled)
    if compiled and chosen == "int8" and bf16_matmuls_pay(resolved):
        bf16_around_int8(model)  # (after for_inference, whose .float() would undo it)
    if packed and chosen == "fp32":  # a decoding step's few rows on torch's own linear, where faster
        few: dict[tuple[int, int], int] = {}
        for layer in model.modules():
            if isinstance(layer, PackedLinear):
                shape = (layer.in_features, layer.out_features)
                if shape not in few:
                    few[shape] = few_rows_on_torch(resolved, chosen, in_features=shape[0], out_features=shape[1])
                layer.run_few_rows_on_torch(few[shape])
    decoding: EncoderDecoder[Any] = CompiledDecoder(model) if compiled else model
    return Prepared(model=model, decoding=decoding, device=resolved, precision=chosen, compiled=compiled)


def warn_of_workers_off_the_cpu(workers: int, device: torch.device) -> None:
    """Several decoder workers on one GPU wait on each other's kernels: one is faster there."""
    if workers > 1 and device.type != "cpu":
        warnings.warn(f"{workers} decoder workers on {device} share one device and wait on each other's "
                      f"kernels: one worker is faster there", stacklevel=3)
