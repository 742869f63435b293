"""python -m seq2seq.score and Translator.score: the model's log-probability of given translations, against
the training loss computed on the same pairs and against CTranslate2's score_batch on the exported model;
and the translate CLI's alignment and token-score columns."""

import gzip
import os
from pathlib import Path

import output_checks
import pytest
import torch
from conftest import DEMO_DATA, sigterm_to_this_process

from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.translator import Translator
from seq2seq.score import main
from seq2seq.training.loss import label_smoothed_nll
from seq2seq.translate import main as translate


def demo_pairs(n: int) -> tuple[list[str], list[str]]:
    with gzip.open(DEMO_DATA / "test.en.gz", "rt", encoding="utf-8") as f:
        sources = f.read().split("\n")[:n]
    with gzip.open(DEMO_DATA / "test.de.gz", "rt", encoding="utf-8") as f:
        targets = f.read().split("\n")[:n]
    return sources, targets


@pytest.fixture(scope="module")
def translator(trained: Path) -> Translator:
    return Translator.from_checkpoint(trained, precision="fp32")


def test_scores_are_the_training_loss_on_the_same_pairs(translator: Translator):
    """Minus the unsmoothed NLL of TranslationModule's loss, computed on a padded batch of all the pairs."""
    sources, targets = demo_pairs(30)
    targets[3] = ""  # EOS alone
    scored = translator.score(sources, targets, max_tokens=200)  # several batches
    tok = translator.tokenizer
    src_ids, tgt_ids = tok.encode_source(sources), tok.encode_target(targets)
    width_s, width_t = max(map(len, src_ids)), max(map(len, tgt_ids)) + 1
    src = torch.full((30, width_s), tok.pad_id)
    tgt_in, tgt_out = torch.full((30, width_t), tok.pad_id), torch.full((30, width_t), tok.pad_id)
    for row, (s, t) in enumerate(zip(src_ids, tgt_ids, strict=True)):
        src[row, : len(s)] = torch.tensor(s)
        tgt_in[row, : len(t) + 1] = torch.tensor([tok.bos_id, *t])
        tgt_out[row, : len(t) + 1] = torch.tensor([*t, tok.eos_id])
    with torch.inference_mode():
        _, nll = label_smoothed_nll(translator.model(src, tgt_in), tgt_out, smoothing=0.0, pad_id=tok.pad_id)
    for row, (t, forced) in enumerate(zip(tgt_ids, scored, strict=True)):
        assert forced is not None and len(forced.token_log_probs) == len(t) + 1
        torch.testing.assert_close(torch.tensor(forced.token_log_probs), -nll[row, : len(t) + 1], rtol=1e-4, atol=1e-4)
    assert scored[3].log_prob == pytest.approx(scored[3].token_log_probs[0])


def test_scores_equal_ctranslate2s_score_batch(trained: Path, translator: Translator, tmp_path: Path):
    import ctranslate2

    from seq2seq.interop.export import export_ctranslate2

    export_ctranslate2(trained, tmp_path / "ct2")
    engine = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", compute_type="float32")
    sources, targets = demo_pairs(40)
    tok, pieces = translator.tokenizer, translator.tokenizer.pieces()
    results = engine.score_batch([[pieces[i] for i in ids] for ids in tok.encode_source(sources)],
                                 [[pieces[i] for i in ids] for ids in tok.encode_target(targets)])
    for forced, result in zip(translator.score(sources, targets), results, strict=True):
        assert forced.token_log_probs == pytest.approx(result.log_probs, abs=2e-4)


def test_a_search_reports_the_token_scores_score_gives_its_output(translator: Translator):
    sources, _ = demo_pairs(20)
    search = SearchConfig(beam_size=4, token_scores=True)
    translations = [hyps[0] for hyps in translator.translate_nbest(sources, search)]
    rescored = translator.score(sources, [t.text for t in translations])
    compared = 0
    for t, forced in zip(translations, rescored, strict=True):
        if translator.tokenizer.encode_target([t.text])[0] == t.tokens:  # the text encodes back to its tokens
            assert forced.token_log_probs == pytest.approx(t.token_scores, abs=1e-4)
            compared += 1
    assert compared >= 15


