"""Where a model's compiled decoder is kept between processes: one package (model/packaged.py) per model's weights,
precision, decoder thread count and machine, in the machine's cache folder (precision.verdict_cache: the CPU's model
and flags, the torch version), so that only the first process on a machine compiles (minutes) and every later one
loads it (docs/performance/compiled-decoding.md#kept).

The key is a digest of what the package's code depends on: every weight (name, dtype, shape, bytes; or the
checkpoint's verified checksum, which covers them) and the model's config as the checkpoint gives them, the
precision, the intra-op thread count built into the code, the attention kernel's instruction set and the package's
layout. A checkpoint trained further, another precision or
another thread count is another package; a stale one is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from seq2seq.model import Transformer
from seq2seq.model.compiled import CompiledDecoder
from seq2seq.model.compiled_step import COMPILABLE_POSITIONS
from seq2seq.model.kernels import machine_instruction_set
from seq2seq.model.packaged import PackageError, build_package, is_package, load_package
from seq2seq.precision import verdict_cache

PACKAGED_PRECISIONS = ("fp32", "bf16")
"""The precisions a package holds (int8's packed oneDNN weights are not exported: model/packaged.py)."""

LAYOUT = 1
"""Bumped when what a package's code computes changes for the same weights (the step's outputs, its kinds)."""


def packageable(model: Transformer, *, device: torch.device, precision: str) -> bool:
    """Whether a package can hold `model`'s decoder on `device` in `precision`: a CPU, fp32 or bf16, absolute
    positions (the compiled step's)."""
    return (device.type == "cpu" and precision in PACKAGED_PRECISIONS
            and model.config.positions in COMPILABLE_POSITIONS)


def package_folder(model: Transformer, *, precision: str, threads: int, checksum: str | None = None) -> Path:
    """The folder `model`'s package for `precision` and decoder threads of `threads` intra-op threads has on this
    machine, whether it is there or not: the model as the checkpoint gives it (before it is prepared). `checksum`:
    the checkpoint's verified checksum of its weights, config, tokenizer and search defaults, which stands for the
    weights (hashing them again takes a second for a large model); without one the weights are hashed."""
    digest = hashlib.blake2b(digest_size=16)
    identity = {"config": model.config.to_dict(), "precision": precision, "threads": threads, "layout": LAYOUT,
                "instruction_set": machine_instruction_set(), "checksum": checksum}
    digest.update(json.dumps(identity, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()) if checksum is None else ():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return verdict_cache() / "compiled" / f"{precision}-{threads}t-{digest.hexdigest()}"


def kept_decoder(decoder: CompiledDecoder, folder: Path, *, runners: int,
                 progress: Callable[[str], None] = lambda _line: None) -> CompiledDecoder:
    """`decoder`'s model decoding with the package in `folder`, built there first where none is (on this thread,
    for its intra-op thread count; `progress` told each kind as it compiles), each function with `runners` instances
    (the decoder threads that run it at once). A kept package that does not load (damaged, its files half gone) is
    built again. CompileError (one line) where inductor cannot compile."""
    if is_package(folder):
        try:
            return CompiledDecoder(decoder.model, chunk=decoder.chunk, packaged=load_package(folder, runners=runners))
        except PackageError as error:
            progress(f"{error}: compiling it again")
            shutil.rmtree(folder, ignore_errors=True)
    build_package(decoder, folder, progress=progress)
    return CompiledDecoder(decoder.model, chunk=decoder.chunk, packaged=load_package(folder, runners=runners))
