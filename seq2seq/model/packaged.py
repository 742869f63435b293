"""The compiled decoder built ahead of time: each kind of call's function (model/compiled.py's) exported with
torch.export and compiled by AOTInductor into a package a later process loads in milliseconds, where torch.compile
compiles every graph again in every process.

torch.compile's own caches do not keep this decoder: inductor's graph cache cannot pickle the weights that freezing
packs into oneDNN's layout, and AOTAutograd's cache is bypassed under freezing
(docs/performance/compiled-decoding.md#kept). AOTInductor packs the frozen weights into the package itself, and the
code it generates is the same as torch.compile's (the GEMM templates, the fused kernels, the attention kernel called
through the dispatcher without the GIL), with no guards to check at each call.

    CompiledDecoder.recorded_calls() ──torch.export (sizes symbolic)──► ExportedProgram per kind
        ──AOTInductor (freezing, GEMM templates timed at the recorded sizes)──► <kind>.pt2, unpacked: folder/<kind>/
    folder/<kind>/ ──load_package──► {kind: function}  ──► CompiledDecoder(model, packaged=...)

A package is built for one model's weights, precision, thread count and machine: the caller keys it
(inference/kept.py). Its generated code uses the intra-op thread count it was built on.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from seq2seq.model.compiled import ALL_KINDS, CompiledDecoder, CompileError, Kind, kind_name
from seq2seq.model.inductor import (
    CPP_WRAPPER,
    GEMM_TEMPLATES,
    QUIET,
    first_line,
    one_line_compile_errors,
    quiet_compile_warnings,
)
from seq2seq.model.kernels import (
    INSTRUCTION_SETS,
    KernelBuildError,
    decode_attention_op,
    machine_instruction_set,
    package_runner,
)
from seq2seq.model.numerics import RowInt8Linear

MANIFEST = "manifest.json"
"""The package folder's list of its kinds' folders (each an AOTInductor package unpacked), written last: a folder
without it is not a package."""

FORMAT = 2
"""The layout of a package folder; a folder of another is built again."""


class _Exported(nn.Module):
    """One of the decoder's functions as a module holding the model, for torch.export to find the weights it reads as
    the model's parameters and buffers (freezing makes them constants of the compiled code)."""

    def __init__(self, model: nn.Module, function: Callable[..., Any]):
        super().__init__()
        self.model = model
        self.function = function

    def forward(self, *inputs: Any) -> Any:
        return self.function(*inputs)


def check_packageable(decoder: CompiledDecoder) -> None:
    """ValueError, one line, for a decoder a package cannot hold: oneDNN's packed int8 weights are opaque tensors
    torch.export cannot trace (int8 stays on torch.compile); a GPU's package is another build."""
    if any(isinstance(module, RowInt8Linear) for module in decoder.model.modules()):
        raise ValueError("a compiled package holds fp32 or bf16 decoders; int8's packed oneDNN weights are compiled "
                         "in each process (torch.compile)")
    if next(decoder.model.parameters()).device.type != "cpu":
        raise ValueError("a compiled package is built for a CPU here; a GPU's decoder compiles in each process")


def _symbolic_sizes(value: Any) -> Any:
    """torch.export's dynamic_shapes for one input: every size above 1 symbolic (those the code fixes, such as the
    heads, export keeps constant), sizes of 1 constant (the kinds of call of one row or one sentence are apart)."""
    if isinstance(value, Tensor):
        return {dim: torch.export.Dim.AUTO for dim, size in enumerate(value.shape) if size > 1}
    if isinstance(value, (list, tuple)):
        return type(value)(_symbolic_sizes(item) for item in value)
    return None


