"""Tests for seq2seq.export: a checkpoint exported to CTranslate2 or to Hugging Face Marian computes
what ours computes.

Two checks, each where it cannot be flaky:
- every exportable variant: CTranslate2's teacher-forced log-probabilities (score_batch) of real
  Multi30k pairs equal ours (float64) within 1e-4, on random weights with every parameter, norms and
  biases included, perturbed, so a transposed, swapped or missing tensor shows at once;
- search: on a model trained for a few hundred steps (decisive distributions), greedy and beam-4
  outputs equal ours token for token but for near-ties, which our own model confirms are ties;
- int8: the exported weights are exactly the per-row quantization of ours (scored in float32);
- the output folder: an export takes --output's place whole or not at all, and --force replaces only
  an earlier export, never the checkpoint or anything else the folder holds.
"""

import copy
import errno
import gzip
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import ctranslate2
import output_checks
import pytest
import torch
from conftest import DEMO_DATA
from near_ties import beam_near_ties, greedy_near_ties, reference_model
from translating import python_env

from seq2seq.checkpoint import CHECKPOINT_KEY, inference_entry, save_atomic
from seq2seq.decoding.config import SearchConfig
from seq2seq.export import main
from seq2seq.inference.translator import Translator
from seq2seq.interop.export import (
    ExportError,
    ctranslate2_refusal,
    export_ctranslate2,
    export_huggingface,
)
from seq2seq.model import Transformer, TransformerConfig
from seq2seq.text.tokenizer import BOS_ID, EOS_ID, Tokenizer

VARIANTS = {
    "post-layernorm-relu-sinusoidal-tied": {},
    "pre-rmsnorm-swiglu-learned": {"norm_placement": "pre", "norm": "rmsnorm", "activation": "swiglu",
                                   "positions": "learned"},
    "post-gelu-untied": {"activation": "gelu", "tie_embeddings": "none"},
    "pre-glu-decoder-tied": {"norm_placement": "pre", "activation": "glu", "tie_embeddings": "decoder"},
    "post-geglu-eps": {"activation": "geglu", "norm_eps": 1e-6},
    "pre-swish-unscaled": {"norm_placement": "pre", "activation": "swish", "scale_embeddings": False},
    "pre-rotary": {"norm_placement": "pre", "positions": "rotary", "rotary_base": 500.0},
    "post-t5-relative-bias": {"positions": "relative", "relative_buckets": 16, "relative_max_distance": 40},
}


def write_checkpoint(path: Path, model: Transformer, tokenizer: Tokenizer) -> Path:
    state_dict = {f"model.{name}": value for name, value in model.state_dict().items()}
    entry = inference_entry(state_dict=state_dict, config=model.config, tokenizer=tokenizer.to_bytes(),
                            src_lang="de", tgt_lang="en")
    save_atomic({"state_dict": state_dict, CHECKPOINT_KEY: entry}, path)
    return path


def random_model(tokenizer: Tokenizer, **options) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=tokenizer.vocab_size, d_model=32, num_heads=4, d_ff=48, num_encoder_layers=2,
                               num_decoder_layers=2, dropout=0.0, max_positions=96, **options)
    model = Transformer(config)
    with torch.no_grad():
        for parameter in model.parameters():  # norms off 1/0, biases off 0: a mix-up cannot hide
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


def our_log_probs(model: Transformer, src: list[int], tgt: list[int]) -> list[float]:
    """log P(tgt + EOS | src) per token, teacher-forced, in float64."""
    model64 = model.double()
    with torch.no_grad():
        logits = model64(torch.tensor([src]), torch.tensor([[BOS_ID, *tgt]]))
    log_probs = torch.log_softmax(logits[0], dim=-1)
    result = log_probs.gather(1, torch.tensor([[*tgt, EOS_ID]]).T)[:, 0].tolist()
    model.float()
    return result


def pieces_of(tokenizer: Tokenizer, ids: list[int]) -> list[bool]:
    return [tokenizer.pieces()[i].startswith("<0x") for i in ids]


@pytest.fixture(scope="module")
def pairs(multi30k_lines) -> list[tuple[str, str]]:
    return list(zip(multi30k_lines("test_2016_flickr", "de", 60), multi30k_lines("test_2016_flickr", "en", 60),
                    strict=True))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_exportable_variant_scores_as_ours(variant: str, tokenizer: Tokenizer, pairs, tmp_path: Path):
    model = random_model(tokenizer, **VARIANTS[variant])
    assert ctranslate2_refusal(model.config) is None
    folder = export_ctranslate2(write_checkpoint(tmp_path / "m.ckpt", model, tokenizer), tmp_path / "ct2")
    engine = ctranslate2.Translator(str(folder), device="cpu", intra_threads=1)
    # The last pair has characters outside the vocabulary: byte-fallback pieces (<0xE2>...) on both sides.
    texts = [*pairs[:20], ("Ein ☃ und ½ Kuchen.", "A ☃ and ½ cake.")]
    sources = [tokenizer.encode_source([de])[0][:60] for de, _ in texts]
    targets = [tokenizer.encode_target([en])[0][:60] for _, en in texts]
    assert any(pieces_of(tokenizer, targets[-1]))
    pieces = tokenizer.pieces()
    results = engine.score_batch([[pieces[i] for i in s] for s in sources], [[pieces[i] for i in t] for t in targets])
    for src, tgt, result in zip(sources, targets, results, strict=True):
        assert result.tokens == [pieces[i] for i in tgt] + ["</s>"]
        ours = our_log_probs(model, src, tgt)
        assert result.log_probs == pytest.approx(ours, abs=2e-4)  # per token
        assert sum(result.log_probs) == pytest.approx(sum(ours), rel=1e-4)


