"""Tests for seq2seq.model.numerics: the int8 linear layers, casting for inference, and exp_."""

import math
from copy import deepcopy
from unittest.mock import patch

import pytest
import torch
from torch import nn

from seq2seq.model import Transformer, TransformerConfig
from seq2seq.model.layers import FeedForward
from seq2seq.model.numerics import (
    Int8Linear,
    PackedLinear,
    RowInt8Linear,
    exp_,
    for_inference,
    onednn_packs,
    pack_linears,
    padded_rows,
    quantize_int8,
)


def test_exp_is_exp_where_it_does_not_underflow_and_a_normal_float_where_it_would():
    for dtype, rtol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float64, 1e-12)):
        tiny = torch.finfo(dtype).tiny
        low = math.log(tiny)  # below it exp gives a denormal or 0
        x = torch.linspace(2 * low, 0, 4001, dtype=torch.float64).to(dtype)
        out = exp_(x.clone()).double()
        above = x.double() > low + 1
        assert torch.allclose(out[above], x[above].double().exp(), rtol=rtol, atol=0)
        assert ((out[~above] >= tiny) & (out[~above] < 3 * tiny)).all()  # a normal float, not 0 or a denormal
    with pytest.raises(TypeError, match="float16"):
        exp_(torch.zeros(3, dtype=torch.float16))


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_is_close_to_the_float64_product(bias):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=bias)
    x = torch.randn(3, 7, 256)
    reference = nn.functional.linear(x.double(), linear.weight.double(),
                                     linear.bias.double() if bias else None)  # (3, 7, 96)
    out = Int8Linear(linear)(x)
    assert out.shape == (3, 7, 96) and out.dtype == torch.float32
    # 8-bit weights (per row) and 7-bit activations: a few percent of the output's scale, no more.
    error = (out.double() - reference).abs().max() / reference.abs().max()
    assert 0 < error < 0.03, error
    assert Int8Linear(linear)(x[0, :0]).shape == (0, 96)  # an empty batch


def row_int8_reference(x: torch.Tensor, linear: nn.Linear, *, bits: int) -> torch.Tensor:
    """RowInt8Linear's arithmetic, naively in float64: weights to int8 by rows, activations to `bits` by rows,
    their integer products summed exactly, then scaled back."""
    weight = linear.weight.detach().double()  # (out, in)
    weight_scale = (weight.abs().amax(dim=1) / 127).float().double()  # (out,), as float32 stores it
    levels = (1 << (bits - 1)) - 1
    x = x.double()
    scale = (x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / levels).float().double()  # (..., 1); 0 rows: 0
    product = (x / scale).round() @ (weight / weight_scale[:, None]).round().T  # (..., out), integers
    out = product * weight_scale * scale
    return out + linear.bias.detach().double() if linear.bias is not None else out


VNNI = torch.cpu._is_vnni_supported()


@pytest.mark.parametrize("bits", [7, pytest.param(8, marks=pytest.mark.skipif(
    not VNNI, reason="8-bit activations overflow the 16-bit pair sums of x86's int8 instructions without VNNI: "
                     "RowInt8Linear never takes them there (test_row_int8_linear_takes_8_bits_only_with_vnni)"))])
