"""The compiled decoder built ahead of time (seq2seq/model/packaged.py): every kind of call exported and compiled by
AOTInductor into a package a later process loads. The package's checks and the decoder's dispatch by kind run in the
default run; building one takes a minute even for a tiny model, so the tests that build run in make e2e, one
package shared by them."""

import json
import shutil
import threading
import zipfile

import pytest
import torch
from test_compiled import BOS, EOS, PAD, agree, sources, tiny

from seq2seq.decoding.config import SearchConfig
from seq2seq.decoding.search import decode
from seq2seq.model import packaged
from seq2seq.model.attention import CACHE_GROWTH
from seq2seq.model.compiled import ALL_KINDS, KINDS, CompiledDecoder, CompileError, int8_compiled, kind_name
from seq2seq.model.packaged import (
    MANIFEST,
    PackageError,
    build_package,
    check_packageable,
    is_package,
    load_package,
    package_threads,
)

pytestmark = pytest.mark.xdist_group("compiled")  # (with test_compiled.py's: the attention kernel built once)

SEARCHES = [SearchConfig(beam_size=1), SearchConfig(beam_size=4, nbest=2), SearchConfig(beam_size=1, scores=False)]


def uncompiled_package(decoder: CompiledDecoder) -> dict:
    """Each kind's function as it is written, standing in for a package's compiled ones."""
    return {kind: decoder.uncompiled(str(kind[0])) for kind in ALL_KINDS}


def fake_package(folder, *, torch_version: str = torch.__version__) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    files = {kind_name(kind): kind_name(kind) for kind in ALL_KINDS}
    for name in files.values():
        (folder / name).mkdir()
        (folder / name / "wrapper.so").write_bytes(b"not a package")
    (folder / MANIFEST).write_text(json.dumps({"format": packaged.FORMAT, "torch": torch_version, "threads": 1,
                                               "files": files, "attention_kernel": None}))


@torch.inference_mode()
def test_a_decoder_with_a_package_calls_each_kinds_function_and_decodes_as_the_model_does():
    """CompiledDecoder(packaged=...) runs the package's function for each kind of call (here the functions
    uncompiled), no torch.compile: one sentence and several, greedy and beams, a one-token source."""
    model = tiny(seed=3)
    decoder = CompiledDecoder(model, gemm_templates=False)
    calls: list = []

    def counted(kind, function):
        def call(*inputs):
            calls.append(kind)
            return function(*inputs)
        return call

    functions = {kind: counted(kind, function) for kind, function in uncompiled_package(decoder).items()}
    with_package = CompiledDecoder(model, packaged=functions)
    for src in (sources(seed=4), sources(seed=5)[:1], sources(seed=6)[3:]):
        for search in SEARCHES:
            got = decode(with_package, src, search, bos=BOS, eos=EOS, pad=PAD)
            agree(model, src, got, decode(model, src, search, bos=BOS, eos=EOS, pad=PAD), beams=search.beam_size > 1)
    assert set(calls) == set(ALL_KINDS)  # (every kind met, none compiled)
    assert with_package.compiling_seconds == 0 and with_package._compiled_encoder_and_step is None


def test_a_package_lacking_a_kind_is_refused():
    decoder = CompiledDecoder(tiny(), gemm_templates=False)
    functions = uncompiled_package(decoder)
    del functions[("step", True, True, False)]
    with pytest.raises(ValueError, match="lacks step-one-row"):
        CompiledDecoder(decoder.model, packaged=functions)


def test_the_recorded_calls_are_one_of_each_kind_at_the_kinds_sizes():
    """What a package exports: compile_kinds' calls, one of each kind, the step's at KINDS' sizes, uncompiled."""
    decoder = CompiledDecoder(tiny(), gemm_templates=False)
    calls = decoder.recorded_calls()
    assert set(calls) == set(ALL_KINDS)
    steps = {kind: inputs[0].shape for kind, (name, inputs) in calls.items() if name == "step"}  # tokens (N, K)
    assert sorted(tuple(shape) for shape in steps.values()) == sorted(KINDS)
    assert decoder._kinds_compiled == set() and decoder._compiled_encoder_and_step is None


def test_int8_and_gpu_decoders_are_not_packaged():
    with pytest.raises(ValueError, match="fp32 or bf16 decoders; int8"):
        check_packageable(CompiledDecoder(int8_compiled(tiny()), gemm_templates=False))


def test_a_folder_is_a_package_only_whole_and_of_this_torch(tmp_path):
    fake_package(tmp_path / "whole")
    assert is_package(tmp_path / "whole") and package_threads(tmp_path / "whole") == 1
    fake_package(tmp_path / "other", torch_version="2.0.0")
    assert not is_package(tmp_path / "other")
    fake_package(tmp_path / "half")
    shutil.rmtree(tmp_path / "half" / "step-one-row")
    assert not is_package(tmp_path / "half") and not is_package(tmp_path / "none")