@pytest.mark.parametrize(("options", "field"), [({"norm_placement": "deepnorm"}, "norm_placement='deepnorm'"),
                                                ({"norm_placement": "sandwich"}, "norm_placement='sandwich'")])
def test_what_ctranslate2_cannot_express_is_refused_by_name(options, field: str, tokenizer: Tokenizer, tmp_path: Path):
    checkpoint = write_checkpoint(tmp_path / "m.ckpt", random_model(tokenizer, **options), tokenizer)
    with pytest.raises(ExportError, match=f"^cannot export to CTranslate2: {field.replace('(', '.')}"):
        export_ctranslate2(checkpoint, tmp_path / "ct2")
    with pytest.raises(SystemExit, match=f"^error: cannot export to CTranslate2: {field}"):
        main(["--checkpoint", str(checkpoint), "--to", "ctranslate2", "--output", str(tmp_path / "cli")])
    assert not (tmp_path / "cli").exists()


def ct2_translate(folder: Path, translator: Translator, sources: list[str], *, beam_size: int,
                  compute_type: str = "default") -> list[list[int]]:
    engine = ctranslate2.Translator(str(folder), device="cpu", intra_threads=1, compute_type=compute_type)
    sp_pieces = [[translator.tokenizer.pieces()[i] for i in ids] for ids in translator.tokenizer.encode_source(sources)]
    results = engine.translate_batch(sp_pieces, beam_size=beam_size, length_penalty=0.0, max_decoding_length=127,  # the model reads BOS + 126 tokens: max_positions 128
                                     suppress_sequences=[["<pad>"], ["<s>"]])
    index = {piece: i for i, piece in enumerate(translator.tokenizer.pieces())}
    return [[index[p] for p in result.hypotheses[0]] for result in results]


def test_greedy_and_beam_equal_ours_but_for_near_ties(trained: Path, tmp_path: Path):
    """Our search and CTranslate2's on the same weights (a trained model: decisive distributions), both in float32,
    give the same outputs, except where two choices tie within float32's rounding (tests/near_ties.py): a greedy
    output may differ only where, after the same prefix, our float64 model rates both tokens within float32's
    tolerance, and a beam output only where our float64 model rates both whole outputs alike. Which near-ties
    flip depends on the CPU's kernels; that outputs differ only at near-ties does not. (No count of outputs that
    differ: how many near-ties flip is the CPU's.)"""
    with gzip.open(DEMO_DATA / "test.en.gz", "rt", encoding="utf-8") as f:
        sources = f.read().split("\n")[:60]
    translator = Translator.from_checkpoint(trained, precision="fp32")
    folder = export_ctranslate2(trained, tmp_path / "fp32")
    assert (folder / "source.spm").read_bytes() == translator.tokenizer.to_bytes()
    reference = reference_model(trained)
    src = translator.tokenizer.encode_source(sources)
    for beam_size, near_ties in ((1, greedy_near_ties), (4, beam_near_ties)):
        search = SearchConfig(beam_size=beam_size, length_penalty=0.0, max_len_a=0.0, max_len_b=126)
        ours = [hyps[0].tokens for hyps in translator.translate_nbest(sources, search)]
        theirs = ct2_translate(folder, translator, sources, beam_size=beam_size)
        assert any(ours) and len({tuple(t) for t in ours}) > len(sources) / 2  # they write, and vary
        problems = near_ties(reference, src, ours, theirs, precision="fp32", bos=BOS_ID, eos=EOS_ID)
        assert not problems, f"beam {beam_size}: " + "; ".join(problems)


def quantize_as_ctranslate2(model: Transformer) -> Transformer:
    """A copy whose linear and embedding weights are what CTranslate2's int8 keeps of them: per row,
    rint(w * 127 / max|w|) / (127 / max|w|), computed in float32 as its converter does."""
    quantized = copy.deepcopy(model)
    with torch.no_grad():
        for module in quantized.modules():
            if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
                weight = module.weight.float()
                amax = weight.abs().amax(dim=1, keepdim=True)
                scale = torch.tensor(127.0) / torch.where(amax == 0, 127.0, amax)
                module.weight.copy_(torch.round(weight * scale) / scale)  # round half to even, as rint
    return quantized


