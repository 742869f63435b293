"""What pays on this machine: the precision `auto` resolves to, for training and for translation.

    fp32   float32 weights and activations
    bf16   bfloat16: bf16-mixed autocast in training; bf16 weights in translation
    int8   (translation, CPU) int8 linear layers (seq2seq/model/numerics.py); outputs differ slightly
           from fp32, as CTranslate2's int8 does, so it is never chosen for you
    auto   bf16 where bf16 matmuls are fast, fp32 elsewhere

How `auto` decides, from what does not move with the machine's load first, so that the same command
gives the same output on the same machine:
- a GPU: bf16 from compute capability 8.0 (Ampere) on; older GPUs only emulate it, slowly;
- an x86 CPU: its flags (Linux's /proc/cpuinfo). With bf16 matmul units (`amx_bf16`: Intel
  Sapphire Rapids on; `avx512_bf16`: AMD Zen 4 on, Intel Cooper Lake) bf16 matmuls beat fp32 ones;
  without them (AVX2-only CPUs) torch emulates bf16, far slower;
- any other CPU (ARM, or an x86 whose flags cannot be read): bf16 and fp32 matmuls are timed, and
  bf16 is chosen only where it is MARGIN times faster. The first verdict is kept, in a cache file
  per machine (CPU model, flags, torch version): a timing under load would otherwise decide
  differently from one run to the next.
Training asks one more question under bf16 autocast, answered by timing and the same cache: whether
attention's forward and backward run faster in bf16 than in float32 (torch's CPU attention kernels
can be slower in bf16 even where its matmuls are faster).

The process's memory is tuned here too (`tune_process_memory`, which the faces call): glibc keeps
freed blocks, and oneDNN's cache of compiled kernels stays bounded.
"""

import ctypes
import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from seq2seq.model.attention import attend_by_matmul
from seq2seq.model.numerics import PackedLinear, onednn_packs

Precision = Literal["auto", "fp32", "bf16", "int8"]
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "int8")
# Training's `precision: auto` as decided by the process the user started ("cpu=32-true"): the DDP
# processes Lightning launches inherit it instead of deciding for themselves (seq2seq/training/fit.py).
AUTO_TRAINING_PRECISION_ENV = "_SEQ2SEQ_AUTO_PRECISION"
BF16_UNITS = ("amx_bf16", "avx512_bf16")  # x86 flags of bf16 matmul units
# A timed verdict picks bf16 only where it is this much faster: near-ties stay fp32, whatever the noise.
MARGIN = 1.25


@dataclass(frozen=True)
class CPU:
    arch: str  # platform.machine(): x86_64, AMD64, aarch64, arm64, ...
    model: str
    flags: frozenset[str]

    @property
    def is_x86(self) -> bool:
        return self.arch.lower() in ("x86_64", "amd64", "i386", "i686")


@cache
def this_cpu() -> CPU:
    """This machine's processor: Linux's /proc/cpuinfo (`flags` on x86, `Features` on ARM); elsewhere no
    flags, and the model platform.processor() names."""
    model, flags = "", frozenset[str]()
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
    return CPU(arch=platform.machine(), model=model or platform.processor() or "unknown CPU", flags=flags)


def device_name(device: torch.device) -> str:
    """What to call the device in messages: the GPU's or the CPU's model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return this_cpu().model if device.type == "cpu" else str(device)


@dataclass(frozen=True)
class Verdict:
    """Whether the faster choice pays for one use on one device (bf16 over float32; oneDNN's packed linear
    layers; SDPA at one query a row), and why (printed with the choice)."""

    pays: bool
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
    return bf16_matmuls(device, training=training).pays


def bf16_attention(device: torch.device, *, dropout: bool) -> Verdict:
    """Under bf16 autocast, whether attention's forward and backward (training's) run faster in bf16 than
    in float32; with attention dropout or without, which takes another kernel."""
    if device.type != "cpu":  # GPU attention kernels are made for bf16 (flash attention)
        return Verdict(True, f"{device.type} attention kernels are made for bf16")
    kind = "dropout" if dropout else "flash"
    return timed_verdict(f"attention-{kind}-training", lambda dtype: _fastest_attention(dtype, dropout=dropout),
                         what="bf16 attention")


def onednn_linears(device: torch.device, precision: str) -> Verdict:
    """Whether translation's linear layers run faster on oneDNN with packed weights (numerics.PackedLinear)
    than on torch's own linear, in a resolved `precision`: timed once per machine and precision, at a
    decoding step's shapes, and chosen only MARGIN times faster (`Verdict.pays`: pack)."""
    if device.type != "cpu" or precision not in ("fp32", "bf16"):
        return Verdict(False, f"oneDNN packing is for fp32 and bf16 on a CPU, not {precision} on {device.type}")
    if not torch.backends.mkldnn.is_available():
        return Verdict(False, "this torch has no oneDNN")
    if not onednn_packs(torch.bfloat16 if precision == "bf16" else torch.float32):
        return Verdict(False, "oneDNN runs bf16 linear layers only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT")
    return timed_verdict(f"linear-onednn-{precision}", lambda packed: _fastest_decoding_linears(precision, packed),
                         what="oneDNN's packed linear layers", candidates=(True, False))


