"""The compiled decoding step's attention on a CPU (and the compiled encoder's), a kernel of our own
(decode_attention.cpp), and its reference.

A decoding step attends with one query per row (a few with beams) over the cross-attention's keys and values and the
self-attention cache. Written out for inductor (compiled_step.attend_masked) the scores' reduction over the head size
sums each position's vector across its lanes on its own, a chain of shuffles per position that takes longer than
reading the keys and values, and the padding of a batch's shorter sources is read and masked. torch's own CPU
attention (SDPA) and FlexAttention are slower still at one query a row
(docs/performance/compiled-decoding.md#attention-kernel). The kernel sums the products of a vector of positions at
once (see the source), and takes each row's length, so that it reads its real positions only.

It is built on first use with torch.utils.cpp_extension (the C++ compiler inductor needs already, and ninja), once
per process and kept on disk for the next (TORCH_EXTENSIONS_DIR), for the instruction set torch's own CPU kernels
use on this machine (or one named: the tests run each). The compiled step calls it as an operator, which inductor's
C++ wrapper calls through the dispatcher without the GIL (inductor.CPP_WRAPPER).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("decode_attention.cpp")

INSTRUCTION_SETS: dict[str, tuple[list[str], list[str]]] = {
    "AVX512": (["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"],
               ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]),
    "AVX2": (["-mavx2", "-mfma", "-mf16c"], ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]),
    "DEFAULT": ([], ["-DCPU_CAPABILITY=DEFAULT"]),
}
"""Compiler flags and ATen's vector-type macros of each build (inductor's own flags for AVX-512 and AVX2): ATen's
Vectorized<float> is 16 floats, 8, or a plain loop over 8 (any CPU, ARM included)."""


def machine_instruction_set() -> str:
    """The build this machine takes: the set torch dispatches its own CPU kernels to ("AVX512", "AVX2"), else DEFAULT."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in INSTRUCTION_SETS else "DEFAULT"


_loaded: dict[str, torch._ops.OpOverloadPacket] = {}
_loading = threading.Lock()


class KernelBuildError(RuntimeError):
    """The kernel could not be built (no C++ compiler, no ninja): one line naming the compiler's reason."""


def decode_attention_op(instruction_set: str | None = None) -> torch._ops.OpOverloadPacket:
    """torch.ops.seq2seq_<set>.decode_attention, built for `instruction_set` (the machine's by default) on first use."""
    name = instruction_set or machine_instruction_set()
    if name not in INSTRUCTION_SETS:
        raise ValueError(f"no decode_attention build for {name!r}; one of {', '.join(INSTRUCTION_SETS)}")
    library = f"seq2seq_{name.lower()}"
    with _loading:
        if library not in _loaded:
            from torch.utils.cpp_extension import load

            arch, macros = INSTRUCTION_SETS[name]
            try:
                load(name=library, sources=[str(SOURCE)],
                     extra_cflags=["-O3", *arch, *macros, f"-DSEQ2SEQ_OPS={library}"], is_python_module=False)
            except (RuntimeError, OSError) as error:  # (cpp_extension's failures: the compiler's pages of output)
                raise KernelBuildError(f"the decoding step's attention kernel could not be built "
                                       f"({_build_reason(error)})") from None
            torch.library.register_fake(f"{library}::decode_attention")(_decode_attention_shape)
            _loaded[library] = getattr(torch.ops, library).decode_attention
    return _loaded[library]


def _build_reason(error: BaseException) -> str:
    """cpp_extension's failure in one line: the compiler's first error, else the message's first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if ": error" in line), lines[0] if lines else repr(error))


def _decode_attention_shape(queries: Tensor, keys: Tensor, values: Tensor, lengths: Tensor) -> Tensor:
    return queries.new_empty(queries.shape)  # (what torch.compile traces: the output's shape, contiguous)


def decode_attention_reference(queries: Tensor, keys: Tensor, values: Tensor, lengths: Tensor) -> Tensor:
    """What the kernel computes, written out: queries (B, Q, H * D), keys and values (B, H, S, D), lengths (B,) -> (B,
    Q, H * D), each row b attending over its first lengths[b] positions (zeros where it has none)."""
    batch, count, _ = queries.shape
    heads, head_dim = keys.size(1), keys.size(3)
    queries = queries.view(batch, count, heads, head_dim).transpose(1, 2)  # (B, H, Q, D)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * head_dim**-0.5  # (B, H, Q, S)
    seen = torch.arange(keys.size(2), device=lengths.device) < lengths[:, None]  # (B, S)
    weights = scores.masked_fill(~seen[:, None, None, :], float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    return torch.matmul(weights, values).transpose(1, 2).reshape(batch, count, heads * head_dim)


RUNNER_SOURCE = Path(__file__).with_name("package_runner.cpp")
_runner: list[Any] = []


def package_runner() -> Any:
    """package_runner.cpp's module (its Runner: a compiled package's model called without the GIL, model/packaged.py),
    built on first use as the kernel is, once per process, kept on disk for the next (TORCH_EXTENSIONS_DIR);
    KernelBuildError (one line) where it cannot be built."""
    with _loading:
        if not _runner:
            from torch.utils.cpp_extension import load

            try:
                _runner.append(load(name="seq2seq_package_runner", sources=[str(RUNNER_SOURCE)], extra_cflags=["-O2"],
                                    is_python_module=True))
            except (RuntimeError, OSError) as error:
                raise KernelBuildError(f"the compiled package's runner could not be built "
                                       f"({_build_reason(error)})") from None
    return _runner[0]