def test_int8_export_keeps_exactly_the_per_row_quantized_weights(tokenizer: Tokenizer, pairs, tmp_path: Path):
    """CTranslate2 computing in float32 on our int8 export scores as our model with the same quantized
    weights (float64) does, to float32 rounding; and not as the unquantized model, which would mean the
    quantization was lost. (int8 *compute* also quantizes activations, by the CPU's int8 kernels: that
    is CTranslate2's own business, measured in bench/decode_vs_ct2.py, not here.)"""
    model = random_model(tokenizer)
    checkpoint = write_checkpoint(tmp_path / "m.ckpt", model, tokenizer)
    main(["--checkpoint", str(checkpoint), "--to", "ctranslate2", "--output", str(tmp_path / "int8"),
          "--quantization", "int8"])
    engine = ctranslate2.Translator(str(tmp_path / "int8"), device="cpu", intra_threads=1, compute_type="float32")
    quantized = quantize_as_ctranslate2(model)
    sources = [tokenizer.encode_source([de])[0][:60] for de, _ in pairs[:20]]
    targets = [tokenizer.encode_target([en])[0][:60] for _, en in pairs[:20]]
    pieces = tokenizer.pieces()
    results = engine.score_batch([[pieces[i] for i in s] for s in sources], [[pieces[i] for i in t] for t in targets])
    lost = 0.0
    for src, tgt, result in zip(sources, targets, results, strict=True):
        assert result.log_probs == pytest.approx(our_log_probs(quantized, src, tgt), abs=2e-4)
        unquantized = our_log_probs(model, src, tgt)
        lost = max(lost, *(abs(a - b) for a, b in zip(result.log_probs, unquantized, strict=True)))
    assert lost > 1e-2  # measured 0.05: the quantization is there, and this test can tell it apart


# ---- Hugging Face: MarianMTModel ------------------------------------------------------------

MARIAN_VARIANTS = {"relu-tied": {}, "gelu-untied": {"activation": "gelu", "tie_embeddings": "none"},
                   "swish-decoder-tied": {"activation": "swish", "tie_embeddings": "decoder"}}


@pytest.mark.parametrize("variant", MARIAN_VARIANTS)
def test_marian_computes_as_ours(variant: str, tokenizer: Tokenizer, pairs, tmp_path: Path):
    """Teacher-forced log-probabilities in float64, with Marian's sin-then-cos channel order."""
    from transformers import MarianMTModel

    model = random_model(tokenizer, **MARIAN_VARIANTS[variant])
    folder = export_huggingface(write_checkpoint(tmp_path / "m.ckpt", model, tokenizer), tmp_path / "hf")
    marian = MarianMTModel.from_pretrained(folder).eval().double()
    src = torch.tensor(tokenizer.encode_source([pairs[0][0]]))
    tgt_in = torch.tensor([[BOS_ID, *tokenizer.encode_target([pairs[0][1]])[0]]])
    with torch.no_grad():
        ours = torch.log_softmax(model.double()(src, tgt_in), dim=-1)
        theirs = torch.log_softmax(marian(input_ids=src, decoder_input_ids=tgt_in).logits, dim=-1)
    assert torch.allclose(theirs, ours, atol=1e-9)


@pytest.mark.parametrize(("options", "field"), [({"norm_placement": "pre"}, "norm_placement='pre'"),
                                                ({"activation": "swiglu"}, "activation='swiglu'"),
                                                ({"positions": "learned"}, "positions='learned'"),
                                                ({"norm": "rmsnorm"}, "norm: Marian uses LayerNorm")])
def test_what_marian_cannot_host_is_refused_by_name(options, field: str, tokenizer: Tokenizer, tmp_path: Path):
    checkpoint = write_checkpoint(tmp_path / "m.ckpt", random_model(tokenizer, **options), tokenizer)
    with pytest.raises(SystemExit, match=f"^error: cannot export to Hugging Face .MarianMTModel.: {field}"):
        main(["--checkpoint", str(checkpoint), "--to", "huggingface", "--output", str(tmp_path / "hf")])


