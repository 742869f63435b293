"""The number format a model runs in, chosen for the machine it runs on.

    fp32   float32 weights and activations
    bf16   bfloat16 weights (cast once, not per call as autocast would), float32 logits
    int8   the linear layers' weights in int8, one scale per output row; activations quantised per
           call (dynamic quantisation), on fbgemm's int8 kernels; CPU only. Outputs differ slightly
           from fp32 (as CTranslate2's int8 does), so it is never chosen for you.
    auto   bf16 where bf16 matmuls are fast, fp32 elsewhere

How `auto` decides, from what does not move with the machine's load first:
- a GPU: bf16 from compute capability 8.0 (Ampere) on; older GPUs only emulate it, slowly;
- an x86 CPU: its flags (Linux's /proc/cpuinfo). With bf16 matmul units (`amx_bf16`: Intel Sapphire Rapids on;
  `avx512_bf16`: AMD Zen 4 on, Intel Cooper Lake) bf16 matmuls run several times faster than fp32;
  without them (AVX2-only CPUs) torch emulates bf16, 10-100x slower;
- any other CPU (ARM, or flags not to be read): bf16 and fp32 matmuls are timed, and bf16 is chosen
  only where it measures MARGIN times faster. The verdict is kept in a cache file per machine
  (CPU model, flags, torch version), so that the same command gives the same output on the same
  machine: a timing taken under load would otherwise decide differently from run to run.
Attention under bf16 autocast (training) is decided in the same way, by timing and the same
cache: torch's CPU attention kernels are slower in bf16 than in fp32 even where matmuls are not.
"""

import hashlib
import json
import math
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Precision = Literal["auto", "fp32", "bf16", "int8"]
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "int8")
M = TypeVar("M", bound=nn.Module)
# Training's `precision: auto` as decided by the process the user started ("cpu=32-true"): the DDP
# processes Lightning launches inherit it instead of deciding for themselves (seq2seq/fit.py).
AUTO_TRAINING_PRECISION_ENV = "_SEQ2SEQ_AUTO_PRECISION"
BF16_UNITS = ("amx_bf16", "avx512_bf16")  # x86 flags of bf16 matmul units
# A timed verdict picks bf16 only where it is this much faster: near-ties stay fp32, whatever the noise.
MARGIN = 1.25


@dataclass(frozen=True)
class CPU:
    arch: str  # platform.machine(): x86_64, aarch64, arm64, ...
    model: str
    flags: frozenset[str]

    @property
    def is_x86(self) -> bool:
        return self.arch.lower() in ("x86_64", "amd64", "i386", "i686")


