"""TranslationModule: the Transformer trained with label smoothing, Adam and inverse-sqrt warm-up.

Its typed keyword arguments are the `model:` section of a LightningCLI config. `vocab_size` is not
written in configs: fit.py links it from the data module's tokenizer.

Validation computes the loss and perplexity on teacher-forced batches and decodes the validation
set (greedy, or beam search with `val_beam_size > 1`), then scores the detokenised output with
sacreBLEU and chrF against the raw references. Under DDP each rank decodes its share; the
hypotheses are gathered, deduplicated by sentence index (the data module pads ranks to equal batch
counts with repeated batches) and scored once over the whole set. torchmetrics' SacreBLEUScore would
sync n-gram counts instead, counting those repeated sentences twice, and gives no signature.

Every checkpoint carries what inference needs under the key "seq2seq" (model config, tokenizer
proto bytes, language pair), as plain types: it loads with `torch.load(..., weights_only=True)`.
"""

import math
import time
from typing import Any

import lightning as L
import sacrebleu
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from seq2seq.loss import label_smoothed_nll, training_loss
from seq2seq.model import Transformer, TransformerConfig
from seq2seq.search import beam_search, greedy
from seq2seq.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from seq2seq.translator import CHECKPOINT_FORMAT, CHECKPOINT_KEY  # the reader owns the format

# (sentence index, hypothesis, reference, summed smoothed loss, summed NLL, target tokens)
ValidationRow = tuple[int, str, str, float, float, int]


