"""The training losses against the plain computation: full logits, log-softmax, float64."""

import pytest
import torch
import torch.nn.functional as F

from seq2seq.model import Transformer, TransformerConfig
from seq2seq.text.tokenizer import PAD_ID
from seq2seq.training.loss import (
    label_smoothed_nll,
    linear_label_smoothed_nll,
    linear_rdrop_loss,
    training_loss,
)


def test_label_smoothed_loss_matches_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.float64)
    target = torch.tensor([3, 5, PAD_ID, 7, 1, PAD_ID])
    loss, nll = label_smoothed_nll(logits, target, smoothing=0.1, pad_id=PAD_ID)
    ce = F.cross_entropy
    torch.testing.assert_close(loss.sum(), ce(logits, target, ignore_index=PAD_ID, label_smoothing=0.1, reduction="sum"))
    torch.testing.assert_close(nll.sum(), ce(logits, target, ignore_index=PAD_ID, reduction="sum"))
    assert loss[2] == 0 and nll[5] == 0


def reference(hidden, weight, target, smoothing):
    """Full logits, F.cross_entropy: summed smoothed loss, summed NLL, and the loss's gradients."""
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    logits = hidden @ weight.T
    loss = F.cross_entropy(logits, target, label_smoothing=smoothing, reduction="sum")
    nll = F.cross_entropy(logits.detach(), target, reduction="sum")
    loss.backward()
    return loss.detach(), nll, hidden.grad, weight.grad


def random_problem(rows: int, d_model: int = 12, vocab: int = 37, *, dtype=torch.float64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, d_model, dtype=dtype, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, d_model, dtype=dtype, generator=generator, requires_grad=True)
    target = torch.randint(0, vocab, (rows,), generator=generator)
    return hidden, weight, target


@pytest.mark.parametrize("chunk_rows", [1, 7, 50, 64, 1000])  # uneven, exact and larger-than-input chunks
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_fused_loss_matches_full_logits(chunk_rows: int, smoothing: float):
    hidden, weight, target = random_problem(50)
    loss, nll = linear_label_smoothed_nll(hidden, weight, target, smoothing=smoothing, chunk_rows=chunk_rows)
    (loss * 0.37).backward()  # a non-unit upstream gradient, as loss / tokens gives
    ref_loss, ref_nll, ref_grad_hidden, ref_grad_weight = reference(hidden, weight, target, smoothing)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll)
    torch.testing.assert_close(hidden.grad, 0.37 * ref_grad_hidden)
    torch.testing.assert_close(weight.grad, 0.37 * ref_grad_weight)
    assert not nll.requires_grad  # a logged quantity, not a second loss


def test_fused_loss_gradcheck():
    hidden, weight, target = random_problem(9, d_model=4, vocab=6)
    assert torch.autograd.gradcheck(
        lambda h, w: linear_label_smoothed_nll(h, w, target, smoothing=0.2, chunk_rows=4)[0], (hidden, weight)
    )


def test_fused_loss_with_a_bias_gradcheck():
    """Marian's output projection has a bias (final_logits_bias): its gradient, and the others', are exact."""
    hidden, weight, target = random_problem(9, d_model=4, vocab=6)
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda h, w, b: linear_label_smoothed_nll(h, w, target, bias=b, smoothing=0.2, chunk_rows=4)[0],
        (hidden, weight, bias),
    )
    loss, nll = linear_label_smoothed_nll(hidden, weight, target, bias=bias, smoothing=0.0)
    logits = hidden @ weight.T + bias
    torch.testing.assert_close(nll, torch.nn.functional.cross_entropy(logits, target, reduction="sum"))


def test_fused_loss_without_grad_and_without_rows():
    hidden, weight, target = random_problem(20)
    with torch.no_grad():
        loss, nll = linear_label_smoothed_nll(hidden, weight, target, smoothing=0.1, chunk_rows=6)
    ref_loss, ref_nll, _, _ = reference(hidden, weight, target, 0.1)
    torch.testing.assert_close((loss, nll), (ref_loss, ref_nll))
    loss, nll = linear_label_smoothed_nll(hidden[:0], weight, target[:0], smoothing=0.1)
    loss.backward()
    assert loss == 0 and nll == 0 and weight.grad.abs().sum() == 0