def test_marian_generates_what_ours_decodes(trained: Path, tmp_path: Path):
    from transformers import MarianMTModel, MarianTokenizer

    with gzip.open(DEMO_DATA / "test.en.gz", "rt", encoding="utf-8") as f:
        sources = f.read().split("\n")[:60]
    translator = Translator.from_checkpoint(trained)
    main(["--checkpoint", str(trained), "--to", "huggingface", "--output", str(tmp_path / "hf")])
    marian, hf_tokenizer = MarianMTModel.from_pretrained(tmp_path / "hf"), MarianTokenizer.from_pretrained(tmp_path / "hf")
    # generate's defaults: the decoder's length (not transformers' 20), the checkpoint's beam
    assert marian.generation_config.max_length == translator.model.config.max_positions
    assert marian.generation_config.num_beams == translator.search.beam_size
    # Our models read the source without EOS: add_special_tokens=False (MarianTokenizer appends one).
    batch = hf_tokenizer(sources, add_special_tokens=False, padding=True, return_tensors="pt")
    assert [row[mask.bool()].tolist() for row, mask in zip(batch.input_ids, batch.attention_mask, strict=True)] == (
        translator.tokenizer.encode_source(sources))
    for beam_size in (1, 4):
        search = SearchConfig(beam_size=beam_size, length_penalty=0.0, max_len_a=0.0, max_len_b=126)
        ours = translator.translate_nbest(sources, search)
        with torch.no_grad():
            generated = marian.eval().generate(**batch, num_beams=beam_size, max_new_tokens=127, do_sample=False,
                                             length_penalty=0.0, early_stopping=True)  # ranked by log-prob, as ours
        assert hf_tokenizer.batch_decode(generated, skip_special_tokens=True) == [hyps[0].text for hyps in ours]



# ---- The output folder: written beside, renamed into place; --force replaces only an earlier export ----

ENGINES = ("ctranslate2", "huggingface")


@pytest.fixture
def checkpoint(tokenizer: Tokenizer, tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "m.ckpt", random_model(tokenizer), tokenizer)


def export(checkpoint: Path, output: Path | str, engine: str, *flags: str) -> None:
    main(["--checkpoint", str(checkpoint), "--to", engine, "--output", str(output), *flags])


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every file and folder under `folder`, hidden ones (a half-written export) included, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def earlier_export(folder: Path) -> Path:
    folder.mkdir()
    for name in ("model.bin", "config.json", "shared_vocabulary.json", "source.spm", "target.spm"):
        (folder / name).write_text(name)
    return folder


