"""Shared test fixtures: the Multi30k corpus next to the repository and a small tokenizer.

Under pytest-xdist (`make test` runs `pytest -n 2`) each worker is a process of its own, with its session fixtures:
the trained models below are trained once for the whole run (`shared_across_workers`, the first worker to need one
trains it, the others wait for it and read it), and the attention kernel (seq2seq/model/kernels.py) is built once
into a folder every worker shares. Each worker runs torch on one intra-op thread (torch's default, one per core,
would have the two workers' threads spin against each other on a 2-core machine); a test that wants more sets it.
"""

import gzip
import os
import signal
import time
from pathlib import Path

# Tests never reach the Hub; set before `datasets` / `huggingface_hub` are imported anywhere.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A compiled package's code checks each call's inputs against the shapes it was exported for (model/packaged.py)
os.environ.setdefault("AOTI_RUNTIME_CHECK_INPUTS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from filelock import FileLock  # noqa: E402
from machines import pretend_machine  # noqa: E402

from seq2seq.precision import Verdict  # noqa: E402
from seq2seq.text.tokenizer import Tokenizer  # noqa: E402

# CI clones the project next to shared/, as the working copy is: ../shared/data/multi30k.
MULTI30K = Path(__file__).resolve().parents[1].parent / "shared/data/multi30k"
DEMO_DATA = Path(__file__).resolve().parents[1] / "seq2seq/demo/data"
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:  # one core per worker (see above); processes the tests start inherit it
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of this whole test run: the session's base folder, or under xdist the one above the workers'."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if XDIST_WORKER else base


def shared_across_workers(tmp_path_factory: pytest.TempPathFactory, name: str, make) -> Path:
    """`make(folder)` run once for the whole test run, by whichever worker asks first (the others wait for it):
    the folder. What is made there is read, never changed, by the tests (as a session fixture's result)."""
    root = run_root(tmp_path_factory)
    folder = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (folder / ".made").is_file():
            folder.mkdir(exist_ok=True)
            make(folder)
            (folder / ".made").touch()
    return folder


@pytest.fixture(scope="session", autouse=True)
def an_avx2_machine_by_default(tmp_path_factory: pytest.TempPathFactory):
    """Every test runs on a pretended AVX2-only x86 CPU unless it pretends otherwise: `auto` then picks fp32
    by the rule (no bf16 units), outputs do not depend on the CPU, and no timing decides. The verdict
    cache goes to a folder of the session's (XDG_CACHE_HOME, inherited by subprocesses). A Translator
    packs its linear layers for oneDNN wherever this torch has oneDNN, as it does on most x86 CPUs
    (tests/inference/test_translator.py runs both kinds), instead of by this machine's timing, every row on oneDNN
    (tests/inference/test_translator.py runs fp32's few rows on torch's own linear too); and its bf16 attention at
    one query a row keeps the matmuls (tests/model/test_attention.py and test_model.py run SDPA there too)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))
        patch.setenv("TORCH_EXTENSIONS_DIR", str(run_root(tmp_path_factory) / "torch_extensions"))  # built once a run
        pretend_machine(patch, "avx2")
        patch.setattr("seq2seq.inference.preparation.onednn_linears", pinned_onednn_linears)
        patch.setattr("seq2seq.inference.preparation.one_query_sdpa", lambda device, precision: Verdict(False, "pinned by the tests"))
        patch.setattr("seq2seq.inference.preparation.few_rows_on_torch", lambda device, precision, **shape: 0)
        patch.setattr("seq2seq.training.machine.compiled_step_pays", pinned_compiled_step)
        yield


@pytest.fixture(autouse=True)
def sigterm_handler_kept():
    """A face's main() makes SIGTERM raise in the main thread (cli.stop_on_sigterm), and its handler ignores a second:
    each test leaves this process's SIGTERM as it found it."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


def sigterm_to_this_process(*_args, **_kwargs) -> None:
    """A real SIGTERM to this process, which a face's main() handles as Ctrl-C (cli.stop_on_sigterm), raising in the
    main thread at once; Python's default had ended the process, exit 143 and no line."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    raise AssertionError("SIGTERM was not handled")


def pinned_compiled_step(*args, **kwargs) -> Verdict:
    """model.compile auto trains eagerly in the tests (timing it compiles; tests/training/test_compiled_training.py times it)."""
    return Verdict(False, "pinned by the tests")


def pinned_onednn_linears(device, precision: str) -> Verdict:
    packs = device.type == "cpu" and precision in ("fp32", "bf16") and torch.backends.mkldnn.is_available()
    return Verdict(packs, "pinned by the tests")


def _multi30k_lines(stem: str, lang: str, limit: int | None = None) -> list[str]:
    path = MULTI30K / f"{stem}.{lang}.gz"
    if not path.is_file():
        pytest.skip(f"Multi30k not found at {MULTI30K} (expected next to the repository)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    lines = lines[:-1] if lines and lines[-1] == "" else lines
    return lines[:limit]


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    if not MULTI30K.is_dir():
        pytest.skip(f"Multi30k not found at {MULTI30K} (expected next to the repository)")
    return MULTI30K


@pytest.fixture(scope="session")
def multi30k_lines():
    """`multi30k_lines(stem, lang, limit=None)`: lines of `<stem>.<lang>.gz` (train, val, test_2016_flickr)."""
    return _multi30k_lines


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """A 2000-piece joint de/en BPE model trained on 5000 Multi30k pairs (well under a second)."""
    texts = _multi30k_lines("train", "de", 5000) + _multi30k_lines("train", "en", 5000)
    return Tokenizer.train(texts, vocab_size=2000, seed=0)


@pytest.fixture(scope="session")
def tokenizer_path(tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tokenizer") / "spm.model"
    tokenizer.save(path)
    return str(path)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hf_cache"))


@pytest.fixture(scope="session")
def multi30k(multi30k_dir: Path, tokenizer_path: str, cache_dir: str):
    """All of Multi30k train and validation, de → en, max_tokens=4096."""
    from seq2seq.training.data import TranslationDataModule

    dm = TranslationDataModule(
        src_lang="de",
        tgt_lang="en",
        tokenizer_path=tokenizer_path,
        train_files=[str(multi30k_dir / "train.de.gz"), str(multi30k_dir / "train.en.gz")],
        valid_files=[str(multi30k_dir / "val.de.gz"), str(multi30k_dir / "val.en.gz")],
        max_tokens=4096,
        cache_dir=cache_dir,
    )
    dm.setup("fit")
    return dm


TINY_CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  max_steps: {max_steps}
  val_check_interval: {max_steps}
  check_val_every_n_epoch: null
  enable_progress_bar: false
  enable_model_summary: false
  log_every_n_steps: 5
  default_root_dir: {root}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {root}/checkpoints
        filename: best
        monitor: val_bleu
        mode: max
        save_last: true
        enable_version_counter: false
model:
  transformer:
    d_model: 32
    num_heads: 2
    d_ff: 64
    num_encoder_layers: 1
    num_decoder_layers: 1
    dropout: 0.0
    max_positions: 128
  lr: 0.003
  warmup_steps: 5
  val_search:
    beam_size: 1
    max_len_b: 5
data:
  src_lang: de
  tgt_lang: en
  tokenizer_path: {root}/spm.model
  vocab_size: 600
  train_files: [{data}/train.de, {data}/train.en]
  valid_files: [{data}/val.de, {data}/val.en]
  max_tokens: 512
  max_tokens_per_sentence: 64
  cache_dir: {root}/hf_cache
"""


def write_tiny_run(root: Path, *, max_steps: int = 12, train_pairs: int = 600, val_pairs: int = 40) -> Path:
    """A config for a one-layer model on a Multi30k subset (written under `root`); returns its path."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    for stem, out, limit in (("train", "train", train_pairs), ("val", "val", val_pairs)):
        for lang in ("de", "en"):
            lines = _multi30k_lines(stem, lang, limit)
            (data / f"{out}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    config = root / "tiny.yaml"
    config.write_text(TINY_CONFIG.format(root=root, data=data, max_steps=max_steps), encoding="utf-8")
    return config


def write_not_ours(path: Path, kind: str) -> None:
    """A file that is not a seq2seq checkpoint, of one of several kinds."""
    import torch

    if kind == "other_dict":  # e.g. another project's Lightning checkpoint
        torch.save({"state_dict": {"layer.weight": torch.zeros(2)}, "epoch": 3}, path)
    elif kind == "tensor":
        torch.save(torch.zeros(3), path)
    elif kind == "pickled_module":  # needs arbitrary unpickling: weights_only refuses it
        torch.save(torch.nn.Linear(2, 2), path)
    elif kind == "text":
        path.write_text("hello\n", encoding="utf-8")
    elif kind == "empty":
        path.write_bytes(b"")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory):
    """A finished few-step training run: (its config path, its checkpoint folder)."""
    from seq2seq.training.fit import main

    def train(root: Path) -> None:
        main(["--config", str(write_tiny_run(root))])

    root = shared_across_workers(tmp_path_factory, "tiny_run", train)
    return root / "tiny.yaml", root / "checkpoints"


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small post-norm model (so that Marian can host it too) trained 300 steps on the demo corpus
    (~40 s; val BLEU ~56): it ends its sentences and is sure of its choices, so rounding cannot flip one."""
    import torch

    from seq2seq.training.fit import main as fit

    def train(root: Path) -> None:
        config = write_tiny_run(root, max_steps=300, train_pairs=10, val_pairs=10)
        text = config.read_text(encoding="utf-8")
        text = text.replace(f"[{root}/data/train.de, {root}/data/train.en]", f"[{DEMO_DATA}/train.en.gz, {DEMO_DATA}/train.de.gz]")
        text = text.replace(f"[{root}/data/val.de, {root}/data/val.en]", f"[{DEMO_DATA}/valid.en.gz, {DEMO_DATA}/valid.de.gz]")
        text = text.replace("src_lang: de\n  tgt_lang: en", "src_lang: en\n  tgt_lang: de").replace("vocab_size: 600", "vocab_size: 1000")
        config.write_text(text, encoding="utf-8")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            fit(["--config", str(config), "--model.transformer.d_model=64", "--model.transformer.num_heads=4",
                 "--model.transformer.d_ff=256", "--model.transformer.num_encoder_layers=2",
                 "--model.transformer.num_decoder_layers=2", "--model.transformer.norm_placement=post",
                 "--model.warmup_steps=50", "--data.max_tokens=1024", "--trainer.limit_val_batches=0"])
        finally:
            torch.set_num_threads(threads)

    root = shared_across_workers(tmp_path_factory, "export_run", train)
    return root / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="session")
def multilingual_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small model trained on four directions into three languages (tests/multilingual.py, ~40 s): its run folder,
    with checkpoints/best.ckpt."""
    from multilingual import train

    return shared_across_workers(tmp_path_factory, "multilingual_run", train)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread (the Translator's tests and its faces', `pytestmark`): on a small, busy machine two threads spinning on tiny matrices are ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(one_thread, request: pytest.FixtureRequest) -> Path:
    """The short training run's best checkpoint (`tiny_run`), as a user would load it."""
    # Asked for here, not as an argument (pytest would build the session fixture before one_thread):
    # when this module is the first to need the training run, it trains with one thread, ~1 s
    # instead of ~40 s on a busy two-core machine.
    _, checkpoints = request.getfixturevalue("tiny_run")
    return checkpoints / "best.ckpt"


@pytest.fixture(scope="module")
def translator(checkpoint: Path):
    """`checkpoint`'s Translator (a module's own `translator` fixture, where it has one, takes its place)."""
    from seq2seq.inference.translator import Translator

    return Translator.from_checkpoint(checkpoint)
