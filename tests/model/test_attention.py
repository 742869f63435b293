"""Attention, masks and position encodings against naive float64 references."""

import math

import pytest
import torch
import torch.nn.functional as F

from seq2seq.model import MultiHeadAttention, causal_mask, padding_mask
from seq2seq.model.attention import attend_by_matmul
from seq2seq.model.positions import RelativePositionBias, Rotary, relative_position_bucket, sinusoidal_table


def naive_attention(attention: MultiHeadAttention, x, memory, mask, bias=None, rotary=None):
    """softmax(Q K^T / sqrt(d) + bias + mask) V, in float64, heads and positions spelled out as einsums."""
    w = {name: p.detach().double() for name, p in attention.named_parameters()}
    d_model = x.size(-1)
    heads, head_dim = attention.num_heads, attention.head_dim
    x, memory = x.double(), memory.double()
    q = x @ w["q_proj.weight"].T + w["q_proj.bias"]
    kv = memory @ w["kv_proj.weight"].T + w["kv_proj.bias"]
    k, v = kv[..., :d_model], kv[..., d_model:]

    def heads_of(t):
        return t.reshape(t.size(0), t.size(1), heads, head_dim).permute(0, 2, 1, 3)

    q, k, v = heads_of(q), heads_of(k), heads_of(v)
    if rotary is not None:
        q, k = naive_rotate(q), naive_rotate(k)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(head_dim)
    if bias is not None:
        scores = scores + bias.double()
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)
    out = out.permute(0, 2, 1, 3).reshape(x.size(0), x.size(1), d_model)
    return out @ w["out_proj.weight"].T + w["out_proj.bias"]


def naive_rotate(x, base=10000.0):
    """RoPE written as a rotation of each (x_i, x_{i+d/2}) pair by angle p * base^(-2i/d), in float64."""
    head_dim = x.size(-1)
    half = head_dim // 2
    out = torch.empty_like(x)
    for p in range(x.size(2)):
        for i in range(half):
            angle = p * base ** (-2 * i / head_dim)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[..., p, i], x[..., p, i + half]
            out[..., p, i] = a * c - b * s
            out[..., p, i + half] = a * s + b * c
    return out


def random_attention(seed=0, d_model=24, num_heads=3):
    torch.manual_seed(seed)
    attention = MultiHeadAttention(d_model=d_model, num_heads=num_heads, attention_dropout=0.0)
    with torch.no_grad():
        for p in attention.parameters():
            p.normal_(0, 0.3)
    return attention


@pytest.mark.parametrize("kind", ["self-padding", "self-causal", "cross", "bias", "rotary"])
def test_attention_matches_float64_reference(kind):
    attention = random_attention()
    torch.manual_seed(1)
    x = torch.randn(3, 7, 24)
    memory = x if kind != "cross" else torch.randn(3, 5, 24)
    tokens = torch.randint(4, 20, (3, memory.size(1)))
    tokens[1, 4:] = 0
    tokens[2, 2:] = 0
    mask = padding_mask(tokens, pad_id=0)
    if kind == "self-causal":
        mask = causal_mask(tokens, pad_id=0)
    bias, rotary = None, None
    if kind == "bias":
        bias = torch.randn(1, 3, 7, 7)
    if kind == "rotary":
        rotary = Rotary(head_dim=8, max_positions=16, base=10000.0)
    keys, values = attention.keys_values(memory, rotary=rotary)
    out = attention(x, keys=keys, values=values, mask=mask, position_bias=bias, rotary=rotary)
    expected = naive_attention(attention, x, memory, mask, bias=bias, rotary=rotary)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_an_attention_given_in_place_of_the_model_s_own_sees_the_queries_keys_and_values_and_is_projected_out():
    """MultiHeadAttention.forward with `attend` (the compiled step's kernel, model/compiled_step.py): the function gets
    the projected queries and the keys and values, its mask its own, and its joined heads go through the output
    projection; one spelling the masked attention gives that attention's output, and relative positions are refused
    (the function would not apply them)."""
    attention = random_attention()
    torch.manual_seed(2)
    x, memory = torch.randn(3, 4, 24), torch.randn(3, 5, 24)
    tokens = torch.randint(4, 20, (3, 5))
    tokens[1, 3:] = 0
    mask = padding_mask(tokens, pad_id=0)  # (B, 1, 1, S)
    keys, values = attention.keys_values(memory)
    seen = []

    def attend(queries, keys, values):  # (B, H, T, Dh), (B, H, S, Dh) each
        seen.append((queries.shape, keys.shape, values.shape))
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
        return out.transpose(1, 2).reshape(3, 4, 24)

    got = attention(x, keys=keys, values=values, mask=None, attend=attend)
    assert seen == [((3, 3, 4, 8), (3, 3, 5, 8), (3, 3, 5, 8))]
    torch.testing.assert_close(got, attention(x, keys=keys, values=values, mask=mask), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="no relative positions"):
        attention(x, keys=keys, values=values, mask=None, attend=attend, position_bias=torch.zeros(1, 3, 4, 5))


