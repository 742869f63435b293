"""python -m seq2seq.convert: Hugging Face Marian (OPUS-MT) models imported, checked against transformers itself.

The models are written offline by transformers (tests/marian_hub.py): random weights, sentencepiece models
trained here on Multi30k, laid out as a Hub repository (and as the Hub cache, for the download path).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import output_checks
import pytest
import torch
from conftest import MULTI30K, shared_across_workers
from marian_hub import hub_cache_layout, read_multi30k, write_marian_folder
from near_ties import beam_near_ties, greedy_near_ties, reference_model

from seq2seq.checkpoint import load_checkpoint, read_inference
from seq2seq.convert import main
from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.translator import Translator
from seq2seq.interop.convert import ConvertError, convert_huggingface, transformer_config
from seq2seq.interop.export import export_ctranslate2, export_huggingface
from seq2seq.model import Transformer
from seq2seq.text.tokenizer import Tokenizer

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"Multi30k not found at {MULTI30K}")


@pytest.fixture(scope="module")
def marian(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An OPUS-MT-like de→en folder: output bias, shared embeddings, swish, scaled embeddings; trained
    300 steps (~12 s), so that it writes varied sentences that end."""
    # (made once for the whole run: test_convert.py's tests may run in two xdist workers)
    return shared_across_workers(tmp_path_factory, "opus-mt-de-en",
                                 lambda folder: write_marian_folder(folder / "model", train_steps=300)) / "model"


