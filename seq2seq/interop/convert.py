"""Import a pretrained Hugging Face Marian model (the 1,000+ OPUS-MT models) as a checkpoint of ours.

    python -m seq2seq.convert --from huggingface Helsinki-NLP/opus-mt-de-en --output opus-mt-de-en.ckpt
    python -m seq2seq.convert --from huggingface ./opus-mt-de-en/ --output de-en.ckpt --src-lang de --tgt-lang en

SRC is a local folder (what `save_pretrained` writes, or a Hub snapshot) or a Hub id, which is
downloaded with huggingface_hub's `snapshot_download` (only the files read here; cached as any Hub
download, so a second conversion needs no network). The checkpoint written holds our entry and the
weights only (checksum, tokenizer, language pair), so it works wherever a checkpoint does:
`seq2seq.translate`, `serve/`, `Translator`, `seq2seq.export`, and fine-tuning (`model.init_from`).

What is read, and how it maps (the inverse of seq2seq/export.py's Marian export):
- config.json: a `marian` model of the configurations OPUS-MT ships: post-norm LayerNorm, sinusoidal
  positions (static), swish/relu/gelu, `scale_embedding` either way, the embeddings shared by
  encoder, decoder and output (OPUS-MT's), or the output tied to the decoder's, or none tied. What
  changes the model otherwise (legacy BART-era fields such as `normalize_before`, separate source and
  target vocabularies) is refused, naming the field.
- the weights: model.safetensors or pytorch_model.bin (sharded or not; read without pickle).
  Marian's sinusoids put every sin before every cos; ours interleave them: the residual stream's
  channels are reordered in every tensor that reads or writes it, which leaves the function unchanged.
  `final_logits_bias` becomes the output projection's bias (`output_bias`).
- the tokenizer: source.spm, target.spm and vocab.json become a Marian `Tokenizer` (seq2seq/text/tokenizer.py:
  pieces mapped through the vocabulary, eos appended to sources, the decoder started from pad). A
  folder our own export wrote (one joint sentencepiece model whose pieces are the vocabulary, in its
  id order) becomes our joint tokenizer again, so export and import round-trip bitwise.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from seq2seq.checkpoint import CHECKPOINT_KEY, inference_entry, save_atomic
from seq2seq.interop.marian import channel_order, layer_modules
from seq2seq.model import ConfigError, Transformer, TransformerConfig
from seq2seq.model.positions import sinusoidal_table
from seq2seq.text.tokenizer import TAG, Tokenizer
from seq2seq.textio import OutputRefused, check_output


class ConvertError(ValueError):
    """SRC cannot be imported; the message names SRC, the file or field, and what to do."""


# The files a Marian model is made of; what a Hub download fetches.
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json")
METADATA_FILES = ("config.json", "tokenizer_config.json", "generation_config.json")
WEIGHT_PATTERNS = (("model.safetensors", "model-*.safetensors", "model.safetensors.index.json"),
                   ("pytorch_model.bin", "pytorch_model-*.bin", "pytorch_model.bin.index.json"))
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

# Fields of older (BART-era) Marian config.json files, which every OPUS-MT model sets to these values;
# transformers ignores them now, so another value means a model it would run differently than trained.
LEGACY_FIELDS = {"normalize_before": False, "normalize_embedding": False, "static_position_embeddings": True,
                 "add_final_layer_norm": False, "add_bias_logits": False}
# What a config.json must say: the sizes (the rest have the defaults MarianConfig gives them).
SIZE_FIELDS = ("vocab_size", "d_model", "encoder_attention_heads", "encoder_ffn_dim", "encoder_layers",
               "decoder_layers")
ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}


# ---- finding the files ---------------------------------------------------------------------------


def resolve_source(source: str) -> Path:
    """The local folder SRC names: itself, or the Hub snapshot of a model id (downloaded if not cached)."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists():
        raise ConvertError(f"{source} is a file; give the model's folder (config.json, the weights, source.spm, "
                           "target.spm, vocab.json) or a Hub id such as Helsinki-NLP/opus-mt-de-en")
    if not HUB_ID.fullmatch(source):
        raise ConvertError(f"{source} is neither a folder nor a Hugging Face Hub id (owner/name, e.g. "
                           "Helsinki-NLP/opus-mt-de-en)")
    return download(source)


