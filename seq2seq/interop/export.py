"""Export a trained checkpoint to CTranslate2, so it runs (fp32, int8, ...) with no seq2seq installed.

    python -m seq2seq.export --checkpoint checkpoints/multi30k/best.ckpt --to ctranslate2 --output ct2/ \
        [--quantization int8]

The checkpoint is read and checked by checkpoint.py; CTranslate2's own `Converter` writes the model
from a `TransformerSpec` that `_load` fills (no hand-written binary files). The folder gets the
sentencepiece model too (`source.spm`, `target.spm`: the same joint model), so that
`ctranslate2.Translator` + `sentencepiece` translate with it alone (docs/interop.md).

The output folder: an export is written into a new folder beside `--output` and renamed into place
only once it is whole, so a failure leaves `--output` as it was. It is checked first by the policy
every face shares (seq2seq/textio.py's check_output: not a file, device, FIFO or link, not the checkpoint,
in a folder that exists, none created); `--force` then replaces only a folder that holds nothing but an
earlier export's files (EXPORT_FILES): never the checkpoint, other files or sub-folders, since the user
named the folder for an export, not for everything in it.

How our model maps onto the spec, and why each choice:
- Positions: our sinusoid table interleaves sin and cos (even and odd channels); CTranslate2's
  default puts them in two halves. The table is passed explicitly (as learned positions are).
- Attention: our `kv_proj` holds keys then values, which is CTranslate2's fused layout; self-
  attention's query, key and value projections are fused into one as it expects.
- The GLU family: our fused `w_in` holds the gate then the linear half: `linear_0` (with the
  activation) and `linear_0_noact`.
- Vocabulary: the sentencepiece pieces in id order, byte-fallback pieces (`<0x0A>`) included, so
  ids and pieces map one to one in both directions; BOS `<s>` starts the decoder, as in ours.
- T5 relative bias: our per-stack table (buckets, heads) goes to every self-attention layer, with
  its max distance; queries keep the 1/sqrt(head size) scale (CTranslate2's T5 converter turns it
  off because T5 folds it into its weights; we do not). Rotary: ours rotates the two halves of each
  head, CTranslate2's `rotary_interleave=False`; its encoder spec always adds a position table, so
  it gets a zero one.
- What the spec cannot express is refused, naming the option: DeepNorm (its residual scale has no
  place in the spec) and sandwich norms (CTranslate2's `pre_post_layer_norm` not yet checked
  against ours: refused rather than exported wrong).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from seq2seq import textio
from seq2seq.checkpoint import InferenceCheckpoint, load_checkpoint, read_inference
from seq2seq.interop.marian import channel_order, layer_modules
from seq2seq.model import TransformerConfig
from seq2seq.text.tokenizer import Tokenizer

QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16",
                 "float32")


class ExportError(ValueError):
    """The model cannot be exported to the asked engine, or not to that folder; the message names the
    option, why, and what to do."""


# What an export of ours writes, to either engine, across the versions the [export] extra allows
# (CTranslate2's converter; MarianMTModel's and MarianTokenizer's save_pretrained): --force replaces
# a folder that holds nothing else, so one engine's export may replace the other's.
EXPORT_FILES = frozenset({
    "model.bin", "config.json", "source.spm", "target.spm",
    *(f"{kind}vocabulary.{ext}" for kind in ("", "shared_", "source_", "target_") for ext in ("json", "txt")),
    "generation_config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
    "pytorch_model.bin.index.json", "vocab.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.json",
})
_WEIGHT_SHARD = re.compile(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)")


def check_output(output: str | Path, *, checkpoint: Path, force: bool) -> None:
    """Raise ExportError (naming --output and what to do) unless an export may write `output`: the policy every
    face shares (cli.check_output: a folder in a folder that exists, not a file, device, FIFO or link, not the
    checkpoint), then export's own: a new folder, or with `force` one holding only an earlier export's files;
    never one holding the checkpoint. The folder checked is the one written: `output` made absolute and
    normalised as _export_folder does (`typo/..` is the working folder there, though the kernel finds no such
    path)."""
    shown = Path(output) if str(output) else ""  # named as Path spells it (`./ct2/.` is ct2); "" stays empty
    try:
        textio.check_output(shown, force=force, replaces=True, folder=True, inputs=[("--checkpoint", checkpoint)])
    except textio.OutputRefused as error:
        raise ExportError(str(error)) from None
    output = Path(os.path.abspath(output))
    if not output.exists():
        return
    try:
        entries = sorted(output.iterdir())
    except OSError as error:
        raise ExportError(f"--output {shown} cannot be read ({error.strerror}): name a new folder") from None
    holder = output.resolve()
    inside = next((e for e in entries if textio.same_file(e, checkpoint)), None)
    if inside is not None or holder in checkpoint.resolve().parents:
        where = inside.name if inside is not None else checkpoint.resolve().relative_to(holder)
        raise ExportError(f"--output {shown} holds the checkpoint being exported ({where}): "
                          "name a new folder for the export")
    for entry in entries:
        kind = "the link " if entry.is_symlink() else "the folder " if entry.is_dir() else ""
        if not kind and entry.is_file() and (entry.name in EXPORT_FILES or _WEIGHT_SHARD.fullmatch(entry.name)):
            continue
        name = f"{entry.name}/" if kind == "the folder " else entry.name
        raise ExportError(f"--output {shown} holds {kind}{name}, which no export writes (--force replaces only an "
                          f"earlier export): name a new folder, or move {name} out")
    if not force:
        raise ExportError(f"--output {shown} exists: name a new folder, or pass --force to replace it")


def _short(prefix: str) -> str:
    # Cut to 200 bytes: beside a --output whose name has the most a file system takes (255), the
    # prefix and the suffix would not fit.
    return prefix.encode()[:200].decode(errors="ignore")


def _new_name(folder: Path, prefix: str) -> Path:
    """A new name in `folder`: `prefix`, the process id (whose death marks it a leftover), random hex."""
    return folder / f"{_short(prefix)}{os.getpid()}-{secrets.token_hex(4)}"


def _leftovers(folder: Path, prefix: str) -> list[Path]:
    """The names _new_name gave in `folder` for `prefix` to processes that are gone (killed mid-export)."""
    short, found = _short(prefix), []
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            match = re.fullmatch(r"(\d+)-[0-9a-f]{8}", entry.name[len(short):]) if entry.name.startswith(short) else None
            if match and not _alive(int(match[1])):
                found.append(Path(entry.path))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _clean_up_after_a_killed_export(target: Path) -> None:
    """What an export killed by kill -9 left beside `target`: its unfinished folder, removed; and if it
    died between setting the earlier export aside and moving the new one in, the earlier one goes back."""
    for staging in _leftovers(target.parent, f".{target.name}.partial-"):
        shutil.rmtree(staging, ignore_errors=True)
    for aside in _leftovers(target.parent, f".{target.name}.replaced-"):
        if os.path.lexists(target):  # the new export got in; only removing the old one was cut short
            shutil.rmtree(aside, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):  # else it stays, for the user to move back
                os.rename(aside, target)


def _swap_in(new: Path, target: Path) -> None:
    """Rename `new` to `target`, setting an earlier export there aside first and removing it after; if
    moving the new one in fails, the earlier one goes back, so `target` holds one whole export or the other."""
    if not target.exists():
        os.rename(new, target)
        return
    aside = _new_name(target.parent, f".{target.name}.replaced-")
    os.rename(target, aside)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)  # the new export is in place; a leftover of the old one harms nothing


@contextmanager
def _export_folder(output: Path, *, checkpoint: Path, force: bool) -> Iterator[Path]:
    """A new, empty folder beside `output` to write an export into; when the body returns, it takes
    `output`'s place (check_output's rules, checked again, as the folder may have changed meanwhile).
    On any failure it is removed, and `output` is left as it was. No folder is created for it: `output`'s
    own must exist (check_output)."""
    target = Path(os.path.abspath(output))  # `.` and `ct2/` have a name and a parent to write beside
    _clean_up_after_a_killed_export(target)
    check_output(output, checkpoint=checkpoint, force=force)
    try:
        staging = _new_name(target.parent, f".{target.name}.partial-")
        staging.mkdir()
    except OSError as error:
        raise ExportError(f"--output {output}: cannot create a folder in {target.parent} ({error.strerror or error}): "
                          "name a folder you can write to") from None
    try:
        yield staging
        check_output(output, checkpoint=checkpoint, force=force)
        _swap_in(staging, target)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        advice = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
                  errno.EBUSY: f"{output} is in use (a mount point?): name a folder inside it, or a new one",
                  errno.EXDEV: f"{output} is a mount point: name a folder inside it, or a new one"}
        raise ExportError(f"--output {output}: writing the export failed ({error.strerror or error}); nothing was "
                          f"changed: {advice.get(error.errno or 0, 'name a folder you can write to')}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def ctranslate2_refusal(config: TransformerConfig) -> str | None:
    """Why CTranslate2 cannot run this model exactly, naming the config field; None when it can."""
    if config.norm_placement == "deepnorm":
        return ("norm_placement='deepnorm': its residual scale alpha (LN(alpha * x + f(x))) has no place in "
                "CTranslate2's TransformerSpec; use post or pre")
    if config.norm_placement == "sandwich":
        return "norm_placement='sandwich': CTranslate2's encoder-decoder spec has no norm after each sub-layer"
    return None


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float32).cpu().numpy()


def _linear(spec: Any, weights: dict[str, torch.Tensor], name: str) -> None:
    spec.weight = _array(weights[f"{name}.weight"])
    if f"{name}.bias" in weights:
        spec.bias = _array(weights[f"{name}.bias"])


def _norm(spec: Any, weights: dict[str, torch.Tensor], name: str) -> None:
    spec.gamma = _array(weights[f"{name}.weight"])
    if f"{name}.bias" in weights:  # RMSNorm has none
        spec.beta = _array(weights[f"{name}.bias"])


def _attention(spec: Any, weights: dict[str, torch.Tensor], name: str, *, self_attention: bool) -> None:
    q_w, kv_w = weights[f"{name}.q_proj.weight"], weights[f"{name}.kv_proj.weight"]
    q_b, kv_b = weights.get(f"{name}.q_proj.bias"), weights.get(f"{name}.kv_proj.bias")
    if self_attention:  # one fused (3D, D) projection: queries, keys, values
        spec.linear[0].weight = _array(torch.cat((q_w, kv_w)))
        if q_b is not None and kv_b is not None:
            spec.linear[0].bias = _array(torch.cat((q_b, kv_b)))
    else:  # queries from the decoder; keys and values (2D, D) from the encoder's output
        _linear(spec.linear[0], weights, f"{name}.q_proj")
        _linear(spec.linear[1], weights, f"{name}.kv_proj")
    _linear(spec.linear[-1], weights, f"{name}.out_proj")


def _ffn(spec: Any, weights: dict[str, torch.Tensor], name: str, *, gated: bool) -> None:
    if gated:  # w_in = [gate; linear]: act(gate(x)) * linear(x)
        gate_w, linear_w = weights[f"{name}.w_in.weight"].chunk(2)
        spec.linear_0.weight, spec.linear_0_noact.weight = _array(gate_w), _array(linear_w)
        if f"{name}.w_in.bias" in weights:
            gate_b, linear_b = weights[f"{name}.w_in.bias"].chunk(2)
            spec.linear_0.bias, spec.linear_0_noact.bias = _array(gate_b), _array(linear_b)
    else:
        _linear(spec.linear_0, weights, f"{name}.w_in")
    _linear(spec.linear_1, weights, f"{name}.w_out")


def _positions(spec: Any, config: TransformerConfig, weights: dict[str, torch.Tensor], stack: str) -> None:
    from seq2seq.model.positions import sinusoidal_table

    if config.positions == "relative":  # T5's bias table (buckets, heads), shared by every self-attention
        for layer in spec.layer:
            layer.self_attention.relative_attention_bias = _array(weights[f"{stack}.relative_bias.bias.weight"])
            layer.self_attention.relative_attention_max_distance = np.int32(config.relative_max_distance)
    elif config.positions == "rotary":
        if hasattr(spec, "position_encodings"):  # the encoder spec always adds a table: a zero one adds nothing
            spec.position_encodings.encodings = np.zeros((config.max_positions, config.d_model), np.float32)
    elif config.positions == "learned":
        spec.position_encodings.encodings = _array(weights[f"{stack}.embed.positions.embedding.weight"])
    else:
        table = sinusoidal_table(max_positions=config.max_positions, d_model=config.d_model)
        spec.position_encodings.encodings = _array(table)


def ctranslate2_spec(loaded: InferenceCheckpoint, tokenizer: Tokenizer) -> Any:
    """The TransformerSpec of a checked checkpoint (ExportError if CTranslate2 cannot express it)."""
    from ctranslate2.specs import common_spec, transformer_spec

    config, weights = loaded.config, loaded.weights
    refusal = ctranslate2_refusal(config)
    if refusal is not None:
        raise ExportError(f"cannot export to CTranslate2: {refusal}")
    gated = config.activation in ("glu", "swiglu", "geglu")
    activation = {
        "relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU, "swish": common_spec.Activation.SWISH,
        "glu": common_spec.Activation.Sigmoid, "swiglu": common_spec.Activation.SWISH, "geglu": common_spec.Activation.GELU,
    }[config.activation]
    options: dict[str, Any] = {"pre_norm": config.norm_placement == "pre", "activation": activation,
                               "ffn_glu": gated, "rms_norm": config.norm == "rmsnorm"}
    if config.positions == "relative":
        options["relative_attention_bias"] = True
    elif config.positions == "rotary":  # ours rotates the two halves of each head (not interleaved pairs)
        options.update(rotary_dim=config.d_model // config.num_heads, rotary_interleave=False,
                       rotary_base=config.rotary_base)
    spec = transformer_spec.TransformerSpec(
        transformer_spec.TransformerEncoderSpec(config.num_encoder_layers, config.num_heads, **options),
        transformer_spec.TransformerDecoderSpec(config.num_decoder_layers, config.num_heads, **options),
    )
    spec.config.layer_norm_epsilon = config.norm_eps
    pre = config.norm_placement == "pre"
    for stack, stack_spec in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        stack_spec.scale_embeddings = config.scale_embeddings
        embeddings = stack_spec.embeddings[0] if isinstance(stack_spec.embeddings, list) else stack_spec.embeddings
        embeddings.weight = _array(weights[f"{stack}.embed.tokens.weight"])
        _positions(stack_spec, config, weights, stack)
        if pre:
            _norm(stack_spec.layer_norm, weights, f"{stack}.final_norm")
        for i, layer in enumerate(stack_spec.layer):
            prefix = f"{stack}.layers.{i}"
            _attention(layer.self_attention, weights, f"{prefix}.self_attn", self_attention=True)
            _norm(layer.self_attention.layer_norm, weights, f"{prefix}.self_attn_residual.norm")
            if stack == "decoder":
                _attention(layer.attention, weights, f"{prefix}.cross_attn", self_attention=False)
                _norm(layer.attention.layer_norm, weights, f"{prefix}.cross_attn_residual.norm")
            _ffn(layer.ffn, weights, f"{prefix}.ffn", gated=gated)
            _norm(layer.ffn.layer_norm, weights, f"{prefix}.ffn_residual.norm")
    _linear(spec.decoder.projection, weights, "output_projection")
    pieces = tokenizer.pieces()
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    start = pieces[tokenizer.bos_id]  # a Marian model's is <pad> (zero embedding), as CTranslate2's own converter
    spec.config.bos_token, spec.config.eos_token, spec.config.unk_token = start, pieces[tokenizer.eos_id], pieces[tokenizer.unk_id]
    spec.config.decoder_start_token = start
    return spec


def tag_usage(checkpoint: str | Path, engine: str) -> str | None:
    """For a multilingual checkpoint, how the exported model is told its target language (None for a bilingual
    one): the tag as the engine takes it. Both engines' vocabularies hold the tags as pieces of their own."""
    loaded = read_inference(checkpoint, load_checkpoint(checkpoint))
    if not loaded.directions:
        return None
    targets = list(dict.fromkeys(tgt for _, tgt in loaded.directions))
    tag = f">>{targets[0]}<<"
    how = {("ctranslate2", "encoder"): f'start each source\'s tokens with its target\'s tag (["{tag}", "▁A", ...])',
           ("ctranslate2", "decoder"): f'give each source target_prefix=["{tag}"] and drop that first token of '
                                       "each hypothesis",
           ("huggingface", "encoder"): f'start each text with its target\'s tag: tokenizer("{tag} " + text)',
           ("huggingface", "decoder"): f'generate(..., forced_bos_token_id=tokenizer.convert_tokens_to_ids("{tag}"))'}
    return (f"a multilingual model ({', '.join(f'{s}→{t}' for s, t in loaded.directions)}): "
            f"{how[(engine, loaded.target_tag)]}, for {', '.join(targets)} (docs/interop.md#multilingual)")


