"""The number format a model decodes in, chosen for the machine it runs on.

    fp32   float32 weights and activations
    bf16   bfloat16 weights (cast once, not per call as autocast would), float32 logits
    int8   the linear layers' weights in int8, one scale per output row; activations quantised per
           call (dynamic quantisation), on fbgemm's int8 kernels; CPU only. Outputs differ slightly
           from fp32 (as CTranslate2's int8 does), so it is never chosen for you.
    auto   bf16 on a GPU with native bf16 (Ampere on), and on a CPU whose bf16 matmuls measure
           faster than fp32 ones (AMX, AVX512-BF16); fp32 elsewhere (AVX2-only CPUs run bf16
           matmuls 10-100x slower)

CPU flags alone do not say it: the measurement is what counts, and it takes a few milliseconds.
"""

import time
import warnings
from functools import cache
from typing import Literal, TypeVar

import torch
from torch import Tensor, nn

Precision = Literal["auto", "fp32", "bf16", "int8"]
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "int8")
M = TypeVar("M", bound=nn.Module)
# Training's `precision: auto` as decided by the process the user started ("cpu=32-true"): the DDP
# processes Lightning launches inherit it instead of timing for themselves (seq2seq/fit.py).
AUTO_TRAINING_PRECISION_ENV = "_SEQ2SEQ_AUTO_PRECISION"


def _fastest_linear(dtype: torch.dtype, device: torch.device, *, training: bool, repeats: int = 3) -> float:
    """Seconds of the fastest of `repeats` linear layers shaped like a decoding step's or, with
    `training`, like a training batch's forward and backward (whose transposed layouts are the ones
    AVX2 CPUs run slowest in bf16)."""
    rows, d_in, d_out = (2048, 256, 1024) if training else (128, 256, 512)
    x = torch.randn(rows, d_in, device=device).to(dtype).requires_grad_(training)
    weight = torch.randn(d_out, d_in, device=device).to(dtype).requires_grad_(training)
    grad = torch.randn(rows, d_out, device=device).to(dtype)

    def run() -> None:
        y = torch.nn.functional.linear(x, weight)
        if training:
            y.backward(grad)  # on a CPU the call returns when the products are done

    run()  # warm-up: kernel selection, first-touch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


@cache
def bf16_matmuls_pay(device: torch.device, *, training: bool = False) -> bool:
    """Whether bf16 linear layers run faster than fp32 ones here (measured once per device and use)."""
    if device.type == "cuda":  # native bf16 from Ampere on; older GPUs only emulate it (slowly)
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type != "cpu":
        return False
    with torch.inference_mode(not training):
        bf16 = _fastest_linear(torch.bfloat16, device, training=training)
        return bf16 * 1.1 < _fastest_linear(torch.float32, device, training=training)


def resolve_precision(precision: str, device: torch.device) -> Literal["fp32", "bf16", "int8"]:
    """`auto` made concrete for this device; a ValueError naming the choices for anything else."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "int8" and device.type != "cpu":
        raise ValueError(f"precision int8 runs on CPUs only (fbgemm's kernels), not on {device}; use bf16 or fp32")
    if precision == "int8" and "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("precision int8 needs torch's fbgemm int8 kernels (x86 CPUs), which this torch lacks; "
                         "use fp32")
    if precision == "auto":
        return "bf16" if bf16_matmuls_pay(device) else "fp32"
    return precision  # type: ignore[return-value]


class Int8Linear(nn.Module):
    """nn.Linear with int8 weights, symmetric, one scale per output row, and dynamically quantised
    activations, on fbgemm's int8 GEMM.

    Not torch.ao.quantization.quantize_dynamic (deprecated in favour of torchao) nor torchao's int8
    (on CPU it runs torch._int_mm, ~30x slower than fp32 matmuls on an AVX2 CPU): the fbgemm ops
    both of them were built on, called directly. reduce_range quantises activations to 7 bits, which
    keeps AVX2's 16-bit pairwise products from saturating (CPUs without VNNI).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float().cpu()  # (out, in)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()  # (out,)
        zero = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's prepack still takes one
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
        bias = linear.bias.detach().float().cpu() if linear.bias is not None else None
        self._packed = torch.ops.quantized.linear_prepack(qweight, bias)

    def forward(self, x: Tensor) -> Tensor:
        # x: (..., in) float32 -> (..., out) float32
        flat = x.reshape(-1, self.in_features)
        return torch.ops.quantized.linear_dynamic(flat, self._packed, True).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8(model: M) -> M:
    """Every nn.Linear of `model` (in place) replaced by an Int8Linear; embeddings and norms stay float32."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_int8(child)
    return model


def for_inference(model: M, precision: Literal["fp32", "bf16", "int8"]) -> M:
    """The model, in place, in eval mode and in `precision` (a resolved one); fp32 leaves the weights
    as they are (float32 from a checkpoint; a test's float64 stays float64)."""
    model.eval()
    if precision == "bf16":
        return model.to(torch.bfloat16)
    if precision == "int8":
        return quantize_int8(model.float())
    return model