# The row counts timed for few_rows_on_torch, up to the last below padded_rows' first rounded count (16)
FEW_ROWS = (1, 2, 4, 8, 15)
FewRowsLayers = tuple[list[torch.nn.Linear], list[PackedLinear]]  # one shape's layers, plain and packed
FEW_ROWS_COPIES = 256  # copies of a shape timed at most (_few_rows_layers)


def few_rows_on_torch(device: torch.device, precision: str, *, in_features: int, out_features: int) -> int:
    """How many rows (0 to 15) a packed float32 linear layer of this shape runs faster on torch's own linear
    (MKL) than on oneDNN's: oneDNN's call describes the matmul anew, which at one row costs more than MKL's whole
    call, while MKL's small-row GEMM loses to oneDNN's as rows and widths grow
    (docs/performance/kernels.md#few-rows). Timed once per machine and shape at each of FEW_ROWS in turn, on one
    thread (a decoding worker's), up to the first where torch's own is not MARGIN times faster; the rows up to the
    last count that was (numerics.PackedLinear.run_few_rows_on_torch). 0 off a CPU and for bf16 (torch's bf16
    linear is no faster than oneDNN's at a few rows) and int8."""
    if device.type != "cpu" or precision != "fp32" or not torch.backends.mkldnn.is_available():
        return 0
    layers: list[FewRowsLayers] = []  # made once, if anything is timed

    def seconds(torch_own: bool, *, rows: int) -> float:
        if not layers:
            layers.append(_few_rows_layers(in_features=in_features, out_features=out_features))
        return _fastest_few_rows(torch_own, rows=rows, layers=layers[0])

    most = 0
    for rows in FEW_ROWS:
        verdict = timed_verdict(f"linear-few-rows-fp32-{in_features}x{out_features}-{rows}",
                                partial(seconds, rows=rows), what=f"torch's own linear at {rows} rows",
                                candidates=(True, False), baseline="oneDNN's packed one")
        if not verdict.pays:
            break
        most = rows
    return most


def one_query_sdpa(device: torch.device, precision: str) -> Verdict:
    """Whether a bf16 decoding step with one query per row of keys attends faster by torch's SDPA than by
    two batched matmuls (attention.attend_by_matmul, the default): timed once per machine at a step's
    shapes, SDPA chosen only MARGIN times faster (`Verdict.pays`: SDPA). Which wins differs by CPU
    (docs/performance/kernels.md#attention)."""
    if device.type != "cpu" or precision != "bf16":
        return Verdict(False, f"the choice is for bf16 on a CPU, not {precision} on {device.type}")
    return timed_verdict("attention-one-query-bf16", _fastest_one_query_attention, what="SDPA at one query a row",
                         candidates=(True, False), baseline="two batched matmuls")


def autocast_dtype(trainer_precision: str) -> torch.dtype | None:
    """The dtype Lightning's precision ("bf16-mixed", "16-mixed", "32-true", ...) autocasts to; None: no autocast."""
    if trainer_precision.startswith("bf16") and trainer_precision.endswith("mixed"):
        return torch.bfloat16
    if trainer_precision.startswith("16") and trainer_precision.endswith("mixed"):
        return torch.float16
    return None


def resolve_precision(precision: str, device: torch.device) -> Literal["fp32", "bf16", "int8"]:
    """Translation's `auto` made concrete for this device; a ValueError naming the choices for anything else."""
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


# ---- timing, once per machine ------------------------------------------------------------------


