"""Tests for seq2seq.precision: what `auto` resolves to on every kind of machine, and how it decides."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from machines import MACHINES, pretend_machine

from seq2seq.precision import CPU as CPUInfo
from seq2seq.precision import (
    DECODING_KERNEL_CACHE_CAPACITY,
    FEW_ROWS,
    FEW_ROWS_COPIES,
    KERNEL_CACHE_CAPACITY,
    _fastest_attention,
    _fastest_decoding_linears,
    _fastest_few_rows,
    _fastest_linear,
    _fastest_one_query_attention,
    _few_rows_layers,
    bf16_attention,
    bf16_matmuls,
    bf16_matmuls_pay,
    few_rows_on_torch,
    keep_first_verdict,
    one_query_sdpa,
    onednn_linears,
    resolve_precision,
    this_cpu,
    tune_process_memory,
    verdict_cache,
)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_verdict_cache(monkeypatch, tmp_path):
    """Each test starts on a machine that has timed nothing yet."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def pretend_quantized_engines(monkeypatch, engines: list[str]) -> None:
    """torch's int8 engines as a build that has `engines` reports them: x86 builds have fbgemm, ARM ones
    (qnnpack only) do not. `supported_engines` is a property of torch.backends.quantized's class."""
    monkeypatch.setattr(type(torch.backends.quantized), "supported_engines", engines)


@pytest.mark.parametrize("pays,expected", [(True, "bf16"), (False, "fp32")])
def test_auto_picks_bf16_only_where_it_pays(monkeypatch, pays, expected):
    monkeypatch.setattr("seq2seq.precision.bf16_matmuls_pay", lambda device: pays)
    pretend_quantized_engines(monkeypatch, ["qnnpack", "onednn", "x86", "fbgemm"])  # an x86 build's, on any CPU
    assert resolve_precision("auto", CPU) == expected
    for fixed in ("fp32", "bf16", "int8"):
        assert resolve_precision(fixed, CPU) == fixed  # an explicit choice is kept


def no_timing(*args, **kwargs):
    raise AssertionError("timed, where the CPU's flags decide")


@pytest.mark.parametrize("machine,bf16,named", [("avx2", False, "no bf16 matmul units"),
                                                ("avx512_bf16", True, "avx512_bf16"),
                                                ("amx", True, "amx_bf16, avx512_bf16")])
@pytest.mark.parametrize("training", [False, True])
def test_x86_flags_decide_without_timing(monkeypatch, machine: str, bf16: bool, named: str, training: bool):
    """What does not move with the machine's load decides: the same command picks the same precision."""
    pretend_machine(monkeypatch, machine)
    monkeypatch.setattr("seq2seq.precision._fastest_linear", no_timing)
    verdict = bf16_matmuls(CPU, training=training)
    assert verdict.pays is bf16 and named in verdict.why
    assert resolve_precision("auto", CPU) == ("bf16" if bf16 else "fp32")
    assert not verdict_cache().exists()  # nothing timed, nothing kept