@pytest.fixture(scope="module")
def imported(marian: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_huggingface(str(marian), tmp_path_factory.mktemp("imported") / "de-en.ckpt")


def hf(folder: Path):
    from transformers import MarianMTModel, MarianTokenizer

    return MarianMTModel.from_pretrained(folder).eval(), MarianTokenizer.from_pretrained(folder)


def sentences(n: int, *, split: str = "val") -> list[tuple[str, str]]:
    return list(zip(read_multi30k("de", lines=n, split=split), read_multi30k("en", lines=n, split=split), strict=True))


def teacher_forced(model: Transformer, src: list[int], tgt_in: list[int]) -> torch.Tensor:
    """log P(each next token) of our model, (T, V), float64."""
    with torch.inference_mode():
        logits = model(torch.tensor([src]), torch.tensor([tgt_in]))[0]
    return logits.double().log_softmax(-1)


# ---- agreement with transformers -------------------------------------------------------------------


def test_the_tokenizer_encodes_and_decodes_as_marian_tokenizer(marian: Path, imported: Path):
    _, theirs = hf(marian)
    ours = Tokenizer.from_bytes(read_inference(imported, load_checkpoint(imported)).tokenizer)
    assert ours.kind == "marian" and (ours.eos_id, ours.unk_id) == (0, 1) and ours.pad_id == ours.vocab_size - 1
    assert ours.bos_id == ours.pad_id  # the decoder starts from pad
    pairs = sentences(200) + [(">>fra<< Ein Hund läuft.", "Ünïcödé ☃ never seen 漢字")]
    for de, en in pairs:
        assert ours.encode_source([de])[0] == theirs(de).input_ids  # eos appended, as Marian's sources
        target = theirs(text_target=en).input_ids
        assert ours.encode_target([en])[0] == target[:-1]  # references without eos: collate adds it
        assert ours.decode([target]) == [theirs.decode(target, skip_special_tokens=True)]
    # Any ids a model may write (pieces of either language, <unk>, <pad>), not only what encodes to them
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        ids = torch.randint(1, ours.vocab_size, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        assert ours.decode([ids]) == [theirs.decode(ids, skip_special_tokens=True)], ids
    # Text that spells a special piece stays text (MarianTokenizer would read "</s>" as the token itself)
    assert ours.eos_id not in ours.encode_source(["Ein </s> Hund"])[0][:-1]


def test_teacher_forced_log_probs_equal_transformers_in_float64(marian: Path, imported: Path):
    model_hf, tokenizer = hf(marian)
    model_hf.double()
    translator = Translator.from_checkpoint(imported, precision="fp32")
    ours = translator.model.double()
    for de, en in sentences(20):
        src = translator.tokenizer.encode_source([de])[0]
        tgt = translator.tokenizer.encode_target([en])[0] + [translator.tokenizer.eos_id]
        tgt_in = [translator.tokenizer.bos_id, *tgt[:-1]]
        with torch.inference_mode():
            theirs = model_hf(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([tgt_in])).logits[0]
        theirs = theirs.double().log_softmax(-1)
        mine = teacher_forced(ours, src, tgt_in)
        picked = torch.arange(len(tgt))
        torch.testing.assert_close(mine[picked, tgt], theirs[picked, tgt], rtol=1e-6, atol=0)
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-9)


def test_greedy_and_beam_4_equal_transformers_generate(marian: Path, imported: Path):
    """Both in float64 (so no kernel's rounding decides a near-tie), with the same settings: sum of
    log-probs (length_penalty 0, no renormalisation after pad is banned), at most 40 tokens then EOS. An
    output may differ only at a near-tie within float64's rounding that our float64 model confirms
    (tests/near_ties.py): greedy at the first token where they part, beam 4 by the whole outputs' totals.
    (Not a count of equal outputs: which ties flip is the CPU's.)"""
    model_hf, tokenizer = hf(marian)
    model_hf.double()
    translator = Translator.from_checkpoint(imported, precision="fp32")
    translator.model.double()
    texts = [de for de, _ in sentences(60)]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    ids = translator.tokenizer
    reference = reference_model(imported)
    src = ids.encode_source(texts)
    for beam_size, near_ties in ((1, greedy_near_ties), (4, beam_near_ties)):
        search = SearchConfig(beam_size=beam_size, length_penalty=0.0, max_len_a=0.0, max_len_b=40)
        ours = [hyps[0].tokens for hyps in translator.translate_nbest(texts, search)]
        with torch.inference_mode():
            generated = model_hf.generate(**batch, num_beams=beam_size, max_new_tokens=41, do_sample=False,
                                          length_penalty=0.0, early_stopping=True)
        theirs = [[i for i in row[1:].tolist() if i != tokenizer.pad_token_id] for row in generated]
        assert all(t[-1] == ids.eos_id for t in theirs if len(t) < 41)  # generate's rows end with eos
        theirs = [t[:-1] if t and t[-1] == ids.eos_id else t for t in theirs]
        problems = near_ties(reference, src, ours, theirs, precision="fp64", bos=ids.bos_id, eos=ids.eos_id)
        assert not problems, f"beam {beam_size}: " + "; ".join(problems)
        assert any(len(t) < 40 for t in theirs) and len({tuple(t) for t in theirs}) > 50  # they end, and differ


# ---- the round trip with our own export --------------------------------------------------------------


def test_our_model_exported_and_imported_is_bitwise_the_same(trained: Path, tmp_path: Path):
    export_huggingface(trained, tmp_path / "hf")
    back = convert_huggingface(str(tmp_path / "hf"), tmp_path / "back.ckpt")
    original, imported = (read_inference(p, load_checkpoint(p)) for p in (trained, back))
    assert imported.tokenizer == original.tokenizer  # our joint model again, byte for byte
    assert (imported.src_lang, imported.tgt_lang) == (original.src_lang, original.tgt_lang)
    assert sorted(imported.weights) == sorted(original.weights)
    for name, tensor in original.weights.items():
        assert torch.equal(imported.weights[name], tensor), name
    texts = [en for _, en in sentences(30, split="test_2016_flickr")]  # the model is en→de
    search = SearchConfig(beam_size=4)
    a, b = (Translator.from_checkpoint(p, precision="fp32") for p in (trained, back))
    assert a.translate(texts, search) == b.translate(texts, search)


def test_an_imported_marian_model_exported_back_is_the_original(marian: Path, imported: Path, tmp_path: Path):
    """Marian → ours → Marian: the same tensors (bitwise: a permutation and its inverse), tokenizer files and
    generate outputs."""
    from transformers import MarianMTModel

    export_huggingface(imported, tmp_path / "back")
    original, back = (MarianMTModel.from_pretrained(folder).eval() for folder in (marian, tmp_path / "back"))
    theirs, ours = original.state_dict(), back.state_dict()
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    for name in ("source.spm", "target.spm"):
        assert (tmp_path / "back" / name).read_bytes() == (marian / name).read_bytes()
    assert json.loads((tmp_path / "back" / "vocab.json").read_text()) == json.loads((marian / "vocab.json").read_text())
    _, tokenizer = hf(tmp_path / "back")
    batch = tokenizer([de for de, _ in sentences(10)], padding=True, return_tensors="pt")
    with torch.inference_mode():
        assert torch.equal(original.generate(**batch, num_beams=4), back.generate(**batch, num_beams=4))


# ---- the imported model everywhere -------------------------------------------------------------------


def test_an_imported_model_translates_exports_and_serves(marian: Path, imported: Path, tmp_path: Path):
    import ctranslate2

    translator = Translator.from_checkpoint(imported, precision="fp32")
    assert (translator.src_lang, translator.tgt_lang) == ("de", "en")
    texts = [de for de, _ in sentences(40)]
    greedy = translator.translate_nbest(texts, SearchConfig(beam_size=1, max_len_a=0, max_len_b=30))
    export_ctranslate2(imported, tmp_path / "ct2")
    ct2 = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", compute_type="float32")
    pieces = translator.tokenizer.pieces()
    tokens = [[pieces[i] for i in ids] for ids in translator.tokenizer.encode_source(texts)]
    results = ct2.translate_batch(tokens, beam_size=1, max_decoding_length=30)
    theirs = [[pieces.index(p) for p in r.hypotheses[0]] for r in results]
    assert [hyps[0].tokens for hyps in greedy] == theirs
    assert (tmp_path / "ct2" / "source.spm").read_bytes() == (marian / "source.spm").read_bytes()
    assert (tmp_path / "ct2" / "target.spm").read_bytes() == (marian / "target.spm").read_bytes()


def test_a_multi_target_model_imports_with_a_direction_per_tag(tmp_path: Path):
    """An OPUS-MT-like en→{fra, spa} model (a `>>fra<<` piece per target in vocab.json, as opus-mt-en-ROMANCE's):
    imported as a multilingual model whose sources start with their target's tag, as MarianTokenizer starts them
    from a leading `>>fra<<`, computing what MarianMTModel computes on them."""
    folder = write_marian_folder(tmp_path / "opus-mt-en-ROMANCE", source_lang="en", target_lang="fr",
                                 language_codes=("fra", "spa"), seed=3)
    checkpoint = convert_huggingface(str(folder), tmp_path / "en-mul.ckpt")
    translator = Translator.from_checkpoint(checkpoint, precision="fp32")
    assert translator.directions == (("en", "fra"), ("en", "spa")) and translator.targets == ["fra", "spa"]
    marian_model, marian_tokenizer = hf(folder)
    text, target = "A dog runs in the snow.", "Un chien court dans la neige."
    for code in ("fra", "spa"):
        chosen = translator.for_target(code)
        [ids] = chosen.prepare_inputs([text]).ids
        assert ids == marian_tokenizer(f">>{code}<< {text}").input_ids  # the tag first, the source's </s> last
        [scored] = chosen.score([text], [target])
        labels = marian_tokenizer(text_target=target).input_ids
        with torch.no_grad():
            logits = marian_model.double()(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).logits
        theirs = torch.log_softmax(logits[0], dim=-1).gather(1, torch.tensor([labels]).T)[:, 0]
        assert scored is not None and scored.token_log_probs == pytest.approx(theirs.tolist(), abs=1e-4)
    only = convert_huggingface(str(folder), tmp_path / "en-spa.ckpt", tgt_lang="spa")
    assert Translator.from_checkpoint(only, precision="fp32").directions == (("en", "spa"),)
    with pytest.raises(ConvertError, match="--tgt-lang ita has no tag in this multi-target model; its targets are fra, spa"):
        convert_huggingface(str(folder), tmp_path / "en-ita.ckpt", tgt_lang="ita")


def test_an_imported_model_through_the_cli_and_the_server(imported: Path, tmp_path: Path):
    """python -m seq2seq.translate and serve/server.py on the converted checkpoint: what Translator gives."""

    from starlette.testclient import TestClient

    from seq2seq.serve.app import create_app
    from seq2seq.translate import main as translate

    texts = [de for de, _ in sentences(8)]
    translator = Translator.from_checkpoint(imported)
    expected = translator.translate(texts)
    assert len(set(expected)) == len(texts)
    (tmp_path / "in.de").write_text("\n".join([texts[0], "", *texts[1:]]) + "\n", encoding="utf-8")
    translate(["--checkpoint", str(imported), "--input", str(tmp_path / "in.de"), "--output", str(tmp_path / "out.en")])
    assert (tmp_path / "out.en").read_text(encoding="utf-8").split("\n") == [expected[0], "", *expected[1:], ""]
    with TestClient(create_app(translator)) as client:
        assert client.get("/languages").json()[0]["code"] == "de"
        reply = client.post("/translate", json={"q": texts, "source": "de", "target": "en"})
        assert reply.status_code == 200 and reply.json()["translatedText"] == expected


# ---- the Hub ---------------------------------------------------------------------------------------------


def test_a_hub_id_is_downloaded_through_the_hub_cache(marian: Path, tmp_path: Path, monkeypatch):
    cache = tmp_path / "hub"
    hub_cache_layout(cache, "Helsinki-NLP/opus-mt-de-en", marian)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # these machines cannot reach the Hub: the cache answers
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = convert_huggingface("Helsinki-NLP/opus-mt-de-en", tmp_path / "de-en.ckpt")
    loaded = read_inference(out, load_checkpoint(out))
    assert (loaded.src_lang, loaded.tgt_lang) == ("de", "en")
    with pytest.raises(ConvertError, match="cannot download Helsinki-NLP/opus-mt-fr-en: the Hub cannot be reached"):
        convert_huggingface("Helsinki-NLP/opus-mt-fr-en", tmp_path / "fr-en.ckpt")


# ---- the configurations OPUS-MT ships, and the rest refused ---------------------------------------------


@pytest.mark.parametrize(("share", "tie", "expected"), [(True, True, "all"), (False, True, "decoder"),
                                                        (False, False, "none")])
def test_tied_and_separate_embeddings_scale_and_bin_weights_import_exactly(share: bool, tie: bool, expected: str,
                                                                            tmp_path: Path):
    folder = write_marian_folder(tmp_path / "m", share_encoder_decoder_embeddings=share, tie_word_embeddings=tie,
                                 scale_embedding=not share, activation="relu" if tie else "gelu",
                                 safetensors=share, final_logits_bias=tie, train_lines=500, vocab_pieces=150)
    out = convert_huggingface(str(folder), tmp_path / "x.ckpt", src_lang="de", tgt_lang="en")
    loaded = read_inference(out, load_checkpoint(out))
    assert loaded.config.tie_embeddings == expected and loaded.config.output_bias == tie
    assert loaded.config.scale_embeddings == (not share)
    model_hf, tokenizer = hf(folder)
    model = Transformer(loaded.config)
    model.load_state_dict(loaded.weights)
    model.double().eval()
    model_hf.double()
    for de, en in sentences(5):
        src = tokenizer(de).input_ids
        tgt_in = [loaded.config.pad_id, *tokenizer(text_target=en).input_ids[:-1]]
        with torch.inference_mode():
            theirs = model_hf(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([tgt_in])).logits[0]
        torch.testing.assert_close(teacher_forced(model, src, tgt_in), theirs.double().log_softmax(-1),
                                   rtol=1e-6, atol=1e-9)


def test_transformer_big_sizes_map_to_our_config(marian: Path):
    config = json.loads((marian / "config.json").read_text())
    config.update(d_model=1024, encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
                  decoder_ffn_dim=4096, encoder_layers=12, decoder_layers=6, max_position_embeddings=1024)
    ours = transformer_config(config, where=marian, pad_id=config["pad_token_id"], output_bias=True)
    assert (ours.d_model, ours.num_heads, ours.d_ff, ours.num_encoder_layers, ours.num_decoder_layers) == (
        1024, 16, 4096, 12, 6)
    assert ours.norm_placement == "post" and ours.positions == "sinusoidal" and ours.activation == "swish"


def edited(marian: Path, tmp_path: Path, *, config: dict | None = None, remove: str | None = None) -> Path:
    """A copy of `marian` with config.json's values updated from `config` (None: the key removed)."""
    folder = tmp_path / "edited"
    shutil.copytree(marian, folder)
    if config is not None:
        values = json.loads((folder / "config.json").read_text())
        values.update(config)
        values = {key: value for key, value in values.items() if value is not None}
        (folder / "config.json").write_text(json.dumps(values))
    if remove is not None:
        (folder / remove).unlink()
    return folder


@pytest.mark.parametrize(("change", "message"), [
    ({"config": {"model_type": "bart"}}, r"is not a Marian model \(config.json model_type: 'bart'\)"),
    ({"config": {"normalize_before": True}}, r"config.json normalize_before=true is not supported \(OPUS-MT's models "
                                             r"have false"),
    ({"config": {"static_position_embeddings": False}}, "static_position_embeddings=false is not supported"),
    ({"config": {"decoder_vocab_size": 7}}, "decoder_vocab_size=7 differs from vocab_size=.*separate source and "
                                            "target vocabularies are not supported"),
    ({"config": {"activation_function": "tanh"}}, "activation_function='tanh' is not supported"),
    ({"config": {"decoder_ffn_dim": 32}}, "encoder_ffn_dim=64 but decoder_ffn_dim=32: our model has one d_ff"),
    ({"config": {"share_encoder_decoder_embeddings": True, "tie_word_embeddings": False}},
     "share_encoder_decoder_embeddings=true with tie_word_embeddings=false"),
    ({"config": {"d_model": None}}, "config.json has no d_model, which every Marian config.json sets"),
    ({"config": {"encoder_layers": "six"}}, "config.json encoder_layers: "),
    ({"config": {"vocab_size": "329"}}, r'config.json vocab_size is "329", not a JSON integer'),
    ({"config": {"share_encoder_decoder_embeddings": "false"}},
     r'config.json share_encoder_decoder_embeddings is "false", not a JSON boolean'),
    ({"config": {"scale_embedding": None, "tie_word_embeddings": None}}, None),  # absent: MarianConfig's defaults
    ({"remove": "config.json"}, "is not a Marian model folder: it has no config.json"),
    ({"remove": "target.spm"}, "the tokenizer file target.spm is missing"),
    ({"remove": "model.safetensors"}, r"has no weights \(model.safetensors or pytorch_model.bin\)"),
])
def test_what_cannot_be_imported_is_one_line_naming_it(change: dict, message: str | None, marian: Path,
                                                       tmp_path: Path, capsys):
    folder = edited(marian, tmp_path, **change)
    if message is None:
        main(["--from", "huggingface", str(folder), "--output", str(tmp_path / "x.ckpt")])
        return
    with pytest.raises(SystemExit) as exit_:
        main(["--from", "huggingface", str(folder), "--output", str(tmp_path / "x.ckpt")])
    assert str(exit_.value).startswith("error: ") and "\n" not in str(exit_.value)
    assert re.search(message, str(exit_.value)), str(exit_.value)
    assert not (tmp_path / "x.ckpt").exists()


@pytest.mark.parametrize(("name", "shape"), [("model.encoder.layers.0.fc1.weight", (64, 40)),  # was cut to 32 columns
                                           ("model.decoder.layers.1.self_attn.k_proj.bias", (40,)),
                                           ("model.shared.weight", (7, 32)), ("final_logits_bias", (1, 5)),
                                           ("model.encoder.layers.1.fc2.weight", (3, 3))])
def test_a_weight_of_another_shape_is_refused_naming_it(name: str, shape: tuple, marian: Path, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    folder = edited(marian, tmp_path)
    weights = load_file(folder / "model.safetensors")
    weights[name] = torch.ones(shape)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConvertError, match=rf"the weight '{re.escape(name)}' has the shape {re.escape(str(shape))}, but "
                                           "config.json makes it"):
        convert_huggingface(str(folder), tmp_path / "x.ckpt")


@pytest.mark.parametrize(("weight_map", "message"), [(["x"], "its weight_map is not an object"),
                                                     ({"a": "../../etc/passwd"}, "not a file in the folder"),
                                                     ({"a": 5}, "its weight_map names 5"),
                                                     ({"a": "model-00002.safetensors"}, "which is missing")])
def test_a_bad_shard_index_is_one_line(weight_map, message: str, marian: Path, tmp_path: Path):
    folder = edited(marian, tmp_path)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConvertError, match=re.escape(message)):
        convert_huggingface(str(folder), tmp_path / "x.ckpt")


