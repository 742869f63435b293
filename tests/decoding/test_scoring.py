"""seq2seq/decoding/scoring.py: teacher-forced token log-probabilities and cross-attention, and what the searches
report with them (SearchConfig.token_scores, .alignments), against computations done another way."""

import pytest
import torch

from seq2seq.decoding.config import SearchConfig
from seq2seq.decoding.scoring import LOGITS_CHUNK, alignment_layer, force_decode
from seq2seq.decoding.search import decode
from seq2seq.model import Transformer, TransformerConfig
from seq2seq.text.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from seq2seq.training.loss import label_smoothed_nll

IDS = {"bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID}


def random_model(**options) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=40, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
                               num_decoder_layers=3, dropout=0.0, max_positions=64, **options)
    model = Transformer(config).double().eval()
    with torch.no_grad():
        model.output_projection.weight[EOS_ID].mul_(3)  # outputs that end
    return model


def sources() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, 40, (5, 9), generator=g)
    for row, length in enumerate((9, 3, 6, 1, 7)):
        src[row, length:] = PAD_ID
    return src


def test_token_log_probs_are_the_teacher_forced_loss_computed_another_way():
    """The per-token log-probs equal minus the unsmoothed NLL of the training loss on the same batch, for
    targets of every length (the empty one: EOS alone), in chunks or not."""
    model, src = random_model(), sources()
    targets = [[5, 6, 7], [], [8, 9, 10, 11, 12, 13], [4], [7, 7]]
    tgt_in = torch.full((5, 7), PAD_ID)
    tgt_out = torch.full((5, 7), PAD_ID)
    for row, target in enumerate(targets):
        tgt_in[row, : len(target) + 1] = torch.tensor([BOS_ID, *target])
        tgt_out[row, : len(target) + 1] = torch.tensor([*target, EOS_ID])
    _, nll = label_smoothed_nll(model(src, tgt_in), tgt_out, smoothing=0.0, pad_id=PAD_ID)  # (B, T)
    for chunk in (LOGITS_CHUNK, 1):  # one call, and one row per call
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("seq2seq.decoding.scoring.LOGITS_CHUNK", chunk)
            forced = force_decode(model, model.encode(src), src != PAD_ID, targets, **IDS)
        for row, (target, f) in enumerate(zip(targets, forced, strict=True)):
            assert len(f.token_log_probs) == len(target) + 1 and f.source_positions is None
            torch.testing.assert_close(torch.tensor(f.token_log_probs, dtype=torch.float64),
                                       -nll[row, : len(target) + 1], rtol=1e-12, atol=1e-12)


def test_the_attention_read_is_the_one_the_layer_computes_with():
    """Per head, the probabilities times the values, heads joined, through out_proj: what the
    cross-attention layer returned; their mean over heads is what decode_with_attention gives."""
    model, src = random_model(), sources()
    tgt_in = torch.tensor([[BOS_ID, 5, 6], [BOS_ID, 7, PAD_ID]] + [[BOS_ID, 8, 9]] * 3)
    memory, src_mask = model.encode(src), src != PAD_ID
    layer = model.decoder.layers[1].cross_attn
    seen = {}

    def keep(_module, args, kwargs, out):
        seen.update(x=args[0], out=out, **kwargs)

    handle = layer.register_forward_hook(keep, with_kwargs=True)
    logits, attention = model.decode_with_attention(tgt_in, memory, src_mask, layer=1)
    handle.remove()
    torch.testing.assert_close(logits, model.decode(tgt_in, memory, src_mask))
    assert attention.shape == (5, 3, 9)
    torch.testing.assert_close(attention.sum(-1), torch.ones(5, 3, dtype=torch.float64))
    assert (attention[~src_mask[:, None, :].expand(-1, 3, -1)] == 0).all()  # padding gets nothing
    heads = layer.weights(seen["queries"], keys=seen["keys"], mask=seen["mask"]).double()  # (B, H, T, S)
    mixed = heads @ seen["values"]  # (B, H, T, Dh)
    torch.testing.assert_close(layer.out_proj(mixed.transpose(1, 2).reshape(5, 3, -1)), seen["out"])
    torch.testing.assert_close(heads.mean(1), attention)