def test_mask_convention():
    tokens = torch.tensor([[5, 6, 0], [7, 0, 0]])
    assert padding_mask(tokens, pad_id=0)[:, 0, 0].tolist() == [[True, True, False], [True, False, False]]
    mask = causal_mask(tokens, pad_id=0)[:, 0]  # (B, T, T), True = may attend
    assert mask[0].tolist() == [[True, False, False], [True, True, False], [True, True, False]]
    assert mask[1].tolist() == [[True, False, False], [True, False, False], [True, False, False]]
    # Two new tokens after three cached ones: query i sees keys 0..3+i.
    offset_mask = causal_mask(torch.tensor([[5, 6]]), pad_id=0, offset=3)[0, 0]
    assert offset_mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_rotary_scores_depend_only_on_offset():
    rotary = Rotary(head_dim=16, max_positions=64, base=10000.0)
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16).double(), torch.randn(1, 1, 1, 16).double()
    rotary = rotary.double()

    def score(query_pos, key_pos):
        return (rotary(q, offset=query_pos) * rotary(k, offset=key_pos)).sum().item()

    for shift in (1, 7, 30):
        for query_pos, key_pos in ((5, 2), (3, 9), (0, 0)):
            assert score(query_pos + shift, key_pos + shift) == pytest.approx(score(query_pos, key_pos), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)  # but it does depend on the offset
    # Rotation keeps norms.
    assert rotary(q, offset=11).norm().item() == pytest.approx(q.norm().item())


def test_rotary_matches_naive_rotation():
    rotary = Rotary(head_dim=8, max_positions=16, base=10000.0).double()
    x = torch.randn(2, 3, 6, 8).double()
    torch.testing.assert_close(rotary(x), naive_rotate(x))


def test_t5_buckets_match_hand_computed_values():
    def bucket(rel, bidirectional=True):
        return relative_position_bucket(
            torch.tensor([rel]), bidirectional=bidirectional, num_buckets=32, max_distance=128
        ).item()

    # Bidirectional: 16 buckets a side, 8 exact offsets, then log-spaced up to 128.
    assert bucket(0) == 0
    assert bucket(-3) == 3  # 3 to the left
    assert bucket(3) == 19  # 16 + 3: keys to the right use the upper half
    assert bucket(-7) == 7
    assert bucket(-8) == 8  # first log bucket: 8 + floor(log(8/8)/log(16) * 8)
    assert bucket(-20) == 10  # 8 + floor(log(2.5)/log(16) * 8) = 8 + floor(2.64)
    assert bucket(-127) == 15  # 8 + floor(log(15.875)/log(16) * 8) = 8 + floor(7.98)
    assert bucket(-200) == 15  # beyond max_distance: the last bucket
    assert bucket(200) == 31
    # Unidirectional (decoder): 32 buckets, all for the past, 16 exact; the future maps to 0.
    assert bucket(-15, bidirectional=False) == 15
    assert bucket(-16, bidirectional=False) == 16
    assert bucket(-40, bidirectional=False) == 23  # 16 + floor(log(2.5)/log(8) * 16) = 16 + floor(7.05)
    assert bucket(5, bidirectional=False) == 0


def test_relative_bias_offsets_while_decoding():
    bias = RelativePositionBias(num_heads=2, bidirectional=False, num_buckets=8, max_distance=16)
    full = bias(6, 6)  # (1, H, 6, 6)
    step = bias(1, 6, offset=5)  # the last query alone, as in incremental decoding
    torch.testing.assert_close(step, full[:, :, 5:6])