def download(repo_id: str) -> Path:
    """huggingface_hub's snapshot of `repo_id`, with the files we read only (safetensors weights where the
    repository has them, else the .bin ones); from the cache when they are there (HF_HUB_OFFLINE=1 works)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise ConvertError(f"{repo_id}: downloading from the Hub needs huggingface_hub (pip install -e '.[export]'); "
                           "or give a local folder") from None
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=[*METADATA_FILES, *TOKENIZER_FILES,
                                                                  *WEIGHT_PATTERNS[0]]))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(repo_id, allow_patterns=[*METADATA_FILES, *TOKENIZER_FILES,
                                                                      *WEIGHT_PATTERNS[1]]))
    except RepositoryNotFoundError:
        raise ConvertError(f"{repo_id} is not a model on the Hugging Face Hub (or it is private: log in with "
                           "`hf auth login`)") from None
    except LocalEntryNotFoundError:
        raise ConvertError(f"cannot download {repo_id}: the Hub cannot be reached and it is not in the cache; "
                           "connect, or download it elsewhere and give its folder") from None
    except (HfHubHTTPError, OSError) as error:
        reason = str(error).strip().split("\n")[0]
        raise ConvertError(f"cannot download {repo_id} from the Hugging Face Hub ({reason}); give a local "
                           "folder, or try again") from None
    return folder


# ---- the config ----------------------------------------------------------------------------------


def read_json(folder: Path, name: str, *, required: bool) -> dict[str, Any]:
    path = folder / name
    if not path.is_file():
        if required:
            raise ConvertError(f"{folder} is not a Marian model folder: it has no {name}")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConvertError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ConvertError(f"{path} holds a {type(value).__name__}, not a JSON object")
    return value


def typed(hf: dict[str, Any], name: str, kind: type, *, default: Any, where: Path) -> Any:
    """config.json's `name`, which must be a `kind` (an int is not a bool, nor a bool an int); `default` if absent."""
    value = hf.get(name, default)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConvertError(f"{where}: config.json {name} is {json.dumps(value)}, not a JSON "
                           f"{'boolean' if kind is bool else 'integer'}; the file is damaged or not MarianConfig's")
    return value


def tie_embeddings(hf: dict[str, Any], *, where: Path) -> str:
    """Our tie_embeddings for Marian's (share_encoder_decoder_embeddings, tie_word_embeddings)."""
    share = typed(hf, "share_encoder_decoder_embeddings", bool, default=True, where=where)
    tie = typed(hf, "tie_word_embeddings", bool, default=True, where=where)
    if share and tie:
        return "all"
    if share:
        raise ConvertError(f"{where}: share_encoder_decoder_embeddings=true with tie_word_embeddings=false (one "
                           "embedding for encoder and decoder, a separate output) is not a configuration we "
                           "import; OPUS-MT's models tie all three")
    return "decoder" if tie else "none"


