"""Tests for the translate command (seq2seq/translate.py): files and stdin, references, n-best, its one-line
errors, what it writes and never overwrites, interruptions that keep whole lines."""

import argparse
import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import output_checks
import pytest
import sacrebleu
import torch
from conftest import sigterm_to_this_process, write_not_ours
from translating import REPO, SENTENCES, python_env, read_line, refused

from seq2seq.checkpoint import store_search_defaults
from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.documents import Translation
from seq2seq.inference.translator import Translator
from seq2seq.model.compiled import CompiledDecoder, CompileError
from seq2seq.textio import Output
from seq2seq.translate import format_nbest, main, one_line, read_lines, write_translations

pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def test_cli_switch_flags_are_none_until_given():
    """A SearchConfig switch's flag is None when absent (the checkpoint's value then applies): --alignments
    turns an off switch on, --no-scores an on switch off."""
    from seq2seq.cli import add_search_arguments, search_config, search_flags

    parser = argparse.ArgumentParser()
    add_search_arguments(parser)
    assert search_flags()["scores"] == ["--no-scores"] and search_flags()["alignments"] == ["--alignments"]
    stored = SearchConfig(alignments=True, scores=False, beam_size=3)
    assert search_config(parser, parser.parse_args([]), stored) == stored
    given = search_config(parser, parser.parse_args(["--no-scores", "--token-scores"]), SearchConfig())
    assert (given.scores, given.token_scores, given.alignments) == (False, True, False)


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_bar_only_on_a_terminal(terminal: bool):
    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return terminal

    progress, output, best = Stream(), io.StringIO(), []
    hyps = [[Translation(text=f"line {i}", score=-1.0, tokens=[4])] for i in range(3)]
    write_translations(iter(hyps), output, search=SearchConfig(), best=best, total=3, progress=progress)
    assert output.getvalue() == "line 0\nline 1\nline 2\n" and best == ["line 0", "line 1", "line 2"]
    assert ("/3 [" in progress.getvalue()) == terminal  # the bar ("0/3 [00:00<?, ...]"); nothing when piped
    assert terminal or progress.getvalue() == ""


def test_output_lines_stay_one_line_each():
    # Byte-fallback pieces can decode to a newline; it must not split a translation over two lines.
    hyps = [Translation(text="a\nb\r", score=-1.5, tokens=[4]), Translation(text="c", score=-2.0, tokens=[5])]
    assert one_line(hyps[0].text) == "a b "
    assert format_nbest(hyps, nbest=2, prefix="3\t") == ["3\t-1.5000\ta b ", "3\t-2.0000\tc"]
    assert format_nbest([], nbest=2, prefix="4\t") == ["4\t0.0000\t", "4\t0.0000\t"]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    # fp32 unless a test asks otherwise: auto would pick bf16 on a CPU with bf16 units, and the
    # outputs are compared with the in-process fp32 Translator's.
    precision = [] if "--precision" in args else ["--precision", "fp32"]
    command = [sys.executable, "-m", "seq2seq.translate", *args, *precision]
    return subprocess.run(command, cwd=REPO, env=python_env(), input=stdin, capture_output=True, text=True,
                          encoding="utf-8", timeout=120)


def test_cli_files_with_references(checkpoint: Path, translator: Translator, tmp_path: Path):
    sources = [SENTENCES[0], "", SENTENCES[1], "   ", SENTENCES[2], SENTENCES[3]]
    references = ["A dog runs across the meadow.", "", "Two men play football in the park.", "",
                  "A woman in a red hat sits on a bench reading a book.", "Children."]
    (tmp_path / "in.de").write_text("\n".join(sources) + "\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("\n".join(references) + "\n", encoding="utf-8")
    result = run_cli("--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"),
                     "--output", str(tmp_path / "out.en"), "--ref", str(tmp_path / "ref.en"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""  # translations went to the file, scores to stderr
    lines = (tmp_path / "out.en").read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines[:-1]) == len(sources)
    assert lines[:-1] == translator.translate(sources, SearchConfig(beam_size=5))
    assert lines[1] == lines[3] == ""
    # The end-of-run line names the precision, the workers and their threads, and the search
    assert re.search(r"^translated 6 lines in [\d.]+s \((fp32|bf16), \d+ workers? x \d+ threads?, beam 5, ",
                     result.stderr, re.MULTILINE), result.stderr
    assert re.search(r"^BLEU = [\d.]+ .*nrefs:1\|case:mixed\|eff:no\|tok:13a\|smooth:exp\|version:[\d.]+$",
                     result.stderr, re.MULTILINE), result.stderr
    assert re.search(r"^chrF2 = [\d.]+ .*nrefs:1\|case:mixed\|eff:yes\|nc:6\|nw:0\|space:no\|version:[\d.]+$",
                     result.stderr, re.MULTILINE), result.stderr


def test_the_end_line_gives_the_compiling_s_share_where_there_was_some(checkpoint: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]):
    """--compile: every process compiles its graphs again (a minute or more), so a short run is mostly compiling, and
    its tokens/s say nothing without the share (the seconds pretended here: test_compiled_decoding_translates_as_the_
    eager_step has the tally's)."""
    (tmp_path / "in.de").write_text(SENTENCES[0] + "\n", encoding="utf-8")
    command = ["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(tmp_path / "out"),
               "--force"]  # run twice into one file
    main(command)
    assert "of it compiling" not in capsys.readouterr().err
    monkeypatch.setattr(Translator, "compiling_seconds", property(lambda self: 12.34))
    main(command)
    assert re.search(r"^translated 1 lines in [\d.]+s, 12\.3s of it compiling \((fp32|bf16), ", capsys.readouterr().err,
                     re.MULTILINE)


