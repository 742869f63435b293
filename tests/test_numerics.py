"""Tests for seq2seq.model.numerics: the int8 linear layers, casting for inference, and exp_."""

import math

import pytest
import torch
from torch import nn

from seq2seq.model import Transformer, TransformerConfig
from seq2seq.model.numerics import Int8Linear, exp_, for_inference, quantize_int8


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
