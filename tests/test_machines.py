"""Every path a machine can send the main job down, run on whatever CPU runs the tests.

`precision: auto` picks 32-true or bf16-mixed for training, fp32 or bf16 for translation, and under
bf16 the attention's precision, by what the machine is (tests/machines.py). On the first AMX Xeon it
met, auto chose bf16-mixed and the first update crashed: no test had run that path, because every
development machine had been AVX2-only. Here each answer is forced by pretending to be a machine that
gets it (`python -m as_machine MACHINE ...`), and the real commands run end to end: training with
every callback the shipped configs use, a resume, then translation through the Python API, the CLI
and the server in each precision; and each shipped config for a few updates under each precision it
could resolve to. bf16 matmuls are emulated, far slower, on AVX2-only CPUs: the models are tiny.
"""

import gzip
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from conftest import DEMO_DATA, _multi30k_lines
from machines import MACHINES, pretend_machine

from seq2seq.inference.translator import Translator
from seq2seq.precision import AUTO_TRAINING_PRECISION_ENV, verdict_cache

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
SHIPPED = ("demo.yaml", "multi30k.yaml", "wmt.yaml")
# machine: (training's auto, translation's auto, attention in float32 under bf16 autocast). The ARM
# machine's matmul verdict is a timed one, settled below as a first timing would leave it.
ANSWERS = {"avx2": ("32-true", "fp32", None), "amx": ("bf16-mixed", "bf16", True),
           "avx512_bf16": ("bf16-mixed", "bf16", False), "arm": ("bf16-mixed", "bf16", True)}
TINY_MODEL = ("--model.transformer.d_model=32", "--model.transformer.num_heads=2", "--model.transformer.d_ff=64",
              "--model.transformer.num_encoder_layers=1", "--model.transformer.num_decoder_layers=1")