@pytest.mark.parametrize("bias", [True, False])
def test_row_int8_linear_is_its_integer_arithmetic_done_in_float64(bits: int, bias: bool):
    """oneDNN's int8 op sums the integer products exactly (int32): what is left is float32's rounding of the
    scales, far below the quantisation's own error, which is a few percent of the output's scale and less with
    8 bits than with 7."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=bias)
    x = torch.randn(3, 7, 256) * torch.logspace(-3, 2, 7)[:, None]  # rows of scales 1e-3 to 1e2: each its own
    x[1, 2] = 0  # a row of zeros: its outputs the bias
    layer = RowInt8Linear(linear, activation_bits=bits)
    out = layer(x)
    assert out.shape == (3, 7, 96) and out.dtype == torch.float32
    reference = row_int8_reference(x, linear, bits=bits)
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-6 * reference.abs().amax())
    with torch.no_grad():
        exact = nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double() if bias else None)
    error = ((out.double() - exact).abs().amax(dim=-1) / exact.abs().amax(dim=-1).clamp(min=1e-12))  # per row
    assert error.max() < (0.02 if bits == 8 else 0.04), error.max()
    assert f"activations {bits}-bit per row" in repr(layer)
    assert layer(x[0, :0]).shape == (0, 96)  # an empty batch
    half = layer(x.bfloat16())  # bf16 in, bf16 out: the same arithmetic on the bf16-rounded input
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), row_int8_reference(x.bfloat16().float(), linear, bits=bits).bfloat16()
                               .double(), rtol=1e-2, atol=1e-2 * reference.abs().amax())


def test_row_int8_linear_takes_8_bits_only_with_vnni(monkeypatch: pytest.MonkeyPatch):
    """Without VNNI, x86 sums pairs of u8 x s8 products in 16 bits (255 * 127 * 2 overflows): 7-bit activations
    there, 8 where the sums are int32 throughout; either forced by activation_bits, and nothing else taken."""
    linear = nn.Linear(32, 8)
    for vnni, bits in ((True, 8), (False, 7)):
        monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda vnni=vnni: vnni)
        assert RowInt8Linear(linear).levels == (1 << (bits - 1)) - 1
        assert RowInt8Linear(linear, activation_bits=15 - bits).levels == (1 << (14 - bits)) - 1
    with pytest.raises(ValueError, match="activation_bits is 7 or 8, got 4"):
        RowInt8Linear(linear, activation_bits=4)


def test_int8_linear_runs_fbgemm_at_padded_rows_and_returns_the_rows_given(monkeypatch):
    """fbgemm sees padded_rows(rows) rows, zero beyond the input's; each row comes back as the unpadded call
    gives it, to the bit here: zero rows leave the activations' quantisation range alone (it holds 0 already),
    also where every input is positive."""
    torch.manual_seed(0)
    layer = Int8Linear(nn.Linear(64, 40))
    seen = []
    fbgemm = torch.ops.quantized.linear_dynamic

    def spy(x, *args):
        seen.append(x.clone())
        return fbgemm(x, *args)

    for shape in ((17, 64), (3, 7, 64), (481, 1, 64), (5, 64), (0, 64), (2, 3, 64), (4, 8, 64), (64,)):
        for x in (torch.randn(shape), torch.rand(shape)):
            rows = x.numel() // 64
            unpadded = fbgemm(x.reshape(rows, 64), layer._packed, True).view(*shape[:-1], 40)
            with monkeypatch.context() as patched:
                patched.setattr(torch.ops.quantized, "linear_dynamic", spy)
                seen.clear()
                out = layer(x)
            assert out.shape == (*shape[:-1], 40) and torch.equal(out, unpadded)
            (given,) = seen  # a count padded_rows keeps runs in the input's own shape (a 1-D one as one row)
            kept = padded_rows(rows) == rows and x.dim() > 1
            assert given.shape == (x.shape if kept else (padded_rows(rows), 64))
            given = given.reshape(-1, 64)
            assert given.shape == (padded_rows(rows), 64)
            assert torch.equal(given[:rows], x.reshape(rows, 64)) and not given[rows:].any()
    with pytest.raises(ValueError, match=r"^a linear layer of 64 input features got an input of shape \(4, 10\)$"):
        layer(torch.randn(4, 10))


def test_quantize_int8_replaces_every_linear_and_keeps_the_embeddings():
    config = TransformerConfig(vocab_size=40, d_model=32, num_heads=2, d_ff=48, num_encoder_layers=1,
                               num_decoder_layers=1, dropout=0.0, max_positions=16)
    model = Transformer(config)
    embedding = model.decoder.embed.tokens.weight.detach().clone()
    src = torch.randint(4, 40, (2, 6))
    with torch.inference_mode():
        expected = model(src, src)
        quantize_int8(model)
        out = model(src, src)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    # q, kv and out of 3 attentions (encoder self, decoder self and cross), 2 per FFN, the output projection
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 3 * 3 + 2 * 2 + 1
    assert torch.equal(model.decoder.embed.tokens.weight, embedding)  # the tied embedding stays float32
    assert (out - expected).abs().max() < 0.05 * expected.abs().max()


def test_for_inference_casts_bf16_and_leaves_fp32_alone():
    model = nn.Sequential(nn.Linear(4, 4)).double()
    assert for_inference(model, "fp32")[0].weight.dtype == torch.float64  # a test's float64 model stays
    assert not model.training
    assert for_inference(model, "bf16")[0].weight.dtype == torch.bfloat16


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
# A bf16 weight in oneDNN's layout: what a test of oneDNN's own bf16 kernel needs (an AVX2-only CPU has none; there
# a bf16 PackedLinear stays plain, which test_a_bf16_layer_stays_plain_where_onednn_runs_no_bf16 forces everywhere).
ONEDNN_BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not onednn_packs(torch.bfloat16), reason="oneDNN runs no bf16 linear on this CPU (AVX-512 or AVX-NE-CONVERT)"))


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_is_the_float64_product(dtype, bias):
    """oneDNN's matmul on a weight packed once: the product of nn.Linear, to the dtype's precision, for
    a batch of rows, one row, a (B, T, D) input and an empty batch."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    for x in (torch.randn(3, 7, 256), torch.randn(1, 256), torch.randn(130, 256)):
        x = x.to(dtype)
        reference = nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double() if bias else None)
        with torch.inference_mode():
            out = packed(x)
        assert out.shape == reference.shape and out.dtype == dtype
        error = (out.double() - reference).abs().max() / reference.abs().max()
        assert error < (1e-6 if dtype == torch.float32 else 1e-2), error
    with torch.inference_mode():
        assert packed(torch.randn(0, 256, dtype=dtype)).shape == (0, 96)