def fake_timer(monkeypatch, name: str, speed_ups: list[float]) -> list[torch.dtype]:
    """`name` (a _fastest_* of precision.py) timed as bf16 being speed_ups[i] times faster at its i-th use."""
    calls: list[torch.dtype] = []

    def seconds(dtype, *args, **kwargs):
        calls.append(dtype)
        return 1.0 / speed_ups[(len(calls) - 1) // 2] if dtype == torch.bfloat16 else 1.0

    monkeypatch.setattr(f"seq2seq.precision.{name}", seconds)
    return calls


def test_a_cpu_no_flag_decides_is_timed_once_and_the_verdict_kept(monkeypatch):
    """An ARM CPU: timed, and the verdict cached per machine, so a second timing under load (here: the
    opposite answer) changes nothing. Decoding and training shapes are separate verdicts."""
    pretend_machine(monkeypatch, "arm")
    calls = fake_timer(monkeypatch, "_fastest_linear", [2.0, 0.5, 0.5])
    first = bf16_matmuls(CPU)
    assert first.pays and "2.0x" in first.why and str(verdict_cache()) in first.why and len(calls) == 2
    assert bf16_matmuls(CPU) == first and len(calls) == 2  # kept: not timed again
    assert resolve_precision("auto", CPU) == "bf16"
    assert bf16_matmuls(CPU, training=True).pays is False and len(calls) == 4  # its own verdict: 0.5x
    assert json.loads((verdict_cache() / "matmul-decoding.json").read_text()) == {"bf16": True, "speed-up": 2.0}
    arm_cache = verdict_cache()
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # a new torch may have new kernels: timed afresh
    assert verdict_cache() != arm_cache and bf16_matmuls(CPU).pays is False and len(calls) == 6
    monkeypatch.setattr("seq2seq.precision.this_cpu",  # another ARM model with the same flags: its own folder
                        lambda: CPUInfo(arch="aarch64", model="Neoverse-N1", flags=MACHINES["arm"].flags))
    assert verdict_cache() != arm_cache


def test_an_x86_cpu_whose_flags_cannot_be_read_is_timed(monkeypatch):
    """Windows, or macOS on Intel: no /proc/cpuinfo, so no flags to decide by; timed as an ARM CPU is."""
    monkeypatch.setattr("seq2seq.precision.this_cpu",
                        lambda: CPUInfo(arch="AMD64", model="Intel64 Family 6 Model 143", flags=frozenset()))
    calls = fake_timer(monkeypatch, "_fastest_linear", [3.0])
    assert bf16_matmuls(CPU).pays and len(calls) == 2


@pytest.mark.parametrize("speed_up,bf16", [(1.2, False), (1.3, True), (0.1, False)])
def test_a_timed_verdict_wants_a_clear_margin(monkeypatch, speed_up: float, bf16: bool):
    pretend_machine(monkeypatch, "arm")
    fake_timer(monkeypatch, "_fastest_linear", [speed_up])
    assert bf16_matmuls(CPU).pays is bf16  # near-ties stay fp32, whichever way the noise falls


def test_a_cache_that_cannot_be_read_or_written_costs_only_a_new_timing(monkeypatch, tmp_path):
    pretend_machine(monkeypatch, "arm")
    calls = fake_timer(monkeypatch, "_fastest_linear", [2.0] * 4)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "damaged"))
    verdict_cache().mkdir(parents=True)
    (verdict_cache() / "matmul-decoding.json").write_text("{not json")
    assert bf16_matmuls(CPU).pays and len(calls) == 2
    assert json.loads((verdict_cache() / "matmul-decoding.json").read_text())["bf16"] is True  # rewritten whole
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a_file"))  # no folder can be made there
    assert bf16_matmuls(CPU).pays and bf16_matmuls(CPU).pays and len(calls) == 6  # timed each time, no error


@pytest.mark.parametrize("dropout", [False, True])
def test_attention_is_timed_on_a_cpu_and_bf16_on_a_gpu(monkeypatch, dropout: bool):
    """No flag says whether torch's CPU attention kernels are faster in bf16 (on an AMX Xeon they were
    slower than fp32's): timed once per machine and kind of kernel (with dropout: another one)."""
    pretend_machine(monkeypatch, "amx")
    calls = fake_timer(monkeypatch, "_fastest_attention", [0.3, 3.0])
    verdict = bf16_attention(CPU, dropout=dropout)
    assert verdict.pays is False and "0.3x" in verdict.why and len(calls) == 2
    assert bf16_attention(CPU, dropout=dropout) == verdict and len(calls) == 2
    assert bf16_attention(CPU, dropout=not dropout).pays is True and len(calls) == 4  # the other kernel
    assert bf16_attention(torch.device("cuda", 0), dropout=dropout).pays and len(calls) == 4  # flash attention


@pytest.mark.parametrize("no_link", [PermissionError(errno.EPERM, "Operation not permitted"),
                                     OSError(errno.EOPNOTSUPP, "Operation not supported")])