def transformer_config(hf: dict[str, Any], *, where: Path, pad_id: int, output_bias: bool) -> TransformerConfig:
    """Our TransformerConfig for a Marian config.json; ConvertError naming a field we cannot run exactly."""
    if hf.get("model_type") != "marian":
        raise ConvertError(f"{where} is not a Marian model (config.json model_type: {hf.get('model_type')!r}); "
                           "seq2seq.convert imports MarianMTModel (OPUS-MT) models")
    for name, wanted in LEGACY_FIELDS.items():
        if name in hf and hf[name] != wanted:
            raise ConvertError(f"{where}: config.json {name}={json.dumps(hf[name])} is not supported (OPUS-MT's "
                               f"models have {json.dumps(wanted)}; transformers itself ignores it)")
    for ours, enc, dec in (("num_heads", "encoder_attention_heads", "decoder_attention_heads"),
                           ("d_ff", "encoder_ffn_dim", "decoder_ffn_dim")):
        if hf.get(enc) != hf.get(dec):
            raise ConvertError(f"{where}: config.json {enc}={hf.get(enc)} but {dec}={hf.get(dec)}: our model has one "
                               f"{ours} for both stacks")
    vocab_size, decoder_vocab = hf.get("vocab_size"), hf.get("decoder_vocab_size")
    if decoder_vocab is not None and decoder_vocab != vocab_size:
        raise ConvertError(f"{where}: config.json decoder_vocab_size={decoder_vocab} differs from vocab_size="
                           f"{vocab_size}: separate source and target vocabularies are not supported")
    activation = ACTIVATIONS.get(str(hf.get("activation_function", "swish")))
    if activation is None:
        raise ConvertError(f"{where}: config.json activation_function={hf.get('activation_function')!r} is not "
                           f"supported (one of {', '.join(ACTIVATIONS)})")
    missing = [name for name in SIZE_FIELDS if name not in hf]
    if missing:
        raise ConvertError(f"{where}: config.json has no {missing[0]}, which every Marian config.json sets; the file "
                           "is damaged or of another model")
    try:
        return TransformerConfig(
            vocab_size=hf["vocab_size"], d_model=hf["d_model"], num_heads=hf["encoder_attention_heads"],
            d_ff=hf["encoder_ffn_dim"], num_encoder_layers=hf["encoder_layers"],
            num_decoder_layers=hf["decoder_layers"], dropout=hf.get("dropout", 0.1),
            attention_dropout=hf.get("attention_dropout", 0.0), activation_dropout=hf.get("activation_dropout", 0.0),
            max_positions=hf.get("max_position_embeddings", 512), pad_id=pad_id, positions="sinusoidal",
            norm="layernorm", norm_placement="post", norm_eps=1e-5, activation=activation,  # type: ignore[arg-type]
            tie_embeddings=tie_embeddings(hf, where=where),  # type: ignore[arg-type]
            scale_embeddings=typed(hf, "scale_embedding", bool, default=False, where=where), output_bias=output_bias,
        )
    except (ConfigError, TypeError) as error:
        field = {"num_heads": "encoder_attention_heads", "d_ff": "encoder_ffn_dim", "scale_embeddings": "scale_embedding",
                 "max_positions": "max_position_embeddings", "num_encoder_layers": "encoder_layers",
                 "num_decoder_layers": "decoder_layers"}
        name = field.get(error.field, error.field) if isinstance(error, ConfigError) else "?"
        raise ConvertError(f"{where}: config.json {name}: {getattr(error, 'problem', error)}") from None


# ---- the tokenizer -------------------------------------------------------------------------------


def read_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer of a Marian folder: a Marian pair, or our joint model where the folder is our export."""
    for name in TOKENIZER_FILES:
        if not (folder / name).is_file():
            raise ConvertError(f"{folder}: the tokenizer file {name} is missing (a Marian model has source.spm, "
                               "target.spm and vocab.json)")
    if read_json(folder, "tokenizer_config.json", required=False).get("separate_vocabs"):
        raise ConvertError(f"{folder}: tokenizer_config.json separate_vocabs=true (a target_vocab.json of its own) "
                           "is not supported")
    vocab = read_json(folder, "vocab.json", required=True)
    ids = sorted(vocab.values()) if all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()) else None
    if ids != list(range(len(vocab))):
        raise ConvertError(f"{folder}/vocab.json does not map its pieces to the ids 0..{len(vocab) - 1}, one each")
    pieces = sorted(vocab, key=vocab.__getitem__)
    source, target = (folder / "source.spm").read_bytes(), (folder / "target.spm").read_bytes()
    try:
        if source == target:
            joint = Tokenizer.from_bytes(source)
            if joint.pieces() == pieces:
                return joint  # our own export: ids are sentencepiece's, specials ours
    except ValueError:
        pass  # not one of ours: a Marian pair that happens to share one model
    try:
        return Tokenizer.from_marian(source=source, target=target, vocabulary=pieces)
    except ValueError as error:
        raise ConvertError(f"{folder}: its tokenizer cannot be used ({error})") from None


def language_pair(folder: Path, source: str, *, src_lang: str | None, tgt_lang: str | None) -> tuple[str, str]:
    """--src-lang/--tgt-lang, else tokenizer_config.json's source_lang/target_lang, else an opus-mt-SRC-TGT name."""
    stored = read_json(folder, "tokenizer_config.json", required=False)
    src, tgt = src_lang or stored.get("source_lang"), tgt_lang or stored.get("target_lang")
    named = re.search(r"opus-mt-(?:tc-[a-z]+-)?([A-Za-z_]+)-([A-Za-z_]+)/?$", source)
    if named:
        src, tgt = src or named[1], tgt or named[2]
    if not (isinstance(src, str) and src and isinstance(tgt, str) and tgt):
        raise ConvertError(f"{source}: the language pair is not recorded (tokenizer_config.json has no "
                           "source_lang/target_lang): give --src-lang and --tgt-lang")
    if src == tgt:
        raise ConvertError(f"{source}: source and target language are both {src!r}: give --src-lang and --tgt-lang")
    return src, tgt


