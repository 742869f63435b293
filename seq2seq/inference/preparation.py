"""A model made ready to decode on a machine: on its device, in its precision, with the kernels the machine's
timed verdicts choose (seq2seq/precision.py), compiled or eager. Every choice is made on this model only: nothing
here sets anything on a class or on the process that another model would see.
"""

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from seq2seq.decoding.config import EncoderDecoder
from seq2seq.inference.kept import package_folder, packageable
from seq2seq.model import Transformer
from seq2seq.model.compiled import CompiledDecoder, bf16_around_int8, check_compilable, int8_compiled
from seq2seq.model.numerics import PackedLinear, for_inference
from seq2seq.model.packaged import is_package
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
    package: Path | None = None
    """The folder of the compiled package the decoding is to run (inference/kept.py: there already, or to build);
    None where torch.compile compiles in this process, or where the decoding is eager."""
    kept_at: Path | None = None
    """Where this model's package would be kept on this machine, whether it is there or not (None where no package
    can hold it: int8, a GPU, relative or rotary positions): what an eager run names as the way to decode faster."""


Compiled = bool | Literal["auto", "jit"]
"""Whether the decoding steps run compiled: True (a kept package, built first where none is; torch.compile where no
package holds the model), False (eager), auto (a kept package where there is one, else eager), or jit (torch.compile
in this process, nothing kept)."""


def prepare(model: Transformer, *, device: str | torch.device = "cpu", precision: Precision = "auto",
            compiled: Compiled = False, threads: int = 1, checksum: str | None = None) -> Prepared:
    """`model`, converted in place, for decoding on `device` in `precision`.

    `precision`: auto picks bf16 where bf16 matmuls are fast (a GPU from Ampere on, a CPU with AMX or
    AVX512-BF16), else fp32; int8 is a CPU option that changes outputs slightly. On a CPU the fp32 or bf16 linear
    layers are packed for oneDNN where precision.onednn_linears times that faster, their few rows in fp32 on
    torch's own linear where precision.few_rows_on_torch times that faster, and bf16 attention at one query a row
    runs SDPA where precision.one_query_sdpa times that faster.

    `compiled`: the decoding steps run compiled (seq2seq/model/compiled.py): fp32, bf16 or int8, models with
    absolute positions (a ValueError for others); outputs can differ from the eager step's in the last bits of a
    logit, as a different kernel's would. The decoder's linear layers stay unpacked (inductor packs its own copy),
    so teacher-forced scoring runs slower. On a CPU in fp32 or bf16 the compiled decoder is a package kept on the
    machine for this model, precision and decoder thread count (`threads`): `Prepared.package`, which the caller
    builds where it is not there yet (inference/kept.py's kept_decoder). True: that package, else torch.compile;
    auto: that package where it is there already, else eager; jit: torch.compile, nothing kept. `checksum`: the
    checkpoint's, which names the package in place of a hash of the weights (inference/kept.py)."""
    resolved = resolve_device(device)
    chosen = resolve_precision(precision, resolved)
    packed = onednn_linears(resolved, chosen).pays
    if compiled is True or compiled == "jit":
        check_compilable(model.config)
    kept_at = None
    if compiled in (True, "auto") and packageable(model, device=resolved, precision=chosen):
        kept_at = package_folder(model, precision=chosen, threads=threads, checksum=checksum)
    package = kept_at if kept_at is not None and (compiled is True or is_package(kept_at)) else None
    runs_compiled = compiled is True or compiled == "jit" or package is not None
    model = model.to(resolved).fuse_self_attention()
    if resolved.type == "cpu" and chosen == "bf16":  # the machine's verdict, for this model
        model.attend_one_query_by_matmul(not one_query_sdpa(resolved, chosen).pays)
    if runs_compiled and chosen == "int8":  # every linear layer the compiled encoder's and step's int8
        int8_compiled(model.float())
    model = for_inference(model, chosen, packed=packed and not runs_compiled)
    if runs_compiled and chosen == "int8" and bf16_matmuls_pay(resolved):
        bf16_around_int8(model)  # (after for_inference, whose .float() would undo it)
    if packed and chosen == "fp32":  # a decoding step's few rows on torch's own linear, where faster
        few: dict[tuple[int, int], int] = {}
        for layer in model.modules():
            if isinstance(layer, PackedLinear):
                shape = (layer.in_features, layer.out_features)
                if shape not in few:
                    few[shape] = few_rows_on_torch(resolved, chosen, in_features=shape[0], out_features=shape[1])
                layer.run_few_rows_on_torch(few[shape])
    decoding: EncoderDecoder[Any] = CompiledDecoder(model) if runs_compiled else model
    return Prepared(model=model, decoding=decoding, device=resolved, precision=chosen, compiled=runs_compiled,
                    package=package, kept_at=kept_at)


def warn_of_workers_off_the_cpu(workers: int, device: torch.device) -> None:
    """Several decoder workers on one GPU wait on each other's kernels: one is faster there."""
    if workers > 1 and device.type != "cpu":
        warnings.warn(f"{workers} decoder workers on {device} share one device and wait on each other's "
                      f"kernels: one worker is faster there", stacklevel=3)