def timed_verdict(key: str, seconds: Callable[[Any], float], *, what: str,
                  candidates: tuple[Any, Any] = (torch.bfloat16, torch.float32), baseline: str | None = None) -> Verdict:
    """The first candidate (bf16) if it is MARGIN times faster than the second (float32), timed once per
    machine and kept in its cache file.

    The first verdict written is the machine's: a process that timed at the same moment as another
    takes the verdict the other wrote first, so that both decide alike. The file keeps the answer under
    "bf16", its name from when bf16 was the only choice timed, so that files already written stay valid.
    """
    path = verdict_cache() / f"{key}.json"
    measured = read_verdict(path)
    if measured is None:
        with torch.random.fork_rng(devices=[]):  # a seeded run draws the same numbers, timed or not
            new, old = seconds(candidates[0]), seconds(candidates[1])
        measured = keep_first_verdict(path, {"bf16": old > MARGIN * new, "speed-up": round(old / new, 2)})
    speed_up = measured.get("speed-up", "?")
    baseline = baseline or ("fp32" if candidates[1] is torch.float32 else "torch's own")
    return Verdict(measured["bf16"], f"{what} timed at {speed_up}x the speed of {baseline} here, "
                                     f"{'over' if measured['bf16'] else 'under'} the {MARGIN}x asked; kept in {path}")


def verdict_cache() -> Path:
    """The folder of this machine's verdicts: one per CPU model, flags and torch version, under XDG_CACHE_HOME."""
    cpu = this_cpu()
    identity = json.dumps([cpu.arch, cpu.model, sorted(cpu.flags), torch.__version__])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "seq2seq" / f"machine-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def read_verdict(path: Path) -> dict[str, Any] | None:
    """A verdict file's content, or None where there is none to trust (absent, unreadable, damaged)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("bf16"), bool) else None


def keep_first_verdict(path: Path, verdict: dict[str, Any]) -> dict[str, Any]:
    """Write `verdict` where no valid one is yet, whole or not at all; return the one the file holds then.

    A hard link publishes the file only if none is there (a rename would replace one another process
    just wrote). A cache that cannot be written costs only a new timing next time.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(verdict, f)
            if read_verdict(path) is None:  # none yet, or a damaged one to replace
                path.unlink(missing_ok=True)
            try:
                os.link(temporary, path)
            except FileExistsError:  # another process was first: its verdict is the machine's
                pass
            except OSError:  # a filesystem without hard links: a rename, unless a verdict came first
                if read_verdict(path) is None:
                    os.replace(temporary, path)
        finally:
            Path(temporary).unlink(missing_ok=True)
    except OSError:
        return verdict
    return read_verdict(path) or verdict


def _fastest(run: Callable[[], None], *, repeats: int = 3) -> float:
    run()  # warm-up: kernel selection, first-touch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()  # on a CPU the call returns when the work is done
        best = min(best, time.perf_counter() - start)
    return best


@contextmanager
def on_one_thread() -> Iterator[None]:
    """Torch's intra-op threads set to one inside, the caller's count given back after (OpenMP's count is per
    thread, as start_decoder_thread relies on): a decoding worker's verdicts are timed as it runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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


def _fastest_decoding_linears(precision: str, packed: bool) -> float:
    """Seconds of a decoding step's linear layers, a projection inside a layer and an output projection
    over a vocabulary, in `precision` (fp32 or bf16) on torch's own linear or oneDNN's packed one."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    layers = [(torch.randn(rows, 256).to(dtype), torch.nn.Linear(256, d_out).to(dtype))
              for rows, d_out in ((128, 512), (16, 8192))]
    modules = [PackedLinear(linear) if packed else linear for _, linear in layers]

    def run() -> None:
        for (x, _), module in zip(layers, modules, strict=True):
            module(x)

    with torch.inference_mode():
        return _fastest(run)