FOREIGN = {  # what the folder holds besides an earlier export, and how the error names it
    "the checkpoint": r"holds the checkpoint being exported \(m\.ckpt\): name a new folder for the export$",
    "the checkpoint as model.bin": r"holds the checkpoint being exported \(model\.bin\)",
    "the checkpoint, in the working directory": r"holds the checkpoint being exported \(m\.ckpt\)",
    "another file": r"holds notes\.txt, which no export writes \(--force replaces only an earlier export\): "
                    r"name a new folder, or move notes\.txt out$",
    "a sub-folder": r"holds the folder runs/, which no export writes .*: name a new folder, or move runs/ out$",
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("holds", FOREIGN)
def test_force_never_replaces_a_folder_holding_what_no_export_writes(holds: str, engine: str, checkpoint: Path,
                                                                      tmp_path: Path, monkeypatch):
    """CTranslate2's converter deleted --output whole under --force (the checkpoint and all else in it), and
    `--output . --force` the working directory; Hugging Face's wrote into it, beside what was there."""
    output = earlier_export(tmp_path / "out")
    if holds == "the checkpoint":
        checkpoint = checkpoint.rename(output / "m.ckpt")
    elif holds == "the checkpoint as model.bin":
        (output / "model.bin").unlink()
        checkpoint = checkpoint.rename(output / "model.bin")
    elif holds == "the checkpoint, in the working directory":
        checkpoint = checkpoint.rename(output / "m.ckpt")
        monkeypatch.chdir(output)
        output = Path(".")
    elif holds == "another file":
        (output / "notes.txt").write_text("mine")
    else:
        (output / "runs").mkdir()
        (output / "runs" / "log.txt").write_text("mine")
    before = tree(tmp_path)
    with pytest.raises(SystemExit, match=f"^error: --output {re.escape(str(output))} {FOREIGN[holds]}"):
        export(checkpoint, output, engine, "--force")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("output", ["notes.txt", "m.ckpt"])
@pytest.mark.parametrize("force", [[], ["--force"]])
def test_a_file_as_output_is_refused_even_with_force(force: list[str], output: str, engine: str, checkpoint: Path,
                                                     tmp_path: Path):
    """It was a NotADirectoryError traceback (CTranslate2), or 'wrote notes.txt' and nothing written (Hugging Face)."""
    (tmp_path / "notes.txt").write_text("mine")
    what = (f"the --checkpoint file {checkpoint}: it would be overwritten" if output == "m.ckpt" else
            "a file, not a folder: name a new folder")
    before = tree(tmp_path)
    with pytest.raises(SystemExit, match=f"^error: --output {re.escape(str(tmp_path / output))} is {re.escape(what)}$"):
        export(checkpoint, tmp_path / output, engine, *force)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("output", ["", "link"])
def test_an_empty_or_linked_output_is_refused(output: str, checkpoint: Path, tmp_path: Path, monkeypatch):
    """`--output ''` was the working directory, which --force deleted; a link's target is not what was named."""
    monkeypatch.chdir(earlier_export(tmp_path / "out"))
    Path("link").symlink_to(tmp_path / "out")
    message = "is empty: name a new folder" if output == "" else "link is a symbolic link: name the folder itself"
    before = tree(tmp_path)
    with pytest.raises(SystemExit, match=f"^error: --output {message}"):
        export(checkpoint, output, "ctranslate2", "--force")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("output", ["typo/..", "out/typo/../..", "./typo/../."])
def test_an_output_through_a_missing_folder_and_dotdot_is_the_folder_it_names(output: str, checkpoint: Path,
                                                                              tmp_path: Path, monkeypatch):
    """`typo/..` does not exist for the kernel, so it passed the checks, then was made absolute, which
    is the working folder: --force (and without it too) set that folder aside and deleted it, checkpoint
    and all. The checks now look at the folder that would be written."""
    monkeypatch.chdir(tmp_path)
    earlier_export(tmp_path / "out")
    checkpoint = checkpoint.rename(tmp_path / "m.ckpt")
    before = tree(tmp_path)
    for flags in ([], ["--force"]):
        with pytest.raises(SystemExit, match=f"^error: --output {re.escape(str(Path(output)))} (holds the checkpoint|exists)"):
            export(checkpoint, output, "ctranslate2", *flags)
        assert tree(tmp_path) == before


def test_an_output_with_the_longest_name_a_folder_may_have_is_written(checkpoint: Path, tmp_path: Path):
    """The export is written beside --output under a longer name first: it was ENAMETOOLONG at 238+ bytes."""
    output = tmp_path / ("é" * 127)  # 254 bytes
    export(checkpoint, output, "ctranslate2")
    assert (output / "model.bin").is_file() and [p.name for p in tmp_path.iterdir()] == sorted(["m.ckpt", output.name])


@pytest.fixture
def unwritable(tmp_path: Path, monkeypatch) -> Path:
    """A folder no one may create anything in; as root, who ignores its mode, mkdir refuses as the kernel
    would for anyone else."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):
        real_mkdir = os.mkdir

        def mkdir(path, *args, **kwargs):
            if Path(path).parent == folder:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)
    yield folder
    folder.chmod(0o755)


@pytest.mark.parametrize("engine", ENGINES)
def test_an_unwritable_output_is_one_line_naming_it(engine: str, checkpoint: Path, unwritable: Path, tmp_path: Path):
    before = tree(tmp_path)
    with pytest.raises(SystemExit, match=f"^error: --output {re.escape(str(unwritable / 'ct2'))}: cannot create a "
                                         f"folder in {re.escape(str(unwritable))} \\(Permission denied\\): name a "
                                         "folder you can write to$"):
        export(checkpoint, unwritable / "ct2", engine)
    assert tree(tmp_path) == before


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here")
@pytest.mark.parametrize("engine", ENGINES)
def test_an_output_in_proc_is_one_line_naming_it(engine: str, checkpoint: Path):
    with pytest.raises(SystemExit, match=r"^error: --output /proc/ct2: cannot create a folder in /proc \(No such file "
                                         r"or directory\): name a folder you can write to$"):
        export(checkpoint, "/proc/ct2", engine, "--force")
    assert not Path("/proc/ct2").exists()


def test_the_command_line_says_one_line_and_exits_1(checkpoint: Path, tmp_path: Path):
    (tmp_path / "notes.txt").write_text("mine")
    result = subprocess.run([sys.executable, "-m", "seq2seq.export", "--checkpoint", str(checkpoint), "--to",
                             "ctranslate2", "--output", str(tmp_path / "notes.txt"), "--force"],
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines() == [f"error: --output {tmp_path / 'notes.txt'} is a file, not a folder: "
                                          "name a new folder"]


@pytest.mark.parametrize(("earlier", "engine"), [("ctranslate2", "huggingface"), ("huggingface", "ctranslate2"),
                                                 ("ctranslate2", "ctranslate2")])
def test_force_replaces_an_earlier_export_whole(earlier: str, engine: str, checkpoint: Path, tmp_path: Path):
    """Nothing of the earlier export stays (Hugging Face's used to write beside CTranslate2's model.bin), and
    nothing beside it either: the folder written next to --output was renamed into its place."""
    export(checkpoint, tmp_path / "fresh", engine)
    export(checkpoint, tmp_path / "out", earlier, *(["--quantization", "int8"] if earlier == engine else []))
    export(checkpoint, tmp_path / "out", engine, "--force")
    assert tree(tmp_path / "out") == tree(tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "m.ckpt", "out"]


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def interrupted(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize(("engine", "failure"), [("ctranslate2", "disk full"), ("huggingface", "disk full"),
                                                 ("ctranslate2", "Ctrl-C"), ("ctranslate2", "moving it in")])
def test_a_failed_export_leaves_the_earlier_one_and_nothing_else(engine: str, failure: str, tokenizer: Tokenizer,
                                                                 checkpoint: Path, tmp_path: Path, monkeypatch):
    """The converter removed the earlier export before writing the new one: a full disk lost both."""
    output = tmp_path / "out"
    export(checkpoint, tmp_path / "out", engine)
    other = write_checkpoint(tmp_path / "other.ckpt", random_model(tokenizer, activation="gelu"), tokenizer)
    before = tree(tmp_path)
    if failure == "moving it in":  # after the earlier export was set aside: it goes back
        real_rename = os.rename
        monkeypatch.setattr(os, "rename", lambda a, b: no_space() if ".partial-" in str(a) else real_rename(a, b))
    else:  # the sentencepiece model is written after the weights, by either engine
        monkeypatch.setattr(Path, "write_bytes", interrupted if failure == "Ctrl-C" else no_space)
    if failure == "Ctrl-C":
        with pytest.raises(KeyboardInterrupt):
            export(other, output, engine, "--force")
    else:
        with pytest.raises(SystemExit, match=f"^error: --output {re.escape(str(output))}: writing the export failed "
                                             r"\(No space left on device\); nothing was changed: "):
            export(other, output, engine, "--force")
    monkeypatch.undo()
    assert tree(tmp_path) == before


def test_what_a_killed_export_left_is_cleaned_up_and_an_earlier_export_put_back(checkpoint: Path, tmp_path: Path):
    """kill -9 mid-export left its hidden .out.partial-* folder for good; killed between setting the earlier
    export aside and moving the new one in, it left no --output at all (the earlier one hidden)."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names the folders of an export that is gone
    staging = tmp_path / f".out.partial-{dead.pid}-0123abcd"
    staging.mkdir()
    (staging / "model.bin").write_bytes(b"half")
    running = tmp_path / f".out.partial-{os.getpid()}-89abcdef"  # an export still running: not ours to remove
    running.mkdir()
    aside = earlier_export(tmp_path / f".out.replaced-{dead.pid}-4567cdef")
    with pytest.raises(SystemExit, match=r"^error: --output .*out exists: name a new folder, or pass --force"):
        export(checkpoint, tmp_path / "out", "ctranslate2")  # the earlier export is back, so --output exists
    assert {p.name for p in tmp_path.iterdir()} - {checkpoint.name} == {running.name, "out"}
    assert (tmp_path / "out" / "model.bin").read_text() == "model.bin"

    # Killed after the new export got in, while the earlier one set aside was being removed: it goes.
    aside = earlier_export(tmp_path / f".out.replaced-{dead.pid}-4567cdef")
    export(checkpoint, tmp_path / "out", "ctranslate2", "--force")
    assert not aside.exists()
    assert {p.name for p in tmp_path.iterdir()} - {checkpoint.name} == {running.name, "out"}
    assert (tmp_path / "out" / "model.bin").stat().st_size > 1000  # the export, not the stand-in


def test_an_output_that_cannot_be_renamed_says_why_not_that_space_is_short(checkpoint: Path, tmp_path: Path,
                                                                          monkeypatch):
    """--force over a mount point: rename() answers EBUSY, and the advice was to free some space."""
    output = earlier_export(tmp_path / "mounted")
    before = tree(tmp_path)
    real_rename = os.rename

    def rename(a, b):
        if Path(a) == output:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(a))
        return real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(SystemExit, match=f"^error: --output {re.escape(str(output))}: writing the export failed "
                                         r"\(Device or resource busy\); nothing was changed: .* is in use \(a mount "
                                         r"point\?\): name a folder inside it, or a new one$"):
        export(checkpoint, output, "ctranslate2", "--force")
    monkeypatch.undo()
    assert tree(tmp_path) == before


