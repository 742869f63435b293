"""Tests for interactive translation (seq2seq/interactive.py, run as serve/translate.py): a line answered as it
comes, n-best, compiling first, long and undecodable lines."""

import io
import subprocess
import sys
from pathlib import Path

import pytest
from translating import REPO, SENTENCES, python_env, read_line

from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.translator import Translator
from seq2seq.model.compiled import CompileError
from seq2seq.translate import format_nbest

pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def serve(checkpoint: Path, *args: str) -> subprocess.Popen:
    command = [sys.executable, str(REPO / "serve/translate.py"), "--checkpoint", str(checkpoint), *args,
               "--precision", "fp32"]  # as the in-process Translator it is compared with (see run_cli)
    return subprocess.Popen(command, cwd=REPO, env=python_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_serve_answers_each_line_as_it_comes(checkpoint: Path, translator: Translator):
    lines = [SENTENCES[1].encode(), b"", b"Dr\xe4i Frauen.", b"   ", SENTENCES[0].encode()]
    expected = [translator.translate([text])[0] for text in (SENTENCES[1], "", "", "", SENTENCES[0])]
    process = serve(checkpoint)
    try:
        answers = []
        for line in lines:  # one at a time: the answer must come before the next line is sent
            process.stdin.write(line + b"\n")
            process.stdin.flush()
            answers.append(read_line(process))
        process.stdin.close()
        assert process.wait(timeout=60) == 0
        assert process.stdout.read() == b""
        assert answers == expected
        assert "input line 3 is not UTF-8" in process.stderr.read().decode()
    finally:
        process.kill()


def test_serve_nbest(checkpoint: Path, translator: Translator):
    process = serve(checkpoint, "--nbest", "2", "--beam", "3")
    out, err = process.communicate(f"{SENTENCES[2]}\n\n{SENTENCES[3]}\n".encode(), timeout=120)
    assert process.returncode == 0, err.decode()
    blocks = out.decode("utf-8").split("\n\n")
    assert blocks[-1] == "" and len(blocks[:-1]) == 3  # N lines and a blank line per input
    for block, text in zip(blocks[:-1], [SENTENCES[2], "", SENTENCES[3]], strict=True):
        expected = format_nbest(translator.translate_nbest([text], SearchConfig(beam_size=3, nbest=2))[0], nbest=2)
        got = block.split("\n")
        assert [line.split("\t")[1] for line in got] == [line.split("\t")[1] for line in expected]
        assert [float(line.split("\t")[0]) for line in got] == pytest.approx(
            [float(line.split("\t")[0]) for line in expected], abs=1e-4
        )


def test_serve_with_compile_compiles_before_it_reads_the_first_line(checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]):
    """serve/translate.py --compile compiles every kind of step before it reads a line (run in this process, the
    compiling pretended: Translator.compile_decoding is the test above)."""
    from seq2seq import interactive
    events: list[str] = []
    monkeypatch.setattr(Translator, "compile_decoding", lambda self, threads=None: events.append("compiled") or 8)

    class Lines(io.BytesIO):
        def readline(self, size: int | None = -1) -> bytes:
            events.append("read")
            return super().readline(size)

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(Lines(b"\n")))  # an empty line: nothing to decode (compile)
    interactive.main(["--checkpoint", str(checkpoint), "--compile", "jit", "--precision", "fp32"])
    assert events[0] == "compiled" and events.count("compiled") == 1 and "read" in events
    out, err = capsys.readouterr()
    assert out == "\n" and "compiling the encoder and the decoding steps (--compile" in err
    assert "8 kinds of call (encoder, cross-attention projection, decoding step) compiled" in err
    # A step that cannot be compiled: one line, before any line is read
    events.clear()
    monkeypatch.setattr(Translator, "compile_decoding", lambda self, threads=None: (_ for _ in ()).throw(
        CompileError("the decoding step could not be compiled (InvalidCxxCompiler)")))
    with pytest.raises(SystemExit) as caught:
        interactive.main(["--checkpoint", str(checkpoint), "--compile", "jit", "--precision", "fp32"])
    assert caught.value.code == ("error: the decoding step could not be compiled (InvalidCxxCompiler); "
                                 "serve/translate.py was not started: run it without --compile") and events == []


def test_serve_reports_each_truncated_line_with_its_own_number(checkpoint: Path, translator: Translator):
    long_line = " ".join(SENTENCES * 4)
    tokens = len(translator.tokenizer.encode_source([long_line])[0])
    process = serve(checkpoint)
    out, err = process.communicate(f"{long_line}\n{SENTENCES[0]}\n{long_line}\n".encode(), timeout=120)
    assert process.returncode == 0, err.decode()
    assert len(out.decode("utf-8").splitlines()) == 3
    warned = [line for line in err.decode().splitlines() if line.startswith("warning:")]
    assert warned == [f"warning: input line {n} has {tokens} tokens, more than the model's max_positions (128); "
                      "translating its first 128 tokens only" for n in (1, 3)]


def test_serve_answers_a_line_of_megabytes_with_an_empty_line_and_goes_on(checkpoint: Path, translator: Translator):
    """A 3 MiB line (a binary file piped in) was read whole; now it is one error and one empty line."""
    process = serve(checkpoint, "--compile", "off")  # (no note of the compiled decoder: stderr holds the errors)
    multibyte = "ä" * (1 << 19) + "a"  # 1 MiB + 1 byte, cut inside a character when read in bounded pieces
    out, err = process.communicate(b"\0" * (3 << 20) + f"\n{multibyte}\n{SENTENCES[0]}\n".encode(), timeout=120)
    assert process.returncode == 0, err.decode()
    assert out.decode("utf-8").split("\n") == ["", "", translator.translate([SENTENCES[0]])[0], ""]
    assert err.decode().splitlines() == [f"error: input line {n} is longer than 1 MiB; translating it as an empty "
                                         "line" for n in (1, 2)], err.decode()