def _few_rows_layers(*, in_features: int, out_features: int) -> FewRowsLayers:
    """float32 linear layers of one shape, plain and packed: as many copies as make 16 MB of weights (one,
    where one is larger), for a step reads its layers' weights from beyond a core's caches, not one again and again;
    FEW_ROWS_COPIES at most, which binds below 64 KB a layer only (a toy model's), where more copies would time
    Python's calls over and over, and hold up a fresh process's start for as long."""
    copies = min(FEW_ROWS_COPIES, max(1, (16 << 20) // (in_features * out_features * 4)))
    plain = [torch.nn.Linear(in_features, out_features) for _ in range(copies)]
    return plain, [PackedLinear(linear) for linear in plain]


def _fastest_few_rows(torch_own: bool, *, rows: int, layers: FewRowsLayers) -> float:
    """Seconds of a pass through `layers` (plain, packed) at `rows` rows on torch's own linear or oneDNN's packed
    one, on one thread: each timing runs as many passes as fill a few milliseconds (at most 256), so that one
    slow call decides less."""
    modules: list[torch.nn.Module] = list(layers[0]) if torch_own else list(layers[1])
    x = torch.randn(rows, layers[0][0].in_features)

    def one_pass() -> None:
        for module in modules:
            module(x)

    with on_one_thread(), torch.inference_mode():
        passes = max(1, min(256, round(0.005 / _fastest(one_pass, repeats=1))))

        def run() -> None:
            for _ in range(passes):
                one_pass()

        return _fastest(run) / passes


def _fastest_one_query_attention(sdpa: bool) -> float:
    """Seconds of a bf16 decoding step's self-attention, one query a row, as the decoder runs it: SDPA over
    the cache's filled positions (a strided view), or the matmuls over its whole capacity, masked. On one
    thread, as a decoding worker mostly runs (one batch a core is the fastest configuration measured):
    the matmuls split over two threads where SDPA's one-query kernel gains little, so the two threads'
    verdict would hold for fewer setups (docs/performance/kernels.md#attention)."""
    rows, heads, filled, capacity, head_dim = 256, 4, 30, 32, 64
    queries = torch.randn(rows, heads, 1, head_dim).bfloat16()
    keys, values = (torch.randn(rows, heads, capacity, head_dim).bfloat16() for _ in range(2))
    mask = (torch.arange(capacity) < filled)[None, None, None, :]

    def run() -> None:
        if sdpa:
            F.scaled_dot_product_attention(queries, keys[:, :, :filled], values[:, :, :filled])
        else:
            attend_by_matmul(queries, keys, values, mask=mask)

    with on_one_thread(), torch.inference_mode():
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


# ---- memory ------------------------------------------------------------------------------------

# Kernels oneDNN keeps compiled, one per matmul shape (its default: 1,024). A training step runs a few dozen
# shapes, and the next step others (batch shapes vary, by design: token budgets), so the cache mostly holds
# kernels never used again; each holds megabytes. With 1,024 the memory of bf16 training grows step by
# step, and the steps slow as it fills (docs/performance/kernels.md#cache). 64 keeps every shape of one step
# (the layers of a stack share them), which is all that training reuses.
KERNEL_CACHE_CAPACITY = 64

# Translation reuses more: its packed linear layers run at rounded row counts (numerics.padded_rows), which
# every batch meets again as its sentences finish, a kernel per count for each of a model's few weight
# shapes. 64 hold about ten counts' kernels, fewer than one batch passes through, so every batch would compile
# its own again; 512 hold what a file's batches share, but for beam search's attention matmuls, whose shapes
# are not rounded and still evict some (docs/performance/kernels.md#cache).
DECODING_KERNEL_CACHE_CAPACITY = 512


def tune_process_memory(*, kernels: int = KERNEL_CACHE_CAPACITY) -> None:
    """What a process that trains or translates should set before its first step: keep_freed_memory, and a
    bounded oneDNN kernel cache of `kernels` (a capacity set in ONEDNN_PRIMITIVE_CACHE_CAPACITY is kept;
    translating processes pass DECODING_KERNEL_CACHE_CAPACITY). oneDNN reads the variable when it first
    compiles a kernel, so this works after `import torch`, not after a matmul. Process-wide: the faces call
    it (fit, the CLIs, the server), not the library."""
    keep_freed_memory()
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(kernels))


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse instead of giving large blocks back to the system.

    A decoding or training step allocates and frees tensors of tens of MB (the logits of every
    hypothesis, a loss chunk's, activations); glibc serves large blocks from a fresh mmap and unmaps
    them when freed, so the next step page-faults all of it in again (docs/performance/kernels.md#memory).
    With mmap off, blocks come from the heap and are reused; the process keeps its peak memory.
    False where the C library is not glibc (nothing changed).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):
        return False
