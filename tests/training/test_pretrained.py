"""Fine-tuning (training/pretrained.py): the model config it takes, and `model.init_from` end to end."""

import csv
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_run

from seq2seq.model import ConfigError, TransformerConfig
from seq2seq.text.tokenizer import Tokenizer
from seq2seq.training.fit import main
from seq2seq.training.pretrained import fine_tuning_config

PRETRAINED = TransformerConfig(vocab_size=100, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
                               num_decoder_layers=2, dropout=0.3, max_positions=64, norm_placement="pre",
                               pad_id=99, output_bias=True)


def given(**values) -> TransformerConfig:
    """What a YAML with only these keys parses to: every other field at its default."""
    return TransformerConfig(vocab_size=100, **values)


def merge(**values) -> TransformerConfig:
    """fine_tuning_config as fit.py calls it: the fields a YAML with these keys sets."""
    return fine_tuning_config(PRETRAINED, given(**values), init_from="p.ckpt", given_fields=set(values))


def test_fields_the_yaml_leaves_out_are_the_pretrained_ones():
    assert merge() == PRETRAINED


def test_dropouts_and_max_positions_of_computed_positions_may_differ():
    merged = merge(dropout=0.05, attention_dropout=0.2, max_positions=256)
    assert (merged.dropout, merged.attention_dropout, merged.max_positions) == (0.05, 0.2, 256)
    assert merged.d_model == 32 and merged.pad_id == 99 and merged.output_bias


def test_a_value_given_is_heard_even_where_it_is_the_default():
    """dropout 0.1 is TransformerConfig's default: set in a YAML, it replaces the pretrained 0.3."""
    assert merge(dropout=0.1).dropout == 0.1
    with pytest.raises(ConfigError, match="norm_placement: is 'post' but model.init_from p.ckpt was trained with 'pre'"):
        merge(norm_placement="post")  # the default too, but not the pretrained model's


def test_the_modules_second_look_at_the_whole_config():
    """TranslationModule checks the merged config again with every field as given: it passes unchanged;
    a whole config of defaults is refused at its first field that is not init_from's."""
    every = [f.name for f in fields(TransformerConfig)]
    for merged in (merge(), merge(dropout=0.1, max_positions=256)):
        assert fine_tuning_config(PRETRAINED, merged, init_from="p.ckpt", given_fields=every) == merged
    with pytest.raises(ConfigError, match="d_model: is 512 but model.init_from p.ckpt was trained with 32"):
        fine_tuning_config(PRETRAINED, TransformerConfig(vocab_size=100), init_from="p.ckpt", given_fields=every)


@pytest.mark.parametrize(("values", "message"), [
    ({"d_model": 64}, "model.transformer.d_model: is 64 but model.init_from p.ckpt was trained with 32: it would "
                      "change the shape of the weight 'decoder.embed.tokens.weight' from (100, 32) to (100, 64)"),
    ({"num_decoder_layers": 3}, "model.transformer.num_decoder_layers: is 3 but model.init_from p.ckpt was trained "
                                "with 2: it would change the shape of the weight 'decoder.layers.2."),
    ({"activation": "gelu"}, "model.transformer.activation: is 'gelu' but model.init_from p.ckpt was trained with "
                             "'relu'"),
    ({"positions": "rotary"}, "would change what the pretrained weights compute (only dropout, attention_dropout, "
                              "activation_dropout, max_positions may differ)"),
])
def test_a_field_set_to_another_value_is_refused_naming_it(values: dict, message: str):
    with pytest.raises(ConfigError) as error:
        merge(**values)
    assert message in str(error.value)
    assert str(error.value).endswith("leave it out to take the pretrained model's")


def test_max_positions_of_learned_positions_is_a_shape():
    learned = TransformerConfig(vocab_size=100, d_model=32, num_heads=4, positions="learned", max_positions=64)
    with pytest.raises(ConfigError, match=r"'decoder.embed.positions.embedding.weight' from \(64, 32\) to \(128, 32\)"):
        fine_tuning_config(learned, given(positions="learned", max_positions=128), init_from="p.ckpt",
                           given_fields={"max_positions"})


def test_a_vocabulary_of_another_size_is_refused():
    with pytest.raises(ConfigError, match="vocab_size: is 50, but model.init_from p.ckpt has 100 pieces"):
        fine_tuning_config(PRETRAINED, TransformerConfig(vocab_size=50), init_from="p.ckpt", given_fields=())


# ---- end to end: python -m seq2seq.fit with model.init_from ------------------------------------------


def finetune(root: Path, pretrained: Path, *extra: str, max_steps: int = 4, vocab_size: bool = True):
    """The tiny run's YAML with model.init_from; `vocab_size=False` takes its data.vocab_size out."""
    config = write_tiny_run(root, max_steps=max_steps)
    if not vocab_size:
        config.write_text(config.read_text(encoding="utf-8").replace("  vocab_size: 600\n", ""), encoding="utf-8")
    return main(["--config", str(config), f"--model.init_from={pretrained}", *extra])


def validation_rows(root: Path) -> list[dict[str, str]]:
    rows = []
    for path in sorted(root.glob("lightning_logs/version_*/metrics.csv")):
        with path.open() as f:
            rows += [row for row in csv.DictReader(f) if row.get("val_bleu")]
    return rows


