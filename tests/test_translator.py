"""Tests for seq2seq.translator, the translate CLI and serve/translate.py.

Two models: the checkpoint of the short training run (`tiny_run`), loaded as a user would, and a
randomly initialised Transformer with the run's tokenizer. Twelve training steps teach little
beyond "A" and "t t t", and a random model rarely ends a sentence, so the random one gets a
larger EOS embedding (tied to the output projection) to end some hypotheses early: between them
the outputs vary in length and content. Where results must match to the last token the models run
in float64, so that padding a sentence among others cannot flip a near-tie.
"""

import io
import os
import random
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seq2seq.model import Transformer, TransformerConfig
from seq2seq.search import beam_search, greedy
from seq2seq.tokenizer import BOS_ID, EOS_ID, PAD_ID
from seq2seq.translate import format_nbest, main, one_line, read_lines
from seq2seq.translator import (
    Translation,
    Translator,
    length_sorted_batches,
    load_checkpoint,
    pad_batch,
)

REPO = Path(__file__).resolve().parents[1]
IDS = {"bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID}

SENTENCES = [
    "Ein Hund läuft über die Wiese.",
    "Zwei Männer spielen Fußball im Park.",
    "Eine Frau mit einem roten Hut sitzt auf einer Bank und liest ein Buch.",
    "Kinder.",
    "Ein Mann fährt Fahrrad auf einer Straße in der Stadt, während es regnet.",
    "Eine Gruppe von Menschen steht vor einem Gebäude.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a small, busy machine two threads spinning on tiny matrices are ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(one_thread, request: pytest.FixtureRequest) -> Path:
    # Asked for here, not as an argument (pytest would build the session fixture before one_thread):
    # when this module is the first to need the training run, it trains with one thread, ~1 s
    # instead of ~40 s on a busy two-core machine.
    _, checkpoints = request.getfixturevalue("tiny_run")
    return checkpoints / "best.ckpt"


@pytest.fixture(scope="module")
def translator(checkpoint: Path) -> Translator:
    return Translator.from_checkpoint(checkpoint)


def float64(translator: Translator) -> Translator:
    return Translator(model=translator.model.double(), tokenizer=translator.tokenizer)


@pytest.fixture(scope="module")
def trained64(checkpoint: Path) -> Translator:
    return float64(Translator.from_checkpoint(checkpoint))


@pytest.fixture(scope="module")
def random64(translator: Translator) -> Translator:
    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=translator.tokenizer.vocab_size, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=2,
        num_decoder_layers=2, dropout=0.0, max_positions=128, norm_placement="pre",
    )
    model = Transformer(config)
    with torch.no_grad():
        model.decoder.embed.tokens.weight[EOS_ID] *= 4  # EOS logits spread 4x wider: some win early
    return float64(Translator(model=model, tokenizer=translator.tokenizer))


@pytest.fixture(params=["trained", "random"])
def model64(request) -> Translator:
    return request.getfixturevalue(f"{request.param}64")


def python_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


# ---------------------------------------------------------------------------------------------
# Loading.


def test_checkpoint_alone_loads_with_weights_only(checkpoint: Path, tmp_path: Path):
    alone = tmp_path / "model.ckpt"  # nothing else in the folder: no tokenizer file, no config
    shutil.copy(checkpoint, alone)
    loaded = Translator.from_checkpoint(alone)
    assert (loaded.src_lang, loaded.tgt_lang) == ("de", "en")
    assert loaded.model.config.d_model == 32 and loaded.tokenizer.vocab_size == 600
    assert not loaded.model.training
    weights = torch.load(checkpoint, weights_only=True)["state_dict"]
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, weights[f"model.{name}"]), name
    (text,) = loaded.translate(["Ein Hund läuft."])
    assert isinstance(text, str)


def write_not_ours(path: Path, kind: str) -> None:
    if kind == "other_dict":  # e.g. another project's Lightning checkpoint
        torch.save({"state_dict": {"layer.weight": torch.zeros(2)}, "epoch": 3}, path)
    elif kind == "tensor":
        torch.save(torch.zeros(3), path)
    elif kind == "pickled_module":  # needs arbitrary unpickling: weights_only refuses it
        torch.save(torch.nn.Linear(2, 2), path)
    elif kind == "text":
        path.write_text("hello\n", encoding="utf-8")