def inverse_sqrt_schedule(step: int, *, warmup_steps: int) -> float:
    """The paper's / fairseq's multiplier: linear warm-up to 1 at `warmup_steps`, then sqrt(warmup/step)."""
    step = step + 1  # LambdaLR counts from 0; the first update already uses a non-zero rate
    if step < warmup_steps:
        return step / warmup_steps
    return math.sqrt(warmup_steps / step)


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU has bf16 matmul instructions (AMX or AVX512-BF16) that torch can use."""
    names = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # private torch API, hence getattr
    checks = [getattr(torch.cpu, name) for name in names if hasattr(torch.cpu, name)]
    return not checks or any(check() for check in checks)  # unknown: assume yes rather than warn wrongly


class TranslationModule(L.LightningModule):
    def __init__(
        self,
        *,
        vocab_size: int,
        d_model: int = 512,
        num_heads: int = 8,
        d_ff: int = 2048,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation_dropout: float = 0.0,
        max_positions: int = 1024,
        positions: str = "sinusoidal",
        norm: str = "layernorm",
        norm_placement: str = "post",
        activation: str = "relu",
        tie_embeddings: str = "all",
        label_smoothing: float = 0.1,
        lr: float = 5e-4,
        warmup_steps: int = 4000,
        weight_decay: float = 0.0,
        adam_betas: tuple[float, float] = (0.9, 0.98),
        adam_eps: float = 1e-9,
        val_beam_size: int = 1,
        val_length_penalty: float = 0.6,
        val_max_len_a: float = 1.5,
        val_max_len_b: int = 10,
    ):
        """Model fields are TransformerConfig's (see seq2seq/model/config.py for each one's meaning).

        Args:
            label_smoothing: mass spread uniformly over the vocabulary (0.1 in the paper).
            lr: peak learning rate, reached after `warmup_steps` updates, then decaying as 1/sqrt(step).
            weight_decay: decoupled (AdamW); 0 gives the paper's Adam.
            val_beam_size: 1 decodes the validation set greedily; more uses beam search.
            val_max_len_a, val_max_len_b: validation output length limit a * src_len + b.
        """
        super().__init__()
        self.save_hyperparameters()
        self.config = TransformerConfig(
            vocab_size=vocab_size,
            d_model=d_model,
            num_heads=num_heads,
            d_ff=d_ff,
            num_encoder_layers=num_encoder_layers,
            num_decoder_layers=num_decoder_layers,
            dropout=dropout,
            attention_dropout=attention_dropout,
            activation_dropout=activation_dropout,
            max_positions=max_positions,
            pad_id=PAD_ID,
            positions=positions,
            norm=norm,
            norm_placement=norm_placement,
            activation=activation,
            tie_embeddings=tie_embeddings,
        )
        self.model = Transformer(self.config)
        self.tokenizer: Tokenizer | None = None  # taken from the data module in setup()
        self._validation_outputs: list[ValidationRow] = []
        self._step_started = 0.0

    # ---- wiring -------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        # Tiny Adam second moments and softmax tails underflow into denormal floats, which x86 CPUs
        # process ~100x slower: measured here, the AdamW step went from 8 s to 0.6 s. Training loses
        # nothing by flushing them to zero.
        torch.set_flush_denormal(True)
        on_cpu = self.trainer.strategy.root_device.type == "cpu"
        if on_cpu and "bf16" in str(self.trainer.precision) and not cpu_has_bf16_matmul():
            rank_zero_warn(
                f"trainer.precision={self.trainer.precision} on a CPU without bf16 matmul units (no AMX, no "
                "AVX512-BF16): torch's bf16 matmuls run 8-100x slower than fp32 there, and a training step ~40x "
                "slower (bench/train_throughput.py). Use --trainer.precision=32-true on this machine."
            )
        datamodule = self.trainer.datamodule
        self.tokenizer = datamodule.tokenizer
        if self.tokenizer.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} pieces but the model was built for "
                f"{self.config.vocab_size}; delete the stale tokenizer or the checkpoint you resume from"
            )
        self.src_lang, self.tgt_lang = datamodule.src_lang, datamodule.tgt_lang

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = {
            "format": CHECKPOINT_FORMAT,
            "model_config": self.config.to_dict(),
            "tokenizer": self.tokenizer.to_bytes(),
            "src_lang": self.src_lang,
            "tgt_lang": self.tgt_lang,
        }

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=hp.lr, betas=tuple(hp.adam_betas), eps=hp.adam_eps, weight_decay=hp.weight_decay,
            # One fused kernel per tensor instead of ~10 passes: 4x faster steps on CPU, also faster on GPU.
            fused=self.device.type in ("cpu", "cuda"),
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, InverseSqrt(hp.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ---- training -----------------------------------------------------------------------------

    def token_losses(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
        """Per-token (label-smoothed loss, NLL), (B, T), zero at padding; and the non-pad mask (B, T)."""
        logits = self.model(batch["src"], batch["tgt_in"])  # (B, T, V)
        tgt_out = batch["tgt_out"]
        loss, nll = label_smoothed_nll(logits, tgt_out, smoothing=self.hparams.label_smoothing, pad_id=PAD_ID)
        return loss, nll, tgt_out != PAD_ID

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_started = time.perf_counter()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, nll, tokens = training_loss(
            self.model, src=batch["src"], tgt_in=batch["tgt_in"], tgt_out=batch["tgt_out"],
            smoothing=self.hparams.label_smoothing,
        )
        self._step_tokens = int(tokens)
        batch_size = batch["src"].size(0)
        loss, nll = loss / tokens, nll / tokens  # normalised per target token
        self.log("train_loss", loss, prog_bar=True, batch_size=batch_size)
        self.log("train_nll", nll, batch_size=batch_size)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        elapsed = time.perf_counter() - self._step_started
        # Per process, data loading excluded: multiply by the number of processes for the whole job.
        self.log("tgt_tokens_per_sec", self._step_tokens / max(elapsed, 1e-9), prog_bar=True, batch_size=1)

    # ---- validation ---------------------------------------------------------------------------

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        loss, nll, is_real = self.token_losses(batch)
        hypotheses = self.translate_batch(batch["src"])
        indices = batch["index"].tolist() if isinstance(batch["index"], Tensor) else list(batch["index"])
        rows = zip(
            indices, hypotheses, batch["ref_text"], loss.sum(1).tolist(), nll.sum(1).tolist(),
            is_real.sum(1).tolist(), strict=True,
        )
        self._validation_outputs.extend(rows)

    def translate_batch(self, src: Tensor) -> list[str]:
        hp = self.hparams
        if hp.val_beam_size > 1:
            nbest = beam_search(
                self.model, src, bos=BOS_ID, eos=EOS_ID, pad=PAD_ID, beam_size=hp.val_beam_size,
                length_penalty=hp.val_length_penalty, max_len_a=hp.val_max_len_a, max_len_b=hp.val_max_len_b,
            )
            tokens = [hyps[0].tokens for hyps in nbest]
        else:
            hyps = greedy(
                self.model, src, bos=BOS_ID, eos=EOS_ID, pad=PAD_ID, max_len_a=hp.val_max_len_a,
                max_len_b=hp.val_max_len_b,
            )
            tokens = [hyp.tokens for hyp in hyps]
        return self.tokenizer.decode(tokens)

    def on_validation_epoch_end(self) -> None:
        outputs, self._validation_outputs = self._validation_outputs, []
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[list[ValidationRow]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, outputs)
            outputs = [row for part in gathered for row in part]
        by_index = {row[0]: row for row in outputs}  # drops the repeats that pad ranks to equal batches
        rows = [by_index[i] for i in sorted(by_index)]
        if not rows:
            return
        _, hypotheses, references, losses, nlls, lengths = zip(*rows, strict=True)
        tokens = sum(lengths)
        bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
        bleu_score = bleu.corpus_score(list(hypotheses), [list(references)])
        chrf_score = chrf.corpus_score(list(hypotheses), [list(references)])
        # Every rank computed the same numbers from the same gathered rows; sync_dist averages equal values
        # (a few scalars per validation) and keeps Lightning from warning about unsynced epoch metrics.
        metrics = {
            "val_loss": sum(losses) / tokens,
            "val_nll": sum(nlls) / tokens,
            "val_ppl": math.exp(min(sum(nlls) / tokens, 50.0)),
            "val_bleu": bleu_score.score,
            "val_chrf": chrf_score.score,
            "val_sentences": float(len(rows)),
        }
        for name, value in metrics.items():
            self.log(name, value, prog_bar=name == "val_bleu", sync_dist=True)
        signature = str(bleu.get_signature())
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            self.print(
                f"epoch {self.current_epoch} step {self.global_step}: val BLEU {bleu_score.score:.2f} "
                f"chrF {chrf_score.score:.2f} ppl {metrics['val_ppl']:.2f} "
                f"on {len(rows)} sentences  [{signature}]"
            )
            self.print(f"  e.g. {hypotheses[0]!r}\n   ref {references[0]!r}")


class InverseSqrt:
    """LambdaLR multiplier as an object (not a lambda), so the scheduler's state_dict stays plain data."""

    def __init__(self, warmup_steps: int):
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        return inverse_sqrt_schedule(step, warmup_steps=self.warmup_steps)
