"""The package as a user installs it: a wheel built from the repository's tracked files, installed (not editable)
into a fresh virtual environment, serves and translates from a folder outside the repository, with every face's
script. The environment takes the project's dependencies from this one's site-packages (a path in a .pth file,
so none of this environment's own .pth files, the editable install among them, run there): what is tested is
what the wheel holds, not how pip resolves torch (the README's set-up and CI's install do that)."""

import os
import signal
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest
from serving import start_process

REPO = Path(__file__).resolve().parents[1]
FACES = ["fit", "translate", "score", "average", "export", "convert", "interactive", "serve"]

pytestmark = pytest.mark.e2e  # a wheel built and a server started: half a minute


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed in it: its python."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # the tracked files only, as a clean clone has them (no build/ left in the repo)
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((REPO / name).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(root / "dist"), str(source)], check=True, cwd=root)
    wheel = next((root / "dist").glob("seq2seq-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("seq2seq/serve/server.py", "seq2seq/serve/__main__.py", "seq2seq/model/decode_attention.cpp",
                   "seq2seq/model/package_runner.cpp",
                   "seq2seq/demo/data/train.en.gz", "seq2seq/py.typed"):
        assert needed in names, f"the wheel lacks {needed}"
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = [path for path in site.getsitepackages() if Path(path).is_dir()] or [sysconfig.get_paths()["purelib"]]
    (Path(purelib) / "dependencies.pth").write_text("\n".join(ours) + "\n", encoding="utf-8")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], check=True)
    return python


def run_outside(python: Path, *args: str, cwd: Path, **options) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          **options)


def test_the_wheel_is_what_runs_and_every_face_has_its_script(installed: Path, tmp_path: Path):
    where = run_outside(installed, "-c", "import seq2seq, seq2seq.serve.app; print(seq2seq.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed.parents[1]), "the repository's copy was imported"
    for face in FACES:
        script = installed.parent / f"seq2seq-{face}"
        help_text = run_outside(script, "--help", cwd=tmp_path) if script.exists() else None
        assert help_text is not None and help_text.returncode == 0 and "usage:" in help_text.stdout, face


def test_the_installed_package_translates_a_file(installed: Path, trained: Path, tmp_path: Path):
    (tmp_path / "in.en").write_text("a man is walking .\ntwo dogs play in the snow .\n", encoding="utf-8")
    done = run_outside(installed.parent / "seq2seq-translate", "--checkpoint", str(trained), "--input", "in.en",
                       "--output", "out.de", "--precision", "fp32", "--beam", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "out.de").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2 and all(lines)


def test_the_installed_package_serves(installed: Path, trained: Path, tmp_path: Path):
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    process, url, _ = start_process([str(installed), "-m", "seq2seq.serve"], trained, timeout=120, cwd=tmp_path,
                                    env=env, stderr=subprocess.PIPE, text=True)
    try:
        reply = httpx.post(url + "/translate", json={"q": "a man is walking .", "source": "en", "target": "de"},
                           timeout=60)
        assert reply.status_code == 200
        text = reply.json()["translatedText"]
        assert isinstance(text, str) and text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert "Traceback" not in (process.stderr.read() if process.stderr else "")
    finally:
        process.kill()
