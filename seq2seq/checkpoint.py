"""The checkpoint format: what training writes for inference, and the reader that checks it first.

A training checkpoint is Lightning's dict (weights under "state_dict" as "model.*", optimiser and
loop state) plus, under the key "seq2seq", what inference needs as plain types: the model config,
the tokenizer (serialized sentencepiece proto), the language pair, optionally the search options
tuned on validation (`search`: e.g. the length penalty, the translation default), a SHA-256 of
all of them and of the weights, and a second one (`training_sha256`) of everything else in the file:
the weights the optimiser trained (an EMA run's `current_model_state`), the optimiser's moments, the
loop, callback and RNG state that a resume or `average --weights trained` loads. It loads with
`torch.load(weights_only=True)` and needs no other file.

Training writes through `inference_entry` and `save_atomic`; Translator (and resume) read through
`load_checkpoint` and `read_inference`, which trust nothing in the file before checking it:
- the file is a torch archive holding our entry, in a format this version reads;
- the model config is a valid TransformerConfig whose tensors have exactly the stored shapes,
  compared on the meta device (no memory) before anything is allocated, and whose position
  tables (not stored: computed from the config) stay within bounds;
- the tokenizer loads and has one piece per embedding row;
- the checksum matches, so flipped bytes in the weights or the tokenizer are caught, not
  translated into garbage; `check_training_state` does the same for the rest, before a resume.
Every failure is a CheckpointError: one line naming the file and the problem.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from seq2seq.decoding.config import SearchConfig
from seq2seq.model import ConfigError, Transformer, TransformerConfig
from seq2seq.model.transformer import position_table_bytes
from seq2seq.text.tokenizer import TAG, TARGET_TAGS, Tokenizer

CHECKPOINT_KEY = "seq2seq"
CHECKPOINT_FORMAT = 6  # 2 added "sha256", 3 "search", 4 "training_sha256", 5 "directions", 6 "target_tag"; bump on
READABLE_FORMATS = (1, 2, 3, 4, 5, 6)  # any change

# What the entry's "sha256" covers; "training_sha256" covers every other key of the file.
INFERENCE_KEYS = (CHECKPOINT_KEY, "state_dict")  # format 1 has no checksum: read, with a warning that it cannot be verified
# Position tables are computed from max_positions, not stored; a config asking for more than this
# beyond its stored weights is refused (a hostile 30 KB file could otherwise ask for gigabytes).
MAX_UNSTORED_BYTES = 1 << 30


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what is wrong with it."""


class InferenceCheckpoint(NamedTuple):
    config: TransformerConfig
    weights: dict[str, Tensor]  # the Transformer's state dict (keys without the "model." prefix)
    tokenizer: bytes  # serialized sentencepiece proto
    src_lang: str
    tgt_lang: str
    search: SearchConfig  # the translation defaults: the fields tuned on validation over SearchConfig's own
    checksum: str | None = None  # the stored sha256 of all the above, verified (None: format 1 has none)
    # a multilingual model's trained (src, tgt) directions, each target's tag in the tokenizer; () for a bilingual
    # model (src_lang, tgt_lang), whose sources carry no tag
    directions: tuple[tuple[str, str], ...] = ()
    target_tag: str = "encoder"  # where a multilingual model's tag goes: TARGET_TAGS


# ---- writing -----------------------------------------------------------------------------------


def checksum(*, weights: dict[str, Tensor], config: dict[str, Any], tokenizer: bytes, src_lang: str,
             tgt_lang: str, search: dict[str, Any] | None = None, directions: Sequence[Sequence[str]] = (),
             target_tag: str = "encoder") -> str:
    """SHA-256 over everything inference reads: each weight's name, dtype, shape and bytes, and the entry."""
    digest = hashlib.sha256()
    header: dict[str, Any] = {"config": config, "src_lang": src_lang, "tgt_lang": tgt_lang}
    if search:  # absent from files without tuned defaults, whose checksums stay what they were
        header["search"] = search
    if directions:  # (likewise: a bilingual model's checksum is what it was)
        header["directions"] = [list(pair) for pair in directions]
    if target_tag != "encoder":  # (likewise: format 5's checksums stay what they were)
        header["target_tag"] = target_tag
    digest.update(json.dumps(header, sort_keys=True).encode())
    digest.update(hashlib.sha256(tokenizer).digest())
    for name in sorted(weights):
        tensor = weights[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().data)  # a memoryview of its bytes: no copy
    return digest.hexdigest()


