"""Number formats and numerics the model runs in: its weights cast for inference (bf16, or int8 linear
layers), and an exp that avoids a slow path of torch's.

    fp32   float32 weights and activations
    bf16   bfloat16 weights (cast once, not per call as autocast would), float32 logits
    int8   the linear layers' weights in int8, one scale per output row; activations quantised per
           call (dynamic quantisation), on fbgemm's int8 kernels; CPU only

Which format pays on a machine is seq2seq/precision.py's question; this module only converts.
"""

import math
import warnings
from typing import Literal, TypeVar

import torch
from torch import Tensor, nn

M = TypeVar("M", bound=nn.Module)


def exp_(x: Tensor) -> Tensor:
    """x.exp_() in place, for x <= 0 such as logits minus their maximum, with what would underflow
    clamped first to one e-fold above the smallest normal float (e^-86.3 for float32 and bfloat16).

    torch's vectorised exp takes a slow path where its result is below the smallest normal float,
    whatever the denormal setting (on AVX-512 CPUs at least; README, Results): a confident model's
    probabilities are that small over most of the vocabulary, so a softmax over them got slower as
    training went on. The clamp changes each such probability by less than 1e-37.
    """
    if x.dtype == torch.float16:  # its normal floats end at e^-9.7: the clamp would change probabilities
        raise TypeError("exp_ takes float32, bfloat16 or float64 (float16 underflows at e^-9.7): cast it first")
    return x.clamp_(min=math.log(torch.finfo(x.dtype).tiny) + 1.0).exp_()


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
