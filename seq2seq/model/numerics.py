"""Number formats and numerics the model runs in: its weights cast for inference (bf16, or int8 linear
layers), the linear layers' weights packed for oneDNN, and an exp that avoids a slow path of torch's.

    fp32   float32 weights and activations
    bf16   bfloat16 weights (cast once, not per call as autocast would); the logits stay bf16
    int8   the linear layers' weights in int8, one scale per output row; activations quantised per
           call (dynamic quantisation), on fbgemm's int8 kernels; CPU only. A compiled decoding step's
           linear layers are RowInt8Linear instead: oneDNN's int8 op, which inductor compiles to its
           VNNI or AMX micro-kernels

Which format pays on a machine, and whether oneDNN's packed matmuls beat torch's own, is
seq2seq/precision.py's question; this module only converts.
"""

import math
import warnings
from collections.abc import Callable
from typing import Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

M = TypeVar("M", bound=nn.Module)


def exp_(x: Tensor) -> Tensor:
    """x.exp_() in place, for x <= 0 such as logits minus their maximum, with what would underflow
    clamped first to one e-fold above the smallest normal float (e^-86.3 for float32 and bfloat16).

    torch's vectorised exp takes a slow path where its result is below the smallest normal float,
    whatever the denormal setting (on AVX-512 CPUs at least; docs/performance/precision.md#exp): a confident
    model's probabilities are that small over most of the vocabulary, so a softmax over them gets slower as
    training goes on. The clamp changes each such probability by less than 1e-37.
    """
    if x.dtype == torch.float16:  # its normal floats end at e^-9.7: the clamp would change probabilities
        raise TypeError("exp_ takes float32, bfloat16 or float64 (float16 underflows at e^-9.7): cast it first")
    return x.clamp_(min=math.log(torch.finfo(x.dtype).tiny) + 1.0).exp_()


def padded_rows(rows: int) -> int:
    """The rows a packed or int8 linear layer runs its kernel at for `rows` rows: `rows` below 16, else rounded
    up to one of eight steps an octave (16, 18, ..., 30, 32, 36, ..., 60, 64, 72, ...), at most 1/8 more.

    oneDNN compiles a kernel for every shape it meets, and a decoding batch's row count changes as its
    sentences finish, to counts the next batch does not meet again, so each batch would compile kernels of its own
    (docs/performance/kernels.md#padded-rows). Rounded, the next batches meet
    the same counts, and the kernels compiled for them are still in the cache
    (precision.DECODING_KERNEL_CACHE_CAPACITY). Below 16 rows each count is its own (cheap kernels, each
    reused by every batch's last steps), where padding would cost CPUs that run one row faster than sixteen.
    """
    if rows < 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def at_padded_rows(kernel: Callable[[Tensor], Tensor], x: Tensor, *, in_features: int, out_features: int) -> Tensor:
    """kernel (a linear layer's (..., in) -> (..., out)) over x (..., in) -> (..., out), its rows run at
    padded_rows(rows), the rows added zeros and their outputs dropped. A ValueError names the width expected
    where x has another (reshape's own error would not)."""
    if x.dim() == 0 or x.size(-1) != in_features:
        raise ValueError(f"a linear layer of {in_features} input features got an input of shape {tuple(x.shape)}")
    rows = x.numel() // in_features
    padded = padded_rows(rows)
    if padded == rows and x.dim() > 1:  # x as it is (both kernels take any leading shape, fbgemm not 1-D): a
        return kernel(x)  # a step's few rows pay for every op around the kernel: docs/performance/kernels.md#no-copies
    flat = x.reshape(rows, in_features)  # (rows, in)
    if padded != rows:  # (F.pad zero-fills the whole result, then copies x over it: slower than cat)
        flat = torch.cat((flat, flat.new_zeros(padded - rows, in_features)))  # (padded, in)
    return kernel(flat)[:rows].view(*x.shape[:-1], out_features)