def test_the_cli_writes_one_line_per_pair(trained: Path, translator: Translator, tmp_path: Path):
    sources, targets = demo_pairs(12)
    sources[5] = ""  # nothing to score against: an empty line, and a warning naming it
    (tmp_path / "src").write_text("\n".join(sources) + "\n", encoding="utf-8")
    (tmp_path / "tgt").write_text("\n".join(targets) + "\n", encoding="utf-8")
    with pytest.warns(UserWarning, match="^line 6 is not scored: its source is empty$"):
        main(["--checkpoint", str(trained), "--src", str(tmp_path / "src"), "--tgt", str(tmp_path / "tgt"),
              "--output", str(tmp_path / "out"), "--precision", "fp32"])
    lines = (tmp_path / "out").read_text(encoding="utf-8").split("\n")
    assert len(lines) == 13 and lines[-1] == "" and lines[5] == ""
    expected = translator.score(sources, targets)
    for line, forced in zip(lines[:12], expected, strict=True):
        if forced is None:
            continue
        total, tokens = line.split("\t")
        assert float(total) == pytest.approx(forced.log_prob, abs=1e-3)
        assert [float(x) for x in tokens.split(" ")] == pytest.approx(forced.token_log_probs, abs=1e-3)


@pytest.mark.parametrize(("change", "message"), [
    ({"tgt_lines": 3}, r"^error: --src .*src has 12 lines but --tgt .*tgt has 3; they must be line-aligned$"),
    ({"tgt": "missing"}, r"^error: --tgt .*missing does not exist$"),
    ({"output": "src"}, r"^error: --output .*src is the --src file"),
])
def test_bad_input_is_one_line(change: dict, message: str, trained: Path, tmp_path: Path):
    sources, targets = demo_pairs(12)
    (tmp_path / "src").write_text("\n".join(sources) + "\n", encoding="utf-8")
    (tmp_path / "tgt").write_text("\n".join(targets[: change.get("tgt_lines", 12)]) + "\n", encoding="utf-8")
    args = {"--src": str(tmp_path / "src"), "--tgt": str(tmp_path / change.get("tgt", "tgt")),
            "--output": str(tmp_path / change.get("output", "out"))}
    with pytest.raises(SystemExit, match=message):
        main(["--checkpoint", str(trained), *[x for pair in args.items() for x in pair]])
    assert (tmp_path / "src").read_text(encoding="utf-8").startswith(sources[0])


def test_translate_writes_alignment_and_token_score_columns(trained: Path, translator: Translator, tmp_path: Path):
    sources, _ = demo_pairs(6)
    sources[2] = ""
    (tmp_path / "in").write_text("\n".join(sources) + "\n", encoding="utf-8")
    translate(["--checkpoint", str(trained), "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
               "--alignments", "--token-scores", "--precision", "fp32", "--beam", "4"])
    lines = (tmp_path / "out").read_text(encoding="utf-8").split("\n")[:-1]
    expected = translator.translate_nbest(sources, SearchConfig(beam_size=4, alignments=True, token_scores=True))
    assert len(lines) == 6 and lines[2] == "\t\t"  # an empty line: its columns empty
    for line, hyps in zip(lines, expected, strict=True):
        if not hyps:
            continue
        text, alignment, scores = line.split("\t")
        assert text == hyps[0].text
        assert alignment == " ".join(f"{i}-{j}" for i, j in hyps[0].alignment)
        assert [float(x) for x in scores.split(" ")] == pytest.approx(hyps[0].token_scores, abs=1e-4)


@pytest.mark.parametrize(("precision", "bound"), [("bf16", 0.05), ("int8", 0.1)])
def test_scores_and_alignments_in_bf16_and_int8(trained: Path, precision: str, bound: float):
    """The forced pass in each precision auto may pick: token scores near the search's own log-probs (per
    token, as test_translator's bounds for these formats), and alignments within the words."""
    sources, _ = demo_pairs(20)
    translator = Translator.from_checkpoint(trained, precision=precision)
    assert translator.precision == precision
    search = SearchConfig(beam_size=4, length_penalty=0.0, token_scores=True, alignments=True)
    tokens = 0
    moved = 0.0
    for source, [t] in zip(sources, translator.translate_nbest(sources, search), strict=True):
        assert len(t.token_scores) == len(t.tokens) + 1
        moved += abs(sum(t.token_scores) - t.score)  # length_penalty 0: the score is the search's log-prob
        tokens += len(t.token_scores)
        assert all(0 <= i < len(source.split(" ")) and 0 <= j < len(t.text.split(" ")) for i, j in t.alignment)
    assert moved / tokens < bound, f"{precision}: {moved / tokens:.4f} a token"