@cache
def this_cpu() -> CPU:
    """This machine's processor: Linux's /proc/cpuinfo (`flags` on x86, `Features` on ARM); no flags elsewhere."""
    model, flags = platform.processor(), frozenset[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return CPU(arch=platform.machine(), model=model or "unknown", flags=flags)


def device_name(device: torch.device) -> str:
    """What to call the device in messages: the GPU's or the CPU's model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return this_cpu().model if device.type == "cpu" else str(device)


@dataclass(frozen=True)
class Verdict:
    """Whether bf16 pays for one use on one device, and why (printed with the choice)."""

    bf16: bool
    why: str


def bf16_matmuls(device: torch.device, *, training: bool = False) -> Verdict:
    """Whether bf16 linear layers run faster than fp32 ones here: shaped like a decoding step's or,
    with `training`, like a training batch's forward and backward."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        native = capability >= (8, 0)
        return Verdict(native, f"compute capability {capability[0]}.{capability[1]}"
                               f"{'' if native else ' emulates bf16 (native from 8.0)'}")
    if device.type != "cpu":
        return Verdict(False, f"no measurement of ours for {device.type}")
    cpu = this_cpu()
    if cpu.is_x86 and cpu.flags:  # no flags: not Linux (Windows, macOS on Intel), timed as below
        units = [flag for flag in BF16_UNITS if flag in cpu.flags]
        if units:
            return Verdict(True, f"this CPU has bf16 matmul units: {', '.join(units)}")
        return Verdict(False, f"this CPU has no bf16 matmul units ({' or '.join(BF16_UNITS)}): torch emulates bf16")
    use = "training" if training else "decoding"
    return timed_verdict(f"matmul-{use}", lambda dtype: _fastest_linear(dtype, device, training=training),
                         what="bf16 matmuls")


def bf16_matmuls_pay(device: torch.device, *, training: bool = False) -> bool:
    return bf16_matmuls(device, training=training).bf16


def bf16_attention(device: torch.device, *, dropout: bool) -> Verdict:
    """Under bf16 autocast, whether attention runs faster in bf16 than in float32 (training: forward and
    backward, with attention dropout or without, which takes another kernel)."""
    if device.type != "cpu":  # GPU attention kernels are made for bf16 (flash attention)
        return Verdict(True, f"{device.type} attention kernels are made for bf16")
    kind = "dropout" if dropout else "flash"
    return timed_verdict(f"attention-{kind}-training", lambda dtype: _fastest_attention(dtype, dropout=dropout),
                         what="bf16 attention")


def timed_verdict(key: str, seconds: Callable[[torch.dtype], float], *, what: str) -> Verdict:
    """bf16 if it measures MARGIN times faster than float32, timed once per machine: the cache file keeps it."""
    path = verdict_cache()
    cached = read_cache(path).get(key)
    if isinstance(cached, dict) and isinstance(cached.get("bf16"), bool):
        measured = cached
    else:
        bf16, fp32 = seconds(torch.bfloat16), seconds(torch.float32)
        measured = {"bf16": fp32 > MARGIN * bf16, "speed-up": round(fp32 / bf16, 2)}
        write_cache(path, {**read_cache(path), key: measured})
    return Verdict(measured["bf16"], f"{what} timed at {measured.get('speed-up', '?')}x the speed of fp32 here, "
                                     f"{'over' if measured['bf16'] else 'under'} the {MARGIN}x asked; kept in {path}")


def verdict_cache() -> Path:
    """The cache file of this machine: one per CPU model, flags and torch version, under XDG_CACHE_HOME."""
    cpu = this_cpu()
    identity = json.dumps([cpu.arch, cpu.model, sorted(cpu.flags), torch.__version__])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "seq2seq" / f"machine-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.json"


def read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, unreadable or damaged: measure again
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, data: dict) -> None:
    """Written whole or not at all (a rename); a cache that cannot be written only costs a new timing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(temporary, path)
    except OSError:
        pass


def _fastest(run: Callable[[], None], *, repeats: int = 3) -> float:
    run()  # warm-up: kernel selection, first-touch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()  # on a CPU the call returns when the work is done
        best = min(best, time.perf_counter() - start)
    return best


def _fastest_linear(dtype: torch.dtype, device: torch.device, *, training: bool) -> float:
    """Seconds of a linear layer shaped like a decoding step's or, with `training`, like a training
    batch's forward and backward (whose transposed layouts are the ones AVX2 CPUs run slowest in bf16)."""
    rows, d_in, d_out = (2048, 256, 1024) if training else (128, 256, 512)
    x = torch.randn(rows, d_in, device=device).to(dtype).requires_grad_(training)
    weight = torch.randn(d_out, d_in, device=device).to(dtype).requires_grad_(training)
    grad = torch.randn(rows, d_out, device=device).to(dtype)

    def run() -> None:
        y = F.linear(x, weight)
        if training:
            y.backward(grad)

    with torch.inference_mode(not training):
        return _fastest(run)


def _fastest_attention(dtype: torch.dtype, *, dropout: bool) -> float:
    """Seconds of a CPU self-attention's forward and backward shaped like a training batch's."""
    batch, heads, length, head_dim = 64, 4, 32, 64
    q, k, v = (torch.randn(batch, heads, length, head_dim).to(dtype).requires_grad_() for _ in range(3))
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    grad = torch.randn(batch, heads, length, head_dim).to(dtype)

    def run() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1 if dropout else 0.0).backward(grad)

    return _fastest(run)


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


def exp_(x: Tensor) -> Tensor:
    """x.exp_() in place, for x <= 0 such as logits minus their maximum, with what would underflow
    clamped first to one e-fold above the smallest normal float (e^-86.3 for float32).

    torch's vectorised exp takes a slow path where its result is below the smallest normal float,
    whatever the denormal setting (on AVX-512 CPUs at least; README, Results): a confident model's
    probabilities are that small over most of the vocabulary, so a softmax over them got slower as
    training went on. The clamp changes each such probability by less than 1e-37.
    """
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
