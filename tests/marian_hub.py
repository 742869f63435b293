"""Offline stand-ins for Hugging Face Marian (OPUS-MT) checkpoints, written by `transformers` itself.

A test helper, not a test module. `write_marian_folder` writes a folder laid out as an OPUS-MT repository
on the Hub is (config.json, generation_config.json, model.safetensors or pytorch_model.bin, source.spm,
target.spm, vocab.json, tokenizer_config.json), with a tiny randomly initialised `MarianMTModel`:

- the two SentencePiece models are trained here, in the test process, on the first lines of Multi30k
  (German for source.spm, English for target.spm), the way OPUS-MT's are: unigram models with
  SentencePiece's own ids (<unk> 0, <s> 1, </s> 2) and default nmt_nfkc normalisation;
- vocab.json is built the way OPUS-MT ships it: "</s>" 0, "<unk>" 1, then the union of both models'
  pieces (source pieces in spm id order, then the target pieces not seen yet), "<pad>" last. Its ids are
  unrelated to the spm ids; vocab_size = len(vocab); pad = decoder start = vocab_size - 1; eos = 0;
- the weights are made non-trivial so that a wrong mapping shows: random final_logits_bias, layer norms
  with random gains and biases, random Linear biases, and weights large enough that the source,
  the positions and every layer change the output.

`hub_cache_layout` then places such a folder in a huggingface_hub cache
(`models--org--name/{blobs,refs/main,snapshots/<commit>}`), so that code resolving a repo id offline
(`snapshot_download(repo_id, cache_dir=..., local_files_only=True)`, `from_pretrained(repo_id,
cache_dir=..., local_files_only=True)`) finds it.

Needs transformers, sentencepiece, safetensors (and huggingface_hub for checking the cache layout), and
the Multi30k text in `../shared/data/multi30k/` (relative to the repository root).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import shutil
from pathlib import Path

MULTI30K = Path(__file__).resolve().parents[2] / "shared/data/multi30k"
"""Multi30k task 1 raw text: train.de.gz, train.en.gz (gzipped, one sentence a line, parallel)."""

TRAIN_LINES = 3000
"""Sentences each SentencePiece model is trained on (the first lines of the training split)."""

SPM_CONTROL = ("<unk>", "<s>", "</s>")
"""SentencePiece's own unk/bos/eos pieces: not copied into vocab.json (it has its own </s> and <unk>)."""


def read_multi30k(lang: str, *, lines: int = TRAIN_LINES, split: str = "train") -> list[str]:
    """The first `lines` sentences of Multi30k's `split` in `lang` (de, en, fr, cs)."""
    path = MULTI30K / f"{split}.{lang}.gz"
    if not path.is_file():
        raise FileNotFoundError(f"Multi30k text not found: {path} (expected at ../shared/data/multi30k/)")
    out: list[str] = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if len(out) >= lines:
                break
            out.append(line.rstrip("\n"))
    return out


def train_spm(sentences: list[str], *, vocab_pieces: int = 300, model_type: str = "unigram") -> bytes:
    """A serialised SentencePiece model trained on `sentences`, in memory; deterministic (one thread,
    input not shuffled), under half a second for 3000 sentences and 300 pieces.

    Like OPUS-MT's: SentencePiece's default ids (<unk> 0, <s> 1, </s> 2, no <pad>), nmt_nfkc
    normalisation, every character covered; `hard_vocab_limit=False` lets a small corpus fall short.
    """
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=buf, vocab_size=vocab_pieces, model_type=model_type,
        character_coverage=1.0, hard_vocab_limit=False, num_threads=1, shuffle_input_sentence=False,
        minloglevel=2,
    )
    return buf.getvalue()


def spm_pieces(model: bytes) -> list[str]:
    """The model's pieces in id order, without its own control and unknown pieces."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())
            if not (sp.is_control(i) or sp.is_unknown(i)) and sp.id_to_piece(i) not in SPM_CONTROL]


def build_vocab(source_model: bytes, target_model: bytes, *, language_codes: tuple[str, ...] = ()) -> dict[str, int]:
    """vocab.json as OPUS-MT ships it: "</s>" 0, "<unk>" 1, a multi-target model's `>>fra<<` tags, the union of
    both models' pieces, "<pad>" last."""
    vocab: dict[str, int] = {"</s>": 0, "<unk>": 1, **{f">>{code}<<": 2 + i for i, code in enumerate(language_codes)}}
    for piece in spm_pieces(source_model) + spm_pieces(target_model):
        vocab.setdefault(piece, len(vocab))
    vocab["<pad>"] = len(vocab)
    return vocab