def test_cli_stdin_nbest(checkpoint: Path, translator: Translator):
    sources = [SENTENCES[0], "", SENTENCES[4]]
    result = run_cli("--checkpoint", str(checkpoint), "--input", "-", "--nbest", "2", "--beam", "3",
                     stdin="\n".join(sources) + "\n")
    assert result.returncode == 0, result.stderr
    rows = [re.fullmatch(r"(\d+)\t(-?\d+\.\d{4})\t(.*)", line) for line in result.stdout.splitlines()]
    assert all(rows), result.stdout
    assert [int(row[1]) for row in rows] == [0, 0, 1, 1, 2, 2]
    expected = translator.translate_nbest(sources, SearchConfig(beam_size=3, nbest=2))
    for i in (0, 2):
        got = rows[2 * i : 2 * i + 2]
        assert [row[3] for row in got] == [h.text for h in expected[i]]
        assert [float(row[2]) for row in got] == pytest.approx([h.score for h in expected[i]], abs=1e-4)
    assert [row.groups()[1:] for row in rows[2:4]] == [("0.0000", ""), ("0.0000", "")]  # the empty line


def test_cli_reference_line_count_mismatch(tmp_path: Path):
    (tmp_path / "in.de").write_text("a\n\nb\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("a\nb\n", encoding="utf-8")
    # The check comes before the checkpoint is read: this one need not exist.
    with pytest.raises(SystemExit, match=r"in\.de has 3 lines but .*ref\.en has 2; the references must be line"):
        main(["--checkpoint", "unused.ckpt", "--input", str(tmp_path / "in.de"), "--ref", str(tmp_path / "ref.en")])


def test_cli_names_the_line_that_is_not_utf8(checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture):
    data = "Ein Hund.\nZwei Männer.\n".encode() + b"Dr\xe4i Frauen.\nVier.\n"  # latin-1 ä on line 3
    (tmp_path / "in.de").write_bytes(data)
    # A file is checked whole before the checkpoint is read (this one need not exist).
    with pytest.raises(SystemExit, match=r"in\.de line 3 is not UTF-8; convert the file to UTF-8$"):
        main(["--checkpoint", "unused.ckpt", "--input", str(tmp_path / "in.de")])
    # stdin is read once, as it comes: the lines before the bad one are translated and kept.
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    with pytest.raises(SystemExit, match="^error: stdin line 3 is not UTF-8; convert the file to UTF-8; stdout holds "
                                         "the translations of the 2 lines before it$"):
        main(["--checkpoint", str(checkpoint), "--precision", "fp32"])
    expected = Translator.from_checkpoint(checkpoint, precision="fp32").translate(["Ein Hund.", "Zwei Männer."])
    assert capsys.readouterr().out == "".join(f"{line}\n" for line in expected)


def test_cli_explains_bad_checkpoints(tmp_path: Path):
    (tmp_path / "in.de").write_text("a\n", encoding="utf-8")
    write_not_ours(tmp_path / "other.ckpt", "other_dict")
    with pytest.raises(SystemExit, match=r"^error: .*other\.ckpt is not a seq2seq training checkpoint"):
        main(["--checkpoint", str(tmp_path / "other.ckpt"), "--input", str(tmp_path / "in.de")])
    with pytest.raises(SystemExit, match="error: .*missing.ckpt does not exist"):
        main(["--checkpoint", str(tmp_path / "missing.ckpt"), "--input", str(tmp_path / "in.de")])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--beam", "2", "--nbest", "3"], "--nbest: must be between 1 and --beam (2), got 3"),
        (["--beam", "0"], "--beam: must be >= 1, got 0"),
        (["--length-penalty", "nan"], "--length-penalty: must be a finite number, got nan"),
        (["--length-penalty", "inf"], "--length-penalty: must be a finite number, got inf"),
        (["--max-len-a", "nan"], "--max-len-a: must be a finite number, got nan"),
        (["--max-len-a", "1e300"], "--max-len-a: must be >= 0 and <= 1000, got 1e+300"),
        (["--max-len-b", "-5"], "--max-len-b: must be >= 0 and <= 1000000, got -5"),
        (["--max-len-a", "0", "--max-len-b", "0"], "--max-len-a and --max-len-b are both 0"),
        (["--min-len", "-1"], "--min-len: must be >= 0, got -1"),
        (["--sampling", "--temperature", "nan"], "--temperature: must be a finite number, got nan"),
        (["--sampling", "--temperature", "0"], "--temperature: must be >= 0.0001 and <= 10000.0, got 0.0"),
        (["--sampling", "--temperature", "1e-38"], "--temperature: must be >= 0.0001 and <= 10000.0, got 1e-38"),
        (["--length-penalty", "300"], "--length-penalty: must be >= 0 and <= 10, got 300.0"),
        (["--sampling", "--top-p", "0"], "--top-p: must be > 0 and <= 1, got 0.0"),
        (["--sampling", "--top-k", "-1"], "--top-k: must be >= 0, got -1"),
        (["--sampling", "--nbest", "2"], "--nbest: --sampling draws one translation per sentence: must be 1, got 2"),
        (["--seed", "-3"], "--seed: must be >= 0"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
        (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "cuda:99"], "--device: device 'cuda"),
        (["--device", "abacus"], "--device: device 'abacus' cannot be used here"),
    ],
)
def test_cli_refuses_bad_options_before_loading_anything(options, message, capsys: pytest.CaptureFixture):
    # The checkpoint does not exist: the option must be refused before it is looked for.
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", "unused.ckpt", *options])
    assert caught.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("python -m seq2seq.translate: error: ") and message in error, error


