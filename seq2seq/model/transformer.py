"""The encoder-decoder Transformer of "Attention Is All You Need", with the common variants.

    src (B, S) ──embed·√d + pos──► Encoder ──► memory (B, S, D)
                                                  │ cross-attention keys/values
    tgt_in (B, T) ──embed·√d + pos──► Decoder ◄───┘ ──► output projection ──► logits (B, T, V)

Initialisation (as fairseq's transformer, with the paper's embedding scale in mind):
- every linear projection: Xavier-uniform weights, zero biases; an untied output projection
  N(0, d_model^-1/2), like the embedding it would otherwise share;
- token embeddings: N(0, d_model^-1/2), so that after the √d_model scale they have unit variance;
  the padding row is zero;
- DeepNorm (Wang et al. 2022, encoder-decoder case, N encoder / M decoder layers): residuals scaled
  by alpha = 0.81 (N^4 M)^(1/16) in the encoder and (3M)^(1/4) in the decoder, and the value, output
  and feed-forward projections initialised Xavier-normal with gain beta = 0.87 (N^4 M)^(-1/16)
  (encoder) or (12M)^(-1/4) (decoder); queries and keys keep gain 1.
"""

import math
from collections.abc import Callable
from functools import partial
from typing import cast

import torch
from torch import Tensor, nn

from seq2seq.model.attention import (
    Attend,
    DecoderState,
    MultiHeadAttention,
    attends_by_matmul,
    causal_mask,
    padding_mask,
)
from seq2seq.model.config import TransformerConfig
from seq2seq.model.layers import DecoderLayer, Dropout, EncoderLayer, FeedForward, make_norm
from seq2seq.model.positions import LearnedPositions, RelativePositionBias, Rotary, SinusoidalPositions


def deepnorm_constants(config: TransformerConfig) -> tuple[float, float, float, float]:
    """(encoder alpha, encoder beta, decoder alpha, decoder beta); all 1 for the other placements."""
    if config.norm_placement != "deepnorm":
        return 1.0, 1.0, 1.0, 1.0
    n, m = config.num_encoder_layers, config.num_decoder_layers
    return (
        0.81 * (n**4 * m) ** (1 / 16),
        0.87 * (n**4 * m) ** (-1 / 16),
        (3 * m) ** (1 / 4),
        (12 * m) ** (-1 / 4),
    )


def check_length(length: int, *, max_positions: int) -> None:
    """A one-line error for a sequence longer than the positions the model was built with."""
    if length > max_positions:
        raise ValueError(f"sequence of {length} tokens exceeds max_positions={max_positions}; "
                         "truncate the input or train a model with larger max_positions")


class Embedder(nn.Module):
    """Token embeddings scaled by √d_model, plus absolute positions when the config uses them.

    `fp32_under_autocast` False (the default): under bf16 autocast, and where gradients are taken (training),
    the embeddings are cast to bf16, and with them the residual stream that every layer adds to, the norms'
    outputs and the gradients that flow back along it. Autocast alone would keep that stream in float32 and cast
    each linear layer's input to bf16 and its gradient back, two passes over a (B, T, D) tensor per layer and
    direction; Megatron-LM's bf16 training keeps the stream in bf16 alike. The norms still compute their
    statistics in float32 (torch's kernels do, from a bf16 input), and the master weights stay float32. Set
    per model by Transformer.residual_in_fp32_under_autocast (the training option model.fp32_residual). float16
    autocast keeps a float32 stream (float16's range would overflow it); inference, without gradients, is
    untouched.
    """

    fp32_under_autocast = False

    def __init__(self, config: TransformerConfig, tokens: nn.Embedding):
        super().__init__()
        self.tokens = tokens
        self.scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0
        self.positions: nn.Module | None = None
        if config.positions == "sinusoidal":
            self.positions = SinusoidalPositions(max_positions=config.max_positions, d_model=config.d_model)
        elif config.positions == "learned":
            self.positions = LearnedPositions(max_positions=config.max_positions, d_model=config.d_model)
        self.dropout = Dropout(config.dropout)
        self.max_positions = config.max_positions

    def forward(self, tokens: Tensor, *, offset: int = 0) -> Tensor:
        # tokens: (B, T) -> (B, T, D)
        check_length(offset + tokens.size(1), max_positions=self.max_positions)
        x = self.tokens(tokens) * self.scale
        if self.positions is not None:
            x = x + self.positions(tokens.size(1), offset=offset)
        device = x.device.type
        if (not self.fp32_under_autocast and torch.is_grad_enabled() and torch.is_autocast_enabled(device)
                and torch.get_autocast_dtype(device) == torch.bfloat16):
            x = x.to(torch.bfloat16)
        return self.dropout(x)


