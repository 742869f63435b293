"""The decoding step's attention kernel (seq2seq/model/kernels.py, decode_attention.cpp) against attention computed
naively in float64, on every instruction set it is built for: AVX-512, AVX2 (the Zen 3's) and the plain loop (any
other CPU), each built here whichever this machine would take (all three run on an x86 CPU with AVX-512; where one
cannot run, its test is skipped, saying so)."""

import pytest
import torch

from seq2seq.model import kernels
from seq2seq.model.kernels import (
    INSTRUCTION_SETS,
    KernelBuildError,
    decode_attention_op,
    decode_attention_reference,
    machine_instruction_set,
)

RUNS_HERE = {"AVX512": ("AVX512", "AVX2", "DEFAULT"), "AVX2": ("AVX2", "DEFAULT"), "DEFAULT": ("DEFAULT",)}
"""The builds a machine of each instruction set can run (an AVX-512 machine runs the AVX2 and the plain builds too)."""


def naive(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Row by row, head by head, query by query, in float64: (B, Q, H * D)."""
    batch, count, _ = queries.shape
    heads, head_dim = keys.size(1), keys.size(3)
    out = torch.zeros(batch, count, heads * head_dim, dtype=torch.float64)
    for b in range(batch):
        length = int(lengths[b])
        for h in range(heads):
            columns = slice(h * head_dim, (h + 1) * head_dim)
            for j in range(count):
                if length:
                    scores = keys[b, h, :length].double() @ queries[b, j, columns].double() / head_dim**0.5
                    out[b, j, columns] = scores.softmax(dim=0) @ values[b, h, :length].double()
    return out


SHAPES = [  # (B, H, Q, D, S): a decoding step's (one query; a sentence's beams), head sizes of whole vectors and not,
    # one position, many (several blocks of W positions and a part)
    (3, 2, 1, 64, 33), (5, 4, 5, 40, 100), (1, 1, 1, 8, 1), (7, 3, 2, 128, 17), (4, 2, 1, 72, 70), (2, 4, 1, 16, 16),
]


@pytest.fixture(params=list(INSTRUCTION_SETS))
def op(request: pytest.FixtureRequest):
    name = request.param
    if name not in RUNS_HERE[machine_instruction_set()]:
        pytest.skip(f"this machine ({machine_instruction_set()}) cannot run the {name} build")
    return decode_attention_op(name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{b}H{h}Q{q}D{d}S{s}" for b, h, q, d, s in SHAPES])
def test_the_kernel_is_attention_over_each_row_s_first_positions(op, shape, dtype: torch.dtype):
    """Each row over its own length (every length from 0, zeros out, to S), float32 to float32's rounding and bf16
    inputs to bf16's (its arithmetic is float32: only the output is rounded)."""
    batch, heads, count, head_dim, positions = shape
    generator = torch.Generator().manual_seed(sum(shape))
    queries = torch.randn(batch, count, heads * head_dim, generator=generator).to(dtype)
    keys, values = (torch.randn(batch, heads, positions, head_dim, generator=generator).to(dtype) for _ in range(2))
    lengths = torch.randint(0, positions + 1, (batch,), generator=generator)
    lengths[0] = positions
    got = op(queries, keys, values, lengths)
    assert got.shape == queries.shape and got.dtype == dtype and got.is_contiguous()
    expected = naive(queries, keys, values, lengths)
    torch.testing.assert_close(got.double(), expected, **(dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else
                                                          dict(atol=1e-2, rtol=1e-2)))
    assert not got[lengths == 0].any()


def test_the_kernel_reads_views_as_the_step_hands_them(op):
    """The step's inputs are views: its queries a third of the self-attention's fused projection (rows a stride
    apart), its keys and values the cache's first positions (a capacity longer than the positions read), and the
    self-attention's lengths one position for every row (stride 0); the padding past a row's length is never
    read (NaN there changes nothing)."""
    generator = torch.Generator().manual_seed(5)
    batch, heads, head_dim, positions, capacity = 6, 4, 64, 20, 24
    fused = torch.randn(batch, 1, 3 * heads * head_dim, generator=generator)
    queries = fused[..., : heads * head_dim]  # (B, 1, H * D), rows 3 * H * D apart
    cache = torch.randn(2, batch, heads, capacity, head_dim, generator=generator)
    cache[:, :, :, positions:] = float("nan")  # not yet written
    keys, values = cache[0], cache[1]
    lengths = torch.tensor(positions).expand(batch)  # (B,), stride 0
    got = op(queries, keys, values, lengths)
    torch.testing.assert_close(got.double(), naive(queries, keys, values, lengths), atol=2e-6, rtol=1e-5)


def test_the_reference_is_the_naive_attention():
    """decode_attention_reference, the kernel's specification written with matmuls, is the naive loops' attention
    (a row of length 0 zeros)."""
    generator = torch.Generator().manual_seed(6)
    queries = torch.randn(3, 2, 4 * 8, generator=generator, dtype=torch.float64)
    keys, values = (torch.randn(3, 4, 9, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    lengths = torch.tensor([9, 0, 4])
    torch.testing.assert_close(decode_attention_reference(queries, keys, values, lengths),
                               naive(queries, keys, values, lengths))


def test_the_kernel_refuses_inputs_that_do_not_fit_in_one_line_each():
    op = decode_attention_op()
    queries, keys = torch.randn(2, 1, 32), torch.randn(2, 4, 5, 8)
    lengths = torch.tensor([5, 5])
    for args, message in [((queries, keys, keys[:, :, :4], lengths), "values .* are not the keys'"),
                          ((torch.randn(2, 1, 24), keys, keys, lengths), "keys .* do not fit queries"),
                          ((queries, keys, keys, lengths.int()), "lengths \\(B,\\) int64"),
                          ((queries.double(), keys.double(), keys.double(), lengths), "float32 or bfloat16")]:
        with pytest.raises(RuntimeError, match=message):
            op(*args)


def test_the_machine_s_build_is_one_there_is():
    assert machine_instruction_set() in INSTRUCTION_SETS
    with pytest.raises(ValueError, match="no decode_attention build for 'NEON'"):
        decode_attention_op("NEON")


def test_a_build_that_fails_is_one_line_naming_the_compiler_s_error(monkeypatch: pytest.MonkeyPatch):
    def failing(**_: object) -> None:
        raise RuntimeError("Error building extension 'seq2seq_avx2':\n[1/2] c++ -O3 ...\nFAILED: decode_attention.o\n"
                           "decode_attention.cpp:40:3: error: 'Vec' was not declared\nninja: build stopped")

    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr("torch.utils.cpp_extension.load", failing)
    with pytest.raises(KernelBuildError) as caught:
        decode_attention_op("AVX2")
    assert str(caught.value) == ("the decoding step's attention kernel could not be built (decode_attention.cpp:40:3: "
                                 "error: 'Vec' was not declared)")
