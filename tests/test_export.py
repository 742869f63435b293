"""Tests for seq2seq.export: a checkpoint exported to CTranslate2 or to Hugging Face Marian computes
what ours computes.

Two checks, each where it cannot be flaky:
- every exportable variant: CTranslate2's teacher-forced log-probabilities (score_batch) of real
  Multi30k pairs equal ours (float64) within 1e-4, on random weights with every parameter, norms and
  biases included, perturbed, so a transposed, swapped or missing tensor shows at once;
- search: on a model trained for a few hundred steps (decisive distributions), greedy and beam-4
  outputs equal ours token for token but for near-ties, which our own model confirms are ties;
- int8: the exported weights are exactly the per-row quantization of ours (scored in float32).
"""

import copy
import gzip
from pathlib import Path

import ctranslate2
import pytest
import torch
from conftest import DEMO_DATA

from seq2seq.checkpoint import CHECKPOINT_KEY, inference_entry, save_atomic
from seq2seq.export import ExportError, ctranslate2_refusal, export_ctranslate2, export_huggingface, main
from seq2seq.model import Transformer, TransformerConfig
from seq2seq.search import SearchConfig
from seq2seq.tokenizer import BOS_ID, EOS_ID, Tokenizer
from seq2seq.translator import Translator

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
    sources = [tokenizer.encode([de])[0][:60] for de, _ in texts]
    targets = [tokenizer.encode([en])[0][:60] for _, en in texts]
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
    sp_pieces = [[translator.tokenizer.pieces()[i] for i in ids] for ids in translator.tokenizer.encode(sources)]
    results = engine.translate_batch(sp_pieces, beam_size=beam_size, length_penalty=0.0, max_decoding_length=127,  # the model reads BOS + 126 tokens: max_positions 128
                                     suppress_sequences=[["<pad>"], ["<s>"]])
    index = {piece: i for i, piece in enumerate(translator.tokenizer.pieces())}
    return [[index[p] for p in result.hypotheses[0]] for result in results]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_greedy_and_beam_equal_ours_but_for_near_ties(trained: Path, tmp_path: Path):
    """Our search and CTranslate2's on the same weights (a trained model: decisive distributions) give the
    same outputs, except where two choices tie within the engines' rounding: a greedy output may differ
    only where, after the same prefix, our float64 model rates both tokens alike, and a beam output only
    where our model rates both whole outputs alike. Which near-ties flip depends on the CPU's kernels;
    that outputs differ only at near-ties does not."""
    with gzip.open(DEMO_DATA / "test.en.gz", "rt", encoding="utf-8") as f:
        sources = f.read().split("\n")[:60]
    translator = Translator.from_checkpoint(trained)
    folder = export_ctranslate2(trained, tmp_path / "fp32")
    assert (folder / "source.spm").read_bytes() == translator.tokenizer.to_bytes()
    model = translator.model
    for beam_size in (1, 4):
        search = SearchConfig(beam_size=beam_size, length_penalty=0.0, max_len_a=0.0, max_len_b=126)
        ours = [hyps[0].tokens for hyps in translator.translate_nbest(sources, search)]
        theirs = ct2_translate(folder, translator, sources, beam_size=beam_size)
        differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
        assert len(differ) < len(sources) / 2, f"beam {beam_size}: {len(differ)} of {len(sources)} differ"
        for i in differ:
            src = translator.tokenizer.encode([sources[i]])[0]
            if beam_size == 1:  # the first token where they part, after the same prefix
                at = first_difference(ours[i], theirs[i])
                gap = our_log_probs(model, src, ours[i])[at] - our_log_probs(model, src, theirs[i])[at]
                assert abs(gap) < 1e-3, f"greedy, sentence {i}, token {at}: not a near-tie ({gap:.2e})"
            else:  # ranked by raw log-probability: the whole outputs tie
                gap = sum(our_log_probs(model, src, ours[i])) - sum(our_log_probs(model, src, theirs[i]))
                assert abs(gap) < 1e-2, f"beam 4, sentence {i}: not a near-tie ({gap:.2e})"


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
    sources = [tokenizer.encode([de])[0][:60] for de, _ in pairs[:20]]
    targets = [tokenizer.encode([en])[0][:60] for _, en in pairs[:20]]
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
    src = torch.tensor(tokenizer.encode([pairs[0][0]]))
    tgt_in = torch.tensor([[BOS_ID, *tokenizer.encode([pairs[0][1]])[0]]])
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
    # Our models read the source without EOS: add_special_tokens=False (MarianTokenizer appends one).
    batch = hf_tokenizer(sources, add_special_tokens=False, padding=True, return_tensors="pt")
    assert [row[mask.bool()].tolist() for row, mask in zip(batch.input_ids, batch.attention_mask, strict=True)] == (
        translator.tokenizer.encode(sources))
    for beam_size in (1, 4):
        search = SearchConfig(beam_size=beam_size, length_penalty=0.0, max_len_a=0.0, max_len_b=126)
        ours = translator.translate_nbest(sources, search)
        with torch.no_grad():
            generated = marian.eval().generate(**batch, num_beams=beam_size, max_new_tokens=127, do_sample=False,
                                             length_penalty=0.0, early_stopping=True)  # ranked by log-prob, as ours
        assert hf_tokenizer.batch_decode(generated, skip_special_tokens=True) == [hyps[0].text for hyps in ours]