def int8_row_scales(weight: Tensor) -> Tensor:
    """(out,) float32 scales of a (out, in) weight quantised to int8 symmetrically, one per output row: the
    row's largest magnitude maps to 127."""
    return (weight.float().abs().amax(dim=1) / 127).clamp(min=1e-12)


class Int8Linear(nn.Module):
    """nn.Linear with int8 weights, symmetric, one scale per output row, and dynamically quantised
    activations, on fbgemm's int8 GEMM.

    Not torch.ao.quantization.quantize_dynamic (deprecated in favour of torchao) nor torchao's int8
    (on CPU it runs torch._int_mm, far slower than fp32 matmuls on an AVX2 CPU): the fbgemm ops
    both of them were built on, called directly. reduce_range quantises activations to 7 bits, which
    keeps AVX2's 16-bit pairwise products from saturating (CPUs without VNNI).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float().cpu()  # (out, in)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = int8_row_scales(weight).double()  # (out,)
        zero = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's prepack still takes one
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
        bias = linear.bias.detach().float().cpu() if linear.bias is not None else None
        self._packed = torch.ops.quantized.linear_prepack(qweight, bias)

    def forward(self, x: Tensor) -> Tensor:
        # x: (..., in) float32 -> (..., out) float32, its rows run at padded_rows(rows) (fbgemm compiles kernels
        # per shape too; zero rows leave the activations' quantisation range as it is: it always holds 0)
        return at_padded_rows(lambda flat: torch.ops.quantized.linear_dynamic(flat, self._packed, True), x,
                              in_features=self.in_features, out_features=self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class RowInt8Linear(nn.Module):
    """nn.Linear with int8 weights, symmetric, one scale per output row, and activations quantised per call,
    symmetric, one scale per row (token), as CTranslate2's int8 does; on oneDNN's int8 op, which inductor
    compiles into a decoding step as its own int8 micro-kernels (AVX512-VNNI or AMX), where Int8Linear's fbgemm
    call would stay an opaque call between the fused kernels (and float32 around it). CPU; float32 or bfloat16 in,
    the same out, computed in float32.

    x86's int8 instructions multiply unsigned bytes by signed ones, so the activations are shifted by a zero
    point into unsigned bytes (oneDNN subtracts it back, exactly, from the int32 sums). Without VNNI, CPUs
    sum pairs of those products in 16 bits first, which 8-bit activations overflow (oneDNN's "int8
    computation aspects"): there they are quantised to 7 bits (`activation_bits`), as fbgemm's reduce_range
    does; with VNNI the sums are int32 throughout, and 8 bits are exact.
    """

    def __init__(self, linear: nn.Linear, *, activation_bits: int | None = None):
        super().__init__()
        bits = activation_bits if activation_bits is not None else (8 if torch.cpu._is_vnni_supported() else 7)
        if bits not in (7, 8):
            raise ValueError(f"activation_bits is 7 or 8, got {bits!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.levels = (1 << (bits - 1)) - 1
        """Largest magnitude of a quantised activation (127 or 63); the zero point is one more."""
        weight = linear.weight.detach().float().cpu()  # (out, in)
        scale = int8_row_scales(weight)  # (out,)
        self.register_buffer("weight_scale", scale)
        quantised = (weight / scale[:, None]).round().to(torch.int8)  # (out, in), within +-127
        self.register_buffer("_packed", torch.ops.onednn.qlinear_prepack(quantised, None))  # oneDNN's layout
        self.register_buffer("_weight_zero", torch.zeros(self.out_features, dtype=torch.int32))
        self.register_buffer("bias", linear.bias.detach().float().cpu() if linear.bias is not None else None)

    def forward(self, x: Tensor) -> Tensor:
        # x: (..., in) float32 or bfloat16 -> (..., out) the same, computed in float32
        x32 = x.float()
        scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / self.levels  # (..., 1)
        shifted = ((x32 / scale).round() + (self.levels + 1)).to(torch.uint8)  # (..., in), 1 to 2 * levels + 1
        out = torch.ops.onednn.qlinear_pointwise(  # (..., out): int32 sums times the weight's scales, float32
            shifted, 1.0, self.levels + 1, self._packed, self.weight_scale, self._weight_zero, None, 1.0, 0,
            torch.float32, "none", [], "")
        # (the op takes one activation scale for all rows: each row's applied here, in place: a batch's memory
        # projected for every decoder layer's cross-attention at once is tens of MB a pass)
        out = out.mul_(scale)
        return (out.add_(self.bias) if self.bias is not None else out).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8, "
                f"activations {self.levels.bit_length() + 1}-bit per row")


class PackedLinear(nn.Module):
    """nn.Linear on oneDNN's matmul, its weight reordered once into oneDNN's blocked layout (CPU, float32
    or bfloat16, inference only).

    torch's own CPU linear runs float32 on MKL, which on AMD CPUs takes its AVX2 code even where the CPU
    has AVX-512 (oneDNN uses the AVX-512 units), and reorders a bf16 weight at every call
    (docs/performance/kernels.md#packed-linear). The ops are the ones torch.compile's CPU backend emits for
    linear layers.
    `.to()`, `.double()` and the like still work: the weight is unpacked (exactly), converted, and
    packed again where oneDNN takes the result, else kept plain for F.linear.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.few_rows = 0
        """Inputs of at most this many rows (0 to 15) run on torch's own linear instead (fp32 only, where
        precision.few_rows_on_torch times that faster: oneDNN's call describes the matmul anew, which at one row
        costs more than MKL's call; docs/performance/kernels.md#few-rows)."""
        self._store(linear.weight.detach(), linear.bias.detach() if linear.bias is not None else None)

    def _store(self, weight: Tensor, bias: Tensor | None) -> None:
        self.bias = bias
        self._packed: Tensor | None = None
        self._plain: Tensor | None = None
        if weight.device.type == "cpu" and onednn_packs(weight.dtype):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, *PACKED_FOR_ROWS[weight.dtype])
            if self.few_rows and weight.dtype == torch.float32:
                self._plain = weight  # kept beside the packed copy, for the few rows
            else:
                self.few_rows = 0
        else:
            self._plain = weight
            self.few_rows = 0  # (every row on torch's own)

    def run_few_rows_on_torch(self, rows: int) -> None:
        """Inputs of at most `rows` rows (0 to 15; 0: none) run on torch's own linear from now on, the plain
        weight kept beside the packed one. Float32 only: torch's bf16 linear is no faster than oneDNN's."""
        if not 0 <= rows < 16:
            raise ValueError(f"few_rows must be between 0 and 15 (padded_rows rounds from 16 on), got {rows}")
        if rows and (self._packed is None or self._packed.dtype != torch.float32):
            raise ValueError(f"only a packed float32 layer runs its few rows on torch's own linear, not this "
                             f"{self.weight.dtype} one ({'packed' if self._packed is not None else 'plain'})")
        if rows != self.few_rows:
            self.few_rows = rows
            self._store(self.weight, self.bias)

    @property
    def weight(self) -> Tensor:
        """The weight, (out, in), in the plain layout: the plain tensor the layer runs where it keeps one (unpacked,
        or beside the packed one for its few rows: writing into it changes those rows' outputs only), else a copy
        unpacked from oneDNN's layout."""
        if self._plain is not None:
            return self._plain
        assert self._packed is not None
        return self._packed.to_dense()

    def forward(self, x: Tensor) -> Tensor:
        # x: (..., in) -> (..., out), in the weight's dtype
        if self._packed is None or self._few(x):
            assert self._plain is not None
            return F.linear(x, self._plain, self.bias)
        return self._onednn(x, "none")

    def then_relu(self, x: Tensor) -> Tensor:
        """relu(self(x)), the ReLU in oneDNN's epilogue where the weight is packed: no second pass over the
        (..., out) output (a feed-forward's, 4 x d_model wide). The same numbers: a ReLU commutes with
        rounding to bf16."""
        if self._packed is None or self._few(x):
            return F.relu(self(x))
        return self._onednn(x, "relu")

    def _few(self, x: Tensor) -> bool:
        # x: (..., in) of at most few_rows rows (a wrong width goes on to at_padded_rows' error)
        return (self.few_rows > 0 and x.dim() > 0 and x.size(-1) == self.in_features
                and x.numel() <= self.few_rows * self.in_features)

    def _onednn(self, x: Tensor, post_op: str) -> Tensor:
        # x: (..., in) -> (..., out), its rows run at padded_rows(rows), the padding zeros. Each row's outputs
        # are its own dot products, but another row count may get another kernel from oneDNN, whose bf16
        # outputs can differ in the last place (docs/performance/kernels.md#padded-rows)
        return at_padded_rows(
            lambda flat: torch.ops.mkldnn._linear_pointwise(flat, self._packed, self.bias, post_op, [], ""), x,
            in_features=self.in_features, out_features=self.out_features)

    def __deepcopy__(self, memo: dict) -> "PackedLinear":
        # oneDNN's packed tensor has no storage to copy: the copy packs the plain weight again
        copy = PackedLinear.__new__(PackedLinear)
        nn.Module.__init__(copy)
        copy.in_features, copy.out_features, copy.few_rows = self.in_features, self.out_features, self.few_rows
        copy._store(self.weight.clone(), self.bias.clone() if self.bias is not None else None)
        return copy

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "PackedLinear":  # type: ignore[override]
        self._store(fn(self.weight), fn(self.bias) if self.bias is not None else None)
        return self

    def extra_repr(self) -> str:
        kind = "oneDNN packed" if self._packed is not None else "plain"
        if self.few_rows:
            kind += f", <= {self.few_rows} rows on torch's own"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.weight.dtype}, {kind}"