@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_loss_under_bf16_autocast(with_bias: bool):
    """Matmuls in bf16, softmax in float32: close to the float32 result (a bias's gradient too, which comes out of
    the weight's transposed matmul), gradients in the inputs' dtypes."""
    hidden, weight, target = random_problem(300, d_model=64, vocab=500, dtype=torch.float32)
    bias = torch.randn(500, requires_grad=True) if with_bias else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, nll = linear_label_smoothed_nll(hidden, weight, target, bias=bias, smoothing=0.1, chunk_rows=64)
    loss.backward()
    ref_hidden, ref_weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    ref_bias = bias.detach().requires_grad_() if bias is not None else None
    logits = ref_hidden @ ref_weight.T + (ref_bias if ref_bias is not None else 0.0)
    ref_loss = F.cross_entropy(logits, target, label_smoothing=0.1, reduction="sum")
    ref_nll = F.cross_entropy(logits.detach(), target, reduction="sum")
    ref_loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=2e-2, atol=0)
    torch.testing.assert_close(nll, ref_nll, rtol=2e-2, atol=0)
    pairs = [(hidden.grad, ref_hidden.grad), (weight.grad, ref_weight.grad)]
    if bias is not None:
        assert bias.grad.dtype == torch.float32
        pairs.append((bias.grad, ref_bias.grad))
    for grad, ref in pairs:
        assert (grad - ref).norm() <= 3e-2 * ref.norm()