def test_padded_rows_are_eight_counts_an_octave_at_most_an_eighth_more():
    """Below 16 every count is its own; from 16 on a count is rounded up to one of eight an octave, never by
    more than an eighth, and a rounded count stays as it is."""
    assert [padded_rows(rows) for rows in range(16)] == list(range(16))
    assert [padded_rows(rows) for rows in (16, 17, 31, 32, 33, 63, 65, 257, 480, 481, 8177)] == [
        16, 18, 32, 32, 36, 64, 72, 288, 480, 512, 8192]
    for low in (16, 32, 64, 1024):
        counts = {padded_rows(rows) for rows in range(low, 2 * low)}
        assert len(counts - {2 * low}) == 8 and max(counts) == 2 * low  # its top rounds to the next one's first
    for rows in range(16, 20000):
        padded = padded_rows(rows)
        assert rows <= padded <= rows * 9 / 8 and padded_rows(padded) == padded


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, ONEDNN_BF16])
def test_packed_linear_runs_onednn_at_padded_rows_and_returns_the_rows_given(dtype, monkeypatch):
    """oneDNN sees padded_rows(rows) rows, zero beyond the input's (its kernels are compiled per row count);
    what comes back is the input's rows, in its shape, each the float64 product to the dtype's precision,
    with and without the ReLU."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 40).to(dtype)
    packed = PackedLinear(linear)
    seen = []
    onednn = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        seen.append(x.clone())
        return onednn(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    for shape in ((17, 64), (3, 7, 64), (7, 3, 64), (481, 1, 64), (5, 64), (0, 64), (2, 3, 64), (4, 8, 64),
                  (64,)):
        x = torch.randn(shape).to(dtype)
        rows = x.numel() // 64
        reference = nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
        for relu in (False, True):
            seen.clear()
            with torch.inference_mode():
                out = packed.then_relu(x) if relu else packed(x)
            want = reference.relu() if relu else reference
            assert out.shape == (*shape[:-1], 40) and out.dtype == dtype
            assert torch.allclose(out.double(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
            (given,) = seen  # a count padded_rows keeps runs in the input's own shape (a 1-D one as one row)
            kept = padded_rows(rows) == rows and x.dim() > 1
            assert given.shape == (x.shape if kept else (padded_rows(rows), 64))
            given = given.reshape(-1, 64)
            assert given.shape == (padded_rows(rows), 64)
            assert torch.equal(given[:rows], x.reshape(rows, 64)) and not given[rows:].any()
    with pytest.raises(ValueError, match=r"^a linear layer of 64 input features got an input of shape \(4, 10\)$"):
        packed(torch.randn(4, 10).to(dtype))


@needs_onednn
def test_a_packed_fp32_layer_runs_its_few_rows_on_torch_s_own_linear(monkeypatch):
    """run_few_rows_on_torch(r): inputs of at most r rows go to torch's linear (and to no oneDNN call), more rows
    to oneDNN's; both give the float64 product to float32's rounding, ReLU too; copies and .to() keep the choice
    where they stay packed float32; anything but a packed float32 layer, or r outside 0-15, is refused."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 40)
    packed = PackedLinear(linear)
    assert packed._plain is None  # no plain copy beside the packed one unless few rows ask for it
    packed.run_few_rows_on_torch(4)
    assert packed.few_rows == 4 and "<= 4 rows on torch's own" in repr(packed)
    assert packed.weight is packed._plain and packed._plain.data_ptr() != linear.weight.data_ptr()
    onednn = torch.ops.mkldnn._linear_pointwise
    calls = []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *args: calls.append(x.shape) or onednn(x, *args))
    with torch.inference_mode():
        for shape, on_torch in (((1, 64), True), ((4, 64), True), ((2, 2, 64), True), ((1, 1, 64), True), ((64,), True),
                                ((0, 64), True), ((5, 64), False), ((3, 2, 64), False), ((17, 64), False)):
            x = torch.randn(shape)
            reference = nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
            for relu in (False, True):
                calls.clear()
                out = packed.then_relu(x) if relu else packed(x)
                want = reference.relu() if relu else reference
                assert out.shape == want.shape and torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)
                assert (not calls) is on_torch, (shape, relu)
        with pytest.raises(ValueError, match=r"^a linear layer of 64 input features got an input of shape \(2, 10\)$"):
            packed(torch.randn(2, 10))  # few rows, the wrong width: the same error as ever
    assert deepcopy(packed).few_rows == 4 and packed.to(torch.float32).few_rows == 4
    assert PackedLinear(linear).to(torch.bfloat16).few_rows == 0 and packed.double().few_rows == 0
    dropped = PackedLinear(linear)
    dropped.run_few_rows_on_torch(3)
    dropped.run_few_rows_on_torch(0)
    assert dropped.few_rows == 0 and dropped._plain is None  # the plain copy let go
    with pytest.raises(ValueError, match="between 0 and 15"):
        PackedLinear(linear).run_few_rows_on_torch(16)
    with pytest.raises(ValueError, match="only a packed float32 layer"):
        PackedLinear(nn.Linear(64, 40).bfloat16()).run_few_rows_on_torch(2)


