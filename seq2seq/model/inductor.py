"""torch.compile as the compiled decoding step (model/compiled.py) drives it: inductor's options, the settings dynamo
traces under, its functions compiled once with frozen weights, and inductor's failures in one line."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar, cast

import torch
from torch import Tensor

from seq2seq.model.kernels import KernelBuildError

T = TypeVar("T")

QUIET = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
"""Inductor's tables of its matmul timings not printed (a translation's output would drown in them)."""

GEMM_TEMPLATES = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
"""On a CPU, each matmul of the step chosen by timing inductor's CPP GEMM templates against ATen's kernels: the
templates' micro-kernels (AMX or AVX-512) sit among the fused work, where the eager step makes a oneDNN call per
layer, which at a few rows costs more than its arithmetic (docs/performance/compiled-decoding.md#gemm-templates);
compiling takes several times longer."""


CPP_WRAPPER = {"cpp_wrapper": True}
"""On a CPU, the step's call (the sequence of its kernels) generated as C++ too, not Python: the C++ call releases
the GIL while it runs (inductor's Python call runs the kernels holding it), so decoder workers sharing a decoder run
their steps at once instead of in turns (docs/performance/compiled-decoding.md#cpp-wrapper)."""


class UnexpectedCompile(RuntimeError):
    """inductor_backend asked to compile where its caller allows none (`allowed`): dynamo raises it wrapped in its
    BackendCompilerFailed, before a graph is made or counted."""


def inductor_backend(options: dict[str, object], *, allowed: Callable[[], bool] = lambda: True,
                     ) -> Callable[[torch.fx.GraphModule, list[Tensor]], Callable[..., object]]:
    """torch.compile's backend: inductor with `options` set while it compiles (and only then: set for the process
    they would change every other compiled function's), where `allowed()` says it may compile now (else
    UnexpectedCompile)."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    def compile_with_options(graph: torch.fx.GraphModule, inputs: list[Tensor]) -> Callable[..., object]:
        if not allowed():
            raise UnexpectedCompile("a graph asked for outside the compile lock")
        with config.patch(options):
            return cast(Callable[..., object], compile_fx(graph, inputs))

    return compile_with_options


@contextmanager
def tracing_settings(*, compiled: bool = False) -> Iterator[None]:
    """What dynamo must see whenever it traces the step, set around each call (it traces on a call whose guards
    fail, and reads these then, before any backend runs), as they were after:

    - inductor's `freezing`: the weights become constants of the compiled code, which inductor packs once for
      its GEMM templates (as inputs, the step runs much slower; docs/performance/compiled-decoding.md#freezing);
    - no duck sizing: dynamo would give sizes equal at the first call one symbol (rows = heads, capacity =
      head size), and then specialise them to the model's constants (a graph for one shape of the cache);
    - with `compiled` (the call's kind has its graph), dynamo's `error_on_recompile`: a call that finds no graph
      fitting raises RecompileError instead of compiling one (compiled.CompiledDecoder._call_retrying says why).

    torch's config settings are the setting thread's own (context variables): other threads, and this one
    after the call, keep theirs. Cheap beside a step."""
    from torch._dynamo import config as dynamo
    from torch._inductor import config as inductor
    from torch.fx.experimental import _config as shapes

    before = inductor.freezing, shapes.use_duck_shape, dynamo.error_on_recompile
    inductor.freezing, shapes.use_duck_shape, dynamo.error_on_recompile = True, False, compiled
    try:
        yield
    finally:
        inductor.freezing, shapes.use_duck_shape, dynamo.error_on_recompile = before


RECOMPILE_LIMIT = 16
"""Graphs one CompiledDecoder may compile for each of its three compiled functions: a search makes up to four kinds
of step (one row; several rows of one sentence, beams; several sentences, one row each; several sentences with beams)
and two each of encoder call and cross-attention projection (one sentence; several), each compiled once
(`compiled.CompiledDecoder._first_of_kind`); the rest is room for a specialisation not foreseen."""


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message that is not blank (torch's errors are pages), else its type's name."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


class CompileError(RuntimeError):
    """The step could not be compiled (no working C++ compiler, say): one line naming inductor's reason."""


@contextmanager
def one_line_compile_errors() -> Iterator[None]:
    """Around a call that may compile: inductor's failure (pages of traceback) becomes a CompileError of one line, as
    does the attention kernel's (its build, at the step's first compile)."""
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        yield
    except BackendCompilerFailed as error:
        raise CompileError(f"the decoding step could not be compiled ({first_line(error)})") from None
    except KernelBuildError as error:
        raise CompileError(str(error)) from None


def quiet_compile_warnings() -> None:
    """Before a compile: inductor's own use of torch's deprecated TypedStorage (its GEMM templates' timing, torch 2.13)
    warns, and the CLIs would show it as a `warning:` line nobody can act on. Put first among the filters each time,
    ahead of any the program set since (the CLIs show every UserWarning, cli.one_line_warnings); only that warning,
    only from inductor's code."""
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning,
                            module=r"torch\._inductor\.")


def compile_frozen(function: Callable[..., T], *, backend: Callable[..., object]) -> Callable[..., T]:
    """`function` compiled as compiled.CompiledDecoder compiles its three: sizes symbolic (`dynamic`), one graph or an error
    (`fullgraph`), its graphs apart from other compiled functions' (`isolate_recompiles`), at most RECOMPILE_LIMIT.

    Its calls check no guards on the model's modules: the model may not change once compiled (compiled.CompiledDecoder), its
    weights and module attributes are constants of the code, and a change to them is not seen (the code compiled
    before runs on). Dynamo guards every submodule's type, hooks, flags and parameters (~1,000 guards for a small
    model), checked at each call, a step's share of greedy search that counts at few rows
    (docs/performance/compiled-decoding.md#guards). The guards on the inputs (dtypes, devices, sizes) and on the
    global state (grad mode, autocast), which tell the kinds of call apart and keep a call off a graph that does not
    fit it, stay."""
    return cast(Callable[..., T], torch.compile(  # type: ignore[call-overload]  # (torch's overloads lack the last two)
        function, dynamic=True, backend=backend, fullgraph=True, isolate_recompiles=True,
        recompile_limit=RECOMPILE_LIMIT, options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}))