def test_an_output_that_is_not_a_regular_file_is_refused(marian: Path, tmp_path: Path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ConvertError, match=r"--output .*pipe is a FIFO \(named pipe\), not a file: name a new file$"):
        convert_huggingface(str(marian), tmp_path / "pipe", force=True)
    assert (tmp_path / "pipe").is_fifo()


def test_unknown_weights_a_taken_output_and_a_bad_source_are_refused(marian: Path, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    folder = edited(marian, tmp_path)
    weights = load_file(folder / "model.safetensors")
    weights["model.encoder.layernorm_embedding.weight"] = torch.ones(32)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConvertError, match="the weights hold 'model.encoder.layernorm_embedding.weight'"):
        convert_huggingface(str(folder), tmp_path / "x.ckpt")
    (tmp_path / "taken.ckpt").write_bytes(b"mine")
    with pytest.raises(ConvertError, match="--output .*taken.ckpt exists: name a new file, or pass --force"):
        convert_huggingface(str(marian), tmp_path / "taken.ckpt")
    assert (tmp_path / "taken.ckpt").read_bytes() == b"mine"
    with pytest.raises(ConvertError, match="not-a-model is neither a folder nor a Hugging Face Hub id"):
        convert_huggingface("not-a-model", tmp_path / "y.ckpt")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ConvertError, match="is a file; give the model's folder"):
        convert_huggingface(str(tmp_path / "file.txt"), tmp_path / "y.ckpt")
    no_pair = edited(marian, tmp_path / "np", remove="tokenizer_config.json")
    with pytest.raises(ConvertError, match="the language pair is not recorded.*give --src-lang and --tgt-lang"):
        convert_huggingface(str(no_pair), tmp_path / "z.ckpt")
    assert os.path.exists(convert_huggingface(str(no_pair), tmp_path / "z.ckpt", src_lang="de", tgt_lang="en"))


