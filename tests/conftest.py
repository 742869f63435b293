"""Shared test fixtures: the Multi30k corpus next to the repository and a small tokenizer."""

import gzip
import os
from pathlib import Path

# Tests never reach the Hub; set before `datasets` / `huggingface_hub` are imported anywhere.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from seq2seq.tokenizer import Tokenizer  # noqa: E402

# CI clones the project next to shared/, as the working copy is: ../shared/data/multi30k.
MULTI30K = Path(__file__).resolve().parents[1].parent / "shared/data/multi30k"


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