def inference_entry(*, state_dict: dict[str, Tensor], config: TransformerConfig, tokenizer: bytes,
                    src_lang: str, tgt_lang: str, search: dict[str, Any] | None = None,
                    directions: Sequence[Sequence[str]] = (), target_tag: str = "encoder") -> dict[str, Any]:
    """What goes under checkpoint["seq2seq"]; `state_dict` is the LightningModule's ("model.*" keys);
    `search`: SearchConfig fields tuned on validation, the translation defaults; `directions`: a multilingual
    model's (src, tgt) pairs, `target_tag` where its tags go (TARGET_TAGS)."""
    config_dict = config.to_dict()
    entry = {
        "format": CHECKPOINT_FORMAT,
        "model_config": config_dict,
        "tokenizer": tokenizer,
        "src_lang": src_lang,
        "tgt_lang": tgt_lang,
        "sha256": checksum(weights=model_weights(state_dict), config=config_dict, tokenizer=tokenizer,
                           src_lang=src_lang, tgt_lang=tgt_lang, search=search, directions=directions,
                           target_tag=target_tag),
    }
    if search:
        entry["search"] = dict(search)
    if directions:
        entry["directions"] = [list(pair) for pair in directions]
    if target_tag != "encoder":
        entry["target_tag"] = target_tag
    return entry


def training_checksum(checkpoint: dict[str, Any]) -> str:
    """SHA-256 over every key of a checkpoint but the inference ones (their own checksum covers them):
    trained weights, optimiser moments, loop, callback and RNG state, in a canonical order."""
    digest = hashlib.sha256()
    for key in sorted(key for key in checkpoint if key not in INFERENCE_KEYS):
        _digest(digest, key)
        _digest(digest, checkpoint[key])
    return digest.hexdigest()


def _digest(digest: Any, value: Any) -> None:
    # Dicts by sorted key, sets by sorted element: their iteration order is not stored in the file.
    if isinstance(value, Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"T|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().data)
    elif isinstance(value, dict):
        digest.update(f"D|{len(value)}|".encode())
        for key in sorted(value, key=repr):
            _digest(digest, key)
            _digest(digest, value[key])
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        digest.update(f"{type(value).__name__}|{len(items)}|".encode())
        for item in items:
            _digest(digest, item)
    else:  # str, int, float (repr is exact), bool, None, bytes, and whatever else weights_only admits
        digest.update(f"{type(value).__name__}|{value!r}|".encode())


def seal_training_state(checkpoint: dict[str, Any]) -> None:
    """Store the training checksum in the entry; call it last, when nothing else will change the dict."""
    checkpoint[CHECKPOINT_KEY]["training_sha256"] = training_checksum(checkpoint)


def store_search_defaults(path: str | Path, search: dict[str, Any]) -> None:
    """Write `search` (SearchConfig fields, e.g. a tuned length_penalty) into checkpoint `path` as the
    translation default, re-checksummed, atomically."""
    SearchConfig.from_dict(search)  # a ConfigError now rather than a damaged file later
    checkpoint = load_checkpoint(path)
    loaded = read_inference(path, checkpoint)  # a damaged file must not come out with a valid checksum
    check_training_state(path, checkpoint)
    checkpoint[CHECKPOINT_KEY] = inference_entry(
        state_dict=checkpoint["state_dict"], config=loaded.config, tokenizer=loaded.tokenizer,
        src_lang=loaded.src_lang, tgt_lang=loaded.tgt_lang, search=search, directions=loaded.directions,
        target_tag=loaded.target_tag,
    )
    seal_training_state(checkpoint)
    save_atomic(checkpoint, path)


def save_atomic(checkpoint: dict[str, Any], path: str | Path, *, create_folder: bool = True) -> None:
    """torch.save to a temporary file beside `path`, fsync, rename over it: a crash leaves the old file or the new.

    Beside, not in TMPDIR: a rename is atomic only within one filesystem (a copy from /tmp is not,
    and a kill during it leaves a truncated file). Errors are raised, never swallowed. `create_folder`: make
    `path`'s missing folders first, as training's checkpoint writes need (Lightning names folders it has not
    made, as `lightning_logs/version_N/checkpoints`); the faces pass False (their output was checked by
    cli.check_output, which creates no folder), and a folder gone meanwhile is an error.
    """
    path = Path(path)
    if create_folder:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)  # mkstemp makes 0600: give the mode any new file would have
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)


