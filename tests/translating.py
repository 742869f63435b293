"""What the Translator's tests and its faces' tests share (their fixtures, `one_thread`, `checkpoint` and
`translator`, are conftest.py's): German sentences for the short training run's model, the environment and the
readers the command tests run with."""

import os
import select
import subprocess
from pathlib import Path

import output_checks

from seq2seq.translate import main

REPO = Path(__file__).resolve().parents[1]


SENTENCES = [
    "Ein Hund läuft über die Wiese.",
    "Zwei Männer spielen Fußball im Park.",
    "Eine Frau mit einem roten Hut sitzt auf einer Bank und liest ein Buch.",
    "Kinder.",
    "Ein Mann fährt Fahrrad auf einer Straße in der Stadt, während es regnet.",
    "Eine Gruppe von Menschen steht vor einem Gebäude.",
]


def python_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def read_line(process: subprocess.Popen, *, timeout: float = 60) -> str:
    """One line of the server's answer; fails (instead of hanging) if it never comes, e.g. unflushed."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, "serve/translate.py did not answer a line (not flushed?)"
    return process.stdout.readline().decode("utf-8").removesuffix("\n")


def refused(*args: str) -> str:
    """(No checkpoint is needed to get there.)"""
    return output_checks.refused(lambda args: main(["--checkpoint", "unused.ckpt", *args]), *args)
