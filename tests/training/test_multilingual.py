"""A multilingual run end to end: several directions of Multi30k (4-way parallel) in one data config, a tag for
each target language in the tokenizer, batches mixing directions in their temperature shares, validation per
direction, a checkpoint that names its directions, and a Translator that translates into the language asked for."""

import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import _multi30k_lines
from multilingual import DIRECTIONS, write_data

from seq2seq.checkpoint import CheckpointError, inference_entry, load_checkpoint, read_inference
from seq2seq.inference.translator import Translator
from seq2seq.text.tokenizer import Tokenizer
from seq2seq.training.data import TranslationDataModule
from seq2seq.training.directions import Direction, sampling_shares


def test_the_checkpoint_names_its_directions_and_its_tokenizer_has_a_tag_for_each_target(multilingual_run):
    root = multilingual_run
    loaded = read_inference(root / "checkpoints" / "best.ckpt", load_checkpoint(root / "checkpoints" / "best.ckpt"))
    assert loaded.directions == tuple(DIRECTIONS)
    assert loaded.search.beam_size == 2  # TuneLengthPenalty tuned it on every direction (their mean BLEU)
    assert Tokenizer.from_bytes(loaded.tokenizer).languages == ["de", "fr", "en"]  # in the directions' order
    hparams = torch.load(root / "checkpoints" / "best.ckpt", weights_only=True)["datamodule_hyper_parameters"]
    assert [d["src_lang"] + "-" + d["tgt_lang"] for d in hparams["directions"]] == ["en-de", "en-fr", "de-en", "fr-en"]


def test_each_direction_is_validated_and_the_run_s_bleu_is_their_mean(multilingual_run):
    root = multilingual_run
    import csv

    (metrics_file,) = root.glob("lightning_logs/version_*/metrics.csv")
    rows = [row for row in csv.DictReader(metrics_file.open(encoding="utf-8")) if row.get("val_bleu")]
    last = rows[-1]
    per_direction = [float(last[f"val_bleu/{src}-{tgt}"]) for src, tgt in DIRECTIONS]
    assert float(last["val_bleu"]) == pytest.approx(sum(per_direction) / len(per_direction), abs=1e-3)


@pytest.fixture(scope="module")
def translator(multilingual_run) -> Translator:
    return Translator.from_checkpoint(multilingual_run / "checkpoints" / "best.ckpt", precision="fp32")


def test_each_target_s_tag_steers_the_output_language(translator: Translator):
    """The English validation captions translated into German and into French: a language identifier (lingua,
    the server's) reads most outputs as the language asked for; the model is small and briefly trained, so a
    few outputs may be too short or mixed to read."""
    from seq2seq.serve.languages import Detector

    detector = Detector({"de", "fr", "en"})
    sources = _multi30k_lines("val", "en", 40)[20:40]  # (lines it validated on, not trained on)
    assert translator.targets == ["de", "fr", "en"] and translator.tgt_lang == ""
    for tgt in ("de", "fr"):
        outputs = translator.translate(sources, tgt_lang=tgt)
        detected = [detector.detect(text, among=["de", "fr", "en"])[0] if text.strip() else None for text in outputs]
        assert sum(lang == tgt for lang in detected) >= 0.8 * len(sources), (tgt, list(zip(outputs, detected, strict=True)))


def test_a_multilingual_model_asks_for_its_target_and_refuses_one_it_lacks(translator: Translator):
    with pytest.raises(ValueError, match="this model translates into de, fr, en: choose the target language"):
        translator.translate(["Ein Mann."])
    with pytest.raises(ValueError, match="cannot translate into 'cs': this model translates into de, fr, en"):
        translator.translate(["A man."], tgt_lang="cs")
    french = translator.for_target("fr")
    assert french.tgt_lang == "fr" and translator.tgt_lang == "" and french.model is translator.model
    tag = translator.tokenizer.tag_id("fr")
    inputs = french.prepare_inputs(["A man.", ""])
    assert inputs.ids[0][0] == tag and inputs.ids[1] == []  # an empty line stays empty: no tag alone
    [scored] = french.score(["A man."], ["Un homme."])
    assert scored is not None