def export_ctranslate2(checkpoint: str | Path, output: str | Path, *, quantization: str | None = None,
                       force: bool = False) -> Path:
    """Write a CTranslate2 model folder (model.bin, vocabularies, config, source.spm / target.spm);
    `force` replaces an earlier export there (see check_output)."""
    import ctranslate2

    checkpoint, output = Path(checkpoint), Path(output)
    check_output(output, checkpoint=checkpoint, force=force)  # before the conversion's minutes
    loaded = read_inference(checkpoint, load_checkpoint(checkpoint))
    tokenizer = Tokenizer.from_bytes(loaded.tokenizer)
    spec = ctranslate2_spec(loaded, tokenizer)

    class _Converter(ctranslate2.converters.Converter):
        def _load(self) -> Any:
            return spec

    with _export_folder(output, checkpoint=checkpoint, force=force) as folder:
        # force: the converter empties the folder it is given, here our own new one and nothing else
        _Converter().convert(str(folder), quantization=quantization, force=True)
        (folder / "source.spm").write_bytes(tokenizer.model_bytes("source"))
        (folder / "target.spm").write_bytes(tokenizer.model_bytes("target"))
    return output


# ---- Hugging Face: MarianMTModel ------------------------------------------------------------


def marian_refusal(config: TransformerConfig) -> str | None:
    """Why MarianMTModel cannot host this model exactly, naming the config field; None when it can."""
    if config.norm_placement != "post":
        return f"norm_placement='{config.norm_placement}': Marian is post-norm only"
    if config.norm != "layernorm" or config.norm_eps != 1e-5:
        return "norm: Marian uses LayerNorm with eps 1e-5 only"
    if config.positions != "sinusoidal":
        return f"positions='{config.positions}': Marian has sinusoidal positions only"
    if config.activation not in ("relu", "gelu", "swish"):
        return f"activation='{config.activation}': Marian's feed-forward has no gated (GLU) variant"
    return None