@pytest.mark.parametrize(("stop", "status"), [("interrupted", 130), ("stopped by SIGTERM", 143)])
def test_ctrl_c_or_sigterm_keeps_the_scores_written_and_says_how_many(stop: str, status: int, trained: Path,
                                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]):
    """Stopped in its second window, by Ctrl-C (130) or by a real SIGTERM to this process (143, cli.stop_on_sigterm):
    the first window's scores kept whole, and one line saying how many pairs they are; stopped while the model loads,
    one line saying nothing was written (Ctrl-C there was a traceback of the loading code)."""
    sources, targets = demo_pairs(7)
    (tmp_path / "src").write_text("\n".join(sources) + "\n", encoding="utf-8")
    (tmp_path / "tgt").write_text("\n".join(targets) + "\n", encoding="utf-8")
    monkeypatch.setattr("seq2seq.score.WINDOW", 4)
    real = Translator.score
    calls: list[int] = []

    def stopping(*args, **kwargs):
        if status == 130:
            raise KeyboardInterrupt
        sigterm_to_this_process()

    def stopped_in_the_second_window(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            stopping()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Translator, "score", stopped_in_the_second_window)
    output = tmp_path / "out"
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(trained), "--src", str(tmp_path / "src"), "--tgt", str(tmp_path / "tgt"),
              "--output", str(output), "--precision", "fp32"])
    assert caught.value.code == status
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"{stop}: --output {output} holds the scores of the "
                                                                "first 4 pairs")
    assert len(output.read_text(encoding="utf-8").split("\n")) == 5  # four whole lines
    monkeypatch.setattr(Translator, "from_checkpoint", stopping)  # while the model loads
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(trained), "--src", str(tmp_path / "src"), "--tgt", str(tmp_path / "tgt"),
              "--output", str(output), "--precision", "fp32", "--force"])
    assert caught.value.code == status
    assert capsys.readouterr().err.strip() == f"{stop} before any pair was scored; --output {output} was not written"


# ---- --output: the policy every face shares (seq2seq/textio.py's check_output), checked before the model loads ----


@pytest.fixture
def pairs(tmp_path: Path) -> list[str]:
    """--src and --tgt files of 5 pairs, as arguments."""
    sources, targets = demo_pairs(5)
    (tmp_path / "src").write_text("\n".join(sources) + "\n", encoding="utf-8")
    (tmp_path / "tgt").write_text("\n".join(targets) + "\n", encoding="utf-8")
    return ["--src", str(tmp_path / "src"), "--tgt", str(tmp_path / "tgt"), "--precision", "fp32"]


def refused(*args: str) -> str:
    """(No checkpoint is needed to get there.)"""
    return output_checks.refused(lambda args: main(["--checkpoint", "unused.ckpt", *args]), *args)


def test_an_existing_file_is_replaced_only_with_force(trained: Path, pairs: list[str], tmp_path: Path):
    """An existing file was emptied and written over, whatever it held."""
    taken = tmp_path / "scores.txt"
    taken.write_text("earlier scores\n", encoding="utf-8")
    message = refused(*pairs, "--output", str(taken))
    assert message == f"error: --output {taken} exists: name a new file, or pass --force to replace it"
    assert taken.read_text(encoding="utf-8") == "earlier scores\n"
    main(["--checkpoint", str(trained), *pairs, "--output", str(taken), "--force"])
    written = taken.read_text(encoding="utf-8")
    assert len(written.splitlines()) == 5 and "earlier" not in written
    empty = tmp_path / "tmp.XXXX"  # an empty file (mktemp's) holds nothing to lose: written without --force
    empty.write_bytes(b"")
    main(["--checkpoint", str(trained), *pairs, "--output", str(empty)])
    assert empty.read_text(encoding="utf-8") == written


def test_a_fifo_is_written_into_without_force(trained: Path, pairs: list[str], tmp_path: Path):
    """Streaming into a FIFO (a pipe to another program) is no replacing: it needs no --force, and is never emptied."""
    fifo = tmp_path / "scores.fifo"
    os.mkfifo(fifo)
    got = output_checks.read_while(fifo, lambda: main(["--checkpoint", str(trained), *pairs, "--output", str(fifo)]))
    main(["--checkpoint", str(trained), *pairs, "--output", str(tmp_path / "scores.txt")])
    assert got == [(tmp_path / "scores.txt").read_text(encoding="utf-8")] and got[0].count("\n") == 5
    assert fifo.is_fifo()


def test_a_missing_folder_or_a_folder_is_refused_in_one_line(pairs: list[str], tmp_path: Path):
    output = tmp_path / "new" / "scores.txt"
    message = refused(*pairs, "--output", str(output), "--force")
    assert message == f"error: --output {output}: the folder {output.parent} does not exist; create it first"
    assert not output.parent.exists()
    message = refused(*pairs, "--output", str(tmp_path), "--force")
    assert message == f"error: --output {tmp_path} is a folder; name the file to write, e.g. {tmp_path / 'scores.txt'}"


@pytest.mark.parametrize("side", ["--src", "--tgt"])
def test_an_input_as_output_is_refused_even_with_force(side: str, pairs: list[str], tmp_path: Path):
    path = tmp_path / side[2:]
    before = path.read_bytes()
    message = refused(*pairs, "--output", str(path), "--force")
    assert message == f"error: --output {path} is the {side} file {path}: it would be overwritten"
    assert path.read_bytes() == before
