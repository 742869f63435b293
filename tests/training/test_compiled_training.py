"""The compiled training step (training/compiled.py): the same loss and gradients as the eager step, dropout as
eager's in distribution, one graph for batches of every shape, and a verdict timed once per machine and kept."""

import json

import pytest
import torch

import seq2seq.training.compiled as compiled_module
from seq2seq.model import Transformer, TransformerConfig
from seq2seq.model.layers import Dropout
from seq2seq.training.compiled import compile_hidden_states, compiled_step_pays
from seq2seq.training.loss import training_loss

# Every variant the shipped configs train: pre-norm with sinusoids (multi30k), post-norm (wmt), learned
# positions, GELU, RMSNorm; one layer each side keeps the compile short.
TINY = dict(vocab_size=96, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=1, num_decoder_layers=1,
            dropout=0.0, attention_dropout=0.0, max_positions=64)


def batch(rows: int, src_len: int, tgt_len: int, *, seed: int) -> dict[str, torch.Tensor]:
    """Random ids with padded tails of random length (pad 0; ids from 4: past the specials)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, length in (("src", src_len), ("tgt", tgt_len + 1)):
        ids = torch.randint(4, TINY["vocab_size"], (rows, length), generator=generator)
        kept = torch.randint(2, length + 1, (rows, 1), generator=generator)
        out[name] = ids.masked_fill(torch.arange(length) >= kept, 0)
    tgt = out.pop("tgt")
    return {"src": out["src"], "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}


def loss_and_grads(model: Transformer, data: dict, hidden_states=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss, _, tokens = training_loss(model, **data, smoothing=0.1, hidden_states=hidden_states)
    (loss / tokens).backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("variant", [dict(norm_placement="pre"),  # (~30 s of compiling each: one in make test)
                                     pytest.param(dict(norm_placement="post", positions="learned", activation="gelu",
                                                       norm="rmsnorm"), marks=pytest.mark.e2e)])
def test_the_compiled_step_gives_the_eager_loss_and_gradients(variant: dict):
    """float32, no dropout: the same loss and every parameter's gradient to float32 rounding (inductor fuses and
    reorders the sums), on two batches of other shapes through one graph (dynamic shapes: no recompile)."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(**TINY, **variant)).train()
    compiled = compile_hidden_states(model)
    torch._dynamo.utils.counters.clear()
    for seed, shape in enumerate([(5, 9, 7), (3, 13, 11), (6, 4, 8)]):
        data = batch(*shape, seed=seed)
        eager_loss, eager_grads = loss_and_grads(model, data)
        loss, grads = loss_and_grads(model, data, compiled)
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
        for got, want in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] <= 2, dict(frames)  # the static first shape, then one dynamic graph for the rest


def test_dropout_under_compile_drops_at_its_rate_and_rescales():
    """Compiled, Dropout uses F.dropout (inductor draws the mask in the fused kernel): about p of the values
    dropped, the rest scaled by 1 / (1 - p), as eager; different masks from call to call."""
    dropout = Dropout(0.25).train()
    step = torch.compile(dropout, dynamic=False)
    x = torch.ones(200_000)
    first, second = step(x), step(x)
    dropped = (first == 0).float().mean().item()
    assert abs(dropped - 0.25) < 5 * (0.25 * 0.75 / x.numel()) ** 0.5  # five standard deviations
    assert torch.all((first == 0) | torch.isclose(first, torch.tensor(1 / 0.75)))
    assert not torch.equal(first, second)


def test_the_verdict_is_timed_once_per_machine_and_shape_and_kept(monkeypatch: pytest.MonkeyPatch):
    """Timed where no verdict is kept (compiled first, then eager), MARGIN asked; the second ask reads the file.
    Another precision or token budget is another shape, timed anew."""
    timed = []

    def seconds(config, device, *, precision, max_tokens, fp32_attention, fp32_residual, compiled):
        timed.append((precision, max_tokens, fp32_residual, compiled))
        return 1.0 if compiled else 1.5  # 1.5x: over the 1.25x asked

    monkeypatch.setattr(compiled_module, "step_seconds", seconds)
    config = TransformerConfig(**TINY)
    cpu = torch.device("cpu")
    verdict = compiled_step_pays(config, cpu, precision="bf16-mixed", max_tokens=4096, fp32_attention=True,
                                 fp32_residual=False)
    assert verdict.pays and "1.5x the speed of eager" in verdict.why
    assert timed == [("bf16-mixed", 4096, False, True), ("bf16-mixed", 4096, False, False)]
    again = compiled_step_pays(config, cpu, precision="bf16-mixed", max_tokens=4096, fp32_attention=True,
                               fp32_residual=False)
    assert again == verdict and len(timed) == 2  # kept: not timed again
    kept = verdict.why.rsplit("kept in ", 1)[1]
    assert json.loads(open(kept, encoding="utf-8").read())["bf16"] is True
    compiled_step_pays(config, cpu, precision="32-true", max_tokens=4096, fp32_attention=False, fp32_residual=False)
    assert len(timed) == 4
    compiled_step_pays(config, cpu, precision="bf16-mixed", max_tokens=4096, fp32_attention=True, fp32_residual=True)
    assert timed[4:] == [("bf16-mixed", 4096, True, True), ("bf16-mixed", 4096, True, False)]  # another step


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.e2e)])
def test_step_seconds_times_a_real_step(compiled: bool):
    """The timing itself, small: a float and the caller's random stream left where it was."""
    config = TransformerConfig(**TINY)
    torch.manual_seed(3)
    before = torch.rand(3)
    torch.manual_seed(3)
    seconds = compiled_module.step_seconds(config, torch.device("cpu"), precision="32-true", max_tokens=256,
                                           fp32_attention=False, fp32_residual=False, compiled=compiled, repeats=1)
    assert 0 < seconds < 60
    assert torch.equal(torch.rand(3), before)