def machine_env() -> dict[str, str]:
    """The environment of a process started as a machine: tests/ importable, and no training precision
    inherited from an earlier `auto` in this process (a launcher passes its choice on that way)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    env.pop(AUTO_TRAINING_PRECISION_ENV, None)
    return env


def run_as(machine: str, target: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m target args` (or `python target args`) in a new process pretending to be `machine`."""
    command = [sys.executable, "-m", "as_machine", machine, target, *args]
    return subprocess.run(command, cwd=REPO, env=machine_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def machine_verdicts(monkeypatch):
    """`settle(machine)`: the timed verdicts that machine's cache holds, set as ANSWERS says, so that every
    path runs whatever this CPU would time (attention on an AMX Xeon: float32, as measured on one)."""

    def settle(machine: str) -> None:
        training, translation, fp32 = ANSWERS[machine]
        with monkeypatch.context() as patch:
            pretend_machine(patch, machine)
            folder = verdict_cache()
        verdicts = {}
        if fp32 is not None:
            verdicts["attention-flash-training"] = verdicts["attention-dropout-training"] = {
                "bf16": not fp32, "speed-up": 0.5 if fp32 else 2.0}
        if machine == "arm":
            verdicts["matmul-training"] = {"bf16": training == "bf16-mixed", "speed-up": 3.0}
            verdicts["matmul-decoding"] = {"bf16": translation == "bf16", "speed-up": 3.0}
        folder.mkdir(parents=True, exist_ok=True)
        for key, verdict in verdicts.items():
            (folder / f"{key}.json").write_text(json.dumps(verdict))

    return settle


def write_lines(path: Path, lines: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def multi30k_subset(root: Path, *, train: int, valid: int) -> dict[str, list[str]]:
    files = {}
    for split, stem, count in (("train", "train", train), ("valid", "val", valid), ("test", "test_2016_flickr", valid)):
        files[split] = [write_lines(root / f"{split}.{lang}", _multi30k_lines(stem, lang, count)) for lang in ("de", "en")]
    return files


def shipped_callbacks() -> list[dict]:
    """multi30k.yaml's callbacks, which are every callback any shipped config uses (checked here)."""
    callbacks = yaml.safe_load((CONFIGS / "multi30k.yaml").read_text())["trainer"]["callbacks"]
    everywhere = {c["class_path"] for name in SHIPPED for c in yaml.safe_load((CONFIGS / name).read_text())["trainer"]["callbacks"]}
    assert everywhere == {c["class_path"] for c in callbacks}, "a shipped config has a callback this test lacks"
    return callbacks


def every_callback_config(root: Path) -> Path:
    """A one-layer model trained for two epochs on 600 Multi30k pairs, with every shipped callback and
    multi30k.yaml's trainer settings (precision auto, clipping, validation each epoch, linear schedule)."""
    files = multi30k_subset(root / "data", train=600, valid=20)
    callbacks = []
    for callback in shipped_callbacks():
        args = dict(callback.get("init_args") or {})
        if "dirpath" in args:
            args["dirpath"] = args["dirpath"].replace("checkpoints/multi30k", str(root / "checkpoints"))
        if callback["class_path"].endswith("TuneLengthPenalty"):
            args.update(beam_size=2, length_penalties=[0.6, 1.5])
        callbacks.append({**callback, "init_args": args})
    shipped = yaml.safe_load((CONFIGS / "multi30k.yaml").read_text())
    trainer = {**shipped["trainer"], "callbacks": callbacks, "accelerator": "cpu", "max_epochs": 2, "max_time": None,
               "default_root_dir": str(root), "enable_progress_bar": False, "enable_model_summary": False,
               "log_every_n_steps": 5}
    model = {**shipped["model"], "warmup_steps": 5, "val_search": {"beam_size": 1, "max_len_b": 5}}
    data = {**shipped["data"], "hf_name": None, "train_files": files["train"], "valid_files": files["valid"],
            "test_files": files["test"], "tokenizer_path": str(root / "spm.model"), "vocab_size": 600,
            "max_tokens": 512, "max_tokens_per_sentence": 64, "cache_dir": str(root / "hf_cache")}
    config = root / "every_callback.yaml"
    config.write_text(yaml.safe_dump({"trainer": trainer, "model": model, "data": data}), encoding="utf-8")
    return config


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def translate_over_http(machine: str, checkpoint: Path, sentences: list[str], *args: str) -> tuple[list[str], str]:
    """The server started as on `machine` (with `args`): its translations of `sentences` and its stderr."""
    port = free_port()
    command = [sys.executable, "-m", "as_machine", machine, str(REPO / "serve/server.py"), "--checkpoint",
               str(checkpoint), "--port", str(port), "--threads", "1", *args]
    process = subprocess.Popen(command, cwd=REPO, env=machine_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                if process.poll() is not None:
                    raise AssertionError(f"the server exited: {process.stderr.read()[-3000:]}") from None
                assert time.monotonic() < deadline, "the server did not start in 120 s"
                time.sleep(0.1)
        reply = httpx.post(f"http://127.0.0.1:{port}/translate", json={"q": sentences, "source": "de", "target": "en"},
                           timeout=120)
        assert reply.status_code == 200, reply.text
        process.terminate()
        assert process.wait(timeout=60) == 0
        return reply.json()["translatedText"], process.stderr.read()
    finally:
        process.kill()


@pytest.mark.e2e  # (make e2e; make test runs demo's and multi30k's few updates below as the AVX2 machine, test_fit.py's
# ranks as each machine, and tests/inference/test_translator.py, test_server.py the translation faces)
@pytest.mark.parametrize("machine", ["avx2", "amx"])
def test_the_main_job_runs_end_to_end_whatever_auto_picks(machine: str, tmp_path: Path, machine_verdicts,
                                                           monkeypatch):
    """The test that the AMX crash lacked: auto resolves to this machine's answer, every shipped callback
    and gradient clipping run under it, a resume continues, and the checkpoint translates through the
    Python API (fp32, bf16, int8, and auto), the CLI (auto, int8) and the server (auto, int8)."""
    training, translation, fp32_attention = ANSWERS[machine]
    machine_verdicts(machine)
    config = every_callback_config(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    result = run_as(machine, "seq2seq.fit", "--config", str(config), *TINY_MODEL,
                    "--trainer.callbacks+=ddp_probe.MachineProbe", f"--trainer.callbacks.out_dir={tmp_path / 'probe'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trainer.precision auto: {training} on {MACHINES[machine].model}" in result.stdout
    if fp32_attention is not None:  # the verdict, printed by the module that applied it
        assert f"attention under bf16-mixed: {'float32' if fp32_attention else 'bf16'} (" in result.stderr
    probe = json.loads((tmp_path / "probe" / "machine0.json").read_text())
    assert probe["precision"] == training and probe["fp32_attention"] == [bool(fp32_attention)]
    assert "stored in" in result.stdout  # TuneLengthPenalty chose a length penalty and stored it
    assert sorted(p.name for p in (checkpoints / "epochs").iterdir()) == ["epoch00.ckpt", "epoch01.ckpt"]
    first = torch.load(checkpoints / "last.ckpt", weights_only=True)
    assert "current_model_state" in first  # PowerEMA's trained weights beside the average

    resumed = run_as(machine, "seq2seq.fit", "--config", str(config), *TINY_MODEL, "--trainer.max_epochs=3",
                     "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    last = torch.load(checkpoints / "last.ckpt", weights_only=True)
    assert last["global_step"] > first["global_step"] and last["epoch"] == first["epoch"] + 1

    best = checkpoints / "best.ckpt"
    sources = _multi30k_lines("test_2016_flickr", "de", 12)
    pretend_machine(monkeypatch, machine)
    assert Translator.from_checkpoint(best).precision == translation  # auto, in this process
    has_int8 = "fbgemm" in torch.backends.quantized.supported_engines  # x86 builds of torch; not ARM ones
    for precision in ("fp32", "bf16", "int8"):
        if precision == "int8" and not has_int8:
            with pytest.raises(ValueError, match="precision int8 needs torch's fbgemm int8 kernels"):
                Translator.from_checkpoint(best, precision=precision)
            continue
        translations = Translator.from_checkpoint(best, precision=precision).translate(sources)
        assert len(translations) == len(sources) and any(translations), precision
    source_file = write_lines(tmp_path / "test.de", sources)
    for precision in ("auto", "int8") if has_int8 else ("auto",):
        output = tmp_path / f"test.{precision}.en"
        cli = run_as(machine, "seq2seq.translate", "--checkpoint", str(best), "--input", source_file,
                     "--output", str(output), "--precision", precision)
        assert cli.returncode == 0, cli.stderr[-3000:]
        ran = translation if precision == "auto" else precision
        assert f"translated {len(sources)} lines" in cli.stderr and f"({ran}, " in cli.stderr
        assert len(output.read_text(encoding="utf-8").split("\n")) == len(sources) + 1
    served, stderr = translate_over_http(machine, best, sources[:3])
    assert len(served) == 3 and f"({translation}, " in stderr
    if machine == "avx2" and has_int8:  # int8 is never auto's answer: given here, once
        served, stderr = translate_over_http(machine, best, sources[:3], "--precision", "int8")
        assert len(served) == 3 and "(int8, " in stderr


def shipped_config_run(name: str, root: Path) -> tuple[Path, list[str]]:
    """`name` rewritten to write under `root`, and the overrides that shrink it to a few updates of a
    one-layer model on small data, keeping its strategy, devices, callbacks, clipping and schedule."""
    config = root / name
    text = (CONFIGS / name).read_text(encoding="utf-8")
    run_folder = yaml.safe_load(text)["trainer"]["default_root_dir"]
    config.write_text(text.replace(run_folder, str(root / "run")), encoding="utf-8")
    common = [*TINY_MODEL, f"--data.tokenizer_path={root / 'spm.model'}", "--data.vocab_size=600",
              f"--data.cache_dir={root / 'hf_cache'}", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
              "--trainer.enable_model_summary=false"]
    if name == "demo.yaml":
        data = {split: [write_lines(root / "data" / f"{split}.{lang}", gzip_lines(DEMO_DATA / f"{split}.{lang}.gz", count))
                        for lang in ("en", "de")] for split, count in (("train", 1000), ("valid", 20), ("test", 20))}
        size = ["--trainer.max_time=null", "--trainer.max_epochs=1", "--trainer.limit_train_batches=4",
                "--trainer.val_check_interval=4"]
    else:
        data = multi30k_subset(root / "data", train=600, valid=20)
        if name == "wmt.yaml":  # languages: en -> de there
            data = {split: files[::-1] for split, files in data.items()}
        size = (["--trainer.accelerator=cpu", "--trainer.max_time=null", "--trainer.max_epochs=1",
                 "--trainer.limit_train_batches=4"]  # accelerator auto: a GPU, if the machine has one
                if name == "multi30k.yaml" else
                ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_steps=4",
                 "--trainer.val_check_interval=4", "--data.num_workers=1", "--data.num_proc=1"])
        size += ["--data.hf_name=null", "--data.hf_config=null", "--data.max_tokens=512"]
    files = [f"--data.{split}_files=[{','.join(paths)}]" for split, paths in data.items()]
    return config, [*common, *size, *files]


def gzip_lines(path: Path, count: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().split("\n")[:count]


END_TO_END = pytest.mark.e2e  # (make e2e: wmt's, and each config's bf16-mixed run; make test: demo's two DDP processes
# stand in for wmt's two, and test_fit.py's ranks as each machine for bf16-mixed's runs)


@pytest.mark.parametrize("name,machine", [("demo.yaml", "avx2"), pytest.param("demo.yaml", "amx", marks=END_TO_END),
                                          ("multi30k.yaml", "avx2"),
                                          pytest.param("multi30k.yaml", "avx512_bf16", marks=END_TO_END),
                                          pytest.param("multi30k.yaml", "arm", marks=END_TO_END),
                                          pytest.param("wmt.yaml", "avx2", marks=END_TO_END),
                                          pytest.param("wmt.yaml", "amx", marks=END_TO_END)])
def test_each_shipped_config_runs_under_each_precision_auto_can_pick(name: str, machine: str, tmp_path: Path,
                                                                     machine_verdicts):
    """demo and wmt run two DDP processes (gloo on a CPU; wmt's GPUs become CPU processes here): every
    rank trains in the precision the launcher chose and with rank 0's attention verdict. wmt resolves
    to bf16-mixed on GPUs from Ampere on, to 32-true before: the CPU machines stand in for both."""
    training, _, fp32_attention = ANSWERS[machine]
    machine_verdicts(machine)
    config, overrides = shipped_config_run(name, tmp_path)
    result = run_as(machine, "seq2seq.fit", "--config", str(config), *overrides,
                    "--trainer.callbacks+=ddp_probe.MachineProbe", f"--trainer.callbacks.out_dir={tmp_path / 'probe'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trainer.precision auto: {training} on {MACHINES[machine].model}" in result.stdout
    if fp32_attention is not None:
        assert f"attention under bf16-mixed: {'float32' if fp32_attention else 'bf16'} (" in result.stderr
    ranks = [json.loads(path.read_text()) for path in sorted((tmp_path / "probe").glob("machine*.json"))]
    assert len(ranks) == (1 if name == "multi30k.yaml" else 2) == ranks[0]["world_size"]
    for rank in ranks:
        assert rank["precision"] == training and rank["fp32_attention"] == [bool(fp32_attention)], rank
    assert (tmp_path / "run" / "best.ckpt").is_file() and (tmp_path / "run" / "last.ckpt").is_file()