def test_cli_refuses_a_beam_wider_than_the_vocabulary_before_translating(checkpoint: Path, tmp_path: Path):
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"^error: --beam: 1000000 needs a vocabulary of at least 2000000 tokens; "
                                         "this model has 600$"):
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--beam", "1000000"])


@pytest.mark.parametrize("where", ["missing_folder", "folder", "under_a_file"])
def test_cli_checks_the_output_path_before_translating(where: str, tmp_path: Path):
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    (tmp_path / "a_file").write_text("x", encoding="utf-8")
    output = {"missing_folder": tmp_path / "nope" / "out.en", "folder": tmp_path,
              "under_a_file": tmp_path / "a_file" / "out.en"}[where]
    expected = {"folder": "is a folder; name the file to write", "missing_folder": "does not exist; create it first",
                "under_a_file": "a_file is a file, not a folder"}[where]
    # No checkpoint either: the output is checked first, before the model loads and the input is translated.
    with pytest.raises(SystemExit, match=rf"^error: --output {re.escape(str(output))}.*{expected}"):
        main(["--checkpoint", "unused.ckpt", "--input", str(tmp_path / "in.de"), "--output", str(output)])


def test_cli_refuses_to_overwrite_its_input_and_names_a_missing_ref(tmp_path: Path):
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"^error: --output .*in\.de is the input file .*in\.de: it would be overwritten"):
        main(["--checkpoint", "unused.ckpt", "--input", str(source), "--output", str(source)])
    assert source.read_text(encoding="utf-8") == "Ein Hund.\n"
    with pytest.raises(SystemExit, match=r"^error: --output is empty"):
        main(["--checkpoint", "unused.ckpt", "--input", str(source), "--output", ""])
    with pytest.raises(SystemExit, match=r"^error: --ref .*nope\.en does not exist"):
        main(["--checkpoint", "unused.ckpt", "--input", str(source), "--ref", str(tmp_path / "nope.en")])