def position_table_bytes(config: TransformerConfig) -> int:
    """Bytes of the position tables a Transformer of `config` computes rather than stores (float32 buffers: the
    encoder's and the decoder's sinusoids, or their rotary cos and sin), known before any is made: a checkpoint
    reader bounds them before it builds anything (tests/model/test_model.py checks this against a built model)."""
    if config.positions == "sinusoidal":
        return 2 * config.max_positions * config.d_model * 4
    if config.positions == "rotary":
        return 2 * 2 * config.max_positions * (config.d_model // config.num_heads // 2) * 4
    return 0


def relative_positions(config: TransformerConfig, *, bidirectional: bool) -> tuple[nn.Module | None, Rotary | None]:
    """The (relative bias, rotary) modules one stack needs; at most one of them is not None."""
    if config.positions == "relative":
        bias = RelativePositionBias(
            num_heads=config.num_heads,
            bidirectional=bidirectional,
            num_buckets=config.relative_buckets,
            max_distance=config.relative_max_distance,
        )
        return bias, None
    if config.positions == "rotary":
        rotary = Rotary(
            head_dim=config.d_model // config.num_heads, max_positions=config.max_positions, base=config.rotary_base
        )
        return None, rotary
    return None, None


class Encoder(nn.Module):
    def __init__(self, config: TransformerConfig, tokens: nn.Embedding):
        super().__init__()
        alpha = deepnorm_constants(config)[0]
        self.embed = Embedder(config, tokens)
        self.relative_bias, self.rotary = relative_positions(config, bidirectional=True)
        self.layers = nn.ModuleList(EncoderLayer(config, alpha=alpha) for _ in range(config.num_encoder_layers))
        self.final_norm = make_norm(config) if config.norm_placement in ("pre", "sandwich") else None

    def forward(self, src: Tensor, *, src_mask: Tensor, attend: Attend | None = None) -> Tensor:
        # src: (B, S); src_mask: (B, 1, 1, S); attend: the self-attention's in place of the masked one (EncoderLayer)
        x = self.embed(src)  # (B, S, D)
        bias = self.relative_bias(src.size(1), src.size(1)) if self.relative_bias is not None else None
        for layer in self.layers:
            x = layer(x, mask=src_mask, position_bias=bias, rotary=self.rotary, attend=attend)
        return self.final_norm(x) if self.final_norm is not None else x


class Decoder(nn.Module):
    def __init__(self, config: TransformerConfig, tokens: nn.Embedding):
        super().__init__()
        alpha = deepnorm_constants(config)[2]
        self.pad_id = config.pad_id
        self.embed = Embedder(config, tokens)
        self.relative_bias, self.rotary = relative_positions(config, bidirectional=False)
        self.layers = nn.ModuleList(DecoderLayer(config, alpha=alpha) for _ in range(config.num_decoder_layers))
        self.final_norm = make_norm(config) if config.norm_placement in ("pre", "sandwich") else None
        self.cross_kv_proj: nn.Module | None = None
        """Transformer.stack_cross_projections': every layer's cross-attention kv_proj in one, for the compiled step."""

    def forward(self, tgt_in: Tensor, *, memory: Tensor, src_mask: Tensor, state: DecoderState | None,
                cross_weights: tuple[int, list[Tensor]] | None = None) -> Tensor:
        # tgt_in: (R, T) new target tokens; memory: (N, S, D); src_mask: (N, 1, 1, S); R = N or N * beams;
        # cross_weights (layer, out): that layer's cross-attention probabilities are appended to out (DecoderLayer)
        offset = state.length if state is not None else 0
        length = tgt_in.size(1)
        x = self.embed(tgt_in, offset=offset)  # (B, T, D)
        # One new token attends to every cached position: no mask needed, and SDPA's fast path applies.
        self_mask = None if (offset and length == 1) else causal_mask(tgt_in, pad_id=self.pad_id, offset=offset)
        layers = cast(list[DecoderLayer], self.layers)
        whole = False  # self-attention over the cache's whole capacity, the unfilled positions masked
        if state is not None and self_mask is None and self.relative_bias is None and self.rotary is None:
            attention = layers[0].self_attn
            whole = attends_by_matmul(x, key_rows=x.size(0), num_heads=attention.num_heads, queries_per_row=1,
                                      one_query_by_matmul=attention.one_query_by_matmul)
            if whole:
                capacity = state.capacity_for(new=1, num_layers=len(layers), rows=x.size(0),
                                              heads=attention.num_heads, head_dim=attention.head_dim,
                                              dtype=x.dtype, device=x.device)
                self_mask = (torch.arange(capacity, device=x.device) <= offset)[None, None, None, :]  # (1, 1, 1, cap)
        bias = None
        if self.relative_bias is not None:
            bias = self.relative_bias(length, offset + length, offset=offset)  # (1, H, T, offset+T)
        first_call = state is None or not state.cross_keys
        for i, layer in enumerate(layers):
            if first_call:
                cross_kv = layer.cross_attn.keys_values(memory)  # (N, H, S, Dh) each
                if state is not None:
                    # Contiguous once, read at every step: a head's keys are strided views of the
                    # projection's output, which batched matmuls would copy each time (attend_by_matmul).
                    cross_kv = (cross_kv[0].contiguous(), cross_kv[1].contiguous())
                    state.cross_keys.append(cross_kv[0])
                    state.cross_values.append(cross_kv[1])
            else:
                assert state is not None  # not the first call: the state holds every layer's cross keys/values
                cross_kv = (state.cross_keys[i], state.cross_values[i])
            extend_cache = partial(state.extend, i, num_layers=len(layers), whole=whole) if state is not None else None
            x = layer(
                x,
                extend_cache=extend_cache,
                cross_kv=cross_kv,
                self_mask=self_mask,
                cross_mask=src_mask,
                position_bias=bias,
                rotary=self.rotary,
                offset=offset,
                cross_weights=cross_weights[1] if cross_weights is not None and cross_weights[0] == i else None,
            )
        if state is not None:
            state.advance(length)
        return self.final_norm(x) if self.final_norm is not None else x


class Transformer(nn.Module):
    """Encoder-decoder Transformer. Masks are built here from `pad_id`; callers pass token ids."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        d_model, vocab = config.d_model, config.vocab_size
        tgt_tokens = nn.Embedding(vocab, d_model, padding_idx=config.pad_id)
        src_tokens = tgt_tokens if config.tie_embeddings == "all" else nn.Embedding(vocab, d_model, padding_idx=config.pad_id)
        self.encoder = Encoder(config, src_tokens)
        self.decoder = Decoder(config, tgt_tokens)
        self.output_projection = nn.Linear(d_model, vocab, bias=config.output_bias)
        self.reset_parameters()
        if config.tie_embeddings != "none":
            self.output_projection.weight = tgt_tokens.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        config = self.config
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding) and module.padding_idx is not None:
                nn.init.normal_(module.weight, mean=0.0, std=config.d_model**-0.5)
                module.weight[module.padding_idx].zero_()
        if config.tie_embeddings == "none":
            # Same scale as a tied projection: unit-variance hidden states give unit-variance logits.
            nn.init.normal_(self.output_projection.weight, mean=0.0, std=config.d_model**-0.5)
        if config.norm_placement == "deepnorm":
            _, encoder_beta, _, decoder_beta = deepnorm_constants(config)
            for stack, beta in ((self.encoder, encoder_beta), (self.decoder, decoder_beta)):
                for module in stack.modules():
                    if isinstance(module, MultiHeadAttention):
                        d_model = module.out_proj.weight.size(0)
                        nn.init.xavier_normal_(module.q_proj.weight)
                        nn.init.xavier_normal_(module.kv_proj.weight[:d_model])  # keys
                        nn.init.xavier_normal_(module.kv_proj.weight[d_model:], gain=beta)  # values
                        nn.init.xavier_normal_(module.out_proj.weight, gain=beta)
                    elif isinstance(module, FeedForward):
                        nn.init.xavier_normal_(module.w_in.weight, gain=beta)
                        nn.init.xavier_normal_(module.w_out.weight, gain=beta)

    def attention_in_fp32_under_autocast(self, *, enabled: bool) -> None:
        """MultiHeadAttention.fp32_under_autocast for every attention layer of the model."""
        for module in self.modules():
            if isinstance(module, MultiHeadAttention):
                module.fp32_under_autocast = enabled

    def residual_in_fp32_under_autocast(self, *, enabled: bool) -> None:
        """Whether the residual stream stays float32 under bf16 autocast in training (Embedder.fp32_under_autocast,
        for the encoder's and the decoder's embeddings; by default it is bf16)."""
        for embedder in (self.encoder.embed, self.decoder.embed):
            embedder.fp32_under_autocast = enabled

    def residual_in_fp32(self) -> bool:
        """Whether the residual stream stays float32 under bf16 autocast (as residual_in_fp32_under_autocast set it)."""
        return self.encoder.embed.fp32_under_autocast

    def attention_in_fp32(self) -> bool:
        """Whether attention runs in float32 under autocast (as attention_in_fp32_under_autocast set it)."""
        return any(module.fp32_under_autocast for module in self.modules() if isinstance(module, MultiHeadAttention))

    def fuse_self_attention(self) -> "Transformer":
        """For inference, in place: every self-attention's projections in one matmul
        (MultiHeadAttention.fuse_projections; cross-attention projects queries and keys from different inputs).
        The model can no longer be trained."""
        for module in self.modules():
            if isinstance(module, (EncoderLayer, DecoderLayer)):
                module.self_attn.fuse_projections()
        return self

    def attend_one_query_by_matmul(self, by_matmul: bool) -> "Transformer":
        """In place: whether this model's bf16 decoding steps on CPU attend by matmuls (else SDPA) where a row of
        keys has one query (MultiHeadAttention.one_query_by_matmul); a choice of this model's, no other's."""
        for module in self.modules():
            if isinstance(module, MultiHeadAttention):
                module.one_query_by_matmul = by_matmul
        return self

    def stack_cross_projections(self) -> "Transformer":
        """For the compiled decoding step, in place: every decoder layer's cross-attention key/value projection
        stacked into one, `decoder.cross_kv_proj` (D -> layers * 2D, layer by layer), so that a batch's memory
        is projected for all layers in one matmul, and quantised once where the step is int8 (a call per layer
        quantised the same memory again each time; docs/performance/compiled-decoding.md#cross-projection). Each
        output is the same dot product. The layers keep theirs, for the eager decode
        (scoring, alignments): the stacked weights are a second copy. Again, or on projections already
        converted for inference (int8): nothing to do."""
        decoder = self.decoder
        projections = [cast(DecoderLayer, layer).cross_attn.kv_proj for layer in decoder.layers]
        if decoder.cross_kv_proj is not None or any(type(p) is not nn.Linear for p in projections):
            return self
        first = projections[0]
        stacked = nn.Linear(first.in_features, sum(p.out_features for p in projections), bias=first.bias is not None,
                            device=first.weight.device, dtype=first.weight.dtype)
        with torch.no_grad():
            stacked.weight.copy_(torch.cat([p.weight for p in projections]))
            if stacked.bias is not None:
                stacked.bias.copy_(torch.cat([p.bias for p in projections]))
        decoder.cross_kv_proj = stacked.requires_grad_(False)
        return self

    def src_mask(self, src: Tensor) -> Tensor:
        """(B, S) source ids -> (B, S) bool, True at real tokens."""
        return src != self.config.pad_id

    def encode(self, src: Tensor, *, chunk_tokens: int = 2048,
               encode_chunk: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """src: (B, S) ids, right-padded with pad_id -> memory (B, S, D); padded positions are 0.

        A batch of sentences of very different lengths wastes most of the encoder's work on padding
        (a decoding batch holds a few hundred sentences: at 8 to 40 tokens, 60% of the positions can
        be padding). The rows are therefore encoded longest first in chunks of about `chunk_tokens`
        positions, each chunk cut to its own longest sentence. Every row's memory is what encoding it
        alone gives. Training (`forward`, `hidden_states`) encodes its length-bucketed batches whole.
        `encode_chunk` encodes each chunk in place of the model's own `_memory` (model/compiled.py's compiled one).
        """
        encode_chunk = encode_chunk or self._memory
        lengths = (src != self.config.pad_id).sum(dim=1)  # (B,)
        batch, width = src.shape
        if batch * width <= 1.25 * int(lengths.sum()) or batch * width <= chunk_tokens:
            return encode_chunk(src)
        order = lengths.argsort(descending=True, stable=True).tolist()
        sorted_lengths = lengths[order].tolist()
        memory: Tensor | None = None
        start = 0
        while start < batch:
            longest = max(sorted_lengths[start], 1)
            rows = order[start : start + max(1, chunk_tokens // longest)]
            out = encode_chunk(src[rows, :longest])  # (b, longest, D)
            if memory is None:
                memory = out.new_zeros(batch, width, out.size(-1))
            memory[rows, :longest] = out
            start += len(rows)
        assert memory is not None
        return memory

    def _memory(self, src: Tensor, *, attend: Attend | None = None) -> Tensor:
        """The encoder over (B, S) as one batch -> (B, S, D), zero at padding; its self-attention `attend` where given
        (model/compiled_step.py's kernel; Encoder)."""
        out = self.encoder(src, src_mask=padding_mask(src, pad_id=self.config.pad_id), attend=attend)
        return out.masked_fill((src == self.config.pad_id)[:, :, None], 0.0)

    @property
    def decoder_dtype(self) -> torch.dtype:
        """The dtype the decoder computes in (its embedding's): the model's, or bf16 for a float32 int8 model's decoder
        under model/compiled.py's bf16_around_int8."""
        return self.decoder.embed.tokens.weight.dtype

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, state: DecoderState | None = None) -> Tensor:
        """Logits (R, T, V) for the target tokens `tgt_in` (R, T).

        memory: (N, S, D) from `encode`; src_mask: (N, S) bool, True at real source tokens
        (`src_mask(src)`). R = N, or R = N * K for K hypotheses per sentence, each sentence's K rows
        adjacent: they share its memory (no copies per beam).
        Without `state`, `tgt_in` is the whole (right-padded) target prefix. With a state (start from
        `new_state()`), `tgt_in` holds only the tokens after the `state.length` already cached ones; the
        state grows by T positions and holds the cross-attention keys/values after its first call.
        """
        memory = memory.to(self.decoder_dtype)  # (a float32 encoder's for bf16_around_int8's decoder; else itself)
        hidden = self.decoder(tgt_in, memory=memory, src_mask=src_mask[:, None, None, :], state=state)
        return self.output_projection(hidden)

    def decode_with_attention(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, *,
                              layer: int) -> tuple[Tensor, Tensor]:
        """`decode` without a state, and decoder layer `layer`'s cross-attention averaged over its heads,
        (R, T, S), float32 at least: where each target position read the source (word alignments come from it).
        One memory row per target row (R = N). The weights come back through the call, not a hook on the
        shared module: decoder threads decoding at once would each see the others' inputs."""
        if not -len(self.decoder.layers) <= layer < len(self.decoder.layers):
            raise IndexError(f"decoder layer {layer} of {len(self.decoder.layers)}")
        seen: list[Tensor] = []
        hidden = self.decoder(tgt_in, memory=memory.to(self.decoder_dtype),  # (as `decode`)
                              src_mask=src_mask[:, None, None, :], state=None,
                              cross_weights=(layer % len(self.decoder.layers), seen))
        return self.output_projection(hidden), seen[0].mean(dim=1)  # (R, T, V), (R, T, S)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced logits (B, T, V) for `tgt_in` (BOS + target) given `src`."""
        return self.output_projection(self.hidden_states(src, tgt_in))

    def hidden_states(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced decoder output (B, T, D), before the output projection.

        Training projects only the non-pad positions, fused with the loss (seq2seq/training/loss.py). The
        batch is encoded whole: training batches are already bucketed by length, and `encode`'s
        chunking would cost a host sync per step on a GPU.
        """
        memory = self.encoder(src, src_mask=padding_mask(src, pad_id=self.config.pad_id))  # (B, S, D)
        src_mask = self.src_mask(src)
        return self.decoder(tgt_in, memory=memory, src_mask=src_mask[:, None, None, :], state=None)

    @staticmethod
    def new_state() -> DecoderState:
        return DecoderState()