def test_a_decoder_side_tag_is_forced_first_and_no_output_shows_it(translator: Translator):
    """The same weights read as a model whose tags go on the decoder side: its sources carry no tag, every
    translation is forced to start with the target's tag, and the tag is dropped from what comes out (tokens,
    token scores, alignments, scores of a given target)."""
    from seq2seq.decoding.config import SearchConfig
    from seq2seq.decoding.scoring import force_decode
    from seq2seq.decoding.search import decode

    decoder_side = Translator(model=translator.model, tokenizer=translator.tokenizer, directions=translator.directions,
                              target_tag="decoder", precision="fp32").for_target("fr")
    tokenizer, tag = decoder_side.tokenizer, decoder_side.tokenizer.tag_id("fr")
    search = SearchConfig(beam_size=1, max_len_b=12, token_scores=True, alignments=True)
    inputs = decoder_side.prepare_inputs(["A man is sleeping.", ""], search, prefixes=["Un", ""])
    assert tag not in inputs.ids[0] and inputs.ids[1] == []
    assert inputs.forced == [[tag, *tokenizer.encode_target(["Un"])[0]], [tag]]
    assert inputs.forced_steps == 1  # charged and searched beside the output limit
    [[ours]] = decoder_side.translate_nbest(["A man is sleeping."], search)
    [[raw]] = decode(decoder_side.model, torch.tensor([inputs.ids[0]]), search, bos=tokenizer.bos_id,
                     eos=tokenizer.eos_id, pad=tokenizer.pad_id, prefix=[[tag]])
    assert raw.tokens[0] == tag and ours.tokens == raw.tokens[1:]
    assert ours.token_scores == raw.token_log_probs[1:] and len(ours.token_scores) == len(ours.tokens) + 1
    assert ours.text == tokenizer.decode([raw.tokens])[0]
    [scored] = decoder_side.score(["A man."], ["Un homme."])
    target = tokenizer.encode_target(["Un homme."])[0]
    src = torch.tensor([tokenizer.encode_source(["A man."])[0]])
    with torch.inference_mode():
        [whole] = force_decode(decoder_side.model, decoder_side.model.encode(src), src != tokenizer.pad_id,
                               [[tag, *target]], bos=tokenizer.bos_id, eos=tokenizer.eos_id, pad=tokenizer.pad_id)
    assert scored is not None and scored.token_log_probs == pytest.approx(whole.token_log_probs[1:])


def test_directions_are_reported_tagged_and_mixed_in_their_temperature_shares(tmp_path, caplog):
    """Each direction's pairs counted, its sources after its target's tag, an epoch drawing the small direction
    far above its share of the pairs (temperature 5), batches holding several directions, and validation rows
    of every direction, each with its direction."""
    files = write_data(tmp_path, train_pairs=1000, val_pairs=10)
    small = [str(tmp_path / f"small.{lang}") for lang in ("en", "fr")]
    for lang, path in zip(("en", "fr"), small, strict=True):  # en-fr: 100 pairs beside en-de's 1,000
        lines = files[f"train.{lang}"].read_text(encoding="utf-8").splitlines()
        Path(path).write_text("\n".join(lines[:100]) + "\n", encoding="utf-8")
    data = TranslationDataModule(tokenizer_path=str(tmp_path / "spm.model"), vocab_size=600, temperature=5.0,
                                 max_tokens=512, cache_dir=str(tmp_path / "cache"), directions=[
        Direction(src_lang="en", tgt_lang="de", train_files=[str(files["train.en"]), str(files["train.de"])],
                  valid_files=[str(files["val.en"]), str(files["val.de"])]),
        Direction(src_lang="en", tgt_lang="fr", train_files=small,
                  valid_files=[str(files["val.en"]), str(files["val.fr"])])])
    with caplog.at_level(logging.INFO, logger="seq2seq.training"):
        data.setup("fit")
    assert "train en-de: 1000 pairs read" in caplog.text and "train en-fr: 100 pairs read" in caplog.text
    assert "train: an epoch draws 1100 pairs at temperature 5: en-de 1000 pairs, 61.3%; en-fr 100 pairs, 38.7%" in caplog.text
    tokenizer = data.tokenizer
    assert tokenizer.languages == ["de", "fr"]
    train = data.datasets["train"]
    tags = [ids[0] for ids in train["src_ids"]]
    assert tags == [tokenizer.tag_id("de")] * 1000 + [tokenizer.tag_id("fr")] * 100
    assert list(data.groups["train"]) == [0] * 1000 + [1] * 100
    batches = list(data.train_dataloader().batch_sampler)
    drawn = Counter(int(data.groups["train"][i]) for batch in batches for i in batch)
    shares = sampling_shares([1000, 100], weights=[1, 1], temperature=5.0)
    assert drawn == {0: 1100 - round(1100 * shares[1]), 1: round(1100 * shares[1])}  # (en-fr's 100 drawn ~4 times)
    assert sum(len({int(data.groups["train"][i]) for i in batch}) > 1 for batch in batches) > len(batches) / 2
    directions = torch.cat([batch["direction"] for batch in data.val_dataloader()]).tolist()
    assert sorted(directions) == [0] * 10 + [1] * 10