def test_the_python_api_refuses_and_replaces_as_the_command_line_does(checkpoint: Path, tmp_path: Path):
    export_ctranslate2(checkpoint, tmp_path / "ct2")
    with pytest.raises(ExportError, match=r"^--output .*ct2 exists: name a new folder, or pass --force to replace it$"):
        export_ctranslate2(checkpoint, tmp_path / "ct2")  # was CTranslate2's RuntimeError
    assert export_ctranslate2(checkpoint, tmp_path / "ct2", quantization="int8", force=True) == tmp_path / "ct2"
    assert export_huggingface(checkpoint, str(tmp_path / "ct2"), force=True) == tmp_path / "ct2"
    assert (tmp_path / "ct2" / "model.safetensors").is_file() and not (tmp_path / "ct2" / "model.bin").exists()
    (tmp_path / "ct2" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="holds notes.txt, which no export writes"):
        export_huggingface(checkpoint, tmp_path / "ct2", force=True)


# ---- --output: the policy every face shares (seq2seq/textio.py's check_output), checked before the checkpoint is read ----


def refused(*args: str) -> str:
    return output_checks.refused(main, *args)


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_dev_null_and_a_fifo_are_refused_and_stay_what_they_are(force: list[str], tmp_path: Path):
    """It said "is a file, not a folder" of both. The checkpoint named does not exist: the refusal comes first."""
    unread = str(tmp_path / "none.ckpt")
    message = refused("--checkpoint", unread, "--to", "ctranslate2", "--output", "/dev/null", *force)
    assert message == "error: --output /dev/null is a character device, not a folder: name a new folder"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    fifo = tmp_path / "ct2"
    os.mkfifo(fifo)
    message = refused("--checkpoint", unread, "--to", "huggingface", "--output", str(fifo), *force)
    assert message == f"error: --output {fifo} is a FIFO (named pipe), not a folder: name a new folder"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_missing_folder_is_refused_and_not_created(engine: str, checkpoint: Path, tmp_path: Path):
    """The export made every missing folder on the way to --output (new/deep/), silently."""
    output = tmp_path / "new" / "deep" / "out"
    before = tree(tmp_path)
    message = refused("--checkpoint", str(checkpoint), "--to", engine, "--output", str(output), "--force")
    assert message == f"error: --output {output}: the folder {output.parent} does not exist; create it first"
    assert tree(tmp_path) == before