def target_directions(tokenizer: Tokenizer, src: str, *, tgt_lang: str | None, where: Path) -> list[tuple[str, str]]:
    """A multi-target model's directions (its vocabulary has a `>>fra<<` piece per target, which starts each source,
    as OPUS-MT's multilingual models read it): from `src` into each, or into --tgt-lang alone; [] for a model of one
    target."""
    languages = tokenizer.languages
    if not languages:
        return []
    if tgt_lang is not None and tgt_lang not in languages:
        shown = ", ".join(languages[:20]) + (f" and {len(languages) - 20} more" if len(languages) > 20 else "")
        raise ConvertError(f"{where}: --tgt-lang {tgt_lang} has no tag in this multi-target model; its targets are "
                           f"{shown}")
    if not TAG.fullmatch(f">>{src}<<"):
        raise ConvertError(f"{where}: source language {src!r} is not a language code; give --src-lang (en, deu, ...)")
    return [(src, target) for target in ([tgt_lang] if tgt_lang is not None else languages)]


# ---- the weights ---------------------------------------------------------------------------------


def read_weights(folder: Path) -> dict[str, Tensor]:
    """Every tensor of the folder's weight files (safetensors first), by MarianMTModel's names."""
    for single, shards, index in WEIGHT_PATTERNS:
        files = [folder / single] if (folder / single).is_file() else sorted(folder.glob(shards))
        if not files:
            continue
        if (folder / index).is_file():
            files = _shards(folder, index)
        weights: dict[str, Tensor] = {}
        for path in files:
            weights.update(_load_file(path))
        if not any(name.startswith("model.") for name in weights):  # a MarianModel's: no "model." prefix
            weights = {f"model.{name}" if not name.startswith(("lm_head", "final_logits")) else name: tensor
                       for name, tensor in weights.items()}
        return weights
    raise ConvertError(f"{folder} has no weights (model.safetensors or pytorch_model.bin)")


def _shards(folder: Path, index: str) -> list[Path]:
    """The weight files an index's weight_map names: plain file names in `folder`, nothing outside it."""
    weight_map = read_json(folder, index, required=True).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConvertError(f"{folder / index}: its weight_map is not an object naming the weight files")
    names = set(weight_map.values())
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise ConvertError(f"{folder / index}: its weight_map names {json.dumps(name)}, not a file in the folder")
        if not (folder / name).is_file():
            raise ConvertError(f"{folder / index} names the weight file {name}, which is missing: download it again")
    return sorted(folder / name for name in names)