def test_fused_loss_of_a_confident_model_matches_float64():
    """Logits spread over hundreds of nats (a trained model's): in float32 most probabilities lie below the
    smallest normal float, where exp_ clamps them (to avoid torch's slow path); loss and gradients still
    equal the float64 computation to float32 rounding."""
    hidden, weight, target = random_problem(200, d_model=16, vocab=300, dtype=torch.float32)
    with torch.no_grad():
        weight.mul_(40.0)  # logits with a standard deviation of ~160
    assert (hidden @ weight.T).std() > 100
    loss, nll = linear_label_smoothed_nll(hidden, weight, target, smoothing=0.1, chunk_rows=64)
    loss.backward()
    ref_loss, ref_nll, ref_grad_hidden, ref_grad_weight = reference(hidden.double(), weight.double(), target, 0.1)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(nll.double(), ref_nll, rtol=1e-5, atol=0)
    for grad, ref in ((hidden.grad, ref_grad_hidden), (weight.grad, ref_grad_weight)):
        torch.testing.assert_close(grad.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("marian", [False, True], ids=["ours", "marian-like"])
def test_training_loss_skips_padding_and_matches_full_logits(marian: bool):
    """Also for a Marian-like model: an output bias, pad the last id, and the decoder started from pad."""
    torch.manual_seed(0)
    pad = 30 if marian else PAD_ID
    config = TransformerConfig(
        vocab_size=31, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1, num_decoder_layers=2,
        dropout=0.0, pad_id=pad, output_bias=marian,
    )
    model = Transformer(config).double()
    if marian:
        torch.nn.init.normal_(model.output_projection.bias)
    src = torch.randint(4, 30, (3, 7))
    src[1, 4:] = pad
    tgt = torch.randint(4, 30, (3, 6))
    if marian:
        tgt[:, 0] = pad  # the decoder's start token
    tgt[0, 3:] = pad
    tgt[2, 5:] = pad
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    loss, nll, tokens = training_loss(model, src=src, tgt_in=tgt_in, tgt_out=tgt_out, smoothing=0.1)
    loss.backward()
    fused_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    per_token, per_token_nll = label_smoothed_nll(model(src, tgt_in), tgt_out, smoothing=0.1, pad_id=pad)
    per_token.sum().backward()
    assert tokens == (tgt_out != pad).sum() == 11
    assert per_token_nll.isfinite().all()
    torch.testing.assert_close(loss, per_token.sum())
    torch.testing.assert_close(nll, per_token_nll.sum())
    for fused, full in zip(fused_grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(fused, full)


@pytest.mark.parametrize("device,rows", [("cpu", 2**22 // 1000), ("meta", 2**26 // 1000)])
def test_chunks_fit_a_cpu_cache_and_are_large_on_other_devices(device: str, rows: int, monkeypatch):
    """The chunk size follows the device (`meta` stands in for a GPU, which wants large matmuls)."""
    seen = []
    monkeypatch.setattr("seq2seq.training.loss._LinearLabelSmoothedNLL.apply",
                        lambda hidden, weight, bias, target, smoothing, chunk_rows: seen.append(chunk_rows))
    linear_label_smoothed_nll(torch.empty(10, 8, device=device), torch.empty(1000, 8, device=device),
                              torch.zeros(10, dtype=torch.long, device=device), smoothing=0.1)
    assert seen == [rows]


def rdrop_reference(hidden, weight, bias, target, smoothing, alpha):
    """Full logits of both passes, F.cross_entropy and F.kl_div: R-Drop's summed loss, NLL and the loss's gradients."""
    hidden, weight, bias = (t.detach().requires_grad_() for t in (hidden, weight, bias))
    logits = hidden @ weight.T + bias  # (2N, V)
    pairs = target.size(0)
    both = torch.cat((target, target))
    log_p1, log_p2 = F.log_softmax(logits[:pairs], dim=-1), F.log_softmax(logits[pairs:], dim=-1)
    kl = (F.kl_div(log_p2, log_p1, log_target=True, reduction="sum")  # KL(p1 || p2)
          + F.kl_div(log_p1, log_p2, log_target=True, reduction="sum"))
    loss = F.cross_entropy(logits, both, label_smoothing=smoothing, reduction="sum") + alpha / 2 * kl
    nll = F.cross_entropy(logits.detach(), both, reduction="sum")
    loss.backward()
    return loss.detach(), nll, hidden.grad, weight.grad, bias.grad


@pytest.mark.parametrize("chunk_rows", [1, 7, 25, 1000])
@pytest.mark.parametrize("smoothing,alpha", [(0.0, 5.0), (0.1, 5.0), (0.1, 0.5), (0.2, 0.0)])
def test_rdrop_loss_matches_full_logits(chunk_rows: int, smoothing: float, alpha: float):
    hidden, weight, target = random_problem(50, seed=1)
    pairs = 25
    target = target[:pairs]
    bias = torch.randn(weight.size(0), dtype=torch.float64, requires_grad=True)
    loss, nll = linear_rdrop_loss(hidden, weight, target, bias=bias, smoothing=smoothing, alpha=alpha,
                                  chunk_rows=chunk_rows)
    (loss * 0.37).backward()
    ref_loss, ref_nll, ref_hidden, ref_weight, ref_bias = rdrop_reference(hidden, weight, bias, target, smoothing, alpha)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll)
    torch.testing.assert_close(hidden.grad, 0.37 * ref_hidden)
    torch.testing.assert_close(weight.grad, 0.37 * ref_weight)
    torch.testing.assert_close(bias.grad, 0.37 * ref_bias)
    assert not nll.requires_grad


def test_rdrop_loss_gradcheck_and_refusal():
    hidden, weight, target = random_problem(8, d_model=4, vocab=6, seed=2)
    assert torch.autograd.gradcheck(
        lambda h, w: linear_rdrop_loss(h, w, target[:4], smoothing=0.1, alpha=3.0, chunk_rows=3)[0], (hidden, weight)
    )
    with pytest.raises(ValueError, match="two passes' states"):
        linear_rdrop_loss(hidden, weight, target, smoothing=0.1, alpha=1.0)


def test_rdrop_loss_under_bf16_autocast_is_close_to_float32():
    """The matmuls in bf16, the softmax, KL and gradients in float32: near the float32 result."""
    hidden, weight, target = random_problem(64, d_model=32, vocab=200, dtype=torch.float32, seed=3)
    exact, _ = linear_rdrop_loss(hidden, weight, target[:32], smoothing=0.1, alpha=5.0)
    exact.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = linear_rdrop_loss(hidden, weight, target[:32], smoothing=0.1, alpha=5.0)
    low.backward()
    assert low.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.float32
    torch.testing.assert_close(low, exact, rtol=2e-2, atol=0)
    for got, want in zip((hidden.grad, weight.grad), grads, strict=True):
        assert (got - want).norm() < 0.05 * want.norm()


def test_training_loss_rdrop_without_dropout_is_twice_one_pass():
    """No dropout: both passes alike, the KL term 0, so R-Drop's loss, NLL, count and gradients are twice one pass's;
    with dropout the passes differ and the KL term adds to the loss."""
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=31, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                               num_decoder_layers=1, dropout=0.0, attention_dropout=0.0)
    model = Transformer(config).double()
    src, tgt = torch.randint(4, 31, (3, 7)), torch.randint(4, 31, (3, 6))
    tgt[0, 3:] = PAD_ID
    data = dict(src=src, tgt_in=tgt[:, :-1], tgt_out=tgt[:, 1:], smoothing=0.1)
    one, one_nll, one_tokens = training_loss(model, **data)
    one.backward()
    one_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    positions = (tgt[:, 1:] != PAD_ID).flatten().nonzero().squeeze(1)  # as collate gives them
    two, two_nll, two_tokens = training_loss(model, **data, rdrop_alpha=5.0, target_positions=positions)
    two.backward()
    assert two_tokens == 2 * one_tokens == 2 * 12
    torch.testing.assert_close(two, 2 * one)
    torch.testing.assert_close(two_nll, 2 * one_nll)
    for got, want in zip((p.grad for p in model.parameters()), one_grads, strict=True):
        torch.testing.assert_close(got, 2 * want)
    noisy = Transformer(TransformerConfig.from_dict({**config.to_dict(), "dropout": 0.3})).double()
    noisy.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.manual_seed(1)
        regularised, nll, _ = training_loss(noisy, **data, rdrop_alpha=5.0)
        torch.manual_seed(1)
        unregularised, nll_again, _ = training_loss(noisy, **data, rdrop_alpha=1e-12)
    assert regularised > unregularised and nll == nll_again  # the same two passes; the KL term > 0