def test_compiled_takes_no_output_and_the_engines_need_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """--to compiled keeps the package in the machine's cache folder: an --output is refused before anything loads,
    as a missing one is for the engines' exports."""
    for command, message in ((["--to", "compiled", "--output", str(tmp_path / "out")], "--to compiled takes no --output"),
                             (["--to", "ctranslate2"], "--to ctranslate2 needs --output")):
        with pytest.raises(SystemExit):
            main(["--checkpoint", str(tmp_path / "none.ckpt"), *command])
        assert message in capsys.readouterr().err


@pytest.mark.e2e
def test_a_decoder_compiled_for_the_machine_is_what_the_translate_command_runs_with_no_flag(trained: Path,
                                                                                             tmp_path: Path):
    """`python -m seq2seq.export --to compiled` builds the package (a line a kind) in this machine's cache folder; the
    translate command, with no flag, then decodes with it (its end line says compiled, no note of eager decoding),
    the translations those of the eager decoder (this model is sure of its choices), and a fresh process loading it
    imports no torch._dynamo (nothing compiles)."""
    env = {**python_env(), "XDG_CACHE_HOME": str(tmp_path / "cache")}  # (nothing kept from another test)
    built = subprocess.run([sys.executable, "-m", "seq2seq.export", "--checkpoint", str(trained), "--to", "compiled",
                            "--precision", "fp32"], capture_output=True, text=True, env=env, timeout=900)
    assert built.returncode == 0, built.stderr
    assert built.stderr.count("compiling the decoder ahead of time: ") == 8
    assert built.stdout.startswith(f"kept {tmp_path / 'cache'}/seq2seq/machine-")
    lines = [line.strip() for line in gzip.open(DEMO_DATA / "valid.en.gz", "rt", encoding="utf-8")][:40]
    (tmp_path / "in.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    outputs = {}
    for flag in ([], ["--compile", "off"]):
        run = subprocess.run([sys.executable, "-m", "seq2seq.translate", "--checkpoint", str(trained), "--input",
                              str(tmp_path / "in.en"), "--output", str(tmp_path / f"out{len(flag)}"), "--precision",
                              "fp32", *flag], capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr
        assert "note: " not in run.stderr
        assert (" (fp32 compiled, " in run.stderr) == (not flag), run.stderr
        outputs[len(flag)] = (tmp_path / f"out{len(flag)}").read_text(encoding="utf-8").splitlines()
    assert outputs[0] == outputs[2] and len(outputs[0]) == 40
    code = ("import sys\n"
            "from seq2seq.inference.translator import Translator\n"
            f"translator = Translator.from_checkpoint({str(trained)!r}, precision='fp32', workers=2, threads=1)\n"
            "print(translator.package is not None, 'torch._dynamo' in sys.modules)\n")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert fresh.stdout.split() == ["True", "False"], fresh.stderr


# ---- A multilingual model: the tag as each engine takes it -----------------------------------


def with_target_tag(checkpoint: Path, path: Path, target_tag: str) -> Path:
    """The checkpoint's weights as a model whose tags go where `target_tag` says (the same numbers either way)."""
    from seq2seq.checkpoint import load_checkpoint, read_inference

    loaded = read_inference(checkpoint, load_checkpoint(checkpoint))
    state_dict = {f"model.{name}": value for name, value in loaded.weights.items()}
    entry = inference_entry(state_dict=state_dict, config=loaded.config, tokenizer=loaded.tokenizer, src_lang="",
                            tgt_lang="", directions=loaded.directions, target_tag=target_tag)
    save_atomic({"state_dict": state_dict, CHECKPOINT_KEY: entry}, path)
    return path


@pytest.mark.parametrize("target_tag", ["encoder", "decoder"])
def test_a_multilingual_model_in_ctranslate2_translates_as_ours_with_the_tag_where_it_goes(
        target_tag: str, multilingual_run: Path, multi30k_lines, tmp_path: Path, capsys):
    """Greedy into German and into French: CTranslate2 given the tag first in the source (encoder side) or as the
    target prefix (decoder side) writes what ours writes, but for near-ties; the export says how to give it."""
    checkpoint = with_target_tag(multilingual_run / "checkpoints" / "best.ckpt", tmp_path / "m.ckpt", target_tag)
    main(["--checkpoint", str(checkpoint), "--to", "ctranslate2", "--output", str(tmp_path / "ct2")])
    said = capsys.readouterr().out
    assert "a multilingual model (en→de, en→fr, de→en, fr→en): " in said and "for de, fr, en" in said
    assert ("target_prefix" in said) == (target_tag == "decoder")
    translator = Translator.from_checkpoint(checkpoint, precision="fp32")
    tokenizer, reference = translator.tokenizer, reference_model(checkpoint)
    pieces = tokenizer.pieces()
    index = {piece: i for i, piece in enumerate(pieces)}
    engine = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    sources = multi30k_lines("val", "en", 40)[20:40]
    # 60 tokens at most, the tag aside (a forced tag gets a step of its own; CTranslate2 counts its prefix)
    search = SearchConfig(beam_size=1, length_penalty=0.0, max_len_a=0.0, max_len_b=60)
    for tgt in ("de", "fr"):
        chosen, tag = translator.for_target(tgt), tokenizer.tag_id(tgt)
        src = chosen.prepare_inputs(sources).ids
        ours = [hyps[0].tokens for hyps in chosen.translate_nbest(sources, search)]
        prefix = {"target_prefix": [[pieces[tag]]] * len(src)} if target_tag == "decoder" else {}
        results = engine.translate_batch([[pieces[i] for i in ids] for ids in src], beam_size=1,
                                         max_decoding_length=60 + len(prefix), suppress_sequences=[["<pad>"], ["<s>"]],
                                         **prefix)
        theirs = [[index[p] for p in result.hypotheses[0]] for result in results]
        if target_tag == "decoder":  # (CTranslate2 returns the prefix; the search ran from it, as ours did)
            assert all(t[0] == tag for t in theirs) and all(ids[0] != tag for ids in src)
            ours = [[tag, *o] for o in ours]
        else:
            assert all(ids[0] == tag for ids in src)
        assert len({tuple(o) for o in ours}) > len(sources) / 2  # they write, and vary
        problems = greedy_near_ties(reference, src, ours, theirs, precision="fp32", bos=BOS_ID, eos=EOS_ID)
        assert not problems, f"into {tgt}: " + "; ".join(problems)


def test_a_multilingual_model_in_hugging_face_reads_the_tag_from_the_text(multilingual_run: Path, tmp_path: Path):
    """MarianTokenizer takes a leading `>>fr<<` as the tag's one token, as our sources start, and MarianMTModel
    computes on it what ours does (random post-norm weights over the multilingual tokenizer: Marian hosts post-norm)."""
    from transformers import MarianMTModel, MarianTokenizer

    multilingual = Translator.from_checkpoint(multilingual_run / "checkpoints" / "best.ckpt", precision="fp32")
    tokenizer = multilingual.tokenizer
    model = random_model(tokenizer)
    state_dict = {f"model.{name}": value for name, value in model.state_dict().items()}
    entry = inference_entry(state_dict=state_dict, config=model.config, tokenizer=tokenizer.to_bytes(), src_lang="",
                            tgt_lang="", directions=multilingual.directions)
    save_atomic({"state_dict": state_dict, CHECKPOINT_KEY: entry}, tmp_path / "m.ckpt")
    folder = export_huggingface(tmp_path / "m.ckpt", tmp_path / "hf")
    hf_tokenizer, marian = MarianTokenizer.from_pretrained(folder), MarianMTModel.from_pretrained(folder).eval().double()
    assert {">>de<<", ">>fr<<", ">>en<<"} <= set(hf_tokenizer.supported_language_codes)
    ours = Translator(model=model, tokenizer=tokenizer, directions=multilingual.directions, precision="fp32")
    for tgt in ("de", "fr"):
        [src_ids] = ours.for_target(tgt).prepare_inputs(["A man is sleeping."]).ids
        assert hf_tokenizer(f">>{tgt}<< A man is sleeping.", add_special_tokens=False).input_ids == src_ids
        src, tgt_in = torch.tensor([src_ids]), torch.tensor([[BOS_ID, *tokenizer.encode_target(["Un homme."])[0]]])
        with torch.no_grad():
            expected = torch.log_softmax(model.double()(src, tgt_in), dim=-1)
            model.float()
            got = torch.log_softmax(marian(input_ids=src, decoder_input_ids=tgt_in).logits, dim=-1)
        assert torch.allclose(got, expected, atol=1e-9)