def _load_file(path: Path) -> dict[str, Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # noqa: BLE001 - either library raises anything on a damaged file
        raise ConvertError(f"{path} cannot be read ({type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}); "
                           "it is damaged or not a weights file: download it again") from None
    if not isinstance(loaded, dict) or not all(isinstance(t, Tensor) for t in loaded.values()):
        raise ConvertError(f"{path} does not hold a state dict of tensors")
    return loaded


def our_weights(hf: dict[str, Tensor], config: TransformerConfig, *, where: Path) -> dict[str, Tensor]:
    """MarianMTModel's weights as our Transformer's state dict (the channel order: module docstring)."""
    d = config.d_model
    inverse = channel_order(d).argsort()  # marian = ours[..., order], so ours = marian[..., inverse]
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> Tensor:
        if name not in hf:
            raise ConvertError(f"{where}: the weights lack '{name}', which a MarianMTModel of this config.json has; "
                               "the files are damaged or of another model")
        used.add(name)
        if tuple(hf[name].shape) != shape:
            raise ConvertError(f"{where}: the weight '{name}' has the shape {tuple(hf[name].shape)}, but config.json "
                               f"makes it {shape}; the files are damaged or of different models")
        tensor = hf[name].float()
        if not tensor.isfinite().all():
            raise ConvertError(f"{where}: the weight '{name}' holds NaN or infinite values")
        return tensor

    out: dict[str, Tensor] = {}
    with torch.device("meta"):  # the shape every tensor must have: our model's, which Marian's mirror
        shapes = {name: tuple(t.shape) for name, t in Transformer(config).state_dict().items()}

    def linear(ours: str, name: str, order: Tensor | None, axis: int) -> None:
        weight, bias = take(f"{name}.weight", shapes[f"{ours}.weight"]), take(f"{name}.bias", shapes[f"{ours}.bias"])
        out[f"{ours}.weight"] = weight if order is None else weight.index_select(axis, order)
        out[f"{ours}.bias"] = bias if order is None or axis == 1 else bias[order]

    def reads(ours: str, name: str) -> None:  # a Linear whose input is the residual stream
        linear(ours, name, inverse, 1)

    def writes(ours: str, name: str) -> None:  # a Linear whose output is added to the residual stream
        linear(ours, name, inverse, 0)

    def norm(ours: str, name: str) -> None:
        linear(ours, name, inverse, 0)

    def attention(ours: str, name: str) -> None:
        reads(f"{ours}.q_proj", f"{name}.q_proj")
        half = (d, d)
        out[f"{ours}.kv_proj.weight"] = torch.cat((take(f"{name}.k_proj.weight", half),
                                                   take(f"{name}.v_proj.weight", half)))[:, inverse]
        out[f"{ours}.kv_proj.bias"] = torch.cat((take(f"{name}.k_proj.bias", (d,)), take(f"{name}.v_proj.bias", (d,))))
        writes(f"{ours}.out_proj", f"{name}.out_proj")

    embeddings = _embeddings(hf, config, take, where=where)
    for stack in ("encoder", "decoder"):
        out[f"{stack}.embed.tokens.weight"] = embeddings[stack][:, inverse]
        _check_positions(hf, config, stack, used, where=where)
    mappers = {"attention": attention, "norm": norm, "reads": reads, "writes": writes}
    for kind, ours, theirs in layer_modules(config):
        mappers[kind](ours, theirs)
    out["output_projection.weight"] = embeddings["output"][:, inverse]
    if config.output_bias:
        out["output_projection.bias"] = take("final_logits_bias", (1, config.vocab_size)).reshape(-1)
    used.add("final_logits_bias")
    extra = sorted(set(hf) - used)
    if extra:
        raise ConvertError(f"{where}: the weights hold '{extra[0]}' ({len(extra)} unknown in all), which no Marian "
                           "configuration we import has: refusing rather than dropping it")
    return {name: tensor.contiguous() for name, tensor in out.items()}


def _embeddings(hf: dict[str, Tensor], config: TransformerConfig, take: Any, *, where: Path) -> dict[str, Tensor]:
    """The encoder's, decoder's and output's matrices; where config.json ties them, every stored copy must agree."""
    names = {"encoder": "model.encoder.embed_tokens.weight", "decoder": "model.decoder.embed_tokens.weight",
             "output": "lm_head.weight"}
    # (the name of a matrix shared by the group or None, the group's members)
    ties: dict[str, list[tuple[str | None, tuple[str, ...]]]] = {
        "all": [("model.shared.weight", ("encoder", "decoder", "output"))],
        "decoder": [(None, ("encoder",)), (None, ("decoder", "output"))],
        "none": [(None, ("encoder",)), (None, ("decoder",)), (None, ("output",))],
    }
    groups = ties[config.tie_embeddings]
    found: dict[str, Tensor] = {}
    for shared, members in groups:
        stored = [n for n in ([shared] if shared else []) + [names[m] for m in members] if n in hf]
        if not stored:
            raise ConvertError(f"{where}: the weights lack '{names[members[0]]}' (or model.shared.weight)")
        shape = (config.vocab_size, config.d_model)
        matrix = take(stored[0], shape)
        for other in stored[1:]:
            if not torch.equal(take(other, shape), matrix):
                raise ConvertError(f"{where}: '{other}' differs from '{stored[0]}', which config.json ties it to")
        found.update({member: matrix for member in members})
    return found


def _check_positions(hf: dict[str, Tensor], config: TransformerConfig, stack: str, used: set[str], *,
                     where: Path) -> None:
    """Older files store the sinusoid table; it must be the one ours computes (static_position_embeddings)."""
    name = f"model.{stack}.embed_positions.weight"
    if name not in hf:
        return
    used.add(name)
    d = config.d_model
    marian = sinusoidal_table(max_positions=config.max_positions, d_model=d)[:, channel_order(d)]
    stored = hf[name].float()
    if stored.shape != marian.shape or not torch.allclose(stored, marian, atol=1e-4):
        raise ConvertError(f"{where}: '{name}' is not the sinusoid table of a static_position_embeddings model "
                           "(learned positions are not supported)")


# ---- the whole ---------------------------------------------------------------------------------------


def source_files(source: str) -> list[Path]:
    """The files of a local SRC folder that a conversion reads (none for a Hub id: its snapshot is in the cache)."""
    folder = Path(source)
    if not folder.is_dir():
        return []
    patterns = [*METADATA_FILES, *TOKENIZER_FILES, *(pattern for group in WEIGHT_PATTERNS for pattern in group)]
    try:
        return sorted(path for path in folder.iterdir() if any(fnmatch.fnmatchcase(path.name, p) for p in patterns))
    except OSError:  # unreadable: resolve_source and the readers say so
        return []


def convert_huggingface(source: str, output: str | Path, *, src_lang: str | None = None,
                        tgt_lang: str | None = None, force: bool = False) -> Path:
    """Write checkpoint `output` from the Marian model SRC (a folder or a Hub id); ConvertError if it cannot.
    `output` is checked first (seq2seq/textio.py's check_output): a new file, or with `force` an existing one, in a
    folder that exists; never a device, FIFO or link, a folder, or one of SRC's files."""
    try:
        check_output(output, force=force, replaces=True, inputs=[("SRC", path) for path in source_files(source)])
    except OutputRefused as error:
        raise ConvertError(str(error)) from None
    output = Path(output)
    folder = resolve_source(source)
    hf_config = read_json(folder, "config.json", required=True)
    tokenizer = read_tokenizer(folder)
    src, tgt = language_pair(folder, source, src_lang=src_lang, tgt_lang=tgt_lang)
    for field, wanted in (("pad_token_id", tokenizer.pad_id), ("eos_token_id", tokenizer.eos_id),
                          ("decoder_start_token_id", tokenizer.bos_id)):
        if typed(hf_config, field, int, default=wanted, where=folder) != wanted:
            raise ConvertError(f"{folder}: config.json {field}={hf_config[field]} but the tokenizer's is {wanted} "
                               f"({tokenizer.pieces()[wanted]!r}); the files are of different models")
    vocab_size = typed(hf_config, "vocab_size", int, default=None, where=folder) if "vocab_size" in hf_config else None
    if vocab_size != tokenizer.vocab_size:
        raise ConvertError(f"{folder}: config.json vocab_size={json.dumps(vocab_size)} but vocab.json lists "
                           f"{tokenizer.vocab_size} pieces; the files are of different models")
    weights = read_weights(folder)
    bias = weights.get("final_logits_bias")
    config = transformer_config(hf_config, where=folder, pad_id=tokenizer.pad_id,
                                output_bias=bias is not None and bool(bias.any()))
    state = our_weights(weights, config, where=folder)
    state_dict = {f"model.{name}": tensor for name, tensor in state.items()}
    directions = target_directions(tokenizer, src, tgt_lang=tgt_lang, where=folder)
    entry = inference_entry(state_dict=state_dict, config=config, tokenizer=tokenizer.to_bytes(), src_lang=src,
                            tgt_lang="" if directions else tgt, directions=directions)
    try:
        save_atomic({CHECKPOINT_KEY: entry, "state_dict": state_dict}, output, create_folder=False)
    except OSError as error:
        raise ConvertError(f"--output {output}: cannot write it ({error.strerror or error})") from None
    return output