def test_a_verdict_is_kept_on_a_filesystem_without_hard_links(monkeypatch, no_link: OSError):
    """FAT, some network and FUSE filesystems refuse hard links (EPERM, EOPNOTSUPP): the verdict is then
    published by a rename, whole, and no temporary file is left; a verdict already there stays the machine's."""
    pretend_machine(monkeypatch, "arm")
    links: list[str] = []

    def refused(source, target, *args, **kwargs):
        links.append(str(target))
        raise no_link

    monkeypatch.setattr(os, "link", refused)
    path = verdict_cache() / "matmul-decoding.json"
    assert keep_first_verdict(path, {"bf16": True, "speed-up": 2.0}) == {"bf16": True, "speed-up": 2.0}
    assert links == [str(path)]  # the link was tried, and refused
    assert json.loads(path.read_text()) == {"bf16": True, "speed-up": 2.0}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left beside it
    assert keep_first_verdict(path, {"bf16": False, "speed-up": 0.5}) == {"bf16": True, "speed-up": 2.0}
    assert json.loads(path.read_text()) == {"bf16": True, "speed-up": 2.0}  # the first one stays
    path.write_text("{damaged")
    assert keep_first_verdict(path, {"bf16": False, "speed-up": 0.5}) == {"bf16": False, "speed-up": 0.5}
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    fake_timer(monkeypatch, "_fastest_linear", [3.0])  # and through the timing that writes it
    path.unlink()
    assert bf16_matmuls(CPU).pays and json.loads(path.read_text()) == {"bf16": True, "speed-up": 3.0}


def test_the_first_verdict_written_is_the_machine_s(monkeypatch):
    """Two processes timing at once: the one that writes second takes the first one's verdict, so the
    two train and translate alike; the timing leaves the global random state as it found it."""
    pretend_machine(monkeypatch, "arm")
    fake_timer(monkeypatch, "_fastest_linear", [0.5])
    path = verdict_cache() / "matmul-decoding.json"
    assert keep_first_verdict(path, {"bf16": True, "speed-up": 2.0}) == {"bf16": True, "speed-up": 2.0}
    assert keep_first_verdict(path, {"bf16": False, "speed-up": 0.5}) == {"bf16": True, "speed-up": 2.0}
    path.unlink()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert bf16_matmuls(CPU).pays is False and torch.equal(torch.rand(3), expected)


def test_the_timings_run_on_this_cpu():
    """The real measurements, whatever this CPU is (bf16 is emulated, slowly, on AVX2: small shapes)."""
    for dtype in (torch.float32, torch.bfloat16):
        assert 0 < _fastest_linear(dtype, CPU, training=False) < 5
        assert 0 < _fastest_attention(dtype, dropout=True) < 30


def test_the_training_timing_runs_forward_and_backward_on_this_cpu(monkeypatch):
    """The training-shaped linear timing (what `precision: auto` asks on a CPU no flag decides), for real:
    a backward each run (the warm-up and 3 timed), outside inference mode, and far more work than a
    decoding step's (~100x the multiply-adds: no scheduling noise turns that around)."""
    backward = torch.Tensor.backward
    calls: list[torch.dtype] = []

    def counted(self, *args, **kwargs):
        calls.append(self.dtype)
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", counted)
    for dtype in (torch.float32, torch.bfloat16):
        training = _fastest_linear(dtype, CPU, training=True)
        assert calls == [dtype] * 4
        calls.clear()
        assert 0 < training < 5
        assert training > _fastest_linear(dtype, CPU, training=False) and calls == []  # decoding: no backward


def test_this_cpu_is_read_from_the_machine():
    cpu = this_cpu.__wrapped__()  # the real one, not the pretended AVX2 of the test session
    assert cpu.arch and cpu.model
    if Path("/proc/cpuinfo").is_file() and cpu.is_x86:
        assert "sse2" in cpu.flags  # every x86-64 CPU has it