def test_fine_tuning_starts_from_the_weights_with_a_fresh_optimiser_and_schedule(tiny_run, tmp_path: Path):
    _, checkpoints = tiny_run
    pretrained = checkpoints / "best.ckpt"
    stored = torch.load(pretrained, weights_only=True)
    best_score = next(state["best_model_score"] for key, state in stored["callbacks"].items() if "ModelCheckpoint" in key)
    cli = finetune(tmp_path, pretrained, "--model.transformer.dropout=0.1")
    assert cli.model.config.dropout == 0.1 and cli.model.config.d_model == 32  # 0.1: the default, given
    assert cli.trainer.global_step == 4  # from step 0, not the pretrained run's 12
    assert cli.trainer.optimizers[0].state_dict()["state"][0]["step"].item() == 4  # fresh Adam moments
    first, *_ = validation_rows(tmp_path)
    # The first validation is the pretrained model's, before any update: the score its own run saw.
    assert float(first["val_bleu"]) == pytest.approx(float(best_score), abs=1e-6)
    assert (tmp_path / "spm.model").read_bytes() == stored["seq2seq"]["tokenizer"]  # written, not trained
    finetuned = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert finetuned["hyper_parameters"]["init_from"] == str(pretrained)
    assert finetuned["seq2seq"]["tokenizer"] == stored["seq2seq"]["tokenizer"]
    # Resuming the fine-tuning run: its command plus --ckpt_path; the step continues. The pretrained model
    # may be named otherwise (another working directory, a relative path): it is the same file.
    config = write_tiny_run(tmp_path, max_steps=6)
    with pytest.raises(SystemExit, match=r"^error: --ckpt_path last: .*last\.ckpt is of a fine-tuning run started from "
                                         r".*best\.ckpt: repeat that run's command, --model\.init_from .* included"):
        main(["--config", str(config), "--ckpt_path", "last"])
    cli = main(["--config", str(config), f"--model.init_from={pretrained.parent}/./{pretrained.name}",
                "--model.transformer.dropout=0.1", "--ckpt_path", "last"])
    assert cli.trainer.global_step == 6


def test_bad_fine_tuning_input_is_one_line(tiny_run, tmp_path: Path):
    _, checkpoints = tiny_run
    pretrained = checkpoints / "best.ckpt"
    with pytest.raises(SystemExit, match=r"^error: model\.transformer\.d_model: is 64 but model\.init_from .*best\.ckpt "
                                         r"was trained with 32: it would change the shape of the weight"):
        finetune(tmp_path / "a", pretrained, "--model.transformer.d_model=64")
    assert not (tmp_path / "a" / "spm.model").exists()  # refused before any data work
    with pytest.raises(SystemExit, match=r"^error: model\.init_from: checkpoint .*missing\.ckpt does not exist"):
        finetune(tmp_path / "b", tmp_path / "missing.ckpt")
    with pytest.raises(SystemExit, match=r"^error: model\.init_from and --ckpt_path .*last\.ckpt are both given, but "
                                         r".*last\.ckpt is not a checkpoint of a run started from"):
        finetune(tmp_path / "c", pretrained, "--ckpt_path", str(checkpoints / "last.ckpt"))
    with pytest.raises(SystemExit, match=r"^error: data\.src_lang: is en and data\.tgt_lang de, but model\.init_from "
                                         r".*best\.ckpt translates de to en: this data would train it backwards"):
        finetune(tmp_path / "e", pretrained, "--data.src_lang=en", "--data.tgt_lang=de")
    with pytest.raises(SystemExit, match=r"^error: data\.vocab_size: is 700, but the data is tokenised with "
                                         r"model\.init_from .*best\.ckpt's tokenizer, of 600 pieces"):
        finetune(tmp_path / "f", pretrained, "--data.vocab_size=700")
    other = tmp_path / "d"
    other.mkdir()
    Tokenizer.train(["ein kleiner Test", "a small test"] * 50, vocab_size=300).save(other / "spm.model")
    with pytest.raises(SystemExit, match=r"^error: data\.tokenizer_path: .*spm\.model is not the tokenizer of "
                                         r"model\.init_from .*best\.ckpt"):
        finetune(other, pretrained)


def test_an_imported_marian_model_fine_tunes(tmp_path: Path):
    """Marian's ids (eos 0, pad the last id and the decoder's start, eos after every source) through
    the data module, the fused loss with the output bias, validation and the checkpoint."""
    pytest.importorskip("transformers")
    from marian_hub import write_marian_folder

    from seq2seq.inference.translator import Translator
    from seq2seq.interop.convert import convert_huggingface

    # The tiny run's YAML sets heads and layers: the Marian model has the same (a YAML value that differs is refused)
    folder = write_marian_folder(tmp_path / "opus-mt-de-en", heads=2, layers=1, eos_logit_bias=2.0, train_lines=1000,
                                 vocab_pieces=200)
    pretrained = convert_huggingface(str(folder), tmp_path / "de-en.ckpt")
    cli = finetune(tmp_path / "run", pretrained, max_steps=6, vocab_size=False)
    assert cli.model.config.pad_id == cli.datamodule.tokenizer.pad_id == cli.model.config.vocab_size - 1
    batch = next(iter(cli.datamodule.train_dataloader()))
    pad, eos = cli.model.config.pad_id, cli.datamodule.tokenizer.eos_id
    assert (batch["tgt_in"][:, 0] == pad).all()  # the decoder starts from pad
    lengths = (batch["src"] != pad).sum(1)
    assert (batch["src"][torch.arange(len(lengths)), lengths - 1] == eos).all()  # every source ends with eos
    first, *rest = validation_rows(tmp_path / "run")
    assert rest and all(float(row["val_loss"]) < float(first["val_loss"]) for row in rest)  # it learns
    translator = Translator.from_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert len(translator.translate(["Ein Hund läuft.", ""])) == 2