def test_a_damaged_package_is_one_line_naming_its_folder(tmp_path):
    fake_package(tmp_path / "damaged")
    with pytest.raises(PackageError) as caught:
        load_package(tmp_path / "damaged")
    assert str(caught.value).startswith(f"{tmp_path / 'damaged'}: the compiled package could not be loaded (")
    assert "\n" not in str(caught.value)
    with pytest.raises(PackageError, match="no compiled package of this torch version"):
        load_package(tmp_path / "none")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model's package (fp32, without the GEMM templates: a quarter of the time), built on one thread."""
    with torch.inference_mode(False):
        model = tiny(seed=7)
    folder = tmp_path_factory.mktemp("package") / "tiny"
    lines: list[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        build_package(CompiledDecoder(model, gemm_templates=False), folder, progress=lines.append)
    finally:
        torch.set_num_threads(threads)
    return model, folder, lines


@pytest.mark.e2e
@torch.inference_mode()
def test_a_built_package_decodes_as_the_model_does_at_every_size(built):
    """The package's compiled functions (AOTInductor, shapes symbolic, checked at each call: AOTI_RUNTIME_CHECK_INPUTS,
    tests/conftest.py) at sizes other than those it was exported at: one sentence and several, greedy and beams,
    a one-token source, and targets past CACHE_GROWTH (the cache grown between steps)."""
    model, folder, lines = built
    assert len(lines) == len(ALL_KINDS) and lines[0].startswith("compiling the decoder ahead of time: ")
    assert is_package(folder) and package_threads(folder) == 1
    decoder = CompiledDecoder(model, packaged=load_package(folder))
    long = SearchConfig(beam_size=3, max_len_a=0, max_len_b=2 * CACHE_GROWTH + 3, min_len=2 * CACHE_GROWTH)
    for src in (sources(seed=11), sources(seed=12)[:1], sources(seed=13)[3:], sources(seed=14).repeat(20, 1)):
        for search in (*SEARCHES, long):
            got = decode(decoder, src, search, bos=BOS, eos=EOS, pad=PAD)
            agree(model, src, got, decode(model, src, search, bos=BOS, eos=EOS, pad=PAD), beams=search.beam_size > 1)


@pytest.mark.e2e
def test_decoder_threads_run_a_package_at_once(built):
    """Two threads decoding with one package loaded with two runners: each thread's outputs are the model's."""
    model, folder, _ = built
    decoder = CompiledDecoder(model, packaged=load_package(folder, runners=2))
    jobs = [[(sources(seed=40 + 10 * i + r)[: 1 + (r + i) % 4], SEARCHES[(r + i) % 3]) for r in range(12)]
            for i in range(2)]
    got: dict[int, list] = {}

    def decoder_thread(i: int) -> None:
        torch.set_num_threads(1)
        with torch.inference_mode():
            got[i] = [decode(decoder, src, search, bos=BOS, eos=EOS, pad=PAD) for src, search in jobs[i]]

    threads = [threading.Thread(target=decoder_thread, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with torch.inference_mode():
        for i in range(2):
            for (src, search), mine in zip(jobs[i], got[i], strict=True):
                agree(model, src, mine, decode(model, src, search, bos=BOS, eos=EOS, pad=PAD),
                      beams=search.beam_size > 1)


def without_compiling(monkeypatch: pytest.MonkeyPatch, *, failing: str | None = None) -> list[str]:
    """torch.export and AOTInductor stood in for (a file written where the package's would be; a CompileError at
    the kind named `failing`): the kinds compiled, in order."""
    compiled: list[str] = []

    def compile_and_package(exported, *, package_path: str, inductor_configs: dict) -> str:
        name = package_path.rsplit("/", 1)[-1].removesuffix(".pt2")
        if name == failing:
            raise CompileError("the decoding step could not be compiled (stood in for)")
        compiled.append(name)
        with zipfile.ZipFile(package_path, "w") as archive:
            archive.writestr(f"{name}/data/aotinductor/model/wrapper.so", b"compiled")
        return package_path

    monkeypatch.setattr(torch.export, "export", lambda module, inputs, **options: None)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_and_package)
    return compiled


def test_a_package_is_made_whole_or_not_at_all_and_one_there_already_is_kept(tmp_path, monkeypatch):
    """Built in a temporary folder beside its place and renamed into it once whole (its manifest last): a failure
    leaves nothing, and where another process has put a package first, theirs is kept."""
    decoder = CompiledDecoder(tiny(), gemm_templates=False)
    without_compiling(monkeypatch, failing="step-sentences")
    with pytest.raises(CompileError):
        build_package(decoder, tmp_path / "package")
    assert list(tmp_path.iterdir()) == []
    compiled = without_compiling(monkeypatch)
    build_package(decoder, tmp_path / "package")
    assert compiled == [kind_name(kind) for kind in ALL_KINDS] and is_package(tmp_path / "package")
    before = {file.name: file.stat().st_mtime_ns for file in (tmp_path / "package").iterdir()}
    build_package(decoder, tmp_path / "package")  # (as another process would, not knowing)
    assert {file.name: file.stat().st_mtime_ns for file in (tmp_path / "package").iterdir()} == before
    assert [path.name for path in tmp_path.iterdir()] == ["package"]  # (no temporary folder left)


def test_loading_a_package_asks_for_the_amx_tiles_first(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Inductor's AMX micro-kernels do not ask Linux for the AMX tiles, and without them a package's first AMX
    instruction kills the process (SIGILL: one line translated in a fresh process did): loading asks first."""
    order: list[str] = []

    class Loader:
        def __init__(self, path: str, runners: int):
            order.append("load")

        def call_spec(self) -> list[str]:
            return ["", torch.utils._pytree.treespec_dumps(torch.utils._pytree.tree_flatten(0)[1])]

    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: order.append("amx") or True)
    monkeypatch.setattr(packaged, "package_runner", lambda: type("Module", (), {"Runner": Loader}))
    packaged._Runner(tmp_path / "step-one-row", runners=1)
    assert order == ["amx", "load"]