@pytest.mark.parametrize("capability,pays", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_auto_on_a_gpu_wants_native_bf16(monkeypatch, capability, pays):
    """V100 and T4 report bf16 support by emulating it, slowly: only Ampere and later count."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    verdict = bf16_matmuls(torch.device("cuda", 0), training=True)
    assert verdict.pays is pays and f"compute capability {capability[0]}.{capability[1]}" in verdict.why
    assert bf16_matmuls_pay(torch.device("meta")) is False  # no measurement of ours for other devices


def test_bad_precisions_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="one of auto, fp32, bf16, int8, got 'fp16'"):
        resolve_precision("fp16", CPU)
    with pytest.raises(ValueError, match="int8 runs on CPUs only"):
        resolve_precision("int8", torch.device("cuda"))


def test_int8_without_fbgemm_is_refused_with_what_to_use(monkeypatch):
    """An ARM build of torch has no fbgemm (qnnpack only), on which our int8 layers cannot run: int8 is
    refused before any model is built, naming what is missing and what to use (the CLIs and the server
    print a ValueError as one `error:` line); every other precision is unchanged."""
    pretend_quantized_engines(monkeypatch, ["qnnpack", "none"])
    assert "fbgemm" not in torch.backends.quantized.supported_engines
    with pytest.raises(ValueError, match=r"^precision int8 needs torch's fbgemm int8 kernels \(x86 CPUs\), which "
                                         r"this torch lacks; use fp32$"):
        resolve_precision("int8", CPU)
    assert resolve_precision("fp32", CPU) == "fp32" and resolve_precision("bf16", CPU) == "bf16"
    assert resolve_precision("auto", CPU) == "fp32"  # the pretended AVX2 machine: no bf16 units
    pretend_quantized_engines(monkeypatch, ["qnnpack", "onednn", "x86", "fbgemm"])
    assert resolve_precision("int8", CPU) == "int8"


def test_process_memory_keeps_a_bounded_kernel_cache_and_a_capacity_given(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    tune_process_memory()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(KERNEL_CACHE_CAPACITY) == "64"
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    tune_process_memory(kernels=DECODING_KERNEL_CACHE_CAPACITY)  # what the translating faces pass
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(DECODING_KERNEL_CACHE_CAPACITY) == "512"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    tune_process_memory()
    tune_process_memory(kernels=DECODING_KERNEL_CACHE_CAPACITY)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"  # the user's


def test_the_faces_that_translate_keep_the_decoding_kernel_cache():
    """The translate and score CLIs, the server and the interactive translator set 512 before their first
    kernel (run as scripts, up to their --help); training's face keeps 64."""
    repo = Path(__file__).resolve().parents[1]
    faces = {"seq2seq.translate": "512", "seq2seq.score": "512", "serve/server.py": "512",
             "serve/translate.py": "512", "seq2seq.fit": "64"}
    script = (
        "import io, os, runpy, sys, contextlib\n"
        "for face in sys.argv[1:]:\n"
        "    os.environ.pop('ONEDNN_PRIMITIVE_CACHE_CAPACITY', None)\n"
        "    sys.argv = [face, '--help']\n"
        "    sys.path.insert(0, os.path.dirname(os.path.abspath(face)))  # as a script's own folder is\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        (runpy.run_path if face.endswith('.py') else runpy.run_module)(face, run_name='__main__')\n"
        "    print(face, os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    out = subprocess.run([sys.executable, "-c", script, *faces], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:-1] == [f"{face} {capacity}" for face, capacity in faces.items()], out.stderr[-3000:]


@pytest.mark.parametrize("speed_up,packed", [(1.2, False), (2.0, True)])
def test_onednn_linears_are_timed_once_per_precision_and_want_a_clear_margin(monkeypatch, speed_up, packed):
    """oneDNN's packed linear layers against torch's own: timed (no flag says how MKL treats this CPU),
    once per machine and precision, chosen only a clear margin faster; never for int8 or off the CPU."""
    pretend_machine(monkeypatch, "avx512_bf16")
    monkeypatch.setattr("seq2seq.precision.onednn_packs", lambda dtype: True)  # (its oneDNN, as its flags say)
    calls: list[tuple[str, bool]] = []

    def seconds(precision: str, onednn: bool) -> float:
        calls.append((precision, onednn))
        return 1.0 / speed_up if onednn else 1.0

    monkeypatch.setattr("seq2seq.precision._fastest_decoding_linears", seconds)
    verdict = onednn_linears(CPU, "fp32")
    assert verdict.pays is packed and f"{speed_up}x the speed of torch's own" in verdict.why
    assert onednn_linears(CPU, "fp32") == verdict and len(calls) == 2  # kept
    assert onednn_linears(CPU, "bf16").pays is packed and len(calls) == 4  # its own timing
    assert not onednn_linears(CPU, "int8").pays and not onednn_linears(torch.device("cuda", 0), "bf16").pays
    assert len(calls) == 4


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_few_rows_on_torch_are_the_rows_up_to_the_first_count_where_oneDNN_keeps_up(monkeypatch):
    """Each of FEW_ROWS is timed in turn, once per machine and shape, until torch's own linear is not MARGIN times
    faster; the answer is the last count that was. fp32 on a CPU only."""
    calls: list[tuple[bool, int, int, int]] = []
    speed_ups = {(256, 256): {1: 3.0, 2: 2.5, 4: 2.0, 8: 1.3, 15: 1.26}, (256, 1024): {1: 1.6, 2: 1.4, 4: 1.2, 8: 2.0},
                 (256, 8000): {1: 1.1, 2: 5.0}}

    def seconds(torch_own: bool, *, rows: int, layers: tuple[int, int]) -> float:
        calls.append((torch_own, rows, *layers))
        return 1.0 / speed_ups[layers][rows] if torch_own else 1.0

    made: list[tuple[int, int]] = []
    monkeypatch.setattr("seq2seq.precision._few_rows_layers",
                        lambda *, in_features, out_features: made.append((in_features, out_features)) or made[-1])
    monkeypatch.setattr("seq2seq.precision._fastest_few_rows", seconds)
    assert few_rows_on_torch(CPU, "fp32", in_features=256, out_features=256) == 15
    assert few_rows_on_torch(CPU, "fp32", in_features=256, out_features=1024) == 2  # 4 is under the margin
    assert few_rows_on_torch(CPU, "fp32", in_features=256, out_features=8000) == 0
    assert [rows for _, rows, *_ in calls[::2]] == [*FEW_ROWS, 1, 2, 4, 1]  # stopped at the first miss
    assert made == [(256, 256), (256, 1024), (256, 8000)]  # each shape's layers made once
    timed = len(calls)
    assert few_rows_on_torch(CPU, "fp32", in_features=256, out_features=1024) == 2 and len(calls) == timed  # kept
    for precision, device in (("bf16", CPU), ("int8", CPU), ("fp32", torch.device("cuda", 0))):
        assert few_rows_on_torch(device, precision, in_features=256, out_features=256) == 0
    assert len(calls) == timed


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_the_onednn_timing_runs_both_kernels():
    assert _fastest_decoding_linears("bf16", True) > 0 and _fastest_decoding_linears("fp32", False) > 0
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        layers = _few_rows_layers(in_features=64, out_features=48)
        assert len(layers[0]) == len(layers[1]) == FEW_ROWS_COPIES  # under 16 MB of float32 weights: the cap
        assert len(_few_rows_layers(in_features=1024, out_features=512)[0]) == 8  # 16 MB of them
        for torch_own in (True, False):
            assert _fastest_few_rows(torch_own, rows=2, layers=layers) > 0
            assert torch.get_num_threads() == 2  # the one thread it timed on given back
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("speed_up,sdpa", [(1.8, True), (1.1, False), (0.5, False)])
def test_one_query_attention_is_timed_once_per_machine(monkeypatch, speed_up: float, sdpa: bool):
    """SDPA replaces the matmuls at one query a row only where it times MARGIN faster; bf16 on a CPU only."""
    calls: list[bool] = []

    def seconds(by_sdpa: bool) -> float:
        calls.append(by_sdpa)
        return 1.0 / speed_up if by_sdpa else 1.0

    monkeypatch.setattr("seq2seq.precision._fastest_one_query_attention", seconds)
    verdict = one_query_sdpa(CPU, "bf16")
    assert verdict.pays is sdpa and f"{speed_up}x the speed of two batched matmuls" in verdict.why
    assert one_query_sdpa(CPU, "bf16") == verdict and len(calls) == 2  # kept
    for precision, device in (("fp32", CPU), ("int8", CPU), ("bf16", torch.device("cuda", 0))):
        assert not one_query_sdpa(device, precision).pays
    assert len(calls) == 2


def test_the_one_query_attention_timing_runs_both_kernels():
    assert _fastest_one_query_attention(True) > 0 and _fastest_one_query_attention(False) > 0