def test_sinusoidal_table_is_the_papers():
    table = sinusoidal_table(max_positions=50, d_model=8)
    for pos in (0, 3, 49):
        for i in range(4):
            angle = pos / 10000 ** (2 * i / 8)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


@pytest.mark.parametrize("kind", ["self-causal", "cross", "bias", "rotary", "beams"])
@pytest.mark.parametrize("fp32", [False, True])
def test_attention_under_autocast_runs_in_the_precision_chosen(fp32: bool, kind: str, monkeypatch):
    """fp32_under_autocast: where gradients are taken, the attention itself (not the projections) runs in
    float32 inside a bf16 autocast region, relative-position bias and rotary positions included; forward
    and backward stay close to the float64 computation either way. Without gradients it stays bf16."""
    attention = random_attention()
    attention.fp32_under_autocast = fp32
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        mask = kwargs.get("attn_mask")
        seen.append((query.dtype, key.dtype, value.dtype, mask.dtype if mask is not None else None,
                     torch.is_autocast_enabled("cpu")))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    torch.manual_seed(1)
    x = torch.randn(6 if kind == "beams" else 3, 7, 24, requires_grad=True)
    memory = torch.randn(3, 5, 24) if kind in ("cross", "beams") else x
    tokens = torch.randint(4, 20, (3, memory.size(1)))
    tokens[1, 3:] = 0
    mask = causal_mask(tokens, pad_id=0) if memory is x else padding_mask(tokens, pad_id=0)
    bias = torch.randn(1, 3, 7, 7) if kind == "bias" else None
    rotary = Rotary(head_dim=8, max_positions=16, base=10000.0) if kind == "rotary" else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        keys, values = attention.keys_values(memory, rotary=rotary)
        out = attention(x, keys=keys, values=values, mask=mask, position_bias=bias, rotary=rotary)
        with torch.no_grad():
            attention(x, keys=keys, values=values, mask=mask, position_bias=bias, rotary=rotary)
    out.float().sum().backward()
    dtype = torch.float32 if fp32 else torch.bfloat16
    bias_dtype = dtype if bias is not None else torch.bool
    no_grad_bias = torch.bfloat16 if bias is not None else torch.bool
    assert seen == [(dtype, dtype, dtype, bias_dtype, not fp32),
                    (torch.bfloat16,) * 3 + (no_grad_bias, True)]  # no gradients: bf16 as autocast has it
    assert out.dtype == torch.bfloat16
    if kind == "beams":  # two hypotheses per sentence, sharing its memory row
        expected = naive_attention(attention, x.detach(), memory.repeat_interleave(2, dim=0),
                                   mask.repeat_interleave(2, dim=0))
    else:
        expected = naive_attention(attention, x.detach(), memory.detach(), mask, bias=bias, rotary=rotary)
    assert (out.double() - expected).abs().max() < 0.05 * expected.abs().max()  # bf16 projections either way
    assert x.grad is not None and torch.isfinite(x.grad).all()
    seen.clear()
    attention(x, keys=keys.float(), values=values.float(), mask=mask)  # no autocast: as given, whatever the flag
    assert seen[0][:3] == (torch.float32,) * 3 and not seen[0][4]


