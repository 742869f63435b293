"""Processors as seq2seq.precision sees them: the machines `auto` has met or will meet.

Pretending to be one of them (`pretend_machine` in this process, `python -m as_machine` in a new one)
makes `auto` take that machine's path through the real decision code, whatever CPU runs the tests.
"""

import pytest

from seq2seq.precision import CPU

MACHINES = {
    "avx2": CPU(arch="x86_64", model="AMD EPYC 7B13 (Zen 3, pretended)", flags=frozenset({"avx", "avx2", "fma"})),
    "avx512_bf16": CPU(arch="x86_64", model="AMD EPYC 9B14 (Zen 4, pretended)",
                       flags=frozenset({"avx2", "avx512f", "avx512_bf16"})),
    "amx": CPU(arch="x86_64", model="Intel Xeon Sapphire Rapids (pretended)",
               flags=frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})),
    "arm": CPU(arch="aarch64", model="Neoverse-V1 (pretended)", flags=frozenset({"fp", "asimd", "bf16"})),
}


def pretend_machine(patch: pytest.MonkeyPatch, name: str) -> None:
    """`auto` decides as it would on machine `name` (a key of MACHINES), in this process."""
    patch.setattr("seq2seq.precision.this_cpu", lambda: MACHINES[name])