@needs_onednn
@pytest.mark.parametrize("kind", ["fp32", pytest.param("bf16", marks=ONEDNN_BF16.marks), "int8"])
def test_a_strided_input_gives_what_its_contiguous_copy_gives(kind):
    """Inputs that reach the kernel as they are (their row count needs no padding) may be views: transposed,
    permuted, sliced; each gives, to the bit, what the same numbers laid out contiguously give."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 40)
    layer = Int8Linear(linear) if kind == "int8" else PackedLinear(linear.to(torch.bfloat16 if kind == "bf16" else torch.float32))
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    base = torch.randn(8, 3, 128).to(dtype)
    views = (base[..., :64].transpose(0, 1), base[:5, :, 64:].permute(1, 0, 2), base[:, 0, ::2], base[:2, :2, :64])
    with torch.inference_mode():
        for x in views:
            assert not x.is_contiguous()
            assert torch.equal(layer(x), layer(x.contiguous()))


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_relu_in_the_linear_epilogue_gives_the_same_numbers(dtype):
    """then_relu (the ReLU fused into oneDNN's matmul; float64 stays plain) equals relu of the linear layer's
    output bit for bit, for the rows of a decoding step and of an encoder batch; a feed-forward block with
    ReLU takes it where its linear layers are packed, and gives what it gave before."""
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(64, 256).to(dtype))
    assert ("plain" in repr(packed)) == (not onednn_packs(dtype))  # float64; bf16 on an AVX2-only CPU
    with torch.inference_mode():
        for x in (torch.randn(1, 64), torch.randn(5, 7, 64), torch.randn(600, 64)):
            x = x.to(dtype)
            fused = packed.then_relu(x)
            assert fused.dtype == dtype and torch.equal(fused, nn.functional.relu(packed(x)))
            assert (fused == 0).any() and (fused > 0).any()
    config = TransformerConfig(vocab_size=40, d_model=64, num_heads=2, d_ff=256, num_encoder_layers=1,
                               num_decoder_layers=1, dropout=0.0, max_positions=16)
    ffn = pack_linears(FeedForward(config).to(dtype).eval())
    x = torch.randn(3, 5, 64, dtype=dtype)
    with torch.inference_mode(), patch.object(PackedLinear, "then_relu", autospec=True,
                                              side_effect=PackedLinear.then_relu) as then_relu:
        out = ffn(x)
        plain = ffn.w_out(nn.functional.relu(ffn.w_in(x)))
    assert then_relu.call_count == (dtype != torch.float64) and torch.equal(out, plain)  # float64: nn.Linear kept


@needs_onednn
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_for_inference_packs_every_linear_and_keeps_the_tied_embedding(precision):
    config = TransformerConfig(vocab_size=40, d_model=32, num_heads=2, d_ff=48, num_encoder_layers=1,
                               num_decoder_layers=1, dropout=0.0, max_positions=16)
    torch.manual_seed(0)
    model = Transformer(config)
    reference = Transformer(config)
    reference.load_state_dict(model.state_dict())
    for_inference(reference, precision)
    for_inference(model, precision, packed=True)
    src = torch.randint(4, 40, (2, 6))
    with torch.inference_mode():
        out, expected = model(src, src), reference(src, src)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 3 * 3 + 2 * 2 + 1
    assert torch.equal(model.decoder.embed.tokens.weight, reference.decoder.embed.tokens.weight)  # not packed
    tolerance = 1e-5 if precision == "fp32" else 3e-2
    assert (out.float() - expected.float()).abs().max() <= tolerance * expected.float().abs().max()
    assert for_inference(Transformer(config), "int8", packed=True).output_projection.__class__ is Int8Linear


@needs_onednn
def test_a_packed_linear_converts_as_a_module_does():
    """.double() unpacks the weight exactly and keeps it plain (oneDNN has no float64), .float() and
    .to(bfloat16) pack it again: the tests' float64 references and a user's conversions keep working."""
    torch.manual_seed(0)
    linear = nn.Linear(8, 4)
    packed = PackedLinear(linear)
    x = torch.randn(2, 8)
    assert torch.equal(packed.weight, linear.weight.detach())
    packed.double()
    assert packed.weight.dtype == torch.float64 and "plain" in repr(packed)
    torch.testing.assert_close(packed(x.double()), linear(x).double().detach())
    packed.to(torch.bfloat16)
    assert f"bfloat16, {'oneDNN packed' if onednn_packs(torch.bfloat16) else 'plain'}" in repr(packed)
    assert packed(x.bfloat16()).dtype == torch.bfloat16
    copy = deepcopy(nn.Sequential(packed))[0]  # a model holding it can be copied (the server's tests do)
    assert copy is not packed and torch.equal(copy.weight, packed.weight) and torch.equal(copy.bias, packed.bias)
    assert torch.equal(copy(x.bfloat16()), packed(x.bfloat16()))


@needs_onednn
def test_a_bf16_layer_stays_plain_where_onednn_runs_no_bf16(monkeypatch):
    """On a CPU whose oneDNN has no bf16 linear (AVX2 only: its reorder raises), a bf16 PackedLinear keeps its
    weight plain and runs torch's own linear, to the same numbers, float32 still packed; and the machine's verdict
    says no to packing bf16 without timing it. Forced, so that every CPU runs the path an AVX2 one takes."""
    import seq2seq.precision as precision

    real = onednn_packs
    monkeypatch.setattr("seq2seq.model.numerics.onednn_packs", lambda dtype: dtype != torch.bfloat16 and real(dtype))
    monkeypatch.setattr("seq2seq.precision.onednn_packs", lambda dtype: dtype != torch.bfloat16 and real(dtype))
    monkeypatch.setattr(precision, "timed_verdict", lambda *args, **kwargs: pytest.fail("timed"))
    torch.manual_seed(0)
    linear = nn.Linear(64, 40).bfloat16()
    layer = PackedLinear(linear)
    x = torch.randn(3, 64).bfloat16()
    assert "bfloat16, plain" in repr(layer)
    with torch.inference_mode():
        assert torch.equal(layer(x), linear(x)) and torch.equal(layer.then_relu(x), linear(x).relu())
    assert "oneDNN packed" in repr(PackedLinear(nn.Linear(64, 40)))
    verdict = precision.onednn_linears(torch.device("cpu"), "bf16")
    assert not verdict.pays and "AVX-512" in verdict.why