def test_with_target_tag_decoder_every_target_starts_with_its_tag_and_no_source_does(tmp_path):
    files = write_data(tmp_path, train_pairs=200, val_pairs=5)
    data = TranslationDataModule(tokenizer_path=str(tmp_path / "spm.model"), vocab_size=600, target_tag="decoder",
                                 max_tokens=512, cache_dir=str(tmp_path / "cache"), directions=[
        Direction(src_lang="en", tgt_lang=tgt, train_files=[str(files["train.en"]), str(files[f"train.{tgt}"])],
                  valid_files=[str(files["val.en"]), str(files[f"val.{tgt}"])]) for tgt in ("de", "fr")])
    data.setup("fit")
    tokenizer = data.tokenizer
    tags = {tokenizer.tag_id("de"), tokenizer.tag_id("fr")}
    for split, count in (("train", 200), ("valid", 5)):
        rows = data.datasets[split]
        assert [ids[0] for ids in rows["tgt_ids"]] == [tokenizer.tag_id("de")] * count + [tokenizer.tag_id("fr")] * count
        assert not any(ids[0] in tags for ids in rows["src_ids"])
    batch = next(iter(data.train_dataloader()))
    assert set(batch["tgt_out"][:, 0].tolist()) <= tags  # the decoder learns to write the tag after BOS


def test_the_data_module_refuses_directions_beside_a_pair_and_names_what_is_wrong(tmp_path):
    from seq2seq.training.corpus import DataError

    direction = Direction(src_lang="de", tgt_lang="en", train_files=["a.de", "a.en"])
    for kwargs, message in [
        (dict(directions=[direction], src_lang="de"), "data.directions is given, and so is data.src_lang"),
        (dict(directions=[direction], train_files=["x", "y"]), "and so is data.train_files"),
        (dict(directions=[direction, direction]), "data.directions: direction de-en is listed twice"),
        (dict(directions=[direction], temperature=0), "data.directions: temperature must be a positive number"),
        (dict(directions=[direction], target_tag="middle"), "data.target_tag is 'middle'; give one of encoder, decoder"),
        (dict(src_lang="de", tgt_lang="en", target_tag="decoder"), "data.target_tag is for data.directions"),
        (dict(), "data.src_lang and data.tgt_lang are missing"),
    ]:
        with pytest.raises(DataError, match=message):
            TranslationDataModule(tokenizer_path=str(tmp_path / "spm.model"), **kwargs)


def test_a_tokenizer_without_a_target_s_tag_is_refused_in_one_line(tmp_path):
    from seq2seq.training.corpus import DataError

    files = write_data(tmp_path, train_pairs=300, val_pairs=5)
    texts = [line for path in files.values() for line in path.read_text(encoding="utf-8").splitlines()]
    Tokenizer.train(texts, vocab_size=600, languages=["de"]).save(tmp_path / "spm.model")
    data = TranslationDataModule(tokenizer_path=str(tmp_path / "spm.model"), directions=[
        Direction(src_lang="en", tgt_lang="de", train_files=[str(files["train.en"]), str(files["train.de"])]),
        Direction(src_lang="en", tgt_lang="fr", train_files=[str(files["train.en"]), str(files["train.fr"])])])
    with pytest.raises(DataError, match=r"spm.model has no language tag for fr, which data.directions translate into"):
        data.load_tokenizer()
    (tmp_path / "spm.model").unlink()
    with pytest.raises(DataError, match="no test data: no entry of data.directions has test_files or hf_name"):
        data.setup("test")


def test_directions_a_checkpoint_cannot_hold_are_refused_as_damage(multilingual_run, tmp_path):
    root = multilingual_run
    checkpoint = load_checkpoint(root / "checkpoints" / "best.ckpt")
    loaded = read_inference(root / "checkpoints" / "best.ckpt", checkpoint)
    # (checksummed as written: a file that says so consistently, as a writer's mistake would)
    checkpoint["seq2seq"] = inference_entry(state_dict=checkpoint["state_dict"], config=loaded.config,
                                            tokenizer=loaded.tokenizer, src_lang="", tgt_lang="",
                                            directions=[("en", "cs")])  # (cs has no tag in its tokenizer)
    with pytest.raises(CheckpointError, match="its directions translate into cs, which its tokenizer has no tag"):
        read_inference(tmp_path / "x.ckpt", checkpoint)
    checkpoint["seq2seq"]["directions"] = [["en"]]
    with pytest.raises(CheckpointError, match="'directions' is not a list of distinct"):
        read_inference(tmp_path / "x.ckpt", checkpoint)
    checkpoint["seq2seq"]["directions"] = [["en", "de"]]  # (well formed, but not what was checksummed)
    with pytest.raises(CheckpointError, match="is damaged: its weights or tokenizer do not match the checksum"):
        read_inference(tmp_path / "x.ckpt", checkpoint)
    checkpoint["seq2seq"] = inference_entry(state_dict=checkpoint["state_dict"], config=loaded.config,
                                            tokenizer=loaded.tokenizer, src_lang="", tgt_lang="",
                                            directions=loaded.directions, target_tag="decoder")
    assert read_inference(tmp_path / "x.ckpt", checkpoint).target_tag == "decoder"
    assert checkpoint["seq2seq"]["sha256"] != loaded.checksum  # (where the tags go is checksummed)
    for tag in ("middle", None):
        checkpoint["seq2seq"]["target_tag"] = tag
        with pytest.raises(CheckpointError, match="'target_tag' is .*, not one of encoder, decoder"):
            read_inference(tmp_path / "x.ckpt", checkpoint)