def marian_state_dict(loaded: InferenceCheckpoint) -> dict[str, torch.Tensor]:
    """Our weights under MarianMTModel's names, channels reordered (seq2seq/interop/marian.py)."""
    from seq2seq.model.positions import sinusoidal_table

    config, weights = loaded.config, loaded.weights
    order = channel_order(config.d_model)
    out: dict[str, torch.Tensor] = {}

    def reads(name: str, ours: str) -> None:  # a Linear whose input is the residual stream
        out[f"{name}.weight"] = weights[f"{ours}.weight"][:, order]
        if f"{ours}.bias" in weights:
            out[f"{name}.bias"] = weights[f"{ours}.bias"]

    def writes(name: str, ours: str) -> None:  # a Linear whose output is added to the residual stream
        out[f"{name}.weight"] = weights[f"{ours}.weight"][order]
        out[f"{name}.bias"] = weights[f"{ours}.bias"][order]

    def norm(name: str, ours: str) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = weights[f"{ours}.weight"][order], weights[f"{ours}.bias"][order]

    def attention(name: str, ours: str) -> None:
        d = config.d_model
        reads(f"{name}.q_proj", f"{ours}.q_proj")
        kv_w, kv_b = weights[f"{ours}.kv_proj.weight"][:, order], weights[f"{ours}.kv_proj.bias"]
        out[f"{name}.k_proj.weight"], out[f"{name}.v_proj.weight"] = kv_w[:d], kv_w[d:]
        out[f"{name}.k_proj.bias"], out[f"{name}.v_proj.bias"] = kv_b[:d], kv_b[d:]
        writes(f"{name}.out_proj", f"{ours}.out_proj")

    table = sinusoidal_table(max_positions=config.max_positions, d_model=config.d_model)[:, order]
    for stack in ("encoder", "decoder"):
        out[f"model.{stack}.embed_tokens.weight"] = weights[f"{stack}.embed.tokens.weight"][:, order]
        out[f"model.{stack}.embed_positions.weight"] = table
    mappers = {"attention": attention, "norm": norm, "reads": reads, "writes": writes}
    for kind, ours, theirs in layer_modules(config):
        mappers[kind](theirs, ours)
    if config.tie_embeddings == "all":  # one matrix for both stacks: Marian's `shared`
        out["model.shared.weight"] = out["model.encoder.embed_tokens.weight"]
    out["lm_head.weight"] = weights["output_projection.weight"][:, order]
    bias = weights.get("output_projection.bias")
    out["final_logits_bias"] = bias[None].clone() if bias is not None else torch.zeros(1, config.vocab_size)
    return {name: tensor.detach().float().contiguous() for name, tensor in out.items()}