# ---- --output: the policy every face shares (seq2seq/textio.py's check_output), checked before SRC is read ----


@pytest.fixture
def unread(tmp_path: Path) -> Path:
    """A SRC folder that is no model: a conversion that got as far as reading it would fail otherwise."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}", encoding="utf-8")
    return folder


def refused(*args: str) -> str:
    return output_checks.refused(lambda args: main(["--from", "huggingface", *args]), *args)


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_dev_null_and_a_fifo_are_refused_and_stay_what_they_are(force: list[str], unread: Path, tmp_path: Path):
    message = refused(str(unread), "--output", "/dev/null", *force)
    assert message == "error: --output /dev/null is a character device, not a file: name a new file"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    fifo = tmp_path / "out.ckpt"
    os.mkfifo(fifo)
    message = refused(str(unread), "--output", str(fifo), *force)
    assert message == f"error: --output {fifo} is a FIFO (named pipe), not a file: name a new file"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_an_existing_file_is_replaced_only_with_force(marian: Path, tmp_path: Path):
    taken = tmp_path / "de-en.ckpt"
    taken.write_bytes(b"mine")
    message = refused(str(marian), "--output", str(taken))
    assert message == f"error: --output {taken} exists: name a new file, or pass --force to replace it"
    assert taken.read_bytes() == b"mine"
    main(["--from", "huggingface", str(marian), "--output", str(taken), "--force"])
    assert read_inference(taken, load_checkpoint(taken)).src_lang == "de"


def test_a_missing_folder_is_refused_and_not_created(unread: Path, tmp_path: Path):
    output = tmp_path / "new" / "de-en.ckpt"
    message = refused(str(unread), "--output", str(output))
    assert message == f"error: --output {output}: the folder {output.parent} does not exist; create it first"
    assert not output.parent.exists()


def test_a_folder_is_refused_in_one_line(unread: Path, tmp_path: Path):
    message = refused(str(unread), "--output", str(tmp_path), "--force")
    assert message == f"error: --output {tmp_path} is a folder; name the file to write, e.g. {tmp_path / 'model.ckpt'}"


def test_a_file_of_src_as_output_is_refused_even_with_force(unread: Path):
    config = unread / "config.json"
    message = refused(str(unread), "--output", str(config), "--force")
    assert message == f"error: --output {config} is the SRC file {config}: it would be overwritten"
    assert config.read_text(encoding="utf-8") == "{}"