def test_the_translate_command_takes_the_target_language_and_asks_for_one(multilingual_run, tmp_path, capsys):
    from seq2seq.translate import main as translate

    checkpoint = str(multilingual_run / "checkpoints" / "best.ckpt")
    (tmp_path / "in.en").write_text("A man is sleeping.\n\nTwo dogs run.\n", encoding="utf-8")
    translate(["--checkpoint", checkpoint, "--input", str(tmp_path / "in.en"), "--output", str(tmp_path / "out.fr"),
               "--tgt-lang", "fr", "--beam", "2", "--precision", "fp32"])
    lines = (tmp_path / "out.fr").read_text(encoding="utf-8").split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[0] and lines[2]  # three lines in, three out
    for flags, message in [([], "error: --tgt-lang: this model translates into de, fr, en: choose the target language"),
                           (["--tgt-lang", "cs"], "error: --tgt-lang: cannot translate into 'cs'")]:
        with pytest.raises(SystemExit) as stopped:
            translate(["--checkpoint", checkpoint, "--input", str(tmp_path / "in.en"), "--output",
                       str(tmp_path / "other"), *flags])
        assert str(stopped.value).startswith(message)
    assert not (tmp_path / "other").exists()


def test_the_score_command_scores_one_direction_a_run(multilingual_run, translator: Translator, tmp_path, capsys):
    from seq2seq.score import main as score

    checkpoint = str(multilingual_run / "checkpoints" / "best.ckpt")
    (tmp_path / "src").write_text("A man is sleeping.\nTwo dogs run.\n", encoding="utf-8")
    (tmp_path / "tgt").write_text("Un homme dort.\nDeux chiens courent.\n", encoding="utf-8")
    score(["--checkpoint", checkpoint, "--src", str(tmp_path / "src"), "--tgt", str(tmp_path / "tgt"), "--output",
           str(tmp_path / "scores"), "--tgt-lang", "fr", "--precision", "fp32"])
    lines = (tmp_path / "scores").read_text(encoding="utf-8").splitlines()
    expected = translator.for_target("fr").score(["A man is sleeping.", "Two dogs run."],
                                                 ["Un homme dort.", "Deux chiens courent."])
    assert [float(line.split("\t")[0]) for line in lines] == pytest.approx([f.log_prob for f in expected], abs=1e-3)
    with pytest.raises(SystemExit, match="error: --tgt-lang: this model translates into de, fr, en: choose"):
        score(["--checkpoint", checkpoint, "--src", str(tmp_path / "src"), "--tgt", str(tmp_path / "tgt"),
               "--output", str(tmp_path / "other")])
    assert not (tmp_path / "other").exists()


def test_fine_tuning_a_multilingual_model_keeps_its_tag_side_and_says_what_changes(multilingual_run, caplog):
    from types import SimpleNamespace

    from seq2seq.model import ConfigError
    from seq2seq.training.fit import check_fine_tuning_data

    init_from = str(multilingual_run / "checkpoints" / "best.ckpt")
    same = [{"src_lang": src, "tgt_lang": tgt} for src, tgt in DIRECTIONS]
    check_fine_tuning_data(SimpleNamespace(src_lang=None, tgt_lang=None, directions=same, target_tag="encoder",
                                           vocab_size=8000), init_from=init_from, given_fields=[])
    with pytest.raises(ConfigError, match="data.target_tag: is decoder, but model.init_from .* was trained with its "
                                          "tags on the encoder side; give encoder"):
        check_fine_tuning_data(SimpleNamespace(src_lang=None, tgt_lang=None, directions=same, target_tag="decoder",
                                               vocab_size=8000), init_from=init_from, given_fields=[])
    with caplog.at_level(logging.WARNING, logger="seq2seq.training"):
        check_fine_tuning_data(SimpleNamespace(src_lang="de", tgt_lang="en", directions=None, target_tag="encoder",
                                               vocab_size=8000), init_from=init_from, given_fields=[])
    assert ("translates en→de, en→fr, de→en, fr→en; this run's data is de→en, which the fine-tuned checkpoint will "
            "say (a bilingual model: its sources without tags)") in caplog.text