def remove_partial_writes(folder: str | Path) -> list[Path]:
    """Delete what save_atomic left in `folder` when killed mid-write (its `.NAME.ckpt.*.partial` files, each
    as large as a checkpoint), and say which. Call it before a run writes there, not during one."""
    removed = []
    for partial in sorted(Path(folder).glob(".*.ckpt.*.partial")):
        if partial.is_file() and not partial.is_symlink():
            partial.unlink(missing_ok=True)
            removed.append(partial)
    return removed


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it: done once, at import, not beside other threads
    os.umask(mask)
    return mask


_UMASK = _read_umask()


# ---- reading -----------------------------------------------------------------------------------


def model_weights(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """The Transformer's weights out of the LightningModule's state dict (keys 'model.*')."""
    return {key.removeprefix("model."): value for key, value in state_dict.items() if key.startswith("model.")}


def load_checkpoint(path: str | Path, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a training checkpoint with weights_only=True; CheckpointError if it is not a readable one of ours."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a folder; give a .ckpt file in it (best.ckpt or last.ckpt)")
    if not path.exists():  # also a dangling link or a loop of links
        raise CheckpointError(f"checkpoint {path} does not exist; training writes them under checkpoints/<run>/")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} is not a regular file (a device or a pipe); give a .ckpt file")
    not_ours = f"{path} is not a seq2seq training checkpoint; use a .ckpt written by `python -m seq2seq.fit`"
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes): a save was interrupted; use another checkpoint")
    try:
        # mmap: the tensors are read when used, so a huge file costs no memory before it is checked.
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        # weights_only refuses to build arbitrary Python objects (it would run the file's code);
        # ours hold tensors and plain types only, so a refusal means the file is someone else's.
        raise CheckpointError(f"{not_ours} (it stores Python objects that torch.load(weights_only=True) "
                              "refuses to load)") from error
    except Exception as error:  # noqa: BLE001 - torch.load raises anything on bytes it did not write
        # A text file, a truncated zip, flipped bytes in the archive's index: IndexError, EOFError,
        # RuntimeError, KeyError... all mean the same to the user.
        raise CheckpointError(f"{path} cannot be read as a checkpoint (torch.load: {type(error).__name__}): "
                              "damaged, e.g. a copy cut short, or not written by torch.save") from error
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(CHECKPOINT_KEY), dict) or (
        not isinstance(checkpoint.get("state_dict"), dict)
    ):
        raise CheckpointError(f"{not_ours} (no '{CHECKPOINT_KEY}' entry)")
    version = checkpoint[CHECKPOINT_KEY].get("format")
    if version not in READABLE_FORMATS:
        raise CheckpointError(f"{path} has checkpoint format {version!r}; this version of seq2seq reads "
                              f"formats {', '.join(map(str, READABLE_FORMATS))}")
    return checkpoint