def _outside_inference_mode(value: Any) -> Any:
    """A recorded input as a normal tensor (compile_kinds makes them in inference mode, which torch.export refuses)."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_outside_inference_mode(item) for item in value)
    return value


@contextmanager
def _one_line(kind: Kind) -> Iterator[None]:
    """torch.export's or AOTInductor's failure (pages of traceback; no C++ compiler, a kernel that does not build, a
    model export cannot trace) as a CompileError of one line naming the kind."""
    try:
        yield
    except CompileError:
        raise
    except Exception as error:  # (torch.export's and inductor's failures have no common type)
        raise CompileError(f"the decoder could not be compiled ahead of time ({kind_name(kind)}: "
                           f"{type(error).__name__}: {first_line(error)})") from None


def build_package(decoder: CompiledDecoder, folder: str | Path, *,
                  progress: Callable[[str], None] = lambda _line: None) -> Path:
    """Every kind of `decoder`'s calls exported and compiled into `folder` (made whole or not at all: built in a
    temporary folder beside it and renamed into place; a folder another process made first is kept), on this
    thread with its intra-op thread count. `progress` is told each kind as it starts. CompileError (one line) where
    inductor cannot compile; ValueError for a decoder no package holds (`check_packageable`)."""
    check_packageable(decoder)
    folder = Path(folder)
    calls = decoder.recorded_calls()
    options = {**QUIET, **CPP_WRAPPER, "freezing": True, **(GEMM_TEMPLATES if decoder.gemm_templates else {})}
    folder.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        files = {}
        for number, kind in enumerate(ALL_KINDS, start=1):
            name, inputs = calls[kind]
            progress(f"compiling the decoder ahead of time: {kind_name(kind)} ({number} of {len(ALL_KINDS)})")
            inputs = _outside_inference_mode(inputs)
            quiet_compile_warnings()
            file = building / f"{kind_name(kind)}.pt2"
            with torch.no_grad(), one_line_compile_errors(), _one_line(kind):
                exported = torch.export.export(_Exported(decoder.model, decoder.uncompiled(name)), inputs,
                                               dynamic_shapes=(_symbolic_sizes(inputs),), strict=False)
                torch._inductor.aoti_compile_and_package(exported, package_path=str(file), inductor_configs=options)
            with zipfile.ZipFile(file) as archive:  # (unpacked once here: a .pt2 is unpacked at every load)
                names = {name.split("/", 1)[0] for name in archive.namelist()}
                archive.extractall(building)
            file.unlink()
            if names != {kind_name(kind)}:
                raise CompileError(f"the decoder could not be compiled ahead of time ({kind_name(kind)}: its package "
                                   f"holds {', '.join(sorted(names))})")
            files[kind_name(kind)] = kind_name(kind)
        manifest = {"format": FORMAT, "torch": torch.__version__, "threads": torch.get_num_threads(), "files": files,
                    "attention_kernel": machine_instruction_set() if decoder.attention_kernel else None}
        (building / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        try:
            building.rename(folder)
        except OSError:  # (another process's package is there already: theirs is kept)
            if not is_package(folder):
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return folder


def is_package(folder: str | Path) -> bool:
    """Whether `folder` holds a whole package of this layout, torch version and thread count's."""
    manifest = _read_manifest(Path(folder))
    return manifest is not None


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("torch") != torch.__version__:
        return None
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != {kind_name(kind) for kind in ALL_KINDS}:
        return None
    if not all(isinstance(name, str) and (folder / name).is_dir() for name in files.values()):
        return None
    return manifest


class _Runner:
    """One kind's compiled model from its unpacked .pt2, called as the function it was exported from: the inputs (tensors and
    lists of tensors) flat in, the outputs in the function's structure out, the GIL released while it runs
    (package_runner.cpp, kernels.package_runner). torch's own loader (torch._inductor.package.load_package) holds the
    GIL while the model runs, so that decoder threads sharing it take turns; it also imports torch.export's
    serialisation and dynamo on the way (a second of every process's start) and parses the call's structure again
    at each call (a step's share at one row)."""

    def __init__(self, file: Path, *, runners: int):
        # The process asks Linux for the AMX tiles before any of the code runs: inductor's AMX micro-kernels do
        # not (torch.compile asks as it compiles them), and without it their first instruction kills the process
        # (SIGILL) unless a oneDNN call has asked first. (False, and nothing asked, on a CPU without AMX.)
        torch.cpu._init_amx()
        self._loader = package_runner().Runner(str(file), runners)
        self._out_spec = pytree.treespec_loads(self._loader.call_spec()[1])

    def __call__(self, *inputs: Tensor | list[Tensor]) -> Any:
        flat = [tensor for value in inputs for tensor in (value if isinstance(value, list) else (value,))]
        return pytree.tree_unflatten(self._loader.run(flat), self._out_spec)


class PackageError(ValueError):
    """A package folder that cannot be loaded (none there, another torch's, damaged): one line naming it."""


def load_package(folder: str | Path, *, runners: int = 1) -> dict[Kind, Callable[..., Any]]:
    """A package's functions by kind, for CompiledDecoder(model, packaged=...): each with `runners` instances of its
    compiled model, so that as many decoder threads run it at once (one waits for another's call otherwise).
    The attention kernel its code calls is loaded first (built where this machine has no build of it yet).
    PackageError where it holds no whole package that loads."""
    folder = Path(folder)
    manifest = _read_manifest(folder)
    if manifest is None:
        raise PackageError(f"{folder}: no compiled package of this torch version ({torch.__version__}) is there")
    kernel = manifest.get("attention_kernel")
    try:
        if kernel is not None:
            if kernel not in INSTRUCTION_SETS:
                raise PackageError(f"{folder}: its attention kernel ({kernel!r}) is none this version builds")
            decode_attention_op(kernel)  # (the package's code calls it by its name: registered first)
        return {kind: _Runner(folder / manifest["files"][kind_name(kind)], runners=runners) for kind in ALL_KINDS}
    except (RuntimeError, OSError, KernelBuildError) as error:
        raise PackageError(f"{folder}: the compiled package could not be loaded ({first_line(error)})") from None


def package_threads(folder: str | Path) -> int | None:
    """The intra-op thread count a package's code was generated for, or None where it holds no package."""
    manifest = _read_manifest(Path(folder))
    return None if manifest is None else int(manifest["threads"])

