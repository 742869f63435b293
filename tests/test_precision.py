"""Tests for seq2seq.model.precision: choosing the number format, and the int8 linear layers."""

import pytest
import torch
from torch import nn

from seq2seq.model import Transformer, TransformerConfig
from seq2seq.model.precision import (
    Int8Linear,
    bf16_matmuls_pay,
    for_inference,
    quantize_int8,
    resolve_precision,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("pays,expected", [(True, "bf16"), (False, "fp32")])
def test_auto_picks_bf16_only_where_it_measures_faster(monkeypatch, pays, expected):
    monkeypatch.setattr("seq2seq.model.precision.bf16_matmuls_pay", lambda device: pays)
    assert resolve_precision("auto", CPU) == expected
    for fixed in ("fp32", "bf16", "int8"):
        assert resolve_precision(fixed, CPU) == fixed  # an explicit choice is kept


def test_the_measurement_runs_here_and_other_devices_get_no_bf16():
    bf16_matmuls_pay.cache_clear()
    assert isinstance(bf16_matmuls_pay(CPU), bool)  # which one depends on the CPU; a few ms either way
    assert bf16_matmuls_pay(torch.device("meta")) is False


@pytest.mark.parametrize("capability,pays", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_auto_on_a_gpu_wants_native_bf16(monkeypatch, capability, pays):
    """V100 and T4 report bf16 support by emulating it, slowly: only Ampere and later count."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    bf16_matmuls_pay.cache_clear()
    try:
        assert bf16_matmuls_pay(torch.device("cuda", 0)) is pays
    finally:
        bf16_matmuls_pay.cache_clear()


def test_bad_precisions_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="one of auto, fp32, bf16, int8, got 'fp16'"):
        resolve_precision("fp16", CPU)
    with pytest.raises(ValueError, match="int8 runs on CPUs only"):
        resolve_precision("int8", torch.device("cuda"))


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