@pytest.mark.parametrize("kind", ["other_dict", "tensor", "pickled_module", "text"])
def test_load_checkpoint_rejects_files_that_are_not_ours(kind: str, tmp_path: Path):
    path = tmp_path / f"{kind}.ckpt"
    write_not_ours(path, kind)
    with pytest.raises(ValueError, match=r"is not a seq2seq training checkpoint; use a \.ckpt written by"):
        load_checkpoint(path)


def test_load_checkpoint_missing_folder_and_newer_format(checkpoint: Path, tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt does not exist; training writes them under"):
        load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(IsADirectoryError, match="is a folder; give a .ckpt file in it"):
        load_checkpoint(tmp_path)
    newer = torch.load(checkpoint, weights_only=True)
    newer["seq2seq"]["format"] = 99
    torch.save(newer, tmp_path / "newer.ckpt")
    with pytest.raises(ValueError, match="has checkpoint format 99; this version of seq2seq reads format 1"):
        load_checkpoint(tmp_path / "newer.ckpt")


# ---------------------------------------------------------------------------------------------
# Translating: batches, odd lines, the search paths.


def test_batch_equals_one_by_one(model64: Translator):
    """Padding, length-sorted batching and dropping finished sentences must not change any result."""
    texts = ["", *SENTENCES, "   ", SENTENCES[0]]
    batched = model64.translate_nbest(texts, beam_size=4, nbest=2, max_tokens=80)  # 3 batches, out of order
    alone = [model64.translate_nbest([text], beam_size=4, nbest=2) for text in texts]
    assert len(batched) == len(texts)
    for together, (by_itself,) in zip(batched, alone, strict=True):
        assert [h.tokens for h in together] == [h.tokens for h in by_itself]
        assert [h.text for h in together] == [h.text for h in by_itself]
        assert [h.score for h in together] == pytest.approx([h.score for h in by_itself], abs=1e-5)
    lengths = {len(hyps[0].tokens) for hyps in batched if hyps}
    assert len(lengths) >= 3  # the outputs differ, so a mix-up between rows would show
    assert batched[0] == batched[-2] == [] and batched[1] == batched[-1]


def test_n_lines_in_n_lines_out_with_empty_and_too_long_lines(trained64: Translator):
    translator = trained64
    limit = translator.model.config.max_positions
    long_line = " ".join(SENTENCES * 4)
    long_ids = translator.tokenizer.encode([long_line])[0]
    assert len(long_ids) > limit
    texts = [SENTENCES[0], "", "  \t ", long_line, SENTENCES[1], ""]
    with pytest.warns(UserWarning, match=rf"input line 4 has {len(long_ids)} tokens, .*max_positions \({limit}\)"):
        out = translator.translate(texts)
    assert len(out) == len(texts)
    assert out[1] == out[2] == out[5] == ""
    assert out[0] == translator.translate([SENTENCES[0]])[0] and out[4] == translator.translate([SENTENCES[1]])[0]
    # The long line is translated as its first max_positions tokens.
    truncated = translator.tokenizer.decode([long_ids[:limit]])[0]
    assert translator.tokenizer.encode([truncated])[0] == long_ids[:limit]
    assert out[3] == translator.translate([truncated])[0]
    assert translator.translate([]) == []


def test_beam_size_1_is_greedy_search(model64: Translator):
    ids = model64.tokenizer.encode(SENTENCES)
    src = pad_batch(ids, device=torch.device("cpu"))
    expected = greedy(model64.model, src, **IDS)
    got = model64.translate_nbest(SENTENCES, beam_size=1, max_tokens=50)
    assert [hyps[0].tokens for hyps in got] == [h.tokens for h in expected]
    assert [hyps[0].score for hyps in got] == pytest.approx([h.log_prob for h in expected], abs=1e-6)
    # ... and a beam of one ranked by raw log-probability finds the same (joeynmt's test).
    beam_one = beam_search(model64.model, src, beam_size=1, length_penalty=0.0, **IDS)
    assert [hyps[0].tokens for hyps in beam_one] == [h.tokens for h in expected]


def test_nbest_is_sorted_and_its_first_is_the_translation(model64: Translator):
    nbest = model64.translate_nbest(SENTENCES, beam_size=5, nbest=5)
    best = model64.translate(SENTENCES, beam_size=5)
    for hyps, text in zip(nbest, best, strict=True):
        assert len(hyps) == 5
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 5  # five different hypotheses
        assert hyps[0].text == text


def test_sampling_with_a_seed_is_reproducible(model64: Translator):
    def draw(seed: int, **options) -> list[list[int]]:
        return [hyps[0].tokens for hyps in model64.translate_nbest(SENTENCES, sampling=True, seed=seed, **options)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    greedy_tokens = [hyps[0].tokens for hyps in model64.translate_nbest(SENTENCES, beam_size=1)]
    assert draw(3, top_k=1) == greedy_tokens  # only the argmax left to draw


@pytest.mark.parametrize(
    "options, message",
    [
        ({"beam_size": 2, "nbest": 3}, r"nbest \(3\) must be between 1 and beam_size \(2\)"),
        ({"beam_size": 0}, r"nbest \(1\) must be between 1 and beam_size \(0\)"),
        ({"sampling": True, "nbest": 2}, "sampling draws one translation per line"),
        ({"sampling": True, "temperature": 0.0}, "temperature must be > 0"),
    ],
)
def test_bad_search_options_fail_even_without_a_sentence_to_translate(translator: Translator, options, message):
    with pytest.raises(ValueError, match=message):
        translator.translate_nbest(["", " "], **options)


def test_length_sorted_batches_respect_the_budget_and_cover_every_sentence_once():
    rng = random.Random(0)
    ids = [[5] * rng.choice([0, 0, 1, 2, 3, 7, 15, 40, 90]) for _ in range(300)]
    non_empty = {i for i, sentence in enumerate(ids) if sentence}
    for max_tokens in (1, 50, 64, 100, 1000, 10**6):
        batches = length_sorted_batches(ids, max_tokens=max_tokens)
        flat = [i for batch in batches for i in batch]
        assert sorted(flat) == sorted(non_empty)  # each non-empty sentence exactly once
        lengths = [len(ids[i]) for i in flat]
        assert lengths == sorted(lengths, reverse=True)  # longest first
        for batch in batches:
            padded = len(batch) * max(len(ids[i]) for i in batch)
            assert padded <= max_tokens or len(batch) == 1  # a sentence over budget goes alone
    assert length_sorted_batches([[], []], max_tokens=10) == []
    src = pad_batch([[5, 6, 7], [8]], device=torch.device("cpu"))
    assert src.tolist() == [[5, 6, 7], [8, PAD_ID, PAD_ID]]


# ---------------------------------------------------------------------------------------------
# python -m seq2seq.translate


def test_read_lines_splits_at_newlines_only(tmp_path: Path):
    # str.splitlines would split the first line at U+2028 and U+0085: one more output line than input.
    path = tmp_path / "in.txt"
    path.write_bytes("Ein\u2028Hund\x85.\r\n\nzwei\x0c\n".encode())
    assert read_lines(str(path)) == ["Ein\u2028Hund\x85.", "", "zwei\x0c"]
    path.write_bytes(b"")
    assert read_lines(str(path)) == []
    path.write_bytes(b"no newline at the end")
    assert read_lines(str(path)) == ["no newline at the end"]


def test_output_lines_stay_one_line_each():
    # Byte-fallback pieces can decode to a newline; it must not split a translation over two lines.
    hyps = [Translation(text="a\nb\r", score=-1.5, tokens=[4]), Translation(text="c", score=-2.0, tokens=[5])]
    assert one_line(hyps[0].text) == "a b "
    assert format_nbest(hyps, nbest=2, prefix="3\t") == ["3\t-1.5000\ta b ", "3\t-2.0000\tc"]
    assert format_nbest([], nbest=2, prefix="4\t") == ["4\t0.0000\t", "4\t0.0000\t"]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "seq2seq.translate", *args]
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
    assert lines[:-1] == translator.translate(sources, beam_size=5)
    assert lines[1] == lines[3] == ""
    assert re.search(r"^BLEU = [\d.]+ .*nrefs:1\|case:mixed\|eff:no\|tok:13a\|smooth:exp\|version:[\d.]+$",
                     result.stderr, re.MULTILINE), result.stderr
    assert re.search(r"^chrF2 = [\d.]+ .*nrefs:1\|case:mixed\|eff:yes\|nc:6\|nw:0\|space:no\|version:[\d.]+$",
                     result.stderr, re.MULTILINE), result.stderr


def test_cli_stdin_nbest(checkpoint: Path, translator: Translator):
    sources = [SENTENCES[0], "", SENTENCES[4]]
    result = run_cli("--checkpoint", str(checkpoint), "--input", "-", "--nbest", "2", "--beam", "3",
                     stdin="\n".join(sources) + "\n")
    assert result.returncode == 0, result.stderr
    rows = [re.fullmatch(r"(\d+)\t(-?\d+\.\d{4})\t(.*)", line) for line in result.stdout.splitlines()]
    assert all(rows), result.stdout
    assert [int(row[1]) for row in rows] == [0, 0, 1, 1, 2, 2]
    expected = translator.translate_nbest(sources, beam_size=3, nbest=2)
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


def test_cli_names_the_line_that_is_not_utf8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    data = "Ein Hund.\nZwei Männer.\n".encode() + b"Dr\xe4i Frauen.\n"  # latin-1 ä on line 3
    (tmp_path / "in.de").write_bytes(data)
    with pytest.raises(SystemExit, match=r"in\.de line 3 is not UTF-8; convert the file to UTF-8"):
        main(["--checkpoint", "unused.ckpt", "--input", str(tmp_path / "in.de")])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    with pytest.raises(SystemExit, match="stdin line 3 is not UTF-8"):
        main(["--checkpoint", "unused.ckpt"])


def test_cli_explains_bad_checkpoints_and_options(tmp_path: Path, capsys: pytest.CaptureFixture):
    (tmp_path / "in.de").write_text("a\n", encoding="utf-8")
    write_not_ours(tmp_path / "other.ckpt", "other_dict")
    with pytest.raises(SystemExit, match=r"^error: .*other\.ckpt is not a seq2seq training checkpoint"):
        main(["--checkpoint", str(tmp_path / "other.ckpt"), "--input", str(tmp_path / "in.de")])
    with pytest.raises(SystemExit, match="error: .*missing.ckpt does not exist"):
        main(["--checkpoint", str(tmp_path / "missing.ckpt"), "--input", str(tmp_path / "in.de")])
    with pytest.raises(SystemExit):
        main(["--checkpoint", "x.ckpt", "--beam", "2", "--nbest", "3"])
    assert r"--nbest (3) must be between 1 and --beam (2)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# serve/translate.py, driven through a pipe.


def serve(checkpoint: Path, *args: str) -> subprocess.Popen:
    command = [sys.executable, str(REPO / "serve/translate.py"), "--checkpoint", str(checkpoint), *args]
    return subprocess.Popen(command, cwd=REPO, env=python_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def read_line(process: subprocess.Popen, *, timeout: float = 60) -> str:
    """One line of the server's answer; fails (instead of hanging) if it never comes, e.g. unflushed."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, "serve/translate.py did not answer a line (not flushed?)"
    return process.stdout.readline().decode("utf-8").removesuffix("\n")


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
        expected = format_nbest(translator.translate_nbest([text], beam_size=3, nbest=2)[0], nbest=2)
        got = block.split("\n")
        assert [line.split("\t")[1] for line in got] == [line.split("\t")[1] for line in expected]
        assert [float(line.split("\t")[0]) for line in got] == pytest.approx(
            [float(line.split("\t")[0]) for line in expected], abs=1e-4
        )