@pytest.mark.parametrize("search", [SearchConfig(beam_size=1), SearchConfig(beam_size=4, nbest=3),
                                    SearchConfig(sampling=True, seed=3)], ids=["greedy", "beam", "sampling"])
def test_a_searchs_token_scores_sum_to_its_log_prob(search: SearchConfig):
    model, src = random_model(), sources()
    plain = decode(model, src, search, **IDS)
    asked = SearchConfig(**{**search.__dict__, "token_scores": True, "alignments": True})
    prefix = [[], [9, 9], [], [], []]
    for annotated, without in ((decode(model, src, asked, **IDS), plain),
                               (decode(model, src, asked, prefix=prefix, **IDS), None)):
        for i, hyps in enumerate(annotated):
            for h in hyps:
                assert len(h.token_log_probs) == len(h.tokens) + 1
                # the search sums float32 log-probs; the forced pass of this float64 model computes in float64
                assert sum(h.token_log_probs) == pytest.approx(h.log_prob, rel=1e-6, abs=1e-5)
                assert len(h.source_positions) == len(h.tokens)
                assert all(0 <= p < int((src[i] != PAD_ID).sum()) for p in h.source_positions)
            if without is not None:  # the same outputs as without the options
                assert [h.tokens for h in hyps] == [h.tokens for h in without[i]]
                assert [h.score for h in hyps] == [h.score for h in without[i]]
    assert all(h.token_log_probs is None and h.source_positions is None for hyps in plain for h in hyps)


def test_alignment_layer_is_the_penultimate():
    assert [alignment_layer(n) for n in (1, 2, 3, 6)] == [0, 0, 1, 4]


def test_word_indices_number_the_words_of_the_decoded_text(tokenizer: Tokenizer, multi30k_lines):
    texts = multi30k_lines("val", "de", 300) + ["Crème brûlée ½ „Zitat“ — 東京", "a  b"]
    for text, ids in zip(texts, tokenizer.encode_source(texts), strict=True):
        words = tokenizer.word_indices(ids)
        assert words == sorted(words) and (not words or words[0] == 0)
        spelled = [tokenizer.decode([[i for i, w in zip(ids, words, strict=True) if w == k]])[0].strip()
                   for k in range(max(words) + 1)]
        assert spelled == tokenizer.decode([ids])[0].split(" "), text  # spaces only: "120\xa0cm" is one word


def test_bare_spaces_at_the_end_spell_no_word(tokenizer: Tokenizer):
    """A search can end on a bare "▁" piece, which decoding drops: it belongs to no word of the text."""
    space = tokenizer.pieces().index("\u2581")
    ids = [*tokenizer.encode_source(["Ein Hund"])[0], space, space]
    words = tokenizer.word_indices(ids)
    assert words[-2:] == [1, 1] and max(words) == 1  # the last word, "Hund"


def test_translations_carry_word_alignments_in_bounds(tokenizer: Tokenizer):
    from seq2seq.inference.translator import Translator

    model = Transformer(TransformerConfig(vocab_size=tokenizer.vocab_size, d_model=32, num_heads=4, d_ff=64,
                                          num_encoder_layers=1, num_decoder_layers=2, dropout=0.0))
    translator = Translator(model=model, tokenizer=tokenizer, precision="fp32")
    texts = ["Ein Hund läuft über die Wiese .", "", "Zwei Männer"]
    search = SearchConfig(beam_size=2, max_len_a=0, max_len_b=8, alignments=True, token_scores=True)
    results = translator.translate_nbest(texts, search)
    assert results[1] == []
    for text, [t] in ((texts[0], results[0]), (texts[2], results[2])):
        assert t.alignment and all(0 <= i < len(text.split(" ")) and 0 <= j < len(t.text.split(" "))
                                   for i, j in t.alignment)
        assert t.alignment == sorted(set(t.alignment)) and len(t.token_scores) == len(t.tokens) + 1
    assert translator.translate_nbest(texts[:1], SearchConfig(beam_size=2))[0][0].alignment is None
