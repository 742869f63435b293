"""MFU's arithmetic (training/mfu.py): 6 N FLOPs a target token over a GPU's datasheet peak, found by its name."""

import pytest
import torch
from torch import nn

from seq2seq.model import Transformer, TransformerConfig
from seq2seq.training.mfu import datasheet_peak, gpu_peak, mfu, training_flops_per_token


@pytest.mark.parametrize(("name", "tflops"), [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
    ("NVIDIA GH200 480GB", 989), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312),
    ("NVIDIA L40S", 362), ("NVIDIA L40", 181), ("NVIDIA L4", 121), ("NVIDIA B200", 2250),
])
def test_each_gpu_gets_its_own_datasheet_peak_not_a_namesake(name: str, tflops: float):
    """"L4" is in "L40S", "H200" in "GH200": the first part that matches, in the table's order, is the chip's."""
    assert datasheet_peak(name) == tflops * 1e12


def test_a_gpu_not_in_the_table_and_a_cpu_have_none():
    assert datasheet_peak("NVIDIA GeForce GTX 1080") is None
    assert gpu_peak(torch.device("cpu")) is None


def test_six_n_a_token_counts_a_tied_embedding_once():
    """transformer-base with a tied 32k vocabulary: N counted once per parameter (the embedding is the output
    projection too), and MFU is 6 N x tokens/s over the peak."""
    config = TransformerConfig(vocab_size=32000, d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6,
                               num_decoder_layers=6, norm_placement="post")
    model = Transformer(config)
    n = sum(p.numel() for p in model.parameters())
    assert 55e6 < n < 70e6  # ~61M: 44M in the layers, 16M in the shared embedding
    assert training_flops_per_token(model) == 6 * n
    assert mfu(model, tokens_per_second=100_000, peak=989e12) == pytest.approx(6 * n * 1e5 / 989e12)
    assert training_flops_per_token(nn.Linear(3, 2)) == 6 * 8