def read_inference(path: str | Path, checkpoint: dict[str, Any]) -> InferenceCheckpoint:
    """What inference needs from a loaded checkpoint, each part checked (see the module docstring)."""
    entry = checkpoint[CHECKPOINT_KEY]
    expected = {"model_config": dict, "tokenizer": bytes, "src_lang": str, "tgt_lang": str}
    if entry.get("format") != 1:
        expected["sha256"] = str
    for key, kind in expected.items():
        if not isinstance(entry.get(key), kind):
            problem = "is missing" if key not in entry else f"is a {type(entry[key]).__name__}, not a {kind.__name__}"
            raise CheckpointError(f"{path}: its '{CHECKPOINT_KEY}' entry is damaged: '{key}' {problem}")
    try:
        config = TransformerConfig.from_dict(entry["model_config"])
    except (ValueError, TypeError, ArithmeticError) as error:
        raise CheckpointError(f"{path}: its model_config is invalid: {error}") from error
    weights = model_weights(checkpoint["state_dict"])
    not_tensor = next((name for name, value in weights.items() if not isinstance(value, Tensor)), None)
    if not_tensor is not None:
        raise CheckpointError(f"{path}: its weight '{not_tensor}' is not a tensor; the file is damaged")
    _check_layer_counts(path, config, weights)
    _check_shapes(path, config, weights)
    directions = _directions(path, entry.get("directions", []))
    target_tag = entry.get("target_tag", "encoder")
    if target_tag not in TARGET_TAGS or (target_tag != "encoder" and not directions):
        raise CheckpointError(f"{path}: its '{CHECKPOINT_KEY}' entry is damaged: 'target_tag' is {target_tag!r}, "
                              f"not one of {', '.join(TARGET_TAGS)} for a multilingual model")
    stored_search = entry.get("search", {})
    try:
        if not isinstance(stored_search, dict):
            raise ConfigError("search", f"is a {type(stored_search).__name__}, not a dict")
        search = SearchConfig.from_dict(stored_search)
    except ConfigError as error:
        raise CheckpointError(f"{path}: its stored search defaults are invalid ({error})") from None
    if "sha256" not in expected:
        warnings.warn(f"{path}: checkpoint format 1 has no checksum, so damage cannot be detected; "
                      "re-save it with this version to add one", stacklevel=2)
    else:
        stored = entry["sha256"]
        actual = checksum(weights=weights, config=entry["model_config"], tokenizer=entry["tokenizer"],
                          src_lang=entry["src_lang"], tgt_lang=entry["tgt_lang"], search=entry.get("search"),
                          directions=directions, target_tag=target_tag)
        if actual != stored:
            raise CheckpointError(f"{path} is damaged: its weights or tokenizer do not match the checksum stored "
                                  "when it was written; copy it again or use another checkpoint")
    _check_tokenizer(path, config, entry["tokenizer"], targets=[tgt for _, tgt in directions])
    bad = next((name for name, t in weights.items() if t.is_floating_point() and not t.isfinite().all()), None)
    if bad is not None:  # a run that diverged: it would translate every sentence into nothing
        raise CheckpointError(f"{path}: its weight '{bad}' holds NaN or infinite values (the training run "
                              "diverged); use an earlier checkpoint")
    return InferenceCheckpoint(config, weights, entry["tokenizer"], entry["src_lang"], entry["tgt_lang"], search,
                               entry.get("sha256"), directions, target_tag)


def _directions(path: str | Path, stored: Any) -> tuple[tuple[str, str], ...]:
    """A multilingual entry's directions, checked: a list of [src, tgt] language codes, each once."""
    ok = isinstance(stored, list) and all(
        isinstance(pair, list) and len(pair) == 2 and all(isinstance(lang, str) and TAG.fullmatch(f">>{lang}<<")
                                                          for lang in pair) for pair in stored)
    if not ok or len({tuple(pair) for pair in stored}) != len(stored):
        raise CheckpointError(f"{path}: its '{CHECKPOINT_KEY}' entry is damaged: 'directions' is not a list of "
                              "distinct [source, target] language codes")
    return tuple((src, tgt) for src, tgt in stored)


def inference_model(loaded: InferenceCheckpoint) -> Transformer:
    """The checkpoint's model with its weights (read_inference checked their names and shapes against the config),
    built without the random initialisation they replace (_ShapesOnly): part of every translating process's start."""
    with _ShapesOnly():
        model = Transformer(loaded.config)
    model.load_state_dict(loaded.weights)  # (every parameter and stored buffer: strict)
    return model


def check_training_state(path: str | Path, checkpoint: dict[str, Any]) -> None:
    """CheckpointError unless what a resume or `average --weights trained` loads beside the inference
    weights (see training_checksum) is what was written."""
    entry = checkpoint[CHECKPOINT_KEY]
    stored = entry.get("training_sha256")
    if stored is None and entry.get("format", 0) < 4:
        if any(key not in INFERENCE_KEYS for key in checkpoint):
            warnings.warn(f"{path}: checkpoint format {entry.get('format')} has no checksum of its training state "
                          "(trained weights, optimiser), so damage there cannot be detected", stacklevel=2)
        return
    if stored is None and all(key in INFERENCE_KEYS for key in checkpoint):
        return  # an averaged checkpoint: nothing but the inference weights
    if not isinstance(stored, str) or training_checksum(checkpoint) != stored:
        raise CheckpointError(f"{path} is damaged: its training state (the trained weights, the optimiser's moments, "
                              "the loop's position) does not match the checksum stored when it was written; "
                              "use another checkpoint")