# oneDNN packs a bf16 weight for a batch size it is told (a hint: other sizes run too); float32 takes none.
PACKED_FOR_ROWS: dict[torch.dtype, tuple[int, ...]] = {torch.float32: (), torch.bfloat16: (64,)}


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and runs a `dtype` linear layer on this CPU: float32 wherever torch has oneDNN; bf16 only
    with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT (torch's check), not on an AVX2-only CPU, where its reorder raises."""
    if dtype not in PACKED_FOR_ROWS or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: M) -> M:
    """Every float32 or bfloat16 nn.Linear of `model` (in place) replaced by a PackedLinear (others, such
    as a test's float64 ones, stay); a weight tied to an embedding is packed as a copy (the embedding
    keeps the original)."""
    return replace_linears(model, lambda linear: PackedLinear(linear) if linear.weight.dtype in PACKED_FOR_ROWS
                           else linear)


def quantize_int8(model: M) -> M:
    """Every nn.Linear of `model` (in place) replaced by an Int8Linear; embeddings and norms stay float32."""
    return replace_linears(model, Int8Linear)


def replace_linears(model: M, replace: Callable[[nn.Linear], nn.Module]) -> M:
    """`model` (in place) with each nn.Linear child, at any depth, replaced by `replace(linear)`."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, replace(child))
        else:
            replace_linears(child, replace)
    return model


def for_inference(model: M, precision: Literal["fp32", "bf16", "int8"], *, packed: bool = False) -> M:
    """The model, in place, in eval mode and in `precision` (a resolved one); fp32 leaves the weights
    as they are (float32 from a checkpoint; a test's float64 stays float64). `packed`: float32 or bf16
    linear layers become PackedLinear (on a CPU where precision.onednn_linears says they pay)."""
    model.eval()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    elif precision == "int8":
        return quantize_int8(model.float())
    if packed:
        pack_linears(model)
    return model