def export_huggingface(checkpoint: str | Path, output: str | Path, *, force: bool = False) -> Path:
    """Write a MarianMTModel folder (config, safetensors weights, MarianTokenizer files); `force`
    replaces an earlier export there (see check_output)."""
    import json
    import tempfile

    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    checkpoint, output = Path(checkpoint), Path(output)
    check_output(output, checkpoint=checkpoint, force=force)
    loaded = read_inference(checkpoint, load_checkpoint(checkpoint))
    config, tokenizer = loaded.config, Tokenizer.from_bytes(loaded.tokenizer)
    refusal = marian_refusal(config)
    if refusal is not None:
        raise ExportError(f"cannot export to Hugging Face (MarianMTModel): {refusal}")
    hf_config = MarianConfig(
        vocab_size=config.vocab_size, decoder_vocab_size=config.vocab_size, d_model=config.d_model,
        encoder_layers=config.num_encoder_layers, decoder_layers=config.num_decoder_layers,
        encoder_attention_heads=config.num_heads, decoder_attention_heads=config.num_heads,
        encoder_ffn_dim=config.d_ff, decoder_ffn_dim=config.d_ff, activation_function=config.activation,
        max_position_embeddings=config.max_positions, scale_embedding=config.scale_embeddings,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=tokenizer.pad_id, eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id,
        decoder_start_token_id=tokenizer.bos_id, forced_eos_token_id=tokenizer.eos_id,
        share_encoder_decoder_embeddings=config.tie_embeddings == "all",
        tie_word_embeddings=config.tie_embeddings != "none",
    )
    model = MarianMTModel(hf_config).eval()
    state = marian_state_dict(loaded)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [name for name in missing if name not in state]:
        raise ExportError(f"MarianMTModel's weights do not match ours: missing {missing}, unexpected {unexpected}")
    generation = model.generation_config
    generation.bad_words_ids = [[i] for i in sorted({tokenizer.pad_id, tokenizer.bos_id})]  # never generated, as in ours
    # transformers' default max_length (20, the decoder's start included) cut sentences short: the
    # decoder reads max_positions positions, as OPUS-MT's configs say. The beam: the checkpoint's default.
    generation.max_length = config.max_positions
    if not loaded.search.sampling:
        generation.num_beams = loaded.search.beam_size
    with _export_folder(output, checkpoint=checkpoint, force=force) as folder, \
            tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(folder)
        spm = {"source": Path(scratch) / "source.spm", "target": Path(scratch) / "target.spm"}
        spm["source"].write_bytes(tokenizer.model_bytes("source"))
        spm["target"].write_bytes(tokenizer.model_bytes("target"))
        vocab_path = Path(scratch) / "vocab.json"
        vocab_path.write_text(json.dumps({piece: i for i, piece in enumerate(tokenizer.pieces())}), encoding="utf-8")
        MarianTokenizer(source_spm=str(spm["source"]), target_spm=str(spm["target"]), vocab=str(vocab_path),
                        source_lang=loaded.src_lang, target_lang=loaded.tgt_lang).save_pretrained(folder)
    return output
