"""Multi-head attention (self and cross) over `scaled_dot_product_attention`, and the decoding cache.

Mask convention, used everywhere in this package: a boolean tensor, True = this query MAY attend to
this key. It is what `torch.nn.functional.scaled_dot_product_attention` expects, so masks go to
the kernel unchanged. Shapes broadcast to (B, H, Tq, Tk): a source padding mask is (B, 1, 1, S),
the decoder's causal-and-padding mask is (B, 1, T, T).
"""

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.model.positions import Rotary


def padding_mask(tokens: Tensor, *, pad_id: int) -> Tensor:
    """(B, T) token ids -> (B, 1, 1, T) mask that lets every query see the real tokens only."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(tokens: Tensor, *, pad_id: int, offset: int = 0) -> Tensor:
    """(B, T) target ids -> (B, 1, T, offset+T): query i (at position offset+i) sees keys 0..offset+i.

    Keys before `offset` are cached positions, assumed real (the decoder is fed unpadded prefixes
    step by step); padding among the new tokens is masked as keys, but for position 0: the decoder's
    start token, real even where it is the pad id (a Marian model starts its decoder from pad).
    """
    length = tokens.size(1)
    query_pos = torch.arange(offset, offset + length, device=tokens.device)[:, None]
    key_pos = torch.arange(offset + length, device=tokens.device)[None, :]
    causal = key_pos <= query_pos  # (T, offset+T)
    is_real = tokens != pad_id
    if offset:
        is_real = torch.cat((is_real.new_ones(tokens.size(0), offset), is_real), dim=1)
    else:
        is_real[:, 0] = True
    return causal[None, None] & is_real[:, None, None, :]


Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
"""attend(queries (R, H, T, Dh), keys, values (N, H, S, Dh)) -> the heads' outputs joined, (R, T, H * Dh), before the
output projection; N = R, or R / K for K beams a sentence, its rows adjacent: an attention given to
`MultiHeadAttention.forward` (and the layers) in place of its own, which sees the positions it was made for (its own
mask or lengths). The compiled decoding step's (model/compiled_step.py): its kernel, or the attention written out."""