def _randomize_(model, *, seed: int, final_logits_bias: bool, eos_logit_bias: float) -> None:
    """In place: weights that make every part of the model matter (see the module docstring)."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed + 1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    cfg = model.config
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.copy_(1 + 0.1 * randn(*module.weight.shape))
                module.bias.copy_(0.1 * randn(*module.bias.shape))
            elif isinstance(module, nn.Linear) and module is not model.lm_head:
                fan_in = module.weight.shape[1]
                module.weight.copy_(randn(*module.weight.shape) / math.sqrt(fan_in))
                if module.bias is not None:
                    module.bias.copy_(0.1 * randn(*module.bias.shape))

        def embedding_(emb: nn.Embedding) -> None:
            emb.weight.copy_(0.2 * randn(*emb.weight.shape))
            emb.weight[cfg.pad_token_id].zero_()  # Marian starts decoding from <pad>, whose embedding is 0

        inner = model.model
        if cfg.share_encoder_decoder_embeddings:
            embedding_(inner.shared)
            # transformers 5 ties encoder/decoder embed_tokens to `shared` only when tie_word_embeddings is
            # on; write the shared matrix into all three so that the checkpoint means "shared" either way.
            inner.encoder.embed_tokens.weight.copy_(inner.shared.weight)
            inner.decoder.embed_tokens.weight.copy_(inner.shared.weight)
        else:
            embedding_(inner.encoder.embed_tokens)
            embedding_(inner.decoder.embed_tokens)
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.copy_(0.2 * randn(*model.lm_head.weight.shape))

        bias = model.final_logits_bias  # a buffer (1, V), saved in the checkpoint
        bias.copy_(0.5 * randn(*bias.shape) if final_logits_bias else torch.zeros_like(bias))
        bias[0, cfg.eos_token_id] += eos_logit_bias


def _train_(model, folder: Path, *, source_lang: str, target_lang: str, lines: int, steps: int, seed: int) -> None:
    """In place: `steps` AdamW updates on batches of 32 Multi30k pairs, tokenised by MarianTokenizer."""
    import torch
    from transformers import MarianTokenizer

    tokenizer = MarianTokenizer(
        source_spm=str(folder / "source.spm"), target_spm=str(folder / "target.spm"),
        vocab=str(folder / "vocab.json"), source_lang=source_lang, target_lang=target_lang,
    )
    src, tgt = read_multi30k(source_lang, lines=lines), read_multi30k(target_lang, lines=lines)
    g = torch.Generator().manual_seed(seed + 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.train()
    try:
        for _ in range(steps):
            rows = torch.randint(0, len(src), (32,), generator=g).tolist()
            batch = tokenizer([src[i] for i in rows], text_target=[tgt[i] for i in rows], padding=True,
                              return_tensors="pt")
            batch["labels"][batch["labels"] == tokenizer.pad_token_id] = -100
            loss = model(**batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
        model.eval()


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_marian_folder(
    folder: Path, *, d_model: int = 32, layers: int = 2, heads: int = 4, ffn: int = 64, vocab_pieces: int = 300,
    tie_word_embeddings: bool = True, share_encoder_decoder_embeddings: bool = True, scale_embedding: bool = True,
    activation: str = "swish", seed: int = 0, safetensors: bool = True, final_logits_bias: bool = True,
    max_position_embeddings: int = 128, max_length: int | None = None, num_beams: int = 4,
    renormalize_logits: bool | None = None, eos_logit_bias: float = 0.0, source_lang: str = "de",
    target_lang: str = "en", train_lines: int = TRAIN_LINES, train_steps: int = 0,
    language_codes: tuple[str, ...] = (),
) -> Path:
    """Write an OPUS-MT-like Marian model folder into `folder` (created; files in it overwritten); returns it.

    Files: config.json, generation_config.json, model.safetensors (`safetensors=True`, as transformers 5
    saves) or pytorch_model.bin (`safetensors=False`: torch.save of the full state dict, every tied copy
    and the sinusoidal position tables included, as the 2020 OPUS-MT conversions are), source.spm,
    target.spm, vocab.json, tokenizer_config.json.

    generation_config.json is OPUS-MT's: bad_words_ids [[pad]], bos 0, decoder_start pad, eos 0,
    forced_eos 0, pad, num_beams, max_length (default: max_position_embeddings, as OPUS-MT's 512/512; the
    decoder cannot read more positions); `renormalize_logits` is written only when given.
    `eos_logit_bias` is added to final_logits_bias[eos] (0: none) to make random models end sooner.
    Deterministic in `seed`; source_lang/target_lang pick the Multi30k languages and the tokenizer's.
    `language_codes` (`fra`, `spa`): a multi-target model's, a `>>fra<<` piece each in vocab.json before `<pad>`.
    `train_steps` > 0 trains the random model that many AdamW steps on the same Multi30k lines (one thread,
    ~40 ms a step at the default size): a random model repeats one token forever, a briefly trained one
    writes varied sentences of natural lengths, which is what a test of search agreement needs.
    """
    import torch
    from transformers import GenerationConfig, MarianConfig, MarianMTModel, MarianTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    source_model = train_spm(read_multi30k(source_lang, lines=train_lines), vocab_pieces=vocab_pieces)
    target_model = train_spm(read_multi30k(target_lang, lines=train_lines), vocab_pieces=vocab_pieces)
    (folder / "source.spm").write_bytes(source_model)
    (folder / "target.spm").write_bytes(target_model)
    vocab = build_vocab(source_model, target_model, language_codes=language_codes)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=2), encoding="utf-8")
    vocab_size, pad, eos = len(vocab), len(vocab) - 1, 0

    config = MarianConfig(
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, d_model=d_model,
        encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
        encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, max_position_embeddings=max_position_embeddings,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, activation_function=activation,
        scale_embedding=scale_embedding, pad_token_id=pad, eos_token_id=eos, bos_token_id=0,
        decoder_start_token_id=pad, forced_eos_token_id=eos, tie_word_embeddings=tie_word_embeddings,
        share_encoder_decoder_embeddings=share_encoder_decoder_embeddings,
    )
    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    _randomize_(model, seed=seed, final_logits_bias=final_logits_bias, eos_logit_bias=eos_logit_bias)
    if train_steps:
        _train_(model, folder, source_lang=source_lang, target_lang=target_lang, lines=train_lines,
                steps=train_steps, seed=seed)

    generation = dict(
        bad_words_ids=[[pad]], bos_token_id=0, decoder_start_token_id=pad, eos_token_id=eos,
        forced_eos_token_id=eos, max_length=max_length if max_length is not None else max_position_embeddings,
        num_beams=num_beams, pad_token_id=pad,
    )
    if renormalize_logits is not None:
        generation["renormalize_logits"] = renormalize_logits
    model.generation_config = GenerationConfig(**generation)

    for stale in ("model.safetensors", "pytorch_model.bin"):
        (folder / stale).unlink(missing_ok=True)
    model.save_pretrained(folder)  # config.json, generation_config.json, model.safetensors
    if not safetensors:  # transformers 5 writes safetensors only: write the legacy file as 4.x / 2020 did
        (folder / "model.safetensors").unlink()
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        torch.save(state, folder / "pytorch_model.bin")

    tokenizer = MarianTokenizer(
        source_spm=str(folder / "source.spm"), target_spm=str(folder / "target.spm"),
        vocab=str(folder / "vocab.json"), source_lang=source_lang, target_lang=target_lang,
    )
    tokenizer.save_pretrained(folder)
    return folder


def hub_cache_layout(cache_dir: Path, repo_id: str, folder: Path, *, symlinks: bool = True) -> Path:
    """Place `folder`'s files in a huggingface_hub cache under `cache_dir` as a download of `repo_id`'s
    main branch would, and return the snapshot folder:

        cache_dir/models--{org}--{name}/blobs/{git sha1, or sha256 for .bin/.safetensors/.spm (LFS)}
        cache_dir/models--{org}--{name}/refs/main              (the commit hash, no newline)
        cache_dir/models--{org}--{name}/snapshots/{commit}/... (relative symlinks into blobs/,
                                                                or copies with symlinks=False)

    The commit hash is a sha1 over the files' names and contents (the same folder, the same commit).
    No tree listing is cached, so an offline `snapshot_download` returns the snapshot without checking it.
    """
    folder, cache_dir = Path(folder), Path(cache_dir)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        raise ValueError(f"{folder} has no files")
    commit = hashlib.sha1()
    for path in files:
        rel = path.relative_to(folder).as_posix()
        commit.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    commit_hash = commit.hexdigest()

    storage = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit_hash
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    if snapshot.exists():
        shutil.rmtree(snapshot)
    for path in files:
        data = path.read_bytes()
        lfs = path.suffix in (".bin", ".safetensors", ".spm", ".model", ".h5", ".msgpack", ".onnx")
        blob = storage / "blobs" / (hashlib.sha256(data).hexdigest() if lfs else _git_blob_sha1(data))
        if not blob.exists():
            blob.write_bytes(data)
        target = snapshot / path.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        if symlinks:
            target.symlink_to(os.path.relpath(blob, target.parent))
        else:
            shutil.copyfile(blob, target)
    (storage / "refs" / "main").write_text(commit_hash)
    return snapshot