def _check_tokenizer(path: str | Path, config: TransformerConfig, proto: bytes, *, targets: list[str]) -> None:
    """The tokenizer must load and give one id per embedding row: a mismatched one would index past the
    embeddings (an IndexError deep in decoding) or read every id as another piece; and hold a tag for each of
    a multilingual model's `targets`."""
    try:
        tokenizer = Tokenizer.from_bytes(proto)
    except ValueError as error:
        raise CheckpointError(f"{path}: its stored tokenizer cannot be loaded ({error})") from None
    pieces = tokenizer.vocab_size
    untagged = sorted(set(targets) - set(tokenizer.languages))
    if untagged:
        raise CheckpointError(f"{path}: its directions translate into {', '.join(untagged)}, which its tokenizer has "
                              "no tag for; the file is damaged")
    if pieces != config.vocab_size:
        raise CheckpointError(f"{path}: its tokenizer has {pieces} pieces but its model has {config.vocab_size} "
                              "embedding rows (vocab_size); they come from different runs: use a checkpoint "
                              "written by training")


def _check_layer_counts(path: str | Path, config: TransformerConfig, weights: dict[str, Tensor]) -> None:
    """Before even the meta skeleton: a config asking for a million layers would take an hour to build."""
    for stack, wanted in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
        prefix = f"{stack}.layers."
        stored = {name[len(prefix):].split(".")[0] for name in weights if name.startswith(prefix)}
        if stored != {str(i) for i in range(wanted)}:
            raise CheckpointError(f"{path}: its model_config does not match its weights: num_{stack}_layers is "
                                  f"{wanted} but the file holds {len(stored)} {stack} layers")


class _ShapesOnly(TorchFunctionMode):
    """Inside, torch.nn.init's functions leave their tensor as it is: a skeleton built for its shapes needs no
    values. (It is built on the CPU, its parameters allocated and never written: on the meta device, torch's meta
    kernels import torch._dynamo at their first call, the largest part of a translating process's start-up where
    nothing compiles: docs/results/decoding-vs-ctranslate2.md#whole-command.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if getattr(func, "__module__", None) == "torch.nn.init" and name.endswith("_") and not name.startswith("_"):
            return args[0] if args else (kwargs or {})["tensor"]  # (normal_, xavier_uniform_, zeros_, ...: in place)
        return func(*args, **(kwargs or {}))


def _check_shapes(path: str | Path, config: TransformerConfig, weights: dict[str, Tensor]) -> None:
    """The config's tensors, built without values (_ShapesOnly) once its position tables are known to be small,
    must be exactly the stored ones."""
    unstored = position_table_bytes(config)
    if unstored > MAX_UNSTORED_BYTES:
        raise CheckpointError(f"{path}: its model_config asks for {unstored / 2**30:.1f} GiB of position tables "
                              f"(max_positions={config.max_positions}); refusing to build it")
    try:
        with torch.device("cpu"), _ShapesOnly():
            skeleton = Transformer(config)
    except (RuntimeError, MemoryError):  # a config too large to allocate even unwritten: its shapes on the meta device
        with torch.device("meta"):
            skeleton = Transformer(config)
    wanted = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    missing = sorted(set(wanted) - set(weights))
    unexpected = sorted(set(weights) - set(wanted))
    if missing or unexpected:
        what = (f"the config describes a weight '{missing[0]}' that the file lacks" if missing
                else f"the file has a weight '{unexpected[0]}' that the config does not describe")
        raise CheckpointError(f"{path}: its model_config does not match its weights: {what} "
                              f"({len(missing)} missing, {len(unexpected)} extra)")
    for name, shape in wanted.items():
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(f"{path}: its model_config does not match its weights: '{name}' is stored as "
                                  f"{tuple(weights[name].shape)} but the config makes it {shape}")
