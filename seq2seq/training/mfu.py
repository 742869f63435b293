"""Model FLOPs utilisation: how much of a GPU's datasheet peak a training run's arithmetic uses.

A training step costs about 6 N FLOPs a token (2 N forward, 4 N backward, N parameters; Kaplan et al. 2020) and
MFU is that count over the time taken, as a share of the chip's dense bf16 peak (PaLM's definition, Chowdhery et
al. 2022). For an encoder-decoder the tokens counted are the target's: the encoder runs over the source, about as
long, so 6 N per target token stays the right order; attention's own FLOPs (which grow with length) are left out,
as in the definition. The output projection is counted where it is tied to the embedding (N holds it once, and
it does its matmul at every target position).
"""

import torch
from torch import nn

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from NVIDIA's datasheets, by a part of the name torch gives
# the device (torch.cuda.get_device_name); the first that matches is the chip's.
GPU_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM5
    ("H200", 989.0),  # (GH200 too)
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
)


def datasheet_peak(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU called `device_name`, FLOP/s; None for one not in GPU_BF16_PEAKS."""
    for part, tflops in GPU_BF16_PEAKS:
        if part in device_name:
            return tflops * 1e12
    return None


def training_flops_per_token(model: nn.Module) -> int:
    """6 N: the FLOPs a training step spends on one target token, N the model's parameters (each counted once)."""
    return 6 * sum(p.numel() for p in model.parameters())


def mfu(model: nn.Module, *, tokens_per_second: float, peak: float) -> float:
    """The share of `peak` FLOP/s that training `model` at `tokens_per_second` target tokens uses."""
    return training_flops_per_token(model) * tokens_per_second / peak


def gpu_peak(device: torch.device) -> float | None:
    """The datasheet peak of a CUDA device, or None (not CUDA, or a chip we have no figure for)."""
    if device.type != "cuda":
        return None
    return datasheet_peak(torch.cuda.get_device_name(device))