class MultiHeadAttention(nn.Module):
    """Queries from `x`, keys and values from `x` (self) or the encoder output (cross).

    Keys and values are projected by `keys_values()` separately from the attention itself, so the
    decoder can cache them: its self-attention appends one position per step, its cross-attention
    projects the source once per sentence.

    Keys may have fewer rows than the queries: beam search keeps one row of cross-attention keys per
    sentence (N) and K query rows per sentence (R = N * K, sentence-major). The K beams then attend
    as K queries against their sentence's keys (beams folded into the query length), so the source
    keys are never copied per beam.

    `fp32_under_autocast`: under autocast, and where gradients are taken, the attention itself (not
    the projections) runs in float32. Set per machine by what turns autocast on (training): torch's
    CPU attention backward can run slower in bf16 than in float32 even where bf16 matmuls are faster.
    Without gradients (validation's decoding) bf16 attention is as fast, and casting a growing
    key/value cache to float32 at every step would not be.
    """

    fp32_under_autocast = False

    def __init__(self, *, d_model: int, num_heads: int, attention_dropout: float, bias: bool = True):
        super().__init__()
        self.one_query_by_matmul = True
        """A bf16 decoding step on CPU with one query per row of keys (self-attention; cross-attention without
        beams) attends by `attend_by_matmul` (else SDPA). Chosen per model by what prepares it for inference
        (`Transformer.attend_one_query_by_matmul`, from precision.one_query_sdpa's timed verdict: which of the
        two is faster differs by CPU). Several queries per row of keys (beams folded) always take the matmuls."""
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.attention_dropout = attention_dropout
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.kv_proj = nn.Linear(d_model, 2 * d_model, bias=bias)  # one matmul for keys and values
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.qkv_proj: nn.Module | None = None  # fuse_projections: self-attention's three in one, for inference

    def fuse_projections(self) -> None:
        """Self-attention for inference: q_proj and kv_proj replaced by one qkv_proj, their weights stacked,
        so that `self_projections` takes one matmul where it took two. At one row a step the call costs
        more than its arithmetic (docs/performance/kernels.md#fused-projections), and
        the numbers are the same: each output is the same dot product. Again, or on projections already
        converted for inference (packed, int8): nothing to do."""
        q_proj, kv_proj = self.q_proj, self.kv_proj
        if self.qkv_proj is not None or type(q_proj) is not nn.Linear or type(kv_proj) is not nn.Linear:
            return
        fused = nn.Linear(q_proj.in_features, q_proj.out_features + kv_proj.out_features,
                          bias=q_proj.bias is not None, device=q_proj.weight.device, dtype=q_proj.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat((q_proj.weight, kv_proj.weight)))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat((q_proj.bias, kv_proj.bias)))
        fused.requires_grad_(False)
        self.qkv_proj, self.q_proj, self.kv_proj = fused, None, None  # type: ignore[assignment]

    def split_heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)

    def keys_values(self, x: Tensor, *, rotary: Rotary | None = None, offset: int = 0) -> tuple[Tensor, Tensor]:
        keys, values = self.kv_proj(x).chunk(2, dim=-1)  # (B, T, D) each
        return self._heads(keys, values, rotary=rotary, offset=offset)

    def split_keys_values(self, projected: Tensor) -> tuple[Tensor, Tensor]:
        """kv_proj's output (B, T, 2D), computed elsewhere (Decoder.cross_kv_proj's slice) -> keys and values
        (B, H, T, Dh) each, unrotated (cross-attention's)."""
        keys, values = projected.chunk(2, dim=-1)  # (B, T, D) each
        return self._heads(keys, values, rotary=None, offset=0)

    def self_projections(self, x: Tensor, *, rotary: Rotary | None = None,
                         offset: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's queries, keys and values of x (B, T, D): (B, H, T, Dh) each, the keys rotated
        (the queries are in `forward`, after beams are folded)."""
        if self.qkv_proj is None:
            queries = self.split_heads(self.q_proj(x))
            return queries, *self.keys_values(x, rotary=rotary, offset=offset)
        queries, keys, values = self.qkv_proj(x).chunk(3, dim=-1)  # (B, T, D) each
        return self.split_heads(queries), *self._heads(keys, values, rotary=rotary, offset=offset)

    def _heads(self, keys: Tensor, values: Tensor, *, rotary: Rotary | None, offset: int) -> tuple[Tensor, Tensor]:
        keys, values = self.split_heads(keys), self.split_heads(values)  # (B, H, T, Dh)
        if rotary is not None:
            keys = rotary(keys, offset=offset)
        return keys, values

    def forward(
        self,
        x: Tensor,
        *,
        keys: Tensor,
        values: Tensor,
        mask: Tensor | None,
        position_bias: Tensor | None = None,
        rotary: Rotary | None = None,
        offset: int = 0,
        queries: Tensor | None = None,
        attend: Attend | None = None,
    ) -> Tensor:
        # x: (B, Tq, D); keys, values: (B, H, Tk, Dh); mask: bool, broadcastable to (B, H, Tq, Tk);
        # queries: x's, (B, H, Tq, Dh), where the caller projected them (self_projections; the alignments' weights);
        # attend: the attention in place of the masked one below (`mask` unused; no relative positions)
        if queries is None:
            queries = self.split_heads(self.q_proj(x))  # (R, H, Tq, Dh)
        if attend is not None:
            if position_bias is not None or rotary is not None:
                raise ValueError("an attention given in place of the model's own takes no relative positions")
            return self.out_proj(attend(queries, keys, values))  # (R, Tq, D)
        rows, _, length, _ = queries.shape
        sentences = keys.size(0)
        beams = rows // sentences if sentences else 1
        if beams != 1:
            if rows != beams * sentences or position_bias is not None or rotary is not None:
                raise ValueError(f"{rows} query rows cannot share the keys of {sentences} sentences"
                                 + (" with relative positions" if rows == beams * sentences else ""))
            queries = fold_beams(queries, sentences=sentences)  # (N, H, K*Tq, Dh)
        if rotary is not None:
            queries = rotary(queries, offset=offset)
        device = queries.device.type
        in_fp32 = self.fp32_under_autocast and torch.is_autocast_enabled(device) and torch.is_grad_enabled()
        if in_fp32:
            queries, keys, values = queries.float(), keys.float(), values.float()
        attn_mask = mask
        if position_bias is not None:
            # SDPA takes one additive float mask: the bias where attending is allowed, -inf elsewhere.
            attn_mask = position_bias.to(queries.dtype)
            if mask is not None:
                attn_mask = attn_mask.masked_fill(~mask, float("-inf"))
        if length == 1 and attn_mask is mask and attends_by_matmul(queries, key_rows=keys.size(0),
                                                                  num_heads=self.num_heads, queries_per_row=beams,
                                                                  one_query_by_matmul=self.one_query_by_matmul):
            out = attend_by_matmul(queries, keys, values, mask=mask)  # (N, H, K, Dh)
        else:
            with torch.autocast(device, enabled=False) if in_fp32 else nullcontext():
                out = F.scaled_dot_product_attention(
                    queries,
                    keys,
                    values,
                    attn_mask=attn_mask,
                    dropout_p=self.attention_dropout if self.training else 0.0,
                )  # (N, H, K*Tq, Dh)
        if beams != 1:
            out = unfold_beams(out, beams=beams)  # (R, H, Tq, Dh)
        return self.out_proj(out.transpose(1, 2).reshape(rows, length, -1))  # (R, Tq, D)


    def weights(self, queries: Tensor, *, keys: Tensor, mask: Tensor | None) -> Tensor:
        """The attention probabilities forward computes (float32 at least, no dropout), (B, H, Tq, Tk), for reading
        rather than computing with (SDPA does not return them); queries: (B, H, Tq, Dh) as forward takes them,
        one query row per key row; no relative positions (cross-attention has none)."""
        dtype = torch.promote_types(queries.dtype, torch.float32)
        scores = queries.to(dtype) @ keys.to(dtype).transpose(-1, -2) * self.head_dim**-0.5  # (B, H, Tq, Tk)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(dim=-1)


MATMUL_ATTENTION_MATRICES = 64
"""A bf16 decoding step on CPU (one query per row, beams folded) attends by `attend_by_matmul` rather
than SDPA from this many (sentence, head) matrices on, where torch's bf16 SDPA kernel for CPU is the slower
(at one query a row the machine decides, per model: MultiHeadAttention.one_query_by_matmul;
docs/performance/kernels.md#attention). float32 keeps SDPA: there the two are even, and its
outputs stay what they were."""


def attends_by_matmul(x: Tensor, *, key_rows: int, num_heads: int, queries_per_row: int,
                      one_query_by_matmul: bool) -> bool:
    """Whether a decoding step's attention over `key_rows` rows of keys, with `queries_per_row` queries each
    (beams folded), runs `attend_by_matmul` (x: its queries or input, for their dtype and device;
    `one_query_by_matmul`: the attention's own choice at one query a row)."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and key_rows * num_heads >= MATMUL_ATTENTION_MATRICES
            and (queries_per_row > 1 or one_query_by_matmul))


def attend_by_matmul(queries: Tensor, keys: Tensor, values: Tensor, *, mask: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(Dh)) v as two batched matmuls, without gradients: (N, H, Tq, Dh) from
    queries (N, H, Tq, Dh), keys and values (N, H, Tk, Dh) and a boolean mask broadcastable to
    (N, H, Tq, Tk). Every query row must see at least one key (a fully masked row would be NaN where
    SDPA gives 0). Keys and values should be dense per (sentence, head): torch's batched matmuls
    copy strided views first (hence `DecoderState.extend(whole=True)`). Scores and probabilities stay
    in the inputs' dtype (bf16 matmuls accumulate in float32, softmax computes in float32), as SDPA's do."""
    scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(queries.size(-1) ** -0.5)  # (N, H, Tq, Tk)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), values)


def fold_beams(queries: Tensor, *, sentences: int) -> Tensor:
    """(N*K, H, Tq, Dh), the K rows of a sentence adjacent -> (N, H, K*Tq, Dh)."""
    rows, heads, length, head_dim = queries.shape
    folded = queries.view(sentences, rows // sentences, heads, length, head_dim).transpose(1, 2)
    return folded.reshape(sentences, heads, -1, head_dim)


def unfold_beams(out: Tensor, *, beams: int) -> Tensor:
    """(N, H, K*Tq, Dh) -> (N*K, H, Tq, Dh): the inverse of fold_beams."""
    sentences, heads, _, head_dim = out.shape
    return out.view(sentences, heads, beams, -1, head_dim).transpose(1, 2).reshape(sentences * beams, heads, -1,
                                                                                   head_dim)


CACHE_GROWTH = 8
"""Positions added to the self-attention cache when it is full: a copy every 8 steps, and a decoding step
by matmuls (which attends over the whole capacity, see `extend`) wastes at most 7 positions."""


class DecoderState:
    """What incremental decoding keeps between steps: per decoder layer, the self-attention keys and
    values of every target position fed so far, and the cross-attention keys and values of the source.

    Rows are hypotheses (R); `reorder` selects, shuffles and duplicates them (beam search) or drops
    finished ones. The self-attention cache is one preallocated buffer per layer, (keys|values, R, H,
    capacity, Dh): each step writes its position in place, the capacity grows by CACHE_GROWTH positions
    when full, and a reorder gathers each layer's filled part into one spare buffer of a layer's shape,
    which then takes that layer's place while the layer's old buffer becomes the spare for the next
    layer. So a step neither concatenates nor allocates, and the cache holds L + 1 layer buffers, where a
    spare for all layers at once made it 2L (beam search's peak memory is mostly this cache). Positions past
    `length` always hold finite numbers (zeros when a buffer is made).

    Cross-attention keys and values, (N, H, S, Dh), have one row per *sentence*, shared by its
    K = R / N hypotheses (see MultiHeadAttention): a reorder within sentences leaves them alone, and
    `reorder(..., sentences=)` drops the rows of finished sentences.
    """

    def __init__(self) -> None:
        self.length = 0
        """Number of target positions cached so far."""
        self.rows = 0
        self.cross_keys: list[Tensor] = []
        self.cross_values: list[Tensor] = []
        self._layers: list[Tensor] = []  # per layer (2, rows capacity, H, capacity, Dh)
        self._spare: Tensor | None = None  # a layer's shape: where the next reorder writes a layer

    def extend(self, layer: int, keys: Tensor, values: Tensor, *, num_layers: int,
               whole: bool = False) -> tuple[Tensor, Tensor]:
        """Write `layer`'s keys/values of the new positions, (R, H, T, Dh) each, after the `length`
        cached ones; return all of them, (R, H, length + T, Dh), as views of the cache. `whole`: the
        views span the whole capacity, (R, H, capacity, Dh), dense per (row, head) where the filled
        part alone is strided (batched matmuls would copy it): the caller masks the positions from
        length + T on (`capacity_for` tells the capacity beforehand).

        The decoder calls this for every layer, then `advance(T)`.
        """
        rows, heads, new, head_dim = keys.shape
        end = self.length + new
        cache = self._reserve(num_layers=num_layers, rows=rows, heads=heads, end=end, head_dim=head_dim,
                              dtype=keys.dtype, device=keys.device)[layer]
        self.rows = rows
        cache[0, :rows, :, self.length : end] = keys
        cache[1, :rows, :, self.length : end] = values
        filled = slice(None) if whole else slice(0, end)
        return cache[0, :rows, :, filled], cache[1, :rows, :, filled]

    def capacity_for(self, *, new: int, num_layers: int, rows: int, heads: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device) -> int:
        """The capacity (positions) the cache has once `new` positions are added: grown now if need be."""
        return self._reserve(num_layers=num_layers, rows=rows, heads=heads, end=self.length + new,
                             head_dim=head_dim, dtype=dtype, device=device)[0].size(3)

    def _reserve(self, *, num_layers: int, rows: int, heads: int, end: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> list[Tensor]:
        layers = self._layers
        # (the layers' row capacities may differ: reorders pass buffers from layer to layer)
        if (len(layers) != num_layers or end > layers[0].size(3) or rows > min(cache.size(1) for cache in layers)
                or layers[0].dtype != dtype):
            self._resize(num_layers=num_layers, rows=rows, heads=heads, capacity=end, head_dim=head_dim,
                         dtype=dtype, device=device)
        return self._layers

    def advance(self, new: int) -> None:
        self.length += new

    def _resize(self, *, num_layers: int, rows: int, heads: int, capacity: int, head_dim: int,
                dtype: torch.dtype, device: torch.device) -> None:
        """Every layer's buffer made anew for `capacity` positions and `rows` rows, its filled part copied
        over, one layer after the other (so that only one layer's old buffer is held beside the new ones)."""
        if self._layers:  # room for the rows held now, not for those of an earlier, larger buffer: dropped
            rows = max(rows, self.rows)  # rows would be zero-filled again at every growth (greedy's long tails)
        capacity = (capacity + CACHE_GROWTH - 1) // CACHE_GROWTH * CACHE_GROWTH
        self._spare = None
        for layer in range(num_layers):
            cache = torch.empty(2, rows, heads, capacity, head_dim, dtype=dtype, device=device)
            if layer < len(self._layers) and self.length:
                cache[:, : self.rows, :, : self.length] = self._layers[layer][:, : self.rows, :, : self.length]
            cache[:, :, :, self.length :] = 0  # (the filled part is overwritten before it is read)
            if layer < len(self._layers):
                self._layers[layer] = cache
            else:
                self._layers.append(cache)
        del self._layers[num_layers:]

    def reorder(self, indices: Tensor, *, sentences: Tensor | None = None) -> "DecoderState":
        """In place: row j becomes what row indices[j] was; `sentences` likewise selects the
        cross-attention rows (None: the sentences are unchanged). Returns the state itself."""
        if sentences is not None:
            self.cross_keys = [t.index_select(0, sentences) for t in self.cross_keys]
            self.cross_values = [t.index_select(0, sentences) for t in self.cross_values]
        rows = indices.numel()
        filled = slice(0, self.length)
        spare = self._spare
        for layer, cache in enumerate(self._layers):
            if spare is None or spare.size(1) < rows or spare.shape[2:] != cache.shape[2:]:
                spare = cache.new_empty(2, max(rows, cache.size(1)), *cache.shape[2:])
                spare[:, :, :, self.length :] = 0
            torch.index_select(cache[:, : self.rows, :, filled], 1, indices, out=spare[:, :rows, :, filled])
            self._layers[layer], spare = spare, cache
        if self._layers:
            self._spare, self.rows = spare, rows
        return self