@pytest.mark.parametrize("queries_per_row", [1, 4])
def test_attend_by_matmul_matches_float64_reference(queries_per_row: int):
    """The decoding steps' attention (two batched matmuls) on keys that are strided views of a cache,
    a padding mask and several queries per key row (beams folded): float64 reference and SDPA alike."""
    torch.manual_seed(2)
    rows, heads, length, head_dim = 5, 3, 9, 8
    cache = torch.randn(2, 2, rows + 2, heads, length + 7, head_dim)  # (layers, k|v, rows, H, capacity, Dh)
    keys, values = cache[1, 0, :rows, :, :length], cache[1, 1, :rows, :, :length]
    queries = torch.randn(rows, heads, queries_per_row, head_dim)
    tokens = torch.randint(4, 20, (rows, length))
    tokens[1, 4:] = 0
    tokens[3, 1:] = 0
    mask = padding_mask(tokens, pad_id=0)
    out = attend_by_matmul(queries, keys, values, mask=mask)
    scores = torch.einsum("bhqd,bhkd->bhqk", queries.double(), keys.double()) / math.sqrt(head_dim)
    expected = torch.einsum("bhqk,bhkd->bhqd", scores.masked_fill(~mask, float("-inf")).softmax(-1), values.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask))
    torch.testing.assert_close(attend_by_matmul(queries, keys, values, mask=None).double(),
                               torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), values.double()),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_decoding_steps_attend_by_matmul_and_stay_close(dtype, monkeypatch):
    """On CPU, a bf16 decoding step with enough (sentence, head) matrices takes attend_by_matmul
    (cross-attention with folded beams included), and lands as close to float64 as SDPA does; float32,
    a longer query, and gradients keep SDPA."""
    attention = random_attention()
    taken = []
    monkeypatch.setattr("seq2seq.model.attention.attend_by_matmul",
                        lambda *args, **kwargs: taken.append(1) or attend_by_matmul(*args, **kwargs))
    monkeypatch.setattr("seq2seq.model.attention.MATMUL_ATTENTION_MATRICES", 6)  # 2 sentences x 3 heads
    torch.manual_seed(3)
    sentences, beams = 2, 3
    x = torch.randn(sentences * beams, 1, 24)
    memory = torch.randn(sentences, 5, 24)
    tokens = torch.randint(4, 20, (sentences, 5))
    tokens[1, 2:] = 0
    mask = padding_mask(tokens, pad_id=0)
    expected = naive_attention(attention, x, memory.repeat_interleave(beams, dim=0),
                               mask.repeat_interleave(beams, dim=0))
    low = attention.to(dtype)
    with torch.no_grad():
        keys, values = low.keys_values(memory.to(dtype))
        out = low(x.to(dtype), keys=keys, values=values, mask=mask)
        assert len(taken) == (1 if dtype == torch.bfloat16 else 0)
        monkeypatch.setattr("seq2seq.model.attention.MATMUL_ATTENTION_MATRICES", 10**9)
        by_sdpa = low(x.to(dtype), keys=keys, values=values, mask=mask)
    error, sdpa_error = ((y.double() - expected).abs().max().item() for y in (out, by_sdpa))
    assert error <= 2 * sdpa_error + 1e-6
    assert error < (0.05 if dtype == torch.bfloat16 else 1e-5) * expected.abs().max().item()
    monkeypatch.setattr("seq2seq.model.attention.MATMUL_ATTENTION_MATRICES", 6)
    taken.clear()
    with torch.no_grad():
        low(torch.randn(sentences, 2, 24, dtype=dtype), keys=keys, values=values, mask=mask)  # two queries per row
    low(x.to(dtype), keys=keys, values=values, mask=mask)  # gradients on
    assert not taken


@pytest.mark.parametrize("by_matmul", [True, False])
def test_one_query_a_row_attends_as_the_machine_chose(by_matmul, monkeypatch):
    """MultiHeadAttention.one_query_by_matmul (chosen from precision.one_query_sdpa) sends a bf16 step with one
    query per row of keys to SDPA where False; folded beams take the matmuls either way; the outputs agree."""
    attention = random_attention().to(torch.bfloat16)
    taken = []
    monkeypatch.setattr("seq2seq.model.attention.attend_by_matmul",
                        lambda *args, **kwargs: taken.append(1) or attend_by_matmul(*args, **kwargs))
    monkeypatch.setattr("seq2seq.model.attention.MATMUL_ATTENTION_MATRICES", 6)
    attention.one_query_by_matmul = by_matmul
    torch.manual_seed(4)
    memory = torch.randn(2, 5, 24).to(torch.bfloat16)
    mask = padding_mask(torch.tensor([[5, 6, 7, 8, 9], [5, 6, 0, 0, 0]]), pad_id=0)
    with torch.no_grad():
        keys, values = attention.keys_values(memory)
        x = torch.randn(2, 1, 24).to(torch.bfloat16)
        one = attention(x, keys=keys, values=values, mask=mask)
        assert len(taken) == (1 if by_matmul else 0)
        attention(torch.randn(6, 1, 24).to(torch.bfloat16), keys=keys, values=values, mask=mask)  # 3 beams
        assert len(taken) == (2 if by_matmul else 1)
        attention.one_query_by_matmul = not by_matmul
        other = attention(x, keys=keys, values=values, mask=mask)
    assert len(taken) == 2  # flipped: the matmuls once more where SDPA ran, or SDPA where they did
    torch.testing.assert_close(one.float(), other.float(), atol=0.03, rtol=0.03)