def test_cli_write_errors_are_one_line_and_a_closed_pipe_is_quiet(checkpoint: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "in.de").write_text("Ein Hund.\nZwei.\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"^error: cannot write --output /dev/full \(No space left on device\); it "
                                         "holds the translations of the first 0 lines$"):
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", "/dev/full"])
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head -0`: nobody reads
    with open(write_end, "w", encoding="utf-8") as closed_pipe:
        monkeypatch.setattr(sys, "stdout", closed_pipe)
        with pytest.raises(SystemExit) as caught:
            main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de")])
        assert caught.value.code == 141  # what `cat` gives in a shell: 128 + SIGPIPE, and no traceback
        monkeypatch.undo()


@pytest.mark.parametrize(("stop", "status"), [("interrupted", 130), ("stopped by SIGTERM", 143)])
def test_cli_writes_as_it_goes_and_an_interrupted_run_keeps_its_lines(stop: str, status: int, checkpoint: Path,
                                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]):
    """Ctrl-C, or SIGTERM (a scheduler's time limit, `kill`), at the third window: the two windows done kept, one line
    saying how many, exit 130 or 143. SIGTERM ended the run at once before (143 and no line, nothing saying how far it
    got); it is handled as Ctrl-C is now (cli.stop_on_sigterm), a real signal to this process here. A second one is
    ignored until the output is cut to whole lines, then ends the process at once (the exit may wait for a batch)."""
    sources = [SENTENCES[i % len(SENTENCES)] for i in range(7)]
    (tmp_path / "in.de").write_text("\n".join(sources) + "\n", encoding="utf-8")
    monkeypatch.setattr("seq2seq.translate.WINDOW", 3)
    real = Translator._decode_batches
    calls = []

    def stopped_at_the_third_window(self, inputs, *args, **kwargs):
        calls.append(len(inputs))
        if len(calls) == 3:
            if status == 130:
                raise KeyboardInterrupt
            sigterm_to_this_process()
        return real(self, inputs, *args, **kwargs)

    real_cut, sigterm_while_cut = Output.cut_to_whole_lines, []

    def cut(self: Output) -> None:
        sigterm_while_cut.append(signal.getsignal(signal.SIGTERM))
        real_cut(self)

    monkeypatch.setattr(Translator, "_decode_batches", stopped_at_the_third_window)
    monkeypatch.setattr(Output, "cut_to_whole_lines", cut)
    output = tmp_path / "out.en"
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(output)])
    assert caught.value.code == status
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"{stop}: --output {output} holds the translations "
                                                                "of the first 6 lines")
    if status == 143:
        assert sigterm_while_cut == [signal.SIG_IGN] and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    monkeypatch.setattr(Translator, "_decode_batches", real)
    expected = Translator.from_checkpoint(checkpoint).translate(sources[:6])
    assert output.read_text(encoding="utf-8") == "".join(f"{line}\n" for line in expected)  # two whole windows


def test_sigterm_while_the_references_are_scored_says_every_translation_was_written(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """--ref's BLEU and chrF come after the last line is written (seconds on a large file): a stop then said "before any
    line was translated; ... was not written" of a complete output."""
    (tmp_path / "in.de").write_text("\n".join(SENTENCES[:3]) + "\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("a dog runs .\ntwo men .\na woman .\n", encoding="utf-8")
    monkeypatch.setattr(sacrebleu.metrics.BLEU, "corpus_score", sigterm_to_this_process)
    output = tmp_path / "out.en"
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(output), "--ref",
              str(tmp_path / "ref.en")])
    assert caught.value.code == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"stopped by SIGTERM while scoring: --output {output} "
                                                                "holds every translation")
    assert len(output.read_text(encoding="utf-8").splitlines()) == 3


def test_ctrl_c_in_the_middle_of_a_line_leaves_whole_lines_and_says_how_many(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """Half of the third line written when Ctrl-C comes: that half is cut off, and the message counts the
    lines that are whole (it said one more before)."""
    sources = SENTENCES[:4]
    (tmp_path / "in.de").write_text("\n".join(sources) + "\n", encoding="utf-8")
    output = tmp_path / "out.en"
    real_write, writes = os.write, []

    def interrupted_halfway_through_the_third_line(fd: int, data) -> int:
        if fd <= 2:  # the terminal and pytest's capture
            return real_write(fd, data)
        writes.append(bytes(data))
        if len(writes) == 3:
            real_write(fd, bytes(data)[: len(data) // 2])
            raise KeyboardInterrupt
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", interrupted_halfway_through_the_third_line)
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(output)])
    monkeypatch.undo()
    assert caught.value.code == 130
    assert capsys.readouterr().err.strip().endswith(f"interrupted: --output {output} holds the translations of the "
                                                    "first 2 lines")
    assert output.read_bytes() == writes[0] + writes[1]  # the half line is gone


def test_cli_with_compile_whose_step_cannot_be_compiled_says_so_in_one_line(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """--compile compiles each kind of step at its first batch: one that cannot be compiled (no C++ compiler) is one
    line saying so, what to do and what was written (the compiling's failure pretended)."""
    (tmp_path / "in.de").write_text("\n".join(SENTENCES[:3]) + "\n", encoding="utf-8")
    output = tmp_path / "out.en"

    def cannot_compile(self, tgt_in, memory, src_mask, state):
        raise CompileError("the decoding step could not be compiled (InvalidCxxCompiler: No working C++ compiler)")

    monkeypatch.setattr(CompiledDecoder, "_steps", cannot_compile)  # (decode's and decode_step's)
    monkeypatch.setattr(CompiledDecoder, "encode", lambda self, src: self.model.encode(src))  # (its compiling: not what is tested)
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(output),
              "--compile", "jit", "--precision", "fp32"])
    assert caught.value.code == ("error: the decoding step could not be compiled (InvalidCxxCompiler: No working C++ "
                                 f"compiler): translate without --compile; --output {output} holds the translations "
                                 "of the 0 lines before it")
    assert capsys.readouterr().err.splitlines()[0] == ("de→en: --compile: each kind of decoding step compiles at its "
                                                       "first batch (seconds to a minute each, in every run)")
    (tmp_path / "in.html").write_text("<p>" + SENTENCES[0] + "</p>", encoding="utf-8")
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.html"), "--output", str(output),
              "--format", "html", "--compile", "jit", "--precision", "fp32"])
    assert str(caught.value.code).endswith(f"translate without --compile; --output {output} was not written")


def test_cli_never_overwrites_the_checkpoint_or_a_file_that_is_not_text(checkpoint: Path, tmp_path: Path):
    """`--output c.ckpt` made a 121 MB checkpoint 650 bytes of text, exit 0."""
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    copy = tmp_path / "model.ckpt"
    shutil.copy(checkpoint, copy)
    before = copy.read_bytes()
    with pytest.raises(SystemExit, match=r"^error: --output .*model\.ckpt is the --checkpoint file .*model\.ckpt: it "
                                         "would be overwritten$"):
        main(["--checkpoint", str(copy), "--input", str(tmp_path / "in.de"), "--output", str(copy)])
    other = tmp_path / "other.ckpt"  # another checkpoint, or any binary file, under a name of its own
    shutil.copy(checkpoint, other)
    with pytest.raises(SystemExit, match=r"^error: --output .*other\.ckpt exists and is not a text file"):
        main(["--checkpoint", str(copy), "--input", str(tmp_path / "in.de"), "--output", str(other)])
    assert copy.read_bytes() == before and other.read_bytes() == before
    old = tmp_path / "old.en"  # earlier translations are the user's output to replace, with --force
    old.write_text("stale\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"^error: --output .*old\.en exists: name a new file, or pass --force"):
        main(["--checkpoint", str(copy), "--input", str(tmp_path / "in.de"), "--output", str(old)])
    assert old.read_text(encoding="utf-8") == "stale\n"
    main(["--checkpoint", str(copy), "--input", str(tmp_path / "in.de"), "--output", str(old), "--force"])
    assert old.read_text(encoding="utf-8").count("\n") == 1 and "stale" not in old.read_text(encoding="utf-8")


def test_cli_never_empties_its_output_for_an_input_it_cannot_read(checkpoint: Path, tmp_path: Path):
    """A missing or folder --input was found only after --output had been emptied; `--output F < F`
    emptied F, the input being read."""
    old = tmp_path / "old.en"
    old.write_text("earlier translations\n", encoding="utf-8")
    (tmp_path / "folder").mkdir()
    for source, message in (("nope.de", "does not exist"), ("folder", "is a folder; give a file")):
        with pytest.raises(SystemExit, match=f"^error: --input .*{source} {message}"):
            main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / source), "--output", str(old)])
    with old.open("rb") as stdin:  # the shell's `< old.en`
        result = subprocess.run([sys.executable, "-m", "seq2seq.translate", "--checkpoint", str(checkpoint),
                                 "--output", str(old)], cwd=REPO, env=python_env(), stdin=stdin, capture_output=True,
                                text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip() == (
        f"error: --output {old} is the input file, read from stdin: it would be overwritten; write to another file")
    assert old.read_text(encoding="utf-8") == "earlier translations\n"


def test_cli_stdin_read_twice_or_closed_is_one_line(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(SystemExit):
        main(["--checkpoint", "unused.ckpt", "--ref", "-"])
    assert "--ref - and --input - would both read stdin" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", None)  # what Python sets when started with fd 0 closed (`<&-`)
    with pytest.raises(SystemExit, match="^error: --input -: stdin is closed; give --input FILE"):
        read_lines("-")


def test_cli_writes_into_a_fifo_without_emptying_or_closing_it_first(checkpoint: Path, translator: Translator,
                                                                     tmp_path: Path):
    """The writability check opened and closed the FIFO: it hung without a reader, and a reader got EOF
    before the first translation."""
    (tmp_path / "in.de").write_text(f"{SENTENCES[0]}\n{SENTENCES[1]}\n", encoding="utf-8")
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    command = [sys.executable, "-m", "seq2seq.translate", "--checkpoint", str(checkpoint), "--precision", "fp32",
               "--input", str(tmp_path / "in.de"), "--output", str(fifo)]
    process = subprocess.Popen(command, cwd=REPO, env=python_env(), stderr=subprocess.PIPE)

    def unblock() -> None:  # a writer that never opens the FIFO would leave open() below waiting for ever
        process.kill()
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    timer = threading.Timer(120, unblock)
    timer.start()
    try:
        with fifo.open("r", encoding="utf-8") as reader:  # open() waits for the writer, read() for its close
            got = reader.read()
        assert process.wait(timeout=60) == 0, process.stderr.read()
    finally:
        timer.cancel()
        process.kill()
    assert got.splitlines() == translator.translate(SENTENCES[:2])


def test_a_full_disk_leaves_whole_lines_and_says_how_many(checkpoint: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch):
    """The disk fills in the middle of line 3: the file keeps lines 1-2 whole (no partial third line), and
    the message counts the lines written, not the one being written."""
    sources = [SENTENCES[i % len(SENTENCES)] for i in range(5)]
    (tmp_path / "in.de").write_text("\n".join(sources) + "\n", encoding="utf-8")
    real_write, writes = os.write, []

    def disk_fills_on_the_third_line(fd: int, data) -> int:
        writes.append(len(data))
        if len(writes) == 3:
            real_write(fd, bytes(data[: len(data) // 2]))  # the first half gets out, then the disk is full
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr("seq2seq.translate.os.write", disk_fills_on_the_third_line)
    output = tmp_path / "out.en"
    with pytest.raises(SystemExit, match=r"^error: cannot write --output .*out\.en \(No space left on device\); it "
                                         r"holds the translations of the first 2 lines$"):
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(output),
              "--precision", "fp32"])
    expected = Translator.from_checkpoint(checkpoint, precision="fp32").translate(sources[:2])
    assert output.read_text(encoding="utf-8") == "".join(f"{line}\n" for line in expected)


def test_cli_failures_around_model_load_are_one_line(checkpoint: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    folder = tmp_path / "out"
    folder.mkdir()
    real = Translator.from_checkpoint

    def folder_goes_during_load(*args, **kwargs):
        folder.rmdir()  # an unmounted disk, a cleaned-up folder: the output cannot be opened any more
        return real(*args, **kwargs)

    monkeypatch.setattr(Translator, "from_checkpoint", folder_goes_during_load)
    with pytest.raises(SystemExit, match=r"^error: --output .*out\.en cannot be written \(No such file or directory\)$"):
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(folder / "out.en")])
    capsys.readouterr()  # (its note: no compiled decoder is kept here)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the model loads

    monkeypatch.setattr(Translator, "from_checkpoint", interrupted)
    (tmp_path / "kept.en").write_text("kept\n", encoding="utf-8")
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(tmp_path / "kept.en"),
              "--force"])
    assert caught.value.code == 130
    assert capsys.readouterr().err.strip() == f"interrupted before any line was translated; --output {tmp_path / 'kept.en'} was not written"
    assert (tmp_path / "kept.en").read_text(encoding="utf-8") == "kept\n"


def test_cli_streams_its_input_and_refuses_what_has_no_lines(checkpoint: Path):
    """`--input /dev/zero` read everything first (+456 MiB, then MemoryError); now the input is read a
    window at a time, and a "line" of more than 1 MiB is refused."""
    result = run_cli("--checkpoint", str(checkpoint), "--input", "/dev/zero")
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
        "error: /dev/zero line 1 is longer than 1 MiB: not a text file with one sentence per line; stdout holds the "
        "translations of the 0 lines before it"), result.stderr
    # The first window's translations come out while stdin is still open: the input is streamed.
    command = [sys.executable, "-m", "seq2seq.translate", "--checkpoint", str(checkpoint), "--precision", "fp32"]
    with subprocess.Popen(command, cwd=REPO, env=python_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL) as process:
        process.stdin.write(("Ein Hund.\n" * 1000).encode())  # one window (seq2seq.translate.WINDOW)
        process.stdin.flush()
        read_line(process, timeout=120)  # fails unless the first line arrives before the end of the input
        process.stdin.write(b"Zwei.\n")
        process.stdin.close()
        rest = process.stdout.read().decode().split("\n")
        assert process.wait(timeout=60) == 0 and len(rest) == 1001  # 999, the 1001st, and "" after the last newline


def test_the_checkpoint_s_tuned_search_is_the_default_and_flags_override_it(checkpoint: Path, tmp_path: Path):
    tuned = tmp_path / "tuned.ckpt"
    shutil.copy(checkpoint, tuned)
    store_search_defaults(tuned, {"beam_size": 2, "length_penalty": 1.5})
    translator = Translator.from_checkpoint(tuned)
    assert translator.search == SearchConfig(beam_size=2, length_penalty=1.5)
    assert translator.translate(SENTENCES) == translator.translate(SENTENCES, SearchConfig(beam_size=2, length_penalty=1.5))
    stdin = "\n".join(SENTENCES) + "\n"
    result = run_cli("--checkpoint", str(tuned), stdin=stdin)
    assert result.returncode == 0 and "beam 2, length penalty 1.5)" in result.stderr, result.stderr
    assert result.stdout.splitlines() == translator.translate(SENTENCES)
    result = run_cli("--checkpoint", str(tuned), "--beam", "3", stdin=stdin)
    assert result.returncode == 0 and "beam 3, length penalty 1.5)" in result.stderr, result.stderr
    result = run_cli("--checkpoint", str(checkpoint), stdin=stdin)  # none stored: ours (beam 5, 0.6)
    assert result.returncode == 0 and "beam 5, length penalty 0.6)" in result.stderr, result.stderr


def test_a_cuda_build_on_a_machine_without_a_gpu_is_one_line(monkeypatch, capsys: pytest.CaptureFixture):
    """torch built for CUDA, no driver: what such a build raises for `--device cuda`, stood in for here."""
    empty = torch.empty

    def no_driver(*args, device=None, **kwargs):
        if torch.device(device).type == "cuda":
            raise RuntimeError("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU\n"
                               "and installed a driver from http://www.nvidia.com/Download/index.aspx")
        return empty(*args, device=device, **kwargs)

    monkeypatch.setattr(torch, "empty", no_driver)
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", "unused.ckpt", "--device", "cuda"])
    assert caught.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == ("python -m seq2seq.translate: error: --device: device 'cuda' cannot be used here (Found no "
                     "NVIDIA driver on your system. Please check that you have an NVIDIA GPU); use cpu, or a device "
                     "this machine has (cuda, cuda:1, mps)")


def test_the_cli_reads_target_prefixes_line_by_line(checkpoint: Path, translator: Translator, tmp_path: Path):
    (tmp_path / "in").write_text("\n".join(SENTENCES[:3]) + "\n", encoding="utf-8")
    (tmp_path / "prefix").write_text("A dog\n\nTwo men\n", encoding="utf-8")
    done = run_cli("--checkpoint", str(checkpoint), "--input", str(tmp_path / "in"), "--target-prefix",
                   str(tmp_path / "prefix"), "--beam", "2")
    assert done.returncode == 0, done.stderr
    expected = translator.translate(SENTENCES[:3], SearchConfig(beam_size=2), prefixes=["A dog", "", "Two men"])
    assert done.stdout.split("\n")[:3] == expected
    (tmp_path / "prefix").write_text("A dog\n", encoding="utf-8")
    done = run_cli("--checkpoint", str(checkpoint), "--input", str(tmp_path / "in"), "--target-prefix",
                   str(tmp_path / "prefix"))
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'in'} has 3 lines but --target-prefix {tmp_path / 'prefix'} has 1; give one line per "
        "input line (an empty line for none)")


def test_cli_replaces_an_existing_file_only_with_force(checkpoint: Path, translator: Translator, tmp_path: Path):
    """An existing text file was emptied and written over without a word."""
    (tmp_path / "in.de").write_text(f"{SENTENCES[0]}\n", encoding="utf-8")
    taken = tmp_path / "out.en"
    taken.write_text("earlier translations\n", encoding="utf-8")
    message = refused("--input", str(tmp_path / "in.de"), "--output", str(taken))
    assert message == f"error: --output {taken} exists: name a new file, or pass --force to replace it"
    assert taken.read_text(encoding="utf-8") == "earlier translations\n"
    main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(taken), "--force"])
    assert taken.read_text(encoding="utf-8").splitlines() == translator.translate(SENTENCES[:1])
    empty = tmp_path / "tmp.XXXX"  # an empty file (mktemp's) holds nothing to lose: written without --force
    empty.write_bytes(b"")
    main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(empty)])
    assert empty.read_text(encoding="utf-8") == taken.read_text(encoding="utf-8")


def test_cli_writes_into_a_fifo_in_this_process_without_force(checkpoint: Path, translator: Translator,
                                                                tmp_path: Path):
    """Streaming into a FIFO (a pipe to another program) is no replacing: it needs no --force, and is never emptied."""
    (tmp_path / "in.de").write_text(f"{SENTENCES[0]}\n{SENTENCES[1]}\n", encoding="utf-8")
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got = output_checks.read_while(fifo, lambda: main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(fifo)]))
    assert len(got) == 1 and got[0].splitlines() == translator.translate(SENTENCES[:2])
    assert fifo.is_fifo()


def test_cli_refuses_a_missing_folder_and_a_folder_in_one_line(tmp_path: Path):
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    output = tmp_path / "new" / "out.en"
    message = refused("--input", str(tmp_path / "in.de"), "--output", str(output), "--force")
    assert message == f"error: --output {output}: the folder {output.parent} does not exist; create it first"
    assert not output.parent.exists()
    message = refused("--input", str(tmp_path / "in.de"), "--output", str(tmp_path), "--force")
    assert message == (f"error: --output {tmp_path} is a folder; name the file to write, e.g. "
                       f"{tmp_path / 'translations.txt'}")


@pytest.mark.parametrize("option", ["--input", "--ref", "--checkpoint"])
def test_cli_refuses_an_input_as_output_even_with_force(option: str, checkpoint: Path, tmp_path: Path):
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("A dog.\n", encoding="utf-8")
    shutil.copy(checkpoint, tmp_path / "model.ckpt")
    paths = {"--input": tmp_path / "in.de", "--ref": tmp_path / "ref.en", "--checkpoint": tmp_path / "model.ckpt"}
    before = {path: path.read_bytes() for path in paths.values()}
    what = "the input file" if option == "--input" else f"the {option} file"
    with pytest.raises(SystemExit) as caught:
        main([*(x for flag, path in paths.items() for x in (flag, str(path))), "--output", str(paths[option]), "--force"])
    assert str(caught.value.code) == f"error: --output {paths[option]} is {what} {paths[option]}: it would be overwritten"
    assert {path: path.read_bytes() for path in paths.values()} == before


def test_a_translating_process_imports_only_what_translating_needs():
    """Start-up is most of a short command's time (docs/results/decoding-vs-ctranslate2.md#whole-command): the
    translate command loads and checks a checkpoint without importing torch._dynamo (nothing compiles), the HTML and
    SubRip parsers (no document) or sacreBLEU (no --ref). Checked by what a fresh process has imported, not by time."""
    code = ("import sys\n"
            "from seq2seq.checkpoint import load_checkpoint, read_inference\n"
            "import seq2seq.translate\n"
            f"read_inference({str(REPO / 'tests/data/format3.ckpt')!r}, load_checkpoint({str(REPO / 'tests/data/format3.ckpt')!r}))\n"
            "print(' '.join(name for name in ('torch._dynamo', 'seq2seq.text.markup', 'seq2seq.text.subtitles', 'sacrebleu')"
            " if name in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"imported at start-up: {result.stdout.strip()}"


def test_with_nothing_kept_the_command_says_it_decodes_eager_and_how_to_compile_once(checkpoint: Path, tmp_path: Path,
                                                                                   capsys: pytest.CaptureFixture[str]):
    """--compile auto (the default) with no compiled decoder kept for the model here: a line says the decoding is
    eager and names the command that builds it (never silently slow); --compile off says nothing of it."""
    (tmp_path / "in.de").write_text(SENTENCES[0] + "\n", encoding="utf-8")
    command = ["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(tmp_path / "out"),
               "--force", "--precision", "fp32"]
    main(command)
    note = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert note == [f"note: decoding eager: no compiled decoder is kept for this model here (fp32, decoder threads of 1 "
                    f"intra-op thread); `python -m seq2seq.export --checkpoint {checkpoint} --to compiled --precision "
                    f"fp32` builds it once (minutes), or run with --compile (docs/performance/compiled-decoding.md#kept)"]
    main([*command, "--compile", "off"])
    assert "note: " not in capsys.readouterr().err
